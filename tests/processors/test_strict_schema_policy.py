"""The `strict` (additionalProperties) policy of `json_schema` constraints never lets in an output the schema as
written refuses, and never makes a schema llguidance compiles as written uncompilable: `oneOf` branches that may
overlap stay as written, parts of `anyOf`/`oneOf` beside keywords that bring in keys of the same object stay open,
and `$anchor` / `"$id": "#name"` references are resolved (an unresolvable one closes nothing)."""

from __future__ import annotations

import json
from functools import cache

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decodekit import LLM, SamplingParams
from decodekit.api.constraints import ConstraintError, ConstraintSpec, backend_class
from decodekit.core.plugin_manager import get_plugin_manager
from decodekit.core.registry import Registry
from decodekit.models.tiny import tiny_model, tiny_tokenizer
from decodekit_plugins.strict_schema import forbid_additional_properties

BACKENDS = Registry.from_plugin_manager(get_plugin_manager(load_entry_points=False)).backend_loaders()

BASE = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
X_PART = {"properties": {"x": {"type": "string"}}, "required": ["x"]}

# The reviewer's schemas.
# A: the branches overlap as written ({"b": 1} matches both), so `oneOf` refuses {"b": 1}; closing them would
# make them disjoint and let {"b": 1} out.
OVERLAPPING_ONE_OF = {"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
                                {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
# B: an `anyOf` part beside a `$ref` (or an `allOf`) that brings in the required key `id`.
ANY_OF_BESIDE_REF = {"$defs": {"base": BASE}, "$ref": "#/$defs/base", "anyOf": [X_PART]}
ANY_OF_BESIDE_ALL_OF = {"allOf": [BASE], "anyOf": [X_PART]}
# C: the `allOf` part reaches its target through a name anchor.
ANCHORED_ALL_OF = {"$defs": {"b": {"$anchor": "B", **BASE}}, "allOf": [{"$ref": "#B"}],
                   "properties": {"z": {"type": "string"}}, "required": ["z"]}
# A `oneOf` whose branches no value can match together (a required discriminator with different constants).
DISJOINT_ONE_OF = {"oneOf": [
    {"type": "object", "properties": {"kind": {"const": "cat"}, "name": {"type": "string", "maxLength": 8}},
     "required": ["kind", "name"]},
    {"type": "object", "properties": {"kind": {"const": "dog"}, "age": {"type": "integer", "minimum": 0,
                                                                         "maximum": 20}},
     "required": ["kind", "age"]}]}


def _check(schema: dict, strict: bool = True) -> str | None:
    """llguidance's refusal of the schema (None when it compiles), without a tokenizer."""
    try:
        written = forbid_additional_properties(schema) if strict else schema  # as the json_schema processor does
        backend_class("llguidance", BACKENDS).check(ConstraintSpec.json_schema(written))
    except ConstraintError as exc:
        return str(exc)
    return None


def _validates(instance, schema: dict) -> bool:
    return jsonschema.validators.validator_for(schema)(schema).is_valid(instance)


# ---- 1: `oneOf` ----------------------------------------------------------------------------------------------------
def test_overlapping_one_of_branches_stay_as_written_so_strict_refuses_the_schema_as_llguidance_does():
    assert forbid_additional_properties(OVERLAPPING_ONE_OF) == OVERLAPPING_ONE_OF  # nothing closed
    assert not _validates({"b": 1}, OVERLAPPING_ONE_OF)  # what closing the branches would let out
    as_written, strict = _check(OVERLAPPING_ONE_OF, strict=False), _check(OVERLAPPING_ONE_OF)
    assert as_written is not None and "oneOf" in as_written and strict == as_written


def test_with_the_bundled_model_the_overlapping_one_of_request_fails_instead_of_writing_an_invalid_output(smol):
    out = smol.chat([[{"role": "user", "content": 'Output exactly this JSON: {"b": 1}'}]],
                    SamplingParams(temperature=0, max_tokens=40,
                                   processors=[{"json_schema": {"schema": OVERLAPPING_ONE_OF}}]))[0]
    assert out.outputs[0].finish_reason == "error" and "oneOf" in (out.error or ""), out.text


def test_disjoint_one_of_branches_are_still_closed_and_random_outputs_validate_as_written():
    closed = forbid_additional_properties(DISJOINT_ONE_OF)
    assert [branch["additionalProperties"] for branch in closed["oneOf"]] == [False, False]
    assert _check(DISJOINT_ONE_OF) is None
    llm = LLM(tiny_model("llama"), tiny_tokenizer(384))
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=60,
                             processors=[{"json_schema": {"schema": DISJOINT_ONE_OF}}]) for seed in range(6)]
    for out in llm.generate(["Pet:"] * len(params), params):  # a random model: the mask does all of it
        assert out.error is None and out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        assert _validates(value, DISJOINT_ONE_OF) and set(value) <= {"kind", "name", "age"}


