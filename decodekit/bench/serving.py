"""`decodekit bench serve`: `decodekit serve` against `transformers serve --continuous-batching`, over HTTP.

Each server runs as a subprocess on a free loopback port (waited for through `/health`), one after the other, and
gets the same seeded chat workload (`make_chat_workload`: prompts of varied lengths, mixed `max_tokens`, some
requests greedy, some sampled with a seed) from N concurrent streaming clients. Every client is a coroutine that
takes the next request from a shared queue as soon as its previous one has finished (a closed loop), so N requests
are in flight at any time. Each server gets an untimed warm-up first.

Per request the client records, from the moment it sends the request: TTFT (the first chunk that carries text),
the end-to-end time (the stream's end), and the generated tokens, read from the usage the server returns
(`stream_options.include_usage`; transformers sends its usage with the last chunk unasked) or, where a response
carries no usage, counted as the chunks that carry text. TPOT is `(e2e - ttft) / (tokens - 1)`. Per server:
throughput (generated tokens over the wall time of the whole run), TTFT and TPOT p50 / p99, errors; then the
ratios decodekit / transformers.

The same client code (`ServerProcess`, `stream_chat`, `post_chat`) drives `benchmarks/serve_soak.py`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from decodekit.bench.machine import environment, machine_line
from decodekit.bench.metrics import percentiles, tpot
from decodekit.bench.report import MISSING
from decodekit.tables import print_table

DEFAULT_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
"""The recipe `decodekit bench serve` serves by default (the bundled model, from the source checkout)."""

SYSTEM_PROMPT = "You are a helpful assistant. Answer clearly."
TOPICS = ("the ocean", "a violin", "Mount Everest", "bread", "the Moon", "a bicycle", "tea", "Paris", "volcanoes",
          "honey bees", "the printing press", "chess", "rainbows", "the Roman Empire", "coffee", "glaciers")
ASKS = ("What is special about {}?", "Explain {} to a ten-year-old.", "Give me three facts about {}.",
        "Write a short poem about {}.", "Summarize the history of {} in a few sentences.",
        "What are the pros and cons of {}?", "Write a short story about {}.", "Describe {} in one paragraph.")
NOTES = ("The Amazon rainforest covers much of northwestern Brazil and extends into Colombia and Peru.",
         "It is the largest tropical rainforest in the world, famed for its biodiversity.",
         "The river that drains the basin carries more water than any other river on Earth.",
         "Deforestation has cleared about a fifth of the forest since the 1970s.",
         "Bees communicate the direction of flowers with a dance inside the hive.",
         "The first printed books in Europe appeared in the middle of the fifteenth century.",
         "A glacier forms where more snow falls each winter than melts each summer.",
         "Tea was first drunk in China, as a medicine, thousands of years ago.",
         "The Moon is slowly drifting away from the Earth, by about four centimetres a year.",
         "Chess engines have beaten the best human players since the late 1990s.",
         "Volcanic soil is among the most fertile in the world.",
         "A violin has four strings tuned in fifths.")
MAX_TOKENS = (16, 32, 64, 96, 128, 192, 256)
SAMPLED_TEMPERATURE, SAMPLED_TOP_P = 0.7, 0.9
WARMUP_MESSAGES = ({"role": "user", "content": "Say hello."},)


# ---- the workload --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChatRequest:
    """One chat request: its conversation and decoding settings (`seed` None: greedy)."""

    messages: tuple[dict[str, str], ...]
    max_tokens: int
    seed: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        """Whether the request decodes greedily (temperature 0)."""
        return self.temperature == 0.0

    def body(self, model: str, *, stream: bool = True) -> dict[str, Any]:
        """The `/v1/chat/completions` body (streamed with usage unless `stream` is False)."""
        body: dict[str, Any] = {"model": model, "messages": list(self.messages), "max_tokens": self.max_tokens,
                                "temperature": self.temperature, "top_p": self.top_p, "stream": stream}
        if self.seed is not None:
            body["seed"] = self.seed
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body


def make_chat_workload(num_requests: int = 64, seed: int = 0, *, sampled_share: float = 0.5, max_notes: int = 12,
                       max_tokens: Sequence[int] = MAX_TOKENS) -> list[ChatRequest]:
    """A seeded chat workload: questions about varied topics, some after 1 to `max_notes` sentences of notes (so
    prompts run from about 30 to 400 tokens), a quarter with a previous turn; `max_tokens` drawn from `max_tokens`;
    a `sampled_share` of the requests sampled (temperature 0.7, top-p 0.9, each with its own seed), the rest greedy.
    """
    if num_requests < 1:
        raise ValueError(f"`num_requests` must be >= 1, got {num_requests}")
    rng = random.Random(f"{seed}:serve-chat")
    requests = []
    for _ in range(num_requests):
        ask = rng.choice(ASKS).format(rng.choice(TOPICS))
        notes = rng.randint(0, max_notes) if max_notes > 0 else 0
        if notes:
            ask = "Here are some notes:\n" + " ".join(rng.sample(NOTES, min(notes, len(NOTES)))) + "\n\n" + ask
        messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM_PROMPT}]
        if rng.random() < 0.25:
            messages += [{"role": "user", "content": f"Hi! Can you tell me about {rng.choice(TOPICS)}?"},
                         {"role": "assistant", "content": "Of course. What would you like to know?"}]
        messages.append({"role": "user", "content": ask})
        limit = rng.choice(list(max_tokens))
        if rng.random() < sampled_share:
            requests.append(ChatRequest(tuple(messages), limit, rng.randrange(2**31), SAMPLED_TEMPERATURE,
                                        SAMPLED_TOP_P))
        else:
            requests.append(ChatRequest(tuple(messages), limit))
    return requests


# ---- the client ----------------------------------------------------------------------------------------------------
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


# ---- servers as subprocesses ---------------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_rss_bytes(pid: int) -> int | None:
    """A process's resident memory (psutil if installed, else /proc/PID/status VmRSS); None if it is gone."""
    try:
        import psutil

        try:
            return int(psutil.Process(pid).memory_info().rss)
        except psutil.Error:
            return None
    except ImportError:
        pass
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class ServerStartError(RuntimeError):
    """A server subprocess could not be started, or did not answer `/health` in time."""


