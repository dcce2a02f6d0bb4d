"""HTTP plumbing for requests that may outlive their client: server-sent events that stop as soon as the client
goes (closing their source, which aborts its engine requests), and waiting for a non-streamed result unless the
client disconnects first."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

log = logging.getLogger("decodekit.serve")
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client disconnects (call once the body has been read: later messages are disconnects)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, or cancel it (and wait for its clean-up) as soon as the client disconnects.

    Raises:
        ClientGone: the client disconnected first.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class EventStream(StreamingResponse):
    """`text/event-stream` from an async generator of events. It listens for the client's disconnect while it
    streams (also while the source has nothing to send) and always closes the source when it ends, so the source's
    clean-up (aborting engine requests) runs as soon as the client goes."""

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went while we were sending
                        pass
                    except Exception:
                        log.exception("streaming a response failed")
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            await self._events.aclose()
