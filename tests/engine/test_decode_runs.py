"""Decode runs (`decodekit.core.decode_runs`, `dk_decode_run`): a lone greedy request's steps run natively several
at a time give exactly the tokens of step-by-step decoding (and of transformers `generate`), end where a stop id, a
stop string or max_tokens ends it, stream every token, and are not used where a token is more than an argmax."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decodekit import LLM, AsyncLLM, SamplingParams
from decodekit.api.params import ComponentSpec
from decodekit.api.sampling import DrawRule
from decodekit.core.decode_runs import FIRST_RUN_STEPS, RUN_SECONDS, timed_run_steps
from decodekit.execution.kernels.native import load_kernels
from decodekit.models.tiny import tiny_model, tiny_tokenizer
from tests.engine.test_sampling_distribution import ALPHA, p_value
from tests.helpers.draws import processed
from tests.helpers.reference import hf_greedy, random_prompts

kernels = load_kernels()
pytestmark = pytest.mark.skipif(isinstance(kernels, str), reason=f"native kernels unavailable: {kernels}")

WEIGHTS: dict[str, dict[str, Any]] = {
    "float32": {},
    "bf16 weights": {"quantization": "bf16"},
    "int8 weights": {"quantization": "int8"},
    "bf16 KV pool": {"kv_cache_dtype": "bfloat16"},
}


def _pair(model: Any, steps: int = 8, **options: Any) -> tuple[LLM, LLM]:
    """Two engines on copies of `model`: one decoding step by step, one with runs of `steps`."""
    options = {"device": "cpu", "fused_decoder": True, "kv_cache_memory": "8MiB", "block_size": 4, **options}
    return (LLM(copy.deepcopy(model), tiny_tokenizer(), decode_run_steps=1, **options),
            LLM(copy.deepcopy(model), tiny_tokenizer(), decode_run_steps=steps, **options))


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


@pytest.mark.parametrize("weights", list(WEIGHTS))
def test_runs_give_the_step_by_step_tokens_for_every_weight_kind(weights):
    model = tiny_model("qwen2", seed=3)  # q/k/v biases too
    steps, runs = _pair(model, **WEIGHTS[weights])
    assert runs.engine.model.runs_decode
    prompts = random_prompts(3, 3, 30, seed=4)
    params = SamplingParams(temperature=0, max_tokens=29, ignore_eos=True)
    for prompt in prompts:  # one at a time: a lone request is what runs
        assert _tokens(runs, [prompt], params) == _tokens(steps, [prompt], params)
    assert runs.engine.decode_run_tokens > 0 and steps.engine.decode_run_tokens == 0


def test_float32_runs_equal_transformers_generate_across_block_boundaries(llama):
    _, runs = _pair(llama, steps=5)
    for prompt in random_prompts(4, 2, 40, seed=8):
        out = runs.generate([prompt], SamplingParams(temperature=0, max_tokens=37))[0]
        assert out.outputs[0].token_ids == hf_greedy(llama, prompt, 37)
    assert runs.engine.decode_run_tokens > 0


def test_a_run_ends_after_a_stop_id_a_stop_string_or_max_tokens_as_steps_do(llama):
    steps, runs = _pair(llama)
    prompt = random_prompts(1, 6, 7, seed=2)[0]
    free = _tokens(steps, [prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    stop_id = free[11]  # mid-run: the run's later tokens must be dropped
    by_id = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id])
    assert _tokens(runs, [prompt], by_id) == _tokens(steps, [prompt], by_id) == [free[: free.index(stop_id) + 1]]
    text = steps.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    by_text = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    a, b = runs.generate([prompt], by_text)[0].outputs[0], steps.generate([prompt], by_text)[0].outputs[0]
    assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    assert b.finish_reason == "stop"
    short = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    out = runs.generate([prompt], short)[0].outputs[0]
    assert out.token_ids == free[:13] and out.finish_reason == "length"


def test_every_token_of_a_run_is_streamed_in_order(llama):
    _, runs = _pair(llama)
    engine = runs.engine
    prompt = random_prompts(1, 5, 6, seed=5)[0]
    request = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=30))
    streamed: list[int] = []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request.request_id:
                streamed.extend(out.delta_token_ids[0] if out.delta_token_ids else [])
                final = out
    want = hf_greedy(llama, prompt, 30)
    assert final is not None and final.finished and final.outputs[0].token_ids == want
    assert streamed == want
    assert engine.decode_run_tokens > 0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, seed=1, max_tokens=20),
    SamplingParams(temperature=0, max_tokens=20, min_tokens=5),
    SamplingParams(temperature=0, max_tokens=20, logprobs=2),
    SamplingParams(temperature=0, max_tokens=20, n=2),
], ids=["seeded sampling", "a processor", "logprobs", "n=2"])
def test_no_run_where_a_token_is_more_than_the_argmax(llama, params):
    steps, runs = _pair(llama)
    prompt = random_prompts(1, 5, 6, seed=1)[0]
    a, b = runs.generate([prompt], params)[0], steps.generate([prompt], params)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert runs.engine.decode_run_tokens == 0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, processors=[{"name": "presence_penalty",
                                                                             "params": {"penalty": 0.5}}]),
    SamplingParams(temperature=0.8, max_tokens=20, logprobs=2),
    SamplingParams(temperature=0.8, max_tokens=20, min_tokens=5),
], ids=["a penalty", "logprobs", "min_tokens"])
def test_no_run_for_an_unseeded_sampled_request_whose_tokens_are_more_than_a_draw_rule(llama, params):
    _, runs = _pair(llama)
    out = runs.generate([random_prompts(1, 5, 6, seed=1)[0]], params)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 20
    assert runs.engine.decode_run_tokens == 0


def _two_step_distribution(model: Any, prompt: list[int], rule: DrawRule) -> torch.Tensor:
    """The target's distribution of the second token after `prompt` drawn by `rule` (the built-in processors it
    stands for, applied to transformers' logits): the sum over every first token of its chance times the second's
    given it."""
    with torch.inference_mode():
        first = processed(model(torch.tensor([prompt])).logits[0, -1], rule).double().softmax(-1)
        batch = torch.tensor([[*prompt, a] for a in range(first.shape[0])])
        logits = model(batch).logits[:, -1]
        second = torch.stack([processed(row, rule) for row in logits]).double().softmax(-1)
    return (first[:, None] * second).sum(0)


def _second_token_p_value(outs: list[Any], expected: torch.Tensor) -> float:
    """Chi-square p-value of the outputs' second tokens against `expected`, tokens expected fewer than 5 times pooled
    into one bin (the test's approximation needs ~5 a bin)."""
    counts = torch.zeros(expected.shape[0], dtype=torch.float64)
    for out in outs:
        counts[out.outputs[0].token_ids[1]] += 1
    common = expected * len(outs) >= 5
    return p_value(torch.cat([counts[common], counts[~common].sum()[None]]),
                   torch.cat([expected[common], expected[~common].sum()[None]]))


@pytest.mark.parametrize("rule", [DrawRule(0.6), DrawRule(1.3, top_k=12, top_p=0.8, min_p=0.02)],
                         ids=["temperature", "top_k, top_p, min_p"])
def test_a_lone_unseeded_sampled_request_runs_natively_and_draws_the_models_distribution(rule):
    """Requests served one at a time (`max_num_seqs` 1), each decoding its tokens after the first in a native run
    that draws by its rule: the second token's chi-square against the target's two-step distribution."""
    model = tiny_model("llama", seed=5)
    llm = LLM(copy.deepcopy(model), tiny_tokenizer(), max_num_seqs=1, decode_run_steps=8, device="cpu",
              fused_decoder=True, kv_cache_memory="8MiB", block_size=4)
    draws = 600
    prompt = random_prompts(1, 8, 9, seed=30)[0]
    torch.manual_seed(0)  # unseeded requests draw from torch's global generator
    params = SamplingParams(temperature=rule.temperature, top_k=rule.top_k, top_p=rule.top_p, min_p=rule.min_p,
                            max_tokens=4, ignore_eos=True)
    outs = llm.generate([prompt] * draws, params)
    assert llm.engine.decode_run_tokens == 3 * draws  # every token after the prefill's came from a run
    assert _second_token_p_value(outs, _two_step_distribution(model, prompt, rule)) > ALPHA


def test_a_request_arriving_during_runs_is_served_and_both_stay_exact(llama):
    _, runs = _pair(llama)
    engine = runs.engine
    first, second = random_prompts(2, 4, 20, seed=9)
    params = SamplingParams(temperature=0, max_tokens=30)
    a = engine.add_request(first, params)
    outputs: dict[str, list[int]] = {}
    for _ in range(3):  # the lone request runs first
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
    assert engine.decode_run_tokens > 0
    b = engine.add_request(second, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    assert outputs[a.request_id] == hf_greedy(llama, first, 30)
    assert outputs[b.request_id] == hf_greedy(llama, second, 30)


def test_a_raised_interrupt_ends_every_run_after_one_token_and_the_tokens_stay_exact(llama):
    steps, runs = _pair(llama, steps=8)
    engine = runs.engine
    prompt = random_prompts(1, 4, 20, seed=21)[0]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = _tokens(steps, [prompt], params)[0]
    request = engine.add_request(prompt, params)
    engine.step()  # the prefill: its token is not a run's
    engine.run_interrupt.raise_()
    while engine.has_unfinished_requests():
        before = engine.decode_run_tokens
        engine.step()
        assert engine.decode_run_tokens - before <= 1  # raised: each run ends after the token it is making
    assert engine.decode_run_tokens >= 18  # and the runs still ran (a run makes at least one token)
    assert request.sequences[0].generated_ids == expected
    engine.run_interrupt.lower()
    before = engine.decode_run_tokens
    assert _tokens(runs, [prompt], params)[0] == expected
    assert engine.decode_run_tokens - before == 19  # lowered: whole runs again


def test_a_request_handed_to_a_running_async_engine_ends_the_run_in_progress(llama):
    """A command put while a run is in progress (simulated: put from inside the run's native call's caller, just
    before the call) ends that run after its first token, and is taken at once."""
    llm = AsyncLLM(copy.deepcopy(llama), tiny_tokenizer(), device="cpu", fused_decoder=True,
                   kv_cache_memory="8MiB", block_size=4, decode_run_steps=32)
    model = llm.engine.model
    lengths: list[int] = []
    run = model.decode_run

    def arrives_during(*args: Any, **kwargs: Any) -> list[int] | None:
        if not lengths:  # the first run: an abort of its own request comes in while it runs
            llm.abort("long")
        tokens = run(*args, **kwargs)
        lengths.append(len(tokens or []))
        return tokens

    model.decode_run = arrives_during  # type: ignore[method-assign]
    prompt = random_prompts(1, 4, 10, seed=22)[0]

    async def stream() -> Any:
        last = None
        async for out in llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                                      request_id="long"):
            last = out
        return last

    try:
        last = asyncio.run(stream())
        assert not llm.engine.run_interrupt.raised  # lowered when the engine took the abort
    finally:
        llm.shutdown()
    assert lengths[0] == 1  # not 32: the run stopped for the abort
    assert last.outputs[0].finish_reason == "abort" and len(last.outputs[0].token_ids) < 8


@settings(max_examples=30, deadline=None)
@given(limit=st.integers(1, 64), token_seconds=st.one_of(st.none(), st.floats(1e-5, 1.0)),
       slower=st.floats(1.0, 10.0))
def test_a_run_lasts_about_run_seconds_and_never_fewer_than_eight_steps_where_the_limit_allows(limit, token_seconds,
                                                                                                 slower):
    steps = timed_run_steps(limit, token_seconds)
    assert min(limit, FIRST_RUN_STEPS) <= steps <= limit
    if token_seconds is None:
        assert steps == min(limit, FIRST_RUN_STEPS)
        return
    if steps > FIRST_RUN_STEPS:  # cut by time, not by the floor: about RUN_SECONDS of tokens
        assert steps * token_seconds <= RUN_SECONDS + 1e-9
    assert timed_run_steps(limit, token_seconds * slower) <= steps  # a slower token: never a longer run


def test_the_engine_sizes_runs_by_its_timing_of_earlier_runs(llama):
    _, runs = _pair(llama, steps=32)
    engine = runs.engine
    prompt = random_prompts(1, 4, 10, seed=23)[0]
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    engine.step()  # the prefill
    made = []
    for slow in (None, 0.05, RUN_SECONDS / 20):  # untimed; a slow token; a fast one
        engine.run_token_seconds = slow
        before = engine.decode_run_tokens
        engine.step()
        made.append(engine.decode_run_tokens - before)
    assert made == [FIRST_RUN_STEPS, FIRST_RUN_STEPS, 20]
    assert engine.run_token_seconds is not None and engine.run_token_seconds > 0  # the runs were timed


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(run=st.integers(2, 9), max_tokens=st.integers(1, 30), length=st.integers(1, 25), seed=st.integers(0, 99))
def test_any_run_length_gives_transformers_tokens(llama, run, max_tokens, length, seed):
    llm = LLM(copy.deepcopy(llama), tiny_tokenizer(), device="cpu", fused_decoder=True, kv_cache_memory="8MiB",
              block_size=4, decode_run_steps=run)
    prompt = random_prompts(1, length, length + 1, seed=seed)[0]
    with torch.no_grad():
        # EOS ends a run as it ends transformers' generate
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))[0]
    assert out.outputs[0].token_ids == hf_greedy(llama, prompt, max_tokens)


