"""The logits-processor contract: what a processor plugin implements, and the batch view it is given.

A processor transforms a `[rows, vocab]` float32 logits tensor for the rows whose requests use it. It is built
once per engine (not per token) and called directly in the hot loop, never through a hook.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from decodekit.params import SamplingParams


@dataclass
class BatchView:
    """The rows a processor sees: each row's parameters and token history.

    Row `i` scores the position after `token_ids(i)`; for speculative verification one sequence can appear in
    several rows, each with the history up to its own position.
    """

    params: list[SamplingParams]
    histories: list[list[int]]
    prompt_lens: list[int]
    eos_token_ids: tuple[int, ...] = ()
    device: torch.device | str = "cpu"

    def __len__(self) -> int:
        return len(self.params)

    def token_ids(self, row: int) -> list[int]:
        """Prompt plus generated ids of a row, up to the position being scored."""
        return self.histories[row]

    def generated_ids(self, row: int) -> list[int]:
        """Generated ids of a row, up to the position being scored."""
        return self.histories[row][self.prompt_lens[row] :]

    @cached_property
    def num_generated(self) -> torch.Tensor:
        """`[rows]` long: tokens generated so far per row."""
        return torch.tensor([len(h) - p for h, p in zip(self.histories, self.prompt_lens)], device=self.device)

    def param_tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`[rows]` tensor of one SamplingParams field across the rows."""
        return torch.tensor([getattr(p, name) for p in self.params], dtype=dtype, device=self.device)

    def select(self, rows: list[int]) -> BatchView:
        """The view restricted to some rows."""
        return BatchView([self.params[r] for r in rows], [self.histories[r] for r in rows],
                         [self.prompt_lens[r] for r in rows], self.eos_token_ids, self.device)


class LogitsProcessor:
    """Base class of logits processors.

    Subclasses set `name`, override `is_active` (which requests use it) and `__call__`.

    Attributes:
        argmax_invariant: the processor never changes which token has the highest logit (so greedy rows skip it).
        needs_history: the processor reads token histories (so verification must give per-position histories).
    """

    name: str = "processor"
    argmax_invariant: bool = False
    needs_history: bool = False

    def is_active(self, params: SamplingParams) -> bool:
        """Whether a request with these parameters uses this processor."""
        return True

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        """Return processed logits `[rows, vocab]`; must not modify `logits` in place."""
        raise NotImplementedError


def apply_processors(
    processors: list[LogitsProcessor], logits: torch.Tensor, batch: BatchView, greedy: list[bool] | None = None
) -> torch.Tensor:
    """Run processors in order, each only on the rows whose request uses it (greedy rows skip argmax-invariant ones)."""
    for proc in processors:
        rows = [
            i for i, p in enumerate(batch.params)
            if proc.is_active(p) and not (proc.argmax_invariant and greedy is not None and greedy[i])
        ]
        if not rows:
            continue
        if len(rows) == len(batch):
            logits = proc(logits, batch)
        else:
            index = torch.tensor(rows, device=logits.device)
            logits = logits.index_copy(0, index, proc(logits.index_select(0, index), batch.select(rows)))
    return logits

