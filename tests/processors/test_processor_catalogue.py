"""The catalogue against its sources: transformers' own processors (run on the same logits and histories, one row
at a time, while ours run batched with per-row parameters), and line-by-line Python ports of llama.cpp's samplers
(DRY, XTC, top-n-sigma, dynamic temperature, mirostat v1 and v2)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers.generation import logits_process as hf

from decodekit.api.params import SamplingParams
from decodekit.api.processors import BatchView
from decodekit.testing import histories, logits_tensors
from decodekit_plugins import biases, penalties, sampling, warpers

FAST = settings(max_examples=40, deadline=None)
INF = float("inf")


VOCABS = st.integers(2, 40)
ROWS = st.integers(1, 5)


@st.composite
def rows_and_histories(draw, vocab=VOCABS, rows=ROWS, min_history=1, max_history=24):
    """Logits with ties and -inf, and one history (prompt + generated) per row."""
    v = draw(vocab)
    n = draw(rows)
    logits = draw(logits_tensors(n, v))
    longest = max_history if isinstance(max_history, int) else draw(max_history)
    hist = [draw(histories(v, min_size=min_history, max_size=longest)) for _ in range(n)]
    prompt_lens = [draw(st.integers(0, len(h))) for h in hist]
    return logits, hist, prompt_lens


@st.composite
def distinct_logits(draw, vocab=VOCABS, rows=ROWS):
    """Logits without ties (so sort order is unambiguous), some -inf."""
    n, v = draw(rows), draw(vocab)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    out = torch.randn(n, v, generator=g) * draw(st.sampled_from([0.5, 2.0, 6.0]))
    masked = torch.rand(n, v, generator=g) < draw(st.sampled_from([0.0, 0.3]))
    masked[:, 0] = False
    return out.masked_fill(masked, -INF)


def view(options, histories_=None, prompt_lens=None, eos=(0,), params=None):
    n = len(options)
    histories_ = histories_ or [[1]] * n
    return BatchView(params or [SamplingParams()] * n, histories_, prompt_lens or [0] * n, eos, options=options)


def per_row(hf_processor, logits, histories_):
    """transformers' processor applied to each row alone, with that row's history as `input_ids`."""
    return torch.cat([hf_processor(i)(torch.tensor([h], dtype=torch.long), logits[i : i + 1].clone())
                      for i, h in enumerate(histories_)])


def same(ours, theirs, atol=1e-6):
    assert torch.equal(ours.isinf(), theirs.isinf()), "different tokens masked"
    torch.testing.assert_close(ours, theirs, atol=atol, rtol=1e-5)


# ---- transformers' processors ---------------------------------------------------------------------------------
@FAST
@given(logits=logits_tensors(), data=st.data())
def test_temperature_matches_transformers(logits, data):
    temps = [data.draw(st.floats(0.05, 5.0)) for _ in range(len(logits))]
    ours = sampling.TemperatureProcessor()(logits, view([sampling.TemperatureProcessor.Params(temperature=t)
                                                         for t in temps]))
    same(ours, per_row(lambda i: hf.TemperatureLogitsWarper(temps[i]), logits, [[1]] * len(logits)))


@FAST
@given(logits=logits_tensors(), data=st.data())
def test_top_k_matches_transformers_ties_included(logits, data):
    ks = [data.draw(st.integers(1, 50)) for _ in range(len(logits))]
    ours = sampling.TopKProcessor()(logits, view([sampling.TopKProcessor.Params(top_k=k) for k in ks]))
    same(ours, per_row(lambda i: hf.TopKLogitsWarper(ks[i]), logits, [[1]] * len(logits)))


@FAST
@given(logits=distinct_logits(), data=st.data())
def test_top_p_matches_transformers(logits, data):
    ps = [data.draw(st.floats(0.01, 1.0)) for _ in range(len(logits))]
    # transformers sums ascending, we sum descending: only a mass within rounding of p may decide differently
    for row, p in zip(logits.double().softmax(-1), ps):
        masses = row.sort(descending=True).values.cumsum(0)
        assume(bool(((masses - p).abs() > 1e-5).all()))
    ours = sampling.TopPProcessor()(logits, view([sampling.TopPProcessor.Params(top_p=p) for p in ps]))
    same(ours, per_row(lambda i: hf.TopPLogitsWarper(ps[i]), logits, [[1]] * len(logits)))


@FAST
@given(logits=logits_tensors(), data=st.data())
def test_min_p_matches_transformers(logits, data):
    ps = [data.draw(st.floats(0.01, 1.0)) for _ in range(len(logits))]
    ours = sampling.MinPProcessor()(logits, view([sampling.MinPProcessor.Params(min_p=p) for p in ps]))
    same(ours, per_row(lambda i: hf.MinPLogitsWarper(ps[i]), logits, [[1]] * len(logits)))


@FAST
@given(logits=logits_tensors(), data=st.data())
def test_typical_p_matches_transformers(logits, data):
    opts = [warpers.TypicalPProcessor.Params(mass=data.draw(st.floats(0.01, 0.99)), min_keep=data.draw(
        st.integers(1, 4))) for _ in range(len(logits))]
    ours = warpers.TypicalPProcessor()(logits, view(opts))
    theirs = per_row(lambda i: hf.TypicalLogitsWarper(opts[i].mass, min_tokens_to_keep=opts[i].min_keep), logits,
                     [[1]] * len(logits))
    same(ours, theirs)


def _far_from(probs: torch.Tensor, cutoff: torch.Tensor) -> bool:
    """No probability within rounding of the cutoff (where float32 formulas may legitimately disagree)."""
    return bool(((probs - cutoff).abs() > 1e-6 * cutoff + 1e-12).all())


@FAST
@given(logits=logits_tensors(), data=st.data())
def test_epsilon_matches_transformers(logits, data):
    opts = [warpers.EpsilonProcessor.Params(epsilon=data.draw(st.floats(1e-4, 0.5)), min_keep=data.draw(
        st.integers(1, 4))) for _ in range(len(logits))]
    probs = logits.double().softmax(-1)
    assume(all(_far_from(probs[i], torch.tensor(o.epsilon, dtype=torch.double)) for i, o in enumerate(opts)))
    ours = warpers.EpsilonProcessor()(logits, view(opts))
    theirs = per_row(lambda i: hf.EpsilonLogitsWarper(opts[i].epsilon, min_tokens_to_keep=opts[i].min_keep), logits,
                     [[1]] * len(logits))
    same(ours, theirs)


@FAST
@given(logits=logits_tensors(), data=st.data())
def test_eta_matches_transformers(logits, data):
    opts = [warpers.EtaProcessor.Params(epsilon=data.draw(st.floats(1e-4, 0.5)), min_keep=data.draw(
        st.integers(1, 4))) for _ in range(len(logits))]
    probs = logits.double().softmax(-1)
    for i, o in enumerate(opts):
        entropy = -(probs[i] * probs[i].log()).nansum()
        cutoff = torch.minimum(torch.tensor(o.epsilon).double(), math.sqrt(o.epsilon) * torch.exp(-entropy))
        assume(_far_from(probs[i], cutoff))
    ours = warpers.EtaProcessor()(logits, view(opts))
    theirs = per_row(lambda i: hf.EtaLogitsWarper(opts[i].epsilon, min_tokens_to_keep=opts[i].min_keep), logits,
                     [[1]] * len(logits))
    same(ours, theirs)


@FAST
@given(case=rows_and_histories(), data=st.data())
def test_repetition_penalty_matches_transformers_over_prompt_and_output(case, data):
    logits, hist, prompt_lens = case
    pens = [data.draw(st.floats(0.1, 3.0)) for _ in hist]
    opts = [penalties.RepetitionPenaltyProcessor.Params(penalty=p) for p in pens]
    ours = penalties.RepetitionPenaltyProcessor()(logits, view(opts, hist, prompt_lens))
    same(ours, per_row(lambda i: hf.RepetitionPenaltyLogitsProcessor(pens[i]), logits, hist))


@FAST
@given(case=rows_and_histories(max_history=30), data=st.data())
def test_no_repeat_ngram_matches_transformers(case, data):
    logits, hist, prompt_lens = case
    sizes = [data.draw(st.integers(1, 5)) for _ in hist]
    opts = [penalties.NoRepeatNGramProcessor.Params(ngram_size=n) for n in sizes]
    ours = penalties.NoRepeatNGramProcessor()(logits, view(opts, hist, prompt_lens))
    same(ours, per_row(lambda i: hf.NoRepeatNGramLogitsProcessor(sizes[i]), logits, hist))


@FAST
@given(case=rows_and_histories(max_history=st.sampled_from([3, 24])), data=st.data())
def test_bad_words_match_transformers(case, data):
    logits, hist, prompt_lens = case
    vocab = logits.shape[-1]
    words = [data.draw(st.lists(st.lists(st.integers(0, min(vocab, 6) - 1).map(lambda t: t * (vocab // min(vocab, 6))),
                                         min_size=1, max_size=3), min_size=1, max_size=4)) for _ in hist]
    eos = data.draw(st.integers(0, vocab - 1))
    opts = [biases.BadWordsProcessor.Params(words_ids=w) for w in words]
    ours = biases.BadWordsProcessor()(logits, view(opts, hist, prompt_lens, eos=(eos,)))
    same(ours, per_row(lambda i: hf.NoBadWordsLogitsProcessor(words[i], eos_token_id=eos), logits, hist))


@FAST
@given(case=rows_and_histories(), data=st.data())
def test_min_tokens_matches_transformers_min_new_tokens_and_min_length(case, data):
    logits, hist, prompt_lens = case
    mins = [data.draw(st.integers(0, 30)) for _ in hist]
    eos = (data.draw(st.integers(0, logits.shape[-1] - 1)),)
    opts = [sampling.MinTokensProcessor.Params(min_tokens=m) for m in mins]
    ours = sampling.MinTokensProcessor()(logits, view(opts, hist, prompt_lens, eos=eos))
    same(ours, per_row(lambda i: hf.MinNewTokensLengthLogitsProcessor(prompt_lens[i], mins[i], list(eos)), logits,
                       hist))
    same(ours, per_row(lambda i: hf.MinLengthLogitsProcessor(prompt_lens[i] + mins[i], list(eos)), logits, hist))


def test_bad_words_ban_the_last_token_when_the_history_ends_with_the_rest():
    opts = biases.BadWordsProcessor.Params(words_ids=[[1, 2, 3], [4], [0]])
    out = biases.BadWordsProcessor()(torch.zeros(4, 6), view([opts] * 4, [[1, 2], [5, 1, 2], [2, 1], [1]], eos=(0,)))
    assert out.isinf().tolist() == [[False, False, False, True, True, False],  # whole history is the prefix
                                    [False, False, False, True, True, False],
                                    [False, False, False, False, True, False],
                                    [False, False, False, False, True, False]]  # [0] is EOS: never banned


# ---- llama.cpp's samplers, ported line by line ------------------------------------------------------------------
def llama_dry(logits, history, multiplier, base, allowed_length, penalty_last_n, breakers):
    """llama.cpp `llama_sampler_dry_apply` with breakers already tokenized (head -> tails)."""
    out = list(logits)
    processed: dict[int, list[list[int]]] = {}
    for seq in breakers:
        processed.setdefault(seq[0], []).append(list(seq[1:]))
    effective = len(history) if penalty_last_n == -1 else max(penalty_last_n, 0)
    last_n = min(len(history), effective)
    if multiplier == 0.0 or base < 1.0 or penalty_last_n == 0 or last_n <= allowed_length:
        return out
    rat = lambda i: history[len(history) - 1 - i]  # noqa: E731  (ring_buffer::rat: i-th token from the end)
    rep_limit = last_n
    for i in range(last_n):
        tails = processed.get(rat(i))
        if tails is None:
            continue
        longest = -1
        for tail in tails:
            if longest < len(tail) <= i and all(tail[o] == rat(i - o - 1) for o in range(len(tail))):
                longest = len(tail)
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed_length:
        return out
    repeat = [0] * last_n
    last, rt, lt = last_n - 1, 0, 0
    for k in range(1, last_n):
        if k > rt:
            n = 0
            while n + k < last_n and rat(n) == rat(n + k):
                n += 1
            repeat[last - k] = min(n, rep_limit)
            if n > 0:
                lt, rt = k, k + n - 1
        else:
            p = k - lt
            right_part_len = rt - k + 1
            if repeat[last - p] < right_part_len:
                repeat[last - k] = min(repeat[last - p], rep_limit)
            else:
                i = rt + 1
                while i < last_n and rat(i) == rat(i - k):
                    i += 1
                repeat[last - k] = min(i - k, rep_limit)
                lt, rt = k, i - 1
    max_repeat: dict[int, int] = {}
    for i in range(last_n - 1):
        if repeat[i] >= allowed_length:
            token = rat(last_n - 2 - i)
            max_repeat[token] = max(max_repeat.get(token, 0), repeat[i])
    max_exponent = int(88.7228391 / math.log(base)) if base > 1.000001 else 0
    for token, length in max_repeat.items():
        if token >= len(out) or any(len(t) == 0 for t in processed.get(token, [])):
            continue
        exponent = length - allowed_length
        if max_exponent > 0 and exponent > max_exponent:
            exponent = max_exponent
        out[token] -= multiplier * base**exponent
    return out


@st.composite
def repetitive_histories(draw, vocab):
    """Histories built from repeated chunks with a few changes, so that DRY has repeats (and breakers) to find."""
    alphabet = st.integers(0, min(vocab, 5) - 1).map(lambda t: t * (vocab // min(vocab, 5)))
    chunk = draw(st.lists(alphabet, min_size=1, max_size=6))
    out: list[int] = []
    for _ in range(draw(st.integers(1, 5))):
        out += chunk + draw(st.lists(alphabet, max_size=2))
    return out[-40:]


@st.composite
def dry_case(draw):
    vocab = draw(st.integers(2, 30))
    rows = draw(st.integers(1, 4))
    token = st.integers(0, min(vocab, 5) - 1).map(lambda t: t * (vocab // min(vocab, 5)))
    opts = [penalties.DryProcessor.Params(
        multiplier=draw(st.sampled_from([0.0, 0.5, 1.0])), base=draw(st.sampled_from([1.0, 1.75, 3.0])),
        allowed_length=draw(st.integers(1, 3)), penalty_last_n=draw(st.sampled_from([-1, -1, 0, 3, 12])),
        sequence_breakers=[], sequence_breaker_ids=draw(st.lists(st.lists(token, min_size=1, max_size=3), max_size=3)))
        for _ in range(rows)]
    return draw(logits_tensors(rows, vocab)), [draw(repetitive_histories(vocab)) for _ in range(rows)], opts


@settings(max_examples=100, deadline=None)
@given(case=dry_case())
def test_dry_matches_a_port_of_llama_cpp(case):
    logits, hist, opts = case
    ours = penalties.DryProcessor()(logits, view(opts, hist))
    theirs = torch.tensor([llama_dry(logits[i].tolist(), hist[i], o.multiplier, o.base, o.allowed_length,
                                     o.penalty_last_n, o.sequence_breaker_ids) for i, o in enumerate(opts)])
    same(ours, theirs, atol=1e-4)


def _dry(history, breakers, length=8):
    opts = penalties.DryProcessor.Params(multiplier=1.0, base=2.0, allowed_length=2, sequence_breakers=[],
                                         sequence_breaker_ids=breakers)
    return penalties.DryProcessor()(torch.zeros(1, length), view([opts], [history]))[0].tolist()


def test_dry_penalty_grows_with_the_repeat_and_stops_at_sequence_breakers():
    a, b, c, d, x, y = 1, 2, 3, 4, 5, 6
    # "a b c" repeats "a b c" before d: d would make a repeat of 4 -> multiplier * base ** (3 - allowed_length)
    assert _dry([a, b, c, d, a, b, c], [])[d] == -2.0
    assert _dry([x, b, c, d, x, b, c], [])[d] == -2.0
    # x a breaker: the repeat is counted from after the last x only ("b c", 2 tokens)
    assert _dry([x, b, c, d, x, b, c], [[x]])[d] == -1.0
    # a two-token breaker "y x" caps it the same way; "x" alone is no breaker then
    assert _dry([y, x, b, c, d, y, x, b, c], [])[d] == -4.0
    assert _dry([y, x, b, c, d, y, x, b, c], [[y, x]])[d] == -1.0
    assert _dry([y, x, b, c, d, y, x, b, c], [[a, x]])[d] == -4.0
    # a single-token breaker is never penalized itself
    assert _dry([a, b, x, a, b], [])[x] == -1.0
    assert _dry([a, b, x, a, b], [[x]])[x] == 0.0
    # fewer tokens after the breaker than allowed_length: nothing at all
    assert _dry([a, b, c, x, a, b, c, x, a], [[x]]) == [0.0] * 8


def test_dry_string_breakers_come_from_the_tokenizer(tokenizer):
    from decodekit.api.components import ComponentInfo

    dry = penalties.DryProcessor()
    info = ComponentInfo(tokenizer=tokenizer, vocab_size=len(tokenizer))
    dry.setup(info)
    opts = penalties.DryProcessor.Params(sequence_breakers=["\n"])
    dry.check_options(opts)
    dry.check_options_with(opts, info)
    single = set(dry._breakers(opts).single.tolist())
    newline_tokens = {i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i])}
    assert newline_tokens and single == newline_tokens
    no_tokenizer = penalties.DryProcessor()
    no_tokenizer.setup(ComponentInfo())
    with pytest.raises(ValueError, match="need a tokenizer"):
        no_tokenizer.check_options_with(opts, ComponentInfo())
    no_tokenizer.check_options_with(penalties.DryProcessor.Params(sequence_breakers=[], sequence_breaker_ids=[[3]]),
                                    ComponentInfo())


def llama_xtc(logits, threshold, min_keep):
    """llama.cpp `llama_sampler_xtc_apply` when the draw says apply (candidates: the finite logits)."""
    ids = [i for i in sorted(range(len(logits)), key=lambda i: -logits[i]) if logits[i] != -INF]
    probs = torch.tensor([logits[i] for i in ids], dtype=torch.double).softmax(0).tolist()
    out = list(logits)
    if threshold > 0.5 or len(ids) < 2:
        return out
    pos_last = 0
    for i, p in enumerate(probs):
        if p >= threshold:
            pos_last = i
        else:
            break
    if len(ids) - pos_last >= min_keep and pos_last > 0:
        for i in ids[:pos_last]:
            out[i] = -INF
    return out


@FAST
@given(logits=distinct_logits(), data=st.data())
def test_xtc_matches_a_port_of_llama_cpp(logits, data):
    opts = [warpers.XTCProcessor.Params(threshold=data.draw(st.floats(0.0, 0.6)), probability=data.draw(
        st.sampled_from([0.0, 1.0])), min_keep=data.draw(st.integers(1, 5))) for _ in range(len(logits))]
    probs = logits.double().softmax(-1)
    assume(all(_far_from(probs[i], torch.tensor(o.threshold).double()) for i, o in enumerate(opts)))
    ours = warpers.XTCProcessor()(logits, view(opts))
    theirs = torch.tensor([llama_xtc(logits[i].tolist(), o.threshold, o.min_keep) if o.probability == 1.0
                           else logits[i].tolist() for i, o in enumerate(opts)])
    same(ours, theirs)


def llama_top_n_sigma(logits, n):
    finite = [x for x in logits if x != -INF]
    top, mean = max(finite), sum(finite) / len(finite)
    std = math.sqrt(sum((x - mean) ** 2 for x in finite) / len(finite))
    return [x if x >= top - n * std else -INF for x in logits]


@FAST
@given(logits=distinct_logits(), data=st.data())
def test_top_n_sigma_matches_a_port_of_llama_cpp(logits, data):
    ns = [data.draw(st.floats(0.01, 4.0)) for _ in range(len(logits))]
    for row, n in zip(logits.double(), ns):
        finite = row[row.isfinite()]
        cutoff = finite.max() - n * finite.std(unbiased=False)
        assume(bool(((finite - cutoff).abs() > 1e-4).all()))
    ours = warpers.TopNSigmaProcessor()(logits, view([warpers.TopNSigmaProcessor.Params(n=n) for n in ns]))
    same(ours, torch.tensor([llama_top_n_sigma(logits[i].tolist(), n) for i, n in enumerate(ns)]))


def llama_dynamic_temperature(logits, temp, delta, exponent):
    finite = [x for x in logits if x != -INF]
    if delta > 0:
        if len(finite) <= 1:
            return list(logits)
        low, high = max(0.0, temp - delta), temp + delta
        probs = torch.tensor(finite, dtype=torch.double).softmax(0).tolist()
        entropy = -sum(p * math.log(p) for p in probs if p > 0)
        temp = low + (high - low) * (entropy / math.log(len(finite))) ** exponent
    if temp <= 0:
        top = max(finite)
        return [x if x == top else -INF for x in logits]
    return [x / temp for x in logits]


@FAST
@given(logits=logits_tensors(), data=st.data())
def test_dynamic_temperature_matches_a_port_of_llama_cpp(logits, data):
    opts = [warpers.DynamicTemperatureProcessor.Params(
        temperature=data.draw(st.sampled_from([0.0, 0.3, 1.0, 2.0])), delta=data.draw(st.sampled_from([0.0, 0.2, 1.5])),
        exponent=data.draw(st.floats(0.2, 3.0))) for _ in range(len(logits))]
    ours = warpers.DynamicTemperatureProcessor()(logits, view(opts))
    theirs = torch.tensor([llama_dynamic_temperature(logits[i].tolist(), o.temperature, o.delta, o.exponent)
                           for i, o in enumerate(opts)], dtype=torch.float64)
    # compare distributions: near-zero entropies give temperatures ~1e-8 whose float32 logits differ in digits
    # that no longer matter after softmax
    torch.testing.assert_close(ours.double().softmax(-1), theirs.softmax(-1), atol=1e-5, rtol=1e-4)


def test_dynamic_temperature_near_zero_acts_as_greedy_instead_of_overflowing():
    # p(second) ~ e^-100: entropy ~1e-42, temperature ~1e-42, 100 / t overflows float32
    opts = warpers.DynamicTemperatureProcessor.Params(temperature=0.0, delta=0.5)
    out = warpers.DynamicTemperatureProcessor()(torch.tensor([[100.0, 0.0, 0.0]]), view([opts]))
    assert out.tolist() == [[100.0, -INF, -INF]]
    assert not out.softmax(-1).isnan().any()


def llama_mirostat_v2(logits, mu, tau, eta, pick):
    """Truncate by surprise, renormalize, 'sample' `pick` (an index into the kept tokens) and update mu."""
    ids = sorted((i for i in range(len(logits)) if logits[i] != -INF), key=lambda i: -logits[i])
    probs = torch.tensor([logits[i] for i in ids], dtype=torch.double).softmax(0).tolist()
    size = next((k for k, p in enumerate(probs) if -math.log2(p) > mu), len(probs)) or 1
    kept = torch.tensor([logits[i] for i in ids[:size]], dtype=torch.double).softmax(0).tolist()
    token = ids[pick % size]
    return set(ids[:size]), token, mu - eta * (-math.log2(kept[pick % size]) - tau)


@FAST
@given(logits=distinct_logits(rows=st.just(1)), tau=st.floats(0.5, 6.0), eta=st.floats(0.01, 1.0),
       picks=st.lists(st.integers(0, 100), min_size=1, max_size=4))
def test_mirostat_v2_truncation_and_mu_updates_match_a_port_of_llama_cpp(logits, tau, eta, picks):
    miro = warpers.MirostatProcessor()
    opts = warpers.MirostatProcessor.Params(tau=tau, eta=eta)
    state = miro.init_state(opts, [1])
    mu = 2 * tau
    for pick in picks:  # several steps on the same logits: mu moves each time
        row = logits[0].tolist()
        probs = logits.double().softmax(-1)[0]
        assume(_far_from(probs[probs > 0], torch.tensor(2.0 ** -mu).double()))
        kept, token, mu = llama_mirostat_v2(row, mu, tau, eta, pick)
        v = view([opts])
        v.states = [state]
        out = miro(logits, v)
        assert set(out[0].isfinite().nonzero()[:, 0].tolist()) == kept
        state = miro.update_state(state, opts, [token])
        assert float(state["mu"]) == pytest.approx(mu, rel=1e-4, abs=1e-4)


def llama_mirostat_v1(logits, mu, tau, eta, m, pick):
    """llama.cpp's `llama_sampler_mirostat_apply` line by line, in double precision: fit the Zipf exponent on the m
    most likely tokens, keep the top k, 'sample' `pick` (an index into the kept tokens with a probability) and
    update mu. Returns the kept tokens with a probability, the token, the new mu and k before truncation. A pair
    with a zero probability is left out of the fit (llama.cpp would divide by zero), and with nothing to fit
    k is 1 (decodekit's documented choice where llama.cpp's k is NaN)."""
    n_vocab = len(logits)
    ids = sorted(range(n_vocab), key=lambda i: -logits[i])
    probs = torch.tensor([logits[i] for i in ids], dtype=torch.double).softmax(0).tolist()
    sum_ti_bi = sum_ti_sq = 0.0
    for i in range(min(m - 1, n_vocab - 1)):
        if probs[i + 1] == 0:
            break
        t_i = math.log((i + 2) / (i + 1))
        b_i = math.log(probs[i] / probs[i + 1])
        sum_ti_bi += t_i * b_i
        sum_ti_sq += t_i * t_i
    if sum_ti_sq == 0:
        k = 1.0
    else:
        s_hat = sum_ti_bi / sum_ti_sq
        epsilon_hat = s_hat - 1
        try:
            k = ((epsilon_hat * 2**mu) / (1 - n_vocab ** (-epsilon_hat))) ** (1 / s_hat)
        except OverflowError:
            k = math.inf
    size = min(max(int(k) if k < n_vocab else n_vocab, 1), n_vocab)
    kept_ids = [i for i, p in zip(ids[:size], probs[:size]) if p > 0]
    kept = torch.tensor([logits[i] for i in kept_ids], dtype=torch.double).softmax(0).tolist()
    token = kept_ids[pick % len(kept_ids)]
    return set(kept_ids), token, mu - eta * (-math.log2(kept[pick % len(kept_ids)]) - tau), k


@FAST
@given(logits=distinct_logits(rows=st.just(1), vocab=st.sampled_from([2, 7, 40, 300])), tau=st.floats(0.5, 6.0),
       eta=st.floats(0.01, 1.0), m=st.sampled_from([2, 5, 100]), picks=st.lists(st.integers(0, 100), min_size=1,
                                                                                  max_size=4))
def test_mirostat_v1_zipf_fit_truncation_and_mu_updates_match_a_port_of_llama_cpp(logits, tau, eta, m, picks):
    miro = warpers.MirostatV1Processor()
    opts = warpers.MirostatV1Processor.Params(tau=tau, eta=eta, m=m)
    state = miro.init_state(opts, [1])
    mu = 2 * tau
    for pick in picks:  # several steps on the same logits: mu moves each time, and k with it
        row = logits[0].tolist()
        kept, token, next_mu, k = llama_mirostat_v1(row, mu, tau, eta, m, pick)
        # float32 here, double there: only a k within rounding of an integer could be truncated differently
        assume(k >= len(row) + 1 or abs(k - round(k)) > 1e-3 * max(1.0, k))
        v = view([opts])
        v.states = [state]
        out = miro(logits, v)
        assert set(out[0].isfinite().nonzero()[:, 0].tolist()) == kept
        state = miro.update_state(state, opts, [token])
        mu = next_mu
        assert float(state["mu"]) == pytest.approx(mu, rel=1e-4, abs=1e-4)


def mirostat_v1_kept(logits, opts):
    """How many tokens mirostat v1 keeps of each row, at the sequence's first step (mu = 2 * tau)."""
    miro = warpers.MirostatV1Processor()
    v = view([opts] * len(logits))
    v.states = [miro.init_state(opts, [1]) for _ in range(len(logits))]
    return miro(logits, v).isfinite().sum(dim=-1).tolist()


