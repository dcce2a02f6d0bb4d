"""JSONSchemaBench on decodekit: per subset, how many schemas decodekit compiles (through the `json_schema`
processor, the path a request takes) against llguidance compiling them directly with the same options, how many
finished outputs validate, how many were cut by the token budget, and crashes (which must be 0).

Usage:
    OMP_NUM_THREADS=2 python benchmarks/jsonschemabench.py [--data DIR] [--subset NAME ...] [--limit N]
        [--max-tokens 256] [--coerce-one-of] [--lenient] [--temperature 0] [--dtype float32] [--compile-only]
        [--json OUT]

The data is a folder of subsets, one JSON schema per file (`../shared/data/jsonschemabench/`: 64 schemas, 8 from
each of eight subsets of JSONSchemaBench, Geng et al. 2025). Each schema becomes one request to the bundled model
(SmolLM2-135M-Instruct): the chat template around a prompt asking for JSON that matches the schema (the schema's
text cut to `--prompt-chars`), greedy by default, all requests in one continuous batch.

Counted per subset:
- llguidance: the schema compiles with llguidance directly (`LLMatcher.grammar_from_json_schema` on the schema as
  given, the same whitespace and JSON options, the engine's tokenizer).
- decodekit: the request was accepted (its `json_schema` constraint compiled at submission).
- finished: the output ended on EOS (finish reason `stop`); valid: it parses and validates against the schema as
  given (`jsonschema`, the schema's own draft, with the format checks `jsonschema` has installed).
- truncated: finish reason `length` (the budget ran out first; a valid prefix, not counted as invalid).
- crashes: an exception out of the engine, or an accepted request that ended in an error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import llguidance.hf
from rich.console import Console
from rich.table import Table

from decodekit import LLM, SamplingParams

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "jsonschemabench"
SYSTEM = "You are a helpful assistant. You answer with one JSON value and nothing else."
# the whitespace decodekit's json_schema processor asks for by default (flexible_whitespace: false)
WHITESPACE: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Case:
    """One schema of the benchmark."""

    subset: str
    name: str
    schema: Any


@dataclass(frozen=True)
class BenchOptions:
    """How the schemas are compiled and generated."""

    coerce_one_of: bool = False
    lenient: bool = False
    max_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    prompt_chars: int = 2000

    def json_options(self) -> dict[str, bool]:
        """The `json_schema` processor's JSON options these stand for (only those set)."""
        return {name: True for name in ("coerce_one_of", "lenient") if getattr(self, name)}


@dataclass
class CaseResult:
    """What happened to one schema."""

    subset: str
    name: str
    llguidance_error: str | None = None
    decodekit_error: str | None = None
    finish_reason: str | None = None
    num_tokens: int = 0
    text: str = ""
    invalid: str | None = None  # why a finished output does not validate
    crash: str | None = None

    @property
    def llguidance_ok(self) -> bool:
        """llguidance compiled the schema directly."""
        return self.llguidance_error is None

    @property
    def decodekit_ok(self) -> bool:
        """decodekit accepted the request (its constraint compiled)."""
        return self.decodekit_error is None


@dataclass
class Summary:
    """Counts for one subset (or the total)."""

    schemas: int = 0
    llguidance: int = 0
    decodekit: int = 0
    finished: int = 0
    valid: int = 0
    truncated: int = 0
    crashes: int = 0
    llguidance_only: list[str] = field(default_factory=list)  # compiled by llguidance, refused by decodekit
    decodekit_only: list[str] = field(default_factory=list)

    def add(self, result: CaseResult) -> None:
        """Count one schema's result."""
        self.schemas += 1
        self.llguidance += result.llguidance_ok
        self.decodekit += result.decodekit_ok
        if result.llguidance_ok and not result.decodekit_ok:
            self.llguidance_only.append(f"{result.subset}/{result.name}")
        if result.decodekit_ok and not result.llguidance_ok:
            self.decodekit_only.append(f"{result.subset}/{result.name}")
        self.crashes += result.crash is not None
        if result.crash is None and result.finish_reason == "stop":
            self.finished += 1
            self.valid += result.invalid is None
        elif result.crash is None and result.finish_reason == "length":
            self.truncated += 1


# ---- data -------------------------------------------------------------------------------------------------------
def load_cases(data: Path, subsets: Sequence[str] | None = None, limit: int | None = None) -> list[Case]:
    """The schemas under `data/<subset>/*.json`, subsets and files in name order; `limit` per subset."""
    folders = sorted(p for p in data.iterdir() if p.is_dir())
    if subsets:
        unknown = set(subsets) - {p.name for p in folders}
        if unknown:
            raise SystemExit(f"unknown subset(s) {sorted(unknown)}; {data} has {[p.name for p in folders]}")
        folders = [p for p in folders if p.name in subsets]
    cases = []
    for folder in folders:
        files = sorted(folder.glob("*.json"))[:limit]
        cases += [Case(folder.name, f.stem, json.loads(f.read_text(encoding="utf-8"))) for f in files]
    return cases


