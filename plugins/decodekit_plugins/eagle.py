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
    pending: list[torch.Tensor] = field(default_factory=list)  # states of positions cache.length, ...
    num_pending: int = 0
    broken: bool = False  # a gap in the observed states: draft nothing for this sequence


class EagleProposer(Proposer):
    """A trained draft head over the target's hidden states (see the module docstring)."""

    name = "eagle"
    Params = EagleParams
    hidden_states = True

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
                                                                 head.embedding.device))
        expected = state.cache.length + state.num_pending  # the first position whose state the head still needs
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
        """Draft `ks[i]` tokens for `seqs[i]`: catch up on the verified positions, then `ks[i]` head steps."""
        drafts: list[list[int]] = []
        qs: list[torch.Tensor | None] = []
        for seq, k, option in zip(seqs, ks, options):
            draft, q = self._propose_one(ctx, seq, k, self._head(option))
            drafts.append(draft)
            qs.append(q)
        return drafts, qs

    def _propose_one(self, ctx: StepContext, seq: Sequence, k: int, head: _Head
                     ) -> tuple[list[int], torch.Tensor | None]:
        state = self._seqs.get(seq.seq_id)
        last = len(seq.token_ids) - 1  # the position of the newest token; states are known up to last - 1
        if state is None or state.broken or k <= 0 or state.cache.length + state.num_pending != last:
            return [], None
        cache = state.cache
        start = cache.length
        device = head.embedding.device
        next_ids = torch.tensor(seq.token_ids[start + 1 : last + 1], dtype=torch.long, device=device)
        states = torch.cat(state.pending) if len(state.pending) > 1 else state.pending[0]
        predicted = head.module.step(head.embedding[next_ids], states, torch.arange(start, last, device=device), cache)
        state.pending, state.num_pending = [], 0
        current = predicted[-1:]
        vocab_size = self.info.vocab_size if self.info is not None else head.embedding.shape[0]
        draft: list[int] = []
        q_rows: list[torch.Tensor] = []
        plain_greedy = seq.greedy and not seq.request.plan.stages  # no processor to apply: argmax is the token
        for j in range(k):
            scores = current @ head.lm_rows.T
            if plain_greedy:
                token = int(head.vocab[int(scores.argmax())])
            else:
                logits = torch.full((1, vocab_size), float("-inf"), device=device)
                logits[0, head.vocab] = scores[0]
                logits = ctx.process_after(logits, [seq], [draft])
                if float(logits.max()) == float("-inf"):
                    break  # the request's processors allow nothing in the draft vocabulary
                token = int(select_tokens(logits, [seq.greedy], [seq.generator])[0])
                if not seq.greedy:
                    q_rows.append(torch.softmax(logits[0], dim=-1))
            draft.append(token)
            if j + 1 < k:
                current = head.module.step(head.embedding[token][None], current,
                                           torch.tensor([last + j], device=device), cache)
        cache.truncate(last)  # the draft's entries are speculative: the verified states replace them
        return draft, torch.stack(q_rows) if q_rows else None

    def release(self, seq: Sequence) -> None:
        """A sequence is finished: drop its cache."""
        self._seqs.pop(seq.seq_id, None)
