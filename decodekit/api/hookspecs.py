"""Every decodekit hook, in one place.

Two kinds of hooks:

Registration hooks run once, when the plugin manager's components are collected into a `Registry`
(`decodekit.core.registry`). They use the register-callback pattern: the hook receives a `register` function and
calls it once per thing it provides. Each is one pluggy hook call, so pluggy's order holds: plugins registered later
run first (third-party entry points before decodekit's default plugins, so a third-party model loader is tried
before the built-in ones), `tryfirst`/`trylast` move a plugin, and hook wrappers run around the others.

Lifecycle hooks run at request and step granularity, never per token per processor.

The step protocol. `Engine.step()` (`decodekit/core/engine.py`) runs these stages in order, each in its own module:

1. propose (`core/stages/propose.py`): strategies that speculate set `seq.draft_token_ids` on their
   decode-ready sequences; it comes before scheduling because each draft token is one more position to schedule
   and score in this step's forward;
2. schedule (`core/scheduler.py`): running requests first, oldest (or highest-priority) first, each with all its
   pending tokens (a decode, a verification, the rest of a chunked prefill) under the token budget and the free
   KV blocks, preempting the newest request if blocks run out; then waiting requests are admitted;
3. forward (`core/stages/forward.py`): one packed forward pass of the model over every scheduled token, logits
   only at the positions whose scores are needed (`1 + len(draft)` per sequence that completes);
4. process (`core/stages/process.py`): each request's processors, in its own order, over the rows that use
   them, on what the strategy asks for (`Strategy.scores`: logits, or log-probabilities for beam search);
5. select (`core/stages/select.py`): the request's search strategy turns scores into actions on the
   `StepContext`: `append_token`, `accept_draft(seq, n, token)` (keep n drafts, roll the rest back out of the KV
   cache), `fork(seq, seed)` (a new sequence sharing the blocks copy-on-write), `free(seq)`, `finish(seq, reason)`,
   `set_results(request, ...)`, `score_candidates(seq, tokens)` (score k sibling next tokens as k rows of the next
   forward, each a hidden probe sharing the sequence's blocks; the sequence then gets one row per candidate) and
   `accept_candidate(seq, i)` (append candidate i keeping the key and value the forward computed for it). A
   strategy with `hidden_states = True` also reads `ctx.hidden_states(seq)`: the last hidden states (the final
   norm's output) of every position computed for the sequence in the step, a chunked prompt's whole, or one per
   candidate;
6. stop (`core/stages/stop.py`): the request's stopping criteria check each new token (several per sequence after
   speculation; tokens after a stop are dropped), unless the strategy `handles_stopping` itself (beam search);
7. emit (`core/stages/emit.py`): the step's outputs are returned: the final outputs queued since the last step,
   then a delta for every other request that got tokens; `decodekit_step_finished` is called once.

When every sequence of a request has finished (stopping criteria included), a strategy with `finalizes = True`
chooses the request's outputs (`Strategy.finalize`: best-of-n ranks its samples); such requests stream no deltas.

`decodekit_request_finished` is called when a request's final output is built: in the emit stage of the step in
which it stopped, failed or got a strategy's results, or of the next step for a request refused in `add_request`
or ended by `abort`.

The strategy contract (`decodekit.api.strategy.Strategy`): per request, which positions need scores (`propose`)
and what to do with them (`select`); `check_compatible` refuses combinations it cannot run when a request or
recipe is planned; `num_sequences` reserves room for forks at admission. Draft proposers
(`decodekit.api.proposer.Proposer`) are plugins of the `speculative` strategy. Components are built once per
engine; per-request parameters are pydantic models (`Params`) validated when the request is planned.

Implementations may accept fewer arguments than a spec lists; always call hooks with keyword arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import pluggy
import typer

from decodekit.api.constraints import ConstraintBackend
from decodekit.api.metrics import Metric
from decodekit.api.models import ModelLoader
from decodekit.api.processors import LogitsProcessor
from decodekit.api.proposer import Proposer
from decodekit.api.reasoning import ReasoningFormat
from decodekit.api.sequence import Request, RequestOutput
from decodekit.api.stopping import StoppingCriterion
from decodekit.api.strategy import Strategy
from decodekit.api.tools import ToolCallFormat

T_contra = TypeVar("T_contra", contravariant=True)

hookspec = pluggy.HookspecMarker("decodekit")
"""Marker for hook specifications (decodekit's own; plugins use `hookimpl`)."""

hookimpl = pluggy.HookimplMarker("decodekit")
"""Marker for plugin hook implementations: ``@decodekit.hookimpl``."""


class Register(Protocol[T_contra]):
    """The callback a registration hook receives: ``register(name, factory, default=False)``."""

    def __call__(self, name: str, factory: Callable[[], T_contra], default: bool = False) -> None:
        """Register `factory` (a class, or any callable that builds the component) under `name`."""
        ...


class RegisterLoader(Protocol):
    """The callback `decodekit_register_model_loaders` receives: ``register(loader)``."""

    def __call__(self, loader: ModelLoader) -> None:
        """Add a model loader (tried in registration order)."""
        ...


class EngineHandle(Protocol):
    """What lifecycle hooks may use of the engine (`decodekit.core.engine.Engine`)."""

    tokenizer: Any
    max_model_len: int

    def stats(self) -> dict[str, Any]:
        """Queue depth, running requests, KV usage and preemptions right now."""
        ...

    def abort(self, request_id: str) -> bool:
        """Stop a request now (finish reason "abort")."""
        ...


# ---- registration -----------------------------------------------------------------------------------------
@hookspec
def decodekit_register_processors(register: Register[LogitsProcessor]) -> None:
    """Register logits processors.

    :param register: ``register(name, factory, default=False)``; ``factory()`` builds a
        :class:`decodekit.api.processors.LogitsProcessor`. ``default=True`` puts it in every engine's pipeline
        (it acts on the requests whose sampling parameters switch it on: ``from_sampling_params``).
    """


@hookspec
def decodekit_register_stopping_criteria(register: Register[StoppingCriterion]) -> None:
    """Register stopping criteria.

    :param register: ``register(name, factory, default=False)``; ``factory()`` builds a
        :class:`decodekit.api.stopping.StoppingCriterion`.
    """


@hookspec
def decodekit_register_strategies(register: Register[Strategy]) -> None:
    """Register search strategies.

    :param register: ``register(name, factory)``; ``factory()`` builds a :class:`decodekit.api.strategy.Strategy`.
    """


@hookspec
def decodekit_register_proposers(register: Register[Proposer]) -> None:
    """Register draft proposers for speculative decoding.

    :param register: ``register(name, factory)``; ``factory()`` builds a :class:`decodekit.api.proposer.Proposer`.
    """


@hookspec
def decodekit_register_constraint_backends(register: Register[type[ConstraintBackend]]) -> None:
    """Register structured-output backends (what the `json_schema`, `regex`, ... processors compile with).

    :param register: ``register(name, loader)``; ``loader()`` returns a
        :class:`decodekit.api.constraints.ConstraintBackend` subclass (import the backend's library there, so it is
        only needed when a request names the backend).
    """


@hookspec
def decodekit_register_tool_formats(register: Register[type[ToolCallFormat]]) -> None:
    """Register tool-call formats: how a model family writes tool calls (`decodekit serve --tool-format NAME`).

    :param register: ``register(name, cls)`` with a :class:`decodekit.api.tools.ToolCallFormat` subclass.
    """


@hookspec
def decodekit_register_metrics(register: Register[Metric]) -> None:
    """Register quality metrics for `decodekit compare` (distinct-n, self-BLEU, a judge, a task's checker, ...).

    :param register: ``register(name, factory)``; ``factory()`` builds a :class:`decodekit.api.metrics.Metric`
        (its `needs` say what it reads, its `aggregate` how its values fold into the report's figure).
    """


@hookspec
def decodekit_register_reasoning_formats(register: Register[type[ReasoningFormat]]) -> None:
    """Register reasoning formats: how a model family marks the phases of its output (`reasoning: {format: NAME}`).

    :param register: ``register(name, cls)`` with a :class:`decodekit.api.reasoning.ReasoningFormat` subclass.
    """


@hookspec
def decodekit_register_model_loaders(register: RegisterLoader) -> None:
    """Register model loaders, tried in the order registered (third-party plugins' before decodekit's own).

    :param register: ``register(loader)`` with a :class:`decodekit.models.ModelLoader`.
    """


@hookspec
def decodekit_register_commands(cli: typer.Typer) -> None:
    """Add commands to the ``decodekit`` command line.

    :param cli: the :class:`typer.Typer` application; add commands with ``@cli.command()``.
    """


# ---- lifecycle ---------------------------------------------------------------------------------------------
@hookspec
def decodekit_engine_started(engine: EngineHandle) -> None:
    """Called once when an engine has loaded its model and allocated its KV cache.

    :param engine: the :class:`decodekit.core.engine.Engine`.
    """


@hookspec
def decodekit_request_added(engine: EngineHandle, request: Request) -> None:
    """Called when a request is accepted into the engine's queue.

    :param engine: the engine.
    :param request: the :class:`decodekit.api.sequence.Request`.
    """


@hookspec
def decodekit_step_finished(engine: EngineHandle, outputs: list[RequestOutput]) -> None:
    """Called after every engine step.

    :param engine: the engine.
    :param outputs: the list of :class:`decodekit.api.sequence.RequestOutput` the step emitted.
    """


@hookspec
def decodekit_request_finished(engine: EngineHandle, request: Request, output: RequestOutput) -> None:
    """Called once when a request's final output is built (stop, length, abort or error): in the emit stage of the
    step that ended it, or of the next step for a request refused in `add_request` or ended by `abort`.

    :param engine: the engine.
    :param request: the finished request.
    :param output: its final :class:`decodekit.api.sequence.RequestOutput`.
    """
