"""`decodekit bench matrix`: decodekit against transformers in every cell of dtype x batch size x strategy.

Each cell is one `decodekit.bench.harness.measure` run in this process: decodekit and its transformers baseline
on the same loaded model and the same requests, warmed up, then `repeats` interleaved rounds (A B A B ...), with
the medians of useful tokens/s and the median of the per-round ratios decodekit / transformers. The cells:

- **greedy**: prompts of `prompt_len` random ordinary token ids (fresh each round, as `bench batch1` and
  `bench batch`), every request generating exactly `output_len` tokens (EOS ignored); transformers: `generate`
  on the same batch, left-padded.
- **speculative**: the n-gram proposer (`NGRAM_STRATEGY`: k 4, adaptive), on the copy-style prompts
  (`COPY_PROMPTS`: repeat, rewrite, add type hints, summarize); transformers: its own prompt-lookup decoding
  (`generate(prompt_lookup_num_tokens=10)`) at batch 1; above batch 1 plain greedy `generate`, because
  transformers' assisted generation runs only at batch size 1 (the table says which).
- **beam**: beam search with 4 beams on summarization prompts (`summary_texts`, as benchmarks/strategies.py);
  transformers: `generate(num_beams=4)`.

Speculative and beam requests hold EOS off with `min_tokens` (transformers: `min_new_tokens`), so both sides
generate exactly `output_len` tokens and their outputs can be compared token for token ("same tokens"). A cell of
batch b has b requests, all submitted at once (decodekit) or as one batch (transformers); a batch-1 cell has
`batch1_requests` requests that both run one after another. The text prompts are tagged per request and round,
so decodekit's prefix cache finds nothing to reuse (transformers has none).

Every dtype loads the model once; decodekit builds one engine per dtype (its KV pool and sequence limit sized for
the largest cell unless the engine options say otherwise) and each cell runs its strategy on it.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from decodekit.api.config import EngineConfig
from decodekit.bench.baselines import DecodekitSystem, HFGenerateSystem, OnDone, RunRecord, System, kv_bytes_per_token
from decodekit.bench.harness import checked_engine_options, measure, torch_threads
from decodekit.bench.machine import environment, machine_line
from decodekit.bench.peers import PeerSpec, build_peer, check_peers, parse_peer, peer_names
from decodekit.bench.progress import BenchProgress
from decodekit.bench.report import MISSING, SystemFigures, jsonable
from decodekit.bench.workloads import (
    COPY_PROMPTS,
    DEFAULT_PROMPT_LEN,
    BenchRequest,
    Workload,
    make_text_workload,
    safe_token_pool,
    summary_texts,
)
from decodekit.models import BUNDLED_MODEL_NAME, load_model
from decodekit.models.loader import resolve_dtype
from decodekit.tables import print_table

log = logging.getLogger("decodekit.bench")

STRATEGIES = ("greedy", "speculative", "beam")
"""The strategies of the matrix, in table order."""
DEFAULT_BATCHES = (1, 8, 64)
DEFAULT_DTYPES = ("float32", "auto")
NUM_BEAMS = 4
HF_PROMPT_LOOKUP_TOKENS = 10
"""transformers' `prompt_lookup_num_tokens` for its speculative baseline (the value its documentation shows;
decodekit's adaptive n-gram drafts grow from 4 to 10 tokens)."""
NGRAM_STRATEGY = {"speculative": {"proposer": "ngram", "num_speculative_tokens": 4, "adaptive": True}}
"""decodekit's side of the speculative cells: prompt lookup, like for like with transformers' (the shipped recipe's
draft-model settings are compared in benchmarks/strategies.py)."""
BATCH1_REQUESTS = 4


