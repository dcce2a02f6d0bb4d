"""A trained draft head (EAGLE-1 style): one Llama decoder layer that predicts the target's next last hidden state.

Input at position `i`: the target's last hidden state `f_i` (the final norm's output, which chose token `t_{i+1}`)
and the embedding of `t_{i+1}`; output: a prediction of `f_{i+1}`, which the target's own LM head turns into the
draft's next token. The head reuses the target's frozen embedding and LM head, so the file holds only its fc and
decoder layer (a few MB), plus the draft vocabulary: the target ids the head may propose, ranked by frequency in
the training data (FR-Spec), so that each draft token reads a fraction of the LM head.

Drafting a second token feeds the head its own predicted state; the training script
(`tools/train_draft_head.py`) trains for both steps (`forward_second`), as at inference.

The same module serves training (whole sequences, `forward`) and the `eagle` proposer (a small dense KV cache per
sequence, `step`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

HEAD_FORMAT = "decodekit-draft-head/1"


@dataclass(frozen=True)
class DraftHeadConfig:
    """The head's shapes (those of the target's decoder layers) and what it was trained for."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's vocabulary size
    draft_vocab_size: int  # how many target ids the head may propose
    target: str = ""  # the target the head was trained on (a note for people; the shapes are what is checked)

    @classmethod
    def for_target(cls, config: Any, draft_vocab_size: int, target: str = "") -> DraftHeadConfig:
        """The head shaped like one of `config`'s (a transformers Llama-style config) decoder layers."""
        rope = getattr(config, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                   num_kv_heads=config.num_key_value_heads, head_dim=head_dim,
                   intermediate_size=config.intermediate_size, rms_norm_eps=float(config.rms_norm_eps),
                   rope_theta=theta, vocab_size=config.vocab_size,
                   draft_vocab_size=min(draft_vocab_size, config.vocab_size), target=target)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding (rotate-half convention) on `[..., L, head_dim]` with `cos`/`sin` `[L, head_dim]`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DraftHead(nn.Module):
    """fc over [embedding; hidden state] -> one pre-norm Llama decoder layer -> the predicted next hidden state."""

    draft_vocab: torch.Tensor
    inv_freq: torch.Tensor

    def __init__(self, config: DraftHeadConfig) -> None:
        super().__init__()
        self.config = config
        h, heads, kv, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.input_norm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(h, heads * d, bias=False)
        self.k_proj = nn.Linear(h, kv * d, bias=False)
        self.v_proj = nn.Linear(h, kv * d, bias=False)
        self.o_proj = nn.Linear(heads * d, h, bias=False)
        self.post_norm = nn.Parameter(torch.ones(h))
        self.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)
        # the target ids the head may propose, most frequent first (a buffer: saved with the weights)
        self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size, dtype=torch.int64))
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        for linear in (self.fc, self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj, self.up_proj,
                       self.down_proj):
            nn.init.normal_(linear.weight, std=0.02)
        nn.init.zeros_(self.fc.bias)

    # --- pieces shared by training and drafting -------------------------------------------------------------------
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[L, head_dim]` at integer `positions` `[L]`."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos(), angles.sin()

    def mix(self, embeds: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """The layer's input: fc over the next token's embedding and the current hidden state."""
        return self.fc(torch.cat((embeds, states), dim=-1))

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries `[..., heads, L, d]` and keys/values `[..., kv_heads, L, d]` of the layer input `x` `[..., L, h]`."""
        c = self.config
        normed = _rms_norm(x, self.input_norm, c.rms_norm_eps)
        lead = x.shape[:-2]
        length = x.shape[-2]
        q = self.q_proj(normed).view(*lead, length, c.num_heads, c.head_dim).transpose(-2, -3)
        k = self.k_proj(normed).view(*lead, length, c.num_kv_heads, c.head_dim).transpose(-2, -3)
        v = self.v_proj(normed).view(*lead, length, c.num_kv_heads, c.head_dim).transpose(-2, -3)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Residual, MLP and residual after attention (`attended` `[..., heads, L, d]`): the predicted state."""
        lead = attended.shape[:-3]
        length = attended.shape[-2]
        x = x + self.o_proj(attended.transpose(-2, -3).reshape(*lead, length, -1))
        normed = _rms_norm(x, self.post_norm, self.config.rms_norm_eps)
        return x + self.down_proj(F.silu(self.gate_proj(normed)) * self.up_proj(normed))

    def _expand(self, kv: torch.Tensor) -> torch.Tensor:
        groups = self.config.num_heads // self.config.num_kv_heads
        return kv.repeat_interleave(groups, dim=-3) if groups > 1 else kv

    # --- training: whole sequences --------------------------------------------------------------------------------
    def forward(self, embeds: torch.Tensor, states: torch.Tensor
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """First draft step at every position of `[B, L, h]` inputs (causal): predicted states and the keys/values
        (for `forward_second`)."""
        length = embeds.shape[-2]
        cos, sin = self.rope(torch.arange(length, device=embeds.device))
        x = self.mix(embeds, states)
        q, k, v = self.qkv(x, cos, sin)
        attended = F.scaled_dot_product_attention(q, self._expand(k), self._expand(v), is_causal=True)
        return self.finish(x, attended), (k, v)

    def forward_second(self, embeds: torch.Tensor, states: torch.Tensor, predicted: torch.Tensor,
                       first_kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Second draft step at every position, as at inference: position `i` takes the head's own prediction of
        `f_i` (from the first step at `i - 1`) and attends to the first step's keys of the positions before it
        (made from the target's true `states`) and to its own key; position 0, which has no prediction, takes
        the true state."""
        length = embeds.shape[-2]
        cos, sin = self.rope(torch.arange(length, device=embeds.device))
        shifted = torch.cat((states[..., :1, :], predicted[..., :-1, :]), dim=-2)
        x = self.mix(embeds, shifted)
        q, k_self, v_self = self.qkv(x, cos, sin)
        k_ctx, v_ctx = self._expand(first_kv[0]), self._expand(first_kv[1])
        k_self, v_self = self._expand(k_self), self._expand(v_self)
        scale = 1.0 / math.sqrt(self.config.head_dim)
        scores = (q @ k_ctx.transpose(-1, -2)) * scale
        before = torch.ones(length, length, dtype=torch.bool, device=q.device).tril(-1)
        scores = scores.masked_fill(~before, float("-inf"))
        own = (q * k_self).sum(-1, keepdim=True) * scale
        weights = torch.softmax(torch.cat((scores, own), dim=-1), dim=-1)
        attended = weights[..., :length] @ v_ctx + weights[..., length:] * v_self
        return self.finish(x, attended)

    # --- drafting: one sequence with a dense cache ---------------------------------------------------------------
    def fuse(self) -> None:
        """Concatenate the q/k/v and gate/up weights for `step` (three products fewer per draft token; a drafting
        head is never trained again)."""
        self._qkv_weight = torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)).detach()
        self._gate_up_weight = torch.cat((self.gate_proj.weight, self.up_proj.weight)).detach()

    def _step_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        fused = getattr(self, "_qkv_weight", None)
        if fused is None:
            return self.qkv(x, cos, sin)
        normed = _rms_norm(x, self.input_norm, c.rms_norm_eps)
        q, k, v = F.linear(normed, fused).split((c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                                                 c.num_kv_heads * c.head_dim), dim=-1)
        length = x.shape[-2]
        q = q.reshape(length, c.num_heads, c.head_dim).transpose(0, 1)
        k = k.reshape(length, c.num_kv_heads, c.head_dim).transpose(0, 1)
        v = v.reshape(length, c.num_kv_heads, c.head_dim).transpose(0, 1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def _step_finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        fused = getattr(self, "_gate_up_weight", None)
        if fused is None:
            return self.finish(x, attended)
        x = x + self.o_proj(attended.transpose(0, 1).reshape(x.shape[0], -1))
        normed = _rms_norm(x, self.post_norm, self.config.rms_norm_eps)
        gate, up = F.linear(normed, fused).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)

    def step(self, embeds: torch.Tensor, states: torch.Tensor, positions: torch.Tensor,
             cache: HeadCache) -> torch.Tensor:
        """Run `[L, h]` inputs at `positions` (consecutive, starting at `cache.length`) and append their keys and
        values to `cache`: the predicted states `[L, h]`."""
        return self.step_many(embeds, states, [(cache, positions)])

    def step_many(self, embeds: torch.Tensor, states: torch.Tensor,
                  segments: list[tuple[HeadCache, torch.Tensor]]) -> torch.Tensor:
        """`step` for several sequences at once: rows `[N, h]` are the sequences' new rows one after another,
        `segments[i]` the `i`-th sequence's cache and positions (consecutive, from its `cache.length`). The products
        run once over all rows; attention per sequence, over its own cache."""
        positions = segments[0][1] if len(segments) == 1 else torch.cat([p for _, p in segments])
        cos, sin = self.rope(positions)
        x = self.mix(embeds, states)
        q, k, v = self._step_qkv(x, cos, sin)
        parts = []
        offset = 0
        for cache, seg_positions in segments:
            length = seg_positions.shape[0]
            rows = slice(offset, offset + length)
            keys, values = cache.append(k[:, rows], v[:, rows])
            mask = None
            if length > 1:  # causal among the new rows; every cached row is visible
                start = cache.length - length
                mask = torch.ones(length, keys.shape[-2], dtype=torch.bool, device=q.device).tril(start)
            parts.append(F.scaled_dot_product_attention(q[:, rows], self._expand(keys), self._expand(values),
                                                        attn_mask=mask))
            offset += length
        attended = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)
        return self._step_finish(x, attended)


class HeadCache:
    """One sequence's keys and values in the head's single layer: dense, grown by doubling, truncated on rollback."""

    def __init__(self, config: DraftHeadConfig, dtype: torch.dtype, device: torch.device, capacity: int = 256) -> None:
        shape = (config.num_kv_heads, capacity, config.head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `[kv_heads, L, d]` keys and values after the cached ones; the whole cache as views."""
        new = k.shape[-2]
        if self.length + new > self.keys.shape[-2]:
            capacity = max(2 * self.keys.shape[-2], self.length + new)
            for name in ("keys", "values"):
                old = getattr(self, name)
                grown = old.new_empty((old.shape[0], capacity, old.shape[2]))
                grown[:, : self.length] = old[:, : self.length]
                setattr(self, name, grown)
        self.keys[:, self.length : self.length + new] = k
        self.values[:, self.length : self.length + new] = v
        self.length += new
        return self.keys[:, : self.length], self.values[:, : self.length]

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions."""
        self.length = min(self.length, length)


def save_head(head: DraftHead, path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write the head as safetensors (weights in float16, the draft vocabulary as int64) with its config."""
    from safetensors.torch import save_file

    tensors = {name: value.detach().to(torch.float16).contiguous() if value.is_floating_point() else value.contiguous()
               for name, value in head.state_dict().items()}
    meta = {"format": HEAD_FORMAT, "config": json.dumps(asdict(head.config)), **(metadata or {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)


def load_head(path: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
              ) -> tuple[DraftHead, dict[str, str]]:
    """Read a head `save_head` wrote; returns it (eval mode, `dtype`) and the file's metadata.

    Raises:
        ValueError: the file is not a decodekit draft head.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata() or {}
    if meta.get("format") != HEAD_FORMAT:
        raise ValueError(f"{path} is not a decodekit draft head (format {meta.get('format')!r}, "
                         f"expected {HEAD_FORMAT!r})")
    config = DraftHeadConfig(**json.loads(meta["config"]))
    head = DraftHead(config)
    tensors = load_file(str(path))
    head.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()})
    return head.to(device=device).eval(), meta
