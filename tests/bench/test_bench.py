"""The benchmark harness on a tiny in-process model: workloads, structure of results, rendering, the machine line,
the progress bar, `bench mixed`'s sizes and `bench matrix`. No timings."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from decodekit.api.errors import ConfigError
from decodekit.bench import (
    SYSTEMS,
    WORKLOADS,
    BenchProgress,
    BenchResult,
    RichBenchProgress,
    SystemFigures,
    cpu_description,
    default_baselines,
    machine_line,
    make_workload,
    matrix_json,
    matrix_markdown,
    render_matrix_table,
    render_table,
    result_json,
    run_benchmark,
    run_matrix,
)
from decodekit.bench.baselines import _StepTimes
from decodekit.bench.machine import CPU_FLAGS
from decodekit.bench.workloads import MIXED_FULL_REPEATS, MIXED_FULL_REQUESTS, MIXED_REPEATS, MIXED_REQUESTS
from decodekit.cli import app
from decodekit.models.tiny import tiny_model, tiny_tokenizer

SIZES = dict(num_requests=3, batch_size=2, output_len=5, repeats=1, seed=13)  # seed 13: short mixed outputs
OPTIONS = {"kv_cache_memory": "16MiB", "max_num_seqs": 8, "max_num_batched_tokens": 256, "block_size": 16}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: tiny models gain nothing from two, and a busy neighbour core slows two-thread runs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny():
    """A private tiny Llama (hf-cb switches and restores its attention, so it is not shared with other tests)."""
    return tiny_model("llama", seed=3), tiny_tokenizer()


def test_workloads_are_seeded_and_exact(tiny):
    _, tok = tiny
    special = set(tok.all_special_ids)
    a = make_workload("mixed", tok, num_requests=20, seed=5)
    b = make_workload("mixed", tok, num_requests=20, seed=5)
    assert a.prompt_lens == b.prompt_lens and a.output_lens == b.output_lens
    assert a.requests(0) == b.requests(0)
    assert all(16 <= n <= 256 for n in a.prompt_lens + a.output_lens)
    assert len(set(a.prompt_lens)) > 1
    r0, r1 = a.requests(0), a.requests(1)
    assert [len(r.prompt_ids) for r in r0] == a.prompt_lens == [len(r.prompt_ids) for r in r1]
    assert [r.prompt_ids for r in r0] != [r.prompt_ids for r in r1]  # fresh ids per round: no cross-round cache
    assert not special & {t for r in r0 for t in r.prompt_ids}
    assert make_workload("mixed", tok, num_requests=20, seed=6).prompt_lens != a.prompt_lens

    one = make_workload("batch1", tok, output_len=7)
    assert (one.prompt_lens, one.output_lens) == ([32], [7])
    batch = make_workload("batch", tok, batch_size=4, output_len=3, prompt_len=10)
    assert (batch.prompt_lens, batch.output_lens, batch.total_output_tokens) == ([10] * 4, [3] * 4, 12)
    ttft = make_workload("ttft", tok)
    assert (ttft.prompt_lens, ttft.output_lens) == ([256], [1])
    with pytest.raises(ValueError):
        make_workload("nope", tok)


@pytest.mark.parametrize("workload", WORKLOADS)
def test_run_benchmark_structure(tiny, workload):
    model, tok = tiny
    # mixed has the longest outputs: skip the slowest baseline there to keep the suite quick
    baselines = ("hf-static", "hf-cb") if workload == "mixed" else ("hf-sequential", "hf-static", "hf-cb")
    result = run_benchmark(workload, hf_model=model, tokenizer=tok, baselines=baselines,
                           engine_options=OPTIONS, **SIZES)
    assert isinstance(result, BenchResult)
    expected = make_workload(workload, tok, num_requests=3, batch_size=2, output_len=5, seed=13)
    assert result.workload["output_tokens"] == expected.total_output_tokens
    assert list(result.systems) == ["decodekit", *baselines]
    for name, fig in result.systems.items():
        assert fig.error is None, (name, fig.error)
        assert fig.rounds == 1
        assert fig.useful_tokens == expected.total_output_tokens
        assert fig.computed_tokens >= fig.useful_tokens
        assert fig.tokens_per_s is not None and fig.tokens_per_s > 0
        assert fig.ttft_p50_s is not None and fig.ttft_p90_s is not None
        assert fig.peak_rss_mb is not None and fig.peak_rss_mb > 0
        if max(expected.output_lens) >= 2:
            assert fig.tpot_p50_s is not None
        else:
            assert fig.tpot_p50_s is None  # one output token: no time per output token
        if name != "decodekit":
            assert fig.match_decodekit is not None and 0.0 <= fig.match_decodekit <= 1.0
    assert set(result.ratios) == set(baselines)
    assert all(r is not None and r > 0 for r in result.ratios.values())
    if workload == "mixed":  # static batches run to their longest output: the waste is computed, not counted
        assert result.systems["hf-static"].computed_tokens > result.systems["hf-static"].useful_tokens


def test_default_baselines_and_reports(tiny):
    model, tok = tiny
    result = run_benchmark("batch", hf_model=model, tokenizer=tok, engine_options=OPTIONS, **SIZES)
    assert list(result.systems) == ["decodekit", *default_baselines("batch")] == ["decodekit", "hf-static"]
    data = json.loads(result_json(result))
    assert data["systems"]["decodekit"]["useful_tokens"] == 2 * 5
    assert data["ratios"]["hf-static"] == pytest.approx(result.ratios["hf-static"])
    assert data["engine_options"] == OPTIONS
    buffer = io.StringIO()
    render_table(result, Console(file=buffer, width=200))
    text = buffer.getvalue()
    assert "decodekit" in text and "hf-static" in text and "useful tok/s" in text


def test_the_table_printed_to_a_narrow_non_terminal_shows_every_system_name_in_full(monkeypatch):
    """Piped or redirected output has no terminal width (rich assumes 80 columns): the table is printed as wide as
    its names and figures need, instead of cutting them to 'hf-seq…'."""
    monkeypatch.delenv("COLUMNS", raising=False)
    workload = {"name": "mixed", "num_requests": 4, "prompt_len_min": 8, "prompt_len_max": 64, "output_len_min": 4,
                "output_len_max": 32, "output_tokens": 60}
    systems = {name: SystemFigures(name, rounds=1, useful_tokens=60, computed_tokens=80, wall_s=1.5,
                                   tokens_per_s=40.0, peak_rss_mb=512.0) for name in SYSTEMS}
    systems["hf-cb"].error = "out of memory"
    result = BenchResult(workload, "HuggingFaceTB/SmolLM2-135M-Instruct", "float32", "cpu", 1, systems,
                         {name: 1.0 for name in SYSTEMS[1:]}, environment={"torch_threads": 1})
    buffer = io.StringIO()
    render_table(result, Console(file=buffer, width=60))
    text = buffer.getvalue()
    assert "…" not in text
    cells = {cell.strip() for line in text.splitlines() for cell in line.replace("┃", "│").split("│")}
    assert {"decodekit", "hf-sequential", "hf-static", "hf-cb (error)", "useful tok/s", "40.0", "1.33"} <= cells
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in text and "hf-cb: out of memory" in text


def test_bad_arguments(tiny):
    model, tok = tiny
    with pytest.raises(ValueError):
        run_benchmark("nope", hf_model=model, tokenizer=tok)
    with pytest.raises(ValueError):
        run_benchmark("batch1", hf_model=model, tokenizer=tok, baselines=("vllm",))
    with pytest.raises(ConfigError):
        run_benchmark("batch1", hf_model=model, tokenizer=tok, engine_options={"kv_cache_mem": "1GiB"})


# ---- the machine, the progress bar, `bench mixed`'s sizes, `bench matrix` -----------------------------------------
def test_the_machine_line_names_the_cpu_its_flags_the_dtype_and_the_threads():
    env = {"cpu": "AMD EPYC 7B13", "cpu_count": 2, "cpu_flags": ["avx2", "fma"],
           "cpu_flags_absent": ["avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"],
           "torch_cpu_capability": "AVX2", "torch_threads": 1, "torch": "2.13.0", "transformers": "5.23.0",
           "git_commit": "abc1234", "gpu": "NVIDIA H100"}
    line = machine_line(env, "float32", device="cpu", dtype_requested="auto")
    assert line == ("AMD EPYC 7B13, 2 cores (avx2 fma; no avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile; torch "
                    "kernels AVX2) | dtype float32 (asked auto) | 1 torch thread | torch 2.13.0, transformers 5.23.0 | "
                    "commit abc1234")
    assert "GPU NVIDIA H100" in machine_line(env, "bfloat16", device="cuda:0")
    assert "2 torch threads" in machine_line({**env, "torch_threads": 2}, "float32")
    assert "(asked" not in machine_line(env, "float32", dtype_requested="float32")
    described = cpu_description()
    assert set(described) == {"cpu", "cpu_flags", "cpu_flags_absent"}
    if described["cpu_flags"] or described["cpu_flags_absent"]:  # an x86 /proc/cpuinfo: every flag is placed
        assert sorted(described["cpu_flags"] + described["cpu_flags_absent"]) == sorted(CPU_FLAGS)


def test_every_table_and_json_carry_the_machine(tiny):
    model, tok = tiny
    result = run_benchmark("batch1", hf_model=model, tokenizer=tok, baselines=("hf-sequential",),
                           engine_options=OPTIONS, **{**SIZES, "output_len": 3})
    env = result.environment
    assert result.dtype == "float32" and env["dtype_requested"] == "auto" and env["torch_threads"] == 1
    data = json.loads(result_json(result))
    assert data["environment"]["cpu"] == cpu_description()["cpu"]
    assert data["environment"]["cpu_flags"] == cpu_description()["cpu_flags"]
    assert data["machine"] == result.machine
    buffer = io.StringIO()
    render_table(result, Console(file=buffer, width=200))
    text = buffer.getvalue()
    machine = next(line for line in text.splitlines() if line.startswith("machine: "))
    assert str(env["cpu"]) in machine and "dtype float32 (asked auto)" in machine and "1 torch thread" in machine
    for flag in env["cpu_flags"]:
        assert flag in machine
    assert all(flag in machine for flag in env["cpu_flags_absent"])


def test_step_times_count_every_token_a_streamer_is_handed():
    times = _StepTimes()
    times.put(torch.zeros(2, 7))  # the prompt
    times.put(torch.tensor([5, 6]))  # one token for each of two rows
    times.put(torch.tensor([[1, 2, 3]]))  # assisted generation: a row's accepted run at once
    assert len(times.times) == 4


def test_the_progress_bar_shows_the_system_the_round_and_the_requests(tiny):
    model, tok = tiny
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=120)
    with RichBenchProgress(console) as progress:
        run_benchmark("batch", hf_model=model, tokenizer=tok, baselines=("hf-static",), engine_options=OPTIONS,
                      progress=progress, **{**SIZES, "output_len": 3})
    text = buffer.getvalue()
    for name in ("decodekit", "hf-static"):
        assert f"{name}: round 1/1" in text  # the bar, while the round ran
        assert f"{name} round 1/1: 6 tokens in" in text  # the line each finished round leaves
    assert "requests" in text and "warming up" in text


@pytest.fixture(scope="module")
def tiny_recipe(tmp_path_factory, tiny):
    """A recipe naming a tiny Llama saved to a folder, float32, with a small KV pool."""
    folder = tmp_path_factory.mktemp("bench-tiny")
    tiny_model("llama", seed=3, max_position_embeddings=1024).save_pretrained(folder)
    tiny[1].save_pretrained(folder)
    recipe = folder / "bench.yaml"
    recipe.write_text(f"model: {folder}\ndtype: float32\nengine: {{kv_cache_memory: 16MiB}}\n")
    return recipe


def _bench(*args: str):
    return CliRunner().invoke(app, ["bench", *args])


def test_bench_mixed_shows_progress_on_stderr_and_none_with_json(tiny_recipe):
    common = ["mixed", "--recipe", str(tiny_recipe), "--num-requests", "2", "--repeats", "1",
              "--seed", "13", "--baseline", "hf-static", "--threads", "1"]
    shown = _bench(*common)
    assert shown.exit_code == 0, shown.stderr
    assert "decodekit round 1/1:" in shown.stderr and "hf-static round 1/1:" in shown.stderr
    assert "machine: " in shown.stdout and "useful tok/s" in shown.stdout
    quiet = _bench(*common, "--json")
    assert quiet.exit_code == 0, quiet.stderr
    assert "round" not in quiet.stderr
    data = json.loads(quiet.stdout)
    assert data["workload"]["num_requests"] == 2 and data["repeats"] == 1 and "dtype float32" in data["machine"]


def test_bench_mixed_defaults_are_the_quick_size_and_full_is_the_long_run(monkeypatch):
    import decodekit.bench

    seen: list[tuple] = []

    def fake(workload, **kwargs):
        seen.append((workload, kwargs.get("num_requests"), kwargs.get("repeats")))
        raise ValueError("stop here")

    monkeypatch.setattr(decodekit.bench, "run_benchmark", fake)
    assert _bench("mixed").exit_code == 2
    assert _bench("mixed", "--full").exit_code == 2
    assert _bench("mixed", "--full", "--num-requests", "5").exit_code == 2
    assert _bench("batch1").exit_code == 2  # the other workloads keep run_benchmark's defaults (3 rounds)
    assert seen == [("mixed", MIXED_REQUESTS, MIXED_REPEATS), ("mixed", MIXED_FULL_REQUESTS, MIXED_FULL_REPEATS),
                    ("mixed", 5, MIXED_FULL_REPEATS), ("batch1", None, None)]
    assert (MIXED_REQUESTS, MIXED_FULL_REQUESTS, MIXED_FULL_REPEATS) == (16, 64, 3)  # --full: the documented run
    refused = _bench("batch1", "--full")
    assert refused.exit_code == 2 and "--full is for `decodekit bench mixed`" in refused.stderr
    refused = _bench("mixed", "--output", "x.md", "--batches", "1")
    assert refused.exit_code == 2 and "--batches, --output are for `decodekit bench matrix`" in refused.stderr


@pytest.fixture(scope="module")
def tiny_long():
    """A tiny Llama with room for the matrix's text prompts (the tiny tokenizer spells them out in many tokens)."""
    return tiny_model("llama", seed=3, max_position_embeddings=1024), tiny_tokenizer()


