"""Recipe syntax: size-capped file reading, safe YAML parsing (with line numbers, refusing duplicate keys and
aliases that expand too far), `--set key.path=value` overrides, and pydantic errors turned into
`key.path[i]: message` lines that list the known keys."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from decodekit.api.components import dotted_path, format_validation_error
from decodekit.api.errors import RecipeError

MAX_ALIAS_NODES = 100_000
"""How many nodes all the aliases (`*name`) of one YAML document may stand for, counted as if expanded.

PyYAML builds an alias as a shared reference, so loading is cheap, but everything after it (validation, copies,
dumps) walks the expanded tree: nine nested lists of nine aliases (a "billion laughs") are 9**9 nodes. Modest
anchors stay far below this; the file-size caps bound the nodes written out literally."""


class AliasBudgetError(yaml.composer.ComposerError):
    """Aliases that expand past `MAX_ALIAS_NODES` or into themselves (a `yaml.YAMLError`, so `parse_value` keeps
    such a `--set` value as text)."""


class _StrictLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` (no Python objects) that refuses duplicate keys, which PyYAML silently overwrites, and
    aliases that expand too far (see `MAX_ALIAS_NODES`)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._sizes: dict[yaml.Node, int] = {}  # each composed node's size with its aliases expanded
        self._alias_nodes = 0  # the expanded sizes of every alias met so far, added up

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        """Compose as PyYAML does, counting sizes bottom-up (each node once, so a bomb costs no more to measure
        than to parse) and charging each alias its target's expanded size."""
        alias = self.peek_event() if self.check_event(yaml.AliasEvent) else None
        node: yaml.Node = super().compose_node(parent, index)
        size = self._sizes.get(node)
        if alias is None:
            children = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                        else node.value if isinstance(node, yaml.SequenceNode) else [])
            self._sizes[node] = 1 + sum(self._sizes[child] for child in children)
        elif size is None:  # the anchored node is still being composed: it would contain itself forever
            raise AliasBudgetError(None, None, f"alias *{alias.anchor} is used inside its own anchor (a cycle)",
                                   alias.start_mark)
        else:
            self._alias_nodes += size
            if self._alias_nodes > MAX_ALIAS_NODES:
                raise AliasBudgetError(None, None, f"aliases (*name) expand to more than {MAX_ALIAS_NODES} nodes "
                                       f"(reached at alias *{alias.anchor})", alias.start_mark,
                                       "write the values out instead")
        return node


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: flatten_mapping merges it, own keys win
            continue
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
            seen.add(key)
        except TypeError:  # an unhashable key; construct_mapping reports it with its position
            continue
        if duplicate:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
    loader.flatten_mapping(node)
    return dict(loader.construct_pairs(node, deep=deep))


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_text_capped(path: Path, cap: int, what: str) -> str:
    """Read a UTF-8 file of at most `cap` bytes; anything else is a `RecipeError` naming the file.

    Reads `cap + 1` bytes at most instead of trusting `stat`: `/dev/zero`, a pipe or a growing file report a size
    of 0 and would otherwise be read until memory runs out.
    """
    try:
        with path.open("rb") as f:
            data = f.read(cap + 1)
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read the {what}: {exc}") from None
    if len(data) > cap:
        raise RecipeError(f"{path}: the {what} is larger than {_bytes(cap)}, the limit for a {what} file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{path}: the {what} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                          f"{exc.start})") from None


def _bytes(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n} bytes"


def parse_yaml(text: str, label: str) -> Any:
    """Parse YAML safely; a syntax error becomes a `RecipeError` with its line and column."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: no Python objects
    except AliasBudgetError as exc:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise RecipeError(f"{label}: {exc.problem}{where}" + (f"; {exc.note}" if exc.note else "")) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = " ".join(p for p in (exc.context, exc.problem) if p)
        raise RecipeError(f"{label}: YAML syntax error{where}: {what}") from None
    except (yaml.YAMLError, RecursionError) as exc:
        raise RecipeError(f"{label}: YAML syntax error: {exc}") from None


# ---- --set overrides --------------------------------------------------------------------------------------------
def parse_value(raw: str) -> Any:
    """A `--set` value: a YAML scalar or flow collection (`0.5`, `true`, `[a, b]`, `{k: 1}`), else the raw text.

    Text that only parses as a mapping or list by accident (`Answer: briefly`) stays text.
    """
    try:
        value = yaml.load(raw, Loader=_StrictLoader)
    except yaml.YAMLError:
        return raw
    if isinstance(value, (dict, list)) and not raw.lstrip().startswith(("{", "[")):
        return raw
    return value


def apply_override(data: dict[str, Any], item: str) -> dict[str, Any]:
    """Apply one `key.path=value` override to a raw recipe mapping (a copy is returned).

    Digits in the path index lists (`processors.0.top_p.top_p=0.5`); missing mappings are created; an index one
    past the end appends; a component given by name only (`- top_p`) is expanded when the path goes into it.
    """
    key, sep, raw = item.partition("=")
    path: list[str | int] = [int(p) if p.isascii() and p.isdigit() else p for p in key.strip().split(".")]
    if not sep or any(p == "" for p in path):
        raise RecipeError(f"--set {item!r}: expected key.path=value, e.g. sampling.temperature=0")
    root = _copy(data)
    value = parse_value(raw)
    node: Any = root
    for depth, step in enumerate(path):
        where = f"--set {key.strip()}: {dotted_path(path[:depth]) or 'the recipe'}"
        here = f"--set {key.strip()}: {dotted_path(path[: depth + 1])}"
        last = depth == len(path) - 1
        if isinstance(node, list):
            if not isinstance(step, int) or step > len(node):
                raise RecipeError(f"{where} is a list of {len(node)}; give an index from 0 to {len(node)}")
            if step == len(node):
                node.append(value if last else {})
            slot: Any = step
        elif isinstance(node, dict):
            slot = str(step)
            if not last and node.get(slot) is None:
                node[slot] = [] if isinstance(path[depth + 1], int) else {}
        else:  # only the root can get here, and it is always a mapping
            raise RecipeError(f"{where} is {node!r}, not a mapping or a list")
        if last:
            node[slot] = value
            break
        child = node[slot]
        if isinstance(child, str) and path[depth + 1] == child:  # `- top_p` or `strategy: sample`, by name only
            child = node[slot] = {child: {}}
        elif not isinstance(child, (dict, list)):
            raise RecipeError(f"{here} is {child!r}, not a mapping or a list")
        node = child
    return root


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


# ---- error messages ---------------------------------------------------------------------------------------------
def format_validation_errors(exc: ValidationError, root: type[BaseModel] | Any | None, label: str = "",
                             prefix: Sequence[Any] = ()) -> str:
    """One line per pydantic error: `label: key.path[i]: message, got value`; an unknown key lists the known ones
    (with a close match when there is one). `prefix` is where the validated value sits in the recipe; `root` is
    the model (or type, `list[ComponentSpec]`) it was validated against (None: no list of known keys)."""
    return format_validation_error(dotted_path(prefix), exc, root, label=label, sep="\n")
