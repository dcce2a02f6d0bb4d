"""Decode runs: several greedy steps of a lone request in one native call (`ModelExecutor.decode_run`).

At batch 1 a step's own Python (scheduling, the forward's glue, processing, selection, stopping, emitting: ~0.4 ms
on a 2-core CPU) is 10-20% of a bf16, int8 or 4-bit token. When the engine serves one request and nothing waits
that could join it, and that request's next tokens are plain argmaxes (greedy, no processors, no logprobs or trace,
a strategy whose `Strategy.greedy_argmax` says its choice is the argmax and nothing else), the model runs up to
`EngineConfig.decode_run_steps` steps natively (embeddings, layers, final norm, LM head, argmax, ending after an
EOS or stop id), and the run's tokens go through the stop and emit stages as one step's tokens, as a speculative
step's accepted drafts do: every stopping criterion still checks every token in order (stop strings, max_tokens,
a plugin's criteria), and the tokens after a stop are dropped. The tokens are the ones step-by-step decoding picks
(the run makes the one-row step's calls with the same operands); a stream gets them a run at a time.

A run lasts up to `decode_run_steps` steps (32 on a CPU), fewer where that would take over ~0.1 s (`RUN_SECONDS`,
by the engine's timing of its earlier runs), so a stream of a slow model still gets its tokens every tenth of a
second. A request that arrives (or an abort) does not wait for a run in progress: the front-end raises the engine's
`RunInterrupt`, and the run ends after the token it is making (`AsyncLLM`).

An unseeded sampled request whose only processors are temperature, top_k, top_p and min_p (`plain_draw`: what an
OpenAI client sends by default, and llama.cpp's usual sampler settings) runs the same way, each token drawn in C from
the softmax at its temperature, truncated as those processors truncate it (`DrawRule`), by the inverse of its CDF at
a uniform from torch's global generator: the distribution step-by-step sampling draws from, with draws of its own
(an unseeded request promises its tokens' distribution, not the tokens; a seeded one decodes step by step, so its
tokens are the same alone and batched).
"""

from __future__ import annotations

from dataclasses import dataclass

from decodekit.api.config import EngineConfig
from decodekit.api.sampling import DrawRule, draw_rule
from decodekit.api.sequence import Request, Sequence
from decodekit.api.strategy import Strategy
from decodekit.core.scheduler import Scheduler, wants_hidden_states

RUN_SECONDS = 0.1
"""About the longest a run lasts (`timed_run_steps`): its tokens reach a stream together, so a run of a slow model
is kept short (a float32 token of the bundled model takes 8-13 ms on a 2-core CPU: 8-12 steps), a fast one's long
(a token of its GGUF ~2.7 ms: 32 steps, where a run of 8 left 0.07 ms of the step's Python a token against 0.03)."""

FIRST_RUN_STEPS = 8
"""A run's steps before the engine has timed one (and the fewest `timed_run_steps` gives where the limit allows)."""

RUN_TIME_DECAY = 0.7
"""The weight of the earlier runs in the engine's running mean of a run token's seconds (`Engine.run_token_seconds`)."""


def timed_run_steps(limit: int, token_seconds: float | None) -> int:
    """A run's most steps: `limit` (`EngineConfig.decode_run_steps`), cut to what lasts about `RUN_SECONDS` at
    `token_seconds` a token, but not below `FIRST_RUN_STEPS` (a token of several tens of ms pays the step's Python
    a hundred times over either way); `FIRST_RUN_STEPS` before any run was timed (None)."""
    floor = min(limit, FIRST_RUN_STEPS)
    if token_seconds is None or token_seconds <= 0:
        return floor
    return max(floor, min(limit, int(RUN_SECONDS / token_seconds)))


@dataclass(frozen=True)
class DecodeRunPlan:
    """A run the engine can make now: its request's one sequence, how many steps at most, the ids ending it, and
    how its tokens are drawn (None: each the argmax)."""

    request: Request
    seq: Sequence
    steps: int
    stop_ids: tuple[int, ...]
    rule: DrawRule | None = None


def _plain_request(request: Request) -> bool:
    """Greedy, one sequence, no processors or reasoning phases, no logprobs or trace, no hidden states, and a
    strategy that neither stops nor finalizes for the engine."""
    plan, params = request.plan, request.params
    if plan is None or not params.greedy or params.n != 1 or len(request.sequences) != 1:
        return False
    strategy = plan.strategy
    return (not plan.stages and plan.phases is None and params.logprobs is None and params.trace is None
            and not strategy.handles_stopping and not strategy.finalizes and not wants_hidden_states(request))


