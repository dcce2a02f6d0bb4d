"""Speculative decoding as a strategy: a proposer drafts k tokens, the target scores k+1 positions in one forward.

Acceptance is the standard lossless rule. Greedy rows accept draft tokens while they equal the target's
processed argmax, then append the target's own token. Sampled rows accept draft token `d` with probability
`min(1, p(d) / q(d))` (p: the target's processed distribution, q: the proposer's), and on rejection sample from the
normalized residual `max(0, p - q)`; when every draft token is accepted a bonus token is sampled from the last
position. Rejected positions are rolled back: the target's KV slots by `accept_draft`, the draft model's by
truncating its own block table; processors only ever advance on accepted tokens, so they need no rollback.

Proposers:
- `ngram` (prompt lookup): the tokens that followed the latest earlier occurrence of the sequence's last n tokens
  (n from `prompt_lookup_max` down to `prompt_lookup_min`), no model;
- `draft`: a smaller causal LM with the target's tokenizer (the engine's `draft` model), with its own paged KV
  cache; it sees the request's processors too, so a draft equal to the target is accepted 100%.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from decodekit import select_tokens
from decodekit.core.blocks import BlockAllocator
from decodekit.core.kv_cache import PagedKVCache
from decodekit.core.runner import ForwardItem, build_runner, model_geometry
from decodekit.core.sequence import Request, Sequence
from decodekit.params import SamplingParams
from decodekit.processors import BatchView, Stage, apply_processors
from decodekit.strategy import Proposer, StepContext, Strategy


class SpeculativeParams(BaseModel):
    """Parameters of the `speculative` strategy."""

    model_config = ConfigDict(extra="forbid")

    proposer: str = Field("ngram", description="A registered proposer: 'ngram' (prompt lookup), 'draft' (a model).")
    proposer_options: dict[str, Any] = Field(default_factory=dict, description="The proposer's own parameters.")
    num_speculative_tokens: int = Field(4, ge=1, le=32, description="Draft tokens per step (k), or the start of k.")
    adaptive: bool = Field(False, description="Adapt k per sequence: +2 when all are accepted, -1 otherwise.")
    max_speculative_tokens: int = Field(10, ge=1, le=32, description="Upper bound for adaptive k.")


class NgramParams(BaseModel):
    """Parameters of the `ngram` proposer (vLLM's names)."""

    model_config = ConfigDict(extra="forbid")

    prompt_lookup_min: int = Field(1, ge=1, description="Shortest suffix to look up.")
    prompt_lookup_max: int = Field(3, ge=1, description="Longest suffix to look up.")

    @model_validator(mode="after")
    def _check(self) -> NgramParams:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        return self


def ngram_proposal(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest matching suffix of `tokens`."""
    length = len(tokens)
    if length < 2 or k <= 0:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)  # starts 0 .. length-1-n
        hits = np.flatnonzero((windows == arr[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n tokens.

    Example (recipe): `strategy: {speculative: {proposer: ngram, proposer_options: {prompt_lookup_max: 4}}}`
    """

    name = "ngram"
    Params = NgramParams

    def propose(self, ctx: StepContext, seqs: list[Sequence], ks: list[int],
                options: list[Any]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        drafts = [ngram_proposal(seq.token_ids, k, o.prompt_lookup_min, o.prompt_lookup_max)
                  for seq, k, o in zip(seqs, ks, options)]
        return drafts, [None] * len(seqs)


@dataclass
class _DraftState:
    computed: int = 0  # tokens of seq.token_ids whose keys/values are in the draft's cache
    fed: list[int] = field(default_factory=list)  # draft tokens fed to the draft model this step


class DraftModelProposer(Proposer):
    """The engine's draft model (`LLM(draft=...)`, recipe `draft:`), with its own paged KV cache (as many blocks
    as the target's), proposing for a batch of sequences with k batched forwards. It applies each request's
    processors to its own logits, so its proposals follow the same constraints as the target.

    Example (recipe): `draft: {model: <smaller model, same tokenizer>}` and
    `strategy: {speculative: {proposer: draft}}`
    """

    name = "draft"

    def __init__(self) -> None:
        self.info: Any = None
        self.allocator: BlockAllocator | None = None
        self.states: dict[int, _DraftState] = {}

    def setup(self, info: Any) -> None:
        self.info = info

    def check(self, options: BaseModel | None) -> None:
        if self.info is not None and self.info.draft is None:
            raise ValueError("proposer 'draft' needs a draft model: set `draft:` in the recipe or LLM(draft=...)")

    def _build(self) -> BlockAllocator:
        if self.allocator is None:
            loaded, engine = self.info.draft, self.info.engine
            num_blocks, block_size = engine.allocator.num_blocks, engine.config.block_size
            geometry = model_geometry(loaded.model)
            self.allocator = BlockAllocator(num_blocks, block_size)
            self.cache = PagedKVCache(geometry.num_layers, num_blocks, block_size, geometry.num_kv_heads,
                                      geometry.head_dim, loaded.dtype, loaded.device)
            self.runner = build_runner(loaded, self.cache, engine.config)
        return self.allocator

    def propose(self, ctx: StepContext, seqs: list[Sequence], ks: list[int],
                options: list[Any]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Draft `ks[i]` tokens for `seqs[i]`; returns the drafts and, for sampled rows, their q rows `[k, vocab]`."""
        self._build()
        assert self.allocator is not None
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = []
        for i, seq in enumerate(seqs):
            state = self.states.setdefault(seq.seq_id, _DraftState())
            if not self.allocator.has(seq.seq_id):
                self.allocator.allocate(seq.seq_id, [])
            need = self.allocator.blocks_to_write(seq.seq_id, state.computed, len(seq.token_ids) + ks[i] - 1)
            if ks[i] > 0 and need <= self.allocator.num_free_blocks:
                active.append(i)
        for step in range(max((ks[i] for i in active), default=0)):
            rows = [i for i in active if len(drafts[i]) < ks[i] and step == len(drafts[i])]
            if not rows:
                break
            items = []
            for i in rows:
                seq, state = seqs[i], self.states[seqs[i].seq_id]
                tokens = (seq.token_ids + drafts[i])[state.computed :]
                start = state.computed
                self.allocator.ensure_slots(seq.seq_id, start, start + len(tokens))
                items.append(ForwardItem(tokens, start, self.allocator.block_table(seq.seq_id), 1))
                state.computed += len(tokens)
            logits = self.runner.forward(items, self.allocator.take_pending_copies())
            row_seqs = [seqs[i] for i in rows]
            view = BatchView([s.request.params for s in row_seqs],
                             [s.token_ids + drafts[i] for s, i in zip(row_seqs, rows)],
                             [s.num_prompt_tokens for s in row_seqs], ctx.eos_token_ids, logits.device,
                             draft_offsets=[len(drafts[i]) for i in rows],
                             generators=[s.generator for s in row_seqs])
            greedy = [s.request.params.greedy for s in row_seqs]
            logits = apply_processors(logits, view, [s.request.plan.stages for s in row_seqs], greedy,
                                      [s.processor_states for s in row_seqs])
            tokens = select_tokens(logits, greedy, [s.generator for s in row_seqs]).tolist()
            probs = None if all(greedy) else torch.softmax(logits, dim=-1)
            for r, (i, token) in enumerate(zip(rows, tokens)):
                drafts[i].append(token)
                if probs is not None and not greedy[r]:
                    qs[i].append(probs[r])
        return drafts, [torch.stack(q) if q else None for q in qs]

    def rollback(self, seq: Sequence, num_valid: int) -> None:
        """Keep only the first `num_valid` tokens of `seq` in the draft's cache."""
        state = self.states.get(seq.seq_id)
        if state is not None and state.computed > num_valid and self.allocator is not None:
            state.computed = num_valid
            self.allocator.truncate(seq.seq_id, num_valid)

    def release(self, seq: Sequence) -> None:
        """Free a finished sequence's draft blocks."""
        self.states.pop(seq.seq_id, None)
        if self.allocator is not None and self.allocator.has(seq.seq_id):
            self.allocator.free(seq.seq_id)


class SpeculativeStrategy(Strategy):
    """Speculative decoding (lossless) with an n-gram or draft-model proposer, under continuous batching.

    Example (recipe): `strategy: {speculative: {proposer: ngram, num_speculative_tokens: 4, adaptive: true}}`
    """

    name = "speculative"
    Params = SpeculativeParams

    def __init__(self) -> None:
        self.components: Any = None
        self.proposers: dict[str, Proposer] = {}  # the ones this strategy has used (for rollback and release)

    def bind(self, components: Any) -> None:
        self.components = components

    def _proposer(self, name: str) -> Proposer:
        proposer: Proposer = self.components.get("proposers", name, "strategy.speculative.proposer")
        self.proposers[name] = proposer
        return proposer

    def check_compatible(self, options: BaseModel | None, params: SamplingParams, stages: tuple[Stage, ...]) -> None:
        assert isinstance(options, SpeculativeParams)
        if params.n > 1:
            raise ValueError("parallel sampling (n > 1) cannot be combined with speculative decoding")
        proposer = self._proposer(options.proposer)
        proposer.check(self._proposer_options(proposer, options))

    @staticmethod
    def _proposer_options(proposer: Proposer, options: SpeculativeParams) -> Any:
        from decodekit.plan import validate_options

        return validate_options(proposer, options.proposer_options, f"proposer_options ({proposer.name})")

    def propose(self, ctx: StepContext, seqs: list[Sequence]) -> None:
        groups: dict[str, list[tuple[Sequence, int, Any]]] = {}
        for seq in seqs:
            options = seq.request.plan.strategy_options
            assert isinstance(options, SpeculativeParams)
            k = seq.state.setdefault("spec_k", options.num_speculative_tokens)
            # never draft past max_tokens or the context (the last position is the target's own token)
            k = min(k, seq.request.params.max_tokens - seq.num_generated - 1,
                    ctx.max_model_len - len(seq.token_ids) - 1)
            if k > 0:
                if "spec_proposer_options" not in seq.request.state:
                    seq.request.state["spec_proposer_options"] = self._proposer_options(
                        self._proposer(options.proposer), options)
                groups.setdefault(options.proposer, []).append((seq, k, seq.request.state["spec_proposer_options"]))
        for name, items in groups.items():
            drafts, qs = self._proposer(name).propose(ctx, [s for s, _, _ in items], [k for _, k, _ in items],
                                                     [o for _, _, o in items])
            for (seq, k, _), draft, q in zip(items, drafts, qs):
                seq.draft_token_ids = list(draft[:k])
                seq.state["spec_q"] = q

    def select(self, ctx: StepContext, seqs: list[Sequence], logits: torch.Tensor) -> None:
        processed = ctx.process(logits, seqs)
        argmax = processed.argmax(dim=-1).tolist()
        offset = 0
        for seq in seqs:
            draft = list(seq.draft_token_ids)
            rows = processed[offset : offset + len(draft) + 1]
            if seq.request.params.greedy:
                best = argmax[offset : offset + len(draft) + 1]
                accepted = 0
                while accepted < len(draft) and draft[accepted] == best[accepted]:
                    accepted += 1
                token = best[accepted]
            else:
                accepted, token = self._accept_sampled(seq, draft, rows)
            offset += len(draft) + 1
            self._account(seq, len(draft), accepted)
            valid = len(seq.token_ids) + accepted
            ctx.accept_draft(seq, accepted, token)
            for proposer in self.proposers.values():
                proposer.rollback(seq, valid)

    @staticmethod
    def _accept_sampled(seq: Sequence, draft: list[int], rows: torch.Tensor) -> tuple[int, int]:
        probs = torch.softmax(rows, dim=-1)
        q = seq.state.get("spec_q")
        gen = seq.generator
        for j, d in enumerate(draft):
            q_d = 1.0 if q is None else float(q[j, d])
            p_d = float(probs[j, d])
            u = float(torch.rand((), generator=gen, device=rows.device)) if gen is not None else float(torch.rand(()))
            if q_d > 0 and u < min(1.0, p_d / q_d):
                continue
            residual = probs[j].clone()
            if q is None:
                residual[d] = 0.0
            else:
                residual = (residual - q[j]).clamp_min(0.0)
            if float(residual.sum()) <= 0.0:
                # p <= q everywhere means p == q up to rounding: rejection had probability ~0, so p itself is
                # the exact residual distribution to draw from
                residual = probs[j]
            token = select_tokens(residual.log()[None], [False], [gen]).item()
            return j, int(token)
        token = select_tokens(rows[-1:], [False], [gen]).item()
        return len(draft), int(token)

    @staticmethod
    def _account(seq: Sequence, proposed: int, accepted: int) -> None:
        seq.request.metrics.num_draft_tokens += proposed
        options = seq.request.plan.strategy_options
        if proposed and options.adaptive:
            k = seq.state["spec_k"]
            seq.state["spec_k"] = min(k + 2, options.max_speculative_tokens) if accepted == proposed else max(1, k - 1)

    def on_request_finished(self, request: Request) -> None:
        for proposer in self.proposers.values():
            for seq in request.sequences:
                proposer.release(seq)
