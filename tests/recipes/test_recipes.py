"""Recipes: loading, every bad-input message, --set overrides, per-request merging, prompts files, the time
limit and plugin stopping criteria, and hypothesis fuzzing of recipe loading. No model is loaded except the tiny
one the stopping tests run on."""

from __future__ import annotations

import contextlib
import json
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, Field

from decodekit import LLM, StopDecision, StoppingCriterion, hookimpl
from decodekit.api.errors import RecipeError
from decodekit.api.strategy import Strategy
from decodekit.core.plan import Components
from decodekit.core.plugin_manager import get_plugin_manager
from decodekit.core.registry import Registry
from decodekit.models.tiny import tiny_model, tiny_tokenizer
from decodekit.recipe import Recipe, describe_recipe, load_recipe, recipe_from_data
from decodekit.recipe_runner import read_inputs
from decodekit.recipe_syntax import apply_override, parse_value, parse_yaml

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml"))
REGISTRY = Registry.from_plugin_manager(get_plugin_manager(load_entry_points=False))


def _load(tmp_path: Path, text: str, overrides: tuple[str, ...] = (), registry: Registry = REGISTRY) -> Recipe:
    path = tmp_path / "x.yaml"
    path.write_text(textwrap.dedent(text))
    return load_recipe(path, overrides, registry=registry)


def _error(tmp_path: Path, text: str, overrides: tuple[str, ...] = (), registry: Registry = REGISTRY) -> str:
    with pytest.raises(RecipeError) as info:
        _load(tmp_path, text, overrides, registry)
    return str(info.value)


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_shipped_recipe_validates_and_resolves_without_loading_a_model(path):
    recipe = load_recipe(path)  # with entry-point plugins, as `decodekit run` loads it
    described = describe_recipe(recipe, Registry.from_plugin_manager(get_plugin_manager()))
    strategy = described["plan"]["strategy"]
    assert (strategy if isinstance(strategy, str) else next(iter(strategy))) == (
        recipe.strategy.name if recipe.strategy else "sample")


# ---- bad input: each message names the file and the key --------------------------------------------------------
def test_yaml_syntax_error_names_the_line_and_column(tmp_path):
    message = _error(tmp_path, "model: m\nsampling:\n  temperature: 0.5\n   top_p: 1\n")
    assert message == (f"{tmp_path / 'x.yaml'}: YAML syntax error at line 4, column 9: "
                       "mapping values are not allowed here")


def test_duplicate_keys_are_refused_instead_of_silently_overwritten(tmp_path):
    assert "line 2, column 1: duplicate key 'model'" in _error(tmp_path, "model: a\nmodel: b\n")


def test_unknown_top_level_key_suggests_the_close_one_and_lists_the_known(tmp_path):
    message = _error(tmp_path, "model: m\nsamplng: {temperature: 0}\n")
    assert message.endswith("x.yaml: samplng: unknown key 'samplng' (did you mean 'sampling'?); known keys: "
                            "description, model, dtype, device, draft, engine, sampling, processors, stopping, "
                            "strategy, reasoning, inputs, outputs")


def test_unknown_nested_key_lists_that_section_s_keys(tmp_path):
    message = _error(tmp_path, "model: m\nengine: {max_num_seq: 4}\n")
    assert ("engine.max_num_seq: unknown key 'max_num_seq' (did you mean 'max_num_seqs'?); known keys: "
            "kv_cache_memory,") in message
    assert "sampling.temprature: unknown key 'temprature' (did you mean 'temperature'?)" in _error(
        tmp_path, "model: m\nsampling: {temprature: 0}\n")


def test_unknown_processor_name_lists_the_known_ones_with_a_suggestion(tmp_path):
    message = _error(tmp_path, "model: m\nprocessors:\n  - top_k: {top_k: 4}\n  - top_q: {top_q: 0.5}\n")
    assert message.startswith(
        f"{tmp_path / 'x.yaml'}: processors[1]: unknown processor 'top_q' (did you mean 'top_p'?)")
    assert "known: " in message and "temperature" in message and "top_k" in message


