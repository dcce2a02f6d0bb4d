"""decodekit as an lm-evaluation-harness model (`decodekit.eval`): on a local multiple-choice task written here it
gives lm-eval's `hf` backend's loglikelihood per choice (1e-4) and accuracy; rolling loglikelihoods over several
windows equal the `hf` backend's; a generation task runs through a recipe with a constraint, batched in the engine;
`decodekit eval` on the command line, and its clear errors (an unknown task, lm-eval missing)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from decodekit import SamplingParams
from decodekit.api.errors import ConfigError
from decodekit.cli import app
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

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'decodekit[eval]')")

GEN_TASK = "decodekit_tiny_yes_no"
CONSTRAINED = "processors: [{choice: {choices: [' yes', ' no']}}]\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A folder with a tiny recipe (greedy, 8 tokens) over a tiny Llama saved beside it, and the local tasks."""
    folder = tmp_path_factory.mktemp("eval")
    write_tiny_recipe(folder, max_tokens=8)
    write_choice_task(folder)
    write_generation_task(folder, GEN_TASK, [{"question": q, "answer": "yes"} for q, _, _ in QUESTIONS],
                          until="\\n")
    return folder


@pytest.fixture
def lm(tiny, monkeypatch):
    offline(monkeypatch, tiny)
    from decodekit.eval.model import DecodekitLM

    return DecodekitLM(recipe=str(tiny / "tiny.yaml"))


def test_the_adapter_equals_lm_evals_hf_backend_per_choice_and_in_accuracy(tiny, lm):
    ours = evaluate(lm, None, tiny, [CHOICE_TASK])
    theirs = evaluate("hf", f"pretrained={tiny / 'tiny'},dtype=float32,device=cpu,batch_size=1", tiny, [CHOICE_TASK])
    got, expected = per_choice(ours), per_choice(theirs)
    assert len(got) == len(QUESTIONS) and all(len(row) == 4 for row in got)
    for row, ref in zip(got, expected):
        assert row == pytest.approx(ref, abs=1e-4)
    assert ours["results"][CHOICE_TASK]["acc,none"] == theirs["results"][CHOICE_TASK]["acc,none"]


def test_the_decodekit_model_is_registered_in_lm_evals_registry(tiny, monkeypatch):
    offline(monkeypatch, tiny)
    from lm_eval.api.registry import get_model

    import decodekit.eval.model as model

    assert get_model("decodekit") is model.DecodekitLM
    by_name = evaluate("decodekit", f"recipe={tiny / 'tiny.yaml'},set=sampling.max_tokens=4", tiny, [CHOICE_TASK],
                       limit=2)
    assert len(by_name["samples"][CHOICE_TASK]) == 2


def test_rolling_loglikelihoods_over_several_windows_equal_the_hf_backends(tiny, lm):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    texts = ["the quick brown fox jumps over the lazy dog " * 90, "short text"]
    requests = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(texts)]
    assert len(lm.tok_encode(texts[0])) > 2 * lm.max_length  # three windows or more
    hf = HFLM(pretrained=str(tiny / "tiny"), dtype="float32", device="cpu", batch_size=4, max_length=lm.max_length)
    assert lm.loglikelihood_rolling(requests) == pytest.approx(hf.loglikelihood_rolling(requests), abs=1e-3)


def test_a_generation_task_runs_through_a_recipe_with_a_constraint_batched(tiny, monkeypatch):
    offline(monkeypatch, tiny)
    from decodekit.eval.model import DecodekitLM

    recipe_path = tiny / "constrained.yaml"
    recipe_path.write_text((tiny / "tiny.yaml").read_text() + CONSTRAINED)
    lm = DecodekitLM(recipe=str(recipe_path))
    steps = []
    lm.on_output = lambda out: steps.append(lm.llm.engine.stats()["running"])
    results = evaluate(lm, None, tiny, [GEN_TASK])
    answers = [s["resps"][0][0] for s in sorted(results["samples"][GEN_TASK], key=lambda s: s["doc_id"])]
    assert set(answers) <= {" yes", " no"}  # the constraint held every answer to a choice
    # the same prompts through the recipe directly: the evaluation used its processors and strategy
    recipe = load_recipe(recipe_path)
    direct = lm.llm.generate([lm.tok_encode(q) for q, _, _ in QUESTIONS], recipe.params_for({"stop": ["\n"]}))
    assert answers == [o.text for o in direct]
    assert len(lm.outputs) == len(QUESTIONS) and max(steps) > 1  # one batch: several requests ran at once
    assert results["results"][GEN_TASK]["exact_match,none"] == answers.count("yes") / len(answers)


def test_decodekit_eval_prints_and_writes_the_tasks_figures(tiny, monkeypatch):
    offline(monkeypatch, tiny)
    out = tiny / "eval.json"
    result = CliRunner().invoke(app, ["eval", str(tiny / "tiny.yaml"), "--tasks", CHOICE_TASK, "--include-path",
                                      str(tiny), "--limit", "3", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert CHOICE_TASK in result.output and "acc" in result.output
    document = json.loads(out.read_text())
    assert set(document["results"][CHOICE_TASK]) >= {"acc"} and len(document["samples"][CHOICE_TASK]) == 3


def test_decodekit_eval_refuses_an_unknown_task_before_loading_anything(tiny, monkeypatch):
    offline(monkeypatch, tiny)
    (tiny / "missing-model.yaml").write_text("model: /nonexistent/model\nsampling: {temperature: 0}\n")
    result = CliRunner().invoke(app, ["eval", str(tiny / "missing-model.yaml"), "--tasks", "decodekit_tiny_choise",
                                      "--include-path", str(tiny)])
    assert result.exit_code == 2
    assert "unknown task 'decodekit_tiny_choise' (did you mean 'decodekit_tiny_choice'?)" in result.output


def test_without_lm_eval_the_error_names_the_extra(monkeypatch):
    from decodekit.eval.harness import import_lm_eval, task_manager

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"pip install 'decodekit\[eval\]'"):
        import_lm_eval()
    with pytest.raises(ConfigError, match="lm-evaluation-harness"):
        task_manager(["anything"])


def test_scoring_params_ask_for_raw_prompt_logprobs():
    from decodekit.eval.scoring import SCORE

    assert SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0) == SCORE
    assert SCORE.logprobs_mode == "raw" and not SCORE.processors
