"""`run_benchmark`: decodekit against baselines, side by side in one process, interleaved, with medians.

One HF model object is loaded once and shared by every system. Each system is warmed up once (untimed);
then every round gives the same requests to each system in turn (A B C A B C ...). A round's token ids are
fresh (see `Workload.requests`), so no system serves a repeated prompt from cache. Figures are medians over
rounds; the ratios decodekit / baseline are medians of the per-round (paired) ratios.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import resource
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from decodekit.api.config import EngineConfig
from decodekit.api.errors import ConfigError
from decodekit.api.startup_heap import frozen_heap
from decodekit.bench.baselines import SYSTEMS, RunRecord, System, build_system
from decodekit.bench.machine import environment
from decodekit.bench.metrics import median
from decodekit.bench.peers import PeerSpec, build_peer, check_peers, parse_peer, peer_names
from decodekit.bench.progress import BenchProgress
from decodekit.bench.report import BenchResult, SystemFigures, summarize
from decodekit.bench.workloads import WORKLOADS, Workload, default_baselines, make_workload
from decodekit.execution.kernels.native import load_kernels
from decodekit.execution.kernels.quant import fixed_point_formats
from decodekit.models import BUNDLED_MODEL_NAME, load_model
from decodekit.models.gguf_weights import stored_formats as count_stored_formats

log = logging.getLogger("decodekit.bench")


def _rss_bytes() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _RssSampler:
    """Samples this process's resident memory in a thread while a system runs; `peak` is the maximum seen."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-rss", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, _rss_bytes())

    def __enter__(self) -> _RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def _setup(builders: Mapping[str, Callable[[], System]], figures: dict[str, SystemFigures], work: Workload,
           progress: BenchProgress) -> dict[str, System]:
    """Build and warm up every system; a baseline that fails is reported in its figures and left out (the
    first system, the reference, must come up)."""
    systems: dict[str, System] = {}
    for name, build in builders.items():
        try:
            progress.stage(f"{name}: setting up and warming up")
            system = build()
            started = time.perf_counter()
            system.prepare(work)
            log.info("%s ready (warm-up %.1fs)", name, time.perf_counter() - started)
            systems[name] = system
            figures[name].notes.extend(system.notes)
        except Exception as exc:
            figures[name].error = f"setup failed: {exc!r}"
            log.exception("%s setup failed", name)
    reference = next(iter(builders))
    if reference not in systems:
        for system in systems.values():
            system.close()
        raise RuntimeError(f"{reference} could not be set up: {figures[reference].error}")
    return systems


def _run_rounds(systems: dict[str, System], figures: dict[str, SystemFigures],
                records: dict[str, list[RunRecord]], work: Workload, repeats: int, limit_s: float,
                progress: BenchProgress) -> None:
    """The interleaved rounds: each round's requests go to every live system in turn."""
    for round_index in range(repeats):
        requests = work.requests(round_index)
        for name in list(systems):
            progress.round_started(name, round_index, repeats, len(requests))
            try:
                with _RssSampler() as rss:
                    record = systems[name].run(requests, progress.requests_done)
                # a peer in a subprocess measures its own processes; this process's RSS says nothing of it
                if record.peak_rss_bytes is None:
                    record.peak_rss_bytes = rss.peak
                record.round_index = round_index
            except Exception as exc:
                figures[name].error = f"round {round_index} failed: {exc!r}"
                log.exception("%s failed in round %d", name, round_index)
                systems.pop(name).close()
                continue
            records[name].append(record)
            progress.round_finished(name, round_index, repeats, record)
            log.info("round %d %s: %.2fs, %.1f tok/s", round_index, name, record.wall_s,
                     record.useful_tokens / record.wall_s)
            if record.wall_s > limit_s and round_index + 1 < repeats:
                figures[name].notes.append(f"stopped after round {round_index}: {record.wall_s:.0f}s > "
                                           f"time limit {limit_s:.0f}s")
                systems.pop(name).close()