def test_unknown_stopping_criterion_and_strategy_list_the_known_ones(tmp_path):
    message = _error(tmp_path, "model: m\nstopping: [time_limt]\n")
    assert "stopping[0]: unknown" in message and "(did you mean 'time_limit'?)" in message
    assert "known: eos, " in message and "time_limit" in message
    message = _error(tmp_path, "model: m\nstrategy: sampel\n")
    assert "strategy: unknown" in message and "'sampel'" in message and "(did you mean 'sample'?)" in message


def test_wrong_parameter_range_names_the_key_path_and_the_value(tmp_path):
    message = _error(tmp_path, "model: m\nprocessors:\n  - temperature: {temperature: 0.5}\n  - top_p: {top_p: -1}\n")
    assert message == f"{tmp_path / 'x.yaml'}: processors[1].top_p.top_p: Input should be greater than 0, got -1"


@pytest.mark.parametrize(("section", "message"), [
    ("processors:\n  - repetition_penalty: {penalty: 1.1, penalti: 2}\n",
     "processors[0].repetition_penalty.penalti: unknown key 'penalti' (did you mean 'penalty'?); known keys: penalty"),
    ("stopping: [max_tokens, {time_limit: {secnds: 2}}]\n",  # not also "seconds: Field required": the same typo
     "stopping[1].time_limit.secnds: unknown key 'secnds' (did you mean 'seconds'?); known keys: seconds"),
    ("strategy: {beam_search: {num_beam: 2}}\n",
     "strategy.beam_search.num_beam: unknown key 'num_beam' (did you mean 'num_beams'?); known keys: num_beams, "
     "length_penalty, early_stopping, num_return_sequences"),
    ("strategy: {speculative: {proposer: ngram, proposer_options: {prompt_lookup_mx: 2}}}\n",
     "strategy.speculative.proposer_options.prompt_lookup_mx: unknown key 'prompt_lookup_mx' (did you mean "
     "'prompt_lookup_max'?); known keys: prompt_lookup_min, prompt_lookup_max"),
], ids=["processor", "stopping_criterion", "strategy", "proposer"])
def test_a_typo_in_a_plugin_parameter_names_its_recipe_key_path_and_the_key_meant(tmp_path, section, message):
    assert _error(tmp_path, "model: m\n" + section) == f"{tmp_path / 'x.yaml'}: {message}"


def test_a_required_plugin_parameter_is_still_reported_missing_when_no_unknown_key_looks_like_it(tmp_path):
    assert _error(tmp_path, "model: m\nstopping: [{time_limit: {wait: 2}}]\n") == (
        f"{tmp_path / 'x.yaml'}: stopping[0].time_limit.seconds: Field required; "
        "stopping[0].time_limit.wait: unknown key 'wait'; known keys: seconds")


def test_an_unknown_plugin_parameter_suggests_a_field_by_the_name_the_recipe_uses_not_its_python_name(tmp_path):
    # json_schema's parameter is `schema` in a recipe (the Python field is `schema_`, aliased)
    message = _error(tmp_path, "model: m\nprocessors: [{json_schema: {schma: {type: object}}}]\n")
    assert "processors[0].json_schema.schma: unknown key 'schma' (did you mean 'schema'?); known keys: " in message
    assert ", schema," in message and "schema_" not in message


def test_wrong_parameter_types_name_the_key_path(tmp_path):
    assert _error(tmp_path, "model: m\nsampling: {max_tokens: many}\n").endswith(
        "sampling.max_tokens: Input should be a valid integer, unable to parse string as an integer, got 'many'")
    assert _error(tmp_path, "model: m\nprocessors: [{top_k: 5}]\n").endswith(
        "processors[0]: parameters of 'top_k' must be a mapping, got int")
    assert _error(tmp_path, "model: m\nstopping: [{time_limit: {seconds: 0}}]\n").endswith(
        "stopping[0].time_limit.seconds: Input should be greater than 0, got 0")
    assert "dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16', got 'fp8'" in _error(
        tmp_path, "model: m\ndtype: fp8\n")
    assert "engine.kv_cache_memory: expected a size like 1GiB or 512MB, got 'lots'" in _error(
        tmp_path, "model: m\nengine: {kv_cache_memory: lots}\n")


