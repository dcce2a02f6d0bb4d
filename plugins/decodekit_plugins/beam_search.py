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

The step of one group of beams (`BeamGroup`, `beam_step`, `finish_with_hypotheses`) is public to the other
beam-based strategies of this package: diverse beam search runs one group per beam group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from decodekit.api.params import SamplingParams
from decodekit.api.processors import Stage
from decodekit.api.sequence import Request, Sequence
from decodekit.api.stash import StashKey
from decodekit.api.strategy import StepContext, Strategy, StrategyResult, TokenDistribution

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


@dataclass(frozen=True)
class BeamRules:
    """How a group of beams steps: transformers' parameters, and which of its two implementations to follow.

    Attributes:
        num_beams: the group's beams, and its slots for finished hypotheses.
        length_penalty: finished scores are `logprob / generated_len ** length_penalty`.
        early_stopping: True, False (the heuristic) or "never".
        scorer: follow the `BeamSearchScorer` that transformers' group beam search used, instead of the vectorized
            beam search of transformers >= 4.50 (plain `beam_search`). They differ in two corners: the early-stop
            heuristic bounds the future by the best candidate of the step (an EOS candidate included), not by the
            best running beam; and at the length limit the EOS candidates finish first and the running beams join
            the hypotheses only if that left the group not done (`finalize`), instead of every top candidate
            finishing at once.
        label: who chose the tokens, in the trace (`chosen_by`).
    """

    num_beams: int
    length_penalty: float
    early_stopping: bool | Literal["never"]
    scorer: bool = False
    label: str = "beam search"


@dataclass
class BeamGroup:
    """One group of beams: its live beams (best first), their running scores and its finished hypotheses."""

    beams: list[Sequence]
    scores: torch.Tensor  # running log-prob per live beam
    finished_scores: torch.Tensor  # one slot per beam of the group, _NEG when empty; sorted best first
    finished: list[tuple[Sequence, str] | None] = field(default_factory=list)  # the hypothesis and its reason
    heuristic_unsatisfied: bool = True
    done: bool = False
    step_note: dict[str, Any] = field(default_factory=dict)  # this step's candidates and fates (traced requests)

    @classmethod
    def start(cls, seq: Sequence, num_beams: int, device: torch.device) -> BeamGroup:
        """A group at its first token: one live beam (transformers' other initial beams score -1e9, so they never
        give a candidate while the vocabulary has more than `2 * num_beams` tokens)."""
        return cls([seq], torch.zeros(1, device=device), torch.full((num_beams,), _NEG, device=device),
                   [None] * num_beams)

    def hypotheses(self) -> list[tuple[float, Sequence, str]]:
        """The finished hypotheses as (score, sequence, finish reason), best first."""
        return [(score, hyp[0], hyp[1]) for hyp, score in zip(self.finished, self.finished_scores.tolist())
                if hyp is not None]


@dataclass
class BeamSearchState:
    """One request's search: its groups (one for plain beam search) and the rows of beams received so far."""

    groups: list[BeamGroup]
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # beam rows received, waiting for the others

    def collect(self, seqs: list[Sequence], rows: torch.Tensor) -> bool:
        """Keep this step's rows; whether every live beam of every group that is not done has one now. After a
        preemption the beams are recomputed and may finish their prefill in different steps: wait for all."""
        self.pending.update({id(s): rows[i] for i, s in enumerate(seqs)})
        return all(id(b) in self.pending for g in self.groups if not g.done for b in g.beams)

    def rows(self, group: BeamGroup) -> torch.Tensor:
        """The received rows of a group's beams, in beam order."""
        return torch.stack([self.pending[id(b)] for b in group.beams])


def by_request(seqs: list[Sequence]) -> list[list[int]]:
    """The positions of `seqs` grouped by request, in order of first appearance."""
    rows: dict[int, list[int]] = {}
    for i, seq in enumerate(seqs):
        rows.setdefault(id(seq.request), []).append(i)
    return list(rows.values())


