"""`decodekit batch`, in-process: one output row per input row, joined by id, in input order, a per-row error
instead of a lost row, resuming from whatever a stopped job left on disk, Parquet in and out, and each row's output
equal to running it alone through `LLM.generate`. (The same job on Ray: tests/serve/test_scale_out.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from decodekit.api.errors import RecipeError
from decodekit.api.params import SamplingParams
from decodekit.batch import BatchRow, read_rows, run_batch
from decodekit.batch.output import OutputFile
from decodekit.cli import app
from decodekit.recipe import Recipe, load_recipe
from tests.helpers.batch_cases import mixed_rows, read_jsonl, same, write_jsonl, write_tiny_recipe


@pytest.fixture(scope="module")
def recipe_path(tmp_path_factory) -> Path:
    return write_tiny_recipe(tmp_path_factory.mktemp("batch"))


@pytest.fixture(scope="module")
def recipe(recipe_path) -> Recipe:
    return load_recipe(recipe_path)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "rows.jsonl", mixed_rows(60))


@pytest.fixture(scope="module")
def reference(recipe, dataset, tmp_path_factory) -> list[dict[str, Any]]:
    """The whole job's output, run once in-process from scratch."""
    out = tmp_path_factory.mktemp("ref") / "out.jsonl"
    run_batch(recipe, dataset, out)
    return read_jsonl(out)


def test_one_output_row_per_input_row_in_input_order_with_errors_for_the_rows_that_cannot_run(dataset, reference):
    ids = [row.id for row in read_rows(dataset)]
    assert [r["id"] for r in reference] == ids
    errors = {r["id"]: r["error"] for r in reference if r["error"] is not None}
    assert "not valid JSON" in errors["6"] and "no_such_processor" in errors["10"]
    assert "exactly one of prompt or messages" in errors["empty-11"]
    assert "context" in errors["14"] or "long" in errors["14"]
    assert all(r["text"] is not None and r["usage"]["completion_tokens"] > 0 for r in reference if r["error"] is None)
    assert len(errors) >= 4 and len(errors) < len(reference) // 4
    assert {r["id"] for r in reference} >= {"s1", "s8"}  # a row's own id is kept
    assert len(next(r for r in reference if r["id"] == "3")["choices"]) == 2  # beam search returns its beams


def test_each_rows_output_equals_running_it_alone_through_llm_generate(recipe, dataset, reference):
    llm = recipe.build_llm()
    by_id = {r["id"]: r for r in reference}
    for row in read_rows(dataset)[:24]:
        data = row.data
        if not isinstance(data, dict) or by_id[row.id]["error"] is not None:
            continue
        params = recipe.params_for(BatchRow.model_validate(data).overrides())
        if "messages" in data:
            text, special = llm.apply_chat_template(data["messages"]), False
        else:
            text, special = data["prompt"], True
        alone = llm.generate([text], params, add_special_tokens=special)[0]
        assert by_id[row.id]["token_ids"] == alone.token_ids, row.id
        assert by_id[row.id]["text"] == alone.text