def test_a_recipe_must_be_a_mapping_and_name_a_model(tmp_path):
    assert _error(tmp_path, "").endswith("a recipe is a mapping of keys (model, sampling, processors, ...), "
                                         "got an empty file")
    assert _error(tmp_path, "- model: m\n").endswith("got list")
    assert _error(tmp_path, "dtype: auto\n").endswith("x.yaml: model: Field required")


def test_components_under_sampling_are_refused_with_where_they_belong(tmp_path):
    assert _error(tmp_path, "model: m\nsampling: {processors: [top_k]}\n").endswith(
        "sampling: set processors at the recipe's top level, not under sampling")


def test_a_system_prompt_without_chat_is_refused(tmp_path):
    assert _error(tmp_path, "model: m\ninputs: {system: Be brief.}\n").endswith(
        "inputs.system: a system prompt needs chat: true (it goes into the chat template), got 'Be brief.'")


def test_a_missing_inputs_file_is_refused_at_load(tmp_path):
    assert "inputs.file: no such file" in _error(tmp_path, "model: m\ninputs: {file: nowhere.jsonl}\n")


class _Picky(Strategy):
    """A strategy that cannot run after a top-k cut (it needs the whole distribution)."""

    name = "picky"

    def check_compatible(self, options, params, stages):
        for stage in stages:
            if stage.processor.name == "top_k":
                raise ValueError("cannot run with processor 'top_k': picky needs the whole distribution")


class _PickyPlugin:
    @hookimpl
    def decodekit_register_strategies(self, register):
        register("picky", _Picky)


def test_an_incompatible_combination_is_refused_at_load_saying_which_and_why(tmp_path):
    pm = get_plugin_manager(load_entry_points=False)
    pm.register(_PickyPlugin(), name="picky-plugin")
    registry = Registry.from_plugin_manager(pm)
    assert _load(tmp_path, "model: m\nstrategy: picky\nprocessors: [{top_p: {top_p: 0.5}}]\n", registry=registry)
    message = _error(tmp_path, "model: m\nstrategy: picky\nprocessors: [{top_k: {top_k: 5}}]\n", registry=registry)
    assert message.endswith("x.yaml: strategy.picky: cannot run with processor 'top_k': picky needs the whole "
                            "distribution")
    # the same processor implied by a sampling field is refused too
    assert "strategy.picky: cannot run" in _error(tmp_path, "model: m\nstrategy: picky\nsampling: {top_k: 5}\n",
                                                  registry=registry)


# ---- --set overrides -------------------------------------------------------------------------------------------
BASE = ("model: m\nsampling: {temperature: 0.7}\nprocessors:\n  - top_p: {top_p: 0.9}\n  - top_k: {top_k: 40}\n"
        "strategy: sample\n")


def test_set_overrides_reach_nested_keys_list_items_and_name_only_components(tmp_path):
    recipe = _load(tmp_path, BASE.replace("{top_k: 40}", ""),
                   ("sampling.temperature=0", "processors.0.top_p.top_p=0.5", "processors.1.top_k.top_k=3",
                    "engine.max_num_seqs=4", "sampling.stop=[a, b]", "inputs.chat=true",
                    "inputs.system=Answer: briefly", "processors.2={min_p: {min_p: 0.1}}"))
    assert recipe.sampling.temperature == 0 and recipe.sampling.stop == ["a", "b"]
    assert [(s.name, s.params) for s in recipe.processors] == [("top_p", {"top_p": 0.5}), ("top_k", {"top_k": 3}),
                                                               ("min_p", {"min_p": 0.1})]
    assert recipe.engine_options() == {"max_num_seqs": 4}
    assert recipe.inputs.system == "Answer: briefly"  # text with a colon stays text


def test_set_overrides_are_validated_like_the_file(tmp_path):
    assert _error(tmp_path, BASE, ("processors.0.top_p.top_p=2",)).endswith(
        "processors[0].top_p.top_p: Input should be less than or equal to 1, got 2")
    assert "--set 'sampling': expected key.path=value" in _error(tmp_path, BASE, ("sampling",))
    assert "--set processors.5.top_k.top_k: processors is a list of 2; give an index from 0 to 2" in _error(
        tmp_path, BASE, ("processors.5.top_k.top_k=1",))
    assert "--set model.name: model is 'm', not a mapping or a list" in _error(tmp_path, BASE, ("model.name=x",))


