"""`ForwardItem`: one sequence's part of a packed forward, what the engine hands model execution."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ForwardItem:
    """One sequence's part of a forward: its new tokens after `context_len` cached ones, and logits wanted."""

    token_ids: list[int]
    context_len: int
    block_table: list[int]
    num_logits: int  # logits for the last `num_logits` of the new tokens (0 for a mid-prompt chunk)
    num_hidden: int = 0  # last hidden states for the last `num_hidden` of the new tokens (`Strategy.hidden_states`)
