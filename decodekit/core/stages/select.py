"""The select stage: each strategy turns its sequences' scores into actions on the step context.

The process stage grouped the sequences by strategy (one call per strategy per step) and made each group's scores
(`ProcessedRows.inputs`: what `Strategy.scores` declares). When a strategy raises, its requests are retried one by
one on their own rows, so only the culprits fail; requests that already got their tokens before the error keep them
(seeded generators are restored for the retried ones). A processor state hook that fails while a strategy appends or
forks never raises into the strategy: the step record keeps the fault and the request fails here, after the
strategies ran.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

from decodekit.api.processors import ProcessorError
from decodekit.api.sequence import Request
from decodekit.core import drafts
from decodekit.core.logprobs import record_logprobs, wants_logprobs
from decodekit.core.stages import Failure
from decodekit.core.stages.forward import ScoredRows
from decodekit.core.stages.process import ProcessedRows
from decodekit.core.step_context import EngineStepContext
from decodekit.core.trace import record_tokens, wants_trace

log = logging.getLogger("decodekit.engine")



def select(scored: ScoredRows, processed: ProcessedRows, ctx: EngineStepContext, tokenizer: Any = None
           ) -> list[Failure]:
    """Run every strategy on its scores, record the logprobs and trace events of what they chose (requests that
    ask); return the requests that failed (those whose processors failed in the process stage first)."""
    rows = scored.seqs
    ctx.scored, ctx.processed = scored, processed
    failures: list[Failure] = list(processed.failures)
    proposed = {seq: list(seq.draft_token_ids) for seq in rows if wants_trace(seq)}
    for group in processed.inputs:
        strategy, indices = group.strategy, group.indices
        # seeded generators, so that a request retried after the batch's failure draws what it would have drawn
        generators = [(seq.request, seq.generator, seq.generator.get_state()) for i in indices
                      if (seq := rows[i]).generator is not None]
        try:
            strategy.select(ctx, [rows[i] for i in indices], group.scores)
        except Exception:
            by_request: dict[int, list[int]] = defaultdict(list)
            for i in indices:
                by_request[id(rows[i].request)].append(i)
            retried = set()
            for part in by_request.values():
                request = rows[part[0]].request
                if not (request.finished or request in ctx.record.faults
                        or any(rows[i] in ctx.record.appended for i in part)):
                    retried.add(id(request))
                    _drop_tokenless_forks(request, ctx)
            for request, generator, state in generators:
                if id(request) in retried:
                    generator.set_state(state)
            for part in by_request.values():
                request = rows[part[0]].request
                if id(request) not in retried:
                    continue
                try:
                    strategy.select(ctx, [rows[i] for i in part], group.part(scored, part))
                except ProcessorError as exc:  # the message names the processor
                    log.warning("request %s failed: %s", request.request_id, exc)
                    failures.append((request, str(exc)))
                except Exception as exc:
                    log.warning("request %s failed in %s: %r", request.request_id, strategy.name, exc)
                    failures.append((request, f"{strategy.name} failed: {exc!r}"))
    for seq in rows:
        if seq.draft_branches and seq in ctx.scheduler.probes:  # a tree no strategy call accepted a branch of
            ctx.scheduler.drop_candidates(seq)
        drafts.clear(seq)
    raw_rows = scored.rows_by_sequence(wants_logprobs) if any(wants_logprobs(seq) for seq in rows) else {}
    for seq, (start, branch) in ctx.record.branch_rows.items():
        # a draft tree's accepted branch: its tokens read that branch's rows, not the tree's first ones
        end = start + 1 + len(branch)
        if seq in raw_rows:
            raw_rows[seq] = raw_rows[seq][start:end]
        if seq in processed.kept:
            processed.kept[seq] = processed.kept[seq][start:end]
        if seq in processed.trace_rows:
            processed.trace_rows[seq] = processed.trace_rows[seq][start:end]
        if seq in proposed:
            proposed[seq] = branch
    for seq, origin in ctx.record.accepted_from.items():
        # an accepted candidate was chosen from a row of an earlier step (`StepContext.score_candidates`)
        proposed.pop(seq, None)
        if origin.raw is not None and seq in raw_rows:
            raw_rows[seq] = origin.raw
        if origin.processed is not None:
            processed.kept[seq] = origin.processed
        if origin.trace is not None:
            processed.trace_rows[seq] = [origin.trace]
        if wants_trace(seq):
            proposed[seq] = []
    if raw_rows:
        record_logprobs(raw_rows, processed.kept, ctx.record.appended, ctx.record.parents, tokenizer)
    if proposed:
        record_tokens(processed.trace_rows, proposed, ctx.record.appended, ctx.record.parents, tokenizer,
                      ctx.record.notes)
    failures.extend(ctx.record.faults.items())
    failed = {id(request) for request, _ in failures}
    for request in {id(s.request): s.request for s in rows}.values():
        if id(request) not in failed and not request.finished and all(
                s.finished or (s.num_pending == 0 and not s.candidate_token_ids) for s in request.sequences):
            # nothing left to compute means never scheduled again: the request would hang its caller forever (one
            # sequence waiting alone is fine: beam search waits for beams that recompute after a preemption)
            failures.append((request, f"strategy {request.plan.strategy.name!r} left a sequence without a new "
                                      "token or a finish"))
    return failures


def _drop_tokenless_forks(request: Request, ctx: EngineStepContext) -> None:
    """Free the sequences a failed strategy call forked for `request` before it could give them a token."""
    for child in list(ctx.record.parents):
        if child.request is request and child not in ctx.record.appended and child in request.sequences:
            ctx.free(child)