def test_mirostat_v1_keeps_the_k_of_the_formula_on_a_zipf_distribution():
    """On an exact Zipf distribution p_i ~ 1 / i ** s the fit finds s, so k is the paper's formula with s itself."""
    vocab, s, mu = 1000, 1.3, 6.0
    logits = -s * torch.log(torch.arange(1, vocab + 1, dtype=torch.float64))
    epsilon = s - 1
    k = ((epsilon * 2**mu) / (1 - vocab ** (-epsilon))) ** (1 / s)  # 10.77
    assert int(k) == 10
    assert mirostat_v1_kept(logits[None, :].float(), warpers.MirostatV1Processor.Params(tau=mu / 2)) == [int(k)]


def test_mirostat_v1_fits_only_the_m_most_likely_tokens():
    """A tail that is not Zipf past the m-th token changes nothing."""
    vocab, m = 300, 20
    zipf = -1.1 * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
    bent = zipf.clone()
    bent[m:] -= torch.linspace(0, 8, vocab - m)  # a steeper tail after the first m tokens
    rows = torch.stack([zipf, bent])
    narrow = mirostat_v1_kept(rows, warpers.MirostatV1Processor.Params(tau=5.0, m=m))
    assert narrow[0] == narrow[1]
    wide = mirostat_v1_kept(rows, warpers.MirostatV1Processor.Params(tau=5.0, m=100))
    assert wide[0] == narrow[0] and wide[1] != narrow[1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_p_matches_transformers_bit_for_bit_on_a_long_tail_and_at_the_edge(seed):
    """A 49k vocabulary: a long flat tail (p=0.99 keeps thousands of tokens: the full computation), a peaked row
    (the candidate path), and rows whose p sits exactly on, or within float32 rounding of, a cumulative mass (where
    summing in another order used to keep or drop other tokens than transformers)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 49152
    flat = torch.randn(1, vocab, generator=gen) * 0.7
    peaked = torch.randn(1, vocab, generator=gen) * 4.0
    edge = torch.randn(2, vocab, generator=gen) * 2.0
    logits = torch.cat([flat, peaked, edge])
    # p exactly where transformers' ascending float32 mass crosses a token, and just beside it
    ascending = edge[0].sort().values.softmax(-1).cumsum(-1)
    cut = int((ascending > 0.05).nonzero()[0])
    ps = [0.99, 0.9, 1.0 - float(ascending[cut]), 1.0 - float(ascending[cut]) + 1e-9]
    ours = sampling.TopPProcessor()(logits, view([sampling.TopPProcessor.Params(top_p=p) for p in ps]))
    for row, p in enumerate(ps):
        theirs = hf.TopPLogitsWarper(p)(torch.tensor([[1]]), logits[row : row + 1].clone())
        assert torch.equal(ours[row : row + 1].isinf(), theirs.isinf()), f"row {row}"
    assert int(ours[0].isfinite().sum()) > 4096  # the long tail went through the full computation
