"""Hypothesis strategies of a logits processor's inputs, for the processor kit (`processor_kit.check_processor`)
and for a plugin's own properties: `logits_tensors`, `histories`, and `cases` (a `Case` is one generated input;
`case.view(processor)` builds fresh `BatchView`s of it) or `batch_views`.

Inputs cover what the engine produces: ties, -inf entries (at least one finite logit per row), histories with
repeats, per-row options and `SamplingParams`, seeded and unseeded rows, and speculative rows (a sequence scoring
positions 0..k in consecutive rows, row `j` with `j` drafted tokens at the end of its history and
`draft_offsets == j`). Stateful processors get states built by `init_state`/`update_state` over each history,
shared by the rows of one sequence.

Options pass `check_options` as at planning; give `info=` (the `ComponentInfo` the processor was set up with) to run
its `check_options_with` too, as an engine does. This module needs hypothesis, not pytest, and nothing of the
engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from hypothesis import strategies as st
from pydantic import BaseModel

from decodekit.api.params import SamplingParams
from decodekit.api.processors import BatchView, LogitsProcessor

StrategyOrFactory = st.SearchStrategy[Any] | Callable[[int], st.SearchStrategy[Any]]
"""A strategy, or a function of the vocabulary size returning one (for parameters that are token ids)."""

DEFAULT_VOCAB: st.SearchStrategy[int] = st.integers(2, 48)
"""Vocabulary sizes the kit draws by default: small, so masks, ties and boundaries are common."""
_ROWS: st.SearchStrategy[int] = st.integers(1, 6)
_SEQUENCES: st.SearchStrategy[int] = st.integers(1, 4)
_PARAMS: st.SearchStrategy[SamplingParams] = st.just(SamplingParams())


@st.composite
def logits_tensors(draw: st.DrawFn, rows: int | st.SearchStrategy[int] = _ROWS,
                   vocab: int | st.SearchStrategy[int] = DEFAULT_VOCAB, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """`[rows, vocab]` logits: spread or peaked values, often on a coarse grid (ties), some -inf (never a whole row).

    The values come from a seeded torch generator whose seed and shape parameters hypothesis draws, so large
    vocabularies stay cheap to generate.
    """
    n = rows if isinstance(rows, int) else draw(rows)
    v = vocab if isinstance(vocab, int) else draw(vocab)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([0.1, 1.0, 3.0, 10.0]))
    out = torch.randn(n, v, generator=g, dtype=torch.float64) * scale + draw(st.sampled_from([0.0, -5.0, 20.0]))
    grid = draw(st.sampled_from([0.0, 0.25, 1.0, -1.0]))
    if grid < 0:  # every token tied
        out = out[:, :1].round().expand(n, v).clone()
    elif grid > 0:
        out = (out / grid).round() * grid
    masked = torch.rand(n, v, generator=g) < draw(st.sampled_from([0.0, 0.2, 0.8, 1.0]))
    keep = torch.randint(0, v, (n,), generator=g)
    masked[torch.arange(n), keep] = False  # at least one finite logit per row
    out = out.masked_fill(masked, -float("inf"))
    return out.to(dtype=dtype, device=device)


def histories(vocab: int, min_size: int = 0, max_size: int = 24) -> st.SearchStrategy[list[int]]:
    """Token-id lists below `vocab`, drawn from a small alphabet so that repeats and n-grams recur."""
    alphabet = min(vocab, 6)
    spread = st.integers(0, alphabet - 1).map(lambda t: t * (vocab // alphabet))
    return st.lists(spread, min_size=min_size, max_size=max_size)


@dataclass
class Case:
    """One generated input: logits and what is needed to build fresh batch views of them.

    Attributes:
        logits: `[rows, vocab]`.
        histories: each row's prompt plus generated ids (for speculative rows, plus the drafted ids).
        prompt_lens: each row's prompt length.
        params: each row's `SamplingParams`.
        options: each row's validated processor parameters.
        sequences: which sequence each row scores; rows of one sequence share state and generator.
        draft_offsets: how many drafted ids end each row's history.
        seeds: each sequence's generator seed (None: the global RNG), indexed by sequence.
        eos_token_ids: the end-of-sequence ids.
    """

    logits: torch.Tensor
    histories: list[list[int]]
    prompt_lens: list[int]
    params: list[SamplingParams]
    options: list[Any]
    sequences: list[int]
    draft_offsets: list[int]
    seeds: list[int | None]
    eos_token_ids: tuple[int, ...]

    def view(self, processor: LogitsProcessor) -> BatchView:
        """A fresh view: new generators from the seeds, new states (stateful processors), shared per sequence."""
        device = self.logits.device
        generators = [None if s is None else torch.Generator(device=device).manual_seed(s) for s in self.seeds]
        states: dict[int, Any] = {}
        for row, seq in enumerate(self.sequences):
            if processor.stateful and seq not in states:
                history, prompt = self.histories[row], self.prompt_lens[row]
                accepted = history[prompt : len(history) - self.draft_offsets[row]]
                state = processor.init_state(self.options[row], history[:prompt])
                states[seq] = processor.update_state(state, self.options[row], accepted) if accepted else state
        return BatchView(list(self.params), [list(h) for h in self.histories], list(self.prompt_lens),
                         self.eos_token_ids, device, options=list(self.options),
                         states=[states.get(s) for s in self.sequences], draft_offsets=list(self.draft_offsets),
                         generators=[generators[s] for s in self.sequences])

    def seeded(self) -> Case:
        """The same case with every sequence seeded (unseeded rows share the global RNG, so their draws depend
        on what else is in the batch by design)."""
        return replace(self, seeds=[1000 + i if s is None else s for i, s in enumerate(self.seeds)])


def _resolve(strategy: StrategyOrFactory, vocab: int) -> st.SearchStrategy[Any]:
    return strategy if isinstance(strategy, st.SearchStrategy) else strategy(vocab)


def _validated(processor: LogitsProcessor, options: Any, info: Any = None) -> Any:
    """Options as a request's plan holds them: validated against `Params`, passed through `check_options` and,
    when the kit was given the engine's `info`, `check_options_with` (the lifecycle `Components.check_options`
    runs)."""
    if isinstance(options, dict) and processor.Params is not None:
        options = processor.Params.model_validate(options)
    if isinstance(options, BaseModel):
        check = getattr(processor, "check_options", None)
        if check is not None:
            check(options)
        with_engine = getattr(processor, "check_options_with", None)
        if info is not None and with_engine is not None:
            with_engine(options, info)
    return options


@st.composite
def cases(draw: st.DrawFn, processor: LogitsProcessor, options: StrategyOrFactory,
          vocab: int | st.SearchStrategy[int] = DEFAULT_VOCAB, sequences: st.SearchStrategy[int] = _SEQUENCES,
          params: StrategyOrFactory = _PARAMS, max_drafts: int = 3,
          dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", info: Any = None) -> Case:
    """Generated `Case`s for `processor`.

    Args:
        processor: the processor under test (set up already, if it needs `setup`).
        options: strategy of its parameters (a `Params` instance or a dict), or a function of the vocabulary
            size returning one (for token ids).
        vocab: vocabulary size(s).
        sequences: how many sequences (requests) share the batch.
        params: strategy of `SamplingParams` (or a function of the vocabulary size returning one).
        max_drafts: most drafted tokens per sequence (0: no speculative rows).
        info: the `ComponentInfo` the processor was set up with: each drawn option then also passes its
            `check_options_with`, as in an engine (None: `check_options` only, as at a recipe check).
    """
    v = vocab if isinstance(vocab, int) else draw(vocab)
    rows: dict[str, list[Any]] = {k: [] for k in ("histories", "prompt_lens", "params", "options", "sequences",
                                                  "draft_offsets")}
    seeds: list[int | None] = []
    for seq in range(draw(sequences)):
        prompt = draw(histories(v, min_size=1))
        generated = draw(histories(v))
        drafts = draw(histories(v, max_size=max_drafts)) if max_drafts else []
        row_options = _validated(processor, draw(_resolve(options, v)), info)
        row_params = draw(_resolve(params, v))
        seeds.append(draw(st.one_of(st.none(), st.integers(0, 2**31 - 1))))
        for j in range(len(drafts) + 1):
            rows["histories"].append(prompt + generated + drafts[:j])
            rows["prompt_lens"].append(len(prompt))
            rows["params"].append(row_params)
            rows["options"].append(row_options)
            rows["sequences"].append(seq)
            rows["draft_offsets"].append(j)
    logits = draw(logits_tensors(len(rows["histories"]), v, dtype, device))
    eos = (draw(st.integers(0, v - 1)),)
    return Case(logits, seeds=seeds, eos_token_ids=eos, **rows)


def batch_views(processor: LogitsProcessor, options: StrategyOrFactory,
                **kwargs: Any) -> st.SearchStrategy[tuple[torch.Tensor, BatchView]]:
    """`(logits, view)` pairs for `processor` (see `cases` for the arguments)."""
    return cases(processor, options, **kwargs).map(lambda case: (case.logits, case.view(processor)))

