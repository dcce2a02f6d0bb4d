"""Fault injection under continuous arrival: hypothesis interleaves good requests, malformed requests and requests
served by faulty plugins (raising or returning wrong shapes, NaN, all -inf in each phase: processor call, state
hooks, stopping, lifecycle hooks), engine steps and aborts, with `LLM`'s engine and with `AsyncLLM`.

Invariants: the engine step never raises; every good request's tokens equal its solo run; every bad one finishes
with an error that says why; nothing hangs (all requests end within a bounded number of steps); afterwards the
engine is idle with every KV block free and no request record.

`HYPOTHESIS_PROFILE=thorough` runs ten times as many examples.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from decodekit import LLM, AsyncLLM, SamplingParams
from decodekit.api.sequence import RequestOutput
from decodekit.core.plugin_manager import get_plugin_manager
from decodekit.models.tiny import tiny_model, tiny_tokenizer
from tests.helpers.faulty_plugins import FaultyHooks, FaultyProcessors
from tests.helpers.reference import assert_idle

THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
EXAMPLES = 1500 if THOROUGH else 150

_SPEC = {"speculative": {"proposer": "ngram", "num_speculative_tokens": 3}}
_DRAFT = {"speculative": {"proposer": "draft", "num_speculative_tokens": 2}}
GOOD: dict[str, dict] = {
    "greedy": {"temperature": 0, "ignore_eos": True},
    "seeded": {"temperature": 0.8, "seed": 5, "top_p": 0.9, "ignore_eos": True},
    "parallel": {"temperature": 1.0, "seed": 9, "n": 2, "ignore_eos": True},
    "ngram": {"temperature": 0, "ignore_eos": True, "strategy": _SPEC},
    "draft": {"temperature": 0, "ignore_eos": True, "strategy": _DRAFT},
    "beam": {"temperature": 0, "strategy": {"beam_search": {"num_beams": 2}}},
    "logprobs": {"temperature": 0.9, "seed": 2, "ignore_eos": True, "logprobs": 2, "prompt_logprobs": 1},
    "shares_a_faulty_strategy": {"temperature": 0, "ignore_eos": True, "strategy": {"flaky": {}}},
    "shares_a_faulty_processor": {"temperature": 0, "ignore_eos": True,
                                  "processors": [{"faulty": {"mode": "nan", "fault": False}}]},
}
"""Good requests: each strategy, and one that shares the faulty processor (with its fault off) with bad rows."""

_FAULTY_STRATEGIES = {"greedy": GOOD["greedy"], "seeded": GOOD["seeded"], "ngram": GOOD["ngram"],
                      "draft": GOOD["draft"], "beam": GOOD["beam"]}

# kind -> (params on top of a strategy, the start of the error)
FAULTY: dict[str, tuple[dict, str]] = {
    **{f"processor {mode}": ({"processors": [{"faulty": {"mode": mode}}]}, message) for mode, message in {
        "raise": "processor 'faulty' raised RuntimeError('boom')",
        "shape": "processor 'faulty' returned a torch.float32 tensor of shape",
        "none": "processor 'faulty' returned NoneType, not a tensor",
        "nan": "processor 'faulty' returned NaN logits",
        "posinf": "processor 'faulty' returned +inf logits",
        "neginf": "processor 'faulty' left no token to choose",
    }.items()},
    "nan after 3 tokens": ({"processors": ["late_nan"]}, "processor 'late_nan' returned NaN logits"),
    "init_state": ({"processors": [{"stateful": {"fails_in": "init_state"}}]},
                   "processor 'stateful': init_state raised ValueError('cannot start')"),
    "update_state": ({"processors": [{"stateful": {"fails_in": "update_state"}}]},
                     "processor 'stateful': update_state raised ValueError('cannot advance')"),
    "fork_state (n=2)": ({"processors": [{"stateful": {"fails_in": "fork_state"}}], "n": 2},
                         "processor 'stateful': fork_state raised ValueError('cannot fork')"),
    "strategy select": ({"strategy": {"flaky": {"fails_in": "select"}}}, "flaky failed: RuntimeError('cannot choose')"),
    "strategy propose": ({"strategy": {"flaky": {"fails_in": "propose"}}},
                         "flaky failed to propose: RuntimeError('cannot draft')"),
    "stopping criterion": ({"stopping": ["explodes"]}, "stopping criterion 'explodes' failed: RuntimeError('boom')"),
}
"""Requests served by a faulty plugin, under any strategy that accepts them."""

BAD_PROMPTS: dict[str, tuple[object, str]] = {
    "float ids": ([float(t) for t in range(5, 25)], "the prompt's token ids must be integers"),
    "nested": ([[5, 6], [7]], "the prompt's token ids must be integers"),
    "None": (None, "the prompt must be a string or a list of token ids"),
    "out of vocabulary": ([5, 6, 100_000], "the prompt has token ids outside the vocabulary"),
    "empty": ([], "the prompt is empty"),
    "too long": ([7] * 5000, "the prompt has 5000 tokens but the "),
    "hooked (request_added raises)": ([13, 14, 15], "plugin 'faulty_hooks': its decodekit_request_added hook raised"),
}
"""Malformed requests, refused at `add_request` or failed by a hook as they arrive."""

BAD_PARAMS: dict[str, tuple[SamplingParams, str]] = {
    "unknown processor": (SamplingParams().model_copy(update={"processors": ["nope"]}),
                          "processors[0]: unknown processor 'nope'"),
    "invalid params": (SamplingParams().model_copy(update={"top_p": 7.0}), "invalid sampling parameters: top_p"),
}


def _plugin_manager():
    pm = get_plugin_manager(load_entry_points=False)
    pm.register(FaultyProcessors(), "faulty_plugins")
    return pm


def _llm(hooks: bool) -> LLM:
    pm = _plugin_manager()
    if hooks:
        pm.register(FaultyHooks(), "faulty_hooks")
    model = tiny_model("llama")
    # a small KV pool, so that continuous arrival also preempts and recomputes
    return LLM(model, tiny_tokenizer(), draft=model, kv_cache_memory="160KiB", block_size=4, max_num_seqs=8,
               plugin_manager=pm)


_ENGINES: dict[str, LLM] = {}


def _shared(name: str) -> LLM:
    if name not in _ENGINES:
        _ENGINES[name] = _llm(hooks=name != "solo")
    return _ENGINES[name]


_SOLO: dict[tuple, RequestOutput] = {}


def solo_run(prompt: list[int], params: SamplingParams) -> RequestOutput:
    """The request's output when it runs alone (cached)."""
    key = (tuple(prompt), params.model_dump_json())
    if key not in _SOLO:
        out = _shared("solo").generate([prompt], params)[0]
        assert out.error is None, out.error
        _SOLO[key] = out
    return _SOLO[key]


