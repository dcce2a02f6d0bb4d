"""The first five minutes with decodekit (issue 21, item 6): what a new user meets first works as shown.

- the run summary's speedup is the ratio of the two rates it prints beside it (no table that contradicts itself);
- every Python block of README.md compiles (fast) and runs as pasted (the ones loading the bundled model: slow);
- `decodekit recipe check` looks the model up without loading it, and refuses one `run` could not load;
- the `decodekit` commands print no transformers progress bar ("Loading weights", GGUF conversion);
- `decodekit --help` starts without importing torch, and the documented imports still work.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from decodekit.api.sequence import CompletionOutput, RequestMetrics, RequestOutput
from decodekit.cli import app, terminal
from decodekit.cli.summary import render_summary
from decodekit.models import BUNDLED_MODEL_NAME, resolve_model
from decodekit.recipe_runner import summarize
from tests.helpers.tiny_folders import save_tiny_llama
from tests.helpers.tiny_folders import tiny_overrides as _tiny
from tests.plugins.test_plugin_docs import Block, blocks

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
QUICKSTART = str(ROOT / "recipes" / "quickstart.yaml")
SPECULATIVE = str(ROOT / "recipes" / "speculative.yaml")
def _invoke(*args: str):
    return CliRunner().invoke(app, list(args))


# ---- 1. the summary's speedup and the rates beside it -------------------------------------------------------------
_SPEEDUP_ROW = re.compile(r"speedup vs plain sample │ ([\d.]+)x \(([\d.]+) vs ([\d.]+) mean tokens/s\)")


def _output(tokens: int) -> RequestOutput:
    metrics = RequestMetrics(0.0, first_token_time=0.1, finished_time=0.5, num_generated_tokens=tokens)
    return RequestOutput("r", "p", [1], [CompletionOutput(0, "t", [3] * tokens, "length")], True, metrics)


def _printed_speedup(text: str) -> tuple[float, float, float]:
    match = _SPEEDUP_ROW.search(text)
    assert match, text
    speedup, strategy, plain = (float(g) for g in match.groups())
    return speedup, strategy, plain


def _consistent(speedup: float, strategy: float, plain: float) -> bool:
    """The printed speedup is the printed rates' ratio, up to their rounding (2 and 1 decimals)."""
    ratio = strategy / plain
    return abs(speedup - ratio) <= 0.005 + ratio * (0.05 / strategy + 0.05 / plain) + 1e-9


def test_the_speedup_is_exactly_the_ratio_of_the_strategy_and_plain_rates_the_summary_shows(capsys, monkeypatch):
    # the first run was fast (17 tokens/s) but the strategy's mean over its two comparison runs was not: the
    # speedup must be computed from, and printed beside, the mean rate, never the first run's
    outputs, plain = [_output(17)], [_output(10)]
    summary = summarize(outputs, 1.0, (), plain, plain_wall=3.0, strategy_wall=3.0)
    assert summary["tokens_per_s"] == 17.0  # the first run, as the wall time above it
    assert summary["strategy_tokens_per_s"] == 17 / 3.0 and summary["plain_tokens_per_s"] == 10 / 3.0
    assert summary["speedup_vs_plain"] == summary["strategy_tokens_per_s"] / summary["plain_tokens_per_s"]
    monkeypatch.setattr(terminal, "console", Console(width=120, color_system=None))
    render_summary(summary)
    speedup, strategy, plain_rate = _printed_speedup(capsys.readouterr().out)
    assert (speedup, strategy, plain_rate) == (1.70, 5.7, 3.3)
    assert _consistent(speedup, strategy, plain_rate)


def test_without_comparison_runs_the_speedup_uses_the_run_itself():
    summary = summarize([_output(12)], 2.0, (), [_output(12)], plain_wall=4.0)
    assert summary["strategy_tokens_per_s"] == summary["tokens_per_s"] == 6.0
    assert summary["speedup_vs_plain"] == 6.0 / 3.0


