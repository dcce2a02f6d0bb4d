"""transformers' spellings in `SamplingParams` (docs/migration.md): `max_new_tokens`, `min_new_tokens`,
`num_return_sequences`, `eos_token_id`, `stop_strings` and `do_sample` are read as decodekit's fields, an alias
beside its field is an error naming both, recipes and prompts files take them (and their typos get a suggestion),
the JSON schema accepts them, and a request written either way decodes to the same tokens."""

from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from decodekit import SamplingParams
from decodekit.api.errors import RecipeError
from decodekit.api.params import SAMPLING_ALIASES
from decodekit.cli import app
from decodekit.core.plan import Components
from decodekit.core.plugin_manager import get_plugin_manager
from decodekit.core.registry import Registry
from decodekit.recipe import Recipe, recipe_from_data
from decodekit.testing import tiny_llm


@pytest.mark.parametrize(("given", "expected"), [
    ({"max_new_tokens": 5}, {"max_tokens": 5}),
    ({"min_new_tokens": 2}, {"min_tokens": 2}),
    ({"num_return_sequences": 3}, {"n": 3}),
    ({"eos_token_id": 7}, {"stop_token_ids": [7]}),
    ({"eos_token_id": [7, 9]}, {"stop_token_ids": [7, 9]}),
    ({"stop_strings": "\n"}, {"stop": ["\n"]}),
    ({"stop_strings": ["a", "b"]}, {"stop": ["a", "b"]}),
    ({"do_sample": False}, {"temperature": 0.0}),
    ({"do_sample": False, "temperature": 0}, {"temperature": 0.0}),
    ({"do_sample": True}, {"temperature": 1.0}),
    ({"do_sample": True, "temperature": 0.7}, {"temperature": 0.7}),
])
def test_each_alias_sets_its_field(given, expected):
    params = SamplingParams(**given)
    assert params.model_dump(include=set(expected)) == expected
    dumped = params.model_dump()
    assert not set(SAMPLING_ALIASES) & set(dumped)  # a validated request has one name per setting
    assert not set(SAMPLING_ALIASES) & params.model_fields_set


@pytest.mark.parametrize(("alias", "target"), [(a, t) for a, t in SAMPLING_ALIASES.items() if a != "do_sample"])
def test_an_alias_beside_its_field_is_an_error_naming_both(alias, target):
    value = {"stop_strings": ["x"], "eos_token_id": 3}.get(alias, 2)
    with pytest.raises(ValidationError) as info:
        SamplingParams(**{alias: value, target: SamplingParams.model_fields[target].default or value})
    assert f"`{alias}` is transformers' name for `{target}`: give one of them, not both" in str(info.value)


@pytest.mark.parametrize(("given", "message"), [
    ({"do_sample": False, "temperature": 0.7}, "`do_sample=False` asks for greedy decoding but `temperature=0.7`"),
    ({"do_sample": True, "temperature": 0}, "`do_sample=True` asks for sampling but `temperature=0`"),
    ({"do_sample": "yes"}, "`do_sample` must be true or false, got 'yes'"),
    ({"eos_token_id": "</s>"}, "`eos_token_id` must be a token id or a list of token ids, got '</s>'"),
    ({"eos_token_id": [1, True]}, "`eos_token_id` must be a token id or a list of token ids"),
    ({"max_new_tokens": 0}, "max_tokens\n  Input should be greater than or equal to 1"),
])
def test_contradictions_and_bad_values_are_refused(given, message):
    with pytest.raises(ValidationError) as info:
        SamplingParams(**given)
    assert message in str(info.value)


