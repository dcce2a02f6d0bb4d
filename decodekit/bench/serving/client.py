"""`bench serve`'s HTTP client: a chat request streamed (or not) and what came back (`StreamResult`: TTFT, end to
end time, tokens from the usage or the chunks), N concurrent closed-loop clients over a workload, the warm-up, and
the model a running server serves. `benchmarks/serve_soak.py` drives servers with the same client."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from decodekit.bench.metrics import tpot
from decodekit.bench.serving.process import ServerStartError
from decodekit.bench.serving.workload import WARMUP_MESSAGES, ChatRequest


@dataclass
class StreamResult:
    """What one request got back.

    Attributes:
        status: the HTTP status (None: no response).
        text: the concatenated text.
        chunks: chunks that carried text.
        usage_tokens, prompt_tokens: the usage's `completion_tokens` and `prompt_tokens` (None without usage).
        finish_reason: the last choice's finish reason.
        done: the stream ended with `[DONE]` (or the JSON response was complete).
        ttft_s: send to the first chunk with text (None: none came).
        e2e_s: send to the end of the response.
        error: what went wrong (a status other than 200, an error event, a transport error, a stream that ended
            without a finish reason).
        disconnected: the client closed the stream on purpose before its end.
    """

    status: int | None = None
    text: str = ""
    chunks: int = 0
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    done: bool = False
    ttft_s: float | None = None
    e2e_s: float = 0.0
    error: str | None = None
    disconnected: bool = False

    @property
    def tokens(self) -> int:
        """Generated tokens: the usage's count, else the chunks that carried text."""
        return self.usage_tokens if self.usage_tokens is not None else self.chunks

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (tokens - 1), when there are two tokens or more (`decodekit.bench.metrics.tpot`)."""
        return tpot(self.ttft_s, self.e2e_s, self.tokens)


def _error_text(data: Any) -> str:
    error = data.get("error") if isinstance(data, dict) else data
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict[str, Any], *,
                      disconnect_after: int | None = None) -> StreamResult:
    """POST a streamed chat request to `url` (…/v1/chat/completions) and read its events.

    Args:
        disconnect_after: close the connection after this many chunks with text (a client that goes away).
    """
    result = StreamResult()
    texts: list[str] = []
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                raw = await response.aread()
                try:
                    result.error = f"HTTP {response.status_code}: {_error_text(json.loads(raw))}"
                except ValueError:
                    result.error = f"HTTP {response.status_code}: {raw[:200]!r}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        result.done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        result.error = f"error event: {_error_text(event)}"
                        continue
                    if event.get("usage"):
                        result.usage_tokens = event["usage"].get("completion_tokens")
                        result.prompt_tokens = event["usage"].get("prompt_tokens")
                    for choice in event.get("choices") or []:
                        content = (choice.get("delta") or {}).get("content")
                        if content:
                            if result.ttft_s is None:
                                result.ttft_s = time.perf_counter() - start
                            result.chunks += 1
                            texts.append(content)
                        if choice.get("finish_reason"):
                            result.finish_reason = choice["finish_reason"]
                    if disconnect_after is not None and result.chunks >= disconnect_after:
                        result.disconnected = True
                        break
    except (httpx.HTTPError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e_s = time.perf_counter() - start
    result.text = "".join(texts)
    if result.ttft_s is None and result.finish_reason is not None:  # nothing but the end (an answer of EOS only)
        result.ttft_s = result.e2e_s
    if result.error is None and not result.disconnected and result.finish_reason is None:
        result.error = "the stream ended without a finish reason"
    return result


async def post_chat(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> StreamResult:
    """POST a non-streamed chat request; the result's `text`, usage and finish reason are the response's."""
    result = StreamResult()
    start = time.perf_counter()
    try:
        response = await client.post(url, json=body)
        result.status = response.status_code
        data = response.json()
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {_error_text(data)}"
        else:
            choice = data["choices"][0]
            result.text = choice["message"]["content"] or ""
            result.finish_reason = choice.get("finish_reason")
            result.usage_tokens = data["usage"]["completion_tokens"]
            result.prompt_tokens = data["usage"]["prompt_tokens"]
            result.done = True
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e_s = time.perf_counter() - start
    result.ttft_s = result.e2e_s if result.done else None
    return result


async def run_clients(base_url: str, model: str, requests: Sequence[ChatRequest], clients: int,
                      timeout_s: float = 1800.0) -> tuple[list[StreamResult], float]:
    """Send `requests` through `clients` concurrent streaming clients (each takes the next request when its last
    one has finished); returns each request's result, in order, and the wall time from the first send to the
    last response's end."""
    if clients < 1:
        raise ValueError(f"`clients` must be >= 1, got {clients}")
    url = f"{base_url}/v1/chat/completions"
    results: list[StreamResult | None] = [None] * len(requests)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(requests)):
        queue.put_nowait(i)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0), limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                results[i] = await stream_chat(client, url, requests[i].body(model))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - start
    return [r if r is not None else StreamResult(error="not sent") for r in results], wall


async def warm_up(base_url: str, model: str, clients: int) -> list[StreamResult]:
    """Untimed: one greedy 8-token request, then `min(clients, 4)` at once (so batched steps are warm too)."""
    warm = ChatRequest(WARMUP_MESSAGES, 8)
    first, _ = await run_clients(base_url, model, [warm], 1)
    rest, _ = await run_clients(base_url, model, [warm] * min(clients, 4), min(clients, 4))
    return [*first, *rest]


def served_model(base_url: str, timeout_s: float = 10.0) -> str:
    """The first model an OpenAI-compatible server lists at `/v1/models` (the name requests must give).

    Raises:
        ServerStartError: nothing answers there, or it lists no model.
    """
    try:
        response = httpx.get(f"{base_url}/v1/models", timeout=timeout_s)
        data = response.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        raise ServerStartError(f"no OpenAI-compatible server answers {base_url}/v1/models: {exc}") from None
    if not data or not data[0].get("id"):
        raise ServerStartError(f"{base_url}/v1/models lists no model")
    return str(data[0]["id"])


__all__ = ["StreamResult", "post_chat", "run_clients", "served_model", "stream_chat", "warm_up"]
