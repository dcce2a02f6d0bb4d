"""The logits-processor contract: what a processor plugin implements, and the batch view it is given.

A processor transforms a `[rows, vocab]` float32 logits tensor for the rows whose requests use it. It is built
once per engine (not per token) and called directly in the hot loop, never through a hook. Its per-request
parameters are a pydantic model (`Params`), validated when a recipe loads or a request arrives; each row of the
batch view carries its own validated parameters in `options`.

Speculative verification scores several positions of one sequence in one step: such a sequence appears in
several rows, row `j` with the history up to its `j`-th drafted token (`draft_offsets[row] == j`). Stateful
processors keep per-sequence state that only ever advances on accepted tokens (`update_state`), so a rejected
draft never needs undoing; a processor that must look ahead (a grammar matcher) advances a copy over the
`draft_offsets[row]` trailing tokens of the history itself.
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, ClassVar

import torch
from pydantic import BaseModel

from decodekit.api.errors import ProcessorError
from decodekit.api.params import SamplingParams

NEG_INF = -float("inf")
"""The logit of a removed token: processors set it, and must keep it (see `LogitsProcessor`)."""


@dataclass
class BatchView:
    """The rows a processor sees: each row's parameters, token history and (stateful processors) state.

    Attributes:
        params: each row's request `SamplingParams`.
        histories: prompt plus generated ids of each row, up to the position being scored.
        prompt_lens: prompt length of each row.
        eos_token_ids: the model's end-of-sequence ids.
        device: where the logits live.
        options: each row's validated parameters for the processor being called (its `Params` instance).
        states: each row's state for the processor being called (stateful processors; shared by rows that score
            positions of the same sequence).
        draft_offsets: how many trailing tokens of each row's history are unverified drafts (0 outside
            speculative verification).
        generators: each row's seeded `torch.Generator` (None: the global RNG).
    """

    params: list[SamplingParams]
    histories: list[list[int]]
    prompt_lens: list[int]
    eos_token_ids: tuple[int, ...] = ()
    device: torch.device | str = "cpu"
    options: list[Any] = field(default_factory=list)
    states: list[Any] = field(default_factory=list)
    draft_offsets: list[int] = field(default_factory=list)
    generators: list[torch.Generator | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        rows = len(self.params)
        self.options = self.options or [None] * rows
        self.states = self.states or [None] * rows
        self.draft_offsets = self.draft_offsets or [0] * rows
        self.generators = self.generators or [None] * rows

    def __len__(self) -> int:
        return len(self.params)

    def token_ids(self, row: int) -> list[int]:
        """Prompt plus generated ids of a row, up to the position being scored."""
        return self.histories[row]

    def generated_ids(self, row: int) -> list[int]:
        """Generated ids of a row, up to the position being scored."""
        return self.histories[row][self.prompt_lens[row] :]

    @cached_property
    def num_generated(self) -> torch.Tensor:
        """`[rows]` long: tokens generated so far per row (the row's step)."""
        return torch.tensor([len(h) - p for h, p in zip(self.histories, self.prompt_lens)], device=self.device)

    def param_tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`[rows]` tensor of one `SamplingParams` field across the rows."""
        return torch.tensor([getattr(p, name) for p in self.params], dtype=dtype, device=self.device)

    def option_tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`[rows]` tensor of one field of the processor's own parameters across the rows."""
        return torch.tensor([getattr(o, name) for o in self.options], dtype=dtype, device=self.device)

    def history_tensor(self, generated_only: bool = False, pad: int = -1) -> torch.Tensor:
        """`[rows, longest]` long tensor of the histories (or generated ids), right-padded with `pad`."""
        rows = [self.generated_ids(r) if generated_only else self.histories[r] for r in range(len(self))]
        width = max((len(r) for r in rows), default=0)
        out = torch.full((len(rows), width), pad, dtype=torch.long)
        for i, ids in enumerate(rows):
            if ids:
                out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out.to(self.device)

    def token_counts(self, vocab_size: int, generated_only: bool = False) -> torch.Tensor:
        """`[rows, vocab_size]` float: how many times each token occurs in each row's history."""
        ids = self.history_tensor(generated_only, pad=vocab_size)
        counts = torch.zeros(len(self), vocab_size + 1, device=self.device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
        return counts[:, :vocab_size]

    def select(self, rows: Sequence[int]) -> BatchView:
        """The view restricted to some rows."""
        return replace(
            self,
            params=[self.params[r] for r in rows],
            histories=[self.histories[r] for r in rows],
            prompt_lens=[self.prompt_lens[r] for r in rows],
            options=[self.options[r] for r in rows],
            states=[self.states[r] for r in rows],
            draft_offsets=[self.draft_offsets[r] for r in rows],
            generators=[self.generators[r] for r in rows],
        )


class LogitsProcessor:
    """Base class of logits processors.

    Subclasses set `name` and `Params` (a pydantic model with `extra="forbid"`; None for no parameters) and
    implement `__call__`. Processors that map onto a `SamplingParams` field (temperature, top-k, ...) also
    implement `from_sampling_params`, so API users get them without naming them.

    Attributes:
        argmax_invariant: the processor never changes which token has the highest logit (so greedy rows skip it
            where every stage after it in their pipeline is argmax-invariant too).
        stateful: the processor keeps per-sequence state (`init_state`/`update_state`/`fork_state`).
        in_place: the processor may modify its input tensor (it says so; the engine then hands it a copy).
        example: parameters with which it visibly changes decoding (its `Params` as a mapping; None: its defaults
            do). The composition matrix (`tests/strategies/test_composition_matrix.py`) runs it with them under
            every strategy and proposer, so a processor a plugin installs is checked there without a table entry.

    Example:
        >>> class Ban(LogitsProcessor):
        ...     name = "ban"
        ...     class Params(BaseModel):
        ...         token_id: int
        ...     def __call__(self, logits, batch):
        ...         out = logits.clone()
        ...         for row, opt in enumerate(batch.options):
        ...             out[row, opt.token_id] = -float("inf")
        ...         return out
    """

    name: ClassVar[str] = "processor"
    Params: ClassVar[type[BaseModel] | None] = None
    argmax_invariant: ClassVar[bool] = False
    stateful: ClassVar[bool] = False
    in_place: ClassVar[bool] = False
    example: ClassVar[dict[str, Any] | None] = None

    @classmethod
    def from_sampling_params(cls, params: SamplingParams) -> BaseModel | None:
        """This processor's parameters implied by `SamplingParams` fields, or None when they do not ask for it."""
        return None

    def check_options(self, options: BaseModel | None) -> None:
        """Refuse parameters pydantic cannot: raise `ValueError` saying why (the key path is added).

        Static: runs wherever a request is planned, `decodekit recipe check` included, where no engine exists and
        `setup` was never called; checks that need the engine belong in `check_options_with`.
        """

    def check_options_with(self, options: BaseModel | None, info: Any) -> None:
        """Refuse parameters this engine cannot serve (a token id past `info.vocab_size`, strings without
        `info.tokenizer`): raise `ValueError` saying why (the key path is added).

        Runs only inside an engine, after `check_options` and after `setup(info)` (the same `info`, a
        `ComponentInfo`); never at `decodekit recipe check`. A good place for per-request work to do once rather
        than at the first token (tokenizing strings, compiling a grammar).
        """

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        """Return processed logits `[rows, vocab]`; must not modify `logits` in place (unless `in_place`)."""
        raise NotImplementedError

    def init_state(self, options: BaseModel | None, prompt_ids: list[int]) -> Any:
        """A new sequence's state (stateful processors)."""
        return None

    def update_state(self, state: Any, options: BaseModel | None, token_ids: list[int]) -> Any:
        """Advance a sequence's state over accepted tokens; return the new state (may be the same object)."""
        return state

    def fork_state(self, state: Any) -> Any:
        """An independent copy of a state, for a forked sequence (beam search, parallel sampling)."""
        return copy.deepcopy(state)


@dataclass(frozen=True)
class Stage:
    """One processor of a request's pipeline with that request's validated parameters."""

    processor: LogitsProcessor
    options: BaseModel | None = None


def init_states(stages: Sequence[Stage], prompt_ids: list[int]) -> list[Any]:
    """A new sequence's per-stage states (None for stateless stages); a failing `init_state` raises
    `ProcessorError` naming its processor."""
    return [_state_call(stage.processor, "init_state", stage.options, prompt_ids) if stage.processor.stateful
            else None for stage in stages]


def update_states(stages: Sequence[Stage], states: list[Any], token_ids: list[int]) -> list[Any]:
    """The per-stage states advanced over accepted tokens (a new list: on failure the old one is intact); a failing
    `update_state` (a grammar rejecting a token) raises `ProcessorError` naming its processor."""
    return [_state_call(stage.processor, "update_state", state, stage.options, token_ids)
            if stage.processor.stateful else state for stage, state in zip(stages, states)]


def fork_states(stages: Sequence[Stage], states: list[Any]) -> list[Any]:
    """Independent copies of the per-stage states, for a forked sequence; a failing `fork_state` raises
    `ProcessorError` naming its processor."""
    return [_state_call(stage.processor, "fork_state", state) if stage.processor.stateful else None
            for stage, state in zip(stages, states)]


def _state_call(proc: LogitsProcessor, method: str, *args: Any) -> Any:
    try:
        return getattr(proc, method)(*args)
    except ProcessorError:
        raise
    except Exception as exc:
        raise ProcessorError(f"processor {proc.name!r}: {method} raised {exc!r}") from exc


def apply_processors(
    logits: torch.Tensor,
    batch: BatchView,
    pipelines: list[tuple[Stage, ...]],
    greedy: list[bool] | None = None,
    states: list[list[Any]] | None = None,
    check_rows: bool = False,
    observe: Callable[[str, list[int], torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Run each row's pipeline in its own order, vectorized over the rows that share a pipeline shape.

    Every processor call is guarded: one that raises, or returns anything but a floating tensor of its input's
    shape on its input's device, raises `ProcessorError` naming it (a cheap check: no device sync).

    Args:
        logits: `[rows, vocab]` raw scores (not modified).
        batch: the rows' view (its `options`/`states` are filled per stage here).
        pipelines: each row's stages.
        greedy: rows decoded by argmax skip the argmax-invariant stages at the end of their pipeline (only there:
            an argmax-invariant stage followed by one that is not, `top_k(1)` then a logit bias, changes which
            token the later stage can promote).
        states: each row's per-stage states (stateful processors).
        check_rows: also check, after every stage, that each row still has a finite logit to choose (a
            reduction per stage; `check_processed_rows` does it once per call and uses this to find the culprit).
        observe: called after every stage with the processor's name, the rows it ran on and its output for them
            (the decoding trace; None costs nothing).
    """
    groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for row, pipeline in enumerate(pipelines):
        if pipeline:
            groups[tuple(id(stage.processor) for stage in pipeline)].append(row)
    for rows in groups.values():
        pipeline = pipelines[rows[0]]
        skippable = len(pipeline)  # greedy rows skip stages from here on: the trailing argmax-invariant run
        while skippable > 0 and pipeline[skippable - 1].processor.argmax_invariant:
            skippable -= 1
        for index, stage in enumerate(pipeline):
            proc = stage.processor
            active = [r for r in rows if not (index >= skippable and greedy is not None and greedy[r])]
            if not active:
                continue
            view = batch.select(active)
            view.options = [pipelines[r][index].options for r in active]
            view.states = [states[r][index] if states is not None else None for r in active]
            if len(active) == len(batch):
                logits = _call(proc, logits.clone() if proc.in_place else logits, view)
                out = logits
            else:
                idx = torch.tensor(active, device=logits.device)
                out = _call(proc, logits.index_select(0, idx), view)
                logits = logits.index_copy(0, idx, out)
            if observe is not None:
                observe(proc.name, active, out)
            if check_rows:
                bad = rows_without_choice(out)
                if bad:
                    raise ProcessorError(f"processor {proc.name!r} {_describe_row(out[bad[0]])}")
    return logits


def _call(proc: LogitsProcessor, logits: torch.Tensor, view: BatchView) -> torch.Tensor:
    """One guarded processor call: its exception, or an unusable result, becomes a `ProcessorError` naming it."""
    try:
        out = proc(logits, view)
    except Exception as exc:
        raise ProcessorError(f"processor {proc.name!r} raised {exc!r}") from exc
    if not isinstance(out, torch.Tensor):
        raise ProcessorError(f"processor {proc.name!r} returned {type(out).__name__}, not a tensor")
    if out.shape != logits.shape or out.device != logits.device or not out.is_floating_point():
        raise ProcessorError(f"processor {proc.name!r} returned a {out.dtype} tensor of shape {tuple(out.shape)} "
                             f"on {out.device} for {logits.dtype} logits of shape {tuple(logits.shape)} on "
                             f"{logits.device}")
    return out if out.dtype == logits.dtype else out.to(logits.dtype)


def rows_without_choice(logits: torch.Tensor) -> list[int]:
    """The rows of processed `logits` with nothing to choose: every logit -inf, or a NaN or +inf (which make
    softmax NaN). One reduction over the tensor and one small host read."""
    if logits.numel() == 0:
        return []
    # amax propagates NaN, so a single NaN marks its row too; the row maxima are read back as floats (one op and one
    # read where isfinite, all and nonzero were three ops more: ~0.1 ms of a batch-1 step, run on cold caches)
    return [row for row, top in enumerate(logits.amax(dim=-1).tolist()) if not math.isfinite(top)]


def _describe_row(row: torch.Tensor) -> str:
    if bool(torch.isnan(row).any()):
        return "returned NaN logits"
    if bool((row == float("inf")).any()):
        return "returned +inf logits (softmax of them is NaN)"
    return "left no token to choose: every logit is -inf"


def check_processed_rows(raw: torch.Tensor, processed: torch.Tensor, batch: BatchView,
                         pipelines: list[tuple[Stage, ...]], greedy: list[bool] | None = None,
                         states: list[list[Any]] | None = None) -> None:
    """Raise `ProcessorError` if a row of `processed` (the output of `apply_processors` on `raw`) has nothing to
    choose, naming the first stage of that row's pipeline that left it so (found by re-running the row's
    pipeline stage by stage, only when a row is bad).

    Rows that score a draft position (`draft_offsets[row] > 0`) are not checked: after a draft token a constraint
    rejects, a grammar allows only EOS there and another processor may mask EOS too, yet verification can never
    reach such a row (it stops at the rejected token). The cost: a draft row that is reached with nothing to choose
    is not caught here; the processors that mask everything do so at offset 0 as well, where it is.
    """
    bad = [row for row in rows_without_choice(processed) if batch.draft_offsets[row] == 0]
    if not bad:
        return
    row = bad[0]
    apply_processors(raw[row : row + 1], batch.select([row]), [pipelines[row]],  # raises naming the stage
                     None if greedy is None else [greedy[row]], None if states is None else [states[row]],
                     check_rows=True)
    if pipelines[row]:  # the re-run came out fine: a processor that depends on more than its inputs
        raise ProcessorError(f"processor {pipelines[row][-1].processor.name!r} (or one before it in the pipeline) "
                             f"{_describe_row(processed[row])}")
    raise ProcessorError(f"the model's logits have no finite value ({_describe_row(raw[row])})")
