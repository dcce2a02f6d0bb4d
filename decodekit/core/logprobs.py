"""Logprobs of the generated tokens (`SamplingParams.logprobs`), recorded after the strategies chose them.

The strategy never computes them: after the select stage ran, each sequence that got tokens this step and whose
request asks for logprobs gets, per new token, the log-softmax of the row that token was chosen from. A token's
row is found without the strategy's help: a sequence's `k` new tokens come from its first `k` scored rows (one
row, or the rows of the accepted drafts and the token after them), and a sequence forked this step (parallel
sampling) takes its parent's rows.

- `raw` mode reads the model's logits (the forward stage's rows);
- `processed` mode reads the rows the request's processors produced in this step's process stage (`Processing`
  keeps them for such requests only), i.e. the distribution the token was drawn from.

Prompt logprobs (`SamplingParams.prompt_logprobs`, raw) come from the forward stage: a request that asks gets
logits at every prompt position of its prefill chunks, and is admitted without reusing the prefix cache (cached
positions have no logits).

Nothing here runs for a step in which no request asks for logprobs.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from decodekit.api.sequence import Logprob, Request, Sequence, TokenLogprobs


def row_source(seq: Sequence, scored: Mapping[Sequence, Any], parents: Mapping[Sequence, Sequence]) -> Sequence:
    """The sequence whose scored rows `seq`'s new tokens were chosen from: itself, or for a sequence forked this
    step, the ancestor that was scored."""
    while seq not in scored and seq in parents:
        seq = parents[seq]
    return seq


def wants_logprobs(seq: Sequence) -> bool:
    """Whether this sequence's request asks for logprobs."""
    return seq.request.params.logprobs is not None


def record_logprobs(raw_rows: dict[Sequence, torch.Tensor], processed_rows: dict[Sequence, torch.Tensor],
                    appended: dict[Sequence, int], parents: dict[Sequence, Sequence], tokenizer: Any) -> None:
    """Append each new token's logprobs to its sequence (`seq.logprobs`, `seq.cumulative_logprob`).

    The rows of the whole step go through one log-softmax, one gather and one top-k (per kind of row), not one per
    sequence: at batch 32 that is most of what logprobs cost.

    Args:
        raw_rows: the model's logits rows of each scored sequence this step (`[positions, vocab]`).
        processed_rows: the processed rows of the sequences whose requests asked for `processed` logprobs.
        appended: how many tokens each sequence got this step (the step record).
        parents: the sequence each sequence forked this step was forked from.
        tokenizer: decodes each listed token.
    """
    # per kind of row: sequences, their rows, their tokens; "logprobs" rows are a strategy's processed
    # log-probabilities (beam search), read as they are so that a beam's logprobs add up to its score
    jobs: dict[str, list[tuple[Sequence, torch.Tensor, list[int]]]] = {"logits": [], "logprobs": []}
    for seq, count in appended.items():
        if not wants_logprobs(seq) or count == 0:
            continue
        source = row_source(seq, raw_rows, parents)
        params = seq.request.params
        processed = params.logprobs_mode == "processed"
        rows = (processed_rows if processed else raw_rows).get(source)
        tokens = seq.token_ids[-count:]
        if rows is None or rows.shape[0] < count:
            # no row to read (a strategy scoring "raw" that never ran the processors, for processed logprobs):
            # NaN entries keep one entry per token, so the list never falls out of step with the tokens
            _extend(seq, [{t: Logprob(math.nan, 0, token_text(tokenizer, t))} for t in tokens], tokens)
            continue
        kind = "logprobs" if processed and seq.request.plan.strategy.scores == "logprobs" else "logits"
        jobs[kind].append((seq, rows[:count], tokens))
    for kind, items in jobs.items():
        if not items:
            continue
        rows = torch.cat([r for _, r, _ in items])
        tokens = [t for _, _, ts in items for t in ts]
        tops = [seq.request.params.logprobs or 0 for seq, _, ts in items for _ in ts]
        entries = _entries(rows, tokens, tops, tokenizer, normalize=kind == "logits")
        start = 0
        for seq, _, ts in items:
            _extend(seq, entries[start : start + len(ts)], ts)
            start += len(ts)


def _extend(seq: Sequence, entries: list[TokenLogprobs], tokens: list[int]) -> None:
    if seq.logprobs is None:
        seq.logprobs = []
    seq.logprobs.extend(entries)
    seq.cumulative_logprob += sum(entry[token].logprob for entry, token in zip(entries, tokens))