def test_set_values_parse_as_yaml_scalars_and_flow_collections():
    assert [parse_value(v) for v in ("0.5", "true", "3", "[a, b]", "{k: 1}", "", "a: b", "x")] == [
        0.5, True, 3, ["a", "b"], {"k": 1}, None, "a: b", "x"]
    data = {"model": "m"}
    assert apply_override(data, "processors.0.top_k.top_k=2") == {"model": "m", "processors": [{"top_k": {"top_k": 2}}]}
    assert data == {"model": "m"}  # the input is not modified


# ---- per-request overrides ---------------------------------------------------------------------------------------
def test_request_overrides_merge_over_the_recipe_defaults(tmp_path):
    recipe = _load(tmp_path, BASE + "stopping: [{time_limit: {seconds: 5}}]\n")
    params = recipe.params_for({"max_tokens": 7, "processors": [{"top_p": {"top_p": 0.3}}, {"min_p": {"min_p": 0.1}}],
                                "strategy": {"sample": {}}})
    assert params.max_tokens == 7 and params.temperature == 0.7  # overridden field, kept default
    assert [(s.name, s.params) for s in params.processors] == [("top_p", {"top_p": 0.3}), ("top_k", {"top_k": 40}),
                                                               ("min_p", {"min_p": 0.1})]
    assert [(s.name, s.params) for s in params.stopping] == [("time_limit", {"seconds": 5})]
    assert recipe.params_for({"stopping": [{"time_limit": {"seconds": 9}}]}).stopping[0].params == {"seconds": 9}
    assert recipe.params_for().processors == recipe.processors


def test_bad_request_overrides_name_the_key(tmp_path):
    recipe = _load(tmp_path, BASE)
    with pytest.raises(RecipeError, match=r"^temperature: Input should be greater than or equal to 0, got -1$"):
        recipe.params_for({"temperature": -1})
    with pytest.raises(RecipeError, match=r"^processors\[0\]: parameters of 'top_k' must be a mapping"):
        recipe.params_for({"processors": [{"top_k": 3}]})
    with pytest.raises(RecipeError, match=r"^colour: unknown key"):
        recipe.params_for({"colour": "blue"})


def test_a_prompts_file_with_bad_lines_keeps_the_good_ones_and_names_each_bad_line(tmp_path):
    lines = [
        {"prompt": "Hello", "id": "a"},
        "not json {",
        {"prompt": "x", "sampling": {"temperature": -1}},
        {"prompt": "x", "processors": [{"top_p": {"top_p": 2}}]},
        {"prompt": "y", "colour": 1},
        "just a prompt",
        {"prompt": "z", "sampling": {"max_tokens": 3}, "processors": [{"top_k": {"top_k": 5}}]},
        {"prompt": "w", "strategy": "beem"},
    ]
    (tmp_path / "p.jsonl").write_text("\n".join(line if isinstance(line, str) and "{" in line else json.dumps(line)
                                                for line in lines) + "\n\n")
    recipe = _load(tmp_path, BASE + "inputs: {file: p.jsonl, prompts: [first]}\n")
    requests, bad = read_inputs(recipe, Components(REGISTRY))
    # a line's default id is its position (after the recipe's one prompt), bad lines counted: ids do not shift
    assert [(r.id, r.prompt) for r in requests] == [("1", "first"), ("a", "Hello"), ("7", "just a prompt"),
                                                    ("8", "z")]
    assert requests[3].params.max_tokens == 3 and [s.name for s in requests[3].params.processors] == [
        "top_p", "top_k"]
    assert [b.where for b in bad] == [f"p.jsonl line {n}" for n in (2, 3, 4, 5, 8)]
    assert bad[0].message.startswith("not valid JSON: Expecting value")
    assert [b.id for b in bad] == ["3", "4", "5", "6", "9"]
    assert bad[1].message == "sampling.temperature: Input should be greater than or equal to 0, got -1"
    assert bad[2].message == "processors[0].top_p.top_p: Input should be less than or equal to 1, got 2"
    assert bad[3].message.startswith("colour: unknown key 'colour'; known keys: prompt, id, sampling")
    assert "unknown" in bad[4].message and "'beem'" in bad[4].message