def solo_tokens(prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """Each output's tokens when the request runs alone."""
    return [o.token_ids for o in solo_run(prompt, params).outputs]


def _same_logprobs(got: list | None, solo: list | None) -> bool:
    if got is None or solo is None:
        return got is solo
    return len(got) == len(solo) and all(
        (a is None and b is None) or (a is not None and b is not None and a.keys() == b.keys()
                                      and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a))
        for a, b in zip(got, solo))


@dataclass
class Expectation:
    """What a request must end with: its solo tokens (good), or an error starting with `error` (bad)."""

    prompt: object
    params: SamplingParams
    error: str | None = None
    aborted: bool = False
    prefix_only: bool = False  # a single-sequence request aborted midway: its tokens are a prefix of its solo run


prompts = st.lists(st.integers(14, 383), min_size=1, max_size=14)  # 13 first is the hooked prompt


class FaultInjection(RuleBasedStateMachine):
    """Requests of every kind arrive between steps of one engine; aborts cut some short."""

    def __init__(self) -> None:
        super().__init__()
        self.llm = _shared("faulty")
        self.engine = self.llm.engine
        assert not self.engine.has_unfinished_requests()
        self.expected: dict[str, Expectation] = {}
        self.finals: dict[str, RequestOutput] = {}
        self.counter = 0

    def _add(self, prompt: object, params: SamplingParams, error: str | None) -> None:
        self.counter += 1
        rid = f"r{self.counter}"
        self.expected[rid] = Expectation(prompt, params, error)
        self.engine.add_request(prompt, params, request_id=rid)  # type: ignore[arg-type]

    @rule(prompt=prompts, kind=st.sampled_from(sorted(GOOD)), max_tokens=st.integers(1, 6))
    def add_good(self, prompt: list[int], kind: str, max_tokens: int) -> None:
        self._add(prompt, SamplingParams(max_tokens=max_tokens, **GOOD[kind]), None)

    @rule(prompt=prompts, fault=st.sampled_from(sorted(FAULTY)), strategy=st.sampled_from(sorted(_FAULTY_STRATEGIES)))
    def add_faulty(self, prompt: list[int], fault: str, strategy: str) -> None:
        extra, error = FAULTY[fault]
        if strategy == "beam" and "stopping" in extra:  # refused before it runs
            error = "strategy.beam_search: stopping criteria (explodes) are not applied by beam search"
        if ("n" in extra or "strategy" in extra) and strategy not in ("greedy", "seeded"):
            return  # n > 1 is parallel sampling's; a faulty strategy replaces the strategy
        fields = {**_FAULTY_STRATEGIES[strategy], **extra}
        if strategy == "beam":  # beam search stops at EOS (no ignore_eos): a fault after 3 tokens must get to fire
            fields.setdefault("min_tokens", 6)
        self._add(prompt, SamplingParams(max_tokens=6, **fields), error)

    @rule(kind=st.sampled_from(sorted(BAD_PROMPTS)))
    def add_bad_prompt(self, kind: str) -> None:
        prompt, error = BAD_PROMPTS[kind]
        self._add(prompt, SamplingParams(max_tokens=4, temperature=0), error)

    @rule(prompt=prompts, kind=st.sampled_from(sorted(BAD_PARAMS)))
    def add_bad_params(self, prompt: list[int], kind: str) -> None:
        params, error = BAD_PARAMS[kind]
        self._add(prompt, params, error)

    @rule(steps=st.integers(1, 4))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            self._collect(self.engine.step())

    @precondition(lambda self: any(rid in self.engine.requests for rid in self.expected))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(r for r in self.expected if r in self.engine.requests)))
        expectation = self.expected[rid]
        expectation.aborted = True
        assert self.engine.abort(rid)

    def _collect(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            assert out.request_id not in self.finals, "an output after the final one"
            if out.finished:
                self.finals[out.request_id] = out

    @invariant()
    def kv_blocks_are_accounted_for(self) -> None:
        allocator = self.engine.allocator
        assert 0 <= allocator.num_free_blocks <= allocator.num_blocks
        if not self.engine.requests:
            assert allocator.num_free_blocks == allocator.num_blocks

    def teardown(self) -> None:
        for _ in range(400):  # every request here ends in far fewer steps: more means one hangs
            if not self.engine.has_unfinished_requests():
                break
            self._collect(self.engine.step())
        assert not self.engine.has_unfinished_requests(), "a request never finished"
        assert_idle(self.llm)
        assert sorted(self.finals) == sorted(self.expected), "a request got no final output"
        for rid, expectation in self.expected.items():
            _check(self.finals[rid], expectation)


def _check(out: RequestOutput, expectation: Expectation) -> None:
    if expectation.error is not None:
        assert out.finish_reason in ("error", "abort"), (out.finish_reason, expectation.error)
        if out.finish_reason == "error":
            assert out.error is not None and out.error.startswith(expectation.error), (out.error, expectation.error)
        else:
            assert expectation.aborted
        return
    assert out.error is None, out.error
    solo = solo_tokens(expectation.prompt, expectation.params)  # type: ignore[arg-type]
    got = [o.token_ids for o in out.outputs]
    if out.finish_reason == "abort":
        assert expectation.aborted
        strategy = expectation.params.strategy
        if len(solo) == 1 and (strategy is None or strategy.name != "beam_search"):  # beams are reordered
            assert got[0] == solo[0][: len(got[0])], "an aborted request's tokens are not a prefix of its solo run"
        return
    assert got == solo, "a good request's tokens differ from its solo run"
    reference = solo_run(expectation.prompt, expectation.params)  # type: ignore[arg-type]
    assert _same_logprobs(out.prompt_logprobs, reference.prompt_logprobs), "prompt logprobs differ from solo"
    for mine, theirs in zip(out.outputs, reference.outputs):
        assert _same_logprobs(mine.logprobs, theirs.logprobs), "logprobs differ from the solo run"


FaultInjection.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=20, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much], print_blob=True)
test_faults_never_reach_good_requests_or_the_engine = FaultInjection.TestCase


