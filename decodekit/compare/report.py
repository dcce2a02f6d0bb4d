"""A comparison's results as one document: every point's speed, quality and task figures (each metric's values
too), the metrics' declarations, the Pareto view and the machine; what `--output FILE.json` writes and what the
table and the HTML report are drawn from."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decodekit.compare.pareto import Scored, pareto_view
from decodekit.compare.plan import ComparePlan
from decodekit.compare.run import PointResult


@dataclass(frozen=True)
class Column:
    """One quality figure of the report: a metric, or a task's accuracy (`accuracy:TASK`)."""

    name: str
    description: str
    higher_is_better: bool | None
    task: str | None = None

    def value(self, result: PointResult) -> float | None:
        """This figure at one point (None where it was not measured)."""
        if self.task is not None:
            return result.accuracy(self.task)
        figure = result.quality.get(self.name)
        return figure.value if figure is not None else None


def quality_columns(plan: ComparePlan) -> list[Column]:
    """The report's quality figures: each task's accuracy, then each metric, in the order asked for."""
    columns = [Column(f"accuracy:{task}", f"{task}: lm-eval's first metric of the task", True, task)
               for task in plan.tasks]
    for metric in plan.metrics:
        doc = (type(metric).__doc__ or "").strip().splitlines()
        columns.append(Column(metric.name, doc[0] if doc else "", metric.higher_is_better))
    return columns


def pareto(plan: ComparePlan, results: Sequence[PointResult]) -> dict[str, Any]:
    """For each quality figure with a better side: the frontier of tokens/s against it, over every point and within
    each recipe (points that failed or lack either figure are left out)."""
    views: dict[str, Any] = {}
    for column in quality_columns(plan):
        if column.higher_is_better is None:
            continue
        scored = [Scored(r.point.label, r.point.recipe_name, r.speed["tokens_per_s"], value)
                  for r in results if r.ok and r.speed.get("tokens_per_s") is not None
                  and (value := column.value(r)) is not None]
        if scored:
            views[column.name] = pareto_view(scored, column.higher_is_better)
    return views


def report_document(plan: ComparePlan, results: Sequence[PointResult], *, environment: dict[str, Any],
                    machine: str, wall_s: float, command: Sequence[str] = ()) -> dict[str, Any]:
    """The whole comparison as JSON-ready data."""
    return {
        "command": list(command),
        "machine": machine,
        "environment": environment,
        "wall_s": wall_s,
        "samples": plan.samples,
        "seed": plan.seed,
        "tasks": plan.tasks,
        "prompts": max((len(r) for r in plan.requests.values()), default=0),
        "bad_inputs": [str(b) for b in plan.bad_inputs],
        "metrics": {m.name: {"description": c.description, "needs": sorted(m.needs), "aggregate": m.aggregate,
                             "higher_is_better": m.higher_is_better}
                    for m, c in zip(plan.metrics, quality_columns(plan)[len(plan.tasks):])},
        "points": [{
            "label": r.point.label,
            "recipe": r.point.recipe_name,
            "file": str(r.point.source),
            "sweep": r.point.settings,
            "status": "ok" if r.ok else "failed",
            "error": r.error,
            "speed": r.speed,
            "quality": {name: figure.as_dict() for name, figure in r.quality.items()},
            "tasks": r.tasks,
            "samples": r.samples,
        } for r in results],
        "pareto": pareto(plan, results),
    }


def write_json(document: dict[str, Any], path: Path) -> None:
    """Write the document (UTF-8, indented)."""
    path.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3f}" if abs(value) < 10 else f"{value:.2f}"


SPEED_COLUMNS = (("tok/s", "tokens_per_s", lambda v: "-" if v is None else f"{v:.1f}"),
                 ("TTFT p50", "ttft_p50_s", _ms), ("TPOT p50", "tpot_p50_s", _ms),
                 ("accepted", "acceptance_rate", lambda v: "-" if v is None else f"{v:.0%}"),
                 ("KV peak", "kv_blocks_peak", lambda v: "-" if v is None else str(v)))
"""The speed columns of the table: header, key in a point's `speed`, format."""


@dataclass(frozen=True)
class Table:
    """The comparison as a table both views print: headers, and per point its cells (or its failure), which
    cells hold the best figure of their column, and whether the point is on some Pareto frontier."""

    headers: list[str]
    rows: list[tuple[str, list[str] | str, set[int], bool]]  # label, cells or error, best cell indexes, frontier


def comparison_table(document: dict[str, Any]) -> Table:
    """The table of a report document (`report_document`)."""
    from decodekit.compare.plots import figure_value

    metrics = document["metrics"]
    quality = [f"accuracy:{t}" for t in document["tasks"]] + list(metrics)
    better = {f"accuracy:{t}": True for t in document["tasks"]}
    better.update({name: m["higher_is_better"] for name, m in metrics.items()})
    better.update({"tokens_per_s": True, "ttft_p50_s": False, "tpot_p50_s": False, "acceptance_rate": True})
    keys = [key for _, key, _ in SPEED_COLUMNS] + quality
    ok = [p for p in document["points"] if p["status"] == "ok"]

    speed_keys = {key for _, key, _ in SPEED_COLUMNS}

    def value(point: dict[str, Any], key: str) -> Any:
        return point["speed"].get(key) if key in speed_keys else figure_value(point, key)

    best: dict[str, Any] = {}
    for key in keys:
        present = [v for p in ok if (v := value(p, key)) is not None]
        if present and better.get(key) is not None and len(ok) > 1:
            best[key] = max(present) if better[key] else min(present)
    on_frontier = {label for view in document["pareto"].values() for label in view["all"]}
    rows: list[tuple[str, list[str] | str, set[int], bool]] = []
    for point in document["points"]:
        if point["status"] != "ok":
            rows.append((point["label"], f"failed: {point['error']}", set(), False))
            continue
        cells = [fmt(point["speed"].get(key)) for _, key, fmt in SPEED_COLUMNS]
        cells += [_number(figure_value(point, name)) if (point["quality"].get(name) or {}).get("missing") is None
                  else "n/a" for name in quality]
        marks = {i for i, key in enumerate(keys) if key in best and value(point, key) == best[key]}
        rows.append((point["label"], cells, marks, point["label"] in on_frontier))
    return Table(["point", *(h for h, _, _ in SPEED_COLUMNS), *quality], rows)
