"""The output file of a batch job: which rows it already holds (a rerun skips them), appending rows as they are
done, and leaving it in input order at the end.

JSONL is appended row by row and flushed, so a job stopped at any point (Ctrl-C, a killed machine) resumes from what
is on disk; a last line cut short by the stop is dropped and its row runs again. Parquet cannot be appended to, so
rows go to a JSONL journal beside it (`out.parquet.partial.jsonl`), and the Parquet file is written from the journal
when the job ends.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from decodekit.api.errors import RecipeError
from decodekit.batch.rows import OUTPUT_KEYS, _import_pyarrow_parquet, output_schema

log = logging.getLogger("decodekit.batch")

OUTPUT_SUFFIXES = (".jsonl", ".parquet")


class OutputFile:
    """A job's output file (.jsonl or .parquet) and, for Parquet, its journal."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if self.path.suffix not in OUTPUT_SUFFIXES:
            raise RecipeError(f"{self.path}: a batch output is .jsonl or .parquet (with --ray, also a folder)")
        self.parquet = self.path.suffix == ".parquet"
        self.journal = self.path.with_name(self.path.name + ".partial.jsonl") if self.parquet else self.path
        self._handle: Any = None

    def existing_rows(self) -> list[dict[str, Any]]:
        """The rows already written (Parquet, then the journal). A journal's last line cut short by a stop is
        removed from the file, so appending goes on from a whole line."""
        rows: list[dict[str, Any]] = []
        if self.parquet and self.path.is_file():
            rows += _read_parquet(self.path)
        rows += self._repair_journal()
        return rows

    def _repair_journal(self) -> list[dict[str, Any]]:
        if not self.journal.is_file():
            return []
        data = self.journal.read_bytes()
        whole = data[: data.rfind(b"\n") + 1]  # everything up to the last complete line
        rows = []
        for number, line in enumerate(whole.decode("utf-8", errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not isinstance(row, dict) or "id" not in row:
                raise RecipeError(f"{self.journal} line {number}: not an output row of decodekit batch; move the "
                                  "file away or give another --output")
            rows.append(row)
        if len(whole) != len(data):
            log.warning("%s: dropping a last line cut short (its row runs again)", self.journal)
            with self.journal.open("r+b") as handle:
                handle.truncate(len(whole))
        return rows

    def drop_error_rows(self) -> None:
        """Remove the rows written with an error, so that they run again (the rest stay, in the journal)."""
        rows = self.existing_rows()
        kept = [row for row in rows if row.get("error") is None]
        if len(kept) == len(rows):
            return
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in kept)
        _write_atomically(self.journal, lambda tmp: tmp.write_text(text, encoding="utf-8"))
        if self.parquet:
            self.path.unlink(missing_ok=True)  # its rows are all in the journal now

    def append(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Append rows and flush them to the file (a stop after this loses none of them)."""
        if self._handle is None:
            self.journal.parent.mkdir(parents=True, exist_ok=True)
            self._handle = self.journal.open("a", encoding="utf-8")
        self._handle.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        self._handle.flush()

    def close(self) -> None:
        """Close the journal (what was appended stays)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def finish(self, order: Mapping[str, int]) -> None:
        """Leave the output whole and in input order (`order`: id to position; rows of other ids go last): a JSONL
        output is rewritten only when a resumed run appended out of order; a Parquet output is written from its
        rows and the journal removed."""
        self.close()
        rows = self.existing_rows()
        end = len(order)
        ranked = sorted(rows, key=lambda r: order.get(str(r["id"]), end))
        if self.parquet:
            _write_atomically(self.path, lambda tmp: _write_parquet(tmp, ranked))
            self.journal.unlink(missing_ok=True)
        elif ranked != rows:
            text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in ranked)
            _write_atomically(self.path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _write_atomically(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = _import_pyarrow_parquet().read_table(path).to_pylist()
    return rows


def _write_parquet(path: Path, rows: list[dict[str, Any]]) -> None:
    import pyarrow as pa

    table = pa.Table.from_pylist([{key: row.get(key) for key in OUTPUT_KEYS} for row in rows], schema=output_schema())
    _import_pyarrow_parquet().write_table(table, path)
