"""`decodekit compare` on tiny models: bad input refused before anything runs (exit 2, the option named); a run of
recipes with a sweep and a recipe that fails (reported, the others go on, exit 1); the same command twice gives the
same quality figures; KL and perplexity equal a direct computation with transformers; the HTML report as a real
headless browser draws it (and a screenshot of it)."""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from decodekit.cli import app
from decodekit.compare.plan import plan_compare
from decodekit.compare.run import Engines, run_point
from decodekit.core.plugin_manager import get_plugin_manager
from decodekit.core.registry import Registry
from decodekit_plugins.metrics import bleu
from tests.helpers.batch_cases import write_tiny_recipe
from tests.helpers.browser import chromium

pytest.importorskip("matplotlib", reason="the HTML report needs matplotlib (pip install 'decodekit[eval]')")

PROMPTS = ["the cat sat on", "one two three", "hello there, friend"]
MIN_P = "processors: [{min_p: {min_p: 0.1}}]\n"


def _variant(folder: Path, name: str, sampling: str, extra: str = "") -> Path:
    base = [line for line in (folder / "tiny.yaml").read_text().splitlines() if not line.startswith("sampling")]
    path = folder / f"{name}.yaml"
    path.write_text("\n".join(base) + f"\nsampling: {sampling}\n{extra}")
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """Tiny recipes: greedy, sampled with min-p, best-of-3, and one whose model does not exist; three prompts."""
    root = tmp_path_factory.mktemp("compare")
    write_tiny_recipe(root, max_tokens=8)
    (root / "greedy.yaml").write_text((root / "tiny.yaml").read_text())
    _variant(root, "minp", "{temperature: 0.9, max_tokens: 8}", MIN_P)
    _variant(root, "bestof", "{temperature: 0.9, max_tokens: 8}", "strategy: {best_of: {best_of: 3}}\n")
    (root / "broken.yaml").write_text("model: /nonexistent/model\ndtype: float32\ndevice: cpu\n"
                                      "sampling: {temperature: 0.7, max_tokens: 8}\n")
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return root


def _compare(*args: str):
    return CliRunner().invoke(app, ["compare", *args])


# ---- bad input: a clear error, before anything runs ----------------------------------------------------------------