def test_command_line_prompts_replace_the_recipe_inputs_and_txt_files_are_one_prompt_per_line(tmp_path):
    (tmp_path / "p.txt").write_text("one\n\ntwo {not json}\n")
    recipe = _load(tmp_path, BASE + "inputs: {prompts: [first]}\n")
    requests, bad = read_inputs(recipe, Components(REGISTRY), ["cli"], tmp_path / "p.txt")
    assert [r.prompt for r in requests] == ["cli", "one", "two {not json}"] and bad == []
    with pytest.raises(RecipeError, match=r"a prompts file is \.jsonl .* or \.txt"):
        read_inputs(recipe, Components(REGISTRY), [], tmp_path / "x.yaml")


# ---- stopping criteria on the tiny model -------------------------------------------------------------------------
class _EndsWithToken(StoppingCriterion):
    """Stop when the newest token is `token_id` (a custom criterion from an in-process plugin)."""

    name = "ends_with"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        token_id: int = Field(ge=0)

    def check(self, seq, params, eos_token_ids, options=None):
        return StopDecision("stop", f"token {options.token_id}") if seq.token_ids[-1] == options.token_id else None


class _EndsWithPlugin:
    @hookimpl
    def decodekit_register_stopping_criteria(self, register):
        register("ends_with", _EndsWithToken)


@pytest.fixture(scope="module")
def tiny_llm():
    pm = get_plugin_manager(load_entry_points=False)
    pm.register(_EndsWithPlugin(), name="ends-with-plugin")
    llm = LLM(tiny_model("llama"), tiny_tokenizer(), dtype="float32", device="cpu", plugin_manager=pm,
              kv_cache_memory="16MiB")
    return llm, Registry.from_plugin_manager(pm)


def test_time_limit_stops_only_the_request_that_names_it_with_length_and_time_limit(tiny_llm):
    llm, registry = tiny_llm
    recipe = recipe_from_data({"model": "tiny", "sampling": {"temperature": 0, "max_tokens": 12, "ignore_eos": True}},
                              registry=registry)
    limited = recipe.params_for({"stopping": [{"time_limit": {"seconds": 1e-9}}]})
    outs = llm.generate([[5, 6, 7], [5, 6, 7]], [limited, recipe.params_for()])
    assert (outs[0].finish_reason, outs[0].outputs[0].stop_reason, len(outs[0].token_ids)) == (
        "length", "time_limit", 1)
    assert (outs[1].finish_reason, outs[1].outputs[0].stop_reason, len(outs[1].token_ids)) == ("length", None, 12)
    generous = llm.generate([[5, 6, 7]], recipe.params_for({"stopping": [{"time_limit": {"seconds": 3600}}]}))[0]
    assert generous.token_ids == outs[1].token_ids


def test_a_custom_criterion_from_a_plugin_stops_its_request_where_the_recipe_says(tiny_llm):
    llm, registry = tiny_llm
    recipe = recipe_from_data({"model": "tiny", "sampling": {"temperature": 0, "max_tokens": 10, "ignore_eos": True}},
                              registry=registry)
    free = llm.generate([[9, 10, 11]], recipe.params_for())[0].token_ids
    target = free[4]
    cut = free.index(target) + 1
    stopped = llm.generate([[9, 10, 11]], recipe.params_for({"stopping": [{"ends_with": {"token_id": target}}]}))[0]
    assert stopped.token_ids == free[:cut] and stopped.finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == f"token {target}"
    with pytest.raises(RecipeError, match=r"stopping\[0\]\.ends_with\.token_id: Input should be greater than or equal"):
        recipe_from_data({"model": "tiny", "stopping": [{"ends_with": {"token_id": -1}}]}, registry=registry)


# ---- fuzzing -----------------------------------------------------------------------------------------------------
NAMES = ["model", "dtype", "device", "draft", "engine", "sampling", "processors", "stopping", "strategy", "inputs",
         "outputs", "description", "temperature", "top_p", "top_k", "min_p", "max_tokens", "seconds", "time_limit",
         "sample", "name", "params", "chat", "prompts", "file", "kv_cache_memory", "max_num_seqs", "stop", "seed"]
SCALARS = (st.none() | st.booleans() | st.integers(-3, 300) | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=6) | st.sampled_from([*NAMES, "auto", "float32", "1GiB", "fcfs", "m"]))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.sampled_from(NAMES) | st.text(max_size=4) | st.integers(0, 3), inner,
                                        max_size=3), max_leaves=12)