def measure(builders: Mapping[str, Callable[[], System]], work: Workload, repeats: int, *, time_limit_s: float = 600.0,
            progress: BenchProgress | None = None) -> tuple[dict[str, SystemFigures], dict[str, float | None],
                                                            list[str]]:
    """Set up the systems, run `repeats` interleaved rounds of `work`, and summarize them.

    Args:
        builders: system name -> a function building that system; the first is the reference (decodekit) that
            every other is compared with, and must set up (else RuntimeError).
        work: the workload; round r gives every system `work.requests(r)`.
        repeats: rounds.
        time_limit_s: a system whose round takes longer is not run again (noted in its figures).
        progress: told of each stage, round and finished request.

    Returns:
        Each system's figures (medians over its rounds), the ratios reference / system (the median of the
        per-round paired ratios of useful tokens/s) for every other system, and notes.
    """
    progress = progress or BenchProgress()
    names = list(builders)
    figures = {n: SystemFigures(n) for n in names}
    records: dict[str, list[RunRecord]] = {n: [] for n in names}
    systems = _setup(builders, figures, work, progress)
    try:
        # every system built: the collections the rounds trigger skip their objects, as in a serving process
        with frozen_heap():
            _run_rounds(systems, figures, records, work, repeats, time_limit_s, progress)
    finally:
        for system in systems.values():
            system.close()
    notes: list[str] = []
    reference_name = names[0]
    reference = {r.round_index: r.outputs for r in records[reference_name]}
    speed = {name: {r.round_index: r.useful_tokens / r.wall_s for r in recs} for name, recs in records.items()}
    for name in names:
        summarize(figures[name], records[name], None if name == reference_name else reference)
        if figures[name].rounds and figures[name].useful_tokens != work.total_output_tokens:
            notes.append(f"{name} produced {figures[name].useful_tokens} useful tokens, "
                         f"expected {work.total_output_tokens}")
    ratios: dict[str, float | None] = {}
    for name in names[1:]:
        paired = [speed[reference_name][i] / speed[name][i] for i in speed[name] if i in speed[reference_name]]
        ratios[name] = median(list(paired))
    return figures, ratios, notes


def run_benchmark(
    workload: str,
    *,
    model: Any = BUNDLED_MODEL_NAME,
    dtype: Any = "auto",
    num_requests: int = 64,
    batch_size: int = 16,
    output_len: int = 64,
    repeats: int = 3,
    baselines: tuple[str, ...] | list[str] | None = None,
    seed: int = 0,
    engine_options: dict[str, Any] | None = None,
    hf_model: Any = None,
    tokenizer: Any = None,
    prompt_len: int = 32,
    time_limit_s: float = 600.0,
    num_threads: int | None = None,
    progress: BenchProgress | None = None,
    peers: Sequence[str | PeerSpec] = (),
) -> BenchResult:
    """Benchmark decodekit against baselines on one workload; see the module docstring for the method.

    Args:
        workload: "batch1", "batch", "mixed" or "ttft" (see `decodekit.bench.workloads.make_workload`).
        model: what to load when `hf_model` is not given (name, folder, .gguf, hub id).
        dtype: "auto", "float32", "bfloat16", "float16" (the shared model is cast once; every system uses it).
        num_requests, batch_size, output_len, prompt_len: the workload's size (`batch_size` is also static
            batching's batch size).
        repeats: rounds; figures are medians over them.
        baselines: any of "hf-sequential", "hf-static", "hf-cb"; default depends on the workload
            (batch1/ttft: hf-sequential; batch: hf-static; mixed: hf-static + hf-cb).
        seed: the workload seed.
        engine_options: `EngineConfig` fields for decodekit (kv_cache_memory, max_num_seqs,
            max_num_batched_tokens, block_size, ...); hf-cb sizes its KV cache and batch limits from them too.
        hf_model, tokenizer: an already-loaded HF model object and its tokenizer (then `model` is ignored).
        time_limit_s: a system whose round takes longer than this is not run again (noted in the result).
        num_threads: torch threads for the run (restored afterwards); default torch's current setting. On a
            shared 2-core machine, 1 thread is far steadier when a neighbour process is busy.
        progress: told of each stage, round and finished request (`RichBenchProgress` draws a bar).
        peers: other engines run side by side on the same token ids (`decodekit.bench.peers`): "vllm=/path/to/python",
            "llama.cpp" or "llama.cpp=/path/to/python", or `PeerSpec`s. They are checked before the model loads
            (PeerUnavailable says what is missing and how to install it) and run in the precision paired with
            decodekit's (its dtype; Q8_0 for llama.cpp beside `quantization: int8`), on as many cores as decodekit's
            torch threads.

    Raises:
        PeerUnavailable: a peer cannot run (before anything loads).
    """
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}")
    if repeats < 1:
        raise ValueError(f"`repeats` must be >= 1, got {repeats}")
    chosen = list(default_baselines(workload) if baselines is None else baselines)
    unknown = [b for b in chosen if b not in SYSTEMS[1:]]
    if unknown:
        raise ValueError(f"unknown baseline(s) {unknown}; choose from {', '.join(SYSTEMS[1:])}")
    options = checked_engine_options(engine_options)
    specs = [p if isinstance(p, PeerSpec) else parse_peer(p) for p in peers]
    if specs:  # before anything loads: a missing peer fails in seconds, not after the model and decodekit are up
        check_peers(specs, model if hf_model is None else hf_model)
    with torch_threads(num_threads):
        return _benchmark(workload, chosen, model, dtype, hf_model, tokenizer, options, repeats, time_limit_s,
                          dict(num_requests=num_requests, batch_size=batch_size, output_len=output_len,
                               prompt_len=prompt_len, seed=seed), progress or BenchProgress(), specs)


