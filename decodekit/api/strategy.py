"""The search-strategy contract: per request, which positions need scores, and what to do with them.

A strategy is built once per engine and serves every request that names it. Per step it may `propose` draft
tokens for its running sequences (each draft token adds one scored position: speculative decoding scores k+1
positions in one forward), then `select` turns the scores into actions through the `StepContext`: append tokens,
accept a prefix of a draft (the rest is rolled back), fork a sequence (its KV blocks shared copy-on-write), free
a sequence, finish one, or set a request's final results (beam search). Stopping criteria then run on every
token appended, unless the strategy `handles_stopping` itself.

What `select` receives is the strategy's choice (`Strategy.scores`): the rows after each request's processors
(`"logits"`), the processors applied to log-probabilities (`"logprobs"`, as transformers' beam search does), or
the model's raw logits (`"raw"`, the default, for strategies that call `ctx.process` themselves).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import torch
from pydantic import BaseModel

from decodekit.api.params import SamplingParams
from decodekit.api.processors import BatchView, Stage
from decodekit.api.sequence import Request, Sequence
from decodekit.api.step_cost import StepTiming

TokenDistribution = Literal["processed", "deterministic"] | None
"""What a strategy's tokens are drawn from (`Strategy.token_distribution`)."""


@dataclass
class StrategyResult:
    """One final output a strategy chose for its request (beam search: a hypothesis and its score).

    `sequence`, when given, is the finished sequence this output is (a hypothesis kept as a sequence of its own:
    fork a live one, append the last token, finish it); the output then carries that sequence's logprobs and
    trace, which the engine records for every sequence as for any other. Without it, the output has none.
    """

    token_ids: list[int]
    finish_reason: str
    score: float | None = None
    stop_reason: str | int | None = None
    sequence: Sequence | None = None


@dataclass
class HiddenStates:
    """Last hidden states of one sequence's positions computed in a step (`StepContext.hidden_states`).

    Row `i` is the final norm's output (the LM head's input) at position `start + i` of `seq.token_ids` followed by
    its draft; for a sequence whose candidates were scored (`candidates` True), row `i` is candidate `i`'s, every
    one at position `start`. A prompt computed in chunks arrives whole, when its last chunk is scored.
    """

    start: int
    states: torch.Tensor
    candidates: bool = False