@dataclass
class MatrixCell:
    """One cell: decodekit and its transformers baseline on one dtype, batch size and strategy.

    Attributes:
        decodekit_runs: what decodekit ran, in words; `baseline`: what transformers ran.
        ratio: the median over rounds of decodekit's useful tokens/s over transformers' (None if either failed).
        workload: the cell's workload (`Workload.describe()`).
        error: why the cell has no figures (it could not be set up), else None.
    """

    dtype: str
    batch: int
    strategy: str
    decodekit_runs: str
    baseline: str
    decodekit: SystemFigures
    transformers: SystemFigures
    ratio: float | None = None
    workload: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    peers: dict[str, SystemFigures] = field(default_factory=dict)  # greedy cells: each peer's figures
    peer_ratios: dict[str, float | None] = field(default_factory=dict)  # decodekit / peer, median per round


@dataclass
class MatrixResult:
    """Every cell of a matrix run, and its context."""

    model: str
    device: str
    dtypes: list[str]
    batches: list[int]
    strategies: list[str]
    repeats: int
    output_len: int
    cells: list[MatrixCell]
    engine_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # per dtype, as decodekit ran
    environment: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    peers: list[str] = field(default_factory=list)  # the peers' column names (`--peer`), in order

    @property
    def machine(self) -> str:
        """The machine line (`decodekit.bench.machine.machine_line`), with every dtype the matrix ran."""
        return machine_line(self.environment, ", ".join(self.dtypes), device=self.device,
                            dtype_requested=self.environment.get("dtype_requested"))

    def cell(self, dtype: str, batch: int, strategy: str) -> MatrixCell:
        """The cell for a dtype, batch size and strategy (KeyError if the matrix has none)."""
        for c in self.cells:
            if (c.dtype, c.batch, c.strategy) == (dtype, batch, strategy):
                return c
        raise KeyError((dtype, batch, strategy))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict of the whole result, with the machine line as `machine`."""
        return {**asdict(self), "machine": self.machine}


def resolve_dtypes(dtypes: Sequence[str], device: torch.device) -> tuple[list[torch.dtype], list[str]]:
    """The dtypes to run (`auto` resolved for `device`, duplicates dropped, order kept), and the names asked."""
    out: list[torch.dtype] = []
    for name in dtypes:
        resolved = resolve_dtype(name, device)
        if resolved not in out:
            out.append(resolved)
    return out, list(dtypes)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cell_workload(strategy: str, batch: int, requests: int, tokenizer: Any, output_len: int, prompt_len: int,
                   seed: int, vocab: int) -> Workload:
    if strategy == "greedy":
        return Workload("greedy", [prompt_len] * requests, [output_len] * requests, batch,
                        safe_token_pool(tokenizer, vocab), seed)
    texts = COPY_PROMPTS if strategy == "speculative" else summary_texts(requests)
    return make_text_workload("copy" if strategy == "speculative" else "summarize", tokenizer, list(texts),
                              num_requests=requests, output_len=output_len, batch_size=batch, seed=seed,
                              vocab_size=vocab)


def _describe(strategy: str, batch: int, spec: dict[str, Any] | None) -> tuple[str, str, dict[str, Any]]:
    """What decodekit runs, what transformers runs (in words), and transformers' extra `generate` arguments."""
    where = "one request at a time" if batch == 1 else f"one batch of {batch}"
    if strategy == "greedy":
        return "greedy", f"generate, greedy, {where}", {}
    if strategy == "beam":
        return f"{NUM_BEAMS} beams", f"generate(num_beams={NUM_BEAMS}), {where}", \
            {"num_beams": NUM_BEAMS}
    params = (spec or {}).get("speculative", {})
    ours = f"n-gram, k {params.get('num_speculative_tokens', '?')}{', adaptive' if params.get('adaptive') else ''}"
    if batch == 1:
        return ours, f"generate(prompt_lookup_num_tokens={HF_PROMPT_LOOKUP_TOKENS}), {where}", \
            {"prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS}
    return ours, f"generate, greedy, {where} (its prompt lookup runs at batch 1 only)", {}


def _engine_options(user: dict[str, Any], works: Sequence[tuple[str, Workload]], model: Any) -> dict[str, Any]:
    """decodekit's engine options for one dtype: the given ones, with the sequence limit and the KV pool raised
    (unless given) so that the largest cell runs as one batch without preemption."""
    options = dict(user)
    default = EngineConfig()
    beams = {s: NUM_BEAMS if s == "beam" else 1 for s, _ in works}
    widest = max((w.batch_size * beams[s] for s, w in works), default=1)
    options.setdefault("max_num_seqs", max(default.max_num_seqs, widest))
    if "kv_cache_memory" not in options:
        block = EngineConfig(**options).block_size
        # each beam (or draft run) may hold its own last blocks; the prompt's blocks are shared by a request's beams
        tokens = max((sum(p + beams[s] * (o + 2 * block) for p, o in zip(w.prompt_lens, w.output_lens, strict=True))
                      for s, w in works), default=0)
        options["kv_cache_memory"] = max(default.kv_cache_memory, int(tokens * kv_bytes_per_token(model) * 1.25))
    return options


def run_matrix(
    model: Any = BUNDLED_MODEL_NAME,
    *,
    dtypes: Sequence[str] = DEFAULT_DTYPES,
    batches: Sequence[int] = DEFAULT_BATCHES,
    strategies: Sequence[str] = STRATEGIES,
    output_len: int = 64,
    prompt_len: int = DEFAULT_PROMPT_LEN,
    repeats: int = 3,
    batch1_requests: int = BATCH1_REQUESTS,
    seed: int = 0,
    engine_options: dict[str, Any] | None = None,
    hf_model: Any = None,
    tokenizer: Any = None,
    num_threads: int | None = None,
    time_limit_s: float = 600.0,
    progress: BenchProgress | None = None,
    peers: Sequence[str | PeerSpec] = (),
) -> MatrixResult:
    """Run every cell of dtype x batch size x strategy (see the module docstring for the method).

    Args:
        model: what to load when `hf_model` is not given (name, folder, .gguf, hub id).
        dtypes: "float32", "bfloat16", "float16" or "auto" (resolved for the device; duplicates run once).
        batches: batch sizes.
        strategies: any of `STRATEGIES`.
        output_len: tokens every request generates.
        prompt_len: the greedy cells' prompt length (the others' prompts are texts).
        repeats: interleaved rounds per cell; figures are medians.
        batch1_requests: requests of a batch-1 cell (run one after another).
        seed: the greedy prompts' seed.
        engine_options: `EngineConfig` fields for decodekit; `max_num_seqs` and `kv_cache_memory` default to what
            the largest cell needs.
        hf_model, tokenizer: an already-loaded HF model object and its tokenizer (then `model` is ignored); a
            dtype other than its own runs on a cast copy.
        num_threads: torch threads for the run (restored afterwards); default torch's current setting.
        time_limit_s: a system whose round takes longer is not run again in that cell.
        progress: told of each stage, cell, round and finished request.
        peers: other engines (`decodekit.bench.peers`), checked before anything loads, started once per dtype and
            run in the greedy cells beside decodekit and transformers (same token ids, same rounds): vLLM with a
            cell's requests all at once, llama.cpp one after another.

    Raises:
        ValueError: an unknown strategy or dtype, or a size below 1.
        ConfigError: bad engine options.
        PeerUnavailable: a peer cannot run.
    """
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strateg{'y' if len(unknown) == 1 else 'ies'} {unknown}; choose from "
                         f"{', '.join(STRATEGIES)}")
    for label, values in (("batches", list(batches)), ("repeats", [repeats]), ("output_len", [output_len]),
                          ("prompt_len", [prompt_len]), ("batch1_requests", [batch1_requests])):
        if not values or min(values) < 1:
            raise ValueError(f"`{label}` must be >= 1, got {values}")
    if not dtypes or not strategies:
        raise ValueError("a matrix needs at least one dtype and one strategy")
    if hf_model is not None and tokenizer is None:
        raise ValueError("`tokenizer` is needed with `hf_model`")
    options = checked_engine_options(engine_options)
    specs = [p if isinstance(p, PeerSpec) else parse_peer(p) for p in peers]
    if specs:  # before anything loads
        check_peers(specs, model if hf_model is None else hf_model)
    with torch_threads(num_threads):
        return _matrix(model, list(dtypes), list(dict.fromkeys(batches)), list(dict.fromkeys(strategies)),
                       output_len, prompt_len, repeats, batch1_requests, seed, options, hf_model, tokenizer,
                       time_limit_s, progress or BenchProgress(), specs)


