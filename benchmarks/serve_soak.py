"""A bounded soak of `decodekit serve`: many clients, mixed traffic, for a few minutes; then checks what is left.

Usage: python benchmarks/serve_soak.py [--minutes 3] [--clients 8] [--recipe recipes/quickstart.yaml] [--seed 0]
                                       [--threads N] [--json]

It starts `decodekit serve RECIPE` (the bundled model by default) on a free loopback port and computes, one request at
a time, a reference answer per prompt: greedy, and sampled with each of a few seeds. Then `--clients` clients send,
until the time is up, a random mix of:

- greedy requests, streamed or not, whose text must equal the prompt's greedy reference;
- seeded sampled requests, streamed or not, whose text must equal the reference for that prompt and seed;
- streams the client closes after a few chunks (a disconnect mid-stream);
- bad requests (a negative temperature, an unknown field, a bad role, no messages, an unsupported field, a body that
  is not JSON, a prompt longer than the context), which must be answered 400.

It stops by itself and reports: requests done by kind, unexpected errors, mismatched and lost responses (no response,
or a stream that ended without a finish reason), the server's RSS at the start, middle and end (and the highest
seen), and, once the server is idle, the KV blocks still in use according to /metrics (should be 0) with the other
engine gauges. Exits 1 if anything unexpected happened.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from decodekit.bench.serving.client import StreamResult, post_chat, stream_chat
from decodekit.bench.serving.process import ServerProcess
from decodekit.bench.serving.run import DEFAULT_RECIPE
from decodekit.bench.serving.servers import decodekit_server
from decodekit.bench.serving.workload import ChatRequest, make_chat_workload

SEEDS = (11, 222, 3333)
MAX_TOKENS = (16, 32, 48, 64)
KINDS = {"greedy-stream": 25, "greedy": 15, "sampled-stream": 20, "sampled": 10, "disconnect": 15, "bad": 15}
"""Each request's kind, drawn with these weights."""


