"""The command line: `decodekit run` on a tiny model saved to a folder (and once on the bundled model), `recipe
check`, `plugins --json`, `bench --recipe`, user mistakes, and a third-party plugin installed from its own folder
and found through its entry point."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from decodekit.api.sequence import CompletionOutput, RequestMetrics, RequestOutput
from decodekit.cli import app, terminal
from decodekit.cli.summary import render_summary
from decodekit.recipe_runner import summarize
from tests.helpers.tiny_folders import tiny_overrides as _tiny

ROOT = Path(__file__).parents[2]


def _invoke(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, list(args), env=env)


def _run_shipped(name: str, tiny_dir, tmp_path):
    """Run a shipped recipe on the tiny model; return its prompts, the CLI result and the --output rows."""
    recipe = ROOT / "recipes" / f"{name}.yaml"
    prompts = yaml.safe_load(recipe.read_text())["inputs"]["prompts"]
    out = tmp_path / "out.jsonl"
    result = _invoke("run", str(recipe), *_tiny(tiny_dir), "--output", str(out), "--quiet")
    assert result.exit_code == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == prompts
    return prompts, result, rows


@pytest.mark.parametrize("name", ["quickstart", "sampling"])
def test_a_shipped_recipe_runs_end_to_end_on_a_tiny_model(name, tiny_dir, tmp_path):
    prompts, result, rows = _run_shipped(name, tiny_dir, tmp_path)
    assert [r["id"] for r in rows] == [str(i + 1) for i in range(len(prompts))]
    for row in rows:
        assert 1 <= len(row["token_ids"]) <= 6 and row["finish_reason"] in ("stop", "length")
        assert row["usage"]["completion_tokens"] == len(row["token_ids"]) == row["metrics"]["generated_tokens"]
        assert row["usage"]["total_tokens"] == row["usage"]["prompt_tokens"] + len(row["token_ids"])
        assert row["metrics"]["ttft_s"] > 0
    assert all(f">>> {p}" in result.stdout for p in prompts)
    assert "summary" in result.stdout and f"requests       │ {len(prompts)}" in result.stdout


def test_quickstart_on_the_bundled_model_answers_paris_with_a_summary_table():
    result = _invoke("run", str(ROOT / "recipes" / "quickstart.yaml"), "--prompt", "What is the capital of France?",
                     "--set", "sampling.temperature=0")
    assert result.exit_code == 0, result.stderr
    answer = result.stdout.split(">>> What is the capital of France?\n")[1].split("summary")[0]
    assert "Paris" in answer
    for row in ("requests       │ 1", "tokens/s", "TTFT p50 / p90", "TPOT p50 / p90", "finish reasons │ stop: 1"):
        assert row in result.stdout


def test_json_prints_one_object_with_the_summary_and_every_choice(tiny_dir):
    result = _invoke("run", str(ROOT / "recipes" / "quickstart.yaml"), *_tiny(tiny_dir), "--json",
                     "--prompt", "a", "--prompt", "b", "--set", "sampling.n=2", "--set", "outputs.compare_plain=true")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["model"] == str(tiny_dir)
    summary = data["summary"]
    assert summary["requests"] == 2 and summary["output_tokens"] == sum(
        len(c["token_ids"]) for r in data["outputs"] for c in r["choices"])
    assert summary["speedup_vs_plain"] > 0 and summary["acceptance_rate"] is None
    assert [len(r["choices"]) for r in data["outputs"]] == [2, 2]
    assert data["outputs"][0]["choices"][0]["token_ids"] == data["outputs"][0]["token_ids"]


def test_the_summary_reports_acceptance_when_drafts_were_proposed(capsys):
    def output(draft: int, accepted: int) -> RequestOutput:
        metrics = RequestMetrics(0.0, first_token_time=0.1, finished_time=0.5, num_generated_tokens=5,
                                 num_draft_tokens=draft, num_accepted_tokens=accepted)
        return RequestOutput("r", "p", [1], [CompletionOutput(0, "t", [3] * 5, "length")], True, metrics)

    summary = summarize([output(8, 6), output(12, 9)], 2.0)
    assert (summary["draft_tokens"], summary["accepted_tokens"], summary["acceptance_rate"]) == (20, 15, 0.75)
    assert summary["tokens_per_s"] == 5.0 and summary["finish_reasons"] == {"length": 2}
    render_summary(summary)
    assert "draft acceptance │ 75.0% (15 of 20 tokens)" in capsys.readouterr().out
    assert summarize([output(0, 0)], 1.0)["acceptance_rate"] is None


# ---- user mistakes: one message, a non-zero exit, no traceback ----------------------------------------------------
@pytest.mark.parametrize(("text", "message"), [
    ("model: m\nsampling:\n  temperature: 0.5\n   top_p: 1\n", "x.yaml: YAML syntax error at line 4, column 9"),
    ("model: m\nmodle: n\n", "x.yaml: modle: unknown key 'modle' (did you mean 'model'?)"),
    ("model: m\nprocessors: [{top_q: {q: 1}}]\n", "x.yaml: processors[0]: unknown processor 'top_q' (did you mean"),
    ("model: m\nprocessors: [{top_p: {top_p: -1}}]\n", "x.yaml: processors[0].top_p.top_p: Input should be greater"),
])
def test_a_bad_recipe_exits_2_with_one_message_and_no_traceback(text, message, tmp_path):
    (tmp_path / "x.yaml").write_text(text)
    for command in ("run", "recipe check"):
        result = _invoke(*command.split(), str(tmp_path / "x.yaml"))
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
        assert result.stderr.startswith("error: ") and message in result.stderr and result.stdout == ""
        assert "Traceback" not in result.stderr


def test_a_missing_model_or_no_prompts_exit_2_with_one_message(tmp_path):
    (tmp_path / "x.yaml").write_text(f"model: {tmp_path / 'nowhere'}\ninputs: {{prompts: [hi]}}\n")
    result = _invoke("run", str(tmp_path / "x.yaml"), "--quiet")
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: no such file or folder: '{tmp_path / 'nowhere'}'")
    assert "Traceback" not in result.stderr
    (tmp_path / "y.yaml").write_text("model: m\n")
    result = _invoke("run", str(tmp_path / "y.yaml"))
    assert result.exit_code == 2 and "no prompts to run" in result.stderr


def test_a_prompts_file_with_a_bad_line_runs_the_good_ones_reports_the_bad_one_and_exits_1(tiny_dir, tmp_path):
    good = {"prompt": "Hello", "id": "a", "sampling": {"max_tokens": 2}}
    (tmp_path / "p.jsonl").write_text(json.dumps(good) + "\n{\"prompt\": \"x\", \"sampling\": {\"top_p\": 7}}\nbye\n")
    out = tmp_path / "out.jsonl"
    result = _invoke("run", str(ROOT / "recipes" / "quickstart.yaml"), *_tiny(tiny_dir), "--quiet",
                     "--prompts", str(tmp_path / "p.jsonl"), "--output", str(out))
    assert result.exit_code == 1
    bad = "p.jsonl line 2: sampling.top_p: Input should be less than or equal to 1, got 7"
    assert f"skipped {bad}" in result.stderr and "Traceback" not in result.stderr
    assert "bad input lines" in result.stdout and "p.jsonl line 2" in result.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r.get("input"), r.get("error")) for r in rows] == [
        ("a", None, None), ("2", "p.jsonl line 2", bad.split(": ", 1)[1]),
        ("3", "p.jsonl line 3", "not valid JSON: Expecting value (column 1)")]
    assert 1 <= len(rows[0]["token_ids"]) <= 2


def test_recipe_check_prints_the_resolved_recipe_and_its_plan_in_order():
    result = _invoke("recipe", "check", str(ROOT / "recipes" / "sampling.yaml"), "--set", "sampling.top_k=20")
    assert result.exit_code == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert resolved["sampling"]["top_k"] == 20 and resolved["engine"]["block_size"] == 16  # defaults filled in
    plan = resolved["plan"]
    names = [next(iter(p)) if isinstance(p, dict) else p for p in plan["processors"]]
    assert names[0] == "repetition_penalty" and names[1:] == ["temperature", "top_k", "top_p"]
    assert {"eos", "max_tokens", "stop_strings"} <= {s for s in plan["stopping"] if isinstance(s, str)}
    assert {"time_limit": {"seconds": 60.0}} in plan["stopping"] and plan["strategy"] == "sample"
    assert "sampling.yaml: ok" in result.stderr


@pytest.mark.parametrize("bf16_cpu", [True, False])
def test_recipe_check_says_which_dtype_auto_chooses_on_this_cpu_and_why(bf16_cpu, monkeypatch, tiny_dir):
    """A Hugging Face folder: bf16 where the CPU has bf16 dot products, else float32. The bundled model (a GGUF):
    float32 activations over its quantized weights as stored, on either CPU."""
    from decodekit.models import loader

    monkeypatch.setattr(loader, "cpu_has_bf16_dot_products", lambda: bf16_cpu)
    monkeypatch.setattr(loader, "_native_kernels_possible", lambda: True)
    quickstart = str(ROOT / "recipes" / "quickstart.yaml")
    result = _invoke("recipe", "check", quickstart, "--set", "device=cpu", "--set", f"model={tiny_dir}")
    assert result.exit_code == 0, result.stderr
    said = " ".join(result.stderr.split())
    if bf16_cpu:
        assert "dtype: auto -> bfloat16 on cpu (this CPU has bf16 dot products" in said
    else:
        assert "dtype: auto -> float32 on cpu (this CPU has no bf16 dot products" in said
    bundled = _invoke("recipe", "check", quickstart, "--set", "device=cpu")
    assert bundled.exit_code == 0, bundled.stderr
    said = " ".join(bundled.stderr.split())
    assert "dtype: auto -> float32 on cpu (the file's quantized weights run as stored" in said
    pinned = _invoke("recipe", "check", quickstart, "--set", "dtype=float32")
    assert pinned.exit_code == 0 and "dtype" not in pinned.stderr  # a dtype the recipe names needs no reason


def test_plugins_json_lists_what_each_plugin_registers_with_parameter_schemas():
    result = _invoke("plugins", "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    stopping = data["decodekit_plugins.stopping"]
    assert stopping["origin"] == "default (decodekit)"
    limit = next(e for e in stopping["stopping_criteria"] if e["name"] == "time_limit")
    assert limit["params"]["properties"]["seconds"]["exclusiveMinimum"] == 0 and limit["default"] is False
    assert limit["description"].startswith("Stop a request `seconds` after it arrived")
    table = _invoke("plugins")
    assert table.exit_code == 0 and "time_limit" in table.stdout


def test_piped_plugins_table_shows_every_plugin_and_component_name_in_full(monkeypatch):
    """Piped output has no terminal width: rich's default of 80 columns cut names to 'decodekit…'. The console here
    is 60 columns and not a terminal (CliRunner captures stdout), as in CI or `decodekit plugins | grep`."""
    from decodekit.core.plugin_manager import get_plugin_manager
    from decodekit.core.registry import Registry

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(terminal, "console", Console(width=60))  # no file: it writes to CliRunner's stdout
    result = _invoke("plugins")
    assert result.exit_code == 0 and "…" not in result.stdout
    registry = Registry.from_plugin_manager(get_plugin_manager())
    shown = {cell.strip() for line in result.stdout.splitlines() for cell in line.split("│")}
    for kind in ("processors", "stopping_criteria", "strategies", "proposers"):
        for entry in getattr(registry, kind).values():
            assert entry.name in shown and entry.plugin in shown, (kind, entry.name, entry.plugin)
    assert max(len(line) for line in result.stdout.splitlines()) > 60  # as wide as the names need


def test_plugins_table_keeps_an_explicit_columns_width_and_folds_names_instead_of_cutting_them(monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    monkeypatch.setattr(terminal, "console", Console(width=60))
    result = _invoke("plugins")
    lines = result.stdout.splitlines()
    assert result.exit_code == 0 and "…" not in result.stdout and max(len(line) for line in lines) <= 60
    # a name too long for its column goes on over the next lines rather than ending in an ellipsis
    plugin_column = "".join(line.split("│")[1].strip() for line in lines if line.startswith("│"))
    assert "decodekit_plugins.structured" in plugin_column


def test_bench_takes_the_model_and_engine_limits_from_a_recipe(tiny_dir, tmp_path):
    (tmp_path / "b.yaml").write_text(f"model: {tiny_dir}\ndtype: float32\nengine: {{max_num_seqs: 4, "
                                     "kv_cache_memory: 8MiB}\n")
    result = _invoke("bench", "batch1", "--recipe", str(tmp_path / "b.yaml"), "--repeats", "1", "--output-len", "3",
                     "--baseline", "hf-sequential", "--threads", "1", "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["model"] == str(tiny_dir) and data["engine_options"] == {"max_num_seqs": 4,
                                                                         "kv_cache_memory": 8 * 2**20}


# ---- a third-party plugin from its own folder -------------------------------------------------------------------
# `plugin_site` (tests/fixtures/plugin_pkg installed into a private folder) is in tests/conftest.py, shared with
# tests/plugins/test_third_party_package.py.


PLUGIN_RECIPE = """\
model: m
sampling: {temperature: 0, max_tokens: 8, ignore_eos: true}
processors: [{ban_tokens: {token_ids: [%s]}}]
stopping: [{token_quota: {tokens: 3}}]
inputs: {prompts: [The capital of France is]}
"""


def test_a_third_party_plugin_is_found_through_its_entry_point_listed_and_used_by_a_recipe(
        plugin_site, tiny_dir, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_site))
    monkeypatch.delenv("DECODEKIT_PLUGINS", raising=False)
    listed = json.loads(_invoke("plugins", "--json").stdout)
    assert listed["example"]["origin"] == "decodekit-example-plugin==0.1.0"
    assert [e["name"] for e in listed["example"]["processors"]] == ["ban_tokens"]
    assert [e["name"] for e in listed["example"]["stopping_criteria"]] == ["token_quota"]
    assert listed["example"]["processors"][0]["params"]["required"] == ["token_ids"]

    def run(banned: int) -> dict:
        (tmp_path / "r.yaml").write_text(PLUGIN_RECIPE % banned)
        result = _invoke("run", str(tmp_path / "r.yaml"), "--set", f"model={tiny_dir}", "--set", "dtype=float32",
                         "--set", "device=cpu", "--set", "engine.kv_cache_memory=16MiB", "--json")
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout)["outputs"][0]

    free = run(banned=0)
    assert len(free["token_ids"]) == 3 and free["finish_reason"] == "stop" and free["stop_reason"] == "token_quota"
    banned = run(banned=free["token_ids"][0])
    assert free["token_ids"][0] not in banned["token_ids"] and len(banned["token_ids"]) == 3

    monkeypatch.setenv("DECODEKIT_PLUGINS", "example")
    assert "example" in json.loads(_invoke("plugins", "--json").stdout)


def test_an_empty_allow_list_keeps_the_third_party_plugin_out(plugin_site, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_site))
    monkeypatch.setenv("DECODEKIT_PLUGINS", "")
    assert "example" not in json.loads(_invoke("plugins", "--json").stdout)
    (tmp_path / "r.yaml").write_text(PLUGIN_RECIPE % 5)
    result = _invoke("recipe", "check", str(tmp_path / "r.yaml"))
    assert result.exit_code == 2 and "processors[0]: unknown processor 'ban_tokens'" in result.stderr


@pytest.mark.parametrize(("name", "choices"), [("creative", 1), ("speculative", 1), ("beam_search", 2),
                                               ("parallel_sampling", 4), ("json_output", 1), ("regex", 1)])
def test_every_other_shipped_recipe_runs_end_to_end_on_a_tiny_model(name, choices, tiny_dir, tmp_path):
    _, result, rows = _run_shipped(name, tiny_dir, tmp_path)
    for row in rows:
        assert "error" not in row and len(row.get("choices", [row])) == choices
        assert all(1 <= len(c["token_ids"]) <= 6 for c in row.get("choices", [row]))
    if name == "speculative":
        assert "speedup vs plain sample" in result.stdout
    if name == "beam_search":
        assert all(c["score"] is not None for r in rows for c in r["choices"])


def test_run_with_trace_writes_one_line_per_request_with_an_event_per_token_and_the_stop(tiny_dir, tmp_path):
    trace = tmp_path / "trace.jsonl"
    result = _invoke("run", str(ROOT / "recipes" / "sampling.yaml"), *_tiny(tiny_dir), "--prompt", "a", "--prompt",
                     "b", "--trace", str(trace), "--quiet")
    assert result.exit_code == 0, result.stderr
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["a", "b"]
    for row in rows:
        out = row["outputs"][0]
        events = [e for e in out["trace"] if "token" in e]
        assert [e["token"] for e in events] == out["token_ids"]
        assert all(e["stages"][0]["stage"] == "model" and len(e["stages"][0]["top"]) == 5 for e in events)
        assert out["trace"][-1]["finished"] == out["finish_reason"]


@pytest.mark.parametrize("setting", ["1", "0"])
def test_run_freezes_the_heap_of_its_one_engine_unless_the_variable_says_no(tiny_dir, tmp_path, monkeypatch, setting):
    """`decodekit run` builds one engine and keeps it: after building it, what is alive moves to the collector's
    permanent generation (`gc.freeze`), so the decode steps' collections skip the model's ~400K objects;
    `DECODEKIT_GC_FREEZE=0` (what the suite runs under, tests/conftest.py) leaves the heap as it was."""
    gc.unfreeze()
    monkeypatch.setenv("DECODEKIT_GC_FREEZE", setting)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: m\ninputs: {prompts: [hi]}\nsampling: {max_tokens: 4}\n")
    try:
        result = _invoke("run", str(recipe), *_tiny(tiny_dir), "--quiet")
        assert result.exit_code == 0, result.stderr
        frozen = gc.get_freeze_count()
    finally:
        gc.unfreeze()
    assert (frozen > 10_000) == (setting == "1"), frozen
