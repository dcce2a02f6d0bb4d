"""Requests, their sequences, and the outputs and metrics the engine emits for them."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from decodekit.api.params import SamplingParams
from decodekit.api.stash import Stash
from decodekit.api.tools import ToolCall

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Per-request timings (seconds, `time.perf_counter` based); derived figures are properties."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0  # every returned sequence's tokens, added up
    # the longest returned sequence's tokens: the output positions the request decoded
    num_output_positions: int = 0
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative decoding: tokens proposed
    num_accepted_tokens: int = 0  # speculative decoding: proposed tokens the target accepted
    # speculative decoding, per proposer that drafted: {"drafted": n, "accepted": m, "steps": verifications} (chained
    # proposers split it); 1 + accepted / steps is its acceptance length (tokens per verification)
    proposer_tokens: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def count_outputs(self, lengths: list[int]) -> None:
        """Record the token counts of the sequences a request returns (or holds so far)."""
        self.num_generated_tokens = sum(lengths)
        self.num_output_positions = max(lengths, default=0)

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, per output position: a request returning several sequences (`n`,
        beam search) decodes them side by side, so this is the time after the first token over the longest returned
        sequence's tokens minus one (vLLM's rule), not over every sequence's tokens added up. None with fewer than
        two positions."""
        positions = self.num_output_positions or self.num_generated_tokens
        if self.finished_time is None or self.first_token_time is None or positions < 2:
            return None
        return (self.finished_time - self.first_token_time) / (positions - 1)

    @property
    def e2e(self) -> float | None:
        """End-to-end latency: arrival to finish."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly summary."""
        return {
            "ttft_s": self.ttft,
            "tpot_s": self.tpot,
            "e2e_s": self.e2e,
            "prompt_tokens": self.num_prompt_tokens,
            "generated_tokens": self.num_generated_tokens,
            "output_positions": self.num_output_positions or self.num_generated_tokens,
            "cached_prompt_tokens": self.num_cached_prompt_tokens,
            "preemptions": self.num_preemptions,
            "draft_tokens": self.num_draft_tokens,
            "accepted_tokens": self.num_accepted_tokens,
            **({"proposer_tokens": {k: dict(v) for k, v in self.proposer_tokens.items()}}
               if self.proposer_tokens else {}),
        }


@dataclass(eq=False)
class Sequence:
    """One token stream of a request: the prompt plus what has been generated, and how much is in the KV cache.

    A request has one sequence, or several for parallel sampling and beam search (forked from the first).

    Plugins read every field; each field has one writer in the engine:

    | field | written by |
    |---|---|
    | `request`, `seq_id`, `num_prompt_tokens` | set when the sequence is made (never change) |
    | `token_ids`, `processor_states`, `generator` | the step context (`append_token`, `accept_draft`, `fork`) |
    | `status`, `num_computed_tokens` | the scheduler (admission, preemption, forward progress, rollback) |
    | `draft_token_ids`, `draft_branches` | a strategy's `propose`; the engine changes them in `core/drafts.py` only |
    | `candidate_token_ids` | the step context (`score_candidates`, `accept_candidate`) and the scheduler |
    | `detokenizer`, `text`, `new_text_len` | the stop stage (`core/stages/stop.py`), which detokenizes each token |
    | `finish_reason`, `stop_reason` | request lifecycle (`core/requests.py`) when the sequence finishes |
    | `logprobs`, `cumulative_logprob` | `core/logprobs.py` (after the select stage; trimmed after stop); `fork` |
    | `trace` | `core/trace.py` (token events after the select stage, the stop event after stop); `fork` |
    | `stash` (typed, see `decodekit.api.stash`), `state` (a plain dict) | the plugins that own the keys |
    """

    request: Request
    token_ids: list[int]
    num_prompt_tokens: int
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    generator: torch.Generator | None = None
    detokenizer: Any = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    new_text_len: int = 0  # characters the newest token added to `text` (stop strings search only that tail)
    stash: Stash = field(default_factory=Stash)  # typed per-plugin state (`StashKey`s)
    state: dict[str, Any] = field(default_factory=dict)  # untyped per-plugin state (kept for existing plugins)
    draft_token_ids: list[int] = field(default_factory=list)  # proposed, not yet verified (speculative decoding)
    # a draft tree's root-to-leaf branches, each verified as a probe in the next forward (`decodekit.api.draft_tree`)
    draft_branches: list[list[int]] = field(default_factory=list)
    # sibling next tokens scored side by side in the next forward (`StepContext.score_candidates`)
    candidate_token_ids: list[int] = field(default_factory=list)
    processor_states: list[Any] = field(default_factory=list)  # one per stage of the request's plan
    logprobs: list[TokenLogprobs] | None = None  # one per generated token, when the request asks for them
    cumulative_logprob: float = 0.0
    trace: list[dict[str, Any]] | None = None  # one event per generated token, then the stop (`SamplingParams.trace`)

    @property
    def num_generated(self) -> int:
        """How many tokens this sequence has generated."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_ids(self) -> list[int]:
        """The generated token ids."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose keys and values are not yet in the cache."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_pending(self) -> int:
        """Tokens to compute next, drafts included (speculative verification scores them in the same forward)."""
        return len(self.token_ids) + len(self.draft_token_ids) - self.num_computed_tokens

    @property
    def num_scored_positions(self) -> int:
        """Rows of scores this sequence gets when its pending work completes: one, plus one per draft token; or,
        when it has candidates (`StepContext.score_candidates`), one per candidate (each the position after it); with
        a draft tree, `1 + len(branch)` per branch, branch after branch."""
        if self.draft_branches:
            return sum(1 + len(branch) for branch in self.draft_branches)
        return len(self.candidate_token_ids) or 1 + len(self.draft_token_ids)

    @property
    def greedy(self) -> bool:
        """Whether this sequence decodes by argmax (its request's temperature is 0)."""
        return self.request.params.greedy

    @property
    def finished(self) -> bool:
        """Whether the sequence is done."""
        return self.status is SequenceStatus.FINISHED


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability at one position (vLLM's shape): its value, its rank among the vocabulary (1 is
    the most likely; ties share the better rank), and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


