"""lm-evaluation-harness for decodekit's commands: its optional import (a clear error naming the `eval` extra when it
is missing), the tasks checked before anything runs, and one evaluation with decodekit as the model.

Only this module and `decodekit.eval.model` import `lm_eval`, and only when a command asks for tasks.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from decodekit.api.errors import ConfigError

EXTRA_HINT = "pip install 'decodekit[eval]' (lm-evaluation-harness)"


def import_lm_eval() -> ModuleType:
    """The `lm_eval` package.

    Raises:
        ConfigError: it is not installed (the message names the extra that installs it).
    """
    try:
        import lm_eval
    except ImportError as exc:
        raise ConfigError(f"tasks need lm-evaluation-harness, which is not installed ({exc}): {EXTRA_HINT}") from None
    return lm_eval


def task_manager(tasks: list[str], include_path: Path | None = None) -> Any:
    """lm-eval's `TaskManager` once every name in `tasks` is known to it: over `include_path`'s tasks alone when
    they are all there, else over lm-eval's own tasks too.

    Raises:
        ConfigError: lm-eval is missing, `include_path` is not a folder, or a task (or group, or tag) is unknown
            (the message names it, and a close match).
    """
    import_lm_eval()
    from lm_eval.tasks import TaskManager

    if not tasks:
        raise ConfigError("--tasks: give at least one task name")
    if include_path is not None and not include_path.is_dir():
        raise ConfigError(f"--include-path {include_path}: not a folder of task YAML files")
    if include_path is not None:
        # lm-eval's own index of ~15,000 task files takes seconds to build: local tasks alone do not need it
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if all(name in local.all_tasks or local.match_tasks([name]) for name in tasks):
            return local
    manager = TaskManager(include_path=str(include_path) if include_path is not None else None)
    known = manager.all_tasks
    for name in tasks:
        if name not in known and not manager.match_tasks([name]):
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            where = (f" nor in {include_path}" if include_path is not None
                     else " (add --include-path DIR for local tasks)")
            raise ConfigError(f"--tasks: unknown task {name!r}{hint}: not one of lm-eval's tasks{where}")
    return manager


@dataclass
class TaskScores:
    """One evaluation's figures: per task, each metric lm-eval reported (`acc`, `exact_match`, ...), and the first of
    them as the task's accuracy; with the samples when they were logged."""

    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def accuracy(self, task: str) -> float | None:
        """The task's first metric (lm-eval lists a task's metric_list order): its accuracy in the report."""
        values = self.metrics.get(task) or {}
        return next(iter(values.values()), None)


def evaluate(lm: Any, tasks: list[str], manager: Any, limit: int | None = None, seed: int = 0,
             log_samples: bool = False, apply_chat_template: bool = False) -> TaskScores:
    """Run lm-eval's `simple_evaluate` on `tasks` with `lm` (a `decodekit.eval.model.DecodekitLM`), seeded."""
    from lm_eval import simple_evaluate

    results = simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                              log_samples=log_samples, apply_chat_template=apply_chat_template, random_seed=seed,
                              numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
    scores = TaskScores()
    for task, figures in (results or {}).get("results", {}).items():
        # a figure's key is "metric,filter"; the rest (name, alias, sample_len) and the stderr entries are not figures
        scores.metrics[task] = {key.removesuffix(",none"): float(value) for key, value in figures.items()
                                if "," in key and "_stderr" not in key and isinstance(value, (int, float))
                                and not isinstance(value, bool) and math.isfinite(value)}
    if log_samples:
        scores.samples = {task: list(rows) for task, rows in (results or {}).get("samples", {}).items()}
    return scores
