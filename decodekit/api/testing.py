"""The conformance kit for logits-processor plugins: hypothesis strategies for their inputs, and the checks every
processor must pass to be safe in decodekit's batched, speculative, seeded sampler step.

One call runs everything on generated inputs (it raises `ConformanceError`, an `AssertionError`, with the failing
example):

    >>> from hypothesis import strategies as st
    >>> from decodekit.testing import check_processor
    >>> check_processor(MyProcessor(), st.builds(MyProcessor.Params, strength=st.floats(0, 2)))

The checks, each also callable on one `Case` (in the order `check_processor` runs them):

- `check_input_not_mutated`: the input logits are unchanged (unless the processor declares `in_place`), and so
  are the token histories;
- `check_shape_and_dtype`: the output has the input's shape, dtype and device, for float32 logits and for
  float64, bfloat16 and float16 ones too;
- `check_no_nan`: no NaN appears;
- `check_masks_kept`: a -inf logit stays -inf, so no processor re-inflates a token an earlier one removed;
- `check_keeps_a_finite_logit`: every row keeps a finite logit, unless the processor bans the row's remaining
  tokens whatever their values (a constraint; a truncation that keeps nothing is a bug);
- `check_state_not_changed`: a stateful processor leaves its per-sequence states unchanged in `__call__` (they
  change only in `update_state`);
- `check_batched_equals_row_by_row`: processing rows together equals processing them one at a time (in order,
  sharing state and generators like the engine does), so a request's result does not depend on its neighbours;
- `check_argmax_invariant`: a processor declaring `argmax_invariant` never changes the argmax (greedy rows skip it);
- `check_deterministic`: the same seeds give the same output;
- `check_uses_row_generators`: with every sequence seeded, the output does not depend on the global RNG (a seeded
  row draws from `batch.generators[row]`).

Every check hands the processor its own copy of the case's logits and fresh batch views, so a processor that
breaks one rule cannot hide it from another. Every failure is a `ConformanceError` naming the processor: a
processor that raises on a valid case included (the message names the exception and the case), and several
distinct failures found in one run (hypothesis reports them together; the message lists each).

Inputs cover what the engine produces: ties, -inf entries (at least one finite logit per row), histories with
repeats, per-row options and `SamplingParams`, seeded and unseeded rows, and speculative rows (a sequence
scoring positions 0..k in consecutive rows, row `j` with `j` drafted tokens at the end of its history and
`draft_offsets == j`). Stateful processors get states built by `init_state`/`update_state` over each history,
shared by the rows of one sequence. This module needs hypothesis, not pytest.

Options pass `check_options` as at planning; give `info=` (the `ComponentInfo` the processor was set up with) to run
its `check_options_with` too, as an engine does. The kits for the plugins that run inside the engine (stopping
criteria, proposers, strategies) need one, so they live with the front-ends in `decodekit.kits`;
`decodekit.testing` re-exports both.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky
from pydantic import BaseModel

from decodekit.api.params import SamplingParams
from decodekit.api.processors import BatchView, LogitsProcessor

if sys.version_info >= (3, 11):
    from builtins import ExceptionGroup as _ExceptionGroup
else:  # pragma: no cover - hypothesis depends on the backport there
    from exceptiongroup import ExceptionGroup as _ExceptionGroup

__all__ = [
    "ALL_CHECKS",
    "DEFAULT_VOCAB",
    "OTHER_DTYPES",
    "Case",
    "ConformanceError",
    "batch_views",
    "cases",
    "check_argmax_invariant",
    "check_batched_equals_row_by_row",
    "check_deterministic",
    "check_input_not_mutated",
    "check_keeps_a_finite_logit",
    "check_masks_kept",
    "check_no_nan",
    "check_processor",
    "check_shape_and_dtype",
    "check_state_not_changed",
    "check_uses_row_generators",
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


OTHER_DTYPES: tuple[torch.dtype, ...] = (torch.float64, torch.bfloat16, torch.float16)
"""The dtypes `check_shape_and_dtype` also converts each case's logits to (the output must keep the input's)."""


def _name(processor: LogitsProcessor) -> str:
    return str(getattr(processor, "name", type(processor).__name__))


def _fail(processor: LogitsProcessor, rule: str, detail: str = "") -> ConformanceError:
    return ConformanceError(f"processor {_name(processor)!r} {rule}" + (f": {detail}" if detail else ""))


def _describe(case: Case, logits: torch.Tensor | None = None) -> str:
    """A one-line summary of a case (the full one is in hypothesis' falsifying example)."""
    logits = case.logits if logits is None else logits
    rows, vocab = logits.shape
    seeded = sum(s is not None for s in case.seeds)
    text = (f"a case of {rows} row(s) x {vocab} tokens ({str(logits.dtype).removeprefix('torch.')}, "
            f"{logits.device}), {len(case.seeds)} sequence(s) ({seeded} seeded)")
    if any(case.draft_offsets):
        text += f", draft offsets {case.draft_offsets}"
    options = list(dict.fromkeys(repr(o) for o in case.options))
    shown = "; ".join(options)
    return text + f", options {shown[:200] + '...' if len(shown) > 200 else shown}"


def _view(processor: LogitsProcessor, case: Case) -> BatchView:
    """A fresh view of `case`; `init_state`/`update_state` raising becomes a `ConformanceError`."""
    try:
        return case.view(processor)
    except Exception as exc:
        raise _fail(processor, f"raised {exc!r} in init_state/update_state while building the states of "
                               f"{_describe(case)}") from exc


def _call(processor: LogitsProcessor, logits: torch.Tensor, view: BatchView, case: Case) -> torch.Tensor:
    """One processor call: an exception, or a result that is not a tensor of the input's shape on its device,
    becomes a `ConformanceError`."""
    shape, device = logits.shape, logits.device
    try:
        out = processor(logits, view)
    except Exception as exc:
        raise _fail(processor, f"raised {exc!r} on {_describe(case, logits)}") from exc
    if not isinstance(out, torch.Tensor):
        raise _fail(processor, "must return a tensor", f"got {type(out).__name__}")
    for what, got, want in (("shape", out.shape, shape), ("device", out.device, device)):
        if got != want:
            raise _fail(processor, f"changed the {what}", f"{want} -> {got}")
    return out


def _seed(seed: int, device: torch.device) -> None:
    """Seed the global RNGs a processor could draw from: torch's (the CPU's, and every device's for logits on an
    accelerator) and Python's."""
    if device.type == "cpu":
        torch.default_generator.manual_seed(seed)  # `torch.manual_seed` also queues a CUDA seeding: a stack trace
    else:
        torch.manual_seed(seed)
    random.seed(seed)


def _run(processor: LogitsProcessor, case: Case, seed: int = 0, logits: torch.Tensor | None = None) -> torch.Tensor:
    """Call the processor on a fresh view and its own copy of the logits (`case.logits` is never handed out)."""
    view = _view(processor, case)
    _seed(seed, case.logits.device)
    return _call(processor, case.logits.clone() if logits is None else logits, view, case)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (NaN equal to NaN, infinities to themselves), shape and dtype."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if not a.is_floating_point() and not a.is_complex():
        return torch.equal(a, b)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))


