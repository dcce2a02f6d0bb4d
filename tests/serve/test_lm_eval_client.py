"""lm-evaluation-harness against `decodekit serve`, with nothing but the server's URL: its `local-completions` model
on a local multiple-choice task (a JSONL file and a task YAML written here), tokenizing through the server's
`/tokenizer_info` and `/tokenize` (`tokenizer_backend=remote`), gives the same loglikelihood per choice (1e-4) and
the same accuracy as lm-eval's own `hf` backend on the same weights."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from decodekit.recipe import load_recipe
from tests.helpers.batch_cases import write_tiny_recipe
from tests.helpers.served import Served

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'lm-eval[api]')")

TASK = "decodekit_tiny_choice"
QUESTIONS = [
    ("The sky is", ["blue", "green", "loud", "seven"], 0),
    ("Two plus two is", ["four", "five", "a cat", "red"], 0),
    ("Water is", ["wet", "dry", "square", "late"], 0),
    ("The sun rises in the", ["east", "west", "sea", "box"], 0),
    ("A dog says", ["woof", "meow", "moo", "tweet"], 0),
    ("Ice is", ["cold", "hot", "tall", "sweet"], 0),
]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lm-eval-task")
    rows = [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS]
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'data.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: \"{{question}}\"\n"
        "doc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n")
    return folder


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("lm-eval-serve")
    server = Served(load_recipe(write_tiny_recipe(folder, max_tokens=8)), served_model_name="tiny")
    server.folder = folder / "tiny"  # type: ignore[attr-defined]
    yield server
    server.stop()


def _evaluate(model: str, model_args: str, task_dir: Path) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=[TASK], log_samples=True,
                           task_manager=TaskManager(include_path=str(task_dir)), random_seed=0, numpy_random_seed=0,
                           torch_random_seed=0, fewshot_random_seed=0)


def _per_choice(results: dict) -> list[list[float]]:
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return [[float(resp[0][0]) for resp in sample["resps"]] for sample in samples]


def test_local_completions_through_the_server_equals_lm_evals_hf_backend(served, task_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(task_dir / "datasets-cache"))
    remote = _evaluate("local-completions", f"base_url={served.url}/v1/completions,model=tiny,"
                       "tokenizer_backend=remote,num_concurrent=1,max_retries=1,tokenized_requests=True", task_dir)
    local = _evaluate("hf", f"pretrained={served.folder},dtype=float32,device=cpu,batch_size=1",  # type: ignore[attr-defined]
                      task_dir)
    got, expected = _per_choice(remote), _per_choice(local)
    assert len(got) == len(QUESTIONS) and all(len(g) == 4 for g in got)
    for row, ref in zip(got, expected):
        assert row == pytest.approx(ref, abs=1e-4)
    assert remote["results"][TASK]["acc,none"] == local["results"][TASK]["acc,none"]
    served.wait_idle()


GEN_TASK = "decodekit_tiny_generate"


def test_local_chat_completions_runs_a_generation_task_with_the_servers_greedy_answers(served, task_dir,
                                                                                       monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(task_dir / "datasets-cache"))
    client = served.client(api_key="unused")
    rows = []
    for question, _, _ in QUESTIONS:  # the target is what the server answers to the same chat request, unstreamed
        answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}],
                                                max_tokens=8, temperature=0, stop=["\n"], seed=1234)
        rows.append({"question": question, "answer": answer.choices[0].message.content})
    (task_dir / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (task_dir / f"{GEN_TASK}.yaml").write_text(
        f"task: {GEN_TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {task_dir / 'gen.jsonl'}\n"
        "test_split: test\n"
        "output_type: generate_until\n"
        "doc_to_text: \"{{question}}\"\n"
        "doc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n"
        "metric_list:\n  - metric: exact_match\n")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(model="local-chat-completions",
                              model_args=f"base_url={served.url}/v1/chat/completions,model=tiny,num_concurrent=1,"
                                         "max_retries=1", tasks=[GEN_TASK], apply_chat_template=True,
                              log_samples=True, task_manager=TaskManager(include_path=str(task_dir)))
    samples = sorted(results["samples"][GEN_TASK], key=lambda s: s["doc_id"])
    assert [s["resps"][0][0] for s in samples] == [r["answer"] for r in rows]
    assert results["results"][GEN_TASK]["exact_match,none"] == 1.0
    served.wait_idle()