TokenLogprobs = dict[int, Logprob]
"""One position's logprobs: token id -> `Logprob`, the chosen token first, then the top alternatives."""


@dataclass
class CompletionOutput:
    """One returned sequence of a request (vLLM's shape): text, token ids, why it ended."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None  # the sum of the chosen tokens' logprobs, when logprobs are asked for
    score: float | None = None  # the strategy's ranking score (beam search: length-penalized log-probability)
    logprobs: list[TokenLogprobs] | None = None  # one per generated token (`SamplingParams.logprobs`)
    trace: list[dict[str, Any]] | None = None  # the decoding trace (`SamplingParams.trace`, `decodekit.core.trace`)
    tool_calls: list[ToolCall] | None = None  # the calls read back from `text` (`LLM.chat(..., tools=...)`)
    # a reasoning request (`SamplingParams.reasoning`): `text` is then the answer, this the thinking (markers removed)
    reasoning_text: str | None = None
    # ... and how many generated tokens were the thinking's, its markers included (the rest are the answer's)
    reasoning_token_count: int | None = None


@dataclass
class RequestOutput:
    """What a request has produced: all its outputs; in streaming, `delta_text`/`delta_token_ids` per output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    delta_text: list[str] = field(default_factory=list)
    delta_token_ids: list[list[int]] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token (None for the first)
    delta_reasoning_text: list[str] | None = None  # a reasoning request's new thinking (`delta_text`: its answer)

    @property
    def text(self) -> str:
        """The first output's text."""
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        """The first output's token ids."""
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def finish_reason(self) -> str | None:
        """The first output's finish reason: "stop", "length", "abort" or "error"."""
        return self.outputs[0].finish_reason if self.outputs else None


@dataclass(eq=False)
class Request:
    """A user's request: prompt, parameters, its sequences and metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    sequences: list[Sequence] = field(default_factory=list)
    error: str | None = None
    plan: Any = None  # the resolved `decodekit.core.plan.Plan` (request lifecycle)
    results: list[Any] | None = None  # final outputs a strategy set (`StrategyResult`), else one per sequence
    max_sequences: int = 1  # sequences the request will run at once (admission counts these)
    metrics: RequestMetrics = field(init=False)
    stash: Stash = field(default_factory=Stash)  # typed per-plugin state (`StashKey`s)
    state: dict[str, Any] = field(default_factory=dict)  # untyped per-plugin state (kept for existing plugins)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # `params.prompt_logprobs`: None for the first token
    forks: int = 0  # sequences forked from this request's so far (numbers each fork: seeds a seeded request's forks)
    final_only: bool = False  # its caller reads only the final output: no per-step deltas are built for it

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(self.arrival_time, num_prompt_tokens=len(self.prompt_token_ids))

    @property
    def finished(self) -> bool:
        """All sequences are finished (or the request failed)."""
        return self.error is not None or self.results is not None or all(s.finished for s in self.sequences)
