"""The conformance kit for logits-processor plugins: hypothesis strategies for their inputs, and the checks every
processor must pass to be safe in decodekit's batched, speculative, seeded sampler step.

One call runs everything on generated inputs (it raises `ConformanceError`, an `AssertionError`, with the failing
example):

    >>> from hypothesis import strategies as st
    >>> from decodekit.testing import check_processor
    >>> check_processor(MyProcessor(), st.builds(MyProcessor.Params, strength=st.floats(0, 2)))

The checks, each also callable on one `Case`:

- `check_shape_and_dtype`: the output has the input's shape, dtype and device;
- `check_input_not_mutated`: the input logits are unchanged (unless the processor declares `in_place`);
- `check_masks_kept`: a -inf logit stays -inf, so no processor re-inflates a token an earlier one removed;
- `check_no_nan`: no NaN appears;
- `check_batched_equals_row_by_row`: processing rows together equals processing them one at a time (in order,
  sharing state and generators like the engine does), so a request's result does not depend on its neighbours;
- `check_argmax_invariant`: a processor declaring `argmax_invariant` never changes the argmax (greedy rows skip it);
- `check_deterministic`: the same seeds give the same output.

Inputs cover what the engine produces: ties, -inf entries (at least one finite logit per row), histories with
repeats, per-row options and `SamplingParams`, seeded and unseeded rows, and speculative rows (a sequence
scoring positions 0..k in consecutive rows, row `j` with `j` drafted tokens at the end of its history and
`draft_offsets == j`). Stateful processors get states built by `init_state`/`update_state` over each history,
shared by the rows of one sequence. This module needs hypothesis, not pytest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from decodekit.api.params import SamplingParams
from decodekit.api.processors import BatchView, LogitsProcessor

__all__ = [
    "ALL_CHECKS",
    "DEFAULT_VOCAB",
    "Case",
    "ConformanceError",
    "batch_views",
    "cases",
    "check_argmax_invariant",
    "check_batched_equals_row_by_row",
    "check_deterministic",
    "check_input_not_mutated",
    "check_masks_kept",
    "check_no_nan",
    "check_processor",
    "check_shape_and_dtype",
    "histories",
    "logits_tensors",
]

StrategyOrFactory = st.SearchStrategy[Any] | Callable[[int], st.SearchStrategy[Any]]


DEFAULT_VOCAB: st.SearchStrategy[int] = st.integers(2, 48)
"""Vocabulary sizes the kit draws by default: small, so masks, ties and boundaries are common."""
_ROWS: st.SearchStrategy[int] = st.integers(1, 6)
_SEQUENCES: st.SearchStrategy[int] = st.integers(1, 4)
_PARAMS: st.SearchStrategy[SamplingParams] = st.just(SamplingParams())


class ConformanceError(AssertionError):
    """A processor broke one of the contract's rules; the message names the rule and the processor."""


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


def _validated(processor: LogitsProcessor, options: Any) -> Any:
    if isinstance(options, dict) and processor.Params is not None:
        options = processor.Params.model_validate(options)
    check = getattr(processor, "check_options", None)
    if check is not None and isinstance(options, BaseModel):
        check(options)
    return options


