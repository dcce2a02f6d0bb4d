"""Every Python block of the plugin guides (docs/writing-plugins.md and docs/plugins/*.md) runs as written.

The pages mark their blocks with an HTML comment on the line before the block (invisible when rendered):

- `<!-- module: NAME -->`: the block is the source of the module `NAME` (a plugin's `__init__.py`); it is executed
  as that module, importable under its name, before the page's other blocks run;
- `<!-- not run: REASON -->`: the block is not executed (a fragment, or one that needs an installed package);
  the reason is required, and few blocks may use it;
- no comment: the block is a script, executed in a fresh namespace with the page's modules importable; every
  `test_*` function it defines is then called, as pytest would (the tests a page tells its reader to write).

Each page under docs/plugins/ must build a plugin (a module block) and test it (a script with a `test_*` function).
YAML blocks must parse; TOML blocks must parse and, when they declare entry points, name a module the guides build.
"""

from __future__ import annotations

import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the TOML blocks go unchecked there
    tomllib = None  # type: ignore[assignment]

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = [DOCS / "writing-plugins.md", *sorted((DOCS / "plugins").glob("*.md"))]
KIND_PAGES = ["processors", "stopping-criteria", "strategies", "proposers", "constraint-backends", "model-loaders",
              "cli-commands", "tool-formats", "metrics", "reasoning-formats"]
MAX_NOT_RUN = 2  # per page: "not run" is for the odd fragment, not a way around the tests

_BLOCK = re.compile(r"(?:<!--\s*(?P<mark>module|not run)\s*:\s*(?P<arg>[^>]*?)\s*-->\s*\n)?"
                    r"^```(?P<lang>[\w-]*)\n(?P<code>.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: its language, its code, its mark and the mark's argument, where it starts."""

    page: Path
    line: int
    lang: str
    code: str
    mark: str | None
    arg: str

    @property
    def label(self) -> str:
        """`page.md:line`, where the block starts (for test ids and tracebacks)."""
        return f"{self.page.relative_to(DOCS)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """Every fenced block of a page, in order."""
    text = page.read_text()
    return [Block(page, text.count("\n", 0, m.start("code")) + 1, m["lang"], m["code"], m["mark"], m["arg"] or "")
            for m in _BLOCK.finditer(text)]


def _python(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.lang == "python"]


def _scripts() -> list[Block]:
    return [b for page in PAGES for b in _python(page) if b.mark is None]


@pytest.fixture
def page_modules(request):
    """A loader of a page's module blocks: each executed as its module, importable while the test runs."""
    loaded: list[str] = []

    def load(page: Path) -> None:
        for block in _python(page):
            if block.mark != "module":
                continue
            module = types.ModuleType(block.arg)
            module.__file__ = block.label
            sys.modules[block.arg] = module  # before executing: dataclasses and pydantic look their module up
            loaded.append(block.arg)
            exec(compile(block.code, block.label, "exec"), module.__dict__)

    yield load
    for name in loaded:
        sys.modules.pop(name, None)


def test_every_kind_has_its_page_and_the_overview_links_to_each():
    overview = (DOCS / "writing-plugins.md").read_text()
    for kind in KIND_PAGES:
        assert (DOCS / "plugins" / f"{kind}.md").is_file(), kind
        assert f"(plugins/{kind}.md)" in overview, kind


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_every_block_is_marked_sensibly(page):
    python = _python(page)
    not_run = [b for b in python if b.mark == "not run"]
    assert all(b.arg for b in not_run), "a `not run` block must say why"
    assert len(not_run) <= MAX_NOT_RUN, [b.label for b in not_run]
    names = [b.arg for b in python if b.mark == "module"]
    assert all(re.fullmatch(r"[a-z_][a-z0-9_]*", n) for n in names) and len(set(names)) == len(names), names
    if page.parent.name == "plugins":
        assert names, f"{page.name} builds no plugin module"
        assert any(re.search(r"^def test_\w+", b.code, re.M) for b in python if b.mark is None), \
            f"{page.name} shows no test of its plugin"
    for block in blocks(page):
        if block.lang == "yaml":
            yaml.safe_load(block.code)
        elif block.lang == "toml" and tomllib is not None:
            entry_points = tomllib.loads(block.code).get("project", {}).get("entry-points", {}).get("decodekit", {})
            built = {b.arg for other in PAGES for b in _python(other) if b.mark == "module"}
            for target in entry_points.values():  # an entry point names a module the guides build
                assert target.split(":")[0] in built, (block.label, target)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_every_module_block_imports(page, page_modules):
    page_modules(page)


@pytest.mark.parametrize("block", _scripts(), ids=[b.label for b in _scripts()])
def test_every_script_block_runs_and_its_tests_pass(block, page_modules):
    page_modules(block.page)
    namespace: dict = {"__name__": f"doc_block_{block.line}"}
    exec(compile(block.code, block.label, "exec"), namespace)
    for name, function in list(namespace.items()):
        if name.startswith("test_") and callable(function):
            function()


def test_the_processor_page_teaches_the_kit_and_the_ready_made_parts():
    tests = [name for b in _python(DOCS / "plugins" / "processors.md") if b.mark is None
             for name in re.findall(r"^def (test_\w+)", b.code, re.M)]
    assert len(tests) >= 4, tests
    assert any("conformance" in name for name in tests) and any("engine" in name for name in tests)