class ServerProcess:
    """A server subprocess on a loopback port; `start` waits until `/health` answers 200, `stop` sends SIGTERM
    (then SIGKILL after `stop_timeout_s`). Its output goes to a temporary log file (`log_tail` reads it)."""

    def __init__(self, command: Sequence[str], port: int, *, env: dict[str, str] | None = None,
                 name: str = "server") -> None:
        self.command = list(command)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.env = env
        self.name = name
        self.process: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)  # noqa: SIM115
        self.log_path = Path(self._log.name)

    @property
    def pid(self) -> int | None:
        """The subprocess's id (None before `start`)."""
        return self.process.pid if self.process is not None else None

    def start(self, timeout_s: float = 300.0) -> ServerProcess:
        """Launch the command and wait for `/health`.

        Raises:
            ServerStartError: the command cannot run, exits, or does not answer within `timeout_s`.
        """
        try:
            self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env)
        except OSError as exc:
            raise ServerStartError(f"cannot run {self.command[0]}: {exc}") from None
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerStartError(f"{self.name} exited with status {code} before answering /health; its "
                                       f"output ends with:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"{self.name} did not answer /health within {timeout_s:.0f}s; its output "
                                       f"ends with:\n{self.log_tail()}")
            time.sleep(0.25)

    def rss_bytes(self) -> int | None:
        """The server process's resident memory now."""
        return process_rss_bytes(self.process.pid) if self.process is not None else None

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of the server's output."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, stop_timeout_s: float = 60.0) -> int | None:
        """SIGTERM, wait, SIGKILL if needed; returns the exit status."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def server_env(threads: int | None) -> dict[str, str]:
    """The servers' environment: offline (nothing is downloaded), and `threads` torch threads when given."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def decodekit_server(recipe: Path | str, overrides: Sequence[str] = (), *, threads: int | None = None,
                     port: int | None = None) -> ServerProcess:
    """`decodekit serve RECIPE` (not started yet) on a free loopback port."""
    port = port or free_port()
    command = [sys.executable, "-m", "decodekit", "serve", str(recipe), "--host", "127.0.0.1", "--port", str(port)]
    for override in overrides:
        command += ["--set", override]
    return ServerProcess(command, port, env=server_env(threads), name="decodekit-serve")


