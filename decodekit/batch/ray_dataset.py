"""A batch job whose input and output are datasets Ray Data reads and writes itself: a file, a folder, a glob or a
URI (`s3://bucket/rows/`, `gs://...`) in, a folder of JSONL or Parquet files out. Nothing passes through the driver
but the ids already done, so the job is as large as the cluster, not the driver's memory.

`decodekit batch RECIPE --ray -i s3://bucket/rows/ -o s3://bucket/answers/` takes this path whenever the output is
a folder (no .jsonl or .parquet suffix). What changes from the file job (`decodekit.batch.ray_job`):

- ids: a row's `id`, else the SHA-1 of its content (positions mean nothing across files read in parallel; the hash
  is the same on every rerun, so resuming works);
- output: Ray Data's writers, one file per block, every file with the same schema (`OUTPUT_SCHEMA`);
- resume: a rerun reads the ids of the folder's files and runs the other rows, into new files; a replica that dies
  is restarted and its block retried before anything of it is written.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from decodekit.api.errors import ConfigError
from decodekit.batch.ray_job import BatchReplica, RayOptions, configure, replica_cpus
from decodekit.batch.rows import InputRow, output_schema, without_nulls
from decodekit.ray_support import connect, import_ray, portable
from decodekit.recipe import Recipe

log = logging.getLogger("decodekit.batch")

FORMATS = ("jsonl", "parquet")


def content_id(row: dict[str, Any]) -> str:
    """A row's id when it has none: the SHA-1 of its content (keys sorted), the same on every rerun."""
    return hashlib.sha1(json.dumps(row, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


class DatasetReplica:
    """A Ray Data actor for dataset jobs: one engine built from the recipe, a block of rows in, a block of output
    rows (`output_schema`) out."""

    def __init__(self, recipe: Recipe, threads: int):
        self.replica = BatchReplica(recipe, threads)

    async def __call__(self, batch: Any) -> Any:
        """Output rows for a block of input rows (an Arrow table)."""
        import pyarrow as pa

        rows = []
        for index, data in enumerate(batch.to_pylist()):
            data = without_nulls(data)
            rows.append(InputRow(row_key(data), index, data))
        outputs = await self.replica.worker.run_async(rows, self.replica.engine)
        return pa.Table.from_pylist(outputs, schema=output_schema())


IO_TASK = {"num_cpus": 0}
"""Reading, filtering, writing and counting reserve no CPU: they wait on storage, and the replicas hold the CPUs
(were they to ask for one, a cluster whose CPUs all went to replicas would never schedule them)."""


def _read(ray: Any, source: str) -> Any:
    """The input through Ray Data's readers, by the kind of its files."""
    suffix = Path(source.rstrip("/")).suffix or _folder_suffix(source)
    if suffix == ".parquet":
        return ray.data.read_parquet(source, ray_remote_args=IO_TASK)
    if suffix == ".txt":
        return ray.data.read_text(source, ray_remote_args=IO_TASK).map(lambda r: {"prompt": r["text"]}, **IO_TASK)
    if suffix in (".jsonl", ".json"):
        return ray.data.read_json(source, lines=True, ray_remote_args=IO_TASK)
    raise ConfigError(f"{source}: cannot tell the input's kind: give .jsonl, .parquet or .txt files (or a folder "
                      "of them)")


def _folder_suffix(source: str) -> str:
    folder = Path(source)
    if folder.is_dir():
        kinds = {p.suffix for p in folder.iterdir() if p.is_file() and not p.name.startswith((".", "_"))}
        if len(kinds) == 1:
            return kinds.pop()
    return ""


def _done_ids(ray: Any, target: str, fmt: str) -> set[str]:
    folder = Path(target)
    if "://" not in target and (not folder.is_dir() or not any(folder.iterdir())):
        return set()
    try:
        done = (ray.data.read_parquet(target, ray_remote_args=IO_TASK) if fmt == "parquet"
                else ray.data.read_json(target, lines=True, ray_remote_args=IO_TASK))
        return {str(row["id"]) for row in done.select_columns(["id"]).take_all()}
    except (FileNotFoundError, ValueError):
        return set()


def run_dataset_on_ray(recipe: Recipe, source: str, target: str, options: RayOptions, fmt: str = "jsonl"
                       ) -> dict[str, int]:
    """Run every row of `source` whose id is not yet in `target` and write their output rows into `target` (a
    folder of `fmt` files). Returns the counts: `skipped` (already there) and `written`, `errors`,
    `output_tokens` of this job.

    Raises:
        ConfigError: Ray is not installed, the input's kind is unknown, or the cluster is too small.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"--output-format: {fmt!r}; choose {' or '.join(FORMATS)}")
    ray = import_ray()
    started = connect(options.address)
    try:
        per_replica = replica_cpus(ray, options)
        configure(ray)
        done = _done_ids(ray, target, fmt)
        dataset = _read(ray, source)
        if done:
            dataset = dataset.filter(lambda row: row_key(without_nulls(dict(row))) not in done, **IO_TASK)
        # materialized: held in the object store, written, then counted, not recomputed
        results = dataset.map_batches(
            DatasetReplica, fn_constructor_args=(portable(recipe), per_replica), batch_size=options.batch_size,
            batch_format="pyarrow", compute=options.compute(ray), num_cpus=per_replica).materialize()
        if results.count():
            write = results.write_parquet if fmt == "parquet" else results.write_json
            write(target, ray_remote_args=IO_TASK)
        counts = results.map_batches(_block_counts, batch_format="pyarrow", **IO_TASK).take_all()
        return {"skipped": len(done), "written": sum(c["rows"] for c in counts),
                "errors": sum(c["errors"] for c in counts), "output_tokens": sum(c["tokens"] for c in counts)}
    finally:
        if started:
            ray.shutdown()


def row_key(data: dict[str, Any]) -> str:
    """A row's id: its `id`, else `content_id`."""
    row_id = data.get("id")
    return str(row_id) if isinstance(row_id, (str, int)) and not isinstance(row_id, bool) else content_id(data)


def _block_counts(block: Any) -> dict[str, list[int]]:
    rows = block.to_pylist()
    return {"rows": [len(rows)], "errors": [sum(r["error"] is not None for r in rows)],
            "tokens": [sum((r["usage"] or {}).get("completion_tokens", 0) for r in rows)]}
