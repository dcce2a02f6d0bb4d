"""A decode run's native draw (draws.c) against the built-in processors it stands for: temperature, then top_k,
top_p and min_p as `SamplingParams` applies them. The kept tokens are the processors' (up to float rounding at an
edge, where the test checks the rule's definition instead), the distribution is the processed softmax, and the
token is the inverse of that distribution's CDF at the uniform."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decodekit import SamplingParams
from decodekit.api.processors import Stage
from decodekit.api.sampling import DrawRule, draw_rule
from decodekit.execution.kernels.native import load_kernels
from decodekit.testing import logits_tensors
from decodekit_plugins import biases, sampling
from tests.helpers.draws import processed

FAST = settings(max_examples=80, deadline=None)
EDGE = 1e-5  # how near a rule's edge a token may fall either way (float32 sums and exp against torch's)


@pytest.fixture(scope="module")
def native():
    loaded = load_kernels()
    assert not isinstance(loaded, str), f"the native kernels must build on this machine: {loaded}"
    return loaded


def _near_an_edge(logits: torch.Tensor, rule: DrawRule) -> bool:
    """Whether float rounding could move a token across one of `rule`'s edges: a top_p nucleus whose mass ahead of
    some token is within `EDGE` of p, a token's probability within `EDGE` of min_p times the largest, or a top_k
    cut that dividing by the temperature moves (distinct logits equal after it)."""
    scaled = logits.double() / rule.temperature
    if rule.top_k:
        kth32 = (logits / rule.temperature).sort(descending=True).values[min(rule.top_k, logits.numel()) - 1]
        kth = logits.sort(descending=True).values[min(rule.top_k, logits.numel()) - 1]
        if not torch.equal(logits >= kth, logits / rule.temperature >= kth32):
            return True
        scaled = scaled.masked_fill(logits < kth, -float("inf"))
    probs = scaled.softmax(-1)
    if rule.top_p < 1.0:
        ranked = probs.sort(descending=True, stable=True).values
        before = ranked.cumsum(0) - ranked
        if bool(((before - rule.top_p).abs() < EDGE).any()):
            return True
        kept = before < rule.top_p
        cut = ranked[kept][-1]
        probs = probs.masked_fill(probs < cut, 0.0)  # ties with the cut: the lower tokens, both sides agree
    if rule.min_p > 0.0:
        ratio = probs / probs.max()
        if bool((((ratio - rule.min_p).abs() < EDGE) & (probs > 0)).any()):
            return True
    return False


rules = st.builds(
    DrawRule,
    temperature=st.sampled_from([0.3, 0.7, 1.0, 1.6]),
    top_k=st.sampled_from([0, 1, 3, 40, 100_000]),
    top_p=st.sampled_from([1.0, 0.05, 0.5, 0.9, 0.95]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
)


@FAST
@given(logits=logits_tensors(rows=1, vocab=st.sampled_from([7, 64, 301, 2051])), rule=rules,
       u=st.floats(0.0, 1.0, exclude_max=True))
def test_a_native_draw_keeps_the_processors_tokens_and_draws_by_the_inverse_cdf_of_their_softmax(native, logits,
                                                                                                  rule, u):
    row = logits[0]
    token, probs = native.draw_row(row, rule, u)
    expected = processed(row, rule).double().softmax(-1)
    assert abs(float(probs.double().sum()) - 1.0) < 1e-5
    assert probs[token] > 0
    cumulative = probs.double().cumsum(0)
    assert float(cumulative[token] - probs[token]) <= u + 1e-6 and u - 1e-6 <= float(cumulative[token])
    if not _near_an_edge(row, rule):
        # (a kept token whose float64 probability lies below float32's smallest normal may underflow to 0 natively,
        # which draws in float32: e.g. a logit 37 below the top one at temperature 0.3 is e^-124 of it)
        decided = (expected == 0) | (expected >= torch.finfo(torch.float32).tiny)
        assert torch.equal((probs > 0)[decided], (expected > 0)[decided]), "the kept tokens are the processors'"
        torch.testing.assert_close(probs.double(), expected, rtol=1e-5, atol=1e-7)
    else:  # an edge within rounding: the kept set still satisfies the rule's definitions
        kept = probs > 0
        assert bool(kept[row.argmax()]), "the most likely token is always kept"
        if rule.top_p < 1.0 and not rule.top_k and rule.min_p == 0.0:
            full = (row.double() / rule.temperature).softmax(-1)
            mass = float(full[kept].sum())
            assert mass >= rule.top_p - EDGE and mass - float(full[kept].min()) < rule.top_p + EDGE


def test_a_draw_with_everything_off_is_the_tempered_softmax_and_top_k_past_the_vocabulary_keeps_all(native):
    row = torch.randn(4099, generator=torch.Generator().manual_seed(3)) * 4
    for rule in (DrawRule(0.8), DrawRule(0.8, top_k=5000), DrawRule(0.8, top_p=1.0, min_p=0.0)):
        _, probs = native.draw_row(row, rule, 0.5)
        torch.testing.assert_close(probs.double(), (row.double() / 0.8).softmax(-1), rtol=1e-5, atol=1e-8)


def test_a_flat_row_keeps_a_nucleus_of_thousands_of_tokens(native):
    """A nearly uniform row over 20K tokens: the nucleus is most of the vocabulary, past the first candidate levels."""
    row = torch.randn(20_000, generator=torch.Generator().manual_seed(4)) * 0.01
    rule = DrawRule(1.0, top_p=0.9)
    _, probs = native.draw_row(row, rule, 0.3)
    expected = processed(row, rule).double().softmax(-1)
    assert 17_000 < int((probs > 0).sum()) < 19_000
    assert int(((probs > 0) != (expected > 0)).sum()) <= 2  # an edge token or two within rounding


def _stages(params: SamplingParams, listed: list[str] | None = None) -> list[Stage]:
    """The stages `params` implies (temperature, top_k, top_p, min_p in the built-ins' order), or `listed` names."""
    classes = {p.name: p for p in (sampling.TemperatureProcessor, sampling.TopKProcessor, sampling.TopPProcessor,
                                   sampling.MinPProcessor, sampling.MinTokensProcessor)}
    names = listed or [n for n in ("min_tokens", "temperature", "top_k", "top_p", "min_p")]
    stages = []
    for name in names:
        options = classes[name].from_sampling_params(params)
        if options is not None:
            stages.append(Stage(classes[name](), options))
    return stages


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(temperature=0.7), DrawRule(0.7)),
    (SamplingParams(temperature=1.0), DrawRule(1.0)),
    (SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05), DrawRule(0.8, 40, 0.95, 0.05)),
    (SamplingParams(temperature=0.6, top_p=0.9), DrawRule(0.6, top_p=0.9)),
    (SamplingParams(temperature=1e-7), None),  # the temperature processor's shifted path: not a plain softmax
    (SamplingParams(temperature=0.8, min_tokens=4), None),  # depends on the tokens generated so far
], ids=["temperature", "temperature 1", "llama.cpp's usual", "top-p", "tiny temperature", "min_tokens"])
def test_the_draw_rule_of_a_pipeline_is_what_its_sampling_fields_ask(params, expected):
    assert draw_rule(_stages(params)) == expected


def test_no_draw_rule_for_another_processor_or_another_order():
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9)
    assert draw_rule(_stages(params, ["top_p", "top_k", "temperature"])) is None  # top_p before top_k keeps others
    bias = Stage(biases.LogitBiasProcessor(), biases.LogitBiasProcessor.Params(bias={"1": 2.0}))
    assert draw_rule([*_stages(params), bias]) is None
    assert draw_rule([]) == DrawRule(1.0)


def test_a_draw_rule_refuses_values_no_processor_takes():
    for bad in ({"temperature": 0.0}, {"temperature": float("inf")}, {"top_k": -1}, {"top_p": 0.0}, {"min_p": 1.5}):
        with pytest.raises(ValueError):
            DrawRule(**bad)