def transformers_executable() -> str:
    """The `transformers` command next to this Python (the venv's), else the one on PATH."""
    beside = Path(sys.executable).parent / "transformers"
    return str(beside) if beside.exists() else "transformers"


def model_folder(model: str) -> Path:
    """The local HF folder of a recipe's `model` for `transformers serve`: the bundled model's (and a .gguf file's)
    converted safetensors folder, which decodekit's loader creates on first use, or the folder itself.

    Raises:
        ValueError: the model is not local (a hub id: nothing is downloaded here).
    """
    from decodekit.models import BUNDLED_MODEL_NAME
    from decodekit.models.loader import bundled_gguf_path, cache_dir, convert_gguf_to_folder

    if model.lower() == BUNDLED_MODEL_NAME or model.lower().endswith(".gguf"):
        gguf = bundled_gguf_path() if model.lower() == BUNDLED_MODEL_NAME else Path(model).expanduser().resolve()
        folder = cache_dir() / "gguf" / f"{gguf.stem}-{gguf.stat().st_size}"  # the loader's naming
        return folder if folder.is_dir() else convert_gguf_to_folder(gguf, folder)
    if Path(model).expanduser().is_dir():
        return Path(model).expanduser().resolve()
    raise ValueError(f"{model!r} is not a local folder or GGUF file; transformers serve would download it")