def _rows(mask: torch.Tensor) -> list[int]:
    """The rows where a `[rows, vocab]` mask has a True."""
    return sorted(set(mask.nonzero()[:, 0].tolist()))


def check_input_not_mutated(processor: LogitsProcessor, case: Case) -> None:
    """The input logits (unless the processor declares `in_place`) and the histories are unchanged after the call.

    The processor gets a copy of the case's logits, compared afterwards with a pristine second copy, so the case
    itself is never modified.
    """
    pristine, given = case.logits.clone(), case.logits.clone()
    view = _view(processor, case)
    _seed(0, case.logits.device)
    _call(processor, given, view, case)
    if not processor.in_place and not _same(given, pristine):
        rows = _rows(~(given == pristine) & ~(given.isnan() & pristine.isnan()))
        raise _fail(processor, "modified its input in place without declaring `in_place = True`",
                    f"rows {rows} (return a new tensor, e.g. `logits.masked_fill(...)` or `out = logits.clone()`)")
    if view.histories != case.histories:  # the engine hands processors its sequences' own token lists
        raise _fail(processor, "modified the token histories")


def check_shape_and_dtype(processor: LogitsProcessor, case: Case) -> None:
    """The output has the input's shape, dtype and device: for the case's logits and for the same logits in each
    of `OTHER_DTYPES`."""
    dtypes = [case.logits.dtype, *(d for d in OTHER_DTYPES if d != case.logits.dtype)]
    for dtype in dtypes:
        try:
            logits = case.logits.to(dtype=dtype, copy=True)
        except (RuntimeError, TypeError):  # a dtype the device lacks (float64 on MPS)
            continue
        out = _run(processor, case, logits=logits)
        if out.dtype != dtype:
            raise _fail(processor, "changed the dtype", f"{dtype} -> {out.dtype} (it must return logits of the dtype "
                                                        f"it is given)")