def test_a_job_stopped_midway_resumes_from_the_file_and_ends_equal_to_an_uninterrupted_run(recipe, dataset,
                                                                                         reference, tmp_path):
    out = tmp_path / "out.jsonl"
    whole = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in reference)
    out.write_text(whole[: len(whole) // 2 - 7])  # a stop mid-write: half the rows and a cut line
    summary = run_batch(recipe, dataset, out)
    assert out.read_text().startswith(whole[: whole.rfind("\n", 0, len(whole) // 2 - 7) + 1])  # kept as it was
    assert same(read_jsonl(out), reference)
    assert summary.skipped > 0 and summary.skipped + summary.written == summary.rows == len(reference)
    again = run_batch(recipe, dataset, out)  # nothing left to do
    assert (again.skipped, again.written) == (len(reference), 0) and same(read_jsonl(out), reference)


def test_resumed_rows_that_arrive_out_of_order_are_put_back_in_input_order(recipe, dataset, reference, tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in reference[30:40]))  # a later slice done first
    run_batch(recipe, dataset, out)
    assert [r["id"] for r in read_jsonl(out)] == [r["id"] for r in reference]
    assert same(read_jsonl(out), reference)


def test_retry_errors_reruns_only_the_rows_written_with_an_error(recipe, dataset, reference, tmp_path):
    out = tmp_path / "out.jsonl"
    planted = [dict(r, text=None, token_ids=None, error="a transient failure") if r["id"] == "1" else r
               for r in reference]
    out.write_text("".join(json.dumps(r) + "\n" for r in planted))
    assert run_batch(recipe, dataset, out).written == 0  # a plain rerun keeps error rows
    summary = run_batch(recipe, dataset, out, retry_errors=True)
    assert summary.written == sum(r["error"] is not None for r in reference) + 1
    assert same(read_jsonl(out), reference)


def test_parquet_in_and_out_gives_the_same_rows_and_resumes_through_its_journal(recipe, dataset, reference, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    good = [row.data for row in read_rows(dataset) if isinstance(row.data, dict)][:20]
    table = pa.Table.from_pylist([{"id": r.get("id") or f"p{i}", "prompt": r.get("prompt"),
                                   "sampling": r.get("sampling")} for i, r in enumerate(good) if "prompt" in r])
    source = tmp_path / "rows.parquet"
    pq.write_table(table, source)
    out = tmp_path / "out.parquet"
    journal = OutputFile(out).journal
    first = table.num_rows // 2
    pq.write_table(table.slice(0, first), tmp_path / "half.parquet")
    run_batch(recipe, tmp_path / "half.parquet", out)
    write_jsonl(journal, pq.read_table(out).to_pylist())  # as if the job had stopped before writing the Parquet
    out.unlink()
    summary = run_batch(recipe, source, out)
    assert (summary.skipped, summary.written) == (first, table.num_rows - first)
    assert not journal.exists()
    rows = pq.read_table(out).to_pylist()
    assert [r["id"] for r in rows] == table.column("id").to_pylist()
    fresh = tmp_path / "fresh.jsonl"
    run_batch(recipe, source, fresh)
    assert [(r["id"], r["token_ids"], r["text"]) for r in rows] == \
        [(r["id"], r["token_ids"], r["text"]) for r in read_jsonl(fresh)]


def test_duplicate_ids_and_unknown_file_kinds_are_refused_before_anything_runs(recipe, tmp_path):
    dup = write_jsonl(tmp_path / "dup.jsonl", [{"id": "a", "prompt": "x"}, {"prompt": "y"}, {"id": "a", "prompt": "z"}])
    with pytest.raises(RecipeError, match="rows 1 and 3 share the id 'a'"):
        run_batch(recipe, dup, tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()
    with pytest.raises(RecipeError, match=r"\.jsonl .*\.parquet"):
        run_batch(recipe, tmp_path / "rows.csv", tmp_path / "out.jsonl")
    with pytest.raises(RecipeError, match=r"batch output is \.jsonl or \.parquet"):
        run_batch(recipe, write_jsonl(tmp_path / "one.jsonl", [{"prompt": "x"}]), tmp_path / "out.csv")
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text("hello\n")
    with pytest.raises(RecipeError, match="not an output row"):
        run_batch(recipe, write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "x"}]), foreign)
    assert foreign.read_text() == "hello\n"


def test_a_text_file_is_one_prompt_per_line(recipe, tmp_path):
    source = tmp_path / "prompts.txt"
    source.write_text("first prompt\n\nsecond prompt\n")
    out = tmp_path / "out.jsonl"
    run_batch(recipe, source, out)
    llm = recipe.build_llm()
    rows = read_jsonl(out)
    assert [r["id"] for r in rows] == ["1", "2"]
    assert rows[1]["token_ids"] == llm.generate(["second prompt"], SamplingParams(temperature=0, max_tokens=10))[0] \
        .token_ids


def test_the_cli_writes_the_rows_prints_a_summary_and_exits_1_when_some_rows_failed(recipe_path, dataset, reference,
                                                                                  tmp_path):
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["batch", str(recipe_path), "--input", str(dataset), "--output", str(out)])
    assert result.exit_code == 1, result.output
    assert same(read_jsonl(out), reference)
    assert "written" in result.output and "errors" in result.output
    clean = write_jsonl(tmp_path / "clean.jsonl", [{"prompt": "one"}, {"prompt": "two"}])
    result = CliRunner().invoke(app, ["batch", str(recipe_path), "-i", str(clean), "-o", str(tmp_path / "c.jsonl"),
                                      "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert (summary["rows"], summary["written"], summary["errors"]) == (2, 2, 0)


def test_the_cli_refuses_ray_options_without_ray_and_a_bad_recipe_key(recipe_path, dataset, tmp_path):
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["batch", str(recipe_path), "-i", str(dataset), "-o", str(out),
                                      "--replicas", "2"])
    assert result.exit_code == 2 and "need --ray" in result.output
    result = CliRunner().invoke(app, ["batch", str(recipe_path), "-i", str(dataset), "-o", str(out),
                                      "--set", "sampling.temprature=1"])
    assert result.exit_code == 2 and "temprature" in result.output
    assert not out.exists()


def test_a_row_with_reasoning_gets_its_thinking_apart_and_its_budget(tmp_path):
    from tests.helpers.reasoning_models import save_tiny_qwen3, think_tokenizer

    save_tiny_qwen3(tmp_path / "qwen3")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {tmp_path / 'qwen3'}\ndtype: float32\ndevice: cpu\nengine: {{kv_cache_memory: 16MiB}}\n"
                      "sampling: {temperature: 0, max_tokens: 16, ignore_eos: true}\n"
                      "reasoning: {format: think_tags, thinking: {wrap_up: ' OK'}}\n")
    rows = [{"id": "a", "prompt": "Hello<think>", "reasoning": {"thinking": {"budget": 3}}},
            {"id": "b", "prompt": "Hello<think>", "reasoning": {"thinking": {"budget": -1}}},
            {"id": "c", "prompt": "Hello"}]
    write_jsonl(tmp_path / "in.jsonl", rows)
    run_batch(load_recipe(recipe), tmp_path / "in.jsonl", tmp_path / "out.jsonl")
    a, b, c = read_jsonl(tmp_path / "out.jsonl")
    wrap = len(think_tokenizer().encode(" OK", add_special_tokens=False))
    assert a["reasoning_tokens"] == 3 + wrap + 1 and a["reasoning_text"].endswith(" OK")  # 3 tokens, ` OK`, `</think>`
    assert "reasoning.thinking.budget" in b["error"]
    assert c["reasoning_text"] is not None and c["error"] is None


def test_a_job_runs_its_rows_on_a_frozen_heap_and_gives_it_back_after(recipe, dataset, tmp_path, reference,
                                                                     monkeypatch):
    """With `DECODEKIT_GC_FREEZE` on (the suite runs with it off), the rows run while the heap is frozen out of the
    garbage collector (the engine's steps skip its objects) and the heap is the collector's again once the job is
    done; the rows are the same as without."""
    import gc

    from decodekit.batch.worker import BatchWorker

    gc.unfreeze()
    monkeypatch.setenv("DECODEKIT_GC_FREEZE", "1")
    frozen_while_running: list[int] = []
    original = BatchWorker._run

    def spying(self, rows):
        for row in original(self, rows):
            frozen_while_running.append(gc.get_freeze_count())
            yield row

    monkeypatch.setattr(BatchWorker, "_run", spying)
    out = tmp_path / "out.jsonl"
    try:
        run_batch(recipe, dataset, out)
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
    assert frozen_while_running and min(frozen_while_running) > 10_000
    assert same(read_jsonl(out), reference)