def _kv_blocks(folder: Path, dtype_bytes: int, kv_cache_memory: int, page_size: int) -> int:
    """How many `page_size`-token blocks fit in `kv_cache_memory` bytes of the model's K and V."""
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(folder).get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    per_token = text.num_hidden_layers * 2 * kv_heads * head_dim * dtype_bytes
    return max(2, kv_cache_memory // (per_token * page_size))


def transformers_server(folder: Path, dtype: str, kv_cache_memory: int, max_batch_tokens: int, *,
                        threads: int | None = None, page_size: int = 16, port: int | None = None,
                        executable: str | None = None) -> tuple[ServerProcess, int]:
    """`transformers serve --continuous-batching` on `folder` (not started yet), its KV cache laid out like
    decodekit's: `kv_cache_memory` bytes in `page_size`-token blocks (decodekit's block size; transformers' own
    default of 256-token pages left it short of blocks at 16 clients here: 17% less throughput, TTFT p99 4x longer);
    returns the server and its number of KV blocks."""
    port = port or free_port()
    dtype_bytes = 2 if dtype in ("bfloat16", "float16") else 4
    blocks = _kv_blocks(folder, dtype_bytes, kv_cache_memory, page_size)
    command = [executable or transformers_executable(), "serve", str(folder), "--continuous-batching",
               "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--device", "cpu",
               "--cb-block-size", str(page_size), "--cb-num-blocks", str(blocks),
               "--cb-max-batch-tokens", str(max_batch_tokens), "--log-level", "warning"]
    return ServerProcess(command, port, env=server_env(threads), name="transformers-serve"), blocks


# ---- figures -------------------------------------------------------------------------------------------------------
@dataclass
class ServerFigures:
    """One server's figures over the timed run (None where it has none)."""

    name: str
    command: list[str] = field(default_factory=list)
    requests: int = 0
    completed: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    generated_tokens: int = 0
    tokens_from: str | None = None  # "usage", "chunks", or "usage (n requests by chunks)"
    prompt_tokens: int | None = None
    wall_s: float | None = None
    tokens_per_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p99_s: float | None = None
    rss_mb_end: float | None = None
    greedy_same_text: float | None = None  # share of greedy requests with decodekit's text (not decodekit)
    per_request: dict[str, list[Any]] = field(default_factory=dict)
    unavailable: str | None = None  # why the server did not run
    notes: list[str] = field(default_factory=list)


@dataclass
class ServeBenchResult:
    """Both servers' figures, the ratios decodekit / transformers, and the context of the run."""

    workload: dict[str, Any]
    model: str
    dtype: str
    clients: int
    servers: dict[str, ServerFigures]
    ratios: dict[str, float | None]
    environment: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    peer_ratios: dict[str, dict[str, float | None]] = field(default_factory=dict)  # peer key -> decodekit / peer

    @property
    def machine(self) -> str:
        """The machine line (`decodekit.bench.machine.machine_line`), with the servers' threads."""
        return machine_line(self.environment, self.dtype, threads=self.environment.get("server_threads"))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict of the whole result, with the machine line as `machine`."""
        return {**asdict(self), "machine": self.machine}


def summarize_run(fig: ServerFigures, results: Sequence[StreamResult], wall_s: float) -> None:
    """Fill `fig` from one timed run's per-request results."""
    ok = [r for r in results if r.error is None]
    fig.requests, fig.completed, fig.errors = len(results), len(ok), len(results) - len(ok)
    fig.error_samples = list(dict.fromkeys(r.error for r in results if r.error is not None))[:5]
    fig.generated_tokens = sum(r.tokens for r in ok)
    by_chunks = sum(r.usage_tokens is None for r in ok)
    fig.tokens_from = "usage" if by_chunks == 0 else "chunks" if by_chunks == len(ok) else \
        f"usage ({by_chunks} requests by chunks)"
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    fig.prompt_tokens = sum(prompts) if prompts and len(prompts) == len(ok) else None
    fig.wall_s = wall_s
    fig.tokens_per_s = fig.generated_tokens / wall_s if wall_s > 0 else None
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [t for t in (r.tpot_s for r in ok) if t is not None]
    fig.ttft_p50_s, fig.ttft_p99_s = percentiles(ttfts, (50, 99))
    fig.tpot_p50_s, fig.tpot_p99_s = percentiles(tpots, (50, 99))
    fig.per_request = {"tokens": [r.tokens for r in results], "chunks": [r.chunks for r in results],
                       "ttft_s": [r.ttft_s for r in results], "e2e_s": [r.e2e_s for r in results],
                       "finish_reason": [r.finish_reason for r in results], "error": [r.error for r in results]}


RATIO_FIELDS = ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")


def _ratios(a: ServerFigures, b: ServerFigures | None) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name in RATIO_FIELDS:
        x, y = getattr(a, name), getattr(b, name) if b is not None else None
        out[name] = x / y if x is not None and y else None
    return out


def _run_server(fig: ServerFigures, server: ServerProcess, model: str, requests: Sequence[ChatRequest],
                clients: int, startup_timeout_s: float, say: Callable[[str], None]) -> list[StreamResult]:
    """Start the server, warm it up, time the workload, stop it; fills `fig` (or its `unavailable`)."""
    fig.command = server.command
    say(f"{fig.name}: starting ({' '.join(server.command)})")
    try:
        server.start(startup_timeout_s)
    except ServerStartError as exc:
        fig.unavailable = str(exc)
        say(f"{fig.name}: did not start")
        return []
    try:
        warm = asyncio.run(warm_up(server.url, model, clients))
        failed = [w.error for w in warm if w.error is not None]
        if failed:
            fig.notes.append(f"warm-up: {len(failed)} request(s) failed, first: {failed[0]}")
        say(f"{fig.name}: warm; timing {len(requests)} requests from {clients} clients")
        results, wall = asyncio.run(run_clients(server.url, model, requests, clients))
        say(f"{fig.name}: done in {wall:.1f}s")
        rss = server.rss_bytes()
        fig.rss_mb_end = rss / 2**20 if rss is not None else None
        summarize_run(fig, results, wall)
        return results
    finally:
        status = server.stop()
        if status not in (0, None, -signal.SIGTERM):
            fig.notes.append(f"exited with status {status} after SIGTERM")


def parse_peer_url(text: str) -> tuple[str, str]:
    """`[name=]URL` as (name, base URL without a trailing `/v1` or `/`); the name defaults to the URL's host:port."""
    name, sep, url = text.partition("=")
    if not sep or "://" in name:  # no name given (a URL's query may hold '=' too)
        name, url = "", text
    url = url.strip().rstrip("/").removesuffix("/v1")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--peer-url takes [name=]http://host:port, got {text!r}")
    return name.strip() or url.split("://", 1)[1], url


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


def _run_peer_url(fig: ServerFigures, base_url: str, requests: Sequence[ChatRequest], clients: int,
                  say: Callable[[str], None]) -> list[StreamResult]:
    """Warm up and time an already-running server (not started or stopped here); fills `fig` or its
    `unavailable`."""
    fig.command = [base_url]
    try:
        model = served_model(base_url)
    except ServerStartError as exc:
        fig.unavailable = str(exc)
        say(f"{fig.name}: not reachable")
        return []
    fig.notes.append(f"already running at {base_url}, serving {model!r} (its settings are its own; RSS not measured)")
    warm = asyncio.run(warm_up(base_url, model, clients))
    failed = [w.error for w in warm if w.error is not None]
    if failed:
        fig.notes.append(f"warm-up: {len(failed)} request(s) failed, first: {failed[0]}")
    say(f"{fig.name}: warm; timing {len(requests)} requests from {clients} clients")
    results, wall = asyncio.run(run_clients(base_url, model, requests, clients))
    say(f"{fig.name}: done in {wall:.1f}s")
    summarize_run(fig, results, wall)
    return results


def _same_greedy_text(work: Sequence[ChatRequest], ours: Sequence[StreamResult],
                      theirs: Sequence[StreamResult]) -> float | None:
    """The share of greedy requests both servers answered whose texts are identical."""
    greedy = [(a, b) for req, a, b in zip(work, ours, theirs, strict=False)
              if req.greedy and a.error is None and b.error is None]
    return sum(a.text == b.text for a, b in greedy) / len(greedy) if greedy else None


def run_serve_benchmark(
    recipe: Path | str = DEFAULT_RECIPE,
    overrides: Sequence[str] = (),
    *,
    clients: int = 16,
    num_requests: int = 64,
    seed: int = 0,
    threads: int | None = None,
    baseline: bool = True,
    requests: Sequence[ChatRequest] | None = None,
    transformers_command: str | None = None,
    startup_timeout_s: float = 300.0,
    progress: Callable[[str], None] | None = None,
    peer_urls: Sequence[str] = (),
) -> ServeBenchResult:
    """Serve the recipe with `decodekit serve`, then its model with `transformers serve --continuous-batching`, and
    send each the same workload through `clients` streaming clients (see the module docstring for the method).

    Args:
        recipe, overrides: the recipe `decodekit serve` runs (and `--set` overrides); transformers serves the same
            model, dtype and KV cache size.
        clients: concurrent streaming clients.
        num_requests, seed: the workload (`make_chat_workload`), unless `requests` is given.
        threads: torch threads for both servers (`OMP_NUM_THREADS`); default torch's.
        baseline: also run `transformers serve` (when it cannot run, the result says why).
        transformers_command: the `transformers` executable (default: the one beside this Python).
        startup_timeout_s: how long a server may take to answer `/health`.
        progress: called with a line at each stage (starting, warm, done).
        peer_urls: OpenAI-compatible servers already running (`vllm serve`, `llama-server`, another
            `decodekit serve`), as `[name=]URL`: each gets the same warm-up and workload after the others (one
            that does not answer is reported as not run).

    Raises:
        DecodeKitError: the recipe does not load.
        RuntimeError: `decodekit serve` does not start.
    """
    import torch

    from decodekit.core.config import EngineConfig
    from decodekit.models.loader import resolve_dtype
    from decodekit.recipe import load_recipe

    if clients < 1:
        raise ValueError(f"`clients` must be >= 1, got {clients}")
    say = progress or (lambda line: None)
    peers = [parse_peer_url(text) for text in peer_urls]  # a malformed URL fails before any server starts
    loaded = load_recipe(recipe, list(overrides))
    dtype = str(resolve_dtype(loaded.dtype, torch.device(loaded.device or "cpu"))).removeprefix("torch.")
    work = list(requests) if requests is not None else make_chat_workload(num_requests, seed)
    env = {**environment(), "server_threads": threads if threads is not None else
           f"torch default ({torch.get_num_threads()} here)"}
    env.pop("torch_threads", None)
    figures = {"decodekit": ServerFigures("decodekit serve")}
    dk = decodekit_server(recipe, overrides, threads=threads)
    dk_results = _run_server(figures["decodekit"], dk, loaded.model, work, clients, startup_timeout_s, say)
    if figures["decodekit"].unavailable is not None:
        raise RuntimeError(f"decodekit serve did not start: {figures['decodekit'].unavailable}")
    notes = ["per request, from its send: TTFT to the first chunk with text, TPOT = (e2e - TTFT) / (tokens - 1); "
             "throughput = generated tokens (from the usage each response returns) / wall time of the run",
             "ratios are decodekit / transformers: above 1 is better for tok/s, below 1 is better for TTFT and TPOT"]
    tf: ServerFigures | None = None
    if baseline:
        tf = figures["transformers"] = ServerFigures("transformers serve --continuous-batching")
        try:
            folder = model_folder(loaded.model)
            config = EngineConfig(**loaded.engine_options())
            server, blocks = transformers_server(folder, dtype, config.kv_cache_memory,
                                                 config.max_num_batched_tokens, threads=threads,
                                                 page_size=config.block_size, executable=transformers_command)
        except Exception as exc:  # any reason it cannot be set up is reported, not raised
            tf.unavailable = f"cannot set up transformers serve: {exc}"
        else:
            tf.notes.append(f"KV cache {blocks} blocks x {config.block_size} tokens (~{config.kv_cache_memory >> 20} "
                            f"MiB, decodekit's layout); max batch tokens {config.max_num_batched_tokens}")
            tf.notes.append("continuous batching takes its sampling settings from the server's first request (the "
                            "greedy warm-up) and ignores later requests' temperature, top_p and seed (transformers "
                            "5.x CBGenerateManager), so its sampled requests decode greedily")
            tf_results = _run_server(tf, server, str(folder), work, clients, startup_timeout_s, say)
            tf.greedy_same_text = _same_greedy_text(work, dk_results, tf_results)
    else:
        notes.append("transformers serve was not run (--baseline none)")
    peer_ratios: dict[str, dict[str, float | None]] = {}
    for name, url in peers:
        key = f"peer:{name}"
        fig = figures[key] = ServerFigures(name)
        peer_results = _run_peer_url(fig, url, work, clients, say)
        fig.greedy_same_text = _same_greedy_text(work, dk_results, peer_results)
        if fig.unavailable is None:
            peer_ratios[name] = _ratios(figures["decodekit"], fig)
    sampled = sum(not r.greedy for r in work)
    workload = {"name": "serve", "num_requests": len(work), "clients": clients, "seed": seed,
                "greedy": len(work) - sampled, "sampled": sampled,
                "max_tokens_min": min(r.max_tokens for r in work), "max_tokens_max": max(r.max_tokens for r in work),
                "max_tokens_total": sum(r.max_tokens for r in work)}
    return ServeBenchResult(workload, loaded.model, dtype, clients, figures, _ratios(figures["decodekit"], tf),
                            env, notes, peer_ratios)


# ---- rendering -----------------------------------------------------------------------------------------------------
def _ms(value: float | None) -> str:
    return MISSING if value is None else f"{value * 1000:.1f}"


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return MISSING if value is None else fmt.format(value)


def render_serve_table(result: ServeBenchResult, console: Console | None = None) -> Table:
    """Print the result as a table (one row per server and a ratio row) followed by its notes."""
    console = console or Console()
    w, env = result.workload, result.environment
    title = (f"serve: {w['num_requests']} chat requests ({w['greedy']} greedy, {w['sampled']} sampled), max_tokens "
             f"{w['max_tokens_min']}-{w['max_tokens_max']}, {result.clients} streaming clients | {result.model} "
             f"{result.dtype}, server threads: {env.get('server_threads')}")
    table = Table(title=title, title_justify="left")
    for header in ("server", "ok", "errors", "tokens", "wall s", "tok/s", "TTFT p50 ms", "TTFT p99 ms",
                   "TPOT p50 ms", "TPOT p99 ms", "RSS MiB", "greedy same text"):
        # fold rather than cut (a server's name, a figure): in a terminal too narrow nothing ends in an ellipsis
        table.add_column(header, justify="left" if header == "server" else "right", overflow="fold")
    for fig in result.servers.values():
        if fig.unavailable is not None:
            table.add_row(f"{fig.name} [red](not run)[/red]", *([MISSING] * 11))
            continue
        same = MISSING if fig.greedy_same_text is None else f"{fig.greedy_same_text:.0%}"
        table.add_row(fig.name, f"{fig.completed}/{fig.requests}", str(fig.errors), str(fig.generated_tokens),
                      _num(fig.wall_s), _num(fig.tokens_per_s), _ms(fig.ttft_p50_s), _ms(fig.ttft_p99_s),
                      _ms(fig.tpot_p50_s), _ms(fig.tpot_p99_s), _num(fig.rss_mb_end, "{:.0f}"), same)
    for label, r in [("transformers", result.ratios), *result.peer_ratios.items()]:
        if any(v is not None for v in r.values()):
            table.add_row(f"[bold]decodekit / {escape(label)}[/bold]", "", "", "", "",
                          _num(r["tokens_per_s"], "{:.2f}x"), *(_num(r[k], "{:.2f}x") for k in RATIO_FIELDS[1:]),
                          "", "")
    print_table(console, table)  # piped or redirected: as wide as the names need
    for fig in result.servers.values():
        if fig.unavailable is not None:
            console.print(f"[red]{fig.name} did not run: {fig.unavailable}[/red]", soft_wrap=True)
        if fig.tokens_from is not None:
            console.print(f"{fig.name}: generated tokens counted from {fig.tokens_from}")
        for sample in fig.error_samples:
            console.print(f"[red]{fig.name} error: {sample}[/red]", soft_wrap=True)
        for note in fig.notes:
            console.print(f"{fig.name}: {note}")
    for note in result.notes:
        console.print(f"[dim]{note}[/dim]")
    console.print(f"machine: {escape(result.machine)} | {env.get('date')}", soft_wrap=True, highlight=False)
    return table


def serve_result_json(result: ServeBenchResult) -> str:
    """The result as an indented JSON document."""
    return json.dumps(result.to_dict(), indent=2, default=str)


__all__ = ["ChatRequest", "ServeBenchResult", "ServerFigures", "ServerProcess", "StreamResult", "make_chat_workload",
           "parse_peer_url", "post_chat", "render_serve_table", "run_clients", "run_serve_benchmark",
           "serve_result_json", "served_model", "stream_chat"]
