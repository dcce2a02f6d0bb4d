"""The propose stage: strategies that speculate draft tokens for their decode-ready sequences.

It runs before scheduling, because a draft is work to schedule: each draft token is one more position scored in
this step's forward. A strategy that does not override `Strategy.propose` is never called here.
"""

from __future__ import annotations

import logging
from collections import defaultdict

from decodekit.api.sequence import Request, Sequence
from decodekit.api.strategy import StepContext, Strategy
from decodekit.core.stages import Failure

log = logging.getLogger("decodekit.engine")



def propose(running: list[Request], ctx: StepContext) -> list[Failure]:
    """Let each speculating strategy draft for its running sequences that have exactly one token to compute;
    return the requests whose strategy failed (each fails alone)."""
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
        try:
            strategy.propose(ctx, seqs)
        except Exception as exc:  # a failing proposer fails its requests, not the engine
            log.exception("%s: propose failed", strategy.name)
            failures.extend((request, f"{strategy.name} failed to propose: {exc!r}")
                            for request in {id(s.request): s.request for s in seqs}.values())
    return failures
