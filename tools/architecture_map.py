"""The module map of docs/architecture.md, from the code's real imports, and the layering rule it must obey.

    python tools/architecture_map.py            # print the map as the code has it
    python tools/architecture_map.py --write    # rewrite the table in docs/architecture.md (keeps each "owns")
    python tools/architecture_map.py --check    # exit 1 if the doc or the layering is off (tests/house/)

Layers, lowest first; a module may import its own layer and those below it, never above:

0. `decodekit.api`: the public plugin API (contracts, parameters, errors, the engine's options);
1. `decodekit.models`: model loading;
2. `decodekit.execution`: model execution (how a model runs, its paged KV pool, the fused decoder, the kernels);
3. `decodekit.core`: the engine (the step loop, its stages, the scheduler, plans of requests, the registry);
4. the front-ends: every other module of `decodekit` (`LLM`/`AsyncLLM`, recipes, the CLI, the benchmarks, the
   testing kit `decodekit.testing`, the package's re-exports).

Two more rules: the engine imports model execution through its face only (`decodekit.execution` itself, never a
module inside it), and no module imports itself back through others (no import cycles, lazy imports included).

decodekit's own plugins (`decodekit_plugins`) are written like a third party's: they may import `decodekit` (the
package's re-exports), `decodekit.api`, `decodekit.models` and each other, never `decodekit.core`.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
SOURCES = (ROOT / "decodekit", ROOT / "plugins" / "decodekit_plugins")
LAYERS = {"api": 0, "models": 1, "execution": 2, "core": 3}
FRONT_END = 4
FACES = {"decodekit.execution": "decodekit.core"}
"""Packages that a layer above imports through their face only (the package itself): face -> that layer."""
PLUGIN_MAY_IMPORT = ("decodekit.api", "decodekit.models", "decodekit_plugins")  # and `decodekit` itself
_ROW = re.compile(r"^\| `([^`]+)` \| (.*) \| (.*) \|$")


def module_name(path: Path) -> str:
    """`decodekit/core/engine.py` -> `decodekit.core.engine` (packages by their `__init__`)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "plugins":
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    """Every Python module of decodekit and its first-party plugins, by dotted name."""
    found = {}
    for source in SOURCES:
        for path in sorted(source.rglob("*.py")):
            found[module_name(path)] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The decodekit modules `path` imports (anywhere in the file, lazy imports included), each by the longest
    known module name it names."""
    tree = ast.parse(path.read_text())
    named: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            named.add(node.module)
            named.update(f"{node.module}.{alias.name}" for alias in node.names)
    out = set()
    for name in named:
        if not name.startswith(("decodekit.", "decodekit_plugins")) and name != "decodekit":
            continue
        while name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in known:
            out.add(name)
    return out


def layer(module: str) -> int | None:
    """The layer of a `decodekit` module (None for the plugins)."""
    parts = module.split(".")
    if parts[0] != "decodekit":
        return None
    return LAYERS.get(parts[1], FRONT_END) if len(parts) > 1 else FRONT_END


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that runs up the layers (or from a first-party plugin into the engine)."""
    out = []
    for module, targets in sorted(graph.items()):
        own = layer(module)
        for target in sorted(targets):
            if own is None:
                if target != "decodekit" and not any(target == p or target.startswith(p + ".")
                                                     for p in PLUGIN_MAY_IMPORT):
                    out.append(f"{module} imports {target}: plugins use decodekit's public API only")
            elif layer(target) is None:
                out.append(f"{module} imports the plugin module {target}")
            elif (layer(target) or 0) > own:
                out.append(f"{module} (layer {own}) imports {target} (layer {layer(target)})")
            else:
                out.extend(f"{module} imports {target}: {user} imports {face} through its face only ({face})"
                           for face, user in FACES.items()
                           if module.startswith(user + ".") and target.startswith(face + "."))
    return out + [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(graph)]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `graph`: one per strongly connected group of modules, each as a path that returns to
    its start (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(_cycle_path(sorted(group), graph))
    return groups


def _cycle_path(group: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A path through `group` (a strongly connected set) from its first module back to it."""
    members, start = set(group), group[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for target in sorted(graph.get(node, ()) & members):
            if target == start:
                return [*paths[node], start]
            if target not in paths:
                paths[target] = [*paths[node], target]
                queue.append(target)
    return group


def graph() -> dict[str, set[str]]:
    """Module -> the decodekit modules it imports (itself and its own package excluded)."""
    found = modules()
    known = set(found)
    return {m: {t for t in imports(p, known) if t != m and not m.startswith(t + ".")} for m, p in found.items()}


def _short(module: str) -> str:
    return module.removeprefix("decodekit.")


def rows(owns: dict[str, str]) -> list[str]:
    """The table's rows: module file, what it owns (kept from the doc), what it imports."""
    found = modules()
    g = graph()
    lines = ["| module | owns | imports (from the code) |", "|---|---|---|"]
    for module, path in found.items():
        rel = str(path.relative_to(ROOT))
        deps = ", ".join(f"`{_short(t)}`" for t in sorted(g[module])) or "nothing of ours"
        lines.append(f"| `{rel}` | {owns.get(rel, 'TODO: say what it owns')} | {deps} |")
    return lines


def doc_rows() -> dict[str, tuple[str, str]]:
    """The doc's table: module file -> (owns, imports)."""
    out = {}
    for line in DOC.read_text().splitlines():
        match = _ROW.match(line)
        if match and match.group(1) != "module":
            out[match.group(1)] = (match.group(2), match.group(3))
    return out


def write() -> None:
    """Rewrite the doc's table from the code, keeping each module's "owns" text."""
    text = DOC.read_text().splitlines()
    owns = {k: v[0] for k, v in doc_rows().items()}
    start = next(i for i, line in enumerate(text) if line.startswith("| module |"))
    end = start
    while end < len(text) and text[end].startswith("|"):
        end += 1
    DOC.write_text("\n".join(text[:start] + rows(owns) + text[end:]) + "\n")


def problems() -> list[str]:
    """What is wrong: layering violations, and doc rows that are missing, stale or list other imports."""
    out = violations(graph())
    expected = {}
    for line in rows({})[2:]:
        match = _ROW.match(line)
        assert match is not None
        expected[match.group(1)] = match.group(3)
    documented = doc_rows()
    for path, deps in expected.items():
        if path not in documented:
            out.append(f"docs/architecture.md has no row for {path}")
        elif documented[path][1] != deps:
            out.append(f"docs/architecture.md: {path} imports {deps}, the doc says {documented[path][1]}")
        elif "TODO" in documented[path][0]:
            out.append(f"docs/architecture.md: say what {path} owns")
    out.extend(f"docs/architecture.md lists {path}, which does not exist" for path in documented.keys() - expected)
    return out


if __name__ == "__main__":
    if "--write" in sys.argv:
        write()
    elif "--check" in sys.argv:
        found = problems()
        print("\n".join(found) or "ok")
        sys.exit(1 if found else 0)
    else:
        print("\n".join(rows({k: v[0] for k, v in doc_rows().items()})))