def test_the_json_schema_accepts_the_aliases_but_not_beside_their_field():
    schema = SamplingParams.model_json_schema()
    jsonschema.validate({"max_new_tokens": 8, "do_sample": False, "eos_token_id": [2, 5], "stop_strings": "\n",
                         "num_return_sequences": 2, "min_new_tokens": 1}, schema)
    jsonschema.validate({"eos_token_id": 2}, schema)
    for bad in ({"max_new_tokens": 8, "max_tokens": 8}, {"max_new_token": 8}, {"max_new_tokens": 0},
                {"do_sample": "no"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    recipe_schema = Recipe.model_json_schema()
    jsonschema.validate({"model": "m", "sampling": {"max_new_tokens": 8, "do_sample": False}}, recipe_schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"model": "m", "sampling": {"max_new_tokens": 8, "max_tokens": 8}}, recipe_schema)


def test_a_recipe_takes_the_aliases_and_suggests_them_for_typos(tmp_path):
    recipe = recipe_from_data({"model": "m", "sampling": {"max_new_tokens": 8, "do_sample": False,
                                                          "eos_token_id": 5}})
    assert recipe.default_params().model_dump(include={"max_tokens", "temperature", "stop_token_ids"}) == {
        "max_tokens": 8, "temperature": 0.0, "stop_token_ids": [5]}
    (tmp_path / "r.yaml").write_text("model: smollm2-135m-instruct\n"  # recipe check looks the model up
                                     "sampling: {max_new_tokens: 8, num_return_sequences: 2}\n")
    result = CliRunner().invoke(app, ["recipe", "check", str(tmp_path / "r.yaml")])
    assert result.exit_code == 0, result.stderr
    assert "max_tokens: 8" in result.stdout and "n: 2" in result.stdout  # resolved to decodekit's names

    def error(sampling: dict) -> str:
        with pytest.raises(RecipeError) as info:
            recipe_from_data({"model": "m", "sampling": sampling})
        return str(info.value)

    assert "sampling.num_return_sequnces: unknown key 'num_return_sequnces' (did you mean 'num_return_sequences'?)" \
        in error({"num_return_sequnces": 2})
    assert "(did you mean 'temperature'?)" in error({"temprature": 0.5})  # the fields' typos are still found
    assert "(did you mean 'max_tokens'?)" in error({"max_token": 5})
    assert error({"max_new_tokens": 4, "max_tokens": 8}) == (
        "<recipe>: sampling: `max_new_tokens` is transformers' name for `max_tokens`: give one of them, not both "
        "(got max_new_tokens=4 and max_tokens=8)")


def test_a_request_override_in_transformers_spelling_replaces_the_recipe_value():
    recipe = recipe_from_data({"model": "m", "sampling": {"max_tokens": 8, "temperature": 0.7}})
    merged = recipe.params_for({"max_new_tokens": 3, "do_sample": False})
    assert (merged.max_tokens, merged.temperature) == (3, 0.0)
    assert recipe.params_for({"do_sample": True}).temperature == 0.7  # do_sample=True keeps the temperature
    greedy = recipe_from_data({"model": "m", "sampling": {"temperature": 0}})
    with pytest.raises(RecipeError, match="`do_sample=True` asks for sampling but `temperature=0`"):
        greedy.params_for({"do_sample": True})
    with pytest.raises(RecipeError, match="give one of them, not both"):
        recipe.params_for({"max_new_tokens": 3, "max_tokens": 4})


def test_the_same_request_through_an_alias_decodes_to_the_same_tokens():
    llm = tiny_llm()
    prompts = [[5, 6, 7], [40, 41, 42, 43]]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    stop_id = greedy[0].token_ids[3]  # a token greedy decoding reaches: the stop id ends the request there
    stop_text = llm.tokenizer.decode(greedy[1].token_ids[2:4])  # text greedy decoding writes: a stop string
    pairs = [
        (SamplingParams(do_sample=False, max_new_tokens=8, eos_token_id=stop_id),
         SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id])),
        (SamplingParams(do_sample=True, temperature=0.8, seed=3, num_return_sequences=3, max_new_tokens=6,
                        min_new_tokens=6),
         SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=6, min_tokens=6)),
        (SamplingParams(do_sample=False, max_new_tokens=8, stop_strings=stop_text),
         SamplingParams(temperature=0, max_tokens=8, stop=[stop_text])),
    ]
    for alias_params, own_params in pairs:
        assert alias_params == own_params
        both = llm.generate(prompts * 2, [alias_params] * 2 + [own_params] * 2)  # in one batch, side by side
        by_alias = [[(o.token_ids, o.finish_reason, o.stop_reason) for o in out.outputs] for out in both[:2]]
        by_name = [[(o.token_ids, o.finish_reason, o.stop_reason) for o in out.outputs] for out in both[2:]]
        assert by_alias == by_name
        finished_by = {o.outputs[0].stop_reason for o in both}
        assert finished_by & {stop_id, stop_text} or alias_params.n == 3  # the stop pairs do stop on their stop
    stopped = llm.generate(prompts[0], pairs[0][0])[0]  # `eos_token_id` stops where greedy first reaches that id
    cut = greedy[0].token_ids.index(stop_id) + 1
    assert stopped.token_ids == greedy[0].token_ids[:cut] and stopped.outputs[0].stop_reason == stop_id


# ---- docs/migration.md --------------------------------------------------------------------------------------------
MIGRATION = Path(__file__).resolve().parents[2] / "docs" / "migration.md"


def test_the_migration_page_examples_run_and_plan():
    """Each Python block runs; every `SamplingParams` it builds plans against the registry (the processor names and
    parameters it shows exist); each YAML block is a valid recipe fragment."""
    text = MIGRATION.read_text()
    components = Components(Registry.from_plugin_manager(get_plugin_manager(load_entry_points=False)))
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert blocks
    for code in blocks:
        namespace: dict = {}
        exec(compile(code, str(MIGRATION), "exec"), namespace)
        for value in namespace.values():
            if isinstance(value, SamplingParams):
                components.resolve(value)
    for fragment in re.findall(r"^```yaml\n(.*?)^```", text, re.S | re.M):
        recipe_from_data({"model": "m", **yaml.safe_load(fragment)})


def test_every_plugin_the_migration_page_names_is_registered():
    registry = Registry.from_plugin_manager(get_plugin_manager(load_entry_points=False))
    text = MIGRATION.read_text()
    kinds = {"processor": registry.processors, "strategy": registry.strategies,
             "stopping criterion": registry.stopping_criteria}
    named = [(kind, name) for kind, name in re.findall(r"(processor|strategy|stopping criterion) `(\w+)", text)]
    assert len(named) > 20
    assert [(kind, name) for kind, name in named if name not in kinds[kind]] == []
    for alias, target in SAMPLING_ALIASES.items():  # the aliases table lists every alias
        assert f"| `{alias}` | `{target}` |" in text, alias