def test_requests_queued_behind_max_num_seqs_1_still_let_the_running_one_run(llama):
    _, runs = _pair(llama, max_num_seqs=1)
    prompts = random_prompts(3, 4, 12, seed=13)
    outs = runs.generate(prompts, SamplingParams(temperature=0, max_tokens=20))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(llama, p, 20) for p in prompts]
    assert runs.engine.decode_run_tokens > 0


def test_runs_keep_a_sliding_window_model_exact():
    model = tiny_model("mistral", sliding_window=6)
    steps, runs = _pair(model, steps=7)
    params = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
    for prompt in random_prompts(2, 3, 20, seed=21):
        assert _tokens(runs, [prompt], params) == _tokens(steps, [prompt], params)
    assert runs.engine.decode_run_tokens > 0


def _speculative(**options: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, strategy={"speculative": {
        "proposer": "ngram", "num_speculative_tokens": 3, **options}})


@pytest.mark.parametrize("proposer", ["ngram", "suffix"])
def test_speculation_runs_natively_where_its_proposers_find_nothing_with_the_plain_tokens(proposer):
    # prompts that repeat (drafts found and verified) and that do not (nothing to draft: the steps run natively)
    model = tiny_model("llama", seed=5)
    plain, spec = _pair(model)
    params = _speculative(proposer=proposer)
    prompts = [(p * 4)[:32] for p in random_prompts(2, 3, 8, seed=9)] + random_prompts(2, 20, 30, seed=10)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for prompt in prompts:  # one at a time: a lone request is what runs
        out = spec.generate([prompt], params)[0]
        assert out.outputs[0].token_ids == _tokens(plain, [prompt], greedy)[0]
    assert 0 < spec.engine.decode_run_tokens < 4 * 40


