"""Benchmark harness: decodekit against transformers baselines, side by side in one process.

Example:
    >>> from rich.console import Console
    >>> from decodekit.bench import run_benchmark, render_table, result_json
    >>> result = run_benchmark("mixed", num_requests=64, repeats=3)
    >>> render_table(result, Console())
    >>> print(result_json(result))
"""

from __future__ import annotations

from decodekit.bench.baselines import SYSTEMS, RunRecord, System, build_system
from decodekit.bench.harness import run_benchmark
from decodekit.bench.report import BenchResult, SystemFigures, render_table, result_json
from decodekit.bench.workloads import WORKLOADS, BenchRequest, Workload, default_baselines, make_workload

__all__ = [
    "SYSTEMS",
    "WORKLOADS",
    "BenchRequest",
    "BenchResult",
    "RunRecord",
    "System",
    "SystemFigures",
    "Workload",
    "build_system",
    "default_baselines",
    "make_workload",
    "render_table",
    "result_json",
    "run_benchmark",
]