def check_no_nan(processor: LogitsProcessor, case: Case) -> None:
    """No NaN appears in the output (inputs never contain NaN and always have a finite logit per row)."""
    out = _run(processor, case)
    if bool(out.isnan().any()):
        raise _fail(processor, "produced NaN", f"rows {_rows(out.isnan())}")


def check_masks_kept(processor: LogitsProcessor, case: Case) -> None:
    """Every -inf logit of the input is -inf in the output."""
    out = _run(processor, case)
    masked = case.logits == -float("inf")
    lost = masked & (out != -float("inf"))
    if bool(lost.any()):
        nan = bool(out[lost].isnan().all())
        what = "made a masked (-inf) logit NaN" if nan else "re-inflated a masked (-inf) logit"
        raise _fail(processor, what, f"rows {_rows(lost)}")


def _no_choice(out: torch.Tensor) -> torch.Tensor:
    """`[rows]` bool: rows without a finite logit (rows with a NaN are `check_no_nan`'s)."""
    return ~out.isfinite().any(dim=-1) & ~out.isnan().any(dim=-1)


def check_keeps_a_finite_logit(processor: LogitsProcessor, case: Case) -> None:
    """Every output row keeps a finite logit (every input row has one), unless the processor bans the row's
    remaining tokens whatever their values.

    A constraint may leave nothing: an allow-list whose tokens an earlier processor removed, bad words covering a
    small vocabulary. Such a ban does not depend on the logits' values, so a row that comes out without a finite
    logit is run again with its finite logits replaced (all tied; one far ahead of the rest): if the processor
    keeps a token then, it emptied the row because of the values, which no truncation may do (keep the most
    likely token).
    """
    out = _run(processor, case)
    empty = _no_choice(out)
    if not bool(empty.any()):
        return
    rows = empty.nonzero()[:, 0]
    finite = case.logits[rows].isfinite()
    top = case.logits[rows].argmax(dim=-1)
    for variant in ("tied", "peaked"):
        values = torch.zeros_like(case.logits[rows]).masked_fill(~finite, -float("inf"))
        if variant == "peaked":
            values[torch.arange(len(rows)), top] = 20.0
        logits = case.logits.clone()
        logits[rows] = values
        kept = ~_no_choice(_run(processor, case, logits=logits)[rows])
        if bool(kept.any()):
            raise _fail(processor, "left a row with every logit -inf (nothing left to sample)",
                        f"rows {rows[kept].tolist()}; it keeps a token there when the logits are {variant}, so this "
                        f"is no constraint banning those tokens: a row must keep at least one finite logit (keep "
                        f"the most likely token)")


