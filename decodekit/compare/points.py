"""What `decodekit compare` runs: every recipe at every point of its sweep (`Point`), each validated before anything
runs.

`--sweep key=v1,v2,...` sweeps a recipe key (a `--set` path: `sampling.temperature`, `processors.0.min_p.min_p`)
over values for every recipe; `--sweep NAME:key=v1,v2` only for the recipe named NAME (its file's stem, or its
position from 1), so recipes with different knobs still get the same number of points. Several sweeps of one
recipe combine as a grid. A key that is not a key of the recipe fails before anything runs, naming the sweep.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from decodekit.api.errors import ConfigError, DecodeKitError
from decodekit.recipe import MAX_RECIPE_BYTES, Recipe, load_recipe
from decodekit.recipe_syntax import parse_value, parse_yaml, read_text_capped


@dataclass(frozen=True)
class Sweep:
    """One `--sweep`: the recipe it is for (None: every recipe), the key path and the values (as `--set` parses
    them)."""

    key: str
    values: tuple[Any, ...]
    recipe: str | None = None
    raw: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        """The sweep as written, for messages."""
        scope = f"{self.recipe}:" if self.recipe is not None else ""
        return f"--sweep {scope}{self.key}={','.join(self.raw)}"


def parse_sweep(text: str) -> Sweep:
    """`[RECIPE:]key=v1,v2,...` -> `Sweep`. Commas inside brackets or braces (`[1, 2]`) do not split values.

    Raises:
        ConfigError: no `=`, an empty key, no value or an empty one (the message quotes the sweep).
    """
    head, sep, tail = text.partition("=")
    scope, colon, key = head.rpartition(":")
    key = key.strip()
    if not sep or not key or " " in key:
        raise ConfigError(f"--sweep {text!r}: expected key=v1,v2,... (or RECIPE:key=v1,v2), e.g. "
                          "sampling.temperature=0.7,1.0")
    raw = _split_values(tail)
    if not raw or any(not v.strip() for v in raw):
        raise ConfigError(f"--sweep {text!r}: give the values separated by commas, none empty")
    return Sweep(key, tuple(parse_value(v.strip()) for v in raw), scope.strip() if colon else None,
                 tuple(v.strip() for v in raw))


def _split_values(text: str) -> list[str]:
    values, depth, current = [], 0, ""
    for char in text:
        depth += char in "[{"
        depth -= char in "]}"
        if char == "," and depth == 0:
            values.append(current)
            current = ""
        else:
            current += char
    return [*values, current] if text else []


@dataclass
class Point:
    """One recipe at one point of its sweep: a label for the table, the recipe's name, the swept values and the
    recipe with them applied."""

    label: str
    recipe_name: str
    source: Path
    settings: dict[str, Any]
    recipe: Recipe
    overrides: list[str] = field(default_factory=list)


def recipe_names(paths: Sequence[Path]) -> list[str]:
    """Each recipe's name in the report: its file's stem, numbered when two share one (`a`, `a#2`)."""
    names: list[str] = []
    for path in paths:
        name = path.stem
        names.append(name if name not in names else f"{name}#{sum(n.split('#')[0] == name for n in names) + 1}")
    return names


def plan_points(paths: Sequence[Path], sweeps: Sequence[Sweep], overrides: Sequence[str], registry: Any) -> list[Point]:
    """Every recipe at every point of its sweeps, each loaded and validated against `registry`.

    Raises:
        ConfigError: a sweep names no recipe of the run, or sets a key the recipe does not have or a value it
            refuses (the message names the sweep); a recipe is invalid (`RecipeError`, naming the file and key).
    """
    if not paths:
        raise ConfigError("give at least one recipe to compare")
    names = recipe_names(paths)
    for sweep in sweeps:
        if sweep.recipe is not None and sweep.recipe not in names and not _position(sweep.recipe, len(names)):
            raise ConfigError(f"{sweep.flag}: no recipe {sweep.recipe!r} in this run; its recipes are "
                              f"{', '.join(names)} (or 1 to {len(names)})")
    points: list[Point] = []
    for index, (path, name) in enumerate(zip(paths, names), start=1):
        own = [s for s in sweeps if s.recipe is None or s.recipe == name or _position(s.recipe, len(names)) == index]
        load_recipe(path, list(overrides), registry=registry)  # the recipe alone first: its own errors say so
        data = parse_yaml(read_text_capped(path, MAX_RECIPE_BYTES, "recipe"), str(path))
        for sweep in own:
            _check_no_new_entry(data, sweep, name)
        for values in itertools.product(*(s.values for s in own)) if own else [()]:
            settings = {s.key: v for s, v in zip(own, values)}
            sets = [f"{s.key}={raw}" for s, raw in zip(own, _raw_of(own, values))]
            try:
                recipe = load_recipe(path, [*overrides, *sets], registry=registry)
            except DecodeKitError as exc:
                culprit = next((s for s in own if s.key in str(exc)), own[0] if own else None)
                where = f"{culprit.flag}: " if culprit is not None else ""
                raise ConfigError(f"{where}not a key or value of recipe {name!r}: {exc}") from None
            label = name + ("[" + ", ".join(f"{_short(k)}={v}" for k, v in settings.items()) + "]" if settings else "")
            points.append(Point(label, name, path, settings, recipe, sets))
    return points


def _check_no_new_entry(data: Any, sweep: Sweep, name: str) -> None:
    """A sweep changes what a recipe has; it never adds a list entry (a processor the recipe does not list), which
    `--set` would do by appending: that is a different recipe, not a point of this one's sweep."""
    node = data
    for part in sweep.key.split("."):
        if node is None and part.isdigit():
            raise ConfigError(f"{sweep.flag}: not a key of recipe {name!r}: it has no list where index {part} "
                              "would be")
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                have = len(node)
                raise ConfigError(f"{sweep.flag}: not a key of recipe {name!r}: {part!r} is past its list of {have} "
                                  f"(give an index from 0 to {have - 1})" if have else
                                  f"{sweep.flag}: not a key of recipe {name!r}: the list it goes into is empty")
            node = node[int(part)]
        elif isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, str) and node == part:  # a component named without parameters (`- min_p`)
            node = {}
        elif node is not None:
            return  # a key under a value the recipe leaves to its defaults: pydantic checks it


def _raw_of(sweeps: Sequence[Sweep], values: Sequence[Any]) -> list[str]:
    """The text of each chosen value, as the sweep wrote it (what `--set` parses back to the same value)."""
    return [s.raw[s.values.index(v)] for s, v in zip(sweeps, values)]


def _position(text: str, count: int) -> int | None:
    """A recipe given by its position (1-based), when `text` is one."""
    return int(text) if text.isdigit() and 1 <= int(text) <= count else None


def _short(key: str) -> str:
    """A sweep key's last part for labels (`processors.0.min_p.min_p` -> `min_p`)."""
    return key.rsplit(".", 1)[-1]