def test_decodekit_run_prints_and_returns_a_speedup_that_is_the_ratio_of_the_rates_beside_it(tiny_dir):
    result = _invoke("run", SPECULATIVE, *_tiny(tiny_dir), "--quiet", "-p", "a b c a b c a b", "-p", "x y z x y")
    assert result.exit_code == 0, result.stderr
    assert _consistent(*_printed_speedup(result.stdout))
    result = _invoke("run", SPECULATIVE, *_tiny(tiny_dir), "--json", "-p", "a b c a b c a b")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)["summary"]
    assert summary["speedup_vs_plain"] == summary["strategy_tokens_per_s"] / summary["plain_tokens_per_s"]


def test_the_shipped_speculative_recipe_reports_acceptance_per_chained_proposer(tiny_dir):
    """recipes/speculative.yaml chains n-gram (two-token matches) to suffix decoding: on a prompt that repeats
    itself and one that does not, both proposers draft, and the table and JSON give each one's share. (Every step
    asks the proposers here, for a fixed 4 tokens: with runs between drafts, or k chosen by this machine's step
    cost, whether a proposer is asked at all depends on the machine's load; a CI run once drafted one token.)"""
    prompts = ["-p", "a b c d a b c d a b c d a b", "-p", "zebra quartz violin",
               "--set", "strategy.speculative.runs_without_drafts=0",
               "--set", "strategy.speculative.num_speculative_tokens=4"]
    result = _invoke("run", SPECULATIVE, *_tiny(tiny_dir, max_tokens=24), "--json", *prompts)
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)["summary"]
    by_proposer = summary["proposer_tokens"]
    assert set(by_proposer) == {"ngram", "suffix"}, by_proposer
    assert sum(c["drafted"] for c in by_proposer.values()) == summary["draft_tokens"]
    assert sum(c["accepted"] for c in by_proposer.values()) == summary["accepted_tokens"]
    table = _invoke("run", SPECULATIVE, *_tiny(tiny_dir, max_tokens=24), "--quiet", *prompts)
    assert table.exit_code == 0, table.stderr
    assert re.search(r"by ngram +│ [\d.]+% \(\d+ of \d+ tokens\)", table.stdout), table.stdout
    assert re.search(r"by suffix +│ [\d.]+% \(\d+ of \d+ tokens\)", table.stdout), table.stdout


# ---- 2. README's Python blocks ------------------------------------------------------------------------------------
def _readme_python() -> list[Block]:
    return [b for b in blocks(README) if b.lang == "python"]


def _label(block: Block) -> str:
    return f"README.md:{block.line}"


def _loads_a_model(block: Block) -> bool:
    """Whether the block builds an `LLM`/`AsyncLLM` (the bundled model: seconds, so the test is slow)."""
    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("LLM", "AsyncLLM")
               for node in ast.walk(ast.parse(block.code)))


def _undefined_names(code: str) -> set[str]:
    """Names a block reads but neither binds (imports, assignments, definitions, parameters) nor gets from builtins:
    a missing import, caught without running the block. Coarse (one scope for the whole block), which is enough for
    snippets."""
    tree = ast.parse(code)
    bound, read = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return read - bound


def _runnable() -> list:
    return [pytest.param(b, id=_label(b), marks=[pytest.mark.slow] if _loads_a_model(b) else [])
            for b in _readme_python() if b.mark != "not run"]


def test_every_readme_python_block_compiles_as_a_program_and_imports_what_it_uses():
    python = _readme_python()
    assert len(python) >= 4
    for block in python:
        # no flags: a top-level `await` / `async for` (which only a REPL takes) is a SyntaxError here
        compile(block.code, _label(block), "exec")
        assert not _undefined_names(block.code), (_label(block), _undefined_names(block.code))


def test_a_readme_block_not_run_says_why_and_few_do():
    not_run = [b for b in _readme_python() if b.mark == "not run"]
    assert all(b.arg for b in not_run) and len(not_run) <= 1, [(_label(b), b.arg) for b in not_run]


def test_the_checks_catch_what_the_old_async_snippet_got_wrong():
    old = ('from decodekit import AsyncLLM\nllm = AsyncLLM(model="smollm2-135m-instruct")\n'
           'async for out in llm.generate("Once upon a time", SamplingParams(max_tokens=64), request_id="r1"):\n'
           '    print(out.delta_text[0], end="", flush=True)\n')
    with pytest.raises(SyntaxError):
        compile(old, "old", "exec")
    fixed = "async def main():\n" + "".join(f"    {line}\n" for line in old.splitlines())
    assert _undefined_names(fixed) == {"SamplingParams"}


