"""`decodekit batch`: a recipe over a dataset of prompts, one output row per input row, in-process or on Ray.

The job reads the input, skips the rows the output already holds (a rerun resumes), runs the rest (in this
process, or over Ray Data with one engine per replica; see `decodekit.batch.ray_job`), appends each output row in
input order as soon as it and the rows before it are done, and leaves the output in input order.

Example:
    >>> recipe = load_recipe("recipes/quickstart.yaml")
    >>> summary = run_batch(recipe, "prompts.jsonl", "answers.jsonl")
    >>> summary.errors
    0
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pluggy

from decodekit.api.errors import DecodeKitError, RecipeError
from decodekit.batch.output import OUTPUT_SUFFIXES, OutputFile
from decodekit.batch.ray_job import RayOptions, run_on_ray
from decodekit.batch.rows import InputRow, read_rows
from decodekit.batch.worker import BatchWorker, tokens_of
from decodekit.recipe import Recipe


@dataclass
class BatchSummary:
    """What a job did.

    Attributes:
        rows: rows in the input.
        skipped: rows the output already held (a resumed job).
        written: rows run and written by this job.
        errors: rows of this job written with an error.
        output_tokens: completion tokens of this job's rows.
        wall_s: this job's time, model loading included.
        replicas: engines that ran the rows (1 in-process).
    """

    rows: int
    skipped: int = 0
    written: int = 0
    errors: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    replicas: int = 1
    error_samples: list[str] = field(default_factory=list)

    @property
    def rows_per_s(self) -> float | None:
        """Rows written per second of the job."""
        return self.written / self.wall_s if self.wall_s > 0 and self.written else None

    @property
    def tokens_per_s(self) -> float | None:
        """Completion tokens per second of the job."""
        return self.output_tokens / self.wall_s if self.wall_s > 0 and self.output_tokens else None


OnRow = Callable[[dict[str, Any]], None]


def run_batch(recipe: Recipe, input_path: str | Path, output_path: str | Path, *, ray: RayOptions | None = None,
              retry_errors: bool = False, plugin_manager: pluggy.PluginManager | None = None,
              on_start: Callable[[int, int], None] | None = None, on_row: OnRow | None = None) -> BatchSummary:
    """Run `recipe` over every row of `input_path` not yet in `output_path` and append their output rows.

    Args:
        ray: run over Ray Data (None: in this process).
        retry_errors: run again the rows the output holds with an error (their old rows are replaced).
        on_start: called with (rows in the input, rows to run) once the input and output are read.
        on_row: called with each output row once it is written.

    Raises:
        DecodeKitError: the input or output cannot be read, the model does not load, or Ray is not installed.
    """
    start = time.perf_counter()
    if ray is not None and is_folder(output_path):
        return _run_dataset(recipe, str(input_path), str(output_path), ray, retry_errors, start, on_start)
    output = OutputFile(output_path)
    rows = read_rows(input_path)
    if retry_errors:
        output.drop_error_rows()
    done = {str(row["id"]) for row in output.existing_rows()}
    todo = [row for row in rows if row.id not in done]
    summary = BatchSummary(rows=len(rows), skipped=len(rows) - len(todo), replicas=ray.replicas if ray else 1)
    if on_start is not None:
        on_start(len(rows), len(todo))
    try:
        if todo:
            results = run_on_ray(recipe, todo, ray) if ray is not None else \
                BatchWorker(recipe, plugin_manager).run(todo)
            _write(results, todo, output, summary, on_row)
    finally:
        output.close()
    output.finish({row.id: row.index for row in rows})
    summary.wall_s = time.perf_counter() - start
    return summary


def _write(results: Iterator[dict[str, Any]], todo: Sequence[InputRow], output: OutputFile, summary: BatchSummary,
           on_row: OnRow | None) -> None:
    """Append each row once (a row retried by Ray after a failure is never written twice) and check that every row
    of the job came back."""
    expected = {row.id for row in todo}
    written: set[str] = set()
    for row in results:
        rid = str(row["id"])
        if rid in written or rid not in expected:
            continue
        output.append([row])
        written.add(rid)
        summary.written += 1
        summary.output_tokens += tokens_of(row)
        if row.get("error") is not None:
            summary.errors += 1
            if len(summary.error_samples) < 5:
                summary.error_samples.append(f"{rid}: {row['error']}")
        if on_row is not None:
            on_row(row)
    missing = [row.id for row in todo if row.id not in written]
    if missing:
        raise DecodeKitError(f"{len(missing)} rows came back without output (first: {missing[:5]}); rerun to "
                             "resume them")


def is_folder(output_path: str | Path) -> bool:
    """Whether an output is a folder of files (written by Ray Data's writers) rather than one .jsonl or .parquet
    file."""
    return Path(str(output_path).rstrip("/")).suffix not in OUTPUT_SUFFIXES or str(output_path).endswith("/")


def _run_dataset(recipe: Recipe, source: str, target: str, ray: RayOptions, retry_errors: bool, start: float,
                 on_start: Callable[[int, int], None] | None) -> BatchSummary:
    """A job whose input and output Ray Data reads and writes (`decodekit.batch.ray_dataset`)."""
    from decodekit.batch.ray_dataset import run_dataset_on_ray

    if retry_errors:
        raise RecipeError("--retry-errors needs a .jsonl or .parquet output file (a folder's files are not rewritten)")
    if on_start is not None:
        on_start(0, 0)  # the rows are only counted as Ray Data reads them
    counts = run_dataset_on_ray(recipe, source, target, ray, ray.folder_format)
    return BatchSummary(rows=counts["skipped"] + counts["written"], skipped=counts["skipped"],
                        written=counts["written"], errors=counts["errors"], output_tokens=counts["output_tokens"],
                        wall_s=time.perf_counter() - start, replicas=ray.replicas)
