"""Fixes from a review of recipes, the CLI and the Python API: like-for-like run summaries (several returned
sequences), temperature given twice at 0, prompts-file ids, output paths checked before the run, `recipe check`
making `run`'s machine checks, `draft.dtype` with `model: target`, per-prompt list lengths in `LLM.generate`,
`generate`'s flag errors, and clearer messages for misshapen components and YAML booleans."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from decodekit import LLM, SamplingParams
from decodekit.api.components import PlanError
from decodekit.api.errors import ConfigError, RecipeError
from decodekit.api.sequence import CompletionOutput, RequestMetrics, RequestOutput
from decodekit.batch.rows import read_rows
from decodekit.cli import app
from decodekit.cli.summary import render_summary
from decodekit.core.plan import Components
from decodekit.core.plugin_manager import get_plugin_manager
from decodekit.core.registry import Registry
from decodekit.execution.attention.kv_cache import PagedKVCache
from decodekit.recipe import load_recipe
from decodekit.recipe_runner import read_inputs, summarize
from tests.helpers.reference import assert_idle
from tests.helpers.tiny_folders import tiny_overrides as _tiny

REGISTRY = Registry.from_plugin_manager(get_plugin_manager())


def _invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def _recipe(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _error(tmp_path: Path, text: str, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(_recipe(tmp_path, text), list(overrides), registry=REGISTRY)
    return str(info.value)


# ---- 1: summaries of requests that return several sequences ------------------------------------------------------
@pytest.mark.parametrize("params", [
    {"n": 4, "temperature": 1.0, "seed": 3},
    {"temperature": 0, "strategy": {"name": "beam_search", "params": {"num_beams": 4, "num_return_sequences": 4}}},
], ids=["n4", "beam4"])
def test_tpot_is_time_per_output_position_not_per_token_of_all_returned_sequences(llama, tokenizer, params):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6, ignore_eos="n" in params, **params))[0]
    lengths = [len(o.token_ids) for o in out.outputs]
    assert len(lengths) == 4 and out.metrics.num_generated_tokens == sum(lengths)
    m = out.metrics
    assert m.num_output_positions == max(lengths) and m.as_dict()["output_positions"] == max(lengths)
    assert m.finished_time is not None and m.first_token_time is not None
    assert m.tpot == pytest.approx((m.finished_time - m.first_token_time) / (max(lengths) - 1))


def _output(sequences: int, tokens: int, step_s: float = 0.1) -> RequestOutput:
    metrics = RequestMetrics(0.0, first_token_time=0.1, finished_time=0.1 + step_s * (tokens - 1),
                             num_generated_tokens=sequences * tokens, num_output_positions=tokens)
    choices = [CompletionOutput(i, "t", [3] * tokens, "length") for i in range(sequences)]
    return RequestOutput("r", "p", [1], choices, True, metrics)


def test_speedup_vs_plain_counts_each_requests_first_answer_on_both_sides(capsys, monkeypatch):
    # beam search returned 4 sequences of 12 tokens in 0.8 s; plain sampling 1 of 12 tokens in 0.4 s: half as fast,
    # not twice as fast (4 x 12 tokens credited to beam search would say 2.0x)
    beams, plain = [_output(4, 12)], [_output(1, 12)]
    summary = summarize(beams, 0.8, plain_outputs=plain, plain_wall=0.4, strategy_wall=0.8)
    assert summary["speedup_vs_plain"] == pytest.approx(0.5)
    assert (summary["answer_tokens"], summary["plain_answer_tokens"]) == (12, 12)
    assert summary["strategy_tokens_per_s"] == pytest.approx(15.0) and summary["plain_tokens_per_s"] == 30.0
    # the rest of the table counts every sequence, and says so
    assert (summary["sequences"], summary["output_tokens"], summary["tokens_per_s"]) == (4, 48, 60.0)
    assert summary["tpot_p50_s"] == pytest.approx(0.1)  # per step: 1.1 s over 11 positions, not over 47 tokens
    monkeypatch.setattr("decodekit.cli.terminal.console", Console(width=200))
    render_summary(summary)
    text = capsys.readouterr().out
    assert "returned sequences" in text and "output tokens (all sequences) │ 48" in text
    assert "0.50x (15.0 vs 30.0 mean tokens/s of each request's first answer)" in text


def test_a_beam_search_comparison_run_reports_a_like_for_like_speedup(tiny_dir, tmp_path):
    recipe = _recipe(tmp_path, "model: m\nsampling: {temperature: 0}\n"
                     "strategy: {beam_search: {num_beams: 4, num_return_sequences: 4}}\n"
                     "inputs: {prompts: [a, b]}\noutputs: {compare_plain: true}\n")
    result = _invoke("run", str(recipe), *_tiny(tiny_dir), "--json", "--quiet")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    summary, rows = data["summary"], data["outputs"]
    assert summary["sequences"] == 8 and summary["output_tokens"] == sum(
        len(c["token_ids"]) for r in rows for c in r["choices"])
    assert summary["answer_tokens"] == sum(len(r["token_ids"]) for r in rows) < summary["output_tokens"]
    assert summary["speedup_vs_plain"] == pytest.approx(
        summary["strategy_tokens_per_s"] / summary["plain_tokens_per_s"])
    for row in rows:  # TPOT per position: the time after the first token over the longest beam's tokens minus one
        longest = max(len(c["token_ids"]) for c in row["choices"])
        assert row["metrics"]["output_positions"] == longest
        if longest > 1:
            assert row["metrics"]["tpot_s"] == pytest.approx(
                (row["metrics"]["e2e_s"] - row["metrics"]["ttft_s"]) / (longest - 1))


# ---- 2: temperature in sampling and in the processors list -------------------------------------------------------
@pytest.mark.parametrize("temperature", [0, 0.8])
def test_a_listed_temperature_processor_is_refused_with_a_sampling_temperature_even_at_zero(tmp_path, temperature):
    message = _error(tmp_path, f"model: m\nsampling: {{temperature: {temperature}}}\n"
                     "processors: [{temperature: {temperature: 1.5}}]\n")
    assert message.startswith(f"{tmp_path / 'r.yaml'}: processors.temperature: set either in the sampling parameters "
                              "or in the processors list, not both")
    with pytest.raises(PlanError, match="not both"):  # the Python API refuses it the same way
        Components(REGISTRY).resolve(SamplingParams(temperature=temperature,
                                                    processors=[{"temperature": {"temperature": 1.5}}]))


def test_a_listed_temperature_processor_alone_still_runs(tmp_path):
    recipe = load_recipe(_recipe(tmp_path, "model: m\nprocessors: [{temperature: {temperature: 1.5}}]\n"),
                         registry=REGISTRY)
    plan = Components(REGISTRY).resolve(recipe.default_params())
    assert [s.processor.name for s in plan.stages] == ["temperature"]


# ---- 4: request ids of a prompts file with bad lines ---------------------------------------------------------------
def test_prompts_file_ids_after_bad_lines_are_line_positions_like_decodekit_batch(tmp_path):
    lines = ['{"prompt": "one"}', "not json", '{"prompt": "three"}', '{"prompt": "x", "sampling": {"top_p": 7}}',
             '{"prompt": "five"}', '{"prompt": "six", "id": "own"}']
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    recipe = load_recipe(_recipe(tmp_path, "model: m\ninputs: {file: p.jsonl}\n"), registry=REGISTRY)
    requests, bad = read_inputs(recipe, Components(REGISTRY))
    assert [(r.id, r.prompt) for r in requests] == [("1", "one"), ("3", "three"), ("5", "five"), ("own", "six")]
    assert [(b.id, b.where) for b in bad] == [("2", "p.jsonl line 2"), ("4", "p.jsonl line 4")]
    assert [row.id for row in read_rows(tmp_path / "p.jsonl")] == ["1", "2", "3", "4", "5", "own"]


def test_a_bad_prompts_file_line_names_the_sampling_key_it_came_from(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "x", "sampling": {"temperature": -1}}\n')
    recipe = load_recipe(_recipe(tmp_path, "model: m\ninputs: {file: p.jsonl}\n"), registry=REGISTRY)
    _, bad = read_inputs(recipe, Components(REGISTRY))
    assert bad[0].message == "sampling.temperature: Input should be greater than or equal to 0, got -1"


# ---- 5: output paths ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--output", "--trace"])
@pytest.mark.parametrize("where", ["missing folder", "a folder"])
def test_an_output_path_that_cannot_be_written_fails_before_the_model_loads(tmp_path, flag, where):
    target = tmp_path / "nowhere" / "x.jsonl" if where == "missing folder" else tmp_path
    # the model does not exist: had the run got as far as loading it, the error would be about the model
    result = _invoke("run", str(_recipe(tmp_path, "model: m\ninputs: {prompts: [hi]}\n")),
                     "--set", f"model={tmp_path / 'no-model'}", flag, str(target), "--quiet")
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: {flag} {target}: ") and "no-model" not in result.stderr
    assert not (tmp_path / "nowhere").exists()


def test_rows_are_printed_when_the_output_cannot_be_written_after_the_run(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("decodekit.cli.run._check_writable", lambda path, flag: None)  # it became unwritable meanwhile
    target = tmp_path / "gone" / "out.jsonl"
    result = _invoke("run", str(_recipe(tmp_path, "model: m\ninputs: {prompts: [hi, there]}\n")), *_tiny(tiny_dir),
                     "--output", str(target), "--quiet")
    assert result.exit_code == 1 and f"cannot write {target}" in result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [(r["id"], r["prompt"]) for r in rows] == [("1", "hi"), ("2", "there")]
    assert "summary" in result.stdout  # the answers and the table were printed first


def test_a_writable_output_that_did_not_exist_is_not_left_behind_by_a_failed_run(tmp_path):
    target = tmp_path / "out.jsonl"
    result = _invoke("run", str(_recipe(tmp_path, "model: m\ninputs: {prompts: [hi]}\n")),
                     "--set", f"model={tmp_path / 'no-model'}", "--output", str(target), "--quiet")
    assert result.exit_code == 2 and "no-model" in result.stderr and not target.exists()


# ---- 6: recipe check makes run's machine checks --------------------------------------------------------------------
def _check_and_run(tmp_path: Path, tiny_dir: Path, *sets: str) -> tuple[object, object]:
    recipe = str(_recipe(tmp_path, "model: m\ninputs: {prompts: [hi]}\n"))
    extra = [arg for item in sets for arg in ("--set", item)]
    return (_invoke("recipe", "check", recipe, *_tiny(tiny_dir), *extra),
            _invoke("run", recipe, *_tiny(tiny_dir), *extra, "--quiet"))


@pytest.mark.parametrize(("setting", "message"), [
    ("device=tpu", "r.yaml: device: not a device torch knows; use cpu or cuda (cuda:N), got 'tpu'"),
    ("engine.kv_cache_memory=100B", "r.yaml: engine.kv_cache_memory: 100 bytes cannot hold 2 KV blocks"),
    ("engine.kv_cache_memory=4KB", "r.yaml: engine.kv_cache_memory: 4000 bytes holds fewer than 2 KV blocks of"),
])
def test_recipe_check_refuses_what_run_refuses_naming_the_file_and_key(tmp_path, tiny_dir, setting, message):
    check, run = _check_and_run(tmp_path, tiny_dir, setting)
    for result in (check, run):
        assert result.exit_code == 2 and message in result.stderr, result.stderr  # type: ignore[attr-defined]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize(("setting", "message"), [
    ("engine.cuda_graphs=true", "r.yaml: engine.cuda_graphs: they need the model on a CUDA device, not cpu"),
    ("device=cuda", "r.yaml: device: 'cuda' was asked for, but this torch build sees no CUDA device"),
])
def test_recipe_check_refuses_cuda_settings_on_a_machine_without_cuda(tmp_path, tiny_dir, setting, message):
    check, run = _check_and_run(tmp_path, tiny_dir, setting)
    for result in (check, run):
        assert result.exit_code == 2 and message in result.stderr, result.stderr  # type: ignore[attr-defined]


def test_the_kv_memory_bound_of_recipe_check_is_the_one_the_engine_applies(tmp_path, tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    per_block = PagedKVCache.bytes_per_token(config["num_hidden_layers"], config.get("num_key_value_heads") or heads,
                                             head_dim, torch.float32) * 16
    check, run = _check_and_run(tmp_path, tiny_dir, f"engine.kv_cache_memory={2 * per_block - 1}")
    assert check.exit_code == run.exit_code == 2  # type: ignore[attr-defined]
    assert f"fewer than 2 KV blocks of {per_block} bytes" in check.stderr  # type: ignore[attr-defined]
    check, run = _check_and_run(tmp_path, tiny_dir, f"engine.kv_cache_memory={2 * per_block}", "sampling.max_tokens=1")
    assert check.exit_code == 0, check.stderr  # type: ignore[attr-defined]
    assert run.exit_code == 0, run.stderr  # type: ignore[attr-defined]


# ---- 7: draft.dtype with model: target ----------------------------------------------------------------------------
def test_a_target_draft_with_a_dtype_of_its_own_is_refused_naming_draft_dtype(tmp_path):
    message = _error(tmp_path, "model: m\ndraft: {model: target, quantization: int8, dtype: float16}\n")
    assert message.startswith(f"{tmp_path / 'r.yaml'}: draft.dtype: `model: target` drafts with the target's own "
                              "weights")
    # the target's own dtype, or auto, is no contradiction
    for dtype in ("auto", "float32"):
        load_recipe(_recipe(tmp_path, f"model: m\ndtype: float32\ndraft: {{model: target, quantization: int8, "
                                      f"dtype: {dtype}}}\n"), registry=REGISTRY)


# ---- 8: per-prompt lists of LLM.generate --------------------------------------------------------------------------
def test_generate_refuses_per_prompt_lists_of_the_wrong_length_before_queueing_any_request(llama, tokenizer):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ConfigError, match="got 1 priorities for 2 prompts"):
        llm.generate(["a", "b"], params, priorities=[1])
    assert_idle(llm)
    with pytest.raises(ConfigError, match="got 3 SamplingParams for 2 prompts"):
        llm.generate(["a", "b"], [params] * 3)
    with pytest.raises(ConfigError, match="priorities: each is an integer"):
        llm.generate(["a", "b"], params, priorities=[1, "high"])  # type: ignore[list-item]
    assert_idle(llm)
    outs = llm.generate(["c"], params, priorities=[2])  # the next call returns its own request only
    assert len(outs) == 1 and outs[0].prompt == "c"


# ---- 9: generate's flags ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("args", "message"), [
    (("--temperature", "-1"), "error: --temperature: must be greater than or equal to 0, got -1.0\n"),
    (("--max-tokens", "0"), "error: --max-tokens: must be greater than or equal to 1, got 0\n"),
    (("--stop", ""), "error: --stop: `stop` strings must be non-empty\n"),
])
def test_generate_names_the_flag_of_an_invalid_value_in_one_line(args, message):
    result = _invoke("generate", "-p", "Hi", *args)
    assert result.exit_code == 2 and result.stderr == message


# ---- 10: messages -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "message"), [
    ("processors: [{top_k: {top_k: 3}, top_p: {top_p: 0.5}}]",
     "processors[0]: one processor per list item: this item names 2 (top_k, top_p); give each its own item"),
    ("stopping: [{max_time: {}, time_limit: {}}]", "stopping[0]: one stopping criterion per list item"),
    ("strategy: {sample: {}, beam_search: {}}", "strategy: one strategy only: got 2 (sample, beam_search)"),
    ("strategy: [sample]", "strategy: a strategy is a name or a mapping of one name to its parameters"),
    ("processors: [[top_k]]", "processors[0]: a processor is a name or a mapping of one name to its parameters"),
])
def test_a_misshapen_component_is_told_once_in_its_own_words(tmp_path, text, message):
    error = _error(tmp_path, f"model: m\n{text}\n")
    assert error == f"{tmp_path / 'r.yaml'}: {message}" or error.startswith(f"{tmp_path / 'r.yaml'}: {message}")
    assert "\n" not in error and "ComponentSpec" not in error and "Field required" not in error


def test_a_misshapen_component_in_a_prompts_file_line_is_told_the_same_way(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "x", "processors": [{"top_k": {"top_k": 3}, "top_p": {}}]}\n'
                                      '{"prompt": "y", "strategy": ["sample"]}\n')
    recipe = load_recipe(_recipe(tmp_path, "model: m\ninputs: {file: p.jsonl}\n"), registry=REGISTRY)
    _, bad = read_inputs(recipe, Components(REGISTRY))
    assert bad[0].message.startswith("processors[0]: one processor per list item")
    assert bad[1].message.startswith("strategy: a strategy is a name or a mapping")


@pytest.mark.parametrize("text", ["processors: [{choice: {choices: [yes, no]}}]",
                                  "processors: [{bad_words: {words: [on]}}]"])
def test_a_yaml_boolean_where_text_is_expected_gets_a_hint_to_quote_it(tmp_path, text):
    error = _error(tmp_path, f"model: m\n{text}\n")
    assert "Input should be a valid string, got True" in error and "quote it if you meant text" in error


def test_recipe_check_notes_a_kv_memory_it_cannot_check_without_the_model(tmp_path):
    # the bundled model before its first load has no config.json on disk (converted on first use, into the cache)
    recipe = str(_recipe(tmp_path, "model: smollm2-135m-instruct\n"))
    result = CliRunner().invoke(app, ["recipe", "check", recipe], env={"DECODEKIT_CACHE": str(tmp_path / "cache")})
    assert result.exit_code == 0, result.stderr
    assert "note: " in result.stderr and "engine.kv_cache_memory: not checked against the model's KV size" in \
        result.stderr


def _speculative_comparison(tiny_dir, tmp_path, proposer: str, k: int | None = None):
    """A recipe comparing speculative decoding with `proposer` (k adapted by cost, or fixed at `k`: asked every step,
    whatever this machine's step costs say) against plain, its requests, and an LLM on the tiny model."""
    fixed = "" if k is None else f", num_speculative_tokens: {k}"
    recipe = load_recipe(_recipe(tmp_path, "model: m\nsampling: {temperature: 0, max_tokens: 6}\n"
                                 f"strategy: {{speculative: {{proposer: {proposer}{fixed}}}}}\n"
                                 "inputs: {prompts: [a b a b, c d c d]}\noutputs: {compare_plain: true}\n"),
                         registry=REGISTRY)
    requests, bad = read_inputs(recipe, Components(REGISTRY))
    assert not bad
    return recipe, requests, LLM(str(tiny_dir), kv_cache_memory="8MiB")


def test_a_comparison_run_measures_the_step_cost_before_its_timed_runs(tiny_dir, tmp_path):
    """Speculation's cost model reads the step cost at its first step; measured then on a new machine, it landed
    inside the timed speculative run and the demo printed 0.78x instead of 1.3x. The warm-up now asks for it."""
    from decodekit.recipe_runner import run_recipe

    recipe, requests, llm = _speculative_comparison(tiny_dir, tmp_path, "ngram")
    events: list[str] = []
    generate, step_cost = llm.generate, llm.engine.step_cost
    llm.generate = lambda *a, **k: (events.append("generate"), generate(*a, **k))[1]  # type: ignore[method-assign]
    llm.engine.step_cost = lambda: (events.append("step_cost"), step_cost())[1]  # type: ignore[method-assign]
    result = run_recipe(recipe, llm, requests)
    assert events[:3] == ["generate", "step_cost", "generate"], "warm-up, the cost, then the timed run"
    assert llm.engine._step_costs, "measured (or read from the cache) before the timed run"
    assert result.plain_wall_s is not None and result.strategy_wall_s is not None


def test_a_comparisons_second_speculative_run_cannot_draft_the_first_runs_answers(tiny_dir, tmp_path):
    """The comparison runs the recipe's strategy twice (A B B A) on the same prompts; the suffix proposer keeps the
    engine's recent outputs, so the second run drafted the first one's answers and flattered the speedup."""
    from decodekit.recipe_runner import run_recipe

    # k fixed: a loaded machine's cost model may leave a short request undrafted, and only an asked proposer keeps
    # its request's answer
    recipe, requests, llm = _speculative_comparison(tiny_dir, tmp_path, "suffix", k=2)
    result = run_recipe(recipe, llm, requests)
    proposer = llm.engine.components.get("proposers", "suffix")
    # what it keeps is the second run's answers alone: the first run's were forgotten before it
    assert proposer.global_tokens == sum(len(o.outputs[0].token_ids) for o in result.outputs) > 0
