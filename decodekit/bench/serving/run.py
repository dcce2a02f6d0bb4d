"""`decodekit bench serve`, the run: each server started in turn (or reached where it already runs), warmed up,
timed on the same workload from N streaming clients, and stopped; the figures of each, and the ratios."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Sequence
from pathlib import Path

from decodekit.bench.machine import environment
from decodekit.bench.serving.client import StreamResult, run_clients, served_model, warm_up
from decodekit.bench.serving.process import ServerProcess, ServerStartError
from decodekit.bench.serving.report import ServeBenchResult, ServerFigures, ratios, same_greedy_text, summarize_run
from decodekit.bench.serving.servers import decodekit_server, model_folder, transformers_server
from decodekit.bench.serving.workload import ChatRequest, make_chat_workload

DEFAULT_RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "quickstart.yaml"
"""The recipe `decodekit bench serve` serves by default (the bundled model, from the source checkout)."""


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
    send each the same workload through `clients` streaming clients (see `decodekit.bench.serving` for the method).

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

    from decodekit.api.config import EngineConfig
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
            tf.greedy_same_text = same_greedy_text(work, dk_results, tf_results)
    else:
        notes.append("transformers serve was not run (--baseline none)")
    peer_ratios: dict[str, dict[str, float | None]] = {}
    for name, url in peers:
        key = f"peer:{name}"
        fig = figures[key] = ServerFigures(name)
        peer_results = _run_peer_url(fig, url, work, clients, say)
        fig.greedy_same_text = same_greedy_text(work, dk_results, peer_results)
        if fig.unavailable is None:
            peer_ratios[name] = ratios(figures["decodekit"], fig)
    sampled = sum(not r.greedy for r in work)
    workload = {"name": "serve", "num_requests": len(work), "clients": clients, "seed": seed,
                "greedy": len(work) - sampled, "sampled": sampled,
                "max_tokens_min": min(r.max_tokens for r in work), "max_tokens_max": max(r.max_tokens for r in work),
                "max_tokens_total": sum(r.max_tokens for r in work)}
    return ServeBenchResult(workload, loaded.model, dtype, clients, figures, ratios(figures["decodekit"], tf),
                            env, notes, peer_ratios)


__all__ = ["DEFAULT_RECIPE", "parse_peer_url", "run_serve_benchmark"]
