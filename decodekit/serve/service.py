"""The engine behind the server: the recipe's engine driven by an `AsyncLLM`, the names it is served under, the
bounded waiting queue, and `RequestGroup`, the engine requests of one HTTP request (one per prompt) streamed
together and aborted together."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from decodekit.api.params import SamplingParams
from decodekit.api.sequence import RequestOutput
from decodekit.llm import AsyncLLM
from decodekit.recipe import Recipe
from decodekit.serve.errors import APIError


class ServingEngine:
    """What the HTTP layer serves: a recipe and the `AsyncLLM` running its engine.

    Args:
        recipe: the recipe (its sampling, processors, stopping and strategy are every request's defaults).
        llm: the `AsyncLLM` running the recipe's engine.
        served_model_name: another name clients may use for the model (listed first by GET /v1/models).
        max_waiting: refuse a request (429) while this many accepted requests have not started yet (None: no bound).
    """

    def __init__(self, recipe: Recipe, llm: AsyncLLM, *, served_model_name: str | None = None,
                 max_waiting: int | None = None) -> None:
        self.recipe = recipe
        self.llm = llm
        self.engine = llm.engine
        self.tokenizer = llm.tokenizer
        self.names = list(dict.fromkeys(n for n in (served_model_name, recipe.model) if n))
        self.max_waiting = max_waiting
        self.started = time.time()
        self.live: dict[str, bool] = {}  # engine request id -> whether it has produced an output yet

    def check_model(self, name: str | None) -> str:
        """The model name to answer with: `name` if it is one this server serves (default: the first).

        Raises:
            APIError: 404 for a name it does not serve.
        """
        if name is None:
            return self.names[0]
        if name not in self.names:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.names)}", param="model", code="model_not_found")
        return name

    def waiting(self) -> int:
        """Accepted engine requests that have not started: not yet in the engine, or queued there and never
        scheduled (a request that has produced output is not waiting)."""
        count = 0
        for rid, started in list(self.live.items()):
            if started:
                continue
            request = self.engine.requests.get(rid)  # a dict read: safe beside the engine thread
            if request is None or request.metrics.first_scheduled_time is None:
                count += 1
        return count

    def admit(self) -> None:
        """Accept a new request, or refuse it while the waiting queue is full.

        Raises:
            APIError: 429 when `max_waiting` requests are already waiting.
        """
        if self.max_waiting is not None and self.waiting() >= self.max_waiting:
            raise APIError(429, f"the server is busy: {self.max_waiting} requests are already waiting; retry later",
                           type="requests", code="rate_limit_exceeded", headers={"Retry-After": "1"})

    def open(self, prompts: Sequence[str | list[int]], params: SamplingParams, add_special_tokens: bool
             ) -> RequestGroup:
        """Submit one engine request per prompt (call inside the event loop)."""
        return RequestGroup(self, prompts, params, add_special_tokens)

    def shutdown(self) -> None:
        """Stop the engine thread, then the engine's worker processes (a model split over ranks)."""
        self.llm.shutdown()
        self.engine.close()


class RequestGroup:
    """The engine requests of one HTTP request, one per prompt, streamed as one: `(prompt index, output)` pairs.

    Each request runs in its own task; `close` cancels them, which aborts the requests still running (their KV
    blocks are freed by the engine thread).
    """

    def __init__(self, service: ServingEngine, prompts: Sequence[str | list[int]], params: SamplingParams,
                 add_special_tokens: bool) -> None:
        self._service = service
        self._queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()
        base = uuid.uuid4().hex[:16]
        self.request_ids = [f"{base}-{i}" for i in range(len(prompts))]
        self._buffer: list[tuple[int, RequestOutput]] = []
        self._ended: set[int] = set()
        service.live.update(dict.fromkeys(self.request_ids, False))  # waiting from now on (admission counts them)
        self._tasks = [asyncio.create_task(self._pump(i, rid, prompt, params, add_special_tokens))
                       for i, (rid, prompt) in enumerate(zip(self.request_ids, prompts))]

    async def _pump(self, index: int, rid: str, prompt: str | list[int], params: SamplingParams,
                    add_special_tokens: bool) -> None:
        live = self._service.live
        item: Any = None
        try:
            async for out in self._service.llm.generate(prompt, params, request_id=rid,
                                                        add_special_tokens=add_special_tokens):
                live[rid] = True
                self._queue.put_nowait((index, out))
        except Exception as exc:  # the engine failed (not the request): the HTTP layer answers 500
            item = exc
        finally:
            live.pop(rid, None)
        self._queue.put_nowait((index, item))

    async def _next(self) -> tuple[int, RequestOutput | None]:
        index, item = await self._queue.get()
        if isinstance(item, Exception):
            raise APIError(500, f"the engine failed: {item}", type="server_error")
        if item is None:
            self._ended.add(index)
        return index, item

    async def first_outputs(self) -> list[RequestOutput]:
        """Wait for every request's first output (a refused request's first output is its final one, with
        `.error`); they stay queued for `outputs`.

        Raises:
            APIError: 500 when the engine itself failed.
        """
        firsts: dict[int, RequestOutput] = {}
        while len(firsts) < len(self.request_ids):
            index, out = await self._next()
            if out is not None:
                self._buffer.append((index, out))
                firsts.setdefault(index, out)
        return [firsts[i] for i in range(len(self.request_ids))]

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every output of every request, as `(prompt index, output)`, until all have finished.

        Raises:
            APIError: 500 when the engine itself failed.
        """
        buffered, self._buffer = self._buffer, []
        for pair in buffered:
            yield pair
        while len(self._ended) < len(self.request_ids):
            index, out = await self._next()
            if out is not None:
                yield index, out

    async def finals(self) -> list[RequestOutput]:
        """Each request's final output, in prompt order."""
        finals: dict[int, RequestOutput] = {}
        async for index, out in self.outputs():
            if out.finished:
                finals[index] = out
        return [finals[i] for i in range(len(self.request_ids))]

    async def close(self) -> None:
        """Abort the requests still running and wait for their tasks to end."""
        for task in self._tasks:
            task.cancel()
        for rid in self.request_ids:  # a task cancelled before it ran never reaches its own clean-up
            self._service.live.pop(rid, None)
        await asyncio.gather(*self._tasks, return_exceptions=True)
