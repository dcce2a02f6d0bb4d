"""Token bitmasks: the int32 masks constraint backends fill (bit `t % 32` of word `t // 32` allows token t), and
turning them into logits biases with tensor ops (one table lookup per byte; no loop over the vocabulary, nothing
compiled on first use)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def allocate_bitmask(rows: int, vocab_size: int, fill: torch.Tensor | None = None, pin: bool = False) -> torch.Tensor:
    """A `[rows, ceil(vocab_size / 32)]` int32 CPU bitmask: all blocked, or each row a copy of `fill`.

    `pin` (for a CUDA device): page-locked memory, so the copy to the device does not wait for the device to finish
    the forward pass (a copy from pageable memory synchronizes first); the mask fill then overlaps the forward.
    """
    bitmask = torch.empty(rows, (vocab_size + 31) // 32, dtype=torch.int32, pin_memory=pin)
    return bitmask.copy_(fill.expand_as(bitmask)) if fill is not None else bitmask.zero_()


def token_bitmask(token_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """A `[ceil(vocab_size / 32)]` int32 bitmask allowing exactly `token_ids`."""
    bits = torch.zeros((vocab_size + 31) // 32 * 32, dtype=torch.bool)
    bits[[t for t in token_ids if 0 <= t < vocab_size]] = True
    weights = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int64)
    return (bits.view(-1, 32).long() * weights).sum(-1).to(torch.int32)


_BYTE_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _byte_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # [256, 8]: the 8 bits of each byte value, as bool (allowed) or as an additive bias (0 / -inf).
    key = (device, dtype)
    table = _BYTE_TABLES.get(key)
    if table is None:
        codes = torch.arange(256, dtype=torch.int32)[:, None]
        bits = ((codes >> torch.arange(8, dtype=torch.int32)) & 1).bool()
        table = bits if dtype == torch.bool else torch.zeros(256, 8, dtype=dtype).masked_fill(~bits, -float("inf"))
        table = _BYTE_TABLES[key] = table.to(device)
    return table


def _unpack(bitmask: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    # One table lookup per byte of the mask (little-endian, as the backends write it): a gather and a reshape.
    as_bytes = bitmask.contiguous().view(torch.uint8).view(-1).int()
    table = _byte_table(bitmask.device, dtype)
    return table.index_select(0, as_bytes).view(bitmask.shape[0], -1)[:, :vocab_size]


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[rows, vocab_size]` bool (True: allowed) from an int32 bitmask, on the bitmask's device."""
    return _unpack(bitmask, vocab_size, torch.bool)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Logits with blocked tokens at -inf (a new tensor); ids beyond the bitmask's width are blocked.

    The bits are unpacked straight into an additive 0 / -inf bias: on CPU, `logits + bias` is several times
    faster than `masked_fill` with a bool mask. Plain tensor ops, so nothing is compiled on first use
    (llguidance's own helper is a `torch.compile` kernel, seconds on its first call).
    """
    vocab = logits.shape[-1]
    bias = _unpack(bitmask.to(logits.device, non_blocking=True), vocab, logits.dtype)
    if bias.shape[-1] < vocab:
        bias = torch.nn.functional.pad(bias, (0, vocab - bias.shape[-1]), value=-float("inf"))
    return logits + bias
