"""The processor plugin that docs/writing-plugins.md builds, `decodekit-eos-boost`, runs as written, and so do the
tests the page tells its author to write (the conformance kit, an exact example, and the ready-made parts)."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "writing-plugins.md"


def _blocks(section: str) -> list[str]:
    text = DOC.read_text().split(section, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", text, re.S)


@pytest.fixture(scope="module")
def eos_boost_module():
    """The page's `decodekit_eos_boost/__init__.py`, importable under its package name as if installed."""
    module = types.ModuleType("decodekit_eos_boost")
    exec(compile(_blocks("## A complete plugin")[0], f"{DOC}:decodekit_eos_boost", "exec"), module.__dict__)
    sys.modules["decodekit_eos_boost"] = module
    yield module
    del sys.modules["decodekit_eos_boost"]


def _documented_tests() -> list[tuple[str, str]]:
    found = []
    for index, code in enumerate(_blocks("## Testing with `decodekit.testing`")):
        found += [(f"block {index}: {name}", code) for name in re.findall(r"^def (test_\w+)", code, re.M)]
    return found


def test_the_page_teaches_the_kit_and_the_ready_made_parts():
    names = [name for name, _ in _documented_tests()]
    assert len(names) >= 4, names
    assert any("conformance" in name for name in names) and any("engine" in name for name in names)


@pytest.mark.parametrize(("name", "code"), _documented_tests(), ids=[n for n, _ in _documented_tests()])
def test_every_documented_test_passes(eos_boost_module, name, code):
    namespace: dict = {}
    exec(compile(code, f"{DOC}:{name}", "exec"), namespace)
    namespace[name.split(": ")[1]]()
