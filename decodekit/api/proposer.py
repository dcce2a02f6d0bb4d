"""The draft-proposer contract: plugins of the `speculative` strategy that draft tokens for the target to verify.

A proposer that runs a model of its own (a draft model) opens it with `info.open_model(info.draft)` in `setup`
and gets a `ProposerModel`: a paged KV cache and a packed forward, driven by sequence id. The built-in `draft`
proposer (`decodekit_plugins.speculative.DraftModelProposer`) uses nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any, ClassVar, Protocol

import torch
from pydantic import BaseModel

from decodekit.api.draft_tree import DraftTree, TreeShape
from decodekit.api.sampling import DrawRule
from decodekit.api.sequence import Sequence
from decodekit.api.step_cost import StepCost
from decodekit.api.strategy import HiddenStates, StepContext


class ProposerModel(Protocol):
    """A model with its own paged KV cache, driven by sequence id (use the target sequence's `seq_id`).

    Example (draft two tokens for `seq` greedily):
        >>> model.reserve(seq.seq_id, len(seq.token_ids) + 1, seq.token_ids)
        >>> new = seq.token_ids[model.num_cached(seq.seq_id):]
        >>> first = int(model.forward([(seq.seq_id, new)])[0].argmax())
        >>> second = int(model.forward([(seq.seq_id, [first])])[0].argmax())

    or the same two tokens in one native call, where the model runs greedy steps natively (None where it does not:
    then the forwards above), when every token but the last is cached:
        >>> first, second = model.greedy_run(seq.seq_id, seq.token_ids[-1], 2)

    or two tokens drawn at temperature 0.7 from the nucleus of 0.9, with the distributions they were drawn from:
        >>> tokens, q = model.sample_run(seq.seq_id, seq.token_ids[-1], 2, DrawRule(0.7, top_p=0.9),
        ...                              torch.rand(2).tolist())
    """

    def num_cached(self, key: int) -> int:
        """How many leading tokens of sequence `key` have their keys and values stored."""
        ...

    def reserve(self, key: int, num_tokens: int, token_ids: Seq[int] | None = None) -> bool:
        """Make room for sequence `key` to hold `num_tokens` tokens in all; False if the pool cannot. Passing a new
        sequence's `token_ids` lets it reuse the blocks computed for the same prefix before (`num_cached` says
        how many tokens that saved)."""
        ...

    def forward(self, batch: Seq[tuple[int, list[int]]]) -> torch.Tensor:
        """One packed forward: each `(key, tokens)` appends `tokens` after the sequence's cached ones; returns
        float32 logits `[len(batch), vocab]` after each sequence's last new token."""
        ...

    def greedy_run(self, key: int, token: int, steps: int) -> list[int] | None:
        """`steps` greedy tokens after sequence `key`'s cached tokens and one more, `token`, in one native call: each
        the argmax of the logits `forward` would return, with the keys and values of `token` and of every new token
        but the last stored, as `steps` one-token forwards would leave them. None (nothing run) where this model has
        no native runs; then call `forward`. Reserve the slots first (`reserve`)."""
        ...

    def sample_run(self, key: int, token: int, steps: int, rule: DrawRule, uniforms: Seq[float]
                   ) -> tuple[list[int], torch.Tensor] | None:
        """`greedy_run` with each token drawn instead: from the distribution `rule` makes of the logits `forward`
        would return (`DrawRule`: their softmax at its temperature, truncated by its top_k, top_p, min_p), by the
        inverse of that distribution's CDF at `uniforms[i]` (each in [0, 1)). Returns the tokens and the
        distributions they were drawn from (float32 `[steps, vocab]`, 0 where truncated); None (nothing run) where
        this model has no native sampled runs; then call `forward`."""
        ...

    def adopt_target_kv(self, key: int, token_ids: Seq[int], computed: int) -> int:
        """Take the target's keys and values of sequence `key`'s tokens past `num_cached(key)`, up to `computed` (the
        sequence's `num_computed_tokens`; never its last token), instead of computing them, where this model is the
        target's own in another format (a self-draft; otherwise nothing happens); returns `num_cached(key)` after.
        Call it after `reserve`."""
        ...

    def truncate(self, key: int, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens of sequence `key`."""
        ...

    def release(self, key: int) -> None:
        """Free everything sequence `key` holds."""
        ...


PROPOSER_OPTIONS_PATH = "strategy.speculative.proposer_options"
"""Where a request or recipe writes a proposer's options (`strategy: {speculative: {proposer_options: {...}}}`): the
key path of the errors its option checks raise."""


class Proposer:
    """Base class of draft proposers for the `speculative` strategy (registered with
    `decodekit_register_proposers`, named by `strategy: {speculative: {proposer: NAME, proposer_options: {...}}}`).

    A proposer drafts up to `k` tokens per sequence. It returns, per sequence, the draft and either None (a
    deterministic proposal) or the `[len(draft), vocab]` probabilities it sampled the draft from (needed by the
    lossless acceptance rule for sampled requests). Built once per engine; `setup` gets the engine's
    `ComponentInfo` (tokenizer, draft model, `open_model`, ...).

    Its `proposer_options` are checked like any component's options: `check_options(options)` wherever a request
    is planned (`decodekit recipe check` included), `check_options_with(options, info)` only inside an engine,
    after `setup(info)`; errors name `strategy.speculative.proposer_options`.
    """

    name: ClassVar[str] = "proposer"
    Params: ClassVar[type[BaseModel] | None] = None

    hidden_states: ClassVar[bool] = False
    """The proposer reads the target's last hidden states (the final norm's output, the LM head's input) of the
    positions it verified, through `observe` (EAGLE-style draft heads); requests that use it then compute their
    prompts in full (cached positions have no hidden states), unless `partial_hidden_states` says otherwise."""

    partial_hidden_states: ClassVar[bool] = False
    """With `hidden_states`: the proposer can start from the first position the target computed, so its requests
    may take their prompts from the prefix cache (the first `observe` then starts at the first uncached position,
    not at 0)."""

    needs_draft: ClassVar[bool] = False
    """The proposer runs the engine's draft model (`LLM(draft=...)`, recipe `draft:`): `decodekit recipe check`
    refuses a recipe that uses it without one, before any model is loaded."""

    def setup(self, info: Any) -> None:
        """Called once with the engine's `ComponentInfo`."""

    def bind(self, components: Any) -> None:
        """Called when the proposer is built, with the components of the engine (or recipe check) it serves: the
        `ComponentLookup` that `check` runs the option checks through. An override must call `super().bind`."""
        self._components = components

    def check_options(self, options: BaseModel | None) -> None:
        """Refuse `proposer_options` pydantic cannot: raise `ValueError` saying why. Static: runs at
        `decodekit recipe check` too, where no engine exists and `setup` was never called."""

    def check_options_with(self, options: BaseModel | None, info: Any) -> None:
        """Refuse a configuration this engine cannot serve (no `info.draft` model, a vocabulary too small): raise
        `ValueError` saying why. Runs only inside an engine, after `check_options` and `setup(info)`."""

    def check(self, options: BaseModel | None) -> None:
        """Check a request's validated `proposer_options`: the strategy that uses the proposer calls this once per
        planned request. Runs `check_options`, then (inside an engine) `check_options_with`, through the components
        the proposer was bound to, so an error is a `PlanError` at `PROPOSER_OPTIONS_PATH`. Implement those two, not
        this (a proposer written before them may still override `check`: it then runs in both places, as before).
        """
        components = getattr(self, "_components", None)
        run = getattr(components, "check_options", None)
        if run is None:  # built by hand (a unit test), not by the engine's components: the static part only
            self.check_options(options)
            return
        run(self, options, PROPOSER_OPTIONS_PATH)

    def propose(self, ctx: StepContext, seqs: list[Sequence], ks: list[int],
                options: list[Any]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Draft up to `ks[i]` tokens for `seqs[i]` (with `options[i]`, its validated `Params`)."""
        raise NotImplementedError

    supports_tree: ClassVar[bool] = False
    """The proposer can draft a tree of branches (`propose_tree`): a request's `tree:` option of the `speculative`
    strategy is refused with a proposer that cannot."""

    def propose_tree(self, ctx: StepContext, seqs: list[Sequence], ks: list[int], options: list[Any],
                     shape: TreeShape) -> list[DraftTree]:
        """Draft a tree of depth up to `ks[i]` for `seqs[i]`, shaped by `shape` (proposers with `supports_tree`):
        its branches and, per token, the distribution it was drawn from (`decodekit.api.draft_tree.DraftTree`)."""
        raise NotImplementedError(f"proposer {self.name!r} cannot draft a tree")

    def observe(self, seq: Sequence, states: HiddenStates, num_valid: int) -> None:
        """After each target forward of `seq` (proposers with `hidden_states = True` only, before `rollback`):
        `states.states[j]` is the target's last hidden state at position `states.start + j` of `seq`'s tokens and
        draft; the positions before `num_valid` are final (a rejected draft's rows follow them). The prompt's
        arrive with its first generated token."""

    def rollback(self, seq: Sequence, num_valid: int) -> None:
        """After verification: only the first `num_valid` tokens of `seq.token_ids` are final."""

    def release(self, seq: Sequence) -> None:
        """A sequence is finished: free what the proposer holds for it."""

    def forget_outputs(self) -> None:
        """Forget what finished requests' outputs taught it (the `suffix` proposer's recent outputs), keeping what it
        measured: a comparison that runs the same prompts more than once calls it before each timed run, so a run
        cannot draft an earlier run's answers. Default: nothing."""

    def forward_rows(self) -> list[int] | None:
        """The rows (tokens fed) of each model forward its last `propose` or `propose_tree` call ran, for the
        strategy's cost model to weigh that call's time against; None (the default) where it runs no model or does
        not say: its forwards are then taken to feed one row per sequence drafting. A draft model's first forward
        of a call also feeds what its cache lacks (a new prompt, the tokens decoded while drafting was off): a call
        that catches up on 8 prompts costs ~100 times a drafting forward, and charged as one it made every later
        draft look 2.5 times dearer than it was (speculation at batch 8 then stayed off)."""
        return None

    def draft_cost(self, measured: bool) -> StepCost | None:
        """What one of its drafting forwards costs by the rows (sequences) it drafts for, for the strategy's
        adaptive draft length: None where drafting costs next to nothing (a lookup); a proposer running a model
        returns `info.step_cost(its ProposerModel)` when `measured`, else a fixed curve (tests)."""
        return None