MAPPINGS = st.dictionaries(st.sampled_from(NAMES) | st.text(max_size=5) | st.integers(), VALUES, max_size=6)
NEAR_VALID = st.fixed_dictionaries({"model": st.just("m")}, optional={
    "sampling": st.dictionaries(st.sampled_from(["temperature", "top_p", "top_k", "max_tokens", "min_tokens", "stop",
                                                 "n", "seed"]), SCALARS | st.lists(SCALARS, max_size=2), max_size=4),
    "processors": st.lists(st.sampled_from(["top_k", "top_p", "temperature", "min_p", "nope"])
                           | st.dictionaries(st.sampled_from(["top_k", "top_p", "min_p", "min_tokens"]),
                                             st.dictionaries(st.sampled_from(["top_k", "top_p", "min_p", "x"]),
                                                             SCALARS, max_size=2), min_size=1, max_size=1), max_size=3),
    "stopping": st.lists(st.just("time_limit") | st.just({"time_limit": {"seconds": 1}}) | SCALARS, max_size=2),
    "strategy": st.sampled_from(["sample", "beam", None, 3]) | VALUES,
    "engine": st.dictionaries(st.sampled_from(["kv_cache_memory", "max_num_seqs", "block_size", "x"]), SCALARS),
    "inputs": VALUES, "outputs": VALUES, "draft": VALUES,
})


@settings(max_examples=300, deadline=None)
@given(data=MAPPINGS | NEAR_VALID)
def test_fuzz_any_mapping_either_loads_or_raises_recipe_error(data):
    try:
        recipe = recipe_from_data(data, registry=REGISTRY)
    except RecipeError:
        return
    yaml.safe_dump(describe_recipe(recipe, REGISTRY))  # a recipe that loads can also be described and dumped


@settings(max_examples=200, deadline=None)
@given(key=st.lists(st.sampled_from(NAMES) | st.text(max_size=3) | st.integers(0, 3).map(str), max_size=4)
       .map(".".join), value=st.text(max_size=8))
def test_fuzz_any_set_override_either_loads_or_raises_recipe_error(key, value):
    data = {"model": "m", "processors": ["top_k", {"top_p": {"top_p": 0.5}}], "strategy": "sample"}
    with contextlib.suppress(RecipeError):
        recipe_from_data(data, [f"{key}={value}"], registry=REGISTRY)


@settings(max_examples=100, deadline=None)
@given(field=st.sampled_from(["temperature", "top_p", "min_p"]), number=st.floats(0.01, 1.0),
       tokens=st.integers(1, 4096), seed=st.integers(0, 2**31))
def test_fuzz_a_valid_set_override_lands_at_its_key(field, number, tokens, seed):
    # the other half of the fuzz above: an override that is valid is applied, at the key it names, with its value
    data = {"model": "m", "strategy": "sample"}
    recipe = recipe_from_data(data, [f"sampling.{field}={number!r}", f"sampling.max_tokens={tokens}",
                                     f"sampling.seed={seed}"], registry=REGISTRY)
    assert getattr(recipe.sampling, field) == pytest.approx(number)
    assert (recipe.sampling.max_tokens, recipe.sampling.seed) == (tokens, seed)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40))
def test_fuzz_any_text_parses_as_yaml_does_or_raises_recipe_error(text):
    try:
        expected = yaml.safe_load(text)
    except yaml.YAMLError:
        with pytest.raises(RecipeError, match=r"fuzz\.yaml"):
            parse_yaml(text, "fuzz.yaml")
        return
    with contextlib.suppress(RecipeError):  # stricter than PyYAML (duplicate keys, alias budgets): may refuse
        assert repr(parse_yaml(text, "fuzz.yaml")) == repr(expected)


@settings(max_examples=100, deadline=None)
@given(document=st.dictionaries(st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
                                st.none() | st.booleans() | st.integers() | st.text(max_size=10)
                                | st.lists(st.integers(), max_size=3), max_size=5))
def test_fuzz_any_yaml_document_written_by_pyyaml_parses_to_what_was_written(document):
    assert parse_yaml(yaml.safe_dump(document), "fuzz.yaml") == document