def prompt_messages(schema: Any, prompt_chars: int) -> list[dict[str, str]]:
    """The conversation asking for JSON that matches `schema` (its compact text cut to `prompt_chars`)."""
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    if len(text) > prompt_chars:
        text = text[:prompt_chars] + " ... (schema cut here)"
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Write an example JSON value that matches this JSON schema:\n{text}\n"
                                        "Answer with the JSON only."}]


def render_prompt(llm: LLM, messages: list[dict[str, str]]) -> tuple[str, bool]:
    """The prompt text, and whether it already holds the special tokens (the chat template's) or needs them."""
    if getattr(llm.tokenizer, "chat_template", None):
        return llm.apply_chat_template(messages), False
    return "\n\n".join(m["content"] for m in messages) + "\n\n", True  # a test tokenizer without a template


# ---- checks -------------------------------------------------------------------------------------------------------
def llguidance_error(tokenizer: Any, schema: Any, options: BenchOptions) -> str | None:
    """Why llguidance cannot compile `schema` directly (as given, with the same options), or None."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults=WHITESPACE, overrides=options.json_options() or None)  # type: ignore[arg-type]
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    except Exception as exc:  # llguidance raises ValueError for a schema that is not a JSON object
        return f"{type(exc).__name__}: {exc}"
    return " ".join(matcher.get_error().split()) if matcher.is_error() else None


def validation_error(schema: Any, text: str) -> str | None:
    """Why `text` is not JSON valid against `schema` (its own draft, with format checks), or None."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc}"
    cls = jsonschema.validators.validator_for(schema)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"at /{where}: {error.message}"[:500]


# ---- the run ------------------------------------------------------------------------------------------------------
def run_benchmark(llm: LLM, cases: Sequence[Case], options: BenchOptions, progress: Console | None = None,
                  generate: bool = True) -> list[CaseResult]:
    """Compile every schema with llguidance directly and through decodekit (each as one request to `llm`), generate
    the accepted ones in one continuous batch, and check the outputs (with `generate=False`, abort the accepted
    requests instead: compile counts only)."""
    engine = llm.engine
    ll_tokenizer = llguidance.hf.from_tokenizer(llm.tokenizer, n_vocab=engine.vocab_size,
                                                eos_token=list(engine.eos_token_ids) or None)
    results = [CaseResult(case.subset, case.name) for case in cases]
    running: dict[str, int] = {}
    for i, case in enumerate(cases):
        results[i].llguidance_error = llguidance_error(ll_tokenizer, case.schema, options)
        text, special = render_prompt(llm, prompt_messages(case.schema, options.prompt_chars))
        params = SamplingParams(temperature=options.temperature, seed=options.seed, max_tokens=options.max_tokens,
                                processors=[{"json_schema": {"schema": case.schema, **options.json_options()}}])
        rid = f"jsb-{i}"
        try:
            request = engine.add_request(text, params, request_id=rid, add_special_tokens=special)
        except Exception as exc:  # the engine must refuse a bad request, not raise
            results[i].crash = f"add_request raised {exc!r}"
            continue
        if request.finished:
            results[i].decodekit_error = request.error or "refused"
        elif generate:
            running[rid] = i
        else:
            engine.abort(rid)
    while not generate and engine.has_unfinished_requests():
        engine.step()  # hands back the aborted requests' outputs
    if progress is not None:
        progress.log(f"{len(cases)} schemas, {len(running)} accepted; generating")
    finals: dict[str, Any] = {}
    started = time.perf_counter()
    while len(finals) < len(running):
        try:
            outputs = engine.step()
        except Exception as exc:  # an engine step must never raise because of a request
            for rid, i in running.items():
                if rid not in finals:
                    results[i].crash = f"engine.step raised {exc!r}"
            break
        for out in outputs:
            if out.finished and out.request_id in running:
                finals[out.request_id] = out
                if progress is not None and len(finals) % 8 == 0:
                    progress.log(f"{len(finals)}/{len(running)} done ({time.perf_counter() - started:.0f} s)")
    for rid, out in finals.items():
        result, case = results[running[rid]], cases[running[rid]]
        result.finish_reason = out.finish_reason
        result.num_tokens = len(out.token_ids)
        result.text = out.text
        if out.finish_reason == "error" or out.error is not None:
            result.crash = f"accepted, then failed: {out.error}"
        elif out.finish_reason == "stop":
            result.invalid = validation_error(case.schema, out.text)
    return results


def summarize(results: Iterable[CaseResult]) -> dict[str, Summary]:
    """Counts per subset, and `"total"`."""
    out: dict[str, Summary] = {}
    total = Summary()
    for result in results:
        out.setdefault(result.subset, Summary()).add(result)
        total.add(result)
    out["total"] = total
    return out