def _matrix(model: Any, dtypes: list[str], batches: list[int], strategies: list[str], output_len: int,
            prompt_len: int, repeats: int, batch1_requests: int, seed: int, options: dict[str, Any], hf_model: Any,
            tokenizer: Any, time_limit_s: float, progress: BenchProgress,
            peers: list[PeerSpec] | None = None) -> MatrixResult:
    env = environment()
    if hf_model is not None:
        device = next(hf_model.parameters()).device
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved, asked = resolve_dtypes(dtypes, device)
    env["dtype_requested"] = ", ".join(asked)
    result = MatrixResult(str(model if hf_model is None else ""), str(device), [_dtype_name(d) for d in resolved],
                          batches, strategies, repeats, output_len, [], {}, env)
    names = peer_names(peers or [])
    result.peers = names
    total, done = len(resolved) * len(batches) * len(strategies), 0
    for dtype in resolved:
        name = _dtype_name(dtype)
        progress.scope = ""
        progress.stage(f"{name}: loading the model")
        if hf_model is None:
            loaded = load_model(model, tokenizer, dtype=dtype, device=device)
        else:  # never cast the caller's object: another dtype runs on a copy
            same = next(hf_model.parameters()).dtype == dtype
            loaded = load_model(hf_model if same else copy.deepcopy(hf_model), tokenizer, dtype=dtype, device=device)
        result.model = loaded.name
        vocab = loaded.model.config.get_text_config().vocab_size
        spec: dict[str, Any] | None = None
        works: dict[tuple[int, str], Workload | Exception] = {}
        for batch in batches:
            for strategy in strategies:
                try:
                    if strategy == "speculative" and spec is None:
                        spec = copy.deepcopy(NGRAM_STRATEGY)
                    works[batch, strategy] = _cell_workload(strategy, batch, batch if batch > 1 else batch1_requests,
                                                            loaded.tokenizer, output_len, prompt_len, seed, vocab)
                except Exception as exc:  # a cell that cannot be built is reported, the others run
                    works[batch, strategy] = exc
        ready = [(s, w) for (_, s), w in works.items() if isinstance(w, Workload)]
        dk_options = _engine_options(options, ready, loaded.model)
        result.engine_options[name] = dk_options
        progress.stage(f"{name}: building decodekit's engine")
        base: DecodekitSystem | None = None
        try:
            base = DecodekitSystem(loaded.model, loaded.tokenizer, loaded.dtype, dk_options)
        except Exception as exc:
            result.notes.append(f"{name}: decodekit could not be set up: {exc!r}")
            log.exception("decodekit setup failed")
        started = _start_peers(names, peers or [], model, name, dk_options, env, result, progress) \
            if "greedy" in strategies else {}
        try:
            for batch in batches:
                for strategy in strategies:
                    done += 1
                    progress.scope = f"[{done}/{total}] {name} · batch {batch} · {strategy} · "
                    result.cells.append(_run_cell(name, batch, strategy, works[batch, strategy], base, loaded, spec,
                                                  repeats, time_limit_s, progress,
                                                  started if strategy == "greedy" else {}))
        finally:
            for system in started.values():
                system.close()
        del base, loaded
    progress.scope = ""
    result.notes.append("tok/s: useful output tokens per second of wall time, median over the rounds; decodekit x: "
                        "the median of the per-round ratios decodekit / transformers; same tokens: the share of "
                        "requests whose tokens equal decodekit's")
    return result