def test_one_of_branches_that_differ_only_in_optional_keys_or_patterns_are_not_proved_disjoint():
    for one_of in ([{"type": "object", "properties": {"k": {"const": 1}}},  # k optional in both
                    {"type": "object", "properties": {"k": {"const": 2}}}],
                   [{"type": "string", "pattern": "^a"}, {"type": "string", "pattern": "^b"}],
                   [{"type": "number"}, {"type": "integer"}],
                   [{"enum": [1, "a"]}, {"const": 1.0}]):
        schema = {"oneOf": one_of}
        assert forbid_additional_properties(schema) == schema


def test_one_of_branches_of_different_types_or_required_constants_are_proved_disjoint():
    for one_of in ([{"type": "string"}, {"type": "object", "properties": {"a": {}}}],
                   [{"const": True}, {"const": 1}],
                   [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}],
                   [{"type": "object", "properties": {"a": {}}, "required": ["a"]},
                    {"type": "object", "properties": {"b": {}}, "additionalProperties": False}]):
        schema = {"oneOf": one_of, "$defs": {"a": {"type": "object", "properties": {"t": {"enum": ["x", "y"]}},
                                                   "required": ["t"]},
                                             "b": {"type": "object", "properties": {"t": {"const": "z"}}}}}
        closed = forbid_additional_properties(schema)
        assert closed["$defs"]["a"]["additionalProperties"] is False
        objects = [part for part in closed["oneOf"] if "properties" in part and "$ref" not in part]
        assert all(part["additionalProperties"] is False for part in objects)


def test_not_and_if_subschemas_stay_as_written():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "not": {"type": "object", "properties": {"b": {}}},
              "if": {"type": "object", "properties": {"a": {"const": 1}}}, "then": {"required": ["a"]}}
    closed = forbid_additional_properties(schema)
    assert closed["not"] == schema["not"] and closed["if"] == schema["if"]
    # closing `not`'s object would let {"b": 1, "a": 2} out (no longer matching it): a value `not` refuses
    assert not _validates({"a": 2, "b": 1}, schema)


# ---- 2: parts beside keywords that bring in keys of the same object --------------------------------------------------
SIBLING_CASES = [
    ANY_OF_BESIDE_REF,
    ANY_OF_BESIDE_ALL_OF,
    {"definitions": {"base": BASE}, "allOf": [{"$ref": "#/definitions/base"}], "anyOf": [X_PART]},
    {"anyOf": [BASE], "oneOf": [{"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
                                {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}]},
    # a single-part allOf beside a $ref is not the part itself: the $ref target requires a key the part does not name
    # (found by the hypothesis property below in CI)
    {"$ref": "#/$defs/d1", "allOf": [{"type": "object", "properties": {"a": {}}, "required": ["a"]}],
     "$defs": {"d1": {"properties": {}, "required": ["b"]}}},
]


@pytest.mark.parametrize("schema", SIBLING_CASES)
def test_parts_beside_a_ref_allof_or_other_combinator_stay_open_so_strict_compiles_what_llguidance_compiles(schema):
    assert _check(schema, strict=False) is None
    assert _check(schema) is None
    closed = forbid_additional_properties(schema)
    parts = [part for key in ("anyOf", "oneOf", "allOf") for part in closed.get(key, [])]
    assert parts and all("additionalProperties" not in part for part in parts)


def test_then_else_and_dependent_schemas_are_parts_of_their_object_and_stay_open():
    schema = {"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"],
              "then": {"properties": {"x": {}}}, "else": {"properties": {"y": {}}},
              "dependentSchemas": {"k": {"properties": {"z": {}}}}}
    closed = forbid_additional_properties(schema)
    assert all("additionalProperties" not in closed[key] for key in ("then", "else"))
    assert "additionalProperties" not in closed["dependentSchemas"]["k"]
    assert closed["additionalProperties"] is False and set(closed["properties"]) == {"k", "x", "y", "z"}


