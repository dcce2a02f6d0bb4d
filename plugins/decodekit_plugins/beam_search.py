"""Beam search inside the engine, with transformers' semantics (`generate(num_beams=..., length_penalty=...,
early_stopping=...)`), under continuous batching.

The beams of a request are sequences of that request: a chosen continuation of a beam reuses the beam's sequence
(or a fork of it that shares its KV blocks copy-on-write), and a beam with no chosen continuation is freed. Each
step, per request: the beams' processed log-probabilities plus their running scores give `beams_to_keep`
candidates (top-k over beams x vocab); candidates ending in EOS (or at the length limit) among the top
`num_beams` become finished hypotheses scored `logprob / generated_len ** length_penalty`; the best non-finished
candidates become the next beams; transformers' early-stopping heuristic decides when to stop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from decodekit.api.params import SamplingParams
from decodekit.api.processors import Stage
from decodekit.api.sequence import Request, Sequence
from decodekit.api.stash import StashKey
from decodekit.api.strategy import StepContext, Strategy, StrategyResult

_NEG = -1.0e9  # transformers' "impossible" score


class BeamSearchParams(BaseModel):
    """Parameters of the `beam_search` strategy (transformers' names and semantics)."""

    model_config = ConfigDict(extra="forbid")

    num_beams: int = Field(4, ge=1, le=64, description="Beams kept per request.")
    length_penalty: float = Field(1.0, description="Finished scores are logprob / generated_len ** length_penalty.")
    early_stopping: bool | Literal["never"] = Field(
        False, description="True: stop when num_beams hypotheses are done; False: heuristic; 'never': exhaustive."
    )
    num_return_sequences: int = Field(1, ge=1, description="How many of the best hypotheses to return.")

    @model_validator(mode="after")
    def _check(self) -> BeamSearchParams:
        if self.num_return_sequences > self.num_beams:
            raise ValueError(f"num_return_sequences ({self.num_return_sequences}) must be <= num_beams "
                             f"({self.num_beams})")
        return self


@dataclass
class _BeamState:
    """One request's search state: live beams (best first) and the finished hypotheses."""

    beams: list[Sequence]
    scores: torch.Tensor  # running log-prob per live beam
    finished_scores: torch.Tensor  # num_beams slots, _NEG when empty
    finished: list[tuple[list[int], str] | None] = field(default_factory=list)
    heuristic_unsatisfied: bool = True
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # beam rows received, waiting for the others


_BEAMS = StashKey[_BeamState]()


class BeamSearchStrategy(Strategy):
    """Beam search with transformers' scoring, stopping and early-stopping rules.

    Example (recipe): `strategy: {beam_search: {num_beams: 4, length_penalty: 1.0, num_return_sequences: 2}}`
    """

    name = "beam_search"
    Params = BeamSearchParams
    handles_stopping = True
    scores = "logprobs"  # transformers' beam search processes log-probabilities

    def check_compatible(self, options: BaseModel | None, params: SamplingParams, stages: tuple[Stage, ...]) -> None:
        assert isinstance(options, BeamSearchParams)
        warpers = [s.processor.name for s in stages if s.processor.argmax_invariant]
        if warpers:
            raise ValueError(f"beam search is deterministic, so sampling warpers ({', '.join(warpers)}) cannot apply; "
                             "remove them (temperature, top_k, top_p, min_p, ...)")
        if params.n > 1:
            raise ValueError("use beam_search.num_return_sequences instead of n")
        if params.stop:
            raise ValueError("stop strings are not supported with beam search (use stop_token_ids)")
        if params.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with beam search")
        if params.trace is not None:
            raise ValueError("the decoding trace is not available with beam search yet")
        if params.logprobs is not None:
            raise ValueError("logprobs are not available with beam search yet (each hypothesis' score is its "
                             "cumulative log-probability: CompletionOutput.score)")
        if params.stopping:
            # beam search finishes its hypotheses itself (EOS, stop_token_ids, max_tokens); refusing is better
            # than running a named criterion's request to the end as if it were not there
            names = ", ".join(spec.name for spec in params.stopping)
            raise ValueError(f"stopping criteria ({names}) are not applied by beam search; remove them "
                             "(max_tokens and stop_token_ids apply)")

    def num_sequences(self, options: BaseModel | None, params: SamplingParams) -> int:
        assert isinstance(options, BeamSearchParams)
        return options.num_beams

    def select(self, ctx: StepContext, seqs: list[Sequence], log_probs: torch.Tensor) -> None:
        by_request: dict[int, list[int]] = {}
        for i, seq in enumerate(seqs):
            by_request.setdefault(id(seq.request), []).append(i)
        for rows in by_request.values():
            self._step(ctx, seqs[rows[0]].request, [seqs[i] for i in rows], log_probs[rows])

    def _step(self, ctx: StepContext, request: Request, seqs: list[Sequence], log_probs: torch.Tensor) -> None:
        options = request.plan.strategy_options
        assert isinstance(options, BeamSearchParams)
        state = request.stash.get(_BEAMS, None)
        device = log_probs.device
        if state is None:  # first token: one live beam (transformers' other initial beams score -1e9)
            state = _BeamState([seqs[0]], torch.zeros(1, device=device),
                               torch.full((options.num_beams,), _NEG, device=device), [None] * options.num_beams)
            request.stash[_BEAMS] = state
        # After a preemption the beams are recomputed and may finish their prefill in different steps: wait for all.
        state.pending.update({id(s): log_probs[i] for i, s in enumerate(seqs)})
        if any(id(b) not in state.pending for b in state.beams):
            return
        log_probs = torch.stack([state.pending[id(b)] for b in state.beams])  # rows in beam order
        state.pending = {}
        num_beams, vocab = options.num_beams, log_probs.shape[-1]
        eos = set(ctx.eos_token_ids) | set(request.params.stop_token_ids)
        generated = state.beams[0].num_generated  # all beams have the same length
        at_limit = generated + 1 >= request.params.max_tokens or len(state.beams[0].token_ids) + 1 >= ctx.max_model_len

        flat = (log_probs + state.scores[:, None]).reshape(-1)
        keep = min(max(2, 1 + len(eos)) * num_beams, flat.numel())
        top_scores, top_index = flat.topk(keep)
        beam_of, token_of = (top_index // vocab).tolist(), (top_index % vocab).tolist()
        hits = torch.tensor([at_limit or t in eos for t in token_of], device=device)

        # Finished hypotheses: among the top num_beams candidates, those that hit EOS or the length limit.
        all_done = all(h is not None for h in state.finished)
        blocked = (all_done and options.early_stopping is True) or not state.heuristic_unsatisfied
        new_final = top_scores / float(generated + 1) ** options.length_penalty
        eligible = hits & (torch.arange(keep, device=device) < num_beams)
        new_final = torch.where(eligible & (not blocked), new_final, new_final + _NEG * 3)
        merged = torch.cat([state.finished_scores, new_final])
        best = merged.topk(num_beams).indices.tolist()
        finished: list[tuple[list[int], str] | None] = []
        for j in best:
            if j < num_beams:
                finished.append(state.finished[j])
            elif bool(eligible[j - num_beams]) and not blocked:
                c = j - num_beams
                reason = "stop" if token_of[c] in eos else "length"
                finished.append(([*state.beams[beam_of[c]].generated_ids, token_of[c]], reason))
            else:
                finished.append(None)
        state.finished_scores = merged[best]
        state.finished = finished

        # Next beams: the best candidates that did not just finish.
        running = top_scores + hits.float() * _NEG
        chosen = running.topk(min(num_beams, keep)).indices.tolist()
        # A candidate a processor forbade (-inf, e.g. a grammar that allows fewer tokens than there are beams)
        # never becomes a beam; transformers would carry it along with a -inf score, which can never win.
        chosen = [c for c in chosen if running[c] != float("-inf")] or chosen[:1]
        state.scores = running[chosen]

        # Early-stopping heuristic (transformers' `_check_early_stop_heuristic`), at the new length.
        new_len = generated + 1
        if options.early_stopping == "never" and options.length_penalty > 0.0:
            best_len = request.params.max_tokens
        else:
            best_len = new_len
        best_possible = float(state.scores[0]) / float(best_len) ** options.length_penalty
        slots_done = [h is not None for h in state.finished]
        worst = float(state.finished_scores.min()) if all(slots_done) else None
        state.heuristic_unsatisfied = state.heuristic_unsatisfied and (worst is None or best_possible > worst)
        stop = (not state.heuristic_unsatisfied or (all(slots_done) and options.early_stopping is True)
                or bool(hits.all()))
        if stop:
            self._finish(ctx, request, state, options)
            return
        self._advance(ctx, state, [beam_of[c] for c in chosen], [token_of[c] for c in chosen])

    @staticmethod
    def _advance(ctx: StepContext, state: _BeamState, parents: list[int], tokens: list[int]) -> None:
        """Turn chosen (parent beam, token) pairs into live sequences: reuse a parent once, fork it for more."""
        used: set[int] = set()
        children: list[Sequence] = []
        for parent in parents:
            seq = state.beams[parent]
            if parent in used:
                children.append(ctx.fork(seq))  # forks are taken before any token is appended to the parent
            else:
                used.add(parent)
                children.append(seq)
        for index, seq in enumerate(state.beams):
            if index not in used:
                ctx.free(seq)
        for seq, token in zip(children, tokens):
            ctx.append_token(seq, token)
        state.beams = children

    @staticmethod
    def _finish(ctx: StepContext, request: Request, state: _BeamState, options: BeamSearchParams) -> None:
        results = [
            StrategyResult(ids, reason, float(score))
            for hyp, score in zip(state.finished, state.finished_scores.tolist())
            if hyp is not None
            for ids, reason in [hyp]
        ][: options.num_return_sequences]
        ctx.set_results(request, results)