def beam_step(ctx: StepContext, request: Request, group: BeamGroup, log_probs: torch.Tensor, rules: BeamRules,
              text: Callable[[int], str | None], note: dict[str, Any] | None = None) -> list[int]:
    """One transformers beam-search step of a group, on its beams' scores (`[len(group.beams), vocab]`, processed).

    New hypotheses become finished sequences, the chosen candidates become the group's next beams (the beams
    without one are freed). When the group is done its beams get no token: `group.done` is set and its live beams
    are left as they are (the caller finishes the request, or frees them). Returns the tokens the group chose for
    its next beams, in beam order, also when it is done (transformers' group beam search still counts a group's
    choice in the step that ends it). `note` adds facts to the step's trace entry (`beams`).
    """
    device = log_probs.device
    num_beams, vocab, lp = rules.num_beams, log_probs.shape[-1], rules.length_penalty
    eos = set(ctx.eos_token_ids) | set(request.params.stop_token_ids)
    generated = group.beams[0].num_generated  # all beams have the same length
    at_limit = generated + 1 >= request.params.max_tokens or len(group.beams[0].token_ids) + 1 >= ctx.max_model_len

    flat = (log_probs + group.scores[:, None]).reshape(-1)
    keep = min(max(2, 1 + len(eos)) * num_beams, flat.numel())
    top_scores, top_index = flat.topk(keep)
    beam_of, token_of = (top_index // vocab).tolist(), (top_index % vocab).tolist()
    ends = [t in eos for t in token_of]
    # the vectorized rules finish every candidate at the length limit; the scorer's only its EOS candidates
    hits = torch.tensor([e or (at_limit and not rules.scorer) for e in ends], device=device)
    sources = [(b, t, "stop" if e else "length") for b, t, e in zip(beam_of, token_of, ends)]

    # Finished hypotheses: among the top num_beams candidates, those that hit EOS (or the length limit).
    new_hypotheses: dict[int, int] = {}  # candidate -> slot
    all_done = all(h is not None for h in group.finished)
    if not ((all_done and rules.early_stopping is True) or not group.heuristic_unsatisfied):
        eligible = hits & (torch.arange(keep, device=device) < num_beams)
        new_hypotheses = _offer(ctx, group, top_scores / float(generated + 1) ** lp, eligible, sources)

    # Next beams: the best candidates that did not just finish.
    running = top_scores + hits.float() * _NEG
    chosen = running.topk(min(num_beams, keep)).indices.tolist()
    # A candidate a processor forbade (-inf, e.g. a grammar that allows fewer tokens than there are beams)
    # never becomes a beam; transformers would carry it along with a -inf score, which can never win.
    chosen = [c for c in chosen if running[c] != float("-inf")] or chosen[:1]
    group.scores = running[chosen]

    # Early-stopping heuristic (transformers' `_check_early_stop_heuristic`, or `BeamHypotheses.is_done` for the
    # scorer), at the new length.
    new_len = generated + 1
    best_len = request.params.max_tokens if rules.early_stopping == "never" and lp > 0.0 else new_len
    best_sum = float(top_scores[0]) if rules.scorer else float(group.scores[0])
    best_possible = best_sum / float(best_len) ** lp
    slots_done = all(h is not None for h in group.finished)
    worst = float(group.finished_scores.min()) if slots_done else None
    group.heuristic_unsatisfied = group.heuristic_unsatisfied and (worst is None or best_possible > worst)
    done = (not group.heuristic_unsatisfied or (slots_done and rules.early_stopping is True)
            or bool(hits.all()))
    if rules.scorer and at_limit:
        if not done:  # `finalize`: the running beams join the hypotheses of a group that is not done
            finals = running / float(new_len) ** lp
            eligible = torch.zeros(keep, dtype=torch.bool, device=device)
            eligible[chosen] = True
            new_hypotheses.update(_offer(ctx, group, finals, eligible, [(b, t, "length") for b, t, _ in sources]))
        done = True
    group.done = done
    if request.params.trace is not None:
        _note_step(ctx, group, rules, new_hypotheses, [] if done else chosen, beam_of, token_of, top_scores, text,
                   note)
    tokens = [token_of[c] for c in chosen]
    if not done:
        _advance(ctx, group, rules, [beam_of[c] for c in chosen], tokens, traced=request.params.trace is not None)
    return tokens


def _offer(ctx: StepContext, group: BeamGroup, finals: torch.Tensor, eligible: torch.Tensor,
           sources: list[tuple[int, int, str]]) -> dict[int, int]:
    """Merge the eligible candidates (final scores `finals`; parent beam, token and finish reason in `sources`)
    into the group's finished hypotheses, which keep the best `num_beams` as transformers' `BeamHypotheses` does.
    A candidate that gets a slot becomes a sequence of its own, forked before any beam gets this step's token; a
    displaced hypothesis is freed. Returns candidate -> slot for the new ones."""
    slots = len(group.finished)
    merged = torch.cat([group.finished_scores, torch.where(eligible, finals, finals + _NEG * 3)])
    best = merged.topk(slots).indices.tolist()
    finished: list[tuple[Sequence, str] | None] = []
    new: dict[int, int] = {}
    for j in best:
        if j < slots:
            finished.append(group.finished[j])
        elif bool(eligible[j - slots]):
            parent, token, reason = sources[j - slots]
            hypothesis = ctx.fork(group.beams[parent])
            ctx.append_token(hypothesis, token)
            ctx.finish(hypothesis, reason)
            new[j - slots] = len(finished)
            finished.append((hypothesis, reason))
        else:
            finished.append(None)
    kept = {id(h[0]) for h in finished if h is not None}
    for old in group.finished:
        if old is not None and id(old[0]) not in kept:
            ctx.free(old[0])  # displaced by a better one
    group.finished_scores = merged[best]
    group.finished = finished
    return new


def _note_step(ctx: StepContext, group: BeamGroup, rules: BeamRules, new_hypotheses: dict[int, int],
               chosen: list[int], beam_of: list[int], token_of: list[int], top_scores: torch.Tensor,
               text: Callable[[int], str | None], note: dict[str, Any] | None) -> None:
    """For the trace: every candidate of this step with its fate, the beams left without a continuation, and
    each new hypothesis' place (the new beams are noted in `_advance`, once they are sequences)."""
    scores = top_scores.tolist()
    kept = set(chosen)
    candidates = [{"parent": b, "token": t, "text": text(t), "score": round(v, 6),
                   "fate": "finished" if c in new_hypotheses else "kept" if c in kept else "dropped"}
                  for c, (b, t, v) in enumerate(zip(beam_of, token_of, scores))]
    step = {"candidates": candidates,
            "pruned": sorted(set(range(len(group.beams))) - {beam_of[c] for c in chosen}), **(note or {})}
    finals = group.finished_scores.tolist()
    for c, slot in new_hypotheses.items():
        hypothesis = group.finished[slot]
        assert hypothesis is not None
        ctx.note(hypothesis[0], chosen_by=rules.label, beams=step,
                 beam={"parent": beam_of[c], "index": None, "score": round(scores[c], 6),
                       "final_score": round(finals[slot], 6), **_group_fact(note)})
    group.step_note = step


def _group_fact(note: dict[str, Any] | None) -> dict[str, Any]:
    return {"group": note["group"]} if note is not None and "group" in note else {}


def _advance(ctx: StepContext, group: BeamGroup, rules: BeamRules, parents: list[int], tokens: list[int],
             traced: bool = False) -> None:
    """Turn chosen (parent beam, token) pairs into live sequences: reuse a parent once, fork it for more."""
    used: set[int] = set()
    children: list[Sequence] = []
    for parent in parents:
        seq = group.beams[parent]
        if parent in used:
            children.append(ctx.fork(seq))  # forks are taken before any token is appended to the parent
        else:
            used.add(parent)
            children.append(seq)
    for index, seq in enumerate(group.beams):
        if index not in used:
            ctx.free(seq)
    for seq, token in zip(children, tokens):
        ctx.append_token(seq, token)
    if traced:
        for index, (seq, parent, score) in enumerate(zip(children, parents, group.scores.tolist())):
            ctx.note(seq, chosen_by=rules.label, beams=group.step_note,
                     beam={"parent": parent, "index": index, "score": round(score, 6),
                           **_group_fact(group.step_note)})
    group.beams = children


def finish_with_hypotheses(ctx: StepContext, request: Request, groups: list[BeamGroup],
                           num_return_sequences: int) -> None:
    """Set the request's results: the best `num_return_sequences` hypotheses of all its groups, best first (as
    transformers' `BeamSearchScorer.finalize` ranks them across beam groups)."""
    ranked = sorted((h for g in groups for h in g.hypotheses()), key=lambda h: h[0], reverse=True)
    ctx.set_results(request, [StrategyResult(seq.generated_ids, reason, score, sequence=seq)
                              for score, seq, reason in ranked[:num_return_sequences]])


def check_beam_compatible(params: SamplingParams, stages: tuple[Stage, ...], name: str) -> None:
    """Refuse what a beam-based strategy cannot run: sampling warpers, `n`, stop strings, `ignore_eos` and named
    stopping criteria (it finishes its hypotheses itself). `name` is the strategy's, for the messages."""
    warpers = [s.processor.name for s in stages if s.processor.argmax_invariant]
    if warpers:
        raise ValueError(f"beam search is deterministic, so sampling warpers ({', '.join(warpers)}) cannot apply; "
                         "remove them (temperature, top_k, top_p, min_p, ...)")
    if params.n > 1:
        raise ValueError(f"use {name}.num_return_sequences instead of n")
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


_BEAMS = StashKey[BeamSearchState]()


class BeamSearchStrategy(Strategy):
    """Beam search with transformers' scoring, stopping and early-stopping rules.

    Example (recipe): `strategy: {beam_search: {num_beams: 4, length_penalty: 1.0, num_return_sequences: 2}}`
    """

    name = "beam_search"
    continues_prompt = False  # its outputs are whole beams scored together: no `echo` with them
    Params = BeamSearchParams
    handles_stopping = True
    scores = "logprobs"  # transformers' beam search processes log-probabilities
    tokenizer: Any = None

    def setup(self, info: Any) -> None:
        """Keep the tokenizer: a traced request's candidates are shown with their text."""
        self.tokenizer = info.tokenizer

    def check_compatible(self, options: BaseModel | None, params: SamplingParams, stages: tuple[Stage, ...]) -> None:
        assert isinstance(options, BeamSearchParams)
        check_beam_compatible(params, stages, self.name)

    def num_sequences(self, options: BaseModel | None, params: SamplingParams) -> int:
        assert isinstance(options, BeamSearchParams)
        return options.num_beams

    def token_distribution(self, options: BaseModel | None, params: SamplingParams) -> TokenDistribution:
        """The returned hypotheses are chosen without sampling."""
        return "deterministic"

    def select(self, ctx: StepContext, seqs: list[Sequence], log_probs: torch.Tensor) -> None:
        for rows in by_request(seqs):
            self._step(ctx, seqs[rows[0]].request, [seqs[i] for i in rows], log_probs[rows])

    def _step(self, ctx: StepContext, request: Request, seqs: list[Sequence], log_probs: torch.Tensor) -> None:
        options = request.plan.strategy_options
        assert isinstance(options, BeamSearchParams)
        state = request.stash.get(_BEAMS, None)
        if state is None:
            state = BeamSearchState([BeamGroup.start(seqs[0], options.num_beams, log_probs.device)])
            request.stash[_BEAMS] = state
        if not state.collect(seqs, log_probs):
            return
        group = state.groups[0]
        rows = state.rows(group)
        state.pending = {}
        rules = BeamRules(options.num_beams, options.length_penalty, options.early_stopping)
        beam_step(ctx, request, group, rows, rules, self.text)
        if group.done:
            finish_with_hypotheses(ctx, request, state.groups, options.num_return_sequences)

    def text(self, token: int) -> str | None:
        """A token's text for the trace (None when the tokenizer cannot decode it alone)."""
        try:
            return str(self.tokenizer.decode([token])) if self.tokenizer is not None else None
        except Exception:  # a tokenizer that cannot decode one id alone: the id still says which token
            return None