def test_the_readme_states_the_default_max_tokens():
    from decodekit import SamplingParams

    default = SamplingParams().max_tokens
    assert f"`max_tokens` (default {default}" in README.read_text()


@pytest.mark.parametrize("block", _runnable())
def test_every_readme_python_block_runs_as_pasted(block, capsys):
    exec(compile(block.code, _label(block), "exec"), {"__name__": "__main__"})
    if _loads_a_model(block):
        assert capsys.readouterr().out.strip()  # it printed the model's answer


# ---- 3. recipe check resolves the model -------------------------------------------------------------------------
def _check(*sets: str):
    return _invoke("recipe", "check", QUICKSTART, *[arg for item in sets for arg in ("--set", item)])


def test_recipe_check_refuses_an_unknown_model_naming_the_key_and_what_it_accepts():
    result = _check("model=no-such-model")
    assert result.exit_code == 2 and "Traceback" not in result.output
    message = " ".join(result.stderr.split())
    assert message.startswith(f"error: {QUICKSTART}: model: no model loader accepts 'no-such-model' (tried: bundled, "
                              "gguf, hf-folder, hub)")
    for accepted in (f"'{BUNDLED_MODEL_NAME}'", "a local Hugging Face folder (with a config.json)", "a .gguf file",
                     "a hub id like 'org/name'"):
        assert accepted in message
    assert _invoke("run", QUICKSTART, "--set", "model=no-such-model", "-p", "hi").exit_code == 2  # as run fails


def test_recipe_check_names_the_draft_model_key_too():
    result = _check("draft.model=no-such-draft")
    assert result.exit_code == 2
    assert f"{QUICKSTART}: draft.model: no model loader accepts 'no-such-draft'" in " ".join(result.stderr.split())


def test_recipe_check_refuses_a_draft_with_another_vocabulary_naming_the_draft_key(tiny_dir, tmp_path):
    other = save_tiny_llama(tmp_path / "other", vocab_size=512)
    result = _check(f"model={tiny_dir}", f"draft.model={other}")
    assert result.exit_code == 2 and "Traceback" not in result.output
    message = " ".join(result.stderr.split())
    assert f"{QUICKSTART}: draft.model: {str(other)!r} has a vocabulary of 512 ids" in message
    assert "needs a draft with the target's tokenizer" in message
    assert _check(f"model={tiny_dir}", f"draft.model={tiny_dir}").exit_code == 0  # the same vocabulary passes


def test_recipe_check_accepts_a_model_folder_the_bundled_model_and_a_gguf_file_that_exist(tiny_dir, tmp_path):
    assert _check(f"model={tiny_dir}").exit_code == 0
    assert _check(f"model={BUNDLED_MODEL_NAME}").exit_code == 0
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert _check(f"model={tmp_path / 'm.gguf'}").exit_code == 0


@pytest.mark.parametrize(("spec", "message"), [
    ("{tmp}", "is a folder without a config.json"),
    ("{tmp}/missing.gguf", "GGUF file not found"),
    ("{tmp}/nowhere", "no such file or folder"),
    ("some-org/not-downloaded", "looks like a hub id but is not in the local Hugging Face cache"),
])
def test_recipe_check_refuses_a_model_that_is_not_there(tmp_path, spec, message):
    result = _check(f"model={spec.format(tmp=tmp_path)}")
    assert result.exit_code == 2
    error = " ".join(result.stderr.split())
    assert error.startswith(f"error: {QUICKSTART}: model: ") and message in error, error


def test_recipe_check_accepts_a_hub_id_in_the_local_cache_without_loading_it(tmp_path, monkeypatch):
    from huggingface_hub import constants

    repo = tmp_path / "models--some-org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")  # no weights at all: nothing is loaded
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert resolve_model("some-org/tiny").name == "hub"
    assert _check("model=some-org/tiny").exit_code == 0
    assert _check("model=some-org/other").exit_code == 2