def trim_logprobs(appended: dict[Sequence, int]) -> None:
    """Drop the logprobs of tokens the stop stage removed again (a stop inside a run of accepted drafts ends the
    sequence there), so a sequence has exactly one entry per generated token."""
    for seq in appended:
        extra = len(seq.logprobs) - seq.num_generated if seq.logprobs is not None else 0
        if extra > 0:
            dropped = seq.logprobs[-extra:]  # type: ignore[index]
            tokens = [next(iter(entry)) for entry in dropped]  # the chosen token is each entry's first key
            seq.cumulative_logprob -= sum(entry[token].logprob for entry, token in zip(dropped, tokens))
            del seq.logprobs[-extra:]  # type: ignore[union-attr]


def record_prompt_logprobs(request: Request, start: int, rows: torch.Tensor, tokenizer: Any) -> None:
    """Record the logprobs of the prompt tokens that the logits at positions `start, start + 1, ...` predict
    (`rows[i]` predicts token `start + i + 1`); positions already recorded (a recomputation after preemption)
    are skipped."""
    recorded: list[TokenLogprobs | None] = request.prompt_logprobs if request.prompt_logprobs is not None else [None]
    request.prompt_logprobs = recorded
    skip = len(recorded) - 1 - start  # rows whose token is already recorded
    if skip < 0 or skip >= rows.shape[0]:
        return
    tokens = request.prompt_token_ids[start + 1 + skip : start + 1 + rows.shape[0]]
    recorded.extend(_entries(rows[skip : skip + len(tokens)], tokens, request.params.prompt_logprobs or 0, tokenizer))


def _entries(rows: torch.Tensor, tokens: list[int], top: int | list[int], tokenizer: Any, normalize: bool = True
             ) -> list[TokenLogprobs]:
    """Per row: the chosen token, then the `top` (per row, or for every row) most likely ones, each with its
    logprob, rank and text. `rows` are logits (`normalize`: log-softmaxed here) or log-probabilities already.

    One log-softmax (faster than a `logsumexp` here, and the very values transformers' scores are compared with),
    one gather, one top-k; a chosen token's rank is read off the top-k when it is among them (every token more
    likely than it is then among them too), and only the other rows count over the whole vocabulary."""
    tops = top if isinstance(top, list) else [top] * len(tokens)
    rows = torch.log_softmax(rows.float(), dim=-1) if normalize else rows.float()
    chosen_ids = torch.tensor(tokens, device=rows.device)[:, None]
    chosen = rows.gather(1, chosen_ids)
    most = max(tops, default=0)
    if most:
        top_rows, top_ids = rows.topk(most, dim=-1)
        # vLLM's rank: 1 + how many tokens are strictly more likely
        ranks = (top_rows > chosen).sum(dim=-1) + 1
        outside = chosen[:, 0] < top_rows[:, -1]
        if bool(outside.any()):
            far = outside.nonzero()[:, 0]
            ranks[far] = (rows[far] > chosen[far]).sum(dim=-1) + 1
        top_value_list, top_id_list = top_rows.tolist(), top_ids.tolist()
    else:
        ranks = (rows > chosen).sum(dim=-1) + 1
        top_value_list = top_id_list = [[] for _ in tokens]
    chosen_list, rank_list = chosen[:, 0].tolist(), ranks.tolist()
    entries: list[TokenLogprobs] = []
    for token, value, rank, alt_values, alt_ids, n in zip(tokens, chosen_list, rank_list, top_value_list,
                                                          top_id_list, tops):
        entry = {token: Logprob(value, rank, token_text(tokenizer, token))}
        for r, (alt, alt_id) in enumerate(zip(alt_values[:n], alt_ids[:n]), start=1):
            if alt_id not in entry:
                entry[alt_id] = Logprob(alt, r, token_text(tokenizer, alt_id))
        entries.append(entry)
    return entries


_TEXTS: weakref.WeakKeyDictionary[Any, dict[int, str | None]] = weakref.WeakKeyDictionary()
"""Per tokenizer, each token's text once decoded: a decode call costs ~50 µs, and logprobs=5 at batch 32 would
otherwise decode ~200 tokens per step."""


def token_text(tokenizer: Any, token: int) -> str | None:
    """A token's text (decoded alone, cached per tokenizer); None if the tokenizer cannot decode it alone."""
    try:
        texts = _TEXTS.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced: decode every time
        texts = {}
    if token not in texts:
        try:
            texts[token] = str(tokenizer.decode([token]))
        except Exception:  # a tokenizer that cannot decode one id alone: the id still says which token
            texts[token] = None
    return texts[token]
