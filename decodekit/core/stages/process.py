"""The process stage: each request's logits processors, in its own order, over the rows of its scored positions.

A sequence scores `1 + len(draft)` positions (speculative verification); row j sees the sequence's history after
its first j draft tokens. Strategies get processed scores from the select stage (or call `ctx.process` on scores
of their own, as beam search does on log-probabilities); proposers use `process_after` for the positions they draft.
"""

from __future__ import annotations

import torch

from decodekit.api.processors import BatchView, apply_processors
from decodekit.api.sequence import Sequence
from decodekit.core import drafts


class Processing:
    """Builds processors' batch views and applies each request's pipeline.

    Args:
        eos_token_ids: the model's end-of-sequence ids (processors read them from the view).
        device: where logits live.
    """

    def __init__(self, eos_token_ids: tuple[int, ...], device: torch.device | str) -> None:
        self.eos_token_ids = eos_token_ids
        self.device = device

    def batch_view(self, seqs: list[Sequence]) -> BatchView:
        """The processors' view of these sequences: one row per scored position (drafts expand a sequence)."""
        params, histories, prompt_lens, offsets, generators = [], [], [], [], []
        for seq in seqs:
            for j, history in enumerate(drafts.row_histories(seq)):
                params.append(seq.request.params)
                histories.append(history)
                prompt_lens.append(seq.num_prompt_tokens)
                offsets.append(j)
                generators.append(seq.generator)
        return BatchView(params, histories, prompt_lens, self.eos_token_ids, self.device,
                         draft_offsets=offsets, generators=generators)

    def process(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Apply each request's processors, in order, to the rows of these sequences' scored positions."""
        view = self.batch_view(seqs)
        positions = [seq for seq in seqs for _ in range(seq.num_scored_positions)]
        return apply_processors(logits, view, [seq.request.plan.stages for seq in positions],
                                [seq.greedy for seq in positions], [seq.processor_states for seq in positions])

    def process_after(self, logits: torch.Tensor, seqs: list[Sequence], extra: list[list[int]]) -> torch.Tensor:
        """Apply each request's processors to one row per sequence: the position after `seq.token_ids + extra[i]`
        (a proposer scoring its own draft: row i has `len(extra[i])` unverified tokens at the end)."""
        view = BatchView([s.request.params for s in seqs], [s.token_ids + e for s, e in zip(seqs, extra)],
                         [s.num_prompt_tokens for s in seqs], self.eos_token_ids, logits.device,
                         draft_offsets=[len(e) for e in extra], generators=[s.generator for s in seqs])
        return apply_processors(logits, view, [s.request.plan.stages for s in seqs], [s.greedy for s in seqs],
                                [s.processor_states for s in seqs])