def _equal(a: Any, b: Any, seen: set[tuple[int, int]] | None = None) -> bool:
    """Structural equality of two states: tensors by value (`torch.equal`, NaN equal to NaN), lists, tuples,
    dicts, sets, dataclasses and plain objects (their `__dict__` and slots) element by element, anything else by
    `==`."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    seen = set() if seen is None else seen
    if (id(a), id(b)) in seen:  # a cycle: equal so far
        return True
    seen.add((id(a), id(b)))
    if isinstance(a, torch.Tensor):
        return _same(a, b)
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y, seen) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k], seen) for k in a)
    if isinstance(a, set | frozenset | str | bytes | int | bool | complex) or a is None:
        return bool(a == b)
    fields: dict[str, Any] = {}
    if dataclasses.is_dataclass(a):
        fields.update((f.name, None) for f in dataclasses.fields(a))
    fields.update(dict.fromkeys(getattr(a, "__dict__", {})))
    for cls in type(a).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        fields.update(dict.fromkeys([slots] if isinstance(slots, str) else slots))
    fields.pop("__dict__", None)
    fields.pop("__weakref__", None)
    if fields:
        missing = object()
        return all(_equal(getattr(a, f, missing), getattr(b, f, missing), seen) for f in fields)
    try:
        result = a == b
        return result if isinstance(result, bool) else bool(result.all())
    except Exception:
        return False


def _snapshot(processor: LogitsProcessor, state: Any) -> tuple[bool, Any]:
    """`(comparable, copy)`: a deep copy of a state (or `fork_state`'s), if it compares equal to the state."""
    for make in (copy.deepcopy, processor.fork_state):
        try:
            snapshot = make(state)
        except Exception:
            continue
        if snapshot is not state and _equal(snapshot, state):
            return True, snapshot
    return False, None  # an opaque state (a native matcher): nothing to compare it with


def check_state_not_changed(processor: LogitsProcessor, case: Case) -> None:
    """A stateful processor's `__call__` leaves the per-sequence states unchanged (compared structurally with deep
    copies taken before the call): states change only in `update_state`, on accepted tokens, so a rejected draft
    needs no undoing and a row can be run again."""
    if not processor.stateful:
        return
    view = _view(processor, case)
    states: dict[int, tuple[int, Any]] = {}
    for row, state in enumerate(view.states):
        states.setdefault(id(state), (case.sequences[row], state))
    snapshots = {key: _snapshot(processor, state) for key, (_, state) in states.items()}
    _seed(0, case.logits.device)
    _call(processor, case.logits.clone(), view, case)
    changed = sorted(seq for key, (seq, state) in states.items()
                     if snapshots[key][0] and not _equal(state, snapshots[key][1]))
    if changed:
        raise _fail(processor, "changed its state in `__call__`",
                    f"sequence(s) {changed}; state changes belong in `update_state` (on accepted tokens only)")


def check_batched_equals_row_by_row(processor: LogitsProcessor, case: Case, rtol: float = 1e-5,
                                    atol: float = 1e-5) -> None:
    """Processing the rows together equals processing them one at a time, in order (every sequence seeded)."""
    case = case.seeded()
    batched = _run(processor, case)
    view = _view(processor, case)  # one view: the rows of a sequence share its state and generator, as in the engine
    _seed(0, case.logits.device)
    logits = case.logits.clone()
    single = torch.cat([_call(processor, logits[r : r + 1].clone(), view.select([r]), case) for r in range(len(view))])
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
    if not _same(first, second):
        raise _fail(processor, "is not deterministic for a fixed seed")


def check_uses_row_generators(processor: LogitsProcessor, case: Case) -> None:
    """With every sequence seeded, the output is the same whatever the global RNG's seed: a seeded row draws from
    `batch.generators[row]`, so a seeded request gets the same tokens alone or batched."""
    case = case.seeded()
    first, second = _run(processor, case, seed=1), _run(processor, case, seed=2)
    if not _same(first, second):
        rows = _rows(~(first == second) & ~(first.isnan() & second.isnan()))
        raise _fail(processor, "draws from the global RNG for seeded rows",
                    f"rows {rows} changed with `torch.manual_seed` although every row was seeded; a seeded row must "
                    f"draw from `batch.generators[row]` (pass `generator=`)")


ALL_CHECKS: tuple[Callable[[LogitsProcessor, Case], None], ...] = (
    check_input_not_mutated, check_shape_and_dtype, check_no_nan, check_masks_kept, check_keeps_a_finite_logit,
    check_state_not_changed, check_batched_equals_row_by_row, check_argmax_invariant, check_deterministic,
    check_uses_row_generators,
)
"""Every check, in the order `check_processor` runs them."""


def _leaves(group: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups."""
    if isinstance(group, _ExceptionGroup):
        return [leaf for inner in group.exceptions for leaf in _leaves(inner)]
    return [group]


def _from_group(processor: LogitsProcessor, group: BaseException) -> ConformanceError:
    """One `ConformanceError` for an exception group hypothesis raised: each distinct failure listed (several bugs
    found in one run), or the one failure said to be flaky; the falsifying examples become its notes."""
    failures: dict[str, list[str]] = {}
    for leaf in _leaves(group):
        text = str(leaf) if isinstance(leaf, ConformanceError) else f"{type(leaf).__name__}: {leaf}"
        failures.setdefault(text, list(getattr(leaf, "__notes__", [])))
    if len(failures) == 1:
        message = next(iter(failures))
    else:
        message = "\n".join([f"processor {_name(processor)!r} failed in {len(failures)} distinct ways:",
                             *(f"- {text}" for text in failures)])
    notes = [f"[{i}] {note}" if len(failures) > 1 else note
             for i, leaf_notes in enumerate(failures.values(), 1) for note in leaf_notes]
    if isinstance(group, Flaky):
        message += ("\n(the failure did not always reproduce: does the processor depend on something besides its "
                    "inputs, states and seeds?)")
        notes.append(str(getattr(group, "message", group)))
    error = ConformanceError(message)
    if hasattr(error, "add_note"):
        for note in notes:
            error.add_note(note)
    return error


def check_processor(processor: LogitsProcessor, options: StrategyOrFactory, *, max_examples: int = 50,
                    checks: Sequence[Callable[[LogitsProcessor, Case], None]] = ALL_CHECKS,
                    derandomize: bool = False, hypothesis_settings: settings | None = None,
                    **case_options: Any) -> None:
    """Run every check on `max_examples` generated cases; raise `ConformanceError` on failure (after hypothesis has
    shrunk the case to a small one; its falsifying example is in the error's notes).

    When hypothesis finds several distinct failures, the one `ConformanceError` lists each of them; a processor
    that raises on a valid case fails with a `ConformanceError` naming the exception and the case.

    Args:
        processor: the processor (set up already, if it needs `setup`).
        options: strategy of its parameters, or a function of the vocabulary size returning one.
        max_examples: how many cases hypothesis generates.
        checks: which checks to run (default: all).
        derandomize: use a fixed hypothesis seed (reproducible CI runs).
        hypothesis_settings: settings to start from (e.g. `settings(phases=[Phase.generate])`, no shrinking);
            without them, every phase runs but `explain` (which re-runs a failing case many times to tell which of
            its parts matter: slow, and of little use on a tensor).
        **case_options: passed to `cases` (`vocab`, `sequences`, `params`, `max_drafts`, `dtype`, `device`,
            `info`: the `ComponentInfo` the processor was set up with, to run its `check_options_with` too).
    """
    base = (settings(phases=[phase for phase in Phase if phase is not Phase.explain]) if hypothesis_settings is None
            else hypothesis_settings)

    @settings(base, max_examples=max_examples, deadline=None, database=None, derandomize=derandomize,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(case=cases(processor, options, **case_options))
    def run(case: Case) -> None:
        for check in checks:
            check(processor, case)

    try:
        run()
    except _ExceptionGroup as group:
        raise _from_group(processor, group) from group