class _Borrowed(System):
    """A peer started once per dtype, lent to each greedy cell: `measure` closes its systems after a cell, which
    must not stop a peer that took a minute to start (vLLM compiles the model)."""

    def __init__(self, system: System) -> None:
        self.system = system
        self.name = system.name
        self.notes = system.notes

    def prepare(self, workload: Workload) -> None:
        """The peer's own warm-up."""
        self.system.prepare(workload)

    def run(self, requests: list[BenchRequest], on_done: OnDone | None = None) -> RunRecord:
        """The peer's round."""
        return self.system.run(requests, on_done)


def _start_peers(names: list[str], peers: list[PeerSpec], model: Any, dtype: str, options: dict[str, Any],
                 env: dict[str, Any], result: MatrixResult, progress: BenchProgress) -> dict[str, System]:
    """Start every peer for one dtype; one that fails is noted and left out of that dtype's cells."""
    started: dict[str, System] = {}
    for peer_name, spec in zip(names, peers, strict=True):
        progress.stage(f"{dtype}: starting {peer_name}")
        try:
            system = build_peer(spec, model=model, dtype=dtype, threads=torch.get_num_threads(),
                                quantization=options.get("quantization"), name=peer_name)
        except Exception as exc:
            result.notes.append(f"{dtype}: {peer_name} could not be started: {exc}")
            log.exception("%s setup failed", peer_name)
            continue
        started[peer_name] = system
        describe = getattr(system, "describe", None)
        if callable(describe):
            env.setdefault("peers", {})[peer_name] = describe()
    return started