# ---- AsyncLLM: concurrent streams -----------------------------------------------------------------------------
_KINDS = [("good", k) for k in sorted(GOOD)] + [("faulty", k) for k in sorted(FAULTY)] + \
    [("prompt", k) for k in sorted(BAD_PROMPTS)] + [("params", k) for k in sorted(BAD_PARAMS)]


def _request(kind: tuple[str, str], prompt: list[int]) -> tuple[object, SamplingParams, str | None]:
    family, name = kind
    if family == "good":
        return prompt, SamplingParams(max_tokens=5, **GOOD[name]), None
    if family == "faulty":
        extra, error = FAULTY[name]
        return prompt, SamplingParams(max_tokens=6, **{**GOOD["greedy"], **extra}), error
    if family == "prompt":
        bad_prompt, error = BAD_PROMPTS[name]
        return bad_prompt, SamplingParams(max_tokens=4, temperature=0), error
    params, error = BAD_PARAMS[name]
    return prompt, params, error


@pytest.fixture(scope="module")
def async_llm():
    llm = AsyncLLM(engine=_llm(hooks=True).engine)
    yield llm
    llm.shutdown()


@settings(max_examples=EXAMPLES // 5, deadline=None)
@given(requests=st.lists(st.tuples(st.sampled_from(_KINDS), prompts), min_size=1, max_size=8))
def test_concurrent_streams_with_faults_all_end_and_good_ones_match_their_solo_runs(async_llm, requests):
    planned = [_request(kind, prompt) for kind, prompt in requests]

    async def stream(prompt: object, params: SamplingParams) -> RequestOutput:
        last = None
        async for out in async_llm.generate(prompt, params):
            last = out
        assert last is not None and last.finished
        return last

    async def main() -> list[RequestOutput]:
        outs = await asyncio.wait_for(asyncio.gather(*(stream(p, s) for p, s, _ in planned)), timeout=120)
        engine = async_llm.engine
        for _ in range(200):  # the engine thread drops the last record right after delivering its output
            if not engine.requests:
                break
            await asyncio.sleep(0.01)
        return outs

    outs = asyncio.run(main())
    for out, (prompt, params, error) in zip(outs, planned):
        _check(out, Expectation(prompt, params, error))
    engine = async_llm.engine
    assert not engine.requests and engine.allocator.num_free_blocks == engine.allocator.num_blocks