def summary_table(summaries: dict[str, Summary], title: str) -> Table:
    """The per-subset table."""
    table = Table(title=title)
    for column in ("subset", "schemas", "llguidance compiles", "decodekit compiles", "finished", "valid / finished",
                   "truncated", "crashes"):
        table.add_column(column, justify="left" if column == "subset" else "right")
    for name, s in summaries.items():
        valid = f"{s.valid}/{s.finished}" + (f" ({100 * s.valid / s.finished:.0f}%)" if s.finished else "")
        table.add_row(name, str(s.schemas), str(s.llguidance), str(s.decodekit), str(s.finished), valid,
                      str(s.truncated), str(s.crashes), style="bold" if name == "total" else None)
    return table


def report(console: Console, results: Sequence[CaseResult], summaries: dict[str, Summary], title: str) -> bool:
    """Print the table and every departure from the bar; True when the bar is met (decodekit compiles every schema
    llguidance compiles, every finished output validates, no crash)."""
    console.print(summary_table(summaries, title))
    total = summaries["total"]
    for result in results:
        key = f"{result.subset}/{result.name}"
        if result.crash:
            console.print(f"[red]crash[/red] {key}: {result.crash}", soft_wrap=True)
        if result.invalid:
            console.print(f"[red]invalid[/red] {key}: {result.invalid}\n    output: {result.text[:300]!r}",
                          soft_wrap=True)
        if result.llguidance_ok and not result.decodekit_ok:
            console.print(f"[red]refused by decodekit only[/red] {key}: {result.decodekit_error}", soft_wrap=True)
        if result.decodekit_ok and not result.llguidance_ok:
            console.print(f"compiled by decodekit only {key}: llguidance says {result.llguidance_error}",
                          soft_wrap=True)
    refused = [r for r in results if not r.llguidance_ok]
    for result in refused:
        console.print(f"refused by llguidance {result.subset}/{result.name}: {(result.llguidance_error or '')[:160]}"
                      + ("" if result.decodekit_ok else f"\n    decodekit: {(result.decodekit_error or '')[:240]}"),
                      soft_wrap=True)
    ok = not total.llguidance_only and total.valid == total.finished and total.crashes == 0
    console.print(f"bar: decodekit compiles every schema llguidance compiles: {not total.llguidance_only}; "
                  f"finished outputs valid: {total.valid}/{total.finished}; crashes: {total.crashes} -> "
                  f"{'[green]met[/green]' if ok else '[red]NOT met[/red]'}")
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark from the command line; exit status 0 when the bar is met."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder of subsets (default: %(default)s)")
    parser.add_argument("--subset", action="append", help="run only this subset (repeatable)")
    parser.add_argument("--limit", type=int, default=None, help="at most N schemas per subset")
    parser.add_argument("--max-tokens", type=int, default=256, help="token budget per output (default 256)")
    parser.add_argument("--coerce-one-of", action="store_true", help="json_schema option coerce_one_of: true")
    parser.add_argument("--lenient", action="store_true", help="json_schema option lenient: true")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-chars", type=int, default=2000, help="schema text shown in the prompt, at most")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-memory", default="3GiB")
    parser.add_argument("--compile-only", action="store_true", help="count compiles only, generate nothing")
    parser.add_argument("--json", type=Path, help="write every schema's result here")
    args = parser.parse_args(argv)
    options = BenchOptions(coerce_one_of=args.coerce_one_of, lenient=args.lenient, max_tokens=args.max_tokens,
                           temperature=args.temperature, seed=args.seed, prompt_chars=args.prompt_chars)
    console = Console(width=150)
    cases = load_cases(args.data, args.subset, args.limit)
    import torch  # after argument parsing, so --help is fast

    threads = torch.get_num_threads()
    console.log(f"{len(cases)} schemas from {args.data}; model {args.model}, {args.dtype}, {threads} torch threads "
                f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}); options {options}")
    started = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, device="cpu", kv_cache_memory=args.kv_cache_memory)
    loaded = time.perf_counter()
    results = run_benchmark(llm, cases, options, progress=console, generate=not args.compile_only)
    elapsed = time.perf_counter() - loaded
    flags = " ".join(f"--{name.replace('_', '-')}" for name in options.json_options()) or "default options"
    title = (f"JSONSchemaBench sample: {flags}, " + ("compile only" if args.compile_only else
             f"max_tokens {options.max_tokens}, "
             f"{'greedy' if options.temperature == 0 else f'temperature {options.temperature}'}"))
    ok = report(console, results, summarize(results), title)
    console.log(f"model load {loaded - started:.0f} s, compile + generation {elapsed:.0f} s, "
                f"{sum(r.num_tokens for r in results)} tokens generated")
    if args.json:
        keep = [f.name for f in fields(CaseResult)]
        args.json.write_text(json.dumps({"options": asdict(options), "results": [
            {k: v for k, v in asdict(r).items() if k in keep} for r in results]}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
