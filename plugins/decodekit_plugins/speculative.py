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
- `draft`: a smaller causal LM with the target's tokenizer (the engine's `draft` model), or an int8 copy of the
  target (`draft: {model: target, quantization: int8}`), with its own paged KV cache; it sees the request's
  processors too, so a draft equal to the target is accepted 100%;
- `eagle` (`decodekit_plugins.eagle`): a trained draft head over the target's own last hidden states;
- `suffix` (`decodekit_plugins.suffix`): suffix decoding, drafts from suffix tries over the request and recent outputs.

`fallback` chains more proposers per step: each drafts for the sequences the links before it left without a draft
(`proposer: ngram` with `prompt_lookup_min: 2` where the context offers a real match, `fallback: [suffix, draft]`
elsewhere): the first link that proposes something drafts that sequence in that step.
Each request's outputs count drafted and accepted tokens per proposer (`metrics.proposer_tokens`).

With `tree: {width, max_nodes, threshold}`, a proposer that `supports_tree` (`draft`) drafts a tree of branches where
it is unsure, all verified in one forward (`decodekit_plugins.draft_trees`; docs/speculative.md, "Draft trees").
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from decodekit.api.components import ComponentInfo, ComponentLookup, validate_options
from decodekit.api.draft_tree import DraftTree, TreeShape, count_nodes
from decodekit.api.params import SamplingParams
from decodekit.api.processors import Stage
from decodekit.api.proposer import Proposer, ProposerModel
from decodekit.api.sampling import DrawRule, draw_rule, select_tokens
from decodekit.api.sequence import Request, Sequence
from decodekit.api.stash import StashKey
from decodekit.api.step_cost import StepCost, StepTiming
from decodekit.api.strategy import StepContext, Strategy, TokenDistribution
from decodekit_plugins.adaptive import (
    ACCEPTANCE,
    CHAIN_DECAY,
    PROBE_TOKENS,
    SHADOW_GAP,
    SHADOW_TOKENS,
    Acceptance,
    OffSwitch,
    Shadow,
    draft_lengths,
    lengths_by_answer,
    tree_rows,
    tree_shape,
    worst_tree_rows,
)
from decodekit_plugins.cost_model import (
    Calibration,
    ChainCharge,
    ProposerCost,
    RealizedGain,
    bucket,
    draft_forwards,
)
from decodekit_plugins.draft_trees import accept_tree, draft_tree, propose_with_trees, tree_rollback

DEFAULT_K = 4  # the first k of `adaptive: heuristic` without `num_speculative_tokens`
DRAFT_SHARE = 0.3  # the default curve's draft model: a third of the target's cost (an int8 copy on a CPU measures so)