BAD = [
    (["--sweep", "sampling.temprature=0.5,1"], "--sweep sampling.temprature=0.5,1: not a key or value of recipe"),
    (["--sweep", "processors.0.min_p.min_p=0.1,0.2"], "--sweep processors.0.min_p.min_p=0.1,0.2: not a key of recipe"),
    (["--sweep", "nosuch:sampling.temperature=0.5"], "no recipe 'nosuch' in this run"),
    (["--sweep", "sampling.temperature"], "expected key=v1,v2"),
    (["--metric", "nope"], "--metric: unknown metric 'nope'"),
    (["--samples", "0"], "--samples must be at least 1"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[b[1][:30] for b in BAD])
def test_bad_input_is_refused_before_anything_runs(folder, tmp_path, args, message):
    out = tmp_path / "out.json"
    # the broken recipe's model does not exist: had anything run, it would be a failed point (exit 1), not exit 2
    result = _compare(str(folder / "greedy.yaml"), str(folder / "broken.yaml"), "--prompts",
                      str(folder / "prompts.txt"), "--output", str(out), *args)
    assert result.exit_code == 2, result.output
    assert message in result.output.replace("\n", " ")
    assert not out.exists()


def test_a_metric_that_needs_logprobs_on_a_strategy_that_cannot_give_them_is_refused(folder, tmp_path):
    result = _compare(str(folder / "minp.yaml"), str(folder / "bestof.yaml"), "--prompts",
                      str(folder / "prompts.txt"), "--metric", "length", "--metric", "kl")
    assert result.exit_code == 2
    text = result.output.replace("\n", " ")
    assert "--metric kl needs the logprobs of each chosen token" in text and "strategy 'best_of'" in text


def test_an_unknown_task_and_missing_inputs_are_refused(folder):
    result = _compare(str(folder / "broken.yaml"), "--tasks", "no_such_task", "--include-path", str(folder))
    assert result.exit_code == 2 and "--tasks: unknown task 'no_such_task'" in result.output
    result = _compare(str(folder / "broken.yaml"))
    assert result.exit_code == 2 and "give the inputs: --prompts FILE" in result.output


# ---- a run --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(folder, tmp_path_factory) -> list[tuple[object, dict, Path]]:
    """The same comparison twice: greedy, min-p swept over two values, best-of-3, and the broken recipe."""
    done = []
    for i in range(2):
        out = tmp_path_factory.mktemp(f"run{i}")
        result = _compare(str(folder / "greedy.yaml"), str(folder / "minp.yaml"), str(folder / "bestof.yaml"),
                          str(folder / "broken.yaml"), "--prompts", str(folder / "prompts.txt"), "--samples", "2",
                          "--sweep", "minp:processors.0.min_p.min_p=0.05,0.3", "--seed", "7", "--output",
                          str(out / "compare.json"), "--html", str(out / "compare.html"))
        done.append((result, json.loads((out / "compare.json").read_text()), out / "compare.html"))
    return done


def test_a_failing_recipe_is_reported_and_the_others_run(runs):
    result, document, _ = runs[0]
    assert result.exit_code == 1, result.output
    status = {p["label"]: p["status"] for p in document["points"]}
    assert status == {"greedy": "ok", "minp[min_p=0.05]": "ok", "minp[min_p=0.3]": "ok", "bestof": "ok",
                      "broken": "failed"}
    broken = next(p for p in document["points"] if p["label"] == "broken")
    assert "/nonexistent/model" in broken["error"]
    assert "broken" in result.output and "failed:" in result.output
    for point in document["points"][:4]:
        assert point["speed"]["tokens_per_s"] > 0 and point["speed"]["kv_blocks_peak"] > 0
        assert len(point["samples"]) == len(PROMPTS) and all(len(s["texts"]) == 2 for s in point["samples"])


def test_every_point_draws_the_same_seeds_and_the_metrics_say_what_they_saw(runs):
    _, document, _ = runs[0]
    points = {p["label"]: p for p in document["points"]}
    greedy = points["greedy"]["quality"]
    for sample in points["greedy"]["samples"]:  # greedy: a prompt's samples are the same text
        assert len(set(sample["texts"])) == 1
    # so each prompt's self-BLEU is its text's BLEU against itself (1, or less for texts shorter than 4 words)
    assert greedy["self_bleu"]["values"] == pytest.approx([bleu(s["texts"][0].split(), [s["texts"][0].split()])
                                                          for s in points["greedy"]["samples"]])
    sampled = [s["texts"] for s in points["minp[min_p=0.05]"]["samples"]]
    assert any(len(set(texts)) > 1 for texts in sampled)  # sampled ones differ
    # a deterministic strategy's KL at its chosen tokens is their mean negative log-likelihood under the model
    nll = [math.log(v) for v in greedy["perplexity"]["values"]]
    assert greedy["kl"]["values"] == pytest.approx(nll, abs=1e-4)
    assert "cannot say what distribution" in points["bestof"]["quality"]["kl"]["missing"]
    assert points["minp[min_p=0.05]"]["sweep"] == {"processors.0.min_p.min_p": 0.05}
    assert set(document["pareto"]) == {"distinct_1", "distinct_2", "self_bleu", "repetition", "perplexity", "kl"}
    for view in document["pareto"].values():
        assert set(view["all"]) <= set(points) - {"broken"} and view["all"]


def test_the_same_command_twice_gives_the_same_quality_figures(runs):
    (_, first, _), (_, second, _) = runs

    def quality(document):
        return {p["label"]: (p["quality"], p["samples"]) for p in document["points"]}

    assert quality(first) == quality(second)


def test_kl_and_perplexity_equal_a_direct_computation_with_transformers(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pm = get_plugin_manager(load_entry_points=False)
    registry = Registry.from_plugin_manager(pm)
    plan = plan_compare([folder / "minp.yaml"], registry, metric_names=["kl", "perplexity"],
                        prompts_file=folder / "prompts.txt", samples=2, seed=3)
    result = run_point(plan, plan.points[0], Engines(pm))
    assert result.ok, result.error
    model = AutoModelForCausalLM.from_pretrained(folder / "tiny", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder / "tiny")
    kls, perplexities = [], []
    for sample in result.samples:
        prompt_ids = tokenizer.encode(sample["prompt"])  # a plain prompt, with the tokenizer's special tokens
        for ids in sample["token_ids"]:
            with torch.no_grad():
                logits = model(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1:-1]
            raw = torch.log_softmax(logits, dim=-1)
            # the recipe's processors in order: min-p on the model's distribution, then the temperature
            kept = raw.exp() >= 0.1 * raw.exp().max(dim=-1, keepdim=True).values
            processed = torch.log_softmax(torch.where(kept, logits, -math.inf) / 0.9, dim=-1)
            chosen = torch.tensor(ids)[:, None]
            log_q, log_p = processed.gather(1, chosen)[:, 0], raw.gather(1, chosen)[:, 0]
            kls.append(float((log_q - log_p).mean()))
            perplexities.append(math.exp(-float(log_p.mean())))
    assert len(kls) == len(PROMPTS) * 2
    assert result.quality["kl"].values == pytest.approx(kls, abs=1e-4)
    assert result.quality["kl"].value == pytest.approx(statistics.fmean(kls), abs=1e-4)
    assert result.quality["perplexity"].values == pytest.approx(perplexities, rel=1e-4)
    assert result.quality["perplexity"].value == pytest.approx(statistics.median(perplexities), rel=1e-4)


# ---- the HTML report in a real browser -----------------------------------------------------------------------------


def test_the_html_report_is_self_contained_and_a_headless_browser_draws_it(runs, tmp_path):
    _, document, page = runs[0]
    text = page.read_text(encoding="utf-8")
    assert "<script" not in text and not re.search(r"""(src|href)=["']?(https?:)?//""", text)  # nothing to fetch
    dom = chromium("--dump-dom", page.resolve().as_uri(), profile=tmp_path / "profile")
    assert dom.returncode == 0 and "<body" in dom.stdout, dom.stderr[-2000:]
    tradeoffs = len(document["pareto"])  # one plot per quality figure with a better side, here all of them
    assert len(re.findall(r"<svg\b", dom.stdout)) == tradeoffs + 2  # and the lengths and the speed
    rows = re.findall(r'<td class="name">([^<]+)</td>', dom.stdout)
    assert rows == [p["label"] for p in document["points"]]
    assert "failed: " in dom.stdout and "/nonexistent/model" in dom.stdout
    shot = tmp_path / "compare.png"
    taken = chromium(f"--screenshot={shot}", "--window-size=1400,1800", page.resolve().as_uri(),
                      profile=tmp_path / "profile")
    assert taken.returncode == 0, taken.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