def test_bench_matrix_runs_every_cell_against_its_baseline(tiny_long, tmp_path):
    model, tok = tiny_long
    progress = BenchProgress()
    result = run_matrix(hf_model=model, tokenizer=tok, dtypes=["float32", "auto", "bfloat16"], batches=[1, 3],
                        output_len=4, repeats=1, batch1_requests=2, progress=progress,
                        engine_options={"kv_cache_memory": "16MiB", "block_size": 16})
    assert result.dtypes == ["float32", "bfloat16"]  # auto is float32 or bfloat16, each dtype runs once
    assert result.environment["dtype_requested"] == "float32, auto, bfloat16"
    assert next(model.parameters()).dtype == torch.float32  # the caller's model was not cast
    assert [(c.dtype, c.batch, c.strategy) for c in result.cells] == [
        (d, b, s) for d in ("float32", "bfloat16") for b in (1, 3) for s in ("greedy", "speculative", "beam")]
    for c in result.cells:
        assert c.error is None, (c.dtype, c.batch, c.strategy, c.error)
        requests = 2 if c.batch == 1 else 3
        assert c.workload["num_requests"] == requests
        for fig in (c.decodekit, c.transformers):
            assert fig.error is None and fig.rounds == 1 and fig.useful_tokens == requests * 4
        assert c.ratio == pytest.approx(c.decodekit.tokens_per_s / c.transformers.tokens_per_s)
        assert c.transformers.match_decodekit is not None
    cell = result.cell("float32", 1, "speculative")
    assert "prompt_lookup_num_tokens=10" in cell.baseline and "one request at a time" in cell.baseline
    assert cell.decodekit_runs.startswith("n-gram, k ")
    assert "batch 1 only" in result.cell("float32", 3, "speculative").baseline
    assert "num_beams=4" in result.cell("bfloat16", 3, "beam").baseline
    assert result.cell("float32", 3, "greedy").transformers.match_decodekit == 1.0
    assert result.engine_options["float32"]["max_num_seqs"] >= 3 * 4  # every beam of the widest cell at once
    assert progress.scope == ""

    data = json.loads(matrix_json(result))
    assert len(data["cells"]) == 12 and data["machine"] == result.machine
    assert "dtype float32, bfloat16 (asked float32, auto, bfloat16)" in data["machine"]
    target = tmp_path / "matrix.md"
    target.write_text(matrix_markdown(result, "decodekit bench matrix --batches 1,3"))
    markdown = target.read_text()
    rows = [line for line in markdown.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + 12 and rows[0].startswith("| dtype | batch | strategy | decodekit tok/s |")
    assert "`decodekit bench matrix --batches 1,3`" in markdown and result.machine in markdown
    for c in result.cells:
        assert f"**{c.ratio:.2f}**" in markdown
    buffer = io.StringIO()
    render_matrix_table(result, Console(file=buffer, width=250))
    assert "transformers baseline" in buffer.getvalue() and "machine: " in buffer.getvalue()


def test_bench_matrix_command_writes_markdown_and_json(tiny_recipe, tmp_path):
    target = tmp_path / "m.md"
    result = _bench("matrix", "--recipe", str(tiny_recipe), "--dtypes", "float32", "--batches", "2", "--strategies",
                    "greedy,beam", "--repeats", "1", "--output-len", "3", "--threads", "1", "--output", str(target),
                    "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert [(c["batch"], c["strategy"]) for c in data["cells"]] == [(2, "greedy"), (2, "beam")]
    assert "round" not in result.stderr
    text = target.read_text()
    assert "--dtypes float32 --batches 2 --strategies greedy,beam --repeats 1 --output-len 3" in text
    assert f"--recipe {tiny_recipe}" in text
    assert text.count("| float32 | 2 |") == 2
    bad = _bench("matrix", "--batches", "1,x")
    assert bad.exit_code == 2 and "--batches takes comma-separated integers" in bad.stderr
    bad = _bench("matrix", "--strategies", "greedy,sampling", "--recipe", str(tiny_recipe))
    assert bad.exit_code == 2 and "unknown strategy ['sampling']" in bad.stderr