class SpeculativeParams(BaseModel):
    """Parameters of the `speculative` strategy."""

    model_config = ConfigDict(extra="forbid")

    proposer: str = Field("ngram", description="A registered proposer: 'ngram' (prompt lookup), 'draft' (a model).")
    proposer_options: dict[str, Any] = Field(default_factory=dict, description="The proposer's own parameters.")
    fallback: str | list[str] | None = Field(
        None, description="More proposers, chained per step: each drafts for the sequences the links before it "
        "left without a draft (e.g. `proposer: ngram` with `prompt_lookup_min: 2` finds no good match, then "
        "`fallback: draft`; or `fallback: [suffix, draft]`).")
    fallback_options: dict[str, Any] | list[dict[str, Any]] = Field(
        default_factory=dict, description="The fallback's own parameters (a list, one per fallback, for a list).")
    num_speculative_tokens: int | None = Field(
        None, ge=1, le=32, description="Draft tokens per step (k), fixed; with `adaptive: heuristic` the start of k. "
        "Unset: k adapts to acceptance and the step's cost (`adaptive: cost`).")
    adaptive: Literal["cost", "heuristic", "off"] | None = Field(
        None, description="How k adapts per sequence: `cost` (the default when `num_speculative_tokens` is unset): "
        "each step, the k that maximizes the batch's expected tokens per second, from the sequence's acceptance "
        "and this machine's cost of a step by rows, 0 where speculation cannot pay; `heuristic` (or true): +2 when "
        "all are accepted, -1 otherwise (transformers'); `off` (or false; the default with "
        "`num_speculative_tokens`): fixed.")
    max_speculative_tokens: int = Field(10, ge=1, le=32, description="Upper bound for adaptive k.")
    tree: TreeShape | None = Field(
        None, description="Draft a tree of branches where the proposer is unsure, verified in one forward "
        "(`decodekit_plugins.draft_trees`; proposers with `supports_tree`): `{width, max_nodes, threshold}`.")
    cost_model: Literal["measured", "default"] = Field(
        "measured", description="`adaptive: cost`'s step cost: measured on this machine once (cached on disk), or "
        "`default`, a fixed memory-bound curve (tests).")
    runs_without_drafts: int = Field(
        4, ge=0, le=64, description="A greedy request alone in the engine that the proposers found no draft for "
        "this step decodes up to this many tokens in one decode run before they are asked again, twice as many "
        "after each further miss in a row (up to 16x); one whose adaptive k is 0 (speculation cannot pay now) "
        "decodes plain decoding's runs. `EngineConfig.decode_run_steps` bounds every run; 0: a step at a time. "
        "Proposers that read the target's hidden states (eagle) never run so.")
    disable_by_batch_size: int | None = Field(
        None, ge=1, description="Draft nothing in steps where at least this many sequences run (vLLM's name): a "
        "large batch keeps the products busy, so verifying drafts costs more than it saves.")

    _proposer_params: Any = PrivateAttr(None)  # `proposer_options`, validated against the proposer at planning
    _fallback_params: list[Any] = PrivateAttr(default_factory=list)  # each fallback's options, likewise

    @property
    def chain(self) -> tuple[str, ...]:
        """The proposer and its fallbacks, in the order they are asked."""
        return (self.proposer, *self.fallbacks)

    @property
    def fallbacks(self) -> list[str]:
        """The chain's links after the first proposer, in order."""
        return [] if self.fallback is None else [self.fallback] if isinstance(self.fallback, str) else self.fallback

    def fallback_options_list(self) -> list[dict[str, Any]]:
        """`fallback_options` as one dict per fallback."""
        options = self.fallback_options
        return options if isinstance(options, list) else [options] * len(self.fallbacks)

    @field_validator("adaptive", mode="before")
    @classmethod
    def _adaptive_bool(cls, value: Any) -> Any:
        """`adaptive: true` is transformers' heuristic (as before `cost` existed), `false` a fixed k."""
        return {True: "heuristic", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @property
    def adaptation(self) -> Literal["cost", "heuristic", "off"]:
        """How k adapts, the default resolved: `cost` unless `num_speculative_tokens` pins k."""
        if self.adaptive is not None:
            return self.adaptive
        return "cost" if self.num_speculative_tokens is None else "off"

    @model_validator(mode="after")
    def _check(self) -> SpeculativeParams:
        if self.adaptive == "cost" and self.num_speculative_tokens is not None:
            raise ValueError("num_speculative_tokens fixes k, and `adaptive: cost` chooses it each step (up to "
                             "max_speculative_tokens): set one of them")
        if self.proposer in self.fallbacks:
            raise ValueError(f"fallback {self.proposer!r} is the proposer itself; name another one or leave it unset")
        repeated = sorted({name for name in self.fallbacks if self.fallbacks.count(name) > 1})
        if repeated:
            raise ValueError(f"fallback {repeated[0]!r} is in the chain twice; name each proposer once")
        if self.fallback_options and self.fallback is None:
            raise ValueError("fallback_options without a fallback")
        if isinstance(self.fallback_options, list) != isinstance(self.fallback, list) and self.fallback_options:
            raise ValueError("fallback_options: a list of fallbacks takes a list of options (one dict each), a "
                             "single fallback one dict")
        if isinstance(self.fallback_options, list) and len(self.fallback_options) != len(self.fallbacks):
            raise ValueError(f"fallback_options: {len(self.fallback_options)} dicts for {len(self.fallbacks)} "
                             "fallbacks; give one per fallback")
        return self


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
    """Up to `k` tokens that followed the latest earlier occurrence of the longest matching suffix of `tokens`.

    Only the earlier positions holding the last token can end a match, so those are found in one comparison over
    the tokens and each longer suffix is checked at them alone: a miss over 600 tokens took ~160 us as three
    sliding-window passes (n = 4, 3, 2), and lookups run for every sequence asked, shadow drafts included."""
    length = len(tokens)
    if length < 2 or k <= 0:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    ends = np.flatnonzero(arr[: length - 1] == arr[length - 1])  # where an earlier match could end, ascending
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        candidates = ends[ends >= n - 1]  # a match of n tokens ending there starts at or after 0
        for back in range(1, n):
            candidates = candidates[arr[candidates - back] == arr[length - 1 - back]]
        if candidates.size:
            start = int(candidates[-1]) + 1
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


def _plain_argmax(seq: Sequence) -> bool:
    """Whether a draft for `seq` is the draft model's argmaxes and nothing else: greedy, no processors (nor reasoning
    phases, which change them), so a native greedy run (`ProposerModel.greedy_run`) drafts exactly what one-token
    forwards, processed and selected, would."""
    plan = seq.request.plan
    return seq.greedy and plan is not None and not plan.stages and plan.phases is None


def _plain_draw(seq: Sequence) -> DrawRule | None:
    """How `seq`'s draft tokens are drawn where each is a draw a native run can make from the draft model's logits:
    sampled without a seed, no reasoning phases, no processors but temperature, top_k, top_p and min_p in their
    usual order (`draw_rule`); None otherwise. A native run (`ProposerModel.sample_run`) then drafts from the
    distribution the forwards would, with draws of its own. A seeded sequence drafts by the forwards: its draws
    come from its generator in the order a batched step takes them, so its output is the same alone and batched."""
    plan = seq.request.plan
    if seq.greedy or plan is None or plan.phases is not None or seq.request.params.seed is not None:
        return None
    return draw_rule(plan.stages)


class _CountedForwards:
    """A `ProposerModel` that notes how many tokens each forward feeds (into `fed`), for `Proposer.forward_rows`."""

    def __init__(self, model: ProposerModel, fed: list[int]) -> None:
        self._model, self._fed = model, fed

    def forward(self, batch: Any) -> torch.Tensor:
        self._fed.append(sum(len(tokens) for _, tokens in batch))
        return self._model.forward(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class DraftModelProposer(Proposer):
    """The engine's draft model (`LLM(draft=...)`, recipe `draft:`), run with its own paged KV cache (opened through
    the public `ComponentInfo.open_model`), proposing for a batch of sequences with k batched forwards. It applies
    each request's processors to its own logits, so its proposals follow the same constraints as the target.

    Example (recipe): `draft: {model: <smaller model, same tokenizer>}` and
    `strategy: {speculative: {proposer: draft}}`
    """

    name = "draft"
    needs_draft = True
    supports_tree = True

    def __init__(self) -> None:
        self.info: ComponentInfo | None = None
        self.model: ProposerModel | None = None
        self.tree_roots: dict[int, tuple[int, list[int]]] = {}  # what a tree left in each sequence's cache
        self._fed: list[int] = []  # the tokens each forward of the last call fed (`forward_rows`)

    def setup(self, info: ComponentInfo) -> None:
        self.info = info

    def check_options_with(self, options: BaseModel | None, info: Any) -> None:
        """Inside an engine only: the engine must have a draft model (`recipe check` has no engine to ask)."""
        if info.draft is None:
            raise ValueError("proposer 'draft' needs a draft model: set `draft:` in the recipe or LLM(draft=...)")

    def _model(self) -> ProposerModel:
        if self.model is None:
            info = self.info
            if info is None or info.draft is None or info.open_model is None:
                raise RuntimeError("proposer 'draft' runs inside an engine with a draft model")
            self.model = info.open_model(info.draft)  # built at first use: engines without speculation pay nothing
        return self.model

    def propose(self, ctx: StepContext, seqs: list[Sequence], ks: list[int],
                options: list[Any]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Draft `ks[i]` tokens for `seqs[i]`; returns the drafts and, for sampled rows, their q rows `[k, vocab]`."""
        self._fed = []
        model = _CountedForwards(self._model(), self._fed)
        for seq in seqs:  # a failed call may have cached draft tokens: the last token is always fed here
            if model.num_cached(seq.seq_id) >= len(seq.token_ids):
                model.truncate(seq.seq_id, len(seq.token_ids) - 1)
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        # the last draft token is never fed: the target verifies it
        active = [i for i, seq in enumerate(seqs) if ks[i] > 0
                  and model.reserve(seq.seq_id, len(seq.token_ids) + ks[i] - 1, seq.token_ids)]
        for i in active:  # a self-draft copies what the target computed (its prompt, a run without drafts)
            model.adopt_target_kv(seqs[i].seq_id, seqs[i].token_ids, seqs[i].num_computed_tokens)
        native_q: dict[int, torch.Tensor | None] = {}  # a native draft's q rows, already one tensor
        if len(active) == 1:  # a lone argmax or plain draw: natively, in one call
            i = active[0]
            native = self._native_draft(model, seqs[i], ks[i])
            if native is not None:
                self._fed.extend([1] * ks[i])  # k one-token forwards, as the loop below would make them
                drafts[i], native_q[i] = native
                active = []
        for step in range(max((ks[i] for i in active), default=0)):
            rows = [i for i in active if len(drafts[i]) < ks[i] and step == len(drafts[i])]
            if not rows:
                break
            row_seqs = [seqs[i] for i in rows]
            batch = [(s.seq_id, (s.token_ids + drafts[i])[model.num_cached(s.seq_id):]) for s, i in zip(row_seqs, rows)]
            logits = ctx.process_after(model.forward(batch), row_seqs, [drafts[i] for i in rows])
            greedy = [s.greedy for s in row_seqs]
            tokens = select_tokens(logits, greedy, [s.generator for s in row_seqs]).tolist()
            probs = None if all(greedy) else torch.softmax(logits, dim=-1)
            for r, (i, token) in enumerate(zip(rows, tokens)):
                drafts[i].append(token)
                if probs is not None and not greedy[r]:
                    qs[i].append(probs[r])
        return drafts, [native_q[i] if i in native_q else torch.stack(q) if q else None for i, q in enumerate(qs)]

    @staticmethod
    def _native_draft(model: ProposerModel, seq: Sequence, k: int) -> tuple[list[int], torch.Tensor | None] | None:
        """`seq`'s k draft tokens from one native run of the draft model (and, drawn, their distributions), where
        it starts from one pending token (a self-draft always does; a separate draft after a fully accepted draft
        has two to catch up) and each token is an argmax (`_plain_argmax`) or a plain draw (`_plain_draw`); None
        where it does not run so (then the forwards draft)."""
        if model.num_cached(seq.seq_id) != len(seq.token_ids) - 1:
            return None
        if _plain_argmax(seq):
            run = model.greedy_run(seq.seq_id, seq.token_ids[-1], k)
            return None if run is None else (run, None)
        rule = _plain_draw(seq)
        if rule is None:
            return None
        uniforms = torch.rand(k, dtype=torch.float64, generator=seq.generator)
        return model.sample_run(seq.seq_id, seq.token_ids[-1], k, rule, uniforms.tolist())

    def propose_tree(self, ctx: StepContext, seqs: list[Sequence], ks: list[int], options: list[Any],
                     shape: TreeShape) -> list[DraftTree]:
        """A tree per sequence: branches where the draft model is unsure (`decodekit_plugins.draft_trees`)."""
        self._fed = []
        return draft_tree(_CountedForwards(self._model(), self._fed), ctx, seqs, ks, shape, self.tree_roots)

    def forward_rows(self) -> list[int] | None:
        """The tokens each forward of the last call fed (its first one's catch-up included)."""
        return list(self._fed)

    def draft_cost(self, measured: bool) -> StepCost | None:
        """The draft model's forward by rows, measured on this machine (or, in the curve's units, a share of the
        target's: the default curve's, or the measured one's while the draft's pool has no blocks to measure with)."""
        if measured and self.info is not None and self.info.step_cost is not None:
            cost = self.info.step_cost(self._model())
            if cost is not None:
                return cost
            target = self.info.step_cost(None)
            if target is not None:
                return target.scaled(DRAFT_SHARE)
        return StepCost.default().scaled(DRAFT_SHARE)

    def rollback(self, seq: Sequence, num_valid: int) -> None:
        """Keep only the first `num_valid` tokens of `seq` in the draft's cache (fewer where a tree's sibling
        branch was kept: the cache holds the tree's first branch)."""
        if self.model is not None:
            self.model.truncate(seq.seq_id, tree_rollback(self.tree_roots, seq, num_valid))

    def release(self, seq: Sequence) -> None:
        """Free a finished sequence's draft blocks."""
        self.tree_roots.pop(seq.seq_id, None)
        if self.model is not None:
            self.model.release(seq.seq_id)


def accept_sampled(draft: list[int], rows: torch.Tensor, q: torch.Tensor | None,
                   gen: torch.Generator | None) -> tuple[int, int]:
    """The lossless rule for a sampled row: how many of `draft` to accept and the token that follows.

    `rows` holds the target's processed logits at the `len(draft) + 1` scored positions, `q` the probabilities each
    draft token was sampled from (None: a deterministic draft), `gen` the sequence's generator.
    """
    probs = torch.softmax(rows, dim=-1)
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


_K = StashKey[int]()  # a sequence's current number of draft tokens (adaptive k)
_Q = StashKey["torch.Tensor | None"]()  # the probabilities the sequence's draft was sampled from (None: deterministic)
_TREE = StashKey[DraftTree]()  # the draft tree the sequence's branches came from (its tokens' distributions)
_BY = StashKey[str]()  # the proposer that drafted the sequence's current draft (with a fallback, either link)
_RELEASED = StashKey[bool]()  # a finished sequence of a request that runs on (n > 1): its proposers' state is freed
_MISSES = StashKey[int]()  # asks in a row its chain drafted nothing for; NOT_ASKED: this step's k was 0
NOT_ASKED = -1
MAX_RUN_STEPS = 1 << 16  # "as plain decoding does": the engine's `decode_run_steps` bounds every run
MAX_RUN_DOUBLINGS = 4  # a chain that keeps finding nothing is asked again after at most 16x runs_without_drafts


@dataclass
class _AnswerFirst:
    """One chooser group of a step whose chain starts with lookups: the sequences (indices in the step) whose
    lengths wait for the lookups' answers, their chain, the target's calibrated cost, the draft model link's cost and
    name (None: the chain has no model)."""

    indices: list[int]
    chain: tuple[str, ...]
    target: Calibration
    draft: Callable[[float], float] | None
    model_link: str | None


class SpeculativeStrategy(Strategy):
    """Speculative decoding (lossless) with an n-gram or draft-model proposer, under continuous batching.

    Example (recipe): `strategy: {speculative: {proposer: ngram, num_speculative_tokens: 4, adaptive: true}}`, or
    chained: `{proposer: ngram, proposer_options: {prompt_lookup_min: 2}, fallback: draft}`
    """

    name = "speculative"
    Params = SpeculativeParams
    scores = "logits"

    def __init__(self) -> None:
        self.components: ComponentLookup | None = None
        self.info: ComponentInfo | None = None
        self.proposers: dict[str, Proposer] = {}  # the ones this strategy has used (for rollback and release)
        # `adaptive: cost`'s online cost model (`decodekit_plugins.cost_model`): per target curve its calibration by
        # what steps measure, per proposer its host time; the last step timing recorded (each step's once)
        self.calibrations: dict[StepCost, Calibration] = {}
        self.host_costs: dict[str, ProposerCost] = {}
        self.chain_priors: dict[tuple[str, ...], Acceptance] = {}  # per chain, its sequences' running acceptance
        self.off_switches: dict[tuple[Any, ...], OffSwitch] = {}  # per group of the chooser, its switched-off batch
        self._chain_reads: dict[tuple[str, ...], bool] = {}  # per chain, whether a proposer reads hidden states
        self._timed: StepTiming | None = None
        # per target curve, chain and batch size bucket, what its steps measured with and without drafts; this
        # step's (its first chooser group's), whether the chooser drafted in it, and the propose time
        self.realized: dict[tuple[StepCost, tuple[str, ...], int], RealizedGain] = {}
        self._measuring: tuple[RealizedGain, bool] | None = None
        self._propose_seconds = 0.0

    def bind(self, components: ComponentLookup) -> None:
        self.components = components

    def setup(self, info: ComponentInfo) -> None:
        self.info = info

    def reads_hidden_states(self, options: BaseModel | None) -> bool:
        """When the proposer (or the fallback) reads the target's hidden states (`Proposer.hidden_states`)."""
        assert isinstance(options, SpeculativeParams)
        chain = options.chain
        known = self._chain_reads.get(chain)  # asked per request every step: kept once the chain's proposers exist
        if known is not None:
            return known
        proposers = self._used_proposers(options)
        reads = any(getattr(p, "hidden_states", False) for p in proposers)
        if all(p is not None for p in proposers):
            self._chain_reads[chain] = reads
        return reads

    def needs_every_hidden_state(self, options: BaseModel | None) -> bool:
        """When a proposer that reads hidden states cannot start mid-prompt (`Proposer.partial_hidden_states`)."""
        return any(getattr(p, "hidden_states", False) and not getattr(p, "partial_hidden_states", False)
                   for p in self._used_proposers(options))

    def steps_without_drafts(self, request: Request) -> int:
        """`runs_without_drafts` (doubled per further miss in a row, up to 16x; plain decoding's runs where its k
        was 0) for a request whose chain reads no hidden states (the run computes none to give them), greedy or
        drawn without a seed by a rule a run draws by (`_plain_draw`); the draft model catches up on the run's tokens
        at its next draft, and a step without a draft leaves nothing else to do than the argmax or the draw."""
        options = request.plan.strategy_options if request.plan is not None else None
        if not isinstance(options, SpeculativeParams) or self.reads_hidden_states(options):
            return 0
        if not request.params.greedy and (len(request.sequences) != 1 or _plain_draw(request.sequences[0]) is None):
            return 0
        if not options.runs_without_drafts:
            return 0
        misses = request.sequences[0].stash.get(_MISSES, 0)
        if misses == NOT_ASKED:  # k 0 (speculation cannot pay now): it decodes as plain decoding does
            return MAX_RUN_STEPS
        # the chain found nothing: a copied span that diverged may resume soon, free text rarely; each further miss
        # in a row doubles the run before the next ask
        return options.runs_without_drafts << min(max(misses - 1, 0), MAX_RUN_DOUBLINGS)

    def ran_natively(self, request: Request, tokens: int, seconds: float) -> None:
        """A run's tokens are plain decoding's steps for `adaptive: cost`: each calibrates the one-row step, so a
        lone request's drafts are weighed against the decode runs it would otherwise make (3.0 ms a token on the
        bundled GGUF against 3.9 for a single step), not against slower single steps."""
        options = request.plan.strategy_options if request.plan is not None else None
        if not isinstance(options, SpeculativeParams) or options.adaptation != "cost" or tokens < 1:
            return
        target = self._costs(options)[0]
        calibrated = self.calibrations.setdefault(target, Calibration(target))
        for _ in range(tokens):
            calibrated.record(1, seconds / tokens)
        if seconds > 0:  # what plain decoding gives a lone request here, for the veto's comparison
            self.realized.setdefault((target, options.chain, bucket(1)), RealizedGain()).record_plain(tokens / seconds)

    def _used_proposers(self, options: BaseModel | None) -> list[Proposer | None]:
        """The proposer and fallback that requests with these options use (None where not built yet)."""
        assert isinstance(options, SpeculativeParams)
        return [self.proposers.get(name) for name in options.chain]

    def _proposer(self, name: str) -> Proposer:
        assert self.components is not None, "the registry binds the strategy when it builds it"
        proposer: Proposer = self.components.get("proposers", name, f"strategy.{self.name}.proposer")
        self.proposers[name] = proposer
        return proposer

    def token_distribution(self, options: BaseModel | None, params: SamplingParams) -> TokenDistribution:
        """Lossless: the tokens are distributed as the plain strategy's (the processed distribution, or its argmax)."""
        return "deterministic" if params.greedy else "processed"

    def num_sequences(self, options: BaseModel | None, params: SamplingParams) -> int:
        """Parallel sampling: `n` sequences, each drafting and verifying on its own (`_fork`)."""
        return params.n

    def check_compatible(self, options: BaseModel | None, params: SamplingParams, stages: tuple[Stage, ...]) -> None:
        assert isinstance(options, SpeculativeParams)
        proposer = self._proposer(options.proposer)
        # validated once, when the request is planned, and kept with its options; errors name the key where the
        # recipe or request writes it (`strategy: {speculative: {proposer_options: {...}}}`)
        options._proposer_params = validate_options(proposer, options.proposer_options,
                                                   f"strategy.{self.name}.proposer_options")
        proposer.check(options._proposer_params)
        if options.tree is not None and not proposer.supports_tree:
            raise ValueError(f"strategy.{self.name}.tree: proposer {options.proposer!r} cannot draft a tree "
                             "(a proposer with supports_tree can, e.g. 'draft'); remove `tree` or name another")
        options._fallback_params = []
        listed = isinstance(options.fallback, list)
        for i, (name, raw) in enumerate(zip(options.fallbacks, options.fallback_options_list())):
            assert self.components is not None
            where = f"strategy.{self.name}.fallback" + (f"[{i}]" if listed else "")
            fallback: Proposer = self.components.get("proposers", name, where)
            self.proposers[name] = fallback
            fallback_params = validate_options(fallback, raw, f"strategy.{self.name}.fallback_options"
                                               + (f"[{i}]" if listed else ""))
            fallback.check(fallback_params)
            options._fallback_params.append(fallback_params)
        if options.tree is not None and self.reads_hidden_states(options):
            raise ValueError(f"strategy.{self.name}.tree: a proposer that reads the target's hidden states cannot "
                             "be chained with a draft tree; remove `tree` or the hidden-state proposer")

    def propose(self, ctx: StepContext, seqs: list[Sequence]) -> None:
        started = time.perf_counter()
        self._measuring = None
        groups: dict[str, list[tuple[Sequence, int, Any]]] = {}
        if self._resolve_shadows(seqs):  # a shadow draft wholly accepted: a batch switched off is chosen for again
            for off in self.off_switches.values():
                off.release()
        self._release_finished_forks(seqs)
        ks, shapes, limits, answer_first, shadowing = self._lengths(ctx, seqs)
        self._ask_shadows(ctx, seqs, ks, limits, shadowing)
        first = {i for group in answer_first for i in group.indices}
        asked = []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            options = seq.request.plan.strategy_options
            seq.stash.pop(_BY, None)
            if options.disable_by_batch_size is not None and ctx.num_running >= options.disable_by_batch_size:
                continue
            if k > 0:  # k 0: the proposers are not asked at all, so an off-switched batch pays no lookups
                if i not in first:
                    groups.setdefault(options.proposer, []).append((seq, k, options._proposer_params))
                asked.append(seq)
        asked_ids = {id(seq) for seq in asked}
        for group in answer_first:
            indices = [i for i in group.indices if id(seqs[i]) in asked_ids]
            for name, items in self._answer_first(ctx, group, [seqs[i] for i in indices],
                                                  [limits[i] for i in indices]).items():
                groups.setdefault(name, []).extend(items)
        while groups:  # each link of the chain drafts for the sequences the links before it left without a draft
            groups = self._draft(ctx, groups, shapes)
        for seq in asked:  # how often each sequence's chain finds a draft (`adaptive: cost` weighs its gains)
            drafted = bool(seq.draft_token_ids or seq.draft_branches)
            seq.stash[_MISSES] = 0 if drafted else max(seq.stash.get(_MISSES, 0), 0) + 1
            if ACCEPTANCE in seq.stash:
                seq.stash[ACCEPTANCE].record_ask(drafted)
                self._chain_prior(seq.request.plan.strategy_options).record_ask(drafted)
        if len(asked) < len(seqs):
            for seq in seqs:
                if id(seq) not in asked_ids:
                    seq.stash[_MISSES] = NOT_ASKED
        self._propose_seconds = time.perf_counter() - started

    def _release_finished_forks(self, seqs: list[Sequence]) -> None:
        """A sequence that finished while its request's others run on (`n > 1`) gives back what the proposers
        keep for it (a draft model's KV blocks, a suffix index) now, not when the whole request ends."""
        requests = {id(seq.request): seq.request for seq in seqs if len(seq.request.sequences) > 1}
        for request in requests.values():
            for seq in request.sequences:
                if seq.finished and not seq.stash.get(_RELEASED, False):
                    seq.stash[_RELEASED] = True
                    for proposer in self.proposers.values():
                        proposer.release(seq)

    def _lengths(self, ctx: StepContext, seqs: list[Sequence]
                 ) -> tuple[list[int], dict[int, TreeShape | None], list[int], list[_AnswerFirst],
                            dict[int, tuple[str, ...]]]:
        """This step's k per sequence: fixed, the heuristic's, or (`adaptive: cost`) chosen for the batch; the
        tree shape of each `adaptive: cost` sequence that asks for a tree, cut to the rows that are nearly free
        (None: a plain draft this step); each sequence's most draft tokens; the groups whose chain's lookups
        answer before their lengths are final (`_answer_first`); and the sequences (indices) of chains of lookups
        alone that may draft in shadow (`_ask_shadows`), with those lookups."""
        ks, limits, costed = [], [], []
        for i, seq in enumerate(seqs):
            options = seq.request.plan.strategy_options
            assert isinstance(options, SpeculativeParams)
            mode = options.adaptation
            # never draft past max_tokens or the context (the last position is the target's own token)
            limit = min(options.max_speculative_tokens if mode == "cost" else 32,
                        seq.request.params.max_tokens - seq.num_generated - 1,
                        ctx.max_model_len - len(seq.token_ids) - 1)
            if mode == "cost":
                costed.append(i)
            ks.append(min(limit, seq.stash.setdefault(_K, options.num_speculative_tokens or DEFAULT_K)))
            limits.append(max(limit, 0))
        by_costs: dict[tuple[StepCost, tuple[StepCost | None, ...], tuple[str, ...]], list[int]] = {}
        costs: dict[tuple[str, ...], tuple[StepCost, tuple[StepCost | None, ...]]] = {}  # this step's, by chain
        for i in costed:  # grouped by cost curves and chains: requests may measure, or not, and chain others
            options = seqs[i].request.plan.strategy_options
            chain = options.chain
            known = costs.get((options.cost_model, *chain))
            if known is None:
                known = costs[(options.cost_model, *chain)] = self._costs(options)
            by_costs.setdefault((*known, chain), []).append(i)
        shapes: dict[int, TreeShape | None] = {}
        answer_first: list[_AnswerFirst] = []
        shadowing: dict[int, tuple[str, ...]] = {}
        first_group = True
        for (target, curves, chain), rows in by_costs.items():
            calibrated = self.calibrations.setdefault(target, Calibration(target))
            # the chain's first model link's curve, for the seeded sequences' timing-free choice
            draft = next((c for c in curves if c is not None), None)
            host = ChainCharge.of([(self.host_costs.setdefault(name, ProposerCost()), curve)
                                   for name, curve in zip(chain, curves)])
            # a chain that starts with a lookup: its lookups answer first, then each length is chosen by the
            # answering link's rate; before that, by the higher of the chain's and its draft model's
            lookups_first = len(chain) > 1 and curves[0] is None
            model_link = next((name for name, c in zip(chain, curves) if c is not None), None)
            realized = self.realized.setdefault((target, chain, bucket(ctx.num_running)), RealizedGain())
            vetoed = realized.vetoed(frozenset(seqs[i].seq_id for i in rows))
            off = self.off_switches.setdefault((target, curves, chain), OffSwitch())
            chosen = draft_lengths([seqs[i] for i in rows], [limits[i] for i in rows],
                                   ctx.num_running - len(rows), target, draft, calibrated, host,
                                   self.chain_priors.get(chain), off,
                                   rate_link=model_link if lookups_first else None, vetoed=vetoed)
            lookups = self._shadow_links(chain, curves)
            # a chain of lookups alone, where a high acceptance could pay (`_ask_shadows`)
            if len(lookups) == len(chain) and not vetoed and off.hopeless is not True:
                shadowing.update((i, lookups) for i in rows)
            for i, k in zip(rows, chosen):
                ks[i] = k
            if first_group:  # what the step gives: with the chooser's drafts, or plain (a probe's step is neither)
                first_group = False
                drafted = any(k and not self._alone_or_probing(seqs[i]) for i, k in zip(rows, chosen))
                self._measuring = (realized, drafted) if drafted or not any(chosen) else None
            if lookups_first:
                first = [i for i in rows if ks[i] > 0 and self._answers_first(seqs[i])]
                if first:
                    answer_first.append(_AnswerFirst(first, chain, calibrated, host.draft, model_link))
            shapes.update(self._tree_shapes(ctx, [seqs[i] for i in rows], [ks[i] for i in rows], target,
                                            calibrated, sum(ks)))
        return ks, shapes, limits, answer_first, shadowing

    def _shadow_links(self, chain: tuple[str, ...], curves: tuple[StepCost | None, ...]) -> tuple[str, ...]:
        """The leading links of `chain` that can draft in shadow: lookups (no draft model's forward to pay, no
        target hidden states to read), which draft for a sequence at any step for tens of microseconds."""
        links: list[str] = []
        for name, curve in zip(chain, curves):
            if curve is not None or self._proposer(name).hidden_states:
                break
            links.append(name)
        return tuple(links)

    @staticmethod
    def _resolve_shadows(seqs: list[Sequence]) -> bool:
        """Count each shadow draft the tokens since have decided (`adaptive.Shadow`) in its sequence's acceptance, as
        a verification of it would have; returns whether any was accepted whole (news that may turn drafting on: a
        batch switched off searches again; a first token matching, common in chat, would send it into a search
        every few steps for nothing)."""
        accepted_whole = False
        for seq in seqs:
            state = seq.stash.get(ACCEPTANCE, None)
            if state is None or state.shadow is None:
                continue
            outcome = state.shadow.outcome(seq.token_ids)
            if outcome is not None:
                state.record(*outcome, state.shadow.link)
                state.shadow = None
                accepted_whole = accepted_whole or outcome[1] == outcome[0]
        return accepted_whole

    def _ask_shadows(self, ctx: StepContext, seqs: list[Sequence], ks: list[int], limits: list[int],
                     shadowing: dict[int, tuple[str, ...]]) -> None:
        """Shadow drafts (`adaptive.Shadow`): a sequence of a chain of lookups alone (`ngram`, `suffix`: no draft
        model, no hidden states) that drafts nothing this step (a batch switched off, a sequence whose acceptance
        fell) asks its lookups for `SHADOW_TOKENS` tokens every `SHADOW_GAP` tokens it generates; once the target's
        next tokens decide such a draft, it counts in the sequence's acceptance as a verified one would
        (`_resolve_shadows`), without a row verified. So a text that turns copyable turns speculation back on by
        what it measures, not after a probe's interval (16 steps, doubling to `MAX_PROBE_INTERVAL` after probes
        that found nothing), and the chain needs no probes (`Acceptance.shadowed`). Not for a chain with a draft
        model behind its lookups: its rate is the model's as much as the lookups', which shadows cannot measure
        (there they made a batch of 8 copy prompts draft more and run 0.97-0.98x, float32 target, 2-core Zen 3).
        Not for a seeded sampled sequence (its choices come from the curves and its own draws alone), nor where
        `_lengths` found that no acceptance could pay. Shadow drafts do not move the chain's prior (what
        verifications measured)."""
        for i, (seq, k, limit) in enumerate(zip(seqs, ks, limits)):
            state = seq.stash.get(ACCEPTANCE, None)
            lookups = shadowing.get(i)
            if (state is None or lookups is None or k > 0 or limit <= 0 or state.shadow is not None
                    or len(seq.token_ids) - state.shadow_at < SHADOW_GAP
                    or (not seq.greedy and seq.request.params.seed is not None)):
                continue
            state.shadow_at = len(seq.token_ids)
            options = seq.request.plan.strategy_options
            params = [options._proposer_params, *options._fallback_params]
            for link, name in enumerate(lookups):
                drafts, _ = self._proposer(name).propose(ctx, [seq], [min(SHADOW_TOKENS, limit)], [params[link]])
                if drafts[0]:
                    state.shadow = Shadow(len(seq.token_ids), list(drafts[0][:SHADOW_TOKENS]), name)
                    break
            state.record_ask(state.shadow is not None)  # the whole chain was asked: whether it drafted; and what
            state.shadowed = True  # it drafts is measured by its shadows from now on, not by probes

    @staticmethod
    def _alone_or_probing(seq: Sequence) -> bool:
        """Whether `seq`'s length this step is not the batch's choice: a seeded sampled sequence's, or a probe's."""
        state = seq.stash.get(ACCEPTANCE, None)
        return (not seq.greedy and seq.request.params.seed is not None) or (state is not None and state.probing)

    @staticmethod
    def _answers_first(seq: Sequence) -> bool:
        """Whether `seq`'s draft this step waits for its chain's lookups: not a seeded sampled sequence's (chosen
        alone from the curves), not a tree's (its shape follows its length). A probe's does (its length stays the
        probe's): a probe answered by a lookup that is always wrong measured that lookup, never the draft model."""
        state = seq.stash.get(ACCEPTANCE, None)
        return (state is not None and seq.request.plan.strategy_options.tree is None
                and (seq.greedy or seq.request.params.seed is None))

    def _answer_first(self, ctx: StepContext, group: _AnswerFirst, seqs: list[Sequence], limits: list[int]
                      ) -> dict[str, list[tuple[Sequence, int, Any]]]:
        """Ask `group`'s leading lookups for up to each sequence's limit, then choose each length by the rate of
        the link that answered (`adaptive.lengths_by_answer`): keep a lookup's draft, cut to its length, where it
        promises as much as the draft model; return the sequences the model link drafts, with their lengths."""
        if not seqs:
            return {}
        chain = group.chain
        pending: dict[str, list[tuple[Sequence, int, Any]]] = {
            chain[0]: [(seq, limit, seq.request.plan.strategy_options._proposer_params)
                       for seq, limit in zip(seqs, limits)]}
        while pending and next(iter(pending)) != group.model_link:  # one chain: one link at a time
            pending = self._draft(ctx, pending, {})
        states = [seq.stash[ACCEPTANCE] for seq in seqs]
        answers = [(state.link_rate(seq.stash[_BY]), len(seq.draft_token_ids)) if seq.draft_token_ids else None
                   for seq, state in zip(seqs, states)]
        model_rates = [state.link_rate(group.model_link) if group.model_link else 0.0 for state in states]
        lengths, keep = lengths_by_answer(answers, model_rates, limits, ctx.num_running - len(seqs), group.target,
                                          group.draft)
        for n, (state, answer) in enumerate(zip(states, answers)):
            if state.probing:  # a probe drafts its own length, from the link the routing chose
                lengths[n] = min(PROBE_TOKENS, answer[1]) if keep[n] and answer is not None else \
                    min(PROBE_TOKENS, limits[n]) if group.model_link is not None else 0
        to_model: list[tuple[Sequence, int, Any]] = []
        for seq, k, kept in zip(seqs, lengths, keep):
            if kept:
                seq.draft_token_ids = seq.draft_token_ids[:k]
                continue
            seq.draft_token_ids = []
            seq.stash.pop(_BY, None)
            if k > 0 and group.model_link is not None:
                options = seq.request.plan.strategy_options
                link = chain.index(group.model_link)
                to_model.append((seq, k, options._proposer_params if link == 0 else options._fallback_params[link - 1]))
        return {group.model_link: to_model} if to_model and group.model_link is not None else {}

    @staticmethod
    def _tree_shapes(ctx: StepContext, seqs: list[Sequence], ks: list[int], target: StepCost,
                     calibrated: Calibration, drafted: int) -> dict[int, TreeShape | None]:
        """Each tree-asking sequence's tree cut to the rows nearly free in this step (`adaptive.tree_rows`): the
        batch's share by the calibrated cost; a seeded sampled sequence's alone by the curve (no timings)."""
        trees = [(seq, k) for seq, k in zip(seqs, ks) if k > 0 and seq.request.plan.strategy_options.tree is not None]
        if not trees:
            return {}
        shapes: dict[int, TreeShape | None] = {}
        shared = [(seq, k) for seq, k in trees if seq.greedy or seq.request.params.seed is None]
        if shared:
            most = sum(worst_tree_rows(seq.request.plan.strategy_options.tree, k) for seq, k in shared)
            share = tree_rows(calibrated, ctx.num_running + drafted, most) // len(shared)
            shapes.update({seq.seq_id: tree_shape(seq.request.plan.strategy_options.tree, k, share)
                           for seq, k in shared})
        for seq, k in trees:
            if seq.seq_id not in shapes:
                shape = seq.request.plan.strategy_options.tree
                shapes[seq.seq_id] = tree_shape(shape, k, tree_rows(target, 1 + k, worst_tree_rows(shape, k)))
        return shapes

    def _costs(self, options: SpeculativeParams) -> tuple[StepCost, tuple[StepCost | None, ...]]:
        """The target's step cost for `adaptive: cost` (measured or the default), and each link's draft-model
        cost (None: a lookup), in one unit: measured seconds, or the default curve's."""
        target = None
        if options.cost_model == "measured" and self.info is not None and self.info.step_cost is not None:
            target = self.info.step_cost(None)  # None while the pool has no blocks to measure with: the default
        return target or StepCost.default(), tuple(p.draft_cost(target is not None) for p in self._chain(options))

    def _chain(self, options: SpeculativeParams) -> list[Proposer]:
        return [self._proposer(name) for name in options.chain]

    def _draft(self, ctx: StepContext, groups: dict[str, list[tuple[Sequence, int, Any]]],
               shapes: dict[int, TreeShape | None]) -> dict[str, list[tuple[Sequence, int, Any]]]:
        """Run each proposer (a link of its sequences' chains) on its sequences, timing it for the cost model;
        return the undrafted ones grouped by their next link."""
        fallbacks: dict[str, list[tuple[Sequence, int, Any]]] = {}
        for name, items in groups.items():
            started = time.perf_counter()
            drafts, qs, trees = propose_with_trees(self._proposer(name), ctx, items, shapes)
            self._record_host_cost(name, items, time.perf_counter() - started,
                                   sum(1 for d, t in zip(drafts, trees) if d or t is not None))
            for (seq, k, _), draft, q, tree in zip(items, drafts, qs, trees):
                seq.draft_token_ids = list(draft[:k])
                seq.stash[_Q] = q
                seq.stash[_BY] = name
                if tree is not None:
                    seq.draft_branches = [list(b) for b in tree.branches]
                    seq.stash[_TREE] = tree
                options = seq.request.plan.strategy_options
                link = options.chain.index(name)  # the next link is fallback number `link`
                if not seq.draft_token_ids and not seq.draft_branches and link < len(options.fallbacks):
                    fallbacks.setdefault(options.fallbacks[link], []).append(
                        (seq, k, options._fallback_params[link]))
        return fallbacks

    def _record_host_cost(self, name: str, items: list[tuple[Sequence, int, Any]], seconds: float,
                          drafted: int) -> None:
        """Learn what a call of proposer `name` costs: per sequence asked, or against its draft model's curve (only
        where a request adapts k by cost: a fixed k never measures the step costs this reads)."""
        costed = [seq for seq, _, _ in items if seq.request.plan.strategy_options.adaptation == "cost"]
        if not costed:
            return
        options = costed[0].request.plan.strategy_options
        curve = self._costs(options)[1][options.chain.index(name)]
        fed = self._proposer(name).forward_rows()  # a catch-up's tokens are the forward's rows too
        forwards = fed if fed else draft_forwards([k for _, k, _ in items])
        predicted = None if curve is None else sum(curve(rows) for rows in forwards)
        self.host_costs.setdefault(name, ProposerCost()).record(seconds, len(items), drafted, predicted)

    def _calibrate(self, ctx: StepContext) -> None:
        """Once per step: what this step's verification took, against each target curve in use."""
        timing = getattr(ctx, "step_timing", None)  # a context that does not time steps has none
        if timing is None or timing is self._timed:
            return
        self._timed = timing
        if timing.decode_only:
            for calibrated in self.calibrations.values():
                calibrated.record(timing.rows, timing.seconds)

    def select(self, ctx: StepContext, seqs: list[Sequence], logits: torch.Tensor) -> None:
        self._calibrate(ctx)
        before = sum(len(seq.token_ids) for seq in seqs)
        self._select(ctx, seqs, logits)
        self._measure(ctx, sum(len(seq.token_ids) for seq in seqs) - before + ctx.num_running - len(seqs))

    def _measure(self, ctx: StepContext, tokens: int) -> None:
        """Once per step: its tokens per second (proposing included), as a step the chooser drafted in or a plain
        one (`RealizedGain`)."""
        timing = getattr(ctx, "step_timing", None)
        measuring, self._measuring = self._measuring, None
        seconds = 0.0 if timing is None else timing.seconds + self._propose_seconds
        if measuring is None or timing is None or not timing.decode_only or seconds <= 0 or tokens < 1:
            return
        realized, drafted = measuring
        if drafted:
            realized.record(tokens / seconds)
        else:
            realized.record_plain(tokens / seconds)

    def _select(self, ctx: StepContext, seqs: list[Sequence], logits: torch.Tensor) -> None:
        # the rows' argmaxes, where a greedy draft is verified (a batch that drafted nothing needs none)
        argmax = logits.argmax(dim=-1).tolist() if any(s.greedy and s.draft_token_ids for s in seqs) else []
        starts, offset = [], 0
        for seq in seqs:
            starts.append(offset)
            offset += seq.num_scored_positions if seq.draft_branches else len(seq.draft_token_ids) + 1
        # the sequences without a draft (a switched-off batch) take plain decoding's token, all in one call as the
        # `sample` strategy does: per sequence, a sampled row's draw cost a batch of 32 sampled sequences 7% of a step
        undrafted = [i for i, seq in enumerate(seqs) if not seq.draft_branches and not seq.draft_token_ids]
        plain: dict[int, int] = {}
        if undrafted:
            # nothing drafted (an off-switched batch's every step): the rows are the sequences' in order, read in
            # place; gathering them copied the whole [batch, vocab] block, ~0.3 ms a step of 32 on a 2-core CPU
            rows = logits if len(undrafted) == len(seqs) == logits.shape[0] else \
                logits[torch.tensor([starts[i] for i in undrafted], device=logits.device)]
            plain = dict(zip(undrafted, select_tokens(rows, [seqs[i].greedy for i in undrafted],
                                                      [seqs[i].generator for i in undrafted]).tolist()))
        for i, seq in enumerate(seqs):
            offset = starts[i]
            if seq.request.params.n > 1 and seq.num_generated == 0 and len(seq.request.sequences) == 1:
                self._fork(ctx, seq, logits[offset])
            if seq.draft_branches:
                self._select_tree(ctx, seq, logits[offset : offset + seq.num_scored_positions])
                continue
            draft = list(seq.draft_token_ids)
            if not draft:
                valid = len(seq.token_ids)
                states = ctx.hidden_states(seq)
                ctx.append_token(seq, plain[i])
                self._after_verification(seq, states, valid)
                continue
            if seq.greedy:
                best = argmax[offset : offset + len(draft) + 1]
                accepted = 0
                while accepted < len(draft) and draft[accepted] == best[accepted]:
                    accepted += 1
                token = best[accepted]
            else:
                rows = logits[offset : offset + len(draft) + 1]
                accepted, token = accept_sampled(draft, rows, seq.stash.get(_Q, None), seq.generator)
            self._adapt(seq, len(draft), accepted)
            valid = len(seq.token_ids) + accepted
            drafted_by = seq.stash.get(_BY, None)
            states = ctx.hidden_states(seq)
            ctx.accept_draft(seq, accepted, token, drafted_by)
            if draft and seq.request.params.trace is not None:
                ctx.note(seq, drafts={"proposer": drafted_by})
            self._after_verification(seq, states, valid)

    def _fork(self, ctx: StepContext, seq: Sequence, row: torch.Tensor) -> None:
        """Parallel sampling (`n > 1`), as the `sample` strategy forks: at its first token the request's sequence is
        forked into `n` that share the prompt's KV blocks (copy-on-write); sequence `k` is seeded `seed + k` when the
        request has a seed. Each child takes its first token from the parent's first row (what the parent's own first
        token is chosen from, before any draft) and from then on drafts and verifies on its own: its proposers learn
        the prompt as the parent's do (the hidden states of its positions, for those that read them), a draft model
        catches up on the prompt at the child's first draft, and its adaptive state starts as a copy of the parent's.
        """
        params = seq.request.params
        valid = len(seq.token_ids)
        states = ctx.hidden_states(seq)
        children = [ctx.fork(seq, seed=None if params.seed is None else params.seed + k) for k in range(1, params.n)]
        tokens = select_tokens(row[None].expand(len(children), -1), [c.greedy for c in children],
                               [c.generator for c in children]).tolist()
        for child, token in zip(children, tokens):
            if ACCEPTANCE in seq.stash:  # the stash's copy is shallow: each sequence adapts on its own
                child.stash[ACCEPTANCE] = copy.deepcopy(seq.stash[ACCEPTANCE])
            ctx.append_token(child, token)
            self._after_verification(child, states, valid)

    def _after_verification(self, seq: Sequence, states: Any, valid: int) -> None:
        """Every proposer in use learns `seq`'s verified step: the hidden states of its computed positions (those
        that read them) and its first `valid` tokens kept (the rest rolled back)."""
        for proposer in self.proposers.values():
            if states is not None and proposer.hidden_states:
                proposer.observe(seq, states, valid)
            proposer.rollback(seq, valid)

    def _select_tree(self, ctx: StepContext, seq: Sequence, rows: torch.Tensor) -> None:
        """Verify `seq`'s draft tree (`decodekit_plugins.draft_trees.accept_tree`), keep the accepted branch."""
        tree = seq.stash[_TREE]
        branch, accepted, token = accept_tree(tree, rows, seq.greedy, seq.generator)
        self._adapt(seq, max(len(b) for b in tree.branches), accepted)
        valid = len(seq.token_ids) + accepted
        drafted_by = seq.stash.get(_BY, None)
        ctx.accept_branch(seq, branch, accepted, token, drafted_by)
        if seq.request.params.trace is not None:
            ctx.note(seq, drafts={"proposer": drafted_by, "tree_branches": len(tree.branches), "branch": branch,
                                  "tree_nodes": count_nodes(tree.branches)})  # what the metrics count as drafted
        for proposer in self.proposers.values():
            proposer.rollback(seq, valid)

    def _chain_prior(self, options: SpeculativeParams) -> Acceptance:
        """The running acceptance and hit rate of a chain's sequences: where its new (unseeded) sequences start."""
        return self.chain_priors.setdefault(options.chain, Acceptance(decay=CHAIN_DECAY))

    def _adapt(self, seq: Sequence, proposed: int, accepted: int) -> None:
        options = seq.request.plan.strategy_options
        mode = options.adaptation
        if proposed and mode == "heuristic":
            k = seq.stash[_K]
            seq.stash[_K] = min(k + 2, options.max_speculative_tokens) if accepted == proposed else max(1, k - 1)
        elif mode == "cost" and ACCEPTANCE in seq.stash:
            link = seq.stash.get(_BY, None)
            seq.stash[ACCEPTANCE].record(proposed, accepted, link)
            self._chain_prior(options).record(proposed, accepted, link)

    def on_request_finished(self, request: Request) -> None:
        for proposer in self.proposers.values():
            for seq in request.sequences:
                if not seq.stash.get(_RELEASED, False):
                    proposer.release(seq)
