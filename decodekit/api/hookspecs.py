"""Every decodekit hook, in one place.

Two kinds of hooks:

Registration hooks run once, when the plugin manager's components are collected into a `Registry`. They use
the register-callback pattern: the hook receives a `register` function and calls it once per thing it provides.

Lifecycle hooks run at request and step granularity, never per token per processor.

The step protocol. `Engine.step()` runs, in this order:

0. propose: strategies that speculate set `seq.draft_token_ids` on their decode-ready sequences (each draft
   token is one more position to score in this step's forward);
1. schedule: the scheduler picks running sequences (decodes first, then prefill chunks) under the token budget
   and the free KV blocks, preempting the newest request if blocks run out, then admits waiting requests;
2. forward: one packed forward pass of the model over every scheduled token, logits only at the positions
   whose scores are needed (`1 + len(draft)` per sequence that completes);
3. process logits: each request's processors, in its own order, over the rows that use them (a strategy calls
   `ctx.process`, so beam search can process log-probabilities and speculation every verified position);
4. select: the request's search strategy turns scores into actions on the `StepContext`: `append_token`,
   `accept_draft(seq, n, token)` (keep n drafts, roll the rest back out of the KV cache), `fork(seq)` (a new
   sequence sharing the blocks copy-on-write), `free(seq)`, `finish(seq, reason)`, `set_results(request, ...)`;
5. stop: stopping criteria check each new token (several per sequence after speculation; tokens after a stop
   are dropped), unless the strategy `handles_stopping` itself (beam search);
6. emit: outputs are built; `decodekit_request_finished` is called for each finished request, then
   `decodekit_step_finished` once.

The strategy contract (`decodekit.strategy.Strategy`): per request, which positions need scores (`propose`) and
what to do with them (`select`); `check_compatible` refuses combinations it cannot run when a request or recipe
is planned; `num_sequences` reserves room for forks at admission. Draft proposers (`decodekit.strategy.Proposer`)
are plugins of the `speculative` strategy. Components are built once per engine; per-request parameters are
pydantic models (`Params`) validated when the request is planned.

Implementations may accept fewer arguments than a spec lists; always call hooks with keyword arguments.
"""

from __future__ import annotations

from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("decodekit")
"""Marker for hook specifications (decodekit's own; plugins use `hookimpl`)."""

hookimpl = pluggy.HookimplMarker("decodekit")
"""Marker for plugin hook implementations: ``@decodekit.hookimpl``."""


# ---- registration -----------------------------------------------------------------------------------------
@hookspec
def decodekit_register_processors(register: Any) -> None:
    """Register logits processors.

    :param register: ``register(name, factory, default=False)``; ``factory()`` builds a
        :class:`decodekit.processors.LogitsProcessor`. ``default=True`` puts it in every engine's pipeline
        (it still acts only on requests for which ``is_active`` is true).
    """


@hookspec
def decodekit_register_stopping_criteria(register: Any) -> None:
    """Register stopping criteria.

    :param register: ``register(name, factory, default=False)``; ``factory()`` builds a
        :class:`decodekit.stopping.StoppingCriterion`.
    """


@hookspec
def decodekit_register_strategies(register: Any) -> None:
    """Register search strategies.

    :param register: ``register(name, factory)``; ``factory()`` builds a :class:`decodekit.strategy.Strategy`.
    """


@hookspec
def decodekit_register_proposers(register: Any) -> None:
    """Register draft proposers for speculative decoding.

    :param register: ``register(name, factory)``; ``factory()`` builds a :class:`decodekit.strategy.Proposer`.
    """


@hookspec
def decodekit_register_constraint_backends(register: Any) -> None:
    """Register structured-output backends (what the `json_schema`, `regex`, ... processors compile with).

    :param register: ``register(name, loader)``; ``loader()`` returns a
        :class:`decodekit.constraints.ConstraintBackend` subclass (import the backend's library there, so it is
        only needed when a request names the backend).
    """


@hookspec
def decodekit_register_model_loaders(register: Any) -> None:
    """Register model loaders, tried in registration order before the built-in ones.

    :param register: ``register(loader)`` with a :class:`decodekit.models.ModelLoader`.
    """


@hookspec
def decodekit_register_commands(cli: Any) -> None:
    """Add commands to the ``decodekit`` command line.

    :param cli: the :class:`typer.Typer` application; add commands with ``@cli.command()``.
    """


# ---- lifecycle ---------------------------------------------------------------------------------------------
@hookspec
def decodekit_engine_started(engine: Any) -> None:
    """Called once when an engine has loaded its model and allocated its KV cache.

    :param engine: the :class:`decodekit.core.engine.Engine`.
    """


@hookspec
def decodekit_request_added(engine: Any, request: Any) -> None:
    """Called when a request is accepted into the engine's queue.

    :param engine: the engine.
    :param request: the :class:`decodekit.core.sequence.Request`.
    """


@hookspec
def decodekit_step_finished(engine: Any, outputs: Any) -> None:
    """Called after every engine step.

    :param engine: the engine.
    :param outputs: the list of :class:`decodekit.core.sequence.RequestOutput` the step emitted.
    """


@hookspec
def decodekit_request_finished(engine: Any, request: Any, output: Any) -> None:
    """Called once when a request finishes (stop, length, abort or error).

    :param engine: the engine.
    :param request: the finished request.
    :param output: its final :class:`decodekit.core.sequence.RequestOutput`.
    """
