"""Benchmark harness: decodekit against transformers baselines, side by side in one process.

Example:
    >>> from rich.console import Console
    >>> from decodekit.bench import run_benchmark, render_table, result_json
    >>> result = run_benchmark("mixed", num_requests=64, repeats=3)
    >>> render_table(result, Console())
    >>> print(result_json(result))

`run_matrix` (`decodekit bench matrix`) runs dtype x batch size x strategy cells the same way; every result
carries the machine it ran on (`decodekit.bench.machine`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from decodekit.bench.baselines import SYSTEMS, RunRecord, System, build_system
    from decodekit.bench.harness import measure, run_benchmark
    from decodekit.bench.machine import cpu_description, environment, machine_line
    from decodekit.bench.matrix import (
        MatrixCell,
        MatrixResult,
        matrix_json,
        matrix_markdown,
        render_matrix_table,
        run_matrix,
    )
    from decodekit.bench.progress import BenchProgress, RichBenchProgress
    from decodekit.bench.report import BenchResult, SystemFigures, render_table, result_json
    from decodekit.bench.workloads import WORKLOADS, BenchRequest, Workload, default_baselines, make_workload

# what each name is imported from, on first use: importing `decodekit.bench.workloads` (the command line does,
# for its help) must not import torch
_EXPORTS = {
    "SYSTEMS": "decodekit.bench.baselines",
    "RunRecord": "decodekit.bench.baselines",
    "System": "decodekit.bench.baselines",
    "build_system": "decodekit.bench.baselines",
    "measure": "decodekit.bench.harness",
    "run_benchmark": "decodekit.bench.harness",
    "cpu_description": "decodekit.bench.machine",
    "environment": "decodekit.bench.machine",
    "machine_line": "decodekit.bench.machine",
    "MatrixCell": "decodekit.bench.matrix",
    "MatrixResult": "decodekit.bench.matrix",
    "matrix_json": "decodekit.bench.matrix",
    "matrix_markdown": "decodekit.bench.matrix",
    "render_matrix_table": "decodekit.bench.matrix",
    "run_matrix": "decodekit.bench.matrix",
    "BenchProgress": "decodekit.bench.progress",
    "RichBenchProgress": "decodekit.bench.progress",
    "BenchResult": "decodekit.bench.report",
    "SystemFigures": "decodekit.bench.report",
    "render_table": "decodekit.bench.report",
    "result_json": "decodekit.bench.report",
    "WORKLOADS": "decodekit.bench.workloads",
    "BenchRequest": "decodekit.bench.workloads",
    "Workload": "decodekit.bench.workloads",
    "default_baselines": "decodekit.bench.workloads",
    "make_workload": "decodekit.bench.workloads",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "SYSTEMS",
    "WORKLOADS",
    "BenchProgress",
    "BenchRequest",
    "BenchResult",
    "MatrixCell",
    "MatrixResult",
    "RichBenchProgress",
    "RunRecord",
    "System",
    "SystemFigures",
    "Workload",
    "build_system",
    "cpu_description",
    "default_baselines",
    "environment",
    "machine_line",
    "make_workload",
    "matrix_json",
    "matrix_markdown",
    "measure",
    "render_matrix_table",
    "render_table",
    "result_json",
    "run_benchmark",
    "run_matrix",
]