def test_the_draft_model_catches_up_on_the_tokens_of_runs_between_its_drafts(monkeypatch):
    # the draft model drafts every other step; in between nothing is drafted and the steps run natively: its next
    # drafts start from the tokens the runs added (accepted drafts prove its cache holds them)
    model = tiny_model("llama", seed=5)
    plain, spec = _pair(model, draft=copy.deepcopy(model))
    proposer = spec.engine.components.get("proposers", "draft")
    draft = type(proposer).propose
    calls = []

    def every_other(self, ctx, seqs, ks, options):
        calls.append(1)
        if len(calls) % 2:
            return [[] for _ in seqs], [None for _ in seqs]
        return draft(self, ctx, seqs, ks, options)

    monkeypatch.setattr(type(proposer), "propose", every_other)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for prompt in random_prompts(2, 10, 20, seed=12):
        out = spec.generate([prompt], _speculative(proposer="draft"))[0]
        assert out.outputs[0].token_ids == _tokens(plain, [prompt], greedy)[0]
        assert out.metrics.num_accepted_tokens > 0  # the same model drafts: every draft token is right
    assert spec.engine.decode_run_tokens > 0


def test_speculation_does_not_run_natively_when_asked_not_to_or_seeded():
    model = tiny_model("llama", seed=5)
    _, spec = _pair(model)
    prompts = random_prompts(2, 20, 30, seed=10)
    spec.generate(prompts[:1], _speculative(runs_without_drafts=0))
    seeded = _speculative()
    seeded.temperature, seeded.seed = 0.8, 3
    spec.generate(prompts[1:], seeded)
    assert spec.engine.decode_run_tokens == 0
    strategy = spec.engine.components.get("strategies", "speculative")
    request = spec.engine.add_request(prompts[0], _speculative(proposer="eagle"))
    assert strategy.steps_without_drafts(request) == 0  # the head reads hidden states a run does not compute


