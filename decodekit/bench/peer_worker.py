"""The peers' side of `decodekit bench --peer`: a script run with the peer's own Python, speaking JSON lines.

vLLM pins its own torch and transformers, so it cannot be imported into decodekit's environment: `VllmPeer`
(`decodekit.bench.peers`) runs this file by path with the Python of vLLM's environment and talks to it over its
stdin and stdout. llama-cpp-python is run the same way when it lives in another environment, or in-process when
decodekit's Python can import it (then `LlamaCppBackend` is used directly). Hence this module imports nothing but
the standard library at its top, and nothing of decodekit at all.

The protocol: one JSON object a line each way, a request on stdin answered by one response on stdout.

- `{"cmd": "load", "backend": "vllm" | "llama.cpp", "options": {...}}` loads the model (untimed); the response
  carries `info` (versions, the settings the peer runs with).
- `{"cmd": "generate", "requests": [{"prompt_token_ids": [...], "max_tokens": N}, ...]}` runs one round: every
  request arrives at once, decodes greedily to exactly `max_tokens` tokens (EOS ignored); the response carries
  `wall_s`, `outputs` (token ids per request, in order), `ttft_s` (from the round's start to each request's first
  token) and `tpot_s` ((last - first token time) / (tokens - 1), for requests of two tokens or more).
- `{"cmd": "quit"}` ends the worker.

Every response has `ok`; a failed command answers `{"ok": false, "error": ..., "traceback": ...}` and the worker
reads on (a failed `load` leaves it unloaded). vLLM logs to stdout, and its engine process inherits our file
descriptors, so the worker moves the protocol to a duplicate of stdout and points descriptor 1 at stderr: nothing
but protocol lines reach the reader.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import IO, Any

LLAMA_FTYPES = {"float32": 0, "float16": 1, "bfloat16": 32, "q4_0": 2, "q4_1": 3, "q8_0": 7}
"""llama.cpp's `llama_ftype` for each precision the bench pairs with decodekit's (`LLAMA_FTYPE_ALL_F32` 0,
`MOSTLY_F16` 1, `MOSTLY_BF16` 32, `MOSTLY_Q4_0` 2, `MOSTLY_Q4_1` 3, `MOSTLY_Q8_0` 7)."""


def _timings(start: float, first: list[float | None], last: list[float | None],
             outputs: list[list[int]]) -> tuple[list[float], list[float]]:
    """Per-request TTFT from the round's start and TPOT per output position, for the requests that have them."""
    ttft = [f - start for f in first if f is not None]
    tpot = [(b - a) / (len(out) - 1) for a, b, out in zip(first, last, outputs, strict=True)
            if a is not None and b is not None and len(out) >= 2]
    return ttft, tpot