def bad_requests(model: str) -> list[tuple[str, dict[str, Any] | bytes]]:
    """Requests the server must answer 400: (what, body)."""
    hello = [{"role": "user", "content": "Hello"}]
    return [
        ("negative temperature", {"model": model, "messages": hello, "temperature": -1}),
        ("unknown field", {"model": model, "messages": hello, "temprature": 0.5}),
        ("bad role", {"model": model, "messages": [{"role": "robot", "content": "Hi"}]}),
        ("no messages", {"model": model, "messages": []}),
        ("top_p over 1", {"model": model, "messages": hello, "top_p": 2}),
        ("tools", {"model": model, "messages": hello,
                   "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
        ("not JSON", b'{"model": "m", "messages": ['),
        ("prompt longer than the context", {"model": model, "messages": [
            {"role": "user", "content": "word " * 9000}], "max_tokens": 4}),
    ]


@dataclass
class Tally:
    """What the clients saw."""

    done: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    tokens: int = 0

    def problem(self, where: list[str], text: str) -> None:
        where.append(text)
        print(f"  ! {text}", file=sys.stderr, flush=True)


def _lost(result: StreamResult) -> bool:
    return result.status is None or result.error == "the stream ended without a finish reason"


async def _references(client: httpx.AsyncClient, url: str, model: str, prompts: list[ChatRequest]
                      ) -> tuple[list[str], dict[tuple[int, int], str]]:
    """Each prompt's greedy answer and its sampled answer per seed, one request at a time."""
    greedy, sampled = [], {}
    for i, prompt in enumerate(prompts):
        result = await post_chat(client, url, prompt.body(model, stream=False))
        if result.error is not None:
            raise RuntimeError(f"reference request {i} failed: {result.error}")
        greedy.append(result.text)
        for seed in SEEDS:
            result = await post_chat(client, url, _sampled(prompt, seed).body(model, stream=False))
            if result.error is not None:
                raise RuntimeError(f"reference request {i} (seed {seed}) failed: {result.error}")
            sampled[i, seed] = result.text
    return greedy, sampled


def _sampled(prompt: ChatRequest, seed: int) -> ChatRequest:
    return ChatRequest(prompt.messages, prompt.max_tokens, seed=seed, temperature=0.8, top_p=0.95)


async def _client(index: int, deadline: float, client: httpx.AsyncClient, url: str, model: str,
                  prompts: list[ChatRequest], greedy: list[str], sampled: dict[tuple[int, int], str],
                  tally: Tally, rng: random.Random) -> None:
    bad = bad_requests(model)
    kinds, weights = list(KINDS), list(KINDS.values())
    while time.monotonic() < deadline:
        kind = rng.choices(kinds, weights)[0]
        p = rng.randrange(len(prompts))
        label = f"client {index} {kind} prompt {p}"
        if kind == "bad":
            what, body = rng.choice(bad)
            stream = rng.random() < 0.5
            if isinstance(body, bytes):
                response = await client.post(url, content=body, headers={"content-type": "application/json"})
                status, error = response.status_code, response.text
            else:
                body = {**body, "stream": stream}
                result = await (stream_chat(client, url, body) if stream else post_chat(client, url, body))
                status, error = result.status, result.error or ""
            if status != 400:
                tally.problem(tally.unexpected, f"{label} ({what}): expected 400, got {status}: {error[:200]}")
            tally.done[f"bad ({what})"] += 1
            continue
        if kind == "disconnect":
            body = {**prompts[p].body(model), "max_tokens": 200, "ignore_eos": True}
            result = await stream_chat(client, url, body, disconnect_after=rng.randint(1, 6))
            if result.error is not None or not result.disconnected:
                where = tally.lost if _lost(result) else tally.unexpected
                tally.problem(where, f"{label}: {result.error or 'ended before the disconnect'}")
            tally.done[kind] += 1
            continue
        seed = rng.choice(SEEDS)
        request = prompts[p] if kind.startswith("greedy") else _sampled(prompts[p], seed)
        expected = greedy[p] if kind.startswith("greedy") else sampled[p, seed]
        stream = kind.endswith("stream")
        result = await (stream_chat(client, url, request.body(model)) if stream
                        else post_chat(client, url, request.body(model, stream=False)))
        tally.done[kind] += 1
        if result.error is not None:
            tally.problem(tally.lost if _lost(result) else tally.unexpected, f"{label}: {result.error}")
        elif result.usage_tokens is None:
            tally.problem(tally.unexpected, f"{label}: no usage in the response")
        elif result.text != expected:
            tally.problem(tally.mismatched, f"{label}{'' if kind.startswith('greedy') else f' seed {seed}'}: "
                                            f"{result.text[:80]!r} != reference {expected[:80]!r}")
        else:
            tally.tokens += result.tokens


def _metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _wait_idle(url: str, timeout_s: float = 60.0) -> dict[str, float]:
    """The metrics once nothing runs or waits (or when the time is up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = _metrics(url)
        idle = metrics["decodekit_num_requests_running"] == 0 and metrics["decodekit_num_requests_waiting"] == 0
        if (idle and metrics["decodekit_kv_cache_blocks_used"] == 0) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.2)


def _mib(value: int | None) -> float | None:
    return None if value is None else round(value / 2**20, 1)


async def soak(server: ServerProcess, model: str, minutes: float, clients: int, seed: int) -> dict[str, Any]:
    url = f"{server.url}/v1/chat/completions"
    prompts = [ChatRequest(r.messages, r.max_tokens) for r in make_chat_workload(8, seed, sampled_share=0.0,
                                                                                   max_notes=6, max_tokens=MAX_TOKENS)]
    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=30.0), limits=limits) as client:
        started = time.monotonic()
        greedy, sampled = await _references(client, url, model, prompts)
        print(f"references: {len(greedy)} greedy, {len(sampled)} sampled, in {time.monotonic() - started:.1f}s",
              file=sys.stderr, flush=True)
        rss = {"start": server.rss_bytes()}
        highest = rss["start"] or 0
        tally = Tally()
        begin = time.monotonic()
        deadline = begin + minutes * 60
        workers = [asyncio.create_task(_client(i, deadline, client, url, model, prompts, greedy, sampled, tally,
                                               random.Random(f"{seed}:{i}"))) for i in range(clients)]
        while not all(w.done() for w in workers):
            await asyncio.sleep(5)
            now = server.rss_bytes()
            highest = max(highest, now or 0)
            if "middle" not in rss and time.monotonic() >= begin + minutes * 30:
                rss["middle"] = now
            print(f"  {time.monotonic() - begin:5.0f}s: {sum(tally.done.values())} requests, RSS "
                  f"{_mib(now)} MiB", file=sys.stderr, flush=True)
        for w in workers:
            w.result()  # a client that crashed is a bug in this script: let it raise
        elapsed = time.monotonic() - begin
    metrics = _wait_idle(server.url)
    rss["end"] = server.rss_bytes()
    return {
        "minutes": minutes, "clients": clients, "seconds": round(elapsed, 1),
        "requests_done": sum(tally.done.values()), "by_kind": dict(sorted(tally.done.items())),
        "checked_tokens": tally.tokens,
        "unexpected_errors": len(tally.unexpected), "mismatched": len(tally.mismatched), "lost": len(tally.lost),
        "problems": (tally.unexpected + tally.mismatched + tally.lost)[:20],
        "rss_mib": {k: _mib(v) for k, v in rss.items()} | {"highest": _mib(highest)},
        "kv_blocks_used_end": metrics["decodekit_kv_cache_blocks_used"],
        "kv_blocks_total": metrics["decodekit_kv_cache_blocks_total"],
        "running_end": metrics["decodekit_num_requests_running"],
        "waiting_end": metrics["decodekit_num_requests_waiting"],
        "preemptions": metrics["decodekit_num_preemptions_total"],
        "engine_finished": {k.split("{")[1].rstrip("}"): v for k, v in metrics.items()
                            if k.startswith("decodekit_requests_total{")},
        "http_errors": {k.split("{")[1].rstrip("}"): v for k, v in metrics.items()
                        if k.startswith("decodekit_http_errors_total{")},
        "generated_tokens_server": metrics["decodekit_generation_tokens_total"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="how long the clients send requests")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE)
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts and each client's choices")
    parser.add_argument("--threads", type=int, default=None, help="the server's torch threads (default torch's)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args()
    from decodekit.recipe import load_recipe

    model = load_recipe(args.recipe).model
    server = decodekit_server(args.recipe, threads=args.threads)
    started = time.monotonic()
    with server.start(timeout_s=300):
        print(f"decodekit serve up in {time.monotonic() - started:.1f}s (pid {server.pid}, {server.url})",
              file=sys.stderr, flush=True)
        report = asyncio.run(soak(server, model, args.minutes, args.clients, args.seed))
        report["server_exit_status"] = server.stop()
    report["server_log_tail"] = server.log_tail(5).splitlines()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
    bad = report["unexpected_errors"] or report["mismatched"] or report["lost"] or report["kv_blocks_used_end"] \
        or report["server_exit_status"] != 0
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