def test_unseeded_sampled_speculation_whose_proposers_find_nothing_runs_natively_and_keeps_the_distribution():
    """The second token of requests served one at a time, their n-gram proposer finding nothing in a prompt without
    repeats, so every token after the prefill's comes from runs drawn by the request's rule: its chi-square against
    the target's two-step distribution."""
    model = tiny_model("llama", seed=5)
    llm = LLM(copy.deepcopy(model), tiny_tokenizer(), max_num_seqs=1, decode_run_steps=8, device="cpu",
              fused_decoder=True, kv_cache_memory="8MiB", block_size=4)
    rule, draws = DrawRule(0.9, top_p=0.85), 600
    prompt = list(range(3, 12))  # no token twice: nothing for the n-gram proposer to match
    params = SamplingParams(temperature=rule.temperature, top_p=rule.top_p, max_tokens=4, ignore_eos=True,
                            strategy={"speculative": {"proposer": "ngram", "num_speculative_tokens": 3,
                                                      "proposer_options": {"prompt_lookup_min": 2}}})
    torch.manual_seed(0)
    outs = llm.generate([prompt] * draws, params)
    assert all(o.error is None for o in outs)
    assert llm.engine.decode_run_tokens >= 2 * draws  # at least the second and third tokens from runs
    assert _second_token_p_value(outs, _two_step_distribution(model, prompt, rule)) > ALPHA


