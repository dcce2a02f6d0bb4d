"""The latency definitions (`decodekit.bench.metrics`) and their three users: `decodekit run`'s summary, `decodekit
bench`'s figures over rounds and `decodekit bench serve`'s figures over streamed requests all report what the
definitions say."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from decodekit.api.sequence import CompletionOutput, RequestMetrics, RequestOutput
from decodekit.bench.baselines import RunRecord
from decodekit.bench.metrics import (
    median,
    median_of_round_percentiles,
    percentile,
    percentiles,
    request_latencies,
    tpot,
)
from decodekit.bench.report import SystemFigures, summarize
from decodekit.bench.serving.client import StreamResult
from decodekit.bench.serving.report import ServerFigures, summarize_run
from decodekit.recipe_runner import summarize as summarize_recipe_run


# ---- the definitions ---------------------------------------------------------------------------------------------
def test_percentile_interpolates_linearly_between_the_closest_ranks():
    assert percentile([], 50) is None
    assert percentile([7.0], 90) == 7.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # order does not matter
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0 and percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([0.0, 10.0], 90) == 9.0
    assert percentiles([1.0, 2.0, 3.0], (50, 99)) == (2.0, pytest.approx(2.98))
    assert percentiles([], (50, 90)) == (None, None)


@given(values=st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), q=st.floats(0, 100))
def test_percentile_is_numpy_s_default_linear_method(values, q):
    expected = torch.quantile(torch.tensor(values, dtype=torch.float64), q / 100).item()
    assert percentile(values, q) == pytest.approx(expected, rel=1e-9, abs=1e-6)


def test_median_skips_missing_values():
    assert median([3.0, None, 1.0, 2.0]) == 2.0
    assert median([1.0, 2.0]) == 1.5
    assert median([None, None]) is None and median([]) is None


def test_the_figure_over_rounds_is_the_median_of_each_round_s_percentile():
    rounds = [[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [10.0]]
    assert median_of_round_percentiles(rounds, (50,)) == (4.0,)  # medians 2, 4, 10
    assert median_of_round_percentiles(rounds, (50, 90)) == (4.0, pytest.approx(median([2.8, 5.6, 10.0])))
    # a round that timed no request: no latency figure at all, rather than one over the other rounds
    assert median_of_round_percentiles([[1.0], []], (50, 90)) == (None, None)
    assert median_of_round_percentiles([[1.0], None], (50,)) == (None,)


def test_tpot_is_the_time_after_the_first_token_over_the_tokens_after_it():
    assert tpot(0.5, 2.5, 5) == 0.5  # 2 s for 4 tokens after the first
    assert tpot(0.5, 1.5, 2) == 1.0
    assert tpot(0.5, 0.5, 1) is None and tpot(0.5, 1.0, 0) is None  # one token: no time per token after it
    assert tpot(None, 1.0, 5) is None  # no first token


def _output(arrival: float, first: float | None, finished: float | None, positions: int) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=arrival, first_token_time=first, finished_time=finished,
                             num_generated_tokens=positions, num_output_positions=positions)
    completion = CompletionOutput(index=0, text="x" * positions, token_ids=list(range(positions)),
                                  finish_reason="length")
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], outputs=[completion], finished=True,
                         metrics=metrics)


def test_request_latencies_are_the_engine_s_per_request_metrics_where_present():
    outputs = [_output(0.0, 0.5, 2.5, 5), _output(1.0, 1.25, 1.25, 1), _output(2.0, None, None, 0)]
    assert request_latencies(outputs) == ([0.5, 0.25], [0.5])  # a one-token request has a TTFT and no TPOT
    assert request_latencies([]) == ([], [])


# ---- the three users -----------------------------------------------------------------------------------------------
def test_the_recipe_summary_reports_p50_and_p90_of_the_engine_s_latencies():
    outputs = [_output(0.0, 0.1 * i, 0.1 * i + 0.05 * (i + 1), i + 2) for i in range(7)]
    ttfts, tpots = request_latencies(outputs)
    summary = summarize_recipe_run(outputs, wall=1.0)
    assert (summary["ttft_p50_s"], summary["ttft_p90_s"]) == percentiles(ttfts, (50, 90))
    assert (summary["tpot_p50_s"], summary["tpot_p90_s"]) == percentiles(tpots, (50, 90))
    assert summary["tpot_p50_s"] == pytest.approx(0.05)


def test_bench_reports_the_median_over_rounds_of_each_round_s_p50_and_p90():
    rounds = [[0.1, 0.2, 0.3], [0.2, 0.4], [0.9]]
    records = [RunRecord(1.0, 10, 10, [[1]], ttft_s=r, tpot_s=[x / 10 for x in r], round_index=i)
               for i, r in enumerate(rounds)]
    fig = SystemFigures("decodekit")
    summarize(fig, records, None)
    assert (fig.ttft_p50_s, fig.ttft_p90_s) == median_of_round_percentiles(rounds, (50, 90))
    assert fig.ttft_p50_s == pytest.approx(0.3)  # round medians 0.2, 0.3, 0.9
    assert (fig.tpot_p50_s, fig.tpot_p90_s) == median_of_round_percentiles([r.tpot_s for r in records], (50, 90))
    untimed = SystemFigures("hf-static")
    summarize(untimed, [RunRecord(1.0, 10, 10, [[1]], ttft_s=None), *records[1:]], None)
    assert untimed.ttft_p50_s is None and untimed.tpot_p90_s is None


def test_bench_serve_reports_p50_and_p99_of_the_streamed_requests():
    results = [StreamResult(status=200, usage_tokens=n, ttft_s=0.1 * n, e2e_s=0.1 * n + 0.02 * (n - 1), done=True,
                            finish_reason="stop") for n in (1, 2, 5, 9)]
    results.append(StreamResult(status=500, error="HTTP 500: boom", ttft_s=0.01, e2e_s=0.02))  # not counted
    fig = ServerFigures("decodekit serve")
    summarize_run(fig, results, 1.0)
    ok = results[:4]
    assert [r.tpot_s for r in ok] == [None, *(tpot(r.ttft_s, r.e2e_s, r.tokens) for r in ok[1:])]
    assert (fig.ttft_p50_s, fig.ttft_p99_s) == percentiles([r.ttft_s for r in ok if r.ttft_s is not None], (50, 99))
    assert (fig.tpot_p50_s, fig.tpot_p99_s) == percentiles([r.tpot_s for r in ok[1:]], (50, 99))
    assert fig.tpot_p50_s == pytest.approx(0.02)
