"""The `eagle` proposer: a trained draft head (EAGLE-1 style) over the target's own last hidden states.

The head (`decodekit.models.draft_head.DraftHead`, one decoder layer) reads the target's last hidden state at a
position and the embedding of the token that followed, and predicts the next hidden state; the target's own LM
head, restricted to the head's frequency-ranked draft vocabulary, turns that into a draft token. Drafting `k`
tokens feeds the head its own predictions `k - 1` times. The target's true states of verified positions arrive
through `observe` (`Proposer.hidden_states`), and the next `propose` first runs them through the head, so its
small KV cache always holds true-state entries for every verified position; the speculative entries of a draft
are dropped as soon as it is proposed.

The head for the bundled model ships with decodekit (`decodekit/models/heads/`, trained by
`tools/train_draft_head.py` on the model's own answers); another target needs its own head file:
`proposer_options: {head: PATH}`. A head whose shapes do not fit the target is refused when the request is planned.

Example (recipe): `strategy: {speculative: {proposer: eagle, num_speculative_tokens: 3}}`
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from decodekit.api.components import ComponentInfo
from decodekit.api.proposer import Proposer
from decodekit.api.sampling import select_tokens
from decodekit.api.sequence import Sequence
from decodekit.api.strategy import HiddenStates, StepContext
from decodekit.models.draft_head import DraftHead, HeadCache, load_head


def shipped_head(model_name: str) -> Path | None:
    """The draft head shipped for a target model name (the bundled model's), or None."""
    import decodekit.models as models
    from decodekit.models.loader import BUNDLED_MODEL_NAME

    if model_name != BUNDLED_MODEL_NAME:
        return None
    path = Path(models.__file__).parent / "heads" / f"{BUNDLED_MODEL_NAME}.safetensors"
    return path if path.is_file() else None


class EagleParams(BaseModel):
    """Parameters of the `eagle` proposer."""

    model_config = ConfigDict(extra="forbid")

    head: str | None = Field(None, description="A draft head file written by tools/train_draft_head.py for this "
                             "target; default: the head shipped for the bundled model.")


@dataclass
class _Head:
    """A loaded head with the target's pieces it reuses."""

    module: DraftHead
    embedding: torch.Tensor  # the target's input embedding `[vocab, hidden]`, float32
    lm_rows: torch.Tensor  # the target's LM head rows of the draft vocabulary `[draft_vocab, hidden]`, float32
    vocab: torch.Tensor  # draft index -> target id


@dataclass
class _SeqState:
    """What the proposer keeps per sequence: the head's cache and the true states not yet run through it."""

    cache: HeadCache
    pending: list[torch.Tensor] = field(default_factory=list)  # states of positions offset + cache.length, ...
    num_pending: int = 0
    broken: bool = False  # a gap in the observed states: draft nothing for this sequence
    # The sequence position of the head cache's first entry: the first position the target computed, past a prompt
    # prefix served from the prefix cache (RoPE sees only relative positions, so the head runs from there as if
    # from 0, without the context before it).
    offset: int = 0

    @property
    def next_position(self) -> int:
        """The first position whose true state the head still needs."""
        return self.offset + self.cache.length + self.num_pending


class EagleProposer(Proposer):
    """A trained draft head over the target's hidden states (see the module docstring)."""

    name = "eagle"
    Params = EagleParams
    hidden_states = True
    partial_hidden_states = True  # a prompt from the prefix cache: the head starts at its first computed position

    def __init__(self) -> None:
        self.info: ComponentInfo | None = None
        self._heads: dict[str, _Head] = {}
        self._seqs: dict[int, _SeqState] = {}

    def setup(self, info: ComponentInfo) -> None:
        self.info = info

    def check_options(self, options: BaseModel | None) -> None:
        """A named head file must exist."""
        assert isinstance(options, EagleParams)
        if options.head is not None and not Path(options.head).is_file():
            raise ValueError(f"draft head {options.head!r} is not a file (write one with tools/train_draft_head.py)")

    def check_options_with(self, options: BaseModel | None, info: Any) -> None:
        """Inside an engine: the head loads and fits the target (hidden size, vocabulary)."""
        assert isinstance(options, EagleParams)
        self._head(options)

    def _head_path(self, options: EagleParams) -> Path:
        if options.head is not None:
            return Path(options.head)
        name = self.info.model_name if self.info is not None else ""
        path = shipped_head(name)
        if path is None:
            raise ValueError(f"no draft head ships for model {name!r} (only for the bundled smollm2-135m-instruct): "
                             "train one with tools/train_draft_head.py and set proposer_options: {head: PATH}")
        return path

    def _head(self, options: EagleParams) -> _Head:
        path = self._head_path(options)
        key = str(path.resolve())
        if key in self._heads:
            return self._heads[key]
        info = self.info
        if info is None or info.target is None:
            raise ValueError("proposer 'eagle' runs inside an engine (it reuses the target's embedding and LM head)")
        model = info.target.model
        module, _ = load_head(path, torch.float32, info.device)
        module.fuse()
        config = model.config
        hidden = getattr(config, "hidden_size", None)
        embedding = model.get_input_embeddings().weight
        if module.config.hidden_size != hidden or module.config.vocab_size != embedding.shape[0]:
            raise ValueError(
                f"draft head {str(path)!r} does not fit model {info.model_name!r}: the head was trained for hidden "
                f"size {module.config.hidden_size} and vocabulary {module.config.vocab_size} "
                f"({module.config.target or 'another model'}), the model has {hidden} and {embedding.shape[0]}")
        vocab = module.draft_vocab.to(info.device)
        lm_weight = model.get_output_embeddings().weight
        head = _Head(module, embedding.detach().to(torch.float32),
                     lm_weight.detach()[vocab].to(torch.float32).contiguous(), vocab)
        self._heads[key] = head
        return head

    def observe(self, seq: Sequence, states: HiddenStates, num_valid: int) -> None:
        """Keep the true states of `seq`'s newly final positions for the head's next catch-up."""
        state = self._seqs.get(seq.seq_id)
        if state is None:
            head = next(iter(self._heads.values()), None)
            if head is None:
                return
            state = self._seqs[seq.seq_id] = _SeqState(HeadCache(head.module.config, torch.float32,
                                                                 head.embedding.device), offset=states.start)
        expected = state.next_position
        if states.candidates or states.start > expected:
            state.broken = True  # a gap (or candidates, not positions): this sequence gets no more drafts
            return
        rows = states.states[expected - states.start : num_valid - states.start]
        if rows.shape[0]:
            state.pending.append(rows.to(torch.float32, copy=True))  # the engine reuses its buffers
            state.num_pending += rows.shape[0]

    @torch.inference_mode()
    def propose(self, ctx: StepContext, seqs: list[Sequence], ks: list[int],
                options: list[Any]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Draft `ks[i]` tokens for `seqs[i]`: catch up on the verified positions, then `ks[i]` head steps, the
        sequences of one head batched in every step."""
        drafts: list[list[int]] = [[] for _ in seqs]
        q_rows: list[list[torch.Tensor]] = [[] for _ in seqs]
        groups: dict[int, tuple[_Head, list[int]]] = {}
        for i, option in enumerate(options):
            head = self._head(option)
            groups.setdefault(id(head), (head, []))[1].append(i)
        for head, members in groups.values():
            self._propose_group(ctx, head, [(i, seqs[i], ks[i]) for i in members], drafts, q_rows)
        return drafts, [torch.stack(q) if q else None for q in q_rows]

    def _propose_group(self, ctx: StepContext, head: _Head, members: list[tuple[int, Sequence, int]],
                       drafts: list[list[int]], q_rows: list[list[torch.Tensor]]) -> None:
        ready = []  # (index, seq, k, state, position of its newest token)
        for i, seq, k in members:
            state = self._seqs.get(seq.seq_id)
            last = len(seq.token_ids) - 1  # states are known up to last - 1
            if state is not None and not state.broken and k > 0 and state.next_position == last:
                ready.append((i, seq, k, state, last))
        if not ready:
            return
        device = head.embedding.device
        # catch-up: every sequence's newly verified positions, (f_p, embedding of t_{p+1}), through the head at once
        # (head positions count from the state's offset)
        next_ids = torch.tensor([t for _, seq, _, state, last in ready
                                 for t in seq.token_ids[state.offset + state.cache.length + 1 : last + 1]],
                                device=device)
        states = torch.cat([row for *_, state, _ in ready for row in state.pending])
        segments = [(state.cache, torch.arange(state.cache.length, last - state.offset, device=device))
                    for *_, state, last in ready]
        ends = torch.tensor([last - state.offset - state.cache.length for *_, state, last in ready],
                            device=device).cumsum(0) - 1
        current = head.module.step_many(head.embedding[next_ids], states, segments)[ends]
        for *_, state, _ in ready:
            state.pending, state.num_pending = [], 0
        vocab_size = self.info.vocab_size if self.info is not None else head.embedding.shape[0]
        active = list(range(len(ready)))  # rows of `current`, in `ready` order
        for j in range(max(k for _, _, k, _, _ in ready)):
            rows = [ready[r] for r in active]
            scores = current @ head.lm_rows.T
            tokens: list[int | None] = [None] * len(rows)
            plain = [n for n, (_, seq, _, _, _) in enumerate(rows) if seq.greedy and not seq.request.plan.stages]
            if plain:  # no processor to apply: the argmax over the draft vocabulary is the token
                best = head.vocab[scores[plain].argmax(dim=-1)].tolist()
                for n, token in zip(plain, best):
                    tokens[n] = token
            processed = [n for n in range(len(rows)) if tokens[n] is None]
            if processed:
                seqs = [rows[n][1] for n in processed]
                logits = torch.full((len(processed), vocab_size), float("-inf"), device=device)
                logits[:, head.vocab] = scores[processed]
                logits = ctx.process_after(logits, seqs, [drafts[rows[n][0]] for n in processed],
                                           allow_empty_rows=True)
                allowed = logits.amax(dim=-1) > float("-inf")  # a row whose processors allow no draft-vocabulary id
                picked = select_tokens(logits[allowed], [s.greedy for s, a in zip(seqs, allowed.tolist()) if a],
                                       [s.generator for s, a in zip(seqs, allowed.tolist()) if a]).tolist()
                probs = None if all(s.greedy for s in seqs) else torch.softmax(logits, dim=-1)
                kept = iter(picked)
                for m, n in enumerate(processed):
                    if bool(allowed[m]):
                        tokens[n] = int(next(kept))
                        if probs is not None and not seqs[m].greedy:
                            q_rows[rows[n][0]].append(probs[m])
            going = []  # rows that draft another token
            for n, token in enumerate(tokens):
                if token is None:
                    continue
                index, _, k, _, _ = rows[n]
                drafts[index].append(token)
                if len(drafts[index]) < k:
                    going.append(n)
            if not going:
                break
            feed = torch.tensor([tokens[n] for n in going], device=device)
            segments = [(rows[n][3].cache, torch.tensor([rows[n][4] - rows[n][3].offset + j], device=device))
                        for n in going]
            current = head.module.step_many(head.embedding[feed], current[going], segments)
            active = [active[n] for n in going]
        for *_, state, last in ready:
            state.cache.truncate(last - state.offset)  # the draft's entries are speculative: verified ones replace them

    def release(self, seq: Sequence) -> None:
        """A sequence is finished: drop its cache."""
        self._seqs.pop(seq.seq_id, None)