def _run_lengths(llm: LLM) -> list[int]:
    """Record the length of every decode run `llm`'s engine makes (in a list it returns)."""
    lengths: list[int] = []
    make = llm.engine._decode_run

    def recorded(run, ctx, **options):
        lengths.append(run.steps)
        return make(run, ctx, **options)

    llm.engine._decode_run = recorded
    return lengths


def test_a_chain_that_keeps_finding_nothing_is_asked_after_ever_longer_runs():
    model = tiny_model("llama", seed=5)
    plain, spec = _pair(model, steps=64)
    lengths = _run_lengths(spec)
    prompt = random_prompts(1, 20, 21, seed=10)[0]
    params = _speculative(runs_without_drafts=2, proposer_options={"prompt_lookup_min": 3})
    params.max_tokens = 60
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    out = spec.generate([prompt], params)[0]
    assert out.outputs[0].token_ids == _tokens(plain, [prompt], greedy)[0] and out.metrics.num_draft_tokens == 0
    # each further miss in a row doubles the run (up to 16x runs_without_drafts); the last one ends at max_tokens
    assert lengths[:-1] == [2, 4, 8, 16] and lengths[-1] == 60 - 1 - sum(lengths[:-1]) <= 32


def test_a_request_whose_speculation_cannot_pay_decodes_in_plain_runs_and_calibrates_with_them(monkeypatch):
    import decodekit_plugins.speculative as speculative

    model = tiny_model("llama", seed=5)
    plain, spec = _pair(model)
    monkeypatch.setattr(speculative, "draft_lengths", lambda seqs, *args, **kw: [0] * len(seqs))  # never pays
    lengths = _run_lengths(spec)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                            strategy={"speculative": {"proposer": "suffix", "cost_model": "default"}})
    prompt = random_prompts(1, 20, 21, seed=11)[0]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out = spec.generate([prompt], params)[0]
    assert out.outputs[0].token_ids == _tokens(plain, [prompt], greedy)[0] and out.metrics.num_draft_tokens == 0
    assert lengths and all(n == 8 for n in lengths[:-1])  # plain decoding's runs, not runs_without_drafts' 4
    strategy = spec.engine.components.get("strategies", "speculative")
    (calibrated,) = strategy.calibrations.values()
    assert calibrated.observed(1) and calibrated.records >= sum(lengths[:-1])  # every run token timed one row


def _draft_engine(self_draft: bool = True) -> tuple[LLM, LLM, Any]:
    """Plain and speculative engines on a tiny llama, the speculative one drafting with an int8 copy of itself (which
    adopts the target's keys and values, so each draft starts from one pending token) or with a separate copy of the
    model, and that draft's `ProposerModel`."""
    model = tiny_model("llama", seed=5)
    draft = {"draft": "target", "draft_quantization": "int8"} if self_draft else {"draft": copy.deepcopy(model)}
    plain, spec = _pair(model, **draft)
    return plain, spec, spec.engine.components.get("proposers", "draft")._model()