class StepContext(Protocol):
    """What the engine offers a strategy during one step."""

    eos_token_ids: tuple[int, ...]
    max_model_len: int
    step_timing: StepTiming | None
    """This step's verification time and rows (`StepTiming`): set once the forward and process stages ran, so
    `select` reads it (None in `propose`, in a step with no forward, and in contexts that do not time steps)."""

    @property
    def num_running(self) -> int:
        """Sequences running in the engine this step, of every request and strategy (the batch size)."""
        ...

    def batch_view(self, seqs: list[Sequence]) -> BatchView:
        """The processors' view of these sequences (one row per scored position)."""
        ...

    def process(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Apply each request's processors, in order, to `logits` (`1 + len(seq.draft_token_ids)` rows per
        sequence, each position with its own history)."""
        ...

    def process_after(self, logits: torch.Tensor, seqs: list[Sequence], extra: list[list[int]],
                      allow_empty_rows: bool = False) -> torch.Tensor:
        """Apply each request's processors to one row per sequence: the position after `seq.token_ids +
        extra[i]` (a proposer scoring what it drafts; those tokens count as unverified drafts).

        With `allow_empty_rows`, a row the processors leave with nothing to choose is the caller's to handle, not
        a fault of the request: a proposer whose logits cover only part of the vocabulary (a draft head's) meets a
        constraint that allows only tokens outside it, and stops drafting there."""
        ...

    def append_token(self, seq: Sequence, token_id: int) -> None:
        """Append a token to a sequence; stopping criteria run on it at the end of the step."""
        ...

    def accept_draft(self, seq: Sequence, num_accepted: int, token_id: int, proposer: str | None = None) -> None:
        """Keep the first `num_accepted` draft tokens, then append `token_id`; the rest of the draft is rolled
        back (KV slots released). `proposer`, when given, names who drafted it, for the request's per-proposer
        acceptance (`RequestMetrics.proposer_tokens`)."""
        ...

    def accept_branch(self, seq: Sequence, branch: int, num_accepted: int, token_id: int,
                      proposer: str | None = None) -> None:
        """For a sequence verified with a draft tree (`seq.draft_branches`): keep the first `num_accepted` tokens of
        branch `branch`, then append `token_id`. The sequence adopts that branch's KV blocks (the rest of the tree
        is freed) and the processor states its rows were scored with; its logprobs and trace read that branch's
        rows."""
        ...

    def fork(self, seq: Sequence, seed: int | None = None) -> Sequence:
        """A new running sequence of the same request sharing `seq`'s tokens and KV blocks (copy-on-write),
        processor states and stash; `seed` gives it its own seeded generator (else it samples from the global
        RNG), so a seeded request's forks draw the same tokens alone or batched."""
        ...

    def free(self, seq: Sequence) -> None:
        """Drop a sequence of a request that goes on (a pruned beam); it is not returned."""
        ...

    def score_candidates(self, seq: Sequence, token_ids: list[int]) -> None:
        """Score these sibling tokens as `seq`'s next token, side by side, in the next step's forward (instead of
        appending one now): `seq` then gets one row of scores per candidate, the position after it
        (`seq.candidate_token_ids` lists them), and hidden states per candidate when the strategy asks for them.
        Costs one forward row per candidate, sharing the sequence's KV blocks. Every token of `seq` must be
        computed (call it instead of `append_token`, or after `accept_candidate`). A preemption or any other action
        on `seq` drops them: the strategy then gets the ordinary single row again."""
        ...

    def accept_candidate(self, seq: Sequence, index: int) -> None:
        """Append `seq.candidate_token_ids[index]` (scored this step), keeping the key and value the forward computed
        for it: the token is not recomputed, and the rows of its candidate are the scores of the next position."""
        ...

    def hidden_states(self, seq: Sequence) -> HiddenStates | None:
        """The last hidden states of the positions computed for `seq` this step (strategies with
        `hidden_states = True` only; None otherwise or when nothing was computed for it)."""
        ...

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Finish a sequence with a finish reason ("stop", "length")."""
        ...

    def set_results(self, request: Request, results: list[StrategyResult]) -> None:
        """Set a request's final outputs (instead of one output per sequence) and finish it."""
        ...

    def note(self, seq: Sequence, **facts: Any) -> None:
        """Add facts to this step's event of `seq` in the decoding trace (`SamplingParams.trace`): what the strategy
        decided and why (beam search: the candidates, their scores and fates). A dict merges into a dict the event
        already has (`drafts`). Values must be JSON-ready. Kept only when the request asks for the trace
        (`seq.request.params.trace is not None`): check that first when the facts cost anything to build."""
        ...


class Strategy:
    """Base class of search strategies.

    Subclasses set `name` and `Params` (pydantic, `extra="forbid"`; None for no parameters) and implement
    `select`. A request's validated parameters are in `seq.request.plan.strategy_options`.

    Attributes:
        handles_stopping: the strategy finishes its own sequences (the engine's stopping criteria are skipped).
        scores: what `select` receives: "logits" (after each request's processors), "logprobs" (processors
            applied to log-softmax scores) or "raw" (the model's logits; call `ctx.process` yourself).
        hidden_states: the strategy reads last hidden states (`ctx.hidden_states(seq)`, contrastive search); its
            requests' prompts are then computed in full, never served from the prefix cache. A strategy that needs
            them for some requests only overrides `reads_hidden_states` instead, and one that can start from the
            first computed position overrides `needs_every_hidden_state`.
        finalizes: the strategy chooses its request's outputs after the engine's stopping (`finalize`: best-of-n
            ranking); its requests stream no deltas, only the final output.
        continues_prompt: each output continues the prompt token by token, scored as the model scores it, so the
            prompt's logprobs can lead its own (a completion's `echo`, for loglikelihood). False for a strategy
            whose outputs are whole sequences scored together (beam search): `echo` is refused with it.
        greedy_argmax: for a greedy request of one sequence, `select` appends the argmax of its row and does
            nothing else (no forks, notes or finishes): the engine may then run several of its steps natively when
            it is the only request (`EngineConfig.decode_run_steps`, `decodekit.core.decode_runs`).
        plain_draw: for a sampled request of one sequence, `select` appends a token drawn from the softmax of its
            processed row and does nothing else: the engine may then run an unseeded request's steps natively as
            it does a greedy one's (`decodekit.core.decode_runs`), drawing in C.
    """

    name: ClassVar[str] = "strategy"
    Params: ClassVar[type[BaseModel] | None] = None
    handles_stopping: ClassVar[bool] = False
    scores: ClassVar[Literal["raw", "logits", "logprobs"]] = "raw"
    hidden_states: ClassVar[bool] = False
    finalizes: ClassVar[bool] = False
    continues_prompt: ClassVar[bool] = True
    greedy_argmax: ClassVar[bool] = False
    plain_draw: ClassVar[bool] = False

    def setup(self, info: Any) -> None:
        """Called once with the engine's `ComponentInfo` (tokenizer, vocab size, draft model, ...)."""

    def check_options(self, options: BaseModel | None) -> None:
        """Refuse parameters pydantic cannot: raise `ValueError` saying why (path `strategy.<name>`). Static: runs
        at `decodekit recipe check` too, where no engine exists; before `check_compatible`."""

    def check_options_with(self, options: BaseModel | None, info: Any) -> None:
        """Refuse parameters this engine cannot serve (`info`: the `ComponentInfo` given to `setup`): raise
        `ValueError`. Runs only inside an engine, after `check_options` and `setup(info)`."""

    def check_compatible(self, options: BaseModel | None, params: SamplingParams, stages: tuple[Stage, ...]) -> None:
        """Refuse a combination this strategy cannot run (raise `ValueError` saying which and why)."""

    def reads_hidden_states(self, options: BaseModel | None) -> bool:
        """Whether requests with these options read last hidden states (default: the class's `hidden_states`).
        The speculative strategy says yes when its proposer reads them (`Proposer.hidden_states`)."""
        return self.hidden_states

    def needs_every_hidden_state(self, options: BaseModel | None) -> bool:
        """Whether requests with these options need the hidden state of every position, the prompt's first one
        included, so that their prompts must be computed in full rather than served from the prefix cache
        (default: whenever they read hidden states). The speculative strategy says no when its proposers can
        start mid-prompt (`Proposer.partial_hidden_states`)."""
        return self.reads_hidden_states(options)

    def token_distribution(self, options: BaseModel | None, params: SamplingParams) -> TokenDistribution:
        """What the tokens of requests with these options are drawn from, for metrics that compare it with the
        model's own distribution (`decodekit compare`'s KL): "processed" (each token sampled from the distribution
        `logprobs_mode="processed"` reports), "deterministic" (each choice certain: greedy, beam and contrastive
        search), or None (not known: the default, and best-of-n, which ranks finished samples)."""
        return None

    def num_sequences(self, options: BaseModel | None, params: SamplingParams) -> int:
        """How many sequences a request will run at once (for admission limits)."""
        return 1

    def propose(self, ctx: StepContext, seqs: list[Sequence]) -> None:
        """Before scheduling: set `seq.draft_token_ids` on running sequences that should verify drafts."""

    def select(self, ctx: StepContext, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Turn `logits` (the scores `scores` asks for, `1 + len(seq.draft_token_ids)` rows per sequence, in order)
        into actions."""
        raise NotImplementedError

    def steps_without_drafts(self, request: Request) -> int:
        """For a strategy that proposes: how many steps of `request` (one sequence, greedy or sampled without a seed
        by a `DrawRule`'s processors) may run natively, as one decode run (`decodekit.core.decode_runs`), when
        `propose` left it nothing to verify this step: its `select` then appends the argmax (sampled: a draw from the
        processed row) and nothing else that the run could miss (no forks, notes, finishes, or state the next
        `propose` would not catch up on). 0 (the default): never; the strategy's steps are all its own."""
        return 0

    def ran_natively(self, request: Request, tokens: int, seconds: float) -> None:
        """After a decode run of `request` that `steps_without_drafts` allowed: `tokens` tokens were decoded
        natively in `seconds` (the forward, the argmaxes and the run's Python), what plain decoding costs it now.
        Speculative decoding calibrates its cost model's one-row step with it, so it weighs drafts against the
        decoding it would otherwise get. Default: nothing."""

    def finalize(self, request: Request) -> list[StrategyResult] | None:
        """Called once when every sequence of a request has finished (stopping criteria included), before its final
        output is built, when `finalizes` is True: return the outputs, best first (None keeps one per sequence).
        Not called for a request that failed or was aborted."""
        return None

    def on_request_finished(self, request: Request) -> None:
        """Release per-request resources (a draft model's KV blocks, ...)."""