@st.composite
def cases(draw: st.DrawFn, processor: LogitsProcessor, options: StrategyOrFactory,
          vocab: int | st.SearchStrategy[int] = DEFAULT_VOCAB, sequences: st.SearchStrategy[int] = _SEQUENCES,
          params: StrategyOrFactory = _PARAMS, max_drafts: int = 3,
          dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Case:
    """Generated `Case`s for `processor`.

    Args:
        processor: the processor under test (set up already, if it needs `setup`).
        options: strategy of its parameters (a `Params` instance or a dict), or a function of the vocabulary
            size returning one (for token ids).
        vocab: vocabulary size(s).
        sequences: how many sequences (requests) share the batch.
        params: strategy of `SamplingParams` (or a function of the vocabulary size returning one).
        max_drafts: most drafted tokens per sequence (0: no speculative rows).
    """
    v = vocab if isinstance(vocab, int) else draw(vocab)
    rows: dict[str, list[Any]] = {k: [] for k in ("histories", "prompt_lens", "params", "options", "sequences",
                                                  "draft_offsets")}
    seeds: list[int | None] = []
    for seq in range(draw(sequences)):
        prompt = draw(histories(v, min_size=1))
        generated = draw(histories(v))
        drafts = draw(histories(v, max_size=max_drafts)) if max_drafts else []
        row_options = _validated(processor, draw(_resolve(options, v)))
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


def _fail(processor: LogitsProcessor, rule: str, detail: str = "") -> ConformanceError:
    name = getattr(processor, "name", type(processor).__name__)
    return ConformanceError(f"processor {name!r} {rule}" + (f": {detail}" if detail else ""))


def _run(processor: LogitsProcessor, case: Case, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    logits = case.logits.clone() if processor.in_place else case.logits
    return processor(logits, case.view(processor))


def check_shape_and_dtype(processor: LogitsProcessor, case: Case) -> None:
    """The output has the input's shape, dtype and device."""
    out = _run(processor, case)
    if not isinstance(out, torch.Tensor):
        raise _fail(processor, "must return a tensor", f"got {type(out).__name__}")
    for what, got, want in (("shape", out.shape, case.logits.shape), ("dtype", out.dtype, case.logits.dtype),
                            ("device", out.device, case.logits.device)):
        if got != want:
            raise _fail(processor, f"changed the {what}", f"{want} -> {got}")


def check_input_not_mutated(processor: LogitsProcessor, case: Case) -> None:
    """The input logits (unless the processor declares `in_place`) and the histories are unchanged after the call."""
    before = case.logits.clone()
    view = case.view(processor)
    processor(case.logits.clone() if processor.in_place else case.logits, view)
    if not torch.equal(before, case.logits):
        raise _fail(processor, "modified its input in place without declaring `in_place = True`")
    if view.histories != case.histories:  # the engine hands processors its sequences' own token lists
        raise _fail(processor, "modified the token histories")


def check_masks_kept(processor: LogitsProcessor, case: Case) -> None:
    """Every -inf logit of the input is -inf in the output."""
    out = _run(processor, case)
    masked = case.logits == -float("inf")
    if not bool((out[masked] == -float("inf")).all()):
        raise _fail(processor, "re-inflated a masked (-inf) logit", f"rows {sorted(set(_rows(masked, out)))}")


def _rows(masked: torch.Tensor, out: torch.Tensor) -> list[int]:
    return masked.logical_and(out != -float("inf")).nonzero()[:, 0].tolist()


def check_no_nan(processor: LogitsProcessor, case: Case) -> None:
    """No NaN appears in the output (inputs never contain NaN and always have a finite logit per row)."""
    out = _run(processor, case)
    if bool(out.isnan().any()):
        raise _fail(processor, "produced NaN", f"rows {sorted(set(out.isnan().nonzero()[:, 0].tolist()))}")


def check_batched_equals_row_by_row(processor: LogitsProcessor, case: Case, rtol: float = 1e-5,
                                    atol: float = 1e-5) -> None:
    """Processing the rows together equals processing them one at a time, in order (every sequence seeded)."""
    case = case.seeded()
    batched = _run(processor, case)
    view = case.view(processor)  # one view: the rows of a sequence share its state and generator, as in the engine
    torch.manual_seed(0)
    single = torch.cat([processor(case.logits[r : r + 1], view.select([r])) for r in range(len(view))])
    same_mask = torch.equal(batched.isinf(), single.isinf())
    if not same_mask or not torch.allclose(batched, single, rtol=rtol, atol=atol, equal_nan=True):
        differ = (~torch.isclose(batched, single, rtol=rtol, atol=atol, equal_nan=True)).nonzero()[:, 0].tolist()
        raise _fail(processor, "gives a different result batched than row by row", f"rows {sorted(set(differ))}")


def check_argmax_invariant(processor: LogitsProcessor, case: Case) -> None:
    """When the processor declares `argmax_invariant`, the argmax of every row is unchanged."""
    if not processor.argmax_invariant:
        return
    out = _run(processor, case)
    before, after = case.logits.argmax(dim=-1), out.argmax(dim=-1)
    if not torch.equal(before, after):
        rows = (before != after).nonzero()[:, 0].tolist()
        raise _fail(processor, "declares argmax_invariant but changed the argmax", f"rows {rows}")


def check_deterministic(processor: LogitsProcessor, case: Case) -> None:
    """Two runs with the same seeds (per-row generators and the global RNG) give the same output."""
    first, second = _run(processor, case, seed=1), _run(processor, case, seed=1)
    if not torch.equal(first.nan_to_num(), second.nan_to_num()):
        raise _fail(processor, "is not deterministic for a fixed seed")


ALL_CHECKS: tuple[Callable[[LogitsProcessor, Case], None], ...] = (
    check_shape_and_dtype, check_input_not_mutated, check_masks_kept, check_no_nan, check_batched_equals_row_by_row,
    check_argmax_invariant, check_deterministic,
)
"""Every check, in the order `check_processor` runs them."""


def check_processor(processor: LogitsProcessor, options: StrategyOrFactory, *, max_examples: int = 50,
                    checks: Sequence[Callable[[LogitsProcessor, Case], None]] = ALL_CHECKS,
                    derandomize: bool = False, hypothesis_settings: settings | None = None,
                    **case_options: Any) -> None:
    """Run every check on `max_examples` generated cases; raise `ConformanceError` on the first failure (after
    hypothesis has shrunk the case to a small one).

    Args:
        processor: the processor (set up already, if it needs `setup`).
        options: strategy of its parameters, or a function of the vocabulary size returning one.
        max_examples: how many cases hypothesis generates.
        checks: which checks to run (default: all).
        derandomize: use a fixed hypothesis seed (reproducible CI runs).
        hypothesis_settings: settings to start from (e.g. `settings(phases=[Phase.generate])`, no shrinking).
        **case_options: passed to `cases` (`vocab`, `sequences`, `params`, `max_drafts`, `dtype`, `device`).
    """

    @settings(hypothesis_settings, max_examples=max_examples, deadline=None, database=None, derandomize=derandomize,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(case=cases(processor, options, **case_options))
    def run(case: Case) -> None:
        for check in checks:
            check(processor, case)

    run()