def _two_caches(draft: Any, run_key: int, loop_key: int, prompt: list[int], steps: int) -> tuple[int, int]:
    """Two sequences of `draft` holding `prompt` but its last token, with room for `steps` more: one for a run, one
    for the one-token forwards it is compared with (no prefix shared: both compute the prompt alike)."""
    for key in (run_key, loop_key):
        assert draft.reserve(key, len(prompt) + steps)
        draft.forward([(key, prompt[:-1])])
    return run_key, loop_key


def _same_caches_then_released(draft: Any, run_key: int, loop_key: int, last: int, cached: int) -> None:
    """Both sequences hold `cached` tokens with the same keys and values (the next forward of `last` scores the
    same), then are released."""
    assert draft.num_cached(run_key) == draft.num_cached(loop_key) == cached
    assert torch.equal(draft.forward([(run_key, [last])]), draft.forward([(loop_key, [last])]))
    for key in (run_key, loop_key):
        draft.release(key)


@pytest.mark.parametrize("steps", [1, 3, 7])
def test_a_draft_models_greedy_run_gives_its_one_token_forwards_argmaxes_and_leaves_the_same_cache(steps):
    _, _, draft = _draft_engine(self_draft=False)
    assert draft.runs_decode
    for n, prompt in enumerate(random_prompts(3, 5, 19, seed=20)):  # block size 4: runs cross blocks
        run_key, loop_key = _two_caches(draft, 1000 + n, 2000 + n, prompt, steps)
        run = draft.greedy_run(run_key, prompt[-1], steps)
        loop, last = [], prompt[-1]
        for _ in range(steps):
            last = int(draft.forward([(loop_key, [last])])[0].argmax())
            loop.append(last)
        assert run == loop
        _same_caches_then_released(draft, run_key, loop_key, loop[-1], len(prompt) + steps - 1)


def test_a_lone_greedy_request_drafts_natively_and_drafts_what_the_forwards_would(monkeypatch):
    plain, spec, draft = _draft_engine()
    runs: list[int] = []
    greedy_run = type(draft).greedy_run

    def counted(self, key, token, steps):
        tokens = greedy_run(self, key, token, steps)
        runs.append(0 if tokens is None else len(tokens))
        return tokens

    monkeypatch.setattr(type(draft), "greedy_run", counted)
    prompts = random_prompts(3, 10, 20, seed=12)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    params = _speculative(proposer="draft")
    native = [spec.generate([prompt], params)[0] for prompt in prompts]
    assert runs and all(runs)
    for prompt, out in zip(prompts, native):
        assert out.outputs[0].token_ids == _tokens(plain, [prompt], greedy)[0]
        assert out.metrics.num_accepted_tokens > 0
    # with the runs off, the one-token forwards draft the same tokens: the same counts drafted and accepted
    monkeypatch.setattr(type(draft), "greedy_run", lambda self, key, token, steps: None)
    looped = [spec.generate([prompt], params)[0] for prompt in prompts]
    assert [(o.metrics.num_draft_tokens, o.metrics.num_accepted_tokens) for o in looped] == \
        [(o.metrics.num_draft_tokens, o.metrics.num_accepted_tokens) for o in native]


def test_no_native_draft_where_a_draft_token_is_more_than_the_argmax_or_several_sequences_draft(monkeypatch):
    _, spec, draft = _draft_engine()
    calls: list[int] = []
    monkeypatch.setattr(type(draft), "greedy_run", lambda self, key, token, steps: calls.append(1))
    prompts = random_prompts(2, 10, 20, seed=13)
    penalized = _speculative(proposer="draft")
    penalized.processors = [{"repetition_penalty": {"penalty": 1.3}}]  # the draft applies it to its own logits
    spec.generate(prompts[:1], penalized)
    sampled = _speculative(proposer="draft")
    sampled.temperature, sampled.seed = 0.8, 3
    spec.generate(prompts[:1], sampled)
    spec.generate(prompts, _speculative(proposer="draft"))  # two sequences draft in batched forwards
    assert not calls