class VllmBackend:
    """vLLM's offline engine (`vllm.LLM`), stepped by hand so each request's first and last token are timed.

    `LLM.generate` runs the same loop (`add_request` for every prompt, then `step` until nothing is unfinished)
    but returns only at the end; stepping it here gives the arrival time of every request's tokens at no cost.
    """

    def __init__(self, options: dict[str, Any]) -> None:
        from vllm import LLM

        kwargs = {"model": options["model"], "dtype": options.get("dtype", "auto"), "seed": options.get("seed", 0)}
        kwargs.update(options.get("llm_kwargs") or {})
        self.llm = LLM(**kwargs)
        self._next_id = 0

    def info(self) -> dict[str, Any]:
        """vLLM's and torch's versions, and the thread settings it runs with."""
        import importlib.metadata

        import vllm

        try:  # the version without importing torch into the front-end (the engine process runs the model)
            torch_version: str | None = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            torch_version = None
        return {"vllm": getattr(vllm, "__version__", None), "torch": torch_version,
                "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
                # set when decodekit runs under DECODEKIT_CPU_ISA: vLLM's torch and oneDNN are capped alike (its
                # own compiled kernels are not)
                **{name: os.environ[name] for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
                   if name in os.environ}}

    def generate(self, requests: list[dict[str, Any]]) -> dict[str, Any]:
        """One round: every request added at once, greedy, `ignore_eos`, exactly `max_tokens` tokens each.

        Outputs come back as deltas (`RequestOutputKind.DELTA`, as `vllm serve` streams them) rather than
        `LLM.generate`'s final-only outputs, so that each request's first token can be timed.
        """
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        index: dict[str, int] = {}
        n = len(requests)
        first: list[float | None] = [None] * n
        last: list[float | None] = [None] * n
        outputs: list[list[int]] = [[] for _ in range(n)]
        start = time.perf_counter()
        for i, request in enumerate(requests):
            request_id = f"r{self._next_id}"  # unique over rounds (vLLM adds its own suffix inside)
            self._next_id += 1
            index[request_id] = i
            params = SamplingParams(temperature=0.0, max_tokens=int(request["max_tokens"]), ignore_eos=True,
                                    output_kind=RequestOutputKind.DELTA)
            engine.add_request(request_id, {"prompt_token_ids": list(request["prompt_token_ids"])}, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                i = index.get(out.request_id, -1)  # the id given to add_request (vLLM's external id)
                if i < 0:
                    continue
                now = time.perf_counter()
                if out.outputs and out.outputs[0].token_ids:
                    outputs[i].extend(int(t) for t in out.outputs[0].token_ids)
                    if first[i] is None:
                        first[i] = now
                if out.finished:
                    last[i] = now
        wall = time.perf_counter() - start
        ttft, tpot = _timings(start, first, last, outputs)
        return {"wall_s": wall, "outputs": outputs, "ttft_s": ttft, "tpot_s": tpot}


def llama_gguf(source: str, target: str, ftype: int, threads: int = 0) -> str:
    """`target`, made once from `source` with llama.cpp's own quantizer (`llama_model_quantize`, re-quantizing
    allowed: the bundled file is Q4_1) as `ftype`; written beside its final name and renamed, so an interrupted
    run leaves no half file behind."""
    import ctypes

    import llama_cpp

    if os.path.exists(target):
        return target
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = threads
    partial = f"{target}.partial-{os.getpid()}"
    status = llama_cpp.llama_model_quantize(source.encode(), partial.encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({source} -> ftype {ftype}) returned {status}")
    os.replace(partial, target)
    return target


class LlamaCppBackend:
    """llama-cpp-python's `Llama`, one request at a time (its Python binding decodes a single sequence)."""

    def __init__(self, options: dict[str, Any]) -> None:
        from llama_cpp import Llama

        threads = int(options.get("threads") or os.cpu_count() or 1)
        path = options.get("gguf")
        if not path:
            path = llama_gguf(options["source_gguf"], options["target_gguf"], int(options["ftype"]), threads)
        self.path = path
        self.threads = threads
        self.llm = Llama(model_path=path, n_ctx=int(options.get("n_ctx", 4096)), n_threads=threads,
                         n_threads_batch=threads, n_batch=int(options.get("n_batch", 512)),
                         seed=int(options.get("seed", 0)), verbose=False)

    def info(self) -> dict[str, Any]:
        """llama-cpp-python's version, the GGUF file and the threads."""
        import llama_cpp

        return {"llama_cpp_python": getattr(llama_cpp, "__version__", None), "gguf": self.path,
                "threads": self.threads}

    def generate(self, requests: list[dict[str, Any]], on_done: Any = None) -> dict[str, Any]:
        """One round, request after request (the later ones wait, as they would behind one sequence): greedy,
        exactly `max_tokens` tokens each; `Llama.generate` never stops at EOS by itself, which is `ignore_eos`."""
        n = len(requests)
        first: list[float | None] = [None] * n
        last: list[float | None] = [None] * n
        outputs: list[list[int]] = [[] for _ in range(n)]
        start = time.perf_counter()
        for i, request in enumerate(requests):
            wanted = int(request["max_tokens"])
            self.llm.reset()  # no prefix reuse from the previous request: each starts from an empty cache
            for token in self.llm.generate(list(request["prompt_token_ids"]), temp=0.0, top_k=1, top_p=1.0,
                                           min_p=0.0, repeat_penalty=1.0, reset=True):
                if first[i] is None:
                    first[i] = time.perf_counter()
                outputs[i].append(int(token))
                if len(outputs[i]) >= wanted:
                    break
            last[i] = time.perf_counter()
            if on_done is not None:
                on_done(1)
        wall = time.perf_counter() - start
        ttft, tpot = _timings(start, first, last, outputs)
        return {"wall_s": wall, "outputs": outputs, "ttft_s": ttft, "tpot_s": tpot}


BACKENDS = {"vllm": VllmBackend, "llama.cpp": LlamaCppBackend}


def _respond(out: IO[str], message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def serve(inp: IO[str], out: IO[str]) -> None:
    """Answer protocol lines from `inp` on `out` until `quit` or the end of `inp`."""
    backend: Any = None
    for line in inp:
        if not line.strip():
            continue
        try:
            message = json.loads(line)
            cmd = message.get("cmd")
            if cmd == "quit":
                _respond(out, {"ok": True})
                return
            if cmd == "load":
                name = message.get("backend")
                if name not in BACKENDS:
                    raise ValueError(f"unknown backend {name!r}; this worker knows {sorted(BACKENDS)}")
                backend = BACKENDS[name](dict(message.get("options") or {}))
                _respond(out, {"ok": True, "info": backend.info()})
            elif cmd == "generate":
                if backend is None:
                    raise RuntimeError("`generate` before a successful `load`")
                _respond(out, {"ok": True, **backend.generate(list(message["requests"]))})
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except Exception as exc:
            _respond(out, {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})


def main() -> None:
    """Move the protocol off descriptor 1 (see the module docstring), then serve stdin."""
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    serve(sys.stdin, protocol)


if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports the main module: guard the work
    main()
