"""Sampling after the warpers draws from the distribution they define: a chi-square goodness-of-fit test over many
draws of the real pipeline (`Components.resolve` -> `apply_processors` -> `select_tokens`), with fixed seeds so
the outcome is the same on every run."""

from __future__ import annotations

import math

import pytest
import torch

from decodekit.api.params import SamplingParams
from decodekit.api.processors import BatchView, apply_processors
from decodekit.api.sampling import exponential_noise, select_tokens
from decodekit.core.plan import Components
from decodekit.core.plugin_manager import get_plugin_manager
from decodekit.core.registry import Registry

DRAWS = 20_000
ALPHA = 1e-3
ROW = torch.tensor([2.0, 1.6, 1.2, 1.0, 0.5, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0, -float("inf")])
HISTORY = [0, 1, 1, 5]


def p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Chi-square goodness of fit (scipy when installed, else the Wilson-Hilferty approximation)."""
    # expected renormalised in float64: float32 probabilities sum to 1 only within ~1e-7, and scipy refuses totals
    # that differ by more than 1.5e-8 (seen on an AVX2-only CPU)
    total = float(expected.double().sum())
    assert abs(total - 1) < 1e-5, f"the expected distribution sums to {total}, not 1"
    counts, exp = observed.double(), expected.double() / total * observed.sum()
    try:
        from scipy.stats import chisquare
    except ImportError:
        statistic = float(((counts - exp) ** 2 / exp).sum())
        k = len(counts) - 1
        z = ((statistic / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
        return 0.5 * math.erfc(z / math.sqrt(2))
    return float(chisquare(counts.numpy(), exp.numpy()).pvalue)


def components() -> Components:
    return Components(Registry.from_plugin_manager(get_plugin_manager(load_entry_points=False)))


def sample(params: SamplingParams, rows: int = DRAWS, seeded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Token counts of `rows` draws from one logits row through a request's pipeline, and the processed rows."""
    plan = components().resolve(params)
    batch = BatchView([params] * rows, [HISTORY] * rows, [1] * rows, (11,),
                      generators=[torch.Generator().manual_seed(i) for i in range(rows)] if seeded else [])
    states = [[s.processor.init_state(s.options, HISTORY[:1]) if s.processor.stateful else None
               for s in plan.stages] for _ in range(rows)]
    torch.manual_seed(1234)
    processed = apply_processors(ROW.expand(rows, -1), batch, [plan.stages] * rows, [False] * rows, states)
    tokens = select_tokens(processed, [False] * rows, batch.generators)
    return torch.bincount(tokens, minlength=len(ROW)), processed


def assert_draws_follow(counts: torch.Tensor, expected: torch.Tensor) -> None:
    support = expected > 0
    assert int(counts[~support].sum()) == 0, "a token the warpers removed was drawn"
    assert int(support.sum()) >= 2, "a single-token distribution says nothing about sampling"
    assert p_value(counts[support], expected[support]) > ALPHA


DETERMINISTIC = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k + temperature": SamplingParams(top_k=4, temperature=1.3),
    "top_p": SamplingParams(top_p=0.8),
    "min_p": SamplingParams(min_p=0.1),
    "typical_p": SamplingParams(processors=[{"typical_p": {"mass": 0.8}}]),
    "epsilon": SamplingParams(processors=[{"epsilon": {"epsilon": 0.01}}]),
    "eta": SamplingParams(processors=[{"eta": {"epsilon": 0.2}}]),
    "top_n_sigma": SamplingParams(processors=[{"top_n_sigma": {"n": 1.0}}]),
    "dynamic_temperature": SamplingParams(processors=[{"dynamic_temperature": {"temperature": 1.0, "delta": 0.5}}]),
    "mirostat": SamplingParams(processors=[{"mirostat": {"tau": 2.0}}]),
    "mirostat_v1": SamplingParams(processors=[{"mirostat_v1": {"tau": 2.0}}]),
    "penalties + top_k + top_p": SamplingParams(top_k=8, top_p=0.9, temperature=0.8, processors=[
        {"repetition_penalty": {"penalty": 1.5}}, {"frequency_penalty": {"penalty": 0.3}}]),
}


