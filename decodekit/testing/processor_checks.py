"""The rules every logits processor must keep to be safe in decodekit's batched, speculative, seeded sampler step:
one check per rule, each callable on one generated `Case` (`processor_inputs`), each raising a `ConformanceError`
naming the processor and what it broke. `processor_kit.check_processor` runs them all (`ALL_CHECKS`, in this order)
on many cases.

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
breaks one rule cannot hide it from another; a processor that raises on a valid case fails with a
`ConformanceError` naming the exception and the case.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
from collections.abc import Callable
from typing import Any

import torch

from decodekit.api.processors import BatchView, LogitsProcessor
from decodekit.testing.errors import processor_failure
from decodekit.testing.processor_inputs import Case

OTHER_DTYPES: tuple[torch.dtype, ...] = (torch.float64, torch.bfloat16, torch.float16)
"""The dtypes `check_shape_and_dtype` also converts each case's logits to (the output must keep the input's)."""


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
        raise processor_failure(processor, f"raised {exc!r} in init_state/update_state while building the "
                                           f"states of {_describe(case)}") from exc


def _call(processor: LogitsProcessor, logits: torch.Tensor, view: BatchView, case: Case) -> torch.Tensor:
    """One processor call: an exception, or a result that is not a tensor of the input's shape on its device,
    becomes a `ConformanceError`."""
    shape, device = logits.shape, logits.device
    try:
        out = processor(logits, view)
    except Exception as exc:
        raise processor_failure(processor, f"raised {exc!r} on {_describe(case, logits)}") from exc
    if not isinstance(out, torch.Tensor):
        raise processor_failure(processor, "must return a tensor", f"got {type(out).__name__}")
    for what, got, want in (("shape", out.shape, shape), ("device", out.device, device)):
        if got != want:
            raise processor_failure(processor, f"changed the {what}", f"{want} -> {got}")
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
        raise processor_failure(processor, "modified its input in place without declaring `in_place = True`",
                                f"rows {rows} (return a new tensor, e.g. `logits.masked_fill(...)` or "
                                f"`out = logits.clone()`)")
    if view.histories != case.histories:  # the engine hands processors its sequences' own token lists
        raise processor_failure(processor, "modified the token histories")


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
            raise processor_failure(processor, "changed the dtype",
                                    f"{dtype} -> {out.dtype} (it must return logits of the dtype it is given)")


def check_no_nan(processor: LogitsProcessor, case: Case) -> None:
    """No NaN appears in the output (inputs never contain NaN and always have a finite logit per row)."""
    out = _run(processor, case)
    if bool(out.isnan().any()):
        raise processor_failure(processor, "produced NaN", f"rows {_rows(out.isnan())}")


def check_masks_kept(processor: LogitsProcessor, case: Case) -> None:
    """Every -inf logit of the input is -inf in the output."""
    out = _run(processor, case)
    masked = case.logits == -float("inf")
    lost = masked & (out != -float("inf"))
    if bool(lost.any()):
        nan = bool(out[lost].isnan().all())
        what = "made a masked (-inf) logit NaN" if nan else "re-inflated a masked (-inf) logit"
        raise processor_failure(processor, what, f"rows {_rows(lost)}")


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
            raise processor_failure(processor, "left a row with every logit -inf (nothing left to sample)",
                                    f"rows {rows[kept].tolist()}; it keeps a token there when the logits are "
                                    f"{variant}, so this is no constraint banning those tokens: a row must keep at "
                                    f"least one finite logit (keep the most likely token)")


def keeps_some_finite_logit(processor: LogitsProcessor, case: Case) -> bool:
    """Whether some output row of `case` keeps a finite logit.

    `check_keeps_a_finite_logit` lets a constraint empty a row (the engine then fails that request alone), so it
    passes a processor that empties every row on every input, which leaves nothing to sample anywhere:
    `check_processor` runs this on each case it draws and fails a processor for which it is false on all of them.
    """
    return bool(_run(processor, case).isfinite().any())


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
        raise processor_failure(processor, "changed its state in `__call__`",
                                f"sequence(s) {changed}; state changes belong in `update_state` (on accepted tokens "
                                f"only)")


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
        raise processor_failure(processor, "gives a different result batched than row by row",
                                f"rows {sorted(set(differ))}")


def check_argmax_invariant(processor: LogitsProcessor, case: Case) -> None:
    """When the processor declares `argmax_invariant`, the argmax of every row is unchanged."""
    if not processor.argmax_invariant:
        return
    out = _run(processor, case)
    before, after = case.logits.argmax(dim=-1), out.argmax(dim=-1)
    if not torch.equal(before, after):
        rows = (before != after).nonzero()[:, 0].tolist()
        raise processor_failure(processor, "declares argmax_invariant but changed the argmax", f"rows {rows}")


def check_deterministic(processor: LogitsProcessor, case: Case) -> None:
    """Two runs with the same seeds (per-row generators and the global RNG) give the same output."""
    first, second = _run(processor, case, seed=1), _run(processor, case, seed=1)
    if not _same(first, second):
        raise processor_failure(processor, "is not deterministic for a fixed seed")


def check_uses_row_generators(processor: LogitsProcessor, case: Case) -> None:
    """With every sequence seeded, the output is the same whatever the global RNG's seed: a seeded row draws from
    `batch.generators[row]`, so a seeded request gets the same tokens alone or batched."""
    case = case.seeded()
    first, second = _run(processor, case, seed=1), _run(processor, case, seed=2)
    if not _same(first, second):
        rows = _rows(~(first == second) & ~(first.isnan() & second.isnan()))
        raise processor_failure(processor, "draws from the global RNG for seeded rows",
                                f"rows {rows} changed with `torch.manual_seed` although every row was seeded; a "
                                f"seeded row must draw from `batch.generators[row]` (pass `generator=`)")


ALL_CHECKS: tuple[Callable[[LogitsProcessor, Case], None], ...] = (
    check_input_not_mutated, check_shape_and_dtype, check_no_nan, check_masks_kept, check_keeps_a_finite_logit,
    check_state_not_changed, check_batched_equals_row_by_row, check_argmax_invariant, check_deterministic,
    check_uses_row_generators,
)
"""Every check, in the order `check_processor` runs them."""