def _drawn_request(request: Request) -> DrawRule | None:
    """The `DrawRule` of a sampled request without a seed, one sequence, no reasoning phases, logprobs or trace, no
    hidden states, a strategy that neither stops nor finalizes for the engine, and no processors but temperature,
    top_k, top_p and min_p in their usual order (`draw_rule`); None otherwise. A native run draws with uniforms from
    torch's global generator: an unseeded request promises no tokens, only their distribution (a seeded one keeps
    its generator's draws, which are the same alone and batched)."""
    plan, params = request.plan, request.params
    if (plan is None or params.greedy or params.seed is not None or params.n != 1 or len(request.sequences) != 1
            or plan.phases is not None or params.logprobs is not None or params.trace is not None):
        return None
    strategy = plan.strategy
    if strategy.handles_stopping or strategy.finalizes or wants_hidden_states(request):
        return None
    return draw_rule(plan.stages)


def plain_draw(request: Request) -> DrawRule | None:
    """How `request`'s next tokens are drawn where each is a draw a native run can make and nothing else
    (`_drawn_request`), by a strategy that draws so (`Strategy.plain_draw`) without proposing drafts; None
    otherwise."""
    plan = request.plan
    if plan is None or not plan.strategy.plain_draw or type(plan.strategy).propose is not Strategy.propose:
        return None
    return _drawn_request(request)


def plain_greedy(request: Request) -> bool:
    """Whether `request`'s next tokens are each the argmax of the model's logits and nothing else: greedy, one
    sequence, no processors or reasoning phases, no logprobs or trace, and a strategy that takes the argmax
    (`Strategy.greedy_argmax`) without proposing drafts or reading hidden states."""
    if not _plain_request(request):
        return False
    assert request.plan is not None
    strategy = request.plan.strategy
    return strategy.greedy_argmax and type(strategy).propose is Strategy.propose


def plan_decode_run(scheduler: Scheduler, config: EngineConfig, eos_token_ids: tuple[int, ...],
                    max_model_len: int, proposed: bool = False,
                    token_seconds: float | None = None) -> DecodeRunPlan | None:
    """The run to make instead of this step, or None (then the step runs as usual): one request running, none
    waiting that could join it (`max_num_seqs` 1 queues the others until it ends), its sequence decoding one pending
    token, `plain_greedy` (or `plain_draw`: its tokens drawn natively by its `DrawRule`), and room for at least two
    steps before its `max_tokens` and `max_model_len`.

    With `proposed` (asked after the strategies proposed), a proposing strategy's request instead (greedy, or
    drawn by a `DrawRule` without a seed), left with no draft this step, for the steps its strategy allows
    (`Strategy.steps_without_drafts`): speculative decoding whose proposers found nothing, or whose adaptive k is 0
    where speculation cannot pay, decodes at a decode run's pace rather than a step at a time.

    `token_seconds`, what a run's token took lately, cuts the run to about `RUN_SECONDS` (`timed_run_steps`)."""
    limit = config.decode_run_steps
    assert limit is not None, "the execution plan resolves decode_run_steps (plan.CPU_RUN_STEPS, GRAPH_RUN_STEPS)"
    limit = timed_run_steps(limit, token_seconds)
    if limit < 2 or len(scheduler.running) != 1:
        return None
    if scheduler.waiting and config.max_num_seqs > 1:  # a waiting request could join the next step: no run delays it
        return None
    request = scheduler.running[0]
    if proposed:
        if request.plan is None or type(request.plan.strategy).propose is Strategy.propose:
            return None  # not proposing: `plain_greedy` and `plain_draw` decided before the step
        if _plain_request(request):
            rule = None
        else:  # sampled: a step without drafts draws from the processed row, as a run draws by its rule
            rule = _drawn_request(request)
            if rule is None:
                return None
        limit = min(limit, request.plan.strategy.steps_without_drafts(request))
    elif plain_greedy(request):
        rule = None
    else:
        rule = plain_draw(request)
        if rule is None:
            return None
    seq = request.sequences[0]
    if (seq.finished or seq.num_uncomputed != 1 or seq.draft_token_ids or seq.draft_branches
            or seq.candidate_token_ids):
        return None
    params = request.params
    # the last token a run adds is at most the request's last and the context's last
    steps = min(limit, max_model_len - len(seq.token_ids) + 1, params.max_tokens - seq.num_generated)
    if steps < 2:
        return None
    stops = () if params.ignore_eos else eos_token_ids
    return DecodeRunPlan(request, seq, steps, tuple(dict.fromkeys([*stops, *(params.stop_token_ids or ())])), rule)
