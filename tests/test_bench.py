"""The benchmark harness on a tiny in-process model: workloads, structure of results, rendering. No timings."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console

from decodekit.bench import (
    SYSTEMS,
    WORKLOADS,
    BenchResult,
    SystemFigures,
    default_baselines,
    make_workload,
    render_table,
    result_json,
    run_benchmark,
)
from decodekit.errors import ConfigError
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
