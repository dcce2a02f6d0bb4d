"""`decodekit bench serve`'s client and server code against a real `decodekit serve` subprocess on a tiny model: the
streamed figures agree with the server's own counts, the table and JSON render, a baseline that cannot start is
reported instead of raised; the transformers-serve run itself is `slow`."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from typer.testing import CliRunner

from decodekit.bench.serving import servers
from decodekit.bench.serving.client import StreamResult, post_chat, run_clients, stream_chat
from decodekit.bench.serving.process import ServerProcess, free_port
from decodekit.bench.serving.report import (
    ServeBenchResult,
    ServerFigures,
    ratios,
    render_serve_table,
    serve_result_json,
    summarize_run,
)
from decodekit.bench.serving.run import parse_peer_url, run_serve_benchmark
from decodekit.bench.serving.servers import decodekit_server
from decodekit.bench.serving.workload import ChatRequest, make_chat_workload
from decodekit.cli import app
from tests.helpers.tiny_folders import save_tiny_llama

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tiny_recipe(tmp_path_factory) -> Path:
    """A recipe over a tiny random Llama (2048 positions: the workload's longest prompts fit) with a chat template."""
    folder = tmp_path_factory.mktemp("bench-serve")
    save_tiny_llama(folder / "tiny", TEMPLATE, max_position_embeddings=2048)
    recipe = folder / "tiny.yaml"
    recipe.write_text(f"model: {folder / 'tiny'}\ndtype: float32\ndevice: cpu\nengine: {{kv_cache_memory: 32MiB}}\n"
                      "sampling: {temperature: 0, max_tokens: 8}\n")
    return recipe


@pytest.fixture(scope="module")
def server(tiny_recipe) -> Iterator[ServerProcess]:
    with decodekit_server(tiny_recipe, threads=1).start(timeout_s=120) as process:
        yield process


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples if not s.labels}


def _model(tiny_recipe: Path) -> str:
    return str(tiny_recipe.parent / "tiny")


def test_streaming_clients_count_what_the_server_generated(server, tiny_recipe):
    work = make_chat_workload(12, seed=3, max_tokens=(2, 8, 16, 24))
    assert {r.greedy for r in work} == {True, False} and len({r.max_tokens for r in work}) > 1
    before = _metrics(server.url)["decodekit_generation_tokens_total"]
    results, wall = asyncio.run(run_clients(server.url, _model(tiny_recipe), work, clients=4))
    after = _metrics(server.url)["decodekit_generation_tokens_total"]

    assert [r.error for r in results] == [None] * len(work)
    assert all(r.usage_tokens is not None and r.done and r.status == 200 for r in results)
    assert sum(r.tokens for r in results) == after - before  # the usage each response returned = the server's count
    for request, result in zip(work, results, strict=True):
        assert 1 <= result.tokens <= request.max_tokens and result.chunks <= result.tokens
        assert result.finish_reason in ("stop", "length") and result.prompt_tokens
        assert result.ttft_s is not None and 0 < result.ttft_s <= result.e2e_s <= wall
        assert result.tpot_s is None if result.tokens < 2 else result.tpot_s >= 0

    fig = ServerFigures("decodekit serve")
    summarize_run(fig, results, wall)
    assert (fig.requests, fig.completed, fig.errors, fig.tokens_from) == (12, 12, 0, "usage")
    assert fig.generated_tokens == after - before and fig.tokens_per_s == fig.generated_tokens / wall
    assert fig.ttft_p50_s <= fig.ttft_p99_s and fig.tpot_p50_s <= fig.tpot_p99_s


