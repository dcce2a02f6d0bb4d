"""`benchmarks/kernel_ab.py`, the in-process A/B of two kernel versions: it reads a revision's sources from git and
reports whether the two sides' outputs agree bit for bit (an A/A run here: the same library on both sides)."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
from pathlib import Path

import pytest

from decodekit.execution.kernels.native import SOURCES, load_kernels

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("kernel_ab", ROOT / "benchmarks" / "kernel_ab.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_revisions_sources_are_the_files_git_holds_for_it(tmp_path):
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    written = _script().sources_at("HEAD", tmp_path)
    assert [path.name for path in written] == [source.name for source in SOURCES]
    for path, source in zip(written, SOURCES, strict=True):
        held = subprocess.run(["git", "show", f"HEAD:{source.relative_to(ROOT).as_posix()}"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
        assert path.read_text() == held


@pytest.mark.parametrize(("fmt", "stored_before"), [("Q4_1", False), ("Q4_K", False), ("Q6_K", False),
                                                   ("Q4_1", True), ("Q4_0", True)])
def test_one_library_against_itself_reports_equal_outputs_and_a_ratio(fmt, stored_before):
    """`--stored-before`: the stored blocks against their layout for the path (Q4_0 and Q4_1 grouped on AVX2), which
    must give the same bits."""
    kernels = load_kernels()
    if isinstance(kernels, str):
        pytest.skip(kernels)
    args = argparse.Namespace(out=8, width=256, calls=2, rounds=2, isa=kernels.quant.isa(), stored_before=stored_before)
    line = _script().compare(fmt, 3, args, [kernels, kernels])
    fields = line.split()
    assert fields[0] == fmt and fields[1] == "3" and fields[-1] == "equal"
    assert float(fields[-2].rstrip("x")) > 0


def test_a_revision_git_does_not_know_is_refused_naming_it(tmp_path):
    with pytest.raises(SystemExit, match="--before no-such-revision: git has no"):
        _script().sources_at("no-such-revision", tmp_path)