@pytest.mark.parametrize("name", sorted(DETERMINISTIC))
def test_sampling_after_warpers_draws_from_the_distribution_they_define(name):
    counts, processed = sample(DETERMINISTIC[name])
    assert torch.equal(processed, processed[:1].expand_as(processed)), "one distribution for every row"
    expected = processed[0].double().softmax(-1)
    assert int((expected == 0).sum()) > 1 or name.startswith(("temperature", "dynamic", "penalties")), \
        "the warper should remove something at these settings"
    assert_draws_follow(counts, expected)


def test_xtc_draws_from_its_mixture_of_excluded_and_untouched_distributions():
    xtc = {"threshold": 0.1, "probability": 0.3}
    counts, _ = sample(SamplingParams(processors=[{"xtc": xtc}]))
    _, excluded = sample(SamplingParams(processors=[{"xtc": {**xtc, "probability": 1.0}}]), rows=1)
    assert int(excluded[0].isinf().sum()) > 1, "at these settings XTC removes the top choices"
    expected = 0.7 * ROW.double().softmax(-1) + 0.3 * excluded[0].double().softmax(-1)
    assert_draws_follow(counts, expected)


def test_seeded_rows_draw_from_the_distribution_too():
    params = SamplingParams(top_k=6, processors=[{"xtc": {"threshold": 0.1, "probability": 0.5}}])
    counts, _ = sample(params, rows=5_000, seeded=True)
    _, excluded = sample(SamplingParams(processors=[{"xtc": {"threshold": 0.1, "probability": 1.0}}]), rows=1)
    def top6(row: torch.Tensor) -> torch.Tensor:
        return row.masked_fill(row < row.topk(6).values[-1], -float("inf")).double().softmax(-1)

    expected = 0.5 * top6(ROW) + 0.5 * top6(excluded[0])
    assert_draws_follow(counts, expected)


def test_the_chi_square_check_rejects_draws_from_another_distribution():
    counts, _ = sample(SamplingParams(temperature=1.0))
    wrong = (ROW / 0.9).double().softmax(-1)  # a 10% temperature change is visible at 20,000 draws
    assert p_value(counts[wrong > 0], wrong[wrong > 0]) < ALPHA
    assert p_value(counts[wrong > 0], ROW.double().softmax(-1)[wrong > 0]) > ALPHA


@pytest.mark.parametrize("seed", [0, 7, 123456789])
def test_exponential_noise_is_exactly_torchs_exponential_and_leaves_the_same_generator_state(seed):
    """The fast noise (uniform draws and one vectorised log1p) must be bit-equal to `Tensor.exponential_`, so a
    seeded request's tokens do not change with the implementation, and leave each generator where exponential_
    would (the row's next step draws from there)."""
    generators = [torch.Generator().manual_seed(seed + i) for i in range(3)]
    references = [torch.Generator().manual_seed(seed + i) for i in range(3)]
    for _ in range(2):  # the second draw starts from the state the first one left
        noise = exponential_noise(3, 50_000, generators)
        expected = torch.stack([torch.empty(50_000).exponential_(generator=g) for g in references])
        assert noise.dtype == torch.float32
        assert torch.equal(noise, expected)
    for generator, reference in zip(generators, references):
        assert torch.equal(generator.get_state(), reference.get_state())


def test_greedy_rows_draw_no_noise_and_sampled_rows_do_not_depend_on_them():
    """A greedy row beside a seeded sampled row neither consumes nor changes that row's draw."""
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(5))
    alone = select_tokens(logits[1:2], [False], [torch.Generator().manual_seed(9)])
    greedy_generator = torch.Generator().manual_seed(1)
    before = greedy_generator.get_state()
    mixed = select_tokens(logits, [True, False, True], [greedy_generator, torch.Generator().manual_seed(9), None])
    assert int(mixed[1]) == int(alone[0])
    assert int(mixed[0]) == int(logits[0].argmax()) and int(mixed[2]) == int(logits[2].argmax())
    assert torch.equal(greedy_generator.get_state(), before)