def _inverse_cdf(q: torch.Tensor, u: float) -> int:
    """The first token whose running sum of `q` passes `u` (in float64)."""
    return int(torch.searchsorted(q.double().cumsum(0), torch.tensor([u], dtype=torch.float64), right=True)[0])


@pytest.mark.parametrize("steps, rule", [(1, DrawRule(0.8)), (3, DrawRule(0.8)), (7, DrawRule(0.8)),
                                         (5, DrawRule(1.2, top_k=9, top_p=0.7, min_p=0.03))])
def test_a_draft_models_sample_run_draws_each_token_by_the_inverse_cdf_of_its_forwards_processed_softmax(steps, rule):
    _, _, draft = _draft_engine(self_draft=False)
    uniforms = torch.rand(steps, dtype=torch.float64, generator=torch.Generator().manual_seed(steps)).tolist()
    for n, prompt in enumerate(random_prompts(3, 5, 19, seed=21)):  # block size 4: runs cross blocks
        run_key, loop_key = _two_caches(draft, 3000 + n, 4000 + n, prompt, steps)
        run = draft.sample_run(run_key, prompt[-1], steps, rule, uniforms)
        assert run is not None
        tokens, q = run
        assert q.shape[0] == steps and q.dtype == torch.float32
        loop, last = [], prompt[-1]
        for i in range(steps):
            want = processed(draft.forward([(loop_key, [last])])[0], rule).softmax(-1)
            torch.testing.assert_close(q[i], want, rtol=1e-5, atol=1e-7)  # the distribution each token came from
            last = _inverse_cdf(q[i], uniforms[i])
            loop.append(last)
        assert tokens == loop
        _same_caches_then_released(draft, run_key, loop_key, loop[-1], len(prompt) + steps - 1)


def test_a_lone_unseeded_sampled_request_drafts_natively_and_keeps_the_targets_distribution(monkeypatch):
    """Chi-square on the second token (a drafted position) of requests served one at a time (`max_num_seqs` 1, so
    each drafts alone, natively) against the target's own two-step distribution, from transformers' logits."""
    model = tiny_model("llama", seed=5)
    options = {"device": "cpu", "fused_decoder": True, "kv_cache_memory": "8MiB", "block_size": 4}
    spec = LLM(copy.deepcopy(model), tiny_tokenizer(), max_num_seqs=1, draft="target", draft_quantization="int8",
               **options)
    draft = spec.engine.components.get("proposers", "draft")._model()
    runs: list[int] = []
    sample_run = type(draft).sample_run

    def counted(self, key, token, steps, rule, uniforms):
        out = sample_run(self, key, token, steps, rule, uniforms)
        runs.append(0 if out is None else len(out[0]))
        return out

    monkeypatch.setattr(type(draft), "sample_run", counted)
    temperature, draws = 0.6, 600
    prompt = random_prompts(1, 8, 9, seed=30)[0]
    params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True, strategy={"speculative": {
        "proposer": "draft", "num_speculative_tokens": 2}})
    torch.manual_seed(0)  # unseeded requests draw from torch's global generator
    outs = spec.generate([prompt] * draws, params)
    assert runs and all(runs)
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    assert _second_token_p_value(outs, _two_step_distribution(model, prompt, DrawRule(temperature))) > ALPHA


def test_no_native_draw_for_a_seeded_request_or_one_with_more_than_a_draw_rule(monkeypatch):
    _, spec, draft = _draft_engine()
    calls: list[int] = []
    monkeypatch.setattr(type(draft), "sample_run", lambda self, *args: calls.append(1))
    prompt = random_prompts(1, 10, 20, seed=14)[0]
    seeded = _speculative(proposer="draft")
    seeded.temperature, seeded.seed = 0.8, 3  # its draws come from its generator, as batched
    spec.generate([prompt], seeded)
    penalized = _speculative(proposer="draft")
    penalized.temperature, penalized.top_p = 0.8, 0.9  # a penalty reads the history: the forwards draft
    penalized.processors = [ComponentSpec(name="presence_penalty", params={"penalty": 0.5})]
    spec.generate([prompt], penalized)
    assert not calls
    unseeded = _speculative(proposer="draft")
    unseeded.temperature, unseeded.top_p = 0.8, 0.9
    spec.generate([prompt], unseeded)
    assert calls  # the same request unseeded, without the penalty: native