def _run_cell(dtype: str, batch: int, strategy: str, work: Workload | Exception, base: DecodekitSystem | None,
              loaded: Any, spec: dict[str, Any] | None, repeats: int, time_limit_s: float,
              progress: BenchProgress, peers: dict[str, System] | None = None) -> MatrixCell:
    ours, theirs, hf_kwargs = _describe(strategy, batch, spec)
    cell = MatrixCell(dtype, batch, strategy, ours, theirs, SystemFigures("decodekit"), SystemFigures("transformers"))
    if isinstance(work, Exception):
        cell.error = f"workload: {work}"
        return cell
    cell.workload = work.describe()
    if base is None:
        cell.error = "decodekit could not be set up"
        return cell
    decodekit_strategy = {"greedy": None, "speculative": spec, "beam": {"beam_search": {"num_beams": NUM_BEAMS}}}
    dk = base.variant(strategy=decodekit_strategy[strategy], batch_size=batch)

    def hf() -> System:
        return HFGenerateSystem(loaded.model, loaded.tokenizer, batch, name="transformers", generate_kwargs=hf_kwargs)

    builders: dict[str, Callable[[], System]] = {"decodekit": lambda: dk, "transformers": hf}
    for peer_name, system in (peers or {}).items():
        builders[peer_name] = functools.partial(_Borrowed, system)
    try:
        figures, ratios, notes = measure(builders, work, repeats, time_limit_s=time_limit_s, progress=progress)
    except Exception as exc:  # decodekit failed to warm up: the cell says why, the matrix goes on
        cell.error = str(exc)
        log.exception("cell %s batch %d %s failed", dtype, batch, strategy)
        return cell
    cell.decodekit, cell.transformers = figures["decodekit"], figures["transformers"]
    cell.ratio, cell.notes = ratios["transformers"], notes
    cell.peers = {n: figures[n] for n in peers or {}}
    cell.peer_ratios = {n: ratios.get(n) for n in peers or {}}
    for fig in (cell.decodekit, cell.transformers, *cell.peers.values()):
        if fig.error is not None:
            cell.notes.append(f"{fig.name}: {fig.error}")
    return cell


# ---- rendering -----------------------------------------------------------------------------------------------------
HEADERS = ("dtype", "batch", "strategy", "decodekit tok/s", "transformers baseline", "transformers tok/s",
           "decodekit ×", "same tokens")


def _num(value: float | None) -> str:
    return MISSING if value is None else f"{value:.1f}"


def _headers(result: MatrixResult) -> list[str]:
    """`HEADERS`, then for each peer its tok/s, decodekit's ratio to it and how many requests have its tokens."""
    extra = [h for n in result.peers for h in (f"{n} tok/s", f"decodekit × {n}", f"{n} same tokens / prefix")]
    return [*HEADERS, *extra]


