"""A third-party plugin package that uses every plugin kind (tests/fixtures/plugin_pkg), installed from its own
folder and found through its entry point: `decodekit plugins --json` lists what it registers, its command runs
from the `decodekit` command line, `decodekit recipe check` validates its components without a model, and one
`decodekit run` batch mixes requests served by its processor, stopping criterion, strategy, proposer and
constraint backend, on a model its loader builds, with beam search and speculative decoding requests.

Each request of the mixed batch is checked for what its component is for (the ban holds, the quota stops, the
proposer is lossless, the constraint holds, the strategy picks what its rule says on the model's own logits), and
against the same request run alone: mixing never changes a request's tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from decodekit import LLM, SamplingParams
from decodekit.cli import app
from decodekit.core.plan import Components
from decodekit.core.plugin_manager import get_plugin_manager
from decodekit.core.registry import Registry
from decodekit.models.tiny import tiny_model
from decodekit.recipe import load_recipe
from decodekit.recipe_runner import read_inputs

PROMPT = "The capital of France is"
CHOICES = ["Paris", "London", "Rome"]
MAX_TOKENS = 8
RECIPE = f"""\
# every request: greedy, 8 tokens, EOS ignored (so lengths are fixed); each line of requests.jsonl adds its part
model: tiny://0
dtype: float32
device: cpu
engine: {{kv_cache_memory: 16MiB}}
sampling: {{temperature: 0, max_tokens: {MAX_TOKENS}, ignore_eos: true}}
inputs: {{file: requests.jsonl}}
"""


def _invoke(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture
def installed(plugin_site, monkeypatch):
    """The package installed for this test: its folder on `sys.path`, every entry point allowed."""
    monkeypatch.syspath_prepend(str(plugin_site))
    monkeypatch.delenv("DECODEKIT_PLUGINS", raising=False)
    return plugin_site


def test_decodekit_plugins_lists_what_the_package_registers(installed):
    listed = json.loads(_invoke("plugins", "--json").stdout)["example"]
    assert listed["origin"] == "decodekit-example-plugin==0.1.0"
    names = {kind: [e["name"] for e in listed[kind]]
             for kind in ("processors", "stopping_criteria", "strategies", "proposers", "constraint_backends")}
    assert names == {"processors": ["ban_tokens"], "stopping_criteria": ["token_quota"],
                     "strategies": ["typical_greedy"], "proposers": ["fixed_phrase"],
                     "constraint_backends": ["token_choice"]}
    assert listed["strategies"][0]["params"]["properties"]["candidates"]["default"] == 4
    # model loaders and commands are not in `plugins --json` (yet): they are hooks of the same plugin
    pm = get_plugin_manager()
    for hook in ("decodekit_register_model_loaders", "decodekit_register_commands"):
        assert "example" in [impl.plugin_name for impl in getattr(pm.hook, hook).get_hookimpls()], hook
    # third-party loaders are tried before decodekit's own
    assert Registry.from_plugin_manager(pm).model_loaders[0].name == "example-tiny"


def test_decodekit_plugins_json_also_lists_the_model_loader_and_the_command(installed):
    listed = json.loads(_invoke("plugins", "--json").stdout)["example"]
    assert [e["name"] for e in listed["model_loaders"]] == ["example-tiny"]
    assert [e["name"] for e in listed["commands"]] == ["example-hello"]


def test_the_package_command_runs_from_the_decodekit_command_line(installed):
    # a new process: `decodekit`'s entry point adds plugin commands when it starts (decodekit.cli.main)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed), os.environ.get("PYTHONPATH", "")])}
    env.pop("DECODEKIT_PLUGINS", None)
    done = subprocess.run([sys.executable, "-m", "decodekit", "example-hello", "--name", "tester"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "hello, tester, from decodekit-example-plugin"


def test_recipe_check_validates_the_package_components_without_a_model(installed, tmp_path):
    (tmp_path / "requests.jsonl").write_text("")

    def check(extra: str) -> tuple[int, str]:
        (tmp_path / "r.yaml").write_text(RECIPE + extra)
        result = _invoke("recipe", "check", str(tmp_path / "r.yaml"))
        return result.exit_code, result.stderr

    ok = ("processors: [{ban_tokens: {token_ids: [5]}}, {choice: {choices: [a, b], backend: token_choice}}]\n"
          "stopping: [{token_quota: {tokens: 3}}]\n"
          "strategy: {speculative: {proposer: fixed_phrase, proposer_options: {phrase: hello}}}\n")
    assert check(ok) == (0, f"{tmp_path / 'r.yaml'}: ok\n")
    code, err = check("strategy: {typical_greedy: {candidates: 0}}\n")
    assert code == 2 and "strategy.typical_greedy.candidates: Input should be greater than or equal to 1" in err
    code, err = check("strategy: {speculative: {proposer: fixed_phrase, proposer_options: {phrase: a, token_ids: "
                      "[1]}}}\n")
    assert code == 2 and "strategy.speculative.proposer_options: give exactly one of `phrase` and `token_ids`" in err
    # a check that needs the engine's vocabulary does not run here (the engine refuses it: see the mixed run below)
    assert check("strategy: {speculative: {proposer: fixed_phrase, proposer_options: {token_ids: [999]}}}\n")[0] == 0
    # the backend's own check (a classmethod: no tokenizer yet) refuses a kind it cannot compile
    code, err = check("processors: [{regex: {pattern: '[0-9]+', backend: token_choice}}]\n")
    assert code == 2 and "the token_choice backend compiles only `choice` constraints, not 'regex'" in err


def _typical_reference(prompt_ids: list[int], candidates: int) -> list[int]:
    """`typical_greedy`'s rule, written out on transformers' own forward of the same tiny model (seed 0)."""
    model, ids, out = tiny_model("llama", seed=0), list(prompt_ids), []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), dim=-1)
            entropy = -(logp.exp() * logp).sum().item()
            top = logp.topk(candidates)
            distances = [abs(-v - entropy) for v in top.values.tolist()]
            token = top.indices[distances.index(min(distances))].item()
            out.append(token)
            ids.append(token)
    return out


def test_one_run_mixes_every_package_component_with_beam_search_and_speculative_decoding(installed, tmp_path):
    llm = LLM("tiny://0", dtype="float32", device="cpu", kv_cache_memory="16MiB")  # the package's model loader
    greedy_params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reference = llm.generate(PROMPT, greedy_params)[0]
    greedy = reference.token_ids
    constrained = {"choice": {"choices": CHOICES, "backend": "token_choice"}}
    chosen = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                 processors=[constrained]))[0].text
    typical = _typical_reference(reference.prompt_token_ids, 4)
    past_vocab = SamplingParams(strategy={"speculative": {"proposer": "fixed_phrase",
                                                          "proposer_options": {"token_ids": [999]}}})
    assert llm.generate(PROMPT, past_vocab)[0].error == (
        "strategy.speculative.proposer_options: token_ids must be below the vocabulary size 384, got 999")

    def speculative(proposer: str, **options: object) -> dict:
        return {"speculative": {"proposer": proposer, "proposer_options": options, "num_speculative_tokens": 3}}

    lines = {
        "greedy": {},
        "banned": {"processors": [{"ban_tokens": {"token_ids": greedy[:2]}}]},
        "quota": {"stopping": [{"token_quota": {"tokens": 3}}]},
        "typical_1": {"strategy": {"typical_greedy": {"candidates": 1}}},
        "typical_4": {"strategy": {"typical_greedy": {"candidates": 4}}},
        "typical_4_banned": {"strategy": {"typical_greedy": {"candidates": 4}},
                             "processors": [{"ban_tokens": {"token_ids": typical[:1]}}]},
        "phrase_hit": {"strategy": speculative("fixed_phrase", token_ids=greedy)},
        "phrase_text": {"strategy": speculative("fixed_phrase", phrase="Hello world! The quick brown fox")},
        "ngram": {"strategy": speculative("ngram")},
        "beam": {"strategy": {"beam_search": {"num_beams": 3, "num_return_sequences": 2}},
                 "sampling": {"ignore_eos": False}},  # beam search finishes its own hypotheses at EOS
        "choice": {"processors": [constrained], "sampling": {"ignore_eos": False}},
        "choice_drafted": {"processors": [constrained], "sampling": {"ignore_eos": False},
                           "strategy": speculative("fixed_phrase", phrase=chosen)},
    }
    (tmp_path / "requests.jsonl").write_text(
        "".join(json.dumps({"id": key, "prompt": PROMPT, **line}) + "\n" for key, line in lines.items()))
    (tmp_path / "r.yaml").write_text(RECIPE)
    out = tmp_path / "out.jsonl"

    result = _invoke("run", str(tmp_path / "r.yaml"), "--output", str(out), "--quiet")
    assert result.exit_code == 0, result.stderr
    rows = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert list(rows) == list(lines) and not [r["error"] for r in rows.values() if "error" in r]

    assert rows["greedy"]["token_ids"] == greedy  # the CLI's model, from the loader too, decodes the same
    # the processor: the banned tokens never come, so the output differs from greedy
    assert not set(greedy[:2]) & set(rows["banned"]["token_ids"]) and rows["banned"]["token_ids"] != greedy
    # the stopping criterion: 3 tokens, finish reason and stop reason its own
    quota = rows["quota"]
    assert (quota["token_ids"], quota["finish_reason"], quota["stop_reason"]) == (greedy[:3], "stop", "token_quota")
    # the strategy: one candidate is greedy; four follow its rule on the model's logits; it sees processed scores
    assert rows["typical_1"]["token_ids"] == greedy
    assert rows["typical_4"]["token_ids"] == typical != greedy
    assert rows["typical_4_banned"]["token_ids"][0] != typical[0]
    # the proposer: lossless (greedy output exactly), every draft of the right phrase accepted, the wrong one drafted
    for key in ("phrase_hit", "phrase_text", "ngram"):
        assert rows[key]["token_ids"] == greedy, key
    hit = rows["phrase_hit"]["metrics"]
    assert hit["draft_tokens"] > 0 and hit["accepted_tokens"] == hit["draft_tokens"]
    assert rows["phrase_text"]["metrics"]["draft_tokens"] > 0
    # beam search in the same batch: two hypotheses, best first
    beams = rows["beam"]["choices"]
    assert len(beams) == 2 and beams[0]["score"] >= beams[1]["score"]
    # the constraint backend: exactly one choice, then EOS; drafts under the constraint change nothing
    choice = rows["choice"]
    assert choice["text"] == chosen and chosen in CHOICES and choice["finish_reason"] == "stop"
    assert choice["token_ids"] == [*llm.tokenizer.encode(chosen, add_special_tokens=False), 2]
    drafted = rows["choice_drafted"]
    assert drafted["token_ids"] == choice["token_ids"] and drafted["metrics"]["accepted_tokens"] > 0

    # mixing changes nothing: each request alone gives the tokens it got in the mixed batch
    recipe = load_recipe(tmp_path / "r.yaml")
    requests, bad = read_inputs(recipe, Components(Registry.from_plugin_manager(get_plugin_manager())))
    assert not bad
    for request in requests:
        alone = llm.generate(request.prompt, request.params)[0]
        assert [o.token_ids for o in alone.outputs] == [c["token_ids"] for c in rows[request.id].get(
            "choices", [rows[request.id]])], request.id