def test_resolving_a_model_loads_nothing(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a folder transformers could not even load
    assert resolve_model(str(tmp_path)).name == "hf-folder"


# ---- 4. no transformers progress bars in decodekit's output ------------------------------------------------------
_BAR = re.compile(r"Loading weights|de-quantizing|it/s\]|\d+%\|")


@pytest.fixture
def bars_on():
    """transformers' progress bars on (their default), whatever an earlier test did; restored afterwards."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    yield
    (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def test_loading_a_model_from_python_draws_transformers_bar(tiny_dir, bars_on, capsys):
    from decodekit import LLM

    LLM(str(tiny_dir), dtype="float32", device="cpu", kv_cache_memory="16MiB")
    assert "Loading weights" in capsys.readouterr().err  # what the commands below must not print


@pytest.mark.parametrize("command", [
    ["run", QUICKSTART, "-p", "hi"],
    ["run", QUICKSTART, "-p", "hi", "--json"],
    ["generate", "-p", "hi", "--max-tokens", "3", "--dtype", "float32", "--device", "cpu"],
])
def test_decodekit_commands_that_load_a_model_print_no_loading_bar(command, tiny_dir, bars_on):
    extra = _tiny(tiny_dir) if command[0] == "run" else ["--model", str(tiny_dir)]
    result = _invoke(*command, *extra)
    assert result.exit_code == 0, result.output
    assert not _BAR.search(result.output), result.output


def test_the_gguf_conversion_bar_follows_transformers_switch(bars_on, capsys):
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from decodekit.models.loader import _gguf_bar_follows_transformers

    original = gguf_utils.tqdm

    def convert() -> str:
        with _gguf_bar_follows_transformers():
            list(gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."))
        return capsys.readouterr().err

    assert "de-quantizing" in convert()  # on by default, as transformers draws it
    hf_logging.disable_progress_bar()  # what the commands do
    assert convert() == ""
    assert gguf_utils.tqdm is original  # put back afterwards


@pytest.mark.slow
def test_converting_the_bundled_gguf_through_the_cli_prints_no_bar(tmp_path):
    env = {**os.environ, "DECODEKIT_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "decodekit", "generate", "-p", "hi", "--max-tokens", "2", "-q"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert not _BAR.search(done.stderr + done.stdout), done.stderr


# ---- 5. start-up ------------------------------------------------------------------------------------------------
def _imports_after(code: str, env: dict[str, str] | None = None) -> set[str]:
    """The top-level modules imported by running `code` in a fresh interpreter."""
    probe = f"{code}\nimport sys, json\nprint(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=env)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_decodekit_help_imports_neither_torch_nor_transformers():
    code = ("import sys\nsys.argv = ['decodekit', '--help']\nfrom decodekit.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass")
    env = {**os.environ, "DECODEKIT_PLUGINS": ""}  # no third-party plugin, whatever this machine has installed
    assert not {"torch", "transformers"} & _imports_after(code, env)


def test_decodekit_help_still_lists_an_installed_plugin_s_command(plugin_site):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_site), os.environ.get("PYTHONPATH", "")])}
    env.pop("DECODEKIT_PLUGINS", None)
    done = subprocess.run([sys.executable, "-m", "decodekit", "--help"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "example-hello" in done.stdout


def test_decodekit_own_plugins_add_no_commands(plugin_manager):
    # what lets `decodekit --help` skip loading them (decodekit.cli._third_party_plugins_installed)
    assert plugin_manager.hook.decodekit_register_commands.get_hookimpls() == []


def test_the_documented_imports_still_work():
    import decodekit
    import decodekit.api
    from decodekit import LLM, AsyncLLM, SamplingParams, hookimpl  # noqa: F401

    for module in (decodekit, decodekit.api):
        for name in module.__all__:
            assert getattr(module, name) is not None, (module.__name__, name)
        assert set(module.__all__) <= set(dir(module))
        with pytest.raises(AttributeError):
            module.no_such_name  # noqa: B018
    assert decodekit.LLM is importlib.import_module("decodekit.llm").LLM