def test_streamed_texts_match_responses_seeds_repeat_and_disconnects_free_the_cache(server, tiny_recipe):
    model = _model(tiny_recipe)
    url = f"{server.url}/v1/chat/completions"
    greedy = ChatRequest(({"role": "user", "content": "Hello world"},), 12)
    sampled = ChatRequest(greedy.messages, 12, seed=7, temperature=0.9)

    async def go() -> list:
        async with httpx.AsyncClient(timeout=60) as client:
            return [await stream_chat(client, url, greedy.body(model)),
                    await post_chat(client, url, greedy.body(model, stream=False)),
                    await stream_chat(client, url, sampled.body(model)),
                    await post_chat(client, url, sampled.body(model, stream=False)),
                    await stream_chat(client, url, {**greedy.body(model), "max_tokens": 200, "ignore_eos": True},
                                      disconnect_after=1),
                    await stream_chat(client, url, {**greedy.body(model), "temperature": -1}),
                    await post_chat(client, url, {**greedy.body(model, stream=False), "temprature": 1})]

    streamed, answered, seeded, seeded_again, gone, bad_stream, bad_post = asyncio.run(go())
    assert streamed.error is None and answered.error is None and streamed.text == answered.text
    assert streamed.tokens == answered.tokens
    assert seeded.text == seeded_again.text and seeded.error is None
    assert gone.disconnected and gone.error is None and gone.chunks == 1
    assert bad_stream.status == 400 and "temperature" in bad_stream.error
    assert bad_post.status == 400 and "temprature" in bad_post.error
    for _ in range(100):  # the aborted request's blocks are freed at the engine's next step
        if _metrics(server.url)["decodekit_kv_cache_blocks_used"] == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert _metrics(server.url)["decodekit_kv_cache_blocks_used"] == 0


def test_bench_serve_cli_reports_decodekit_and_why_transformers_did_not_run(tiny_recipe, monkeypatch):
    monkeypatch.setattr(servers, "transformers_executable", lambda: "/nowhere/transformers")
    result = CliRunner().invoke(app, ["bench", "serve", "--recipe", str(tiny_recipe), "--num-requests", "6",
                                      "--clients", "4", "--threads", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    dk, tf = data["servers"]["decodekit"], data["servers"]["transformers"]
    assert (dk["requests"], dk["completed"], dk["errors"], dk["tokens_from"]) == (6, 6, 0, "usage")
    assert dk["generated_tokens"] == sum(dk["per_request"]["tokens"]) > 0 and dk["tokens_per_s"] > 0
    assert dk["ttft_p50_s"] <= dk["ttft_p99_s"] and dk["unavailable"] is None
    assert tf["unavailable"].startswith("cannot run /nowhere/transformers") and tf["requests"] == 0
    assert data["ratios"]["tokens_per_s"] is None and data["clients"] == 4
    assert data["workload"]["num_requests"] == 6 and data["environment"]["server_threads"] == 1
    assert data["dtype"] == "float32" and "cpu_flags" in data["environment"]


def test_bench_serve_sends_the_workload_to_a_running_server_by_url_and_compares_its_greedy_texts(server, tiny_recipe):
    """`--peer-url`: any OpenAI-compatible server already running (here another `decodekit serve` of the same recipe,
    so its greedy answers must be decodekit's own) gets the same warm-up and workload; one that does not answer is
    reported as not run."""
    nobody = f"http://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(app, ["bench", "serve", "--recipe", str(tiny_recipe), "--num-requests", "6",
                                      "--clients", "3", "--threads", "1", "--baseline", "none", "--json",
                                      "--peer-url", f"twin={server.url}/v1/", "--peer-url", nobody])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    dk, twin, gone = data["servers"]["decodekit"], data["servers"]["peer:twin"], data["servers"][
        f"peer:{nobody.split('://')[1]}"]
    assert twin["unavailable"] is None and twin["command"] == [server.url]
    assert (twin["requests"], twin["completed"], twin["errors"]) == (6, 6, 0)
    assert twin["per_request"]["tokens"] == dk["per_request"]["tokens"]  # greedy and seeded: the same lengths
    assert twin["greedy_same_text"] == 1.0
    assert any(f"serving {_model(tiny_recipe)!r}" in note for note in twin["notes"])
    assert gone["unavailable"].startswith(f"no OpenAI-compatible server answers {nobody}/v1/models")
    assert data["peer_ratios"]["twin"]["tokens_per_s"] > 0 and nobody.split("://")[1] not in data["peer_ratios"]


def test_peer_urls_are_parsed_with_an_optional_name():
    assert parse_peer_url("vllm=http://10.0.0.2:8000/v1/") == ("vllm", "http://10.0.0.2:8000")
    assert parse_peer_url("http://127.0.0.1:8080") == ("127.0.0.1:8080", "http://127.0.0.1:8080")
    with pytest.raises(ValueError, match="takes \\[name=\\]http"):
        parse_peer_url("llama=127.0.0.1:8080")