def _benchmark(workload: str, chosen: list[str], model: Any, dtype: Any, hf_model: Any, tokenizer: Any,
               options: dict[str, Any], repeats: int, time_limit_s: float, sizes: dict[str, int],
               progress: BenchProgress, peers: list[PeerSpec] | None = None) -> BenchResult:
    env = environment()  # the code, the machine and the settings as the run starts
    env["dtype_requested"] = str(dtype).removeprefix("torch.")
    progress.stage(f"loading {model if hf_model is None else 'the model'}")
    if hf_model is None:
        loaded = load_model(model, tokenizer, dtype=dtype)
        hf_model, tokenizer, model_name = loaded.model, loaded.tokenizer, loaded.name
    else:
        if tokenizer is None:
            raise ValueError("`tokenizer` is needed with `hf_model`")
        loaded = load_model(hf_model, tokenizer, dtype=dtype)  # casts the shared object in place if asked
        hf_model, model_name = loaded.model, loaded.name
    vocab = hf_model.config.get_text_config().vocab_size
    work = make_workload(workload, tokenizer, vocab_size=vocab, **sizes)
    names = ["decodekit", *[b for b in chosen if b != "decodekit"]]
    builders: dict[str, Callable[[], System]] = {
        name: functools.partial(build_system, name, hf_model, tokenizer, dtype=loaded.dtype,
                                batch_size=sizes["batch_size"], engine_options=options) for name in names}
    dtype_name = str(loaded.dtype).removeprefix("torch.")
    stored = stored_formats(loaded) if options.get("quantization") in (None, "gguf") else ""
    if stored:
        # a GGUF under dtype auto: decodekit runs its blocks as stored (it loads the file itself: the shared object
        # is the dequantized model the baselines run), llama.cpp reads the same file
        builders["decodekit"] = functools.partial(build_system, "decodekit", model, tokenizer, dtype="auto",
                                                  batch_size=sizes["batch_size"], engine_options=options)
        env["weights"] = f"as stored ({stored})"
    for peer_name, spec in zip(peer_names(peers or []), peers or [], strict=True):
        builders[peer_name] = functools.partial(_build_peer, spec, peer_name, model, dtype_name, options, env,
                                                stored)
    figures, ratios, notes = measure(builders, work, repeats, time_limit_s=time_limit_s, progress=progress)
    if stored:
        notes.append(f"decodekit ran the GGUF's weights as stored ({stored}; {stored_activations()}), loading the "
                     "file itself; the baselines run the dequantized float32 model; llama.cpp reads the same file")
    if peers:
        notes.append("same tokens: the share of requests whose greedy tokens equal decodekit's; common prefix: the "
                     "mean over requests of the share of decodekit's tokens matched before the first difference")
    notes.append("TTFT is measured from the round's start (all requests arrive at once); TPOT per request "
                 "is (last token - first token) / (tokens - 1); peak RSS is the whole process while that "
                 "system ran (the shared model and decodekit's KV pool stay resident throughout)")
    env["process_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return BenchResult(work.describe(), model_name, dtype_name, str(loaded.device), repeats, figures, ratios,
                       options, env, notes)


def stored_activations() -> str:
    """What decodekit's products of stored GGUF weights multiply: float32 activations, or on the AVX2 and AVX-512
    paths (unless `$DECODEKIT_GGUF_ACTIVATIONS=float32`) some formats times activations in 16-bit fixed point."""
    kernels = load_kernels()
    try:
        isa = "" if isinstance(kernels, str) else kernels.quant.isa()
        formats = fixed_point_formats(isa) if isa else ()
    except ValueError:  # a bad variable: the engine build refuses it, naming it
        formats = ()
    if not formats:
        return "float32 activations"
    return f"{', '.join(formats)} by activations in 16-bit fixed point per block of 32 ({isa}), the rest float32"


def stored_formats(loaded: Any) -> str:
    """The formats of the weights `loaded` keeps as its file stores them, most frequent first ("Q4_1, Q8_0"), or ""
    when it keeps none."""
    counts = count_stored_formats(getattr(loaded, "stored", {}))
    return ", ".join(sorted(counts, key=lambda name: -counts[name]))


def _build_peer(spec: PeerSpec, name: str, model: Any, dtype: str, options: dict[str, Any],
                env: dict[str, Any], stored: str = "") -> System:
    """Start a peer on the run's model, dtype and threads (and decodekit's weights as stored, when it runs them
    so); its version and binding go into the machine line."""
    system = build_peer(spec, model=model, dtype=dtype, threads=torch.get_num_threads(),
                        quantization=options.get("quantization"), name=name, stored=stored)
    describe = getattr(system, "describe", None)
    if callable(describe):
        env.setdefault("peers", {})[name] = describe()
    return system


def checked_engine_options(engine_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """`engine_options` as a dict, checked against `EngineConfig` before anything loads.

    Raises:
        ConfigError: an unknown option or a bad value.
    """
    options = dict(engine_options or {})
    try:
        EngineConfig(**options)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise ConfigError(f"bad engine_options: {exc}") from exc
    return options


@contextlib.contextmanager
def torch_threads(num_threads: int | None) -> Iterator[None]:
    """Run with `num_threads` torch threads (None: as they are), and put the count back afterwards."""
    before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