# ---- 3: anchors and references that cannot be resolved -------------------------------------------------------
ANCHOR_CASES = [
    ANCHORED_ALL_OF,
    {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"b": {"$id": "#B", **BASE}},
     "allOf": [{"$ref": "#B"}], "properties": {"z": {"type": "string"}}, "required": ["z"]},
    {"$id": "https://example.com/s.json", "$defs": {"b": {"$anchor": "B", **BASE}},
     "allOf": [{"$ref": "https://example.com/s.json#B"}], "properties": {"z": {"type": "string"}}, "required": ["z"]},
    {"$id": "https://example.com/s.json", "$defs": {"b": {"$id": "b.json", **BASE}},
     "allOf": [{"$ref": "b.json"}], "properties": {"z": {"type": "string"}}, "required": ["z"]},
]


@pytest.mark.parametrize("schema", ANCHOR_CASES)
def test_anchor_and_id_references_are_resolved_so_their_allof_target_stays_open(schema):
    assert _check(schema, strict=False) is None
    assert _check(schema) is None
    closed = forbid_additional_properties(schema)
    target = next(iter((closed.get("$defs") or closed["definitions"]).values()))
    assert "additionalProperties" not in target  # used inside allOf: open
    assert closed["additionalProperties"] is False and set(closed["properties"]) == {"z", "id"}


def test_a_reference_that_cannot_be_resolved_where_it_is_intersected_closes_nothing():
    schema = {"$defs": {"b": BASE}, "allOf": [{"$ref": "other.json#/$defs/b"}],
              "properties": {"z": {"type": "object", "properties": {"q": {}}}}}
    assert forbid_additional_properties(schema) == schema
    plain = {"$defs": {"b": BASE}, "properties": {"r": {"$ref": "other.json"}, "z": {"type": "object",
                                                                                    "properties": {"q": {}}}}}
    assert forbid_additional_properties(plain)["properties"]["z"]["additionalProperties"] is False


@pytest.mark.parametrize(("schema", "message", "expected"), [
    (ANY_OF_BESIDE_REF, 'Output JSON with id 1 and x "a".', {"id": 1, "x": "a"}),
    (ANY_OF_BESIDE_ALL_OF, 'Output JSON with id 1 and x "a".', {"id": 1, "x": "a"}),
    (ANCHORED_ALL_OF, 'Output JSON with id 1 and z "a".', None),
])
def test_with_the_bundled_model_the_reviewer_s_schemas_give_valid_outputs_under_strict(smol, schema, message,
                                                                                       expected):
    outs = smol.chat([[{"role": "user", "content": message}]] * 2,
                     [SamplingParams(temperature=0, max_tokens=40, processors=[{"json_schema": {
                         "schema": schema, "strict": strict}}]) for strict in (True, False)])
    strict_out, written_out = outs
    assert strict_out.error is None and strict_out.outputs[0].finish_reason == "stop", strict_out.error
    value = json.loads(strict_out.text)
    assert _validates(value, schema)
    assert set(value) <= {"id", "x", "z"}  # closed: no invented keys
    if expected is not None:
        assert value == expected and json.loads(written_out.text) == expected


@pytest.fixture(scope="module")
def smol() -> LLM:
    return LLM("smollm2-135m-instruct", dtype="float32", device="cpu")


# ---- properties over generated schemas ----------------------------------------------------------------------------
KEYS = ("a", "b", "c")
LEAVES = st.sampled_from([{}, {"type": "integer"}, {"type": "string"}, {"const": 1}, {"const": "s"},
                          {"enum": [1, "s"]}, {"type": "object"}]) | st.builds(
    lambda key, value: {"type": "object", "properties": {key: value}, "required": [key]},
    st.sampled_from(KEYS), st.sampled_from([{}, {"type": "integer"}, {"const": "s"}]))
DEF_NAMES = ("d0", "d1")


def _object(children):
    return st.builds(
        lambda props, req, typed: {**({"type": "object"} if typed else {}), "properties": props,
                                   **({"required": req} if req else {})},
        st.dictionaries(st.sampled_from(KEYS), children, max_size=3),
        st.lists(st.sampled_from(KEYS), max_size=2, unique=True), st.booleans())


def _schemas(refs: tuple[str, ...]):
    leaves = LEAVES | st.sampled_from([{"$ref": ref} for ref in refs]) if refs else LEAVES

    def extend(children):
        parts = st.lists(children, min_size=1, max_size=3)
        combined = st.builds(lambda key, items: {key: items}, st.sampled_from(["anyOf", "oneOf", "allOf"]), parts)
        beside = st.builds(lambda base, extra: {**base, **extra}, _object(children), combined)
        negated = st.builds(lambda inner: {"not": inner}, children)
        with_ref = (st.builds(lambda ref, extra: {"$ref": ref, **extra}, st.sampled_from(refs), combined | _object(
            children)) if refs else combined)
        return _object(children) | combined | beside | with_ref | negated

    return st.recursive(leaves, extend, max_leaves=6)