def test_bench_serve_cli_refuses_an_unknown_baseline(tiny_recipe):
    result = CliRunner().invoke(app, ["bench", "serve", "--recipe", str(tiny_recipe), "--baseline", "vllm"])
    assert result.exit_code == 2 and "unknown baseline(s) ['vllm'] for serve" in result.stderr


def test_the_table_shows_both_servers_the_ratios_and_a_server_that_did_not_run():
    dk, tf = ServerFigures("decodekit serve"), ServerFigures("transformers serve --continuous-batching")
    summarize_run(dk, [StreamResult(status=200, usage_tokens=10, ttft_s=0.1, e2e_s=1.0, done=True)], 2.0)
    summarize_run(tf, [StreamResult(status=200, usage_tokens=10, ttft_s=0.2, e2e_s=2.0, done=True),
                       StreamResult(status=500, error="HTTP 500: boom")], 4.0)
    result = ServeBenchResult({"name": "serve", "num_requests": 1, "greedy": 1, "sampled": 0, "max_tokens_min": 10,
                               "max_tokens_max": 10}, "m", "float32", 2, {"decodekit": dk, "transformers": tf},
                              ratios(dk, tf), {"server_threads": 1})
    out = io.StringIO()
    render_serve_table(result, Console(file=out, width=250))
    text = out.getvalue()
    assert "decodekit / transformers" in text and "2.00x" in text and "0.50x" in text  # 5 vs 2.5 tok/s; TTFT
    assert "HTTP 500: boom" in text and "counted from usage" in text
    tf.unavailable = "cannot run transformers: missing"
    out = io.StringIO()
    render_serve_table(result, Console(file=out, width=250))
    assert "(not run)" in out.getvalue() and "did not run: cannot run transformers: missing" in out.getvalue()
    assert json.loads(serve_result_json(result))["servers"]["transformers"]["errors"] == 1


def test_the_table_printed_to_a_narrow_non_terminal_shows_the_server_names_in_full(monkeypatch):
    """Piped or redirected output has no terminal width (rich assumes 80 columns): the table is printed as wide as
    it needs rather than wrapping or cutting the servers' names."""
    monkeypatch.delenv("COLUMNS", raising=False)
    dk, tf = ServerFigures("decodekit serve"), ServerFigures("transformers serve --continuous-batching")
    summarize_run(dk, [StreamResult(status=200, usage_tokens=10, ttft_s=0.1, e2e_s=1.0, done=True)], 2.0)
    tf.unavailable = "cannot run transformers: missing"
    result = ServeBenchResult({"name": "serve", "num_requests": 1, "greedy": 1, "sampled": 0, "max_tokens_min": 10,
                               "max_tokens_max": 10}, "HuggingFaceTB/SmolLM2-135M-Instruct", "float32", 2,
                              {"decodekit": dk, "transformers": tf}, ratios(dk, tf), {"server_threads": 1})
    out = io.StringIO()
    render_serve_table(result, Console(file=out, width=60))
    text = out.getvalue()
    cells = {cell.strip() for line in text.splitlines() for cell in line.replace("┃", "│").split("│")}
    assert {"decodekit serve", "transformers serve --continuous-batching (not run)", "TTFT p50 ms"} <= cells
    assert "…" not in text and "HuggingFaceTB/SmolLM2-135M-Instruct" in text


@pytest.mark.slow
def test_transformers_serve_runs_the_same_workload(tiny_recipe):
    """The real baseline, on the tiny model (transformers serve takes ~10 s to start)."""
    work = make_chat_workload(8, seed=1, max_notes=2, max_tokens=(4, 8, 16))
    result = run_serve_benchmark(tiny_recipe, clients=4, requests=work, threads=1)
    dk, tf = result.servers["decodekit"], result.servers["transformers"]
    assert tf.unavailable is None, tf.unavailable
    assert (dk.errors, tf.errors) == (0, 0), (dk.error_samples, tf.error_samples)
    assert tf.tokens_from == "usage" and tf.generated_tokens > 0 and tf.greedy_same_text is not None
    assert all(v is not None for v in result.ratios.values())
