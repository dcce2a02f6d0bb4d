"""Invariants of the processors (hypothesis), routing of per-request pipelines, and the catalogue running through a
real engine under continuous batching (tiny model): seeded samples do not depend on the batch, constraints hold."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from decodekit import LLM, SamplingParams
from decodekit.api.params import ComponentSpec
from decodekit.api.processors import BatchView, apply_processors
from decodekit.core.plan import Components
from decodekit.core.plugin_manager import get_plugin_manager
from decodekit.core.registry import Registry
from decodekit.testing import histories, logits_tensors
from decodekit_plugins import biases, penalties, sampling
from tests.helpers.reference import random_prompts

FAST = settings(max_examples=50, deadline=None)
INF = float("inf")


def view(options, hist=None, prompt_lens=None):
    n = len(options)
    return BatchView([SamplingParams()] * n, hist or [[1]] * n, prompt_lens or [0] * n, (0,), options=options)


def kept(row: torch.Tensor) -> set[int]:
    return set(row.isfinite().nonzero()[:, 0].tolist())


@FAST
@given(logits=logits_tensors(), data=st.data())
def test_top_k_keeps_at_least_k_and_only_tokens_at_least_the_kth_largest_ties_kept(logits, data):
    ks = [data.draw(st.integers(1, 60)) for _ in range(len(logits))]
    out = sampling.TopKProcessor()(logits, view([sampling.TopKProcessor.Params(top_k=k) for k in ks]))
    for row, k in zip(range(len(logits)), ks):
        finite = logits[row][logits[row].isfinite()]
        kth = finite.sort(descending=True).values[min(k, len(finite)) - 1]
        assert kept(out[row]) == {i for i, x in enumerate(logits[row].tolist()) if x >= kth and x > -INF}
        assert len(kept(out[row])) >= min(k, len(finite))


@FAST
@given(logits=logits_tensors(), data=st.data())
def test_top_p_keeps_the_smallest_set_of_most_likely_tokens_reaching_p(logits, data):
    ps = [data.draw(st.floats(0.01, 1.0)) for _ in range(len(logits))]
    out = sampling.TopPProcessor()(logits, view([sampling.TopPProcessor.Params(top_p=p) for p in ps]))
    probs = logits.double().softmax(-1)
    for row, p in enumerate(ps):
        keep = sorted(kept(out[row]))
        dropped = [i for i in range(logits.shape[-1]) if i not in keep]
        mass = float(probs[row, keep].sum())
        assert mass >= p - 1e-5, "the kept set must reach p"
        assert mass - float(probs[row, keep].min()) < p + 1e-5, "without its least likely token it must not"
        if dropped:
            assert float(probs[row, keep].min()) >= float(probs[row, dropped].max()) - 1e-7, "most likely first"


@FAST
@given(logits=logits_tensors(), data=st.data())
def test_min_p_keeps_exactly_tokens_with_p_at_least_min_p_times_p_max(logits, data):
    ps = [data.draw(st.floats(0.01, 1.0)) for _ in range(len(logits))]
    out = sampling.MinPProcessor()(logits, view([sampling.MinPProcessor.Params(min_p=p) for p in ps]))
    probs = logits.double().softmax(-1)
    for row, p in enumerate(ps):
        threshold = p * float(probs[row].max())
        for i, q in enumerate(probs[row].tolist()):
            if abs(q - threshold) > 1e-6 * threshold:  # float32 rounding may decide a token at the threshold
                assert (i in kept(out[row])) == (q >= threshold)


@FAST
@given(logits=logits_tensors(), data=st.data())
def test_temperature_preserves_the_argmax_and_the_order(logits, data):
    ts = [data.draw(st.floats(0.05, 20.0)) for _ in range(len(logits))]
    out = sampling.TemperatureProcessor()(logits, view([sampling.TemperatureProcessor.Params(temperature=t)
                                                        for t in ts]))
    assert torch.equal(out.argmax(-1), logits.argmax(-1))
    finite = logits.isfinite()
    for row in range(len(logits)):
        a, b = logits[row][finite[row]], out[row][finite[row]]
        assert bool(((a[:, None] < a[None, :]) <= (b[:, None] <= b[None, :])).all()), "order preserved"


PENALTIES = [
    (penalties.RepetitionPenaltyProcessor, st.floats(1.0, 3.0), False),
    (penalties.PresencePenaltyProcessor, st.floats(0.0, 2.0), True),
    (penalties.FrequencyPenaltyProcessor, st.floats(0.0, 2.0), True),
]


@pytest.mark.parametrize(("cls", "strength", "generated_only"), PENALTIES, ids=lambda p: getattr(p, "name", ""))
@FAST
@given(logits=logits_tensors(), data=st.data())
def test_penalties_never_favour_a_seen_token(cls, strength, generated_only, logits, data):
    """A seen token's logit never rises, its odds against any unseen token never rise, the seen tokens' total
    probability never rises, and unseen tokens are untouched. (A single seen token's probability can rise under
    repetition or frequency penalties when another seen token loses more: see the test below.)"""
    n, vocab = logits.shape
    hist = [data.draw(histories(vocab, min_size=1)) for _ in range(n)]
    prompt_lens = [data.draw(st.integers(0, len(h))) for h in hist]
    opts = [cls.Params(penalty=data.draw(strength)) for _ in range(n)]
    out = cls()(logits, view(opts, hist, prompt_lens))
    before, after = logits.double().softmax(-1), out.double().softmax(-1)
    for row in range(n):
        seen = set(hist[row][prompt_lens[row]:] if generated_only else hist[row])
        unseen = [i for i in range(vocab) if i not in seen]
        seen_ids = sorted(seen)
        assert bool((out[row, seen_ids] <= logits[row, seen_ids]).all())
        assert torch.equal(out[row, unseen], logits[row, unseen])
        # rounding the shifted logits to float32 moves each by up to half an ulp of its magnitude, so a probability
        # can move by that much (twice: its own logit and the largest) relative when nothing else changes: ~1e-7 for
        # logits near 1, 4e-6 near 35
        finite = logits[row][torch.isfinite(logits[row])]
        magnitude = float(finite.abs().max()) if finite.numel() else 1.0
        slack = 1 + 1e-6 + 2 * torch.finfo(torch.float32).eps * max(1.0, magnitude)
        assert float(after[row, seen_ids].sum()) <= float(before[row, seen_ids].sum()) * slack
        if cls is penalties.PresencePenaltyProcessor:
            assert bool((after[row, seen_ids] <= before[row, seen_ids] * slack).all())


def test_a_single_seen_tokens_probability_can_rise_when_another_seen_token_loses_more():
    # tokens 0 and 1 were generated; 1 much more often, so the frequency penalty takes mass from 1 to 0 and 2
    logits = torch.tensor([[0.0, 5.0, 0.0]])
    opts = [penalties.FrequencyPenaltyProcessor.Params(penalty=1.0)]
    out = penalties.FrequencyPenaltyProcessor()(logits, view(opts, [[0, 1, 1, 1, 1]], [0]))
    assert out.softmax(-1)[0, 0] > logits.softmax(-1)[0, 0]


@FAST
@given(logits=logits_tensors(), data=st.data())
def test_logit_bias_shifts_only_the_named_tokens_by_their_bias(logits, data):
    vocab = logits.shape[-1]
    opts = [biases.LogitBiasProcessor.Params(bias=data.draw(st.dictionaries(st.integers(0, vocab - 1),
                                                                            st.floats(-100, 100), max_size=5)))
            for _ in range(len(logits))]
    out = biases.LogitBiasProcessor()(logits, view(opts))
    expected = logits.clone()
    for row, o in enumerate(opts):
        for token, bias in o.bias.items():
            expected[row, token] += bias
    assert torch.equal(out, expected)


STAGES = {
    "top_k": (sampling.TopKProcessor(), lambda d: {"top_k": d.draw(st.integers(1, 10))}),
    "min_p": (sampling.MinPProcessor(), lambda d: {"min_p": d.draw(st.floats(0.01, 0.5))}),
    "temperature": (sampling.TemperatureProcessor(), lambda d: {"temperature": d.draw(st.floats(0.2, 2.0))}),
    "repetition_penalty": (penalties.RepetitionPenaltyProcessor(), lambda d: {"penalty": d.draw(st.floats(1, 2))}),
    "dry": (penalties.DryProcessor(), lambda d: {"sequence_breakers": [], "allowed_length": 1}),
    "no_repeat_ngram": (penalties.NoRepeatNGramProcessor(), lambda d: {"ngram_size": d.draw(st.integers(1, 3))}),
    "logit_bias": (biases.LogitBiasProcessor(), lambda d: {"bias": {0: d.draw(st.floats(-5, 5))}}),
}


@FAST
@given(logits=logits_tensors(rows=st.integers(1, 8)), data=st.data())
def test_per_request_pipelines_applied_to_a_batch_equal_each_row_alone(logits, data):
    from decodekit.api.processors import Stage

    n, vocab = logits.shape
    pipelines, greedy = [], []
    for _ in range(n):
        names = data.draw(st.lists(st.sampled_from(sorted(STAGES)), max_size=4))
        pipelines.append(tuple(Stage(STAGES[k][0], STAGES[k][0].Params(**STAGES[k][1](data))) for k in names))
        greedy.append(data.draw(st.booleans()))
    hist = [data.draw(histories(vocab, min_size=1)) for _ in range(n)]
    batch = BatchView([SamplingParams()] * n, hist, [1] * n, (0,))
    together = apply_processors(logits, batch, pipelines, greedy)
    alone = torch.cat([apply_processors(logits[r : r + 1], batch.select([r]), [pipelines[r]], [greedy[r]])
                       for r in range(n)])
    assert torch.equal(together.isinf(), alone.isinf())
    torch.testing.assert_close(together, alone)


# ---- through the engine ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    from decodekit.models.tiny import tiny_model, tiny_tokenizer

    return LLM(tiny_model("llama"), tiny_tokenizer(), dtype="float32", device="cpu", block_size=8, max_num_seqs=4)


CATALOGUE = [
    {"repetition_penalty": {"penalty": 1.3}},
    {"dry": {"multiplier": 0.8, "base": 1.75, "allowed_length": 2}},
    {"xtc": {"threshold": 0.01, "probability": 0.5}},  # the tiny model is flat: ~20 tokens >= 0.01
    {"min_p": {"min_p": 0.02}},
    {"logit_bias": {"bias": {"5": -100, "6": 3.0}}},
]


def test_a_seeded_request_with_catalogue_processors_samples_the_same_alone_and_in_any_batch(llm):
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=16, ignore_eos=True, processors=CATALOGUE)
    prompt = random_prompts(1, 10, 11, seed=31)[0]
    alone = llm.generate([prompt], params)[0].token_ids
    others = random_prompts(5, 3, 40, seed=32)
    noisy = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, processors=CATALOGUE[:2])
    for position in (0, 3):
        prompts = [*others[:position], prompt, *others[position:]]
        plist = [noisy] * len(prompts)
        plist[position] = params
        assert llm.generate(prompts, plist)[position].token_ids == alone
    assert llm.generate([prompt], params.model_copy(update={"seed": 8}))[0].token_ids != alone


def repeats_an_ngram(ids: list[int], start: int, n: int) -> bool:
    """Whether an n-gram ending at a position >= `start` already occurred earlier in `ids`."""
    return any(tuple(ids[t - n + 1 : t + 1]) in {tuple(ids[i - n + 1 : i + 1]) for i in range(n - 1, t)}
               for t in range(max(start, n - 1), len(ids)))


def test_catalogue_requests_and_plain_requests_share_continuous_batches(llm):
    prompts = random_prompts(8, 4, 30, seed=41)
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    banned = [7, 8, 9]
    allowed = list(range(100, 140))
    fancy = [
        SamplingParams(temperature=0.8, seed=1, max_tokens=20, ignore_eos=True, processors=[
            *CATALOGUE, {"no_repeat_ngram": {"ngram_size": 2}}, {"bad_words": {"words_ids": [[b] for b in banned]}}]),
        SamplingParams(temperature=0.7, seed=2, max_tokens=20, ignore_eos=True, processors=[
            {"allowed_token_ids": {"token_ids": allowed}}, {"mirostat": {"tau": 3.0}},
            {"presence_penalty": {"penalty": 0.5}}, {"frequency_penalty": {"penalty": 0.5}}]),
        SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True, processors=[
            {"typical_p": {"mass": 0.9}}, {"top_n_sigma": {"n": 2.0}}, {"epsilon": {"epsilon": 0.001}},
            {"eta": {"epsilon": 0.001}}, {"dynamic_temperature": {"temperature": 1.0, "delta": 0.5}}]),
    ]
    params = [plain, fancy[0], plain, fancy[1], plain, fancy[2], plain, fancy[0]]
    outs = llm.generate(prompts, params)  # max_num_seqs=4: requests join and leave the running batch
    assert all(o.error is None and len(o.token_ids) == 20 for o in outs)
    for i in (0, 2, 4, 6):  # plain rows are untouched by their neighbours' processors
        assert outs[i].token_ids == llm.generate([prompts[i]], plain)[0].token_ids
    for i in (1, 7):
        assert not repeats_an_ngram(prompts[i] + outs[i].token_ids, len(prompts[i]), 2)
        assert not set(outs[i].token_ids) & {5, *banned}
    assert set(outs[3].token_ids) <= set(allowed)


def test_no_repeat_ngram_holds_over_prompt_and_output_in_the_engine(llm):
    prompt = random_prompts(1, 12, 13, seed=43)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                processors=[{"no_repeat_ngram": {"ngram_size": 2}}]))[0]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert repeats_an_ngram(prompt + greedy.token_ids, len(prompt), 2), "plain greedy repeats (else this is moot)"
    assert not repeats_an_ngram(prompt + out.token_ids, len(prompt), 2)


def test_speculative_greedy_with_history_penalties_equals_plain_greedy_with_them(llama, tokenizer):
    """Each verified position sees the history up to itself (drafts included): same tokens as one at a time."""
    llm = LLM(llama, tokenizer, draft=llama, kv_cache_memory="16MiB", block_size=4)
    prompts = [(p * 4)[:30] for p in random_prompts(4, 4, 9, seed=44)]  # repetitive: drafts get accepted
    processors = [{"dry": {"multiplier": 2.0, "allowed_length": 1, "sequence_breakers": []}},
                  {"frequency_penalty": {"penalty": 0.7}}, {"presence_penalty": {"penalty": 0.5}},
                  {"no_repeat_ngram": {"ngram_size": 3}}, {"bad_words": {"words_ids": [[p[0], p[1]] for p in prompts]}}]
    plain = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, processors=processors))
    spec = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, processors=processors, strategy={
        "speculative": {"proposer": "draft", "num_speculative_tokens": 4}}))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.metrics.num_accepted_tokens for o in spec) > 0
    unprocessed = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    assert [o.token_ids for o in plain] != [o.token_ids for o in unprocessed]


@pytest.mark.parametrize("version", ["mirostat", "mirostat_v1"])
def test_mirostat_rows_at_draft_offsets_equal_scoring_the_positions_one_after_another(version):
    from decodekit_plugins.warpers import MirostatProcessor, MirostatV1Processor

    miro = MirostatProcessor() if version == "mirostat" else MirostatV1Processor()
    opts = miro.Params(tau=2.0, eta=0.5)
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0)) * 2
    history, drafts, bonus = [1, 2, 3], [4, 5], 6
    rows = [history, history + drafts[:1], history + drafts]
    state = miro.init_state(opts, history[:1])
    spec_view = BatchView([SamplingParams()] * 3, rows, [1] * 3, (0,), options=[opts] * 3, states=[state] * 3,
                          draft_offsets=[0, 1, 2])
    together = miro(logits, spec_view)
    miro.update_state(state, opts, [*drafts, bonus])
    one_by_one, sequential = [], miro.init_state(opts, history[:1])
    for j, token in enumerate([*drafts, bonus]):
        one = BatchView([SamplingParams()], [rows[j]], [1], (0,), options=[opts], states=[sequential])
        one_by_one.append(miro(logits[j : j + 1], one))
        miro.update_state(sequential, opts, [token])
    assert torch.equal(together, torch.cat(one_by_one))
    assert float(state["mu"]) == pytest.approx(float(sequential["mu"]))
    assert float(state["mu"]) != 2 * opts.tau


def test_seeded_mirostat_v1_and_v2_requests_sample_the_same_alone_and_batched_together(llm):
    """Each sequence's mu is its own: v1 and v2 rows, batched with each other and a plain row, draw what they draw
    alone."""
    prompts = random_prompts(4, 4, 20, seed=45)
    params = [SamplingParams(temperature=0.8, seed=seed, max_tokens=12, ignore_eos=True,
                             processors=[{name: {"tau": 3.0, "eta": 0.5}}])
              for seed, name in ((1, "mirostat_v1"), (2, "mirostat"), (3, "mirostat_v1"))]
    params.append(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    alone = [llm.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == alone


def test_every_catalogue_name_and_bad_value_is_checked_when_a_request_is_planned(tokenizer):
    from decodekit.api.components import ComponentInfo, PlanError

    components = Components(Registry.from_plugin_manager(get_plugin_manager(load_entry_points=False)),
                            ComponentInfo(tokenizer=tokenizer, vocab_size=len(tokenizer)))
    good = [*CATALOGUE, {"typical_p": {"mass": 0.9}}, {"top_n_sigma": {"n": 1.0}}, {"epsilon": {"epsilon": 3e-4}},
            {"eta": {"epsilon": 3e-4}}, {"dynamic_temperature": {"delta": 0.5}}, {"mirostat": {"tau": 5.0}},
            {"presence_penalty": {"penalty": 0.5}}, {"frequency_penalty": {"penalty": 0.5}},
            {"no_repeat_ngram": {"ngram_size": 3}}, {"bad_words": {"words": ["Paris"], "words_ids": [[1, 2]]}},
            {"allowed_token_ids": {"token_ids": [3, 4]}}, {"logit_bias": {"bias_strings": {"Paris": 2.0}}}]
    plan = components.resolve(SamplingParams(processors=good))
    assert [s.processor.name for s in plan.stages] == [ComponentSpec.model_validate(g).name for g in good]
    bad = [({"repetition_penalty": {"penalty": 0}}, "greater than 0"),
           ({"typical_p": {"mass": 1.0}}, "less than 1"),
           ({"xtc": {"threshold": 1.5}}, "less than or equal to 1"),
           ({"logit_bias": {"bias": {"1": 101}}}, "less than or equal to 100"),
           ({"logit_bias": {"bias": {"100000": 1}}}, "vocabulary size"),
           ({"allowed_token_ids": {"token_ids": []}}, "at least 1"),
           ({"dry": {"sequence_breakers": [""]}}, "at least 1 character"),
           ({"no_repeat_ngram": {"ngram": 3}}, r"^processors\[0\]\.no_repeat_ngram\.ngram: unknown key 'ngram' "
                                               r"\(did you mean 'ngram_size'\?\); known keys: ngram_size$")]
    for spec, message in bad:
        with pytest.raises(PlanError, match=message):
            components.resolve(SamplingParams(processors=[spec]))


def test_the_creative_recipe_names_valid_catalogue_processors(tokenizer):
    from decodekit.api.components import ComponentInfo

    recipe = yaml.safe_load((Path(__file__).parents[2] / "recipes" / "creative.yaml").read_text())
    components = Components(Registry.from_plugin_manager(get_plugin_manager(load_entry_points=False)),
                            ComponentInfo(tokenizer=tokenizer, vocab_size=len(tokenizer)))
    plan = components.resolve(SamplingParams(**recipe["sampling"], processors=recipe["processors"]))
    assert [s.processor.name for s in plan.stages] == ["dry", "xtc", "min_p", "temperature"]


def test_a_seeded_greedy_xtc_request_decodes_the_same_tokens_with_and_without_speculation(llm):
    """XTC's coin for a seeded row is keyed by the seed and the position it scores: verification scores draft rows
    as well, and a coin per scored row drawn from the request's generator would shift the stream (other tokens with
    speculation than without, even greedy ones)."""
    prompts = [p * 3 for p in random_prompts(3, 4, 8, seed=41)]  # repeats give the n-gram proposer hits
    params = dict(temperature=0.0, max_tokens=24, ignore_eos=True,
                  processors=[{"xtc": {"threshold": 0.01, "probability": 0.5}}])
    for seed in (3, 4):
        plain = llm.generate(prompts, SamplingParams(seed=seed, **params))
        spec = llm.generate(prompts, SamplingParams(seed=seed, strategy={"speculative": {
            "proposer": "ngram", "num_speculative_tokens": 4}}, **params))
        assert sum(o.metrics.num_draft_tokens for o in spec) > 0
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