@st.composite
def documents(draw):
    """A schema with one or two definitions (each may refer to the earlier ones, by pointer or by anchor) and a
    root that may refer to them."""
    defs: dict = {}
    refs: tuple[str, ...] = ()
    for i, name in enumerate(DEF_NAMES[:draw(st.integers(1, len(DEF_NAMES)))]):
        body = draw(_schemas(refs))
        if draw(st.booleans()):
            defs[name] = {**body, "$anchor": f"A{i}"}
            refs += (f"#A{i}",)
        else:
            defs[name] = body
            refs += (f"#/$defs/{name}",)
    root = draw(_schemas(refs))
    return {**root, "$defs": defs} if defs else root


@st.composite
def intersections(draw):
    """An object schema intersected with others beside it: a definition reached by `$ref` (a pointer or an
    anchor) or as an `allOf` part, next to `anyOf`/`oneOf` parts and keys of its own."""
    leaf = _schemas(())
    target = draw(_object(leaf) | LEAVES)
    anchored = draw(st.booleans())
    defs = {"d0": {**target, "$anchor": "A0"} if anchored else target}
    ref = "#A0" if anchored else "#/$defs/d0"
    root: dict = draw(st.sampled_from([{"$ref": ref}, {"allOf": [{"$ref": ref}]}, {"allOf": [target]}]))
    root[draw(st.sampled_from(["anyOf", "oneOf"]))] = draw(st.lists(_object(leaf) | LEAVES, min_size=1, max_size=2))
    if draw(st.booleans()):
        root = {**draw(_object(leaf)), **root}
    return {**root, "$defs": defs}


INSTANCES = st.recursive(st.sampled_from([1, 2, "s", "t", None]),
                         lambda children: st.dictionaries(st.sampled_from((*KEYS, "d")), children, max_size=4),
                         max_leaves=8)


@cache
def _validator(text: str):
    return jsonschema.Draft202012Validator(json.loads(text))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents() | intersections(), st.lists(INSTANCES, min_size=10, max_size=30))
def test_every_value_the_strict_schema_accepts_the_schema_as_written_accepts(schema, instances):
    closed = forbid_additional_properties(schema)
    strict, written = _validator(json.dumps(closed)), _validator(json.dumps(schema))
    for instance in instances:
        if strict.is_valid(instance):
            assert written.is_valid(instance), (json.dumps(closed), instance)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents() | intersections())
def test_strict_never_refuses_a_generated_schema_llguidance_compiles_as_written(schema):
    if _check(schema, strict=False) is None:
        assert _check(schema) is None, json.dumps(forbid_additional_properties(schema))


def test_a_property_named_on_both_sides_of_a_ref_stays_open_on_both_and_the_others_are_closed():
    """`{"$ref": D, "properties": {"a": ...}}`: the object's `a` is intersected with D's `a`, so neither is closed
    (D's `a` requires a key this side's `a` does not list); a property D does not name is closed as usual."""
    schema = {"$ref": "#/$defs/d0", "properties": {"a": {"properties": {}}, "b": {"properties": {"x": {}}}},
              "required": ["a"],
              "$defs": {"d0": {"type": "object", "properties": {"a": {"type": "object", "properties": {"a": {}},
                                                                       "required": ["a"]}}}}}
    closed = forbid_additional_properties(schema)
    assert "additionalProperties" not in closed["properties"]["a"]
    assert "additionalProperties" not in closed["$defs"]["d0"]["properties"]["a"]
    assert closed["properties"]["b"]["additionalProperties"] is False
    assert _check(schema) is None and _check(schema, strict=False) is None


def test_a_single_part_all_of_is_the_part_itself_and_is_closed_as_pydantic_writes_fields():
    """pydantic writes a field with a default or description as `allOf: [{"$ref": ...}]` beside annotations only:
    nothing is intersected there, so the referenced model is closed like any other object."""
    schema = {"type": "object", "properties": {"inner": {"allOf": [{"$ref": "#/$defs/Inner"}], "description": "d"}},
              "required": ["inner"],
              "$defs": {"Inner": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
    closed = forbid_additional_properties(schema)
    assert closed["$defs"]["Inner"]["additionalProperties"] is False
    assert closed["additionalProperties"] is False
