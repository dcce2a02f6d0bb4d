"""Request lifecycle: a prompt becomes a planned request with its first sequence; requests fail, abort, complete.

This module owns the table of live requests and every way a request ends: `fail` (finish reason "error"),
`abort`, `set_results` (a strategy's final outputs) and `complete` (all its sequences finished). Each end releases
the request's blocks, tells its strategy (`on_request_finished`) and queues its final output with the emitter.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Mapping
from typing import Any

import torch
from pydantic import ValidationError

from decodekit.api.components import format_validation_error
from decodekit.api.errors import DecodeKitError, RequestError
from decodekit.api.params import SamplingParams
from decodekit.api.processors import ProcessorError, init_states
from decodekit.api.sequence import Request, Sequence
from decodekit.api.strategy import StrategyResult
from decodekit.core.detokenizer import IncrementalDetokenizer
from decodekit.core.plan import Components
from decodekit.core.scheduler import Scheduler
from decodekit.core.stages.emit import OutputEmitter
from decodekit.core.stages.stop import StopStage
from decodekit.core.trace import record_end

log = logging.getLogger("decodekit.engine")



PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})
"""The keys of a prompt given as a dict (vLLM's `TextPrompt` / `TokensPrompt`)."""


def prompt_of(prompt: Any) -> Any:
    """A prompt given as vLLM's `{"prompt": text}` or `{"prompt_token_ids": ids}` unwrapped to its text or ids (the
    ids where both are given, as vLLM does); anything else as it is (a dict with other keys is refused later)."""
    if isinstance(prompt, Mapping) and prompt and set(prompt) <= PROMPT_KEYS:
        return prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
    return prompt


class RequestLifecycle:
    """Creates, plans, queues and ends requests.

    Args:
        tokenizer: encodes text prompts and detokenizes outputs.
        components: resolves each request's plan.
        scheduler: queues requests and releases their blocks.
        stop: finishes sequences (final text and reasons).
        emitter: queues final outputs.
        max_model_len: prompts must be shorter than this.
        vocab_size: prompt token ids must be below this.
        device: where seeded generators live.
        context_limit: why `max_model_len` is below the model's context, if it is (for the message refusing a longer
            prompt).
    """

    def __init__(self, tokenizer: Any, components: Components, scheduler: Scheduler, stop: StopStage,
                 emitter: OutputEmitter, max_model_len: int, vocab_size: int, device: torch.device,
                 context_limit: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.components = components
        self.scheduler = scheduler
        self.stop = stop
        self.emitter = emitter
        self.max_model_len = max_model_len
        self.context_limit = context_limit
        self.vocab_size = vocab_size
        self.device = device
        self.requests: dict[str, Request] = {}
        self._counter = 0

    def add(self, prompt: str | list[int] | Mapping[str, Any], params: SamplingParams, request_id: str | None,
            priority: int, add_special_tokens: bool) -> Request:
        """Make, validate and plan a request and queue it; a bad one is failed at once (its final output is
        queued), the caller's other requests unaffected."""
        if request_id is None:
            request_id = str(self._counter)
        self._counter += 1
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        prompt = prompt_of(prompt)
        ids, error = self._token_ids(prompt, add_special_tokens)
        params, params_error = _validated(params)
        error = error or params_error
        request = Request(request_id, prompt if isinstance(prompt, str) else None, ids, params, priority)
        self.requests[request_id] = request
        error = error or self._validate(request)
        if error is None:
            try:
                request.plan = self.components.resolve(params)
                request.max_sequences = request.plan.strategy.num_sequences(request.plan.strategy_options, params)
            except DecodeKitError as exc:
                error = str(exc)
            except Exception as exc:  # a plugin failing to set up fails this request, not the caller's batch
                log.exception("planning request %s failed", request_id)
                error = f"could not plan the request: {exc!r}"
        seq = Sequence(request, list(ids), len(ids))
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        request.sequences.append(seq)
        if error is not None:
            self.fail(request, error)
            return request
        try:
            seq.processor_states = init_states(request.plan.stages, ids)
        except ProcessorError as exc:
            log.warning("request %s failed: %s", request_id, exc)
            self.fail(request, str(exc))
            return request
        self.scheduler.add(request)
        return request

    def _token_ids(self, prompt: object, add_special_tokens: bool) -> tuple[list[int], str | None]:
        """The prompt's token ids, or an error when it is neither text nor a list of integer token ids (a float id
        would otherwise be truncated, or break prefix hashing inside the scheduler)."""
        if isinstance(prompt, str):
            try:
                return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)), None
            except Exception as exc:  # e.g. a lone surrogate, which no tokenizer takes: this request's fault only
                return [], f"the prompt could not be tokenized: {exc}"
        if isinstance(prompt, Mapping):
            return [], (f"a prompt dict holds 'prompt' (text) or 'prompt_token_ids' (vLLM's TextPrompt and "
                        f"TokensPrompt) and nothing else; got keys {sorted(map(str, prompt))}")
        if not isinstance(prompt, (list, tuple)):
            return [], f"the prompt must be a string or a list of token ids, got {type(prompt).__name__}"
        try:
            if any(isinstance(t, bool) for t in prompt):
                raise TypeError("bool")
            return [operator.index(t) for t in prompt], None
        except TypeError:
            bad = next((t for t in prompt if isinstance(t, bool) or not hasattr(t, "__index__")), prompt)
            return [], f"the prompt's token ids must be integers, got {bad!r} ({type(bad).__name__})"

    def _validate(self, request: Request) -> str | None:
        n = len(request.prompt_token_ids)
        if n == 0:
            return "the prompt is empty"
        if n >= self.max_model_len:
            if self.context_limit is not None:
                return (f"the prompt has {n} tokens but the context is {self.max_model_len} tokens "
                        f"({self.context_limit})")
            return f"the prompt has {n} tokens but the model's context is {self.max_model_len} tokens"
        if any(t < 0 or t >= self.vocab_size for t in request.prompt_token_ids):
            return f"the prompt has token ids outside the vocabulary [0, {self.vocab_size})"
        return None

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its output finishes with reason "abort". Returns False if it is unknown or done."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return False
        for seq in request.sequences:
            if not seq.finished:
                self.stop.finish_sequence(seq, "abort")
                record_end(seq, "abort")
        self.complete(request, finalize=False)
        return True

    def fail(self, request: Request, error: str) -> None:
        """End a request with finish reason "error" and this message (a request already ended keeps its end)."""
        if self.requests.get(request.request_id) is not request:
            return
        request.error = error
        for seq in request.sequences:
            if not seq.finished:
                self.stop.finish_sequence(seq, "error", text=seq.text)
                record_end(seq, "error", error)
        self.complete(request)

    def set_results(self, request: Request, results: list[StrategyResult]) -> None:
        """A strategy's final outputs for a request; its remaining sequences are released."""
        request.results = results
        for seq in request.sequences:
            if not seq.finished:
                self.stop.finish_sequence(seq, results[0].finish_reason if results else "stop", text=seq.text)
        request.metrics.count_outputs([len(r.token_ids) for r in results])
        self.complete(request)

    def complete(self, request: Request, finalize: bool = True) -> None:
        """Release a finished request's blocks, let a strategy that `finalizes` choose its outputs (unless the
        request failed, or `finalize` is False: an abort), tell its strategy, and queue its final output."""
        if request.request_id not in self.requests:
            return  # already completed this step (a strategy's results, then the stop stage)
        request.metrics.finished_time = time.perf_counter()
        self.scheduler.remove(request)
        if finalize and request.error is None and request.results is None and request.plan is not None \
                and request.plan.strategy.finalizes:
            self._finalize(request)
        if request.plan is not None:
            try:
                request.plan.strategy.on_request_finished(request)
            except Exception:  # cleanup must not take the engine down
                log.exception("%s: on_request_finished failed", request.plan.strategy.name)
        self.emitter.final(request)
        del self.requests[request.request_id]


    def _finalize(self, request: Request) -> None:
        """The strategy's final outputs after the engine's stopping; a strategy that raises fails the request."""
        strategy = request.plan.strategy
        try:
            results = strategy.finalize(request)
        except Exception as exc:
            log.warning("request %s: %s failed to finalize: %r", request.request_id, strategy.name, exc)
            request.error = f"{strategy.name} failed to finalize: {exc!r}"
            return
        if results is not None:
            request.results = list(results)
            request.metrics.count_outputs([len(r.token_ids) for r in results])


def _validated(params: object) -> tuple[SamplingParams, str | None]:
    """The request's parameters validated again: `SamplingParams.model_copy(update=...)` and `model_construct`
    skip pydantic's validation, and a plain dict is accepted here too. Returns the defaults and an error when
    they are invalid."""
    try:
        if isinstance(params, SamplingParams):
            return SamplingParams.model_validate(dict(params)), None
        return SamplingParams.model_validate(params), None
    except ValidationError as exc:
        return SamplingParams(), f"invalid sampling parameters: {format_validation_error('', exc, SamplingParams)}"
