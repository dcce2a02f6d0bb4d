"""Diverse (group) beam search (Vijayakumar et al. 2016, "Diverse Beam Search"), as transformers implemented it
before it moved out of its core (`generate(num_beams=..., num_beam_groups=..., diversity_penalty=...)`).

The `num_beams` beams of a request are split into `num_beam_groups` groups of `num_beams // num_beam_groups`.
Each step the groups take their turn in order. Group `g` starts from its beams' processed log-probabilities (the
request's processors applied to log-softmax scores, as for beam search) and subtracts `diversity_penalty` times
the number of times each token was chosen at this step by the new beams of groups before it (Hamming diversity,
transformers' `HammingDiversityLogitsProcessor`); then it takes an ordinary beam-search step on its own: the top
`2 * group_size` candidates, EOS candidates among the top `group_size` become finished hypotheses scored
`score / generated_len ** length_penalty`, and transformers' early-stopping rules decide when the group is done.
The scores carry the penalties (transformers' `sequences_scores` do too). The request finishes when every group
is done (or at the length limit); its outputs are the `num_return_sequences` best hypotheses of all groups.

Each group steps with the machinery of `beam_search` (`BeamGroup`, `beam_step`) under the rules of the
`BeamSearchScorer` that transformers' group beam search used (`BeamRules.scorer`), which differ from plain beam
search's vectorized rules in two corners (see `BeamRules`).

Differences from transformers, on purpose:

- the penalty is subtracted after the request's processors (transformers put `HammingDiversityLogitsProcessor`
  first in its list); the two agree for every processor that adds to or masks scores, and differ only for one
  that scales them (`repetition_penalty`);
- a group's choice at the step that ends it still counts against the groups after it (as in transformers), but
  from then on it chooses nothing and penalizes nothing (transformers kept padding a done group with
  `pad_token_id` "beams", which the groups after it were then penalized for).

Per-token `processed` logprobs are the processors' log-probabilities without the diversity penalty: they add up
to a hypothesis' score times `generated_len ** length_penalty` plus the penalties its tokens paid. A traced
request's events are beam search's (`chosen_by: "diverse beam search"`), with the group in `beam.group` and
`beams.group`, and the tokens the group was penalized for (and by how much) in `beams.diversity`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from pydantic import Field, model_validator

from decodekit import hookimpl
from decodekit.api.sequence import Request, Sequence
from decodekit.api.stash import StashKey
from decodekit.api.strategy import StepContext
from decodekit_plugins.beam_search import (
    BeamGroup,
    BeamRules,
    BeamSearchParams,
    BeamSearchState,
    BeamSearchStrategy,
    beam_step,
    finish_with_hypotheses,
)


class DiverseBeamSearchParams(BeamSearchParams):
    """Parameters of the `diverse_beam_search` strategy (transformers' names and semantics)."""

    num_beams: int = Field(4, ge=2, le=64, description="Beams kept per request, over all groups.")
    num_beam_groups: int = Field(2, gt=1, le=64, description="Groups the beams are split into (divides num_beams).")
    diversity_penalty: float = Field(
        0.5, ge=0.0, description="Subtracted from a token's score per beam of an earlier group that chose it this step."
    )

    @model_validator(mode="after")
    def _check_groups(self) -> DiverseBeamSearchParams:
        if self.num_beams % self.num_beam_groups:
            raise ValueError(f"num_beams ({self.num_beams}) must be divisible by num_beam_groups "
                             f"({self.num_beam_groups})")
        return self

    @property
    def group_size(self) -> int:
        """Beams per group."""
        return self.num_beams // self.num_beam_groups


_GROUPS = StashKey[BeamSearchState]()


class DiverseBeamSearchStrategy(BeamSearchStrategy):
    """Diverse beam search: beam search in groups that are penalized for choosing what earlier groups chose.

    It shares beam search's checks (no sampling warpers, `n`, stop strings, `ignore_eos` or named stopping
    criteria), admission (`num_beams` sequences) and trace texts; only the step differs.

    Example (recipe):
    `strategy: {diverse_beam_search: {num_beams: 4, num_beam_groups: 2, diversity_penalty: 0.5,
    num_return_sequences: 2}}`
    """

    name = "diverse_beam_search"
    Params = DiverseBeamSearchParams

    def _step(self, ctx: StepContext, request: Request, seqs: list[Sequence], log_probs: torch.Tensor) -> None:
        options = request.plan.strategy_options
        assert isinstance(options, DiverseBeamSearchParams)
        state = request.stash.get(_GROUPS, None)
        if state is None:
            # First token: every group starts from the prompt. Each gets a sequence of its own (a fork sharing the
            # prompt's blocks, taken before any group appends a token), scored by the prompt's row.
            root = seqs[0]
            starts = [root, *(ctx.fork(root) for _ in range(options.num_beam_groups - 1))]
            state = BeamSearchState([BeamGroup.start(s, options.group_size, log_probs.device) for s in starts])
            state.pending = {id(s): log_probs[0] for s in starts}
            request.stash[_GROUPS] = state
        elif not state.collect(seqs, log_probs):
            return
        rules = BeamRules(options.group_size, options.length_penalty, options.early_stopping, scorer=True,
                          label="diverse beam search")
        traced = request.params.trace is not None
        chosen: list[int] = []  # the tokens of this step's new beams, in the groups before this one
        for index, group in enumerate(state.groups):
            if group.done:
                continue
            rows = state.rows(group)
            if chosen and options.diversity_penalty > 0.0:
                counts = torch.bincount(torch.tensor(chosen, device=rows.device), minlength=rows.shape[-1])
                rows = rows - options.diversity_penalty * counts.to(rows.dtype)
            note = None
            if traced:
                note = {"group": index, "diversity": [
                    {"token": t, "text": self.text(t), "penalty": round(options.diversity_penalty * n, 6)}
                    for t, n in sorted(Counter(chosen).items())] if options.diversity_penalty > 0.0 else []}
            chosen += beam_step(ctx, request, group, rows, rules, self.text, note)
            if group.done:  # the request goes on without its beams (or finishes below)
                for beam in group.beams:
                    ctx.free(beam)
                group.beams = []
        state.pending = {}
        if all(g.done for g in state.groups):
            finish_with_hypotheses(ctx, request, state.groups, options.num_return_sequences)


@hookimpl
def decodekit_register_strategies(register: Callable[..., None]) -> None:
    """Register the `diverse_beam_search` strategy."""
    register(DiverseBeamSearchStrategy.name, DiverseBeamSearchStrategy)
