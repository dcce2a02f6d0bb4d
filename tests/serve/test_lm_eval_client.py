"""lm-evaluation-harness against `decodekit serve`, with nothing but the server's URL: its `local-completions` model
on a local multiple-choice task (a JSONL file and a task YAML written here), tokenizing through the server's
`/tokenizer_info` and `/tokenize` (`tokenizer_backend=remote`), gives the same loglikelihood per choice (1e-4) and
the same accuracy as lm-eval's own `hf` backend on the same weights."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from decodekit.recipe import load_recipe
from tests.helpers.batch_cases import write_tiny_recipe
from tests.helpers.lm_eval_tasks import (
    CHOICE_TASK,
    QUESTIONS,
    evaluate,
    offline,
    per_choice,
    write_choice_task,
    write_generation_task,
)
from tests.helpers.served import Served

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'lm-eval[api]')")


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    return write_choice_task(tmp_path_factory.mktemp("lm-eval-task"))


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("lm-eval-serve")
    server = Served(load_recipe(write_tiny_recipe(folder, max_tokens=8)), served_model_name="tiny")
    server.folder = folder / "tiny"  # type: ignore[attr-defined]
    yield server
    server.stop()


def test_local_completions_through_the_server_equals_lm_evals_hf_backend(served, task_dir, monkeypatch):
    offline(monkeypatch, task_dir)
    remote = evaluate("local-completions", f"base_url={served.url}/v1/completions,model=tiny,"
                      "tokenizer_backend=remote,num_concurrent=1,max_retries=1,tokenized_requests=True", task_dir,
                      [CHOICE_TASK])
    local = evaluate("hf", f"pretrained={served.folder},dtype=float32,device=cpu,batch_size=1",  # type: ignore[attr-defined]
                     task_dir, [CHOICE_TASK])
    got, expected = per_choice(remote), per_choice(local)
    assert len(got) == len(QUESTIONS) and all(len(g) == 4 for g in got)
    for row, ref in zip(got, expected):
        assert row == pytest.approx(ref, abs=1e-4)
    assert remote["results"][CHOICE_TASK]["acc,none"] == local["results"][CHOICE_TASK]["acc,none"]
    served.wait_idle()


GEN_TASK = "decodekit_tiny_generate"


def test_local_chat_completions_runs_a_generation_task_with_the_servers_greedy_answers(served, task_dir,
                                                                                       monkeypatch):
    offline(monkeypatch, task_dir)
    client = served.client(api_key="unused")
    rows = []
    for question, _, _ in QUESTIONS:  # the target is what the server answers to the same chat request, unstreamed
        answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}],
                                                max_tokens=8, temperature=0, stop=["\n"], seed=1234)
        rows.append({"question": question, "answer": answer.choices[0].message.content})
    write_generation_task(task_dir, GEN_TASK, rows)
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
