"""Local lm-evaluation-harness tasks written by the tests (a JSONL file and a task YAML, offline), and lm-eval run
on them: shared by the lm-eval client's tests (tests/serve/test_lm_eval_client.py), `decodekit eval` and `decodekit
compare`'s (tests/compare/)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHOICE_TASK = "decodekit_tiny_choice"
QUESTIONS = [
    ("The sky is", ["blue", "green", "loud", "seven"], 0),
    ("Two plus two is", ["four", "five", "a cat", "red"], 0),
    ("Water is", ["wet", "dry", "square", "late"], 0),
    ("The sun rises in the", ["east", "west", "sea", "box"], 0),
    ("A dog says", ["woof", "meow", "moo", "tweet"], 0),
    ("Ice is", ["cold", "hot", "tall", "sweet"], 0),
]
"""The multiple-choice task's questions: (question, choices, index of the right one)."""


def offline(monkeypatch: Any, folder: Path) -> None:
    """lm-eval's datasets read local files only, cached under `folder`."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(folder / "datasets-cache"))


def _task_head(folder: Path, task: str, rows: list[dict[str, Any]]) -> str:
    """Write the task's rows as its JSONL file; the start of its YAML, which reads them (offline)."""
    (folder / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return (f"task: {task}\ndataset_path: json\n"
            f"dataset_kwargs:\n  data_files:\n    test: {folder / f'{task}.jsonl'}\ntest_split: test\n")


def write_choice_task(folder: Path, task: str = CHOICE_TASK) -> Path:
    """The multiple-choice task over `QUESTIONS` in `folder` (its data and its YAML); returns the folder."""
    rows = [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS]
    (folder / f"{task}.yaml").write_text(
        _task_head(folder, task, rows) +
        "output_type: multiple_choice\n"
        "doc_to_text: \"{{question}}\"\n"
        "doc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n")
    return folder


def write_generation_task(folder: Path, task: str, rows: list[dict[str, str]], max_gen_toks: int = 8,
                          until: str = "\\n") -> Path:
    """A generation task over `rows` ({"question", "answer"}), scored by exact match, in `folder`."""
    (folder / f"{task}.yaml").write_text(
        _task_head(folder, task, rows) +
        "output_type: generate_until\n"
        "doc_to_text: \"{{question}}\"\n"
        "doc_to_target: \"{{answer}}\"\n"
        f"generation_kwargs:\n  until: [\"{until}\"]\n  max_gen_toks: {max_gen_toks}\n"
        "metric_list:\n  - metric: exact_match\n")
    return folder


def evaluate(model: Any, model_args: str | None, task_dir: Path, tasks: list[str], **options: Any) -> dict:
    """lm-eval's `simple_evaluate` on local tasks, seeded, with the samples logged (lm-eval's own tasks are not
    indexed: that takes seconds)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    return simple_evaluate(model=model, model_args=model_args, tasks=tasks, log_samples=True, task_manager=manager,
                           random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0, **options)


def per_choice(results: dict, task: str = CHOICE_TASK) -> list[list[float]]:
    """Each question's loglikelihood per choice, in question order."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [[float(resp[0][0]) for resp in sample["resps"]] for sample in samples]
