"""The propose stage: strategies that speculate draft tokens for their decode-ready sequences.

It runs before scheduling, because a draft is work to schedule: each draft token is one more position scored in
this step's forward. A strategy that does not override `Strategy.propose` is never called here. A reasoning
request's draft is cut where it departs from the tokens its phases force (`decodekit.core.phases.usable_draft`).
"""

from __future__ import annotations

import logging
from collections import defaultdict

from decodekit.api.sequence import Request, Sequence
from decodekit.api.strategy import StepContext, Strategy
from decodekit.core import drafts
from decodekit.core.phases import phase_state, usable_draft
from decodekit.core.stages import Failure

log = logging.getLogger("decodekit.engine")



def propose(running: list[Request], ctx: StepContext) -> list[Failure]:
    """Let each speculating strategy draft for its running sequences that have exactly one token to compute;
    return the requests whose strategy failed. When a strategy raises for its batch, it proposes again for each
    request alone, so only the culprits fail (a strategy must tolerate proposing again after a failed call)."""
    groups: dict[int, list[Sequence]] = defaultdict(list)
    strategies: dict[int, Strategy] = {}
    for request in running:
        strategy = request.plan.strategy
        if type(strategy).propose is Strategy.propose:
            continue
        for seq in request.sequences:
            if not seq.finished and seq.num_uncomputed == 1:
                groups[id(strategy)].append(seq)
                strategies[id(strategy)] = strategy
    failures: list[Failure] = []
    for key, seqs in groups.items():
        strategy = strategies[key]
        generators = [(seq.generator, seq.generator.get_state()) for seq in seqs if seq.generator is not None]
        try:
            strategy.propose(ctx, seqs)
        except Exception:  # retry request by request (without drafts), so that only the culprits fail
            for generator, state in generators:  # a retried request drafts what it would have drafted
                generator.set_state(state)
            by_request: dict[int, list[Sequence]] = defaultdict(list)
            for seq in seqs:
                drafts.clear(seq)
                by_request[id(seq.request)].append(seq)
            for part in by_request.values():
                try:
                    strategy.propose(ctx, part)
                except Exception as exc:
                    log.warning("request %s: %s failed to propose: %r", part[0].request.request_id, strategy.name,
                                exc)
                    for seq in part:
                        drafts.clear(seq)
                    failures.append((part[0].request, f"{strategy.name} failed to propose: {exc!r}"))
        for seq in seqs:  # a reasoning request's draft stops where it departs from a forced marker
            if (seq.draft_token_ids or seq.draft_branches) and seq.request.plan.phases is not None:
                phases = phase_state(seq)
                if phases is not None:
                    drafts.cut(seq, usable_draft(phases, seq.draft_token_ids))
                    for b, branch in enumerate(seq.draft_branches):  # each branch of a draft tree alike
                        drafts.cut_branch(seq, b, usable_draft(phases, branch))
    return failures
