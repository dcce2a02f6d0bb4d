"""Beam search inside the engine, with transformers' semantics (`generate(num_beams=..., length_penalty=...,
early_stopping=...)`), under continuous batching.

The beams of a request are sequences of that request: a chosen continuation of a beam reuses the beam's sequence
(or a fork of it that shares its KV blocks copy-on-write), and a beam with no chosen continuation is freed. Each
step, per request: the beams' processed log-probabilities plus their running scores give `beams_to_keep`
candidates (top-k over beams x vocab); candidates ending in EOS (or at the length limit) among the top
`num_beams` become finished hypotheses scored `logprob / generated_len ** length_penalty`; the best non-finished
candidates become the next beams; transformers' early-stopping heuristic decides when to stop.

A finished hypothesis is a sequence of its own (a fork of its beam with the last token appended, finished at once;
its blocks are released then), so the engine records its logprobs and trace like any other sequence's: per-token
`processed` logprobs are the beam's processed log-probabilities and add up to its score times
`generated_len ** length_penalty`. A traced request's events say, per step, which candidates were kept, finished
or dropped and which beams were pruned (`StepContext.note`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

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
    finished: list[tuple[Sequence, str] | None] = field(default_factory=list)  # the hypothesis and its reason
    heuristic_unsatisfied: bool = True
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # beam rows received, waiting for the others
    step_note: dict[str, Any] = field(default_factory=dict)  # this step's candidates and fates (traced requests)


_BEAMS = StashKey[_BeamState]()


class BeamSearchStrategy(Strategy):
    """Beam search with transformers' scoring, stopping and early-stopping rules.

    Example (recipe): `strategy: {beam_search: {num_beams: 4, length_penalty: 1.0, num_return_sequences: 2}}`
    """

    name = "beam_search"
    Params = BeamSearchParams
    handles_stopping = True
    scores = "logprobs"  # transformers' beam search processes log-probabilities
    tokenizer: Any = None

    def setup(self, info: Any) -> None:
        """Keep the tokenizer: a traced request's candidates are shown with their text."""
        self.tokenizer = info.tokenizer

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
        finished: list[tuple[Sequence, str] | None] = []
        new_hypotheses: dict[int, int] = {}  # candidate -> slot
        for j in best:
            if j < num_beams:
                finished.append(state.finished[j])
            elif bool(eligible[j - num_beams]) and not blocked:
                # a sequence of its own, forked before any beam gets this step's token
                c = j - num_beams
                reason = "stop" if token_of[c] in eos else "length"
                hypothesis = ctx.fork(state.beams[beam_of[c]])
                ctx.append_token(hypothesis, token_of[c])
                ctx.finish(hypothesis, reason)
                new_hypotheses[c] = len(finished)
                finished.append((hypothesis, reason))
            else:
                finished.append(None)
        kept_hypotheses = {id(h[0]) for h in finished if h is not None}
        for old in state.finished:
            if old is not None and id(old[0]) not in kept_hypotheses:
                ctx.free(old[0])  # displaced by a better one
        state.finished_scores = merged[best]
        state.finished = finished

        # Next beams: the best candidates that did not just finish.
        running = top_scores + hits.float() * _NEG
        chosen = running.topk(min(num_beams, keep)).indices.tolist()
        # A candidate a processor forbade (-inf, e.g. a grammar that allows fewer tokens than there are beams)
        # never becomes a beam; transformers would carry it along with a -inf score, which can never win.
        chosen = [c for c in chosen if running[c] != float("-inf")] or chosen[:1]
        state.scores = running[chosen]
        if request.params.trace is not None:
            self._note_step(ctx, state, new_hypotheses, chosen, beam_of, token_of, top_scores)

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
        self._advance(ctx, state, [beam_of[c] for c in chosen], [token_of[c] for c in chosen],
                      traced=request.params.trace is not None)

    def _note_step(self, ctx: StepContext, state: _BeamState, new_hypotheses: dict[int, int], chosen: list[int],
                   beam_of: list[int], token_of: list[int], top_scores: torch.Tensor) -> None:
        """For the trace: every candidate of this step with its fate, the beams left without a continuation, and
        each new hypothesis' place (the new beams are noted in `_advance`, once they are sequences)."""
        scores = top_scores.tolist()
        kept = set(chosen)
        candidates = [{"parent": b, "token": t, "text": self._text(t), "score": round(v, 6),
                       "fate": "kept" if c in kept else "finished" if c in new_hypotheses else "dropped"}
                      for c, (b, t, v) in enumerate(zip(beam_of, token_of, scores))]
        step = {"candidates": candidates,
                "pruned": sorted(set(range(len(state.beams))) - {beam_of[c] for c in chosen})}
        finals = state.finished_scores.tolist()
        for c, slot in new_hypotheses.items():
            hypothesis = state.finished[slot]
            assert hypothesis is not None
            ctx.note(hypothesis[0], chosen_by="beam search", beams=step,
                     beam={"parent": beam_of[c], "index": None, "score": round(scores[c], 6),
                           "final_score": round(finals[slot], 6)})
        state.step_note = step

    def _text(self, token: int) -> str | None:
        try:
            return str(self.tokenizer.decode([token])) if self.tokenizer is not None else None
        except Exception:  # a tokenizer that cannot decode one id alone: the id still says which token
            return None

    @staticmethod
    def _advance(ctx: StepContext, state: _BeamState, parents: list[int], tokens: list[int],
                 traced: bool = False) -> None:
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
        if traced:
            for index, (seq, parent, score) in enumerate(zip(children, parents, state.scores.tolist())):
                ctx.note(seq, chosen_by="beam search", beams=state.step_note,
                         beam={"parent": parent, "index": index, "score": round(score, 6)})
        state.beams = children

    @staticmethod
    def _finish(ctx: StepContext, request: Request, state: _BeamState, options: BeamSearchParams) -> None:
        results = [
            StrategyResult(seq.generated_ids, reason, float(score), sequence=seq)
            for hyp, score in zip(state.finished, state.finished_scores.tolist())
            if hyp is not None
            for seq, reason in [hyp]
        ][: options.num_return_sequences]
        ctx.set_results(request, results)