def _peer_cells(c: MatrixCell, names: list[str], bold: Callable[[str], str]) -> list[str]:
    out = []
    for n in names:
        fig, ratio = c.peers.get(n), c.peer_ratios.get(n)
        agree = MISSING if fig is None or fig.match_decodekit is None else \
            f"{fig.match_decodekit:.0%} / {fig.prefix_decodekit or 0:.0%}"
        out += [_num(fig.tokens_per_s if fig else None), MISSING if ratio is None else bold(f"{ratio:.2f}"), agree]
    return out


def _rows(result: MatrixResult, bold: Callable[[str], str]) -> list[list[str]]:
    rows = []
    for c in result.cells:
        ratio = MISSING if c.ratio is None else bold(f"{c.ratio:.2f}")
        same = MISSING if c.transformers.match_decodekit is None else f"{c.transformers.match_decodekit:.0%}"
        strategy = c.strategy if c.strategy == c.decodekit_runs else f"{c.strategy} ({c.decodekit_runs})"
        if c.error is not None:
            strategy += " (error)"
        rows.append([c.dtype, str(c.batch), strategy, _num(c.decodekit.tokens_per_s), c.baseline,
                     _num(c.transformers.tokens_per_s), ratio, same, *_peer_cells(c, result.peers, bold)])
    return rows


def _title(result: MatrixResult) -> str:
    return (f"matrix: {result.model} on {result.device}, {result.output_len} output tokens per request, "
            f"median of {result.repeats} round(s)")


def _problems(result: MatrixResult) -> list[str]:
    lines = []
    for c in result.cells:
        where = f"{c.dtype} batch {c.batch} {c.strategy}"
        if c.error is not None:
            lines.append(f"{where}: {c.error}")
        lines.extend(f"{where}: {note}" for note in c.notes)
    return lines + result.notes


def render_matrix_table(result: MatrixResult, console: Console | None = None) -> Table:
    """Print the matrix as a table (one row per cell), its notes and the machine line; returns the table."""
    console = console or Console()
    table = Table(title=escape(_title(result)), title_justify="left")
    for header in _headers(result):
        right = header not in ("dtype", "strategy", "transformers baseline")
        table.add_column(header, justify="right" if right else "left", overflow="fold")
    for row in _rows(result, lambda text: f"[bold]{text}[/bold]"):
        table.add_row(*(cell if cell.startswith("[bold]") else escape(cell) for cell in row))
    print_table(console, table)
    for line in _problems(result):
        console.print(f"[dim]{escape(line)}[/dim]", soft_wrap=True)
    console.print(f"machine: {escape(result.machine)}", soft_wrap=True, highlight=False)
    return table


def matrix_markdown(result: MatrixResult, command: str | None = None) -> str:
    """The matrix as a markdown section: what ran (the command, the machine line), the table, its notes."""
    lines = [f"Command: `{command}`" if command else "", "", f"Machine: {result.machine}, "
             f"{result.environment.get('date', 'date unknown')}.", "",
             f"{_title(result)}; speculative and beam requests hold EOS off with `min_tokens` (transformers: "
             "`min_new_tokens`), greedy ones ignore it.", "",
             "| " + " | ".join(_headers(result)) + " |", "|" + "---|" * len(_headers(result))]
    lines.extend("| " + " | ".join(row) + " |" for row in _rows(result, lambda text: f"**{text}**"))
    problems = _problems(result)
    if problems:
        lines.append("")
        lines.extend(f"- {line}" for line in problems)
    return "\n".join(lines).lstrip("\n") + "\n"


def matrix_json(result: MatrixResult) -> str:
    """The result as an indented JSON document."""
    return json.dumps(jsonable(result.to_dict()), indent=2)


__all__ = ["DEFAULT_BATCHES", "DEFAULT_DTYPES", "STRATEGIES", "MatrixCell", "MatrixResult", "matrix_json",
           "matrix_markdown", "render_matrix_table", "resolve_dtypes", "run_matrix"]
