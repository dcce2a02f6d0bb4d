"""Structured output: the constraint backends and processors, unit-level on the tiny tokenizer (mask exactness
against an independent oracle, speculative draft rows, forking, refusal messages) and end to end on the bundled
model (32 JSON schemas, regexes and choices in one continuous batch; errors that fail one request; parallel
sampling; composition with other processors; the two recipes)."""

from __future__ import annotations

import json
import re
from functools import cache

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict

from decodekit import LLM, SamplingParams, hookimpl
from decodekit.api.components import ComponentInfo, PlanError
from decodekit.api.constraints import (
    ConstraintError,
    ConstraintSpec,
    allocate_bitmask,
    apply_bitmask,
    backend_class,
    bitmask_to_bool,
    get_backend,
    token_bitmask,
)
from decodekit.api.processors import BatchView, LogitsProcessor
from decodekit.core.plan import Components
from decodekit.core.plugin_manager import get_plugin_manager
from decodekit.core.registry import Registry
from decodekit.models.tiny import tiny_model, tiny_tokenizer
from decodekit_plugins.strict_schema import forbid_additional_properties
from decodekit_plugins.structured import ChoiceProcessor, JsonSchemaProcessor, RegexProcessor
from tests.helpers.structured_cases import CHOICES, REGEXES, SCHEMAS

EOS = 2
TINY_VOCAB = 384
REGISTRY = Registry.from_plugin_manager(get_plugin_manager(load_entry_points=False))
BACKEND_LOADERS = REGISTRY.backend_loaders()  # the constraint backends by name, as an engine finds them


@cache
def _tiny():
    return tiny_tokenizer(TINY_VOCAB)


def _has_xgrammar() -> bool:
    try:
        backend_class("xgrammar", BACKEND_LOADERS)
    except ConstraintError:
        return False
    return True


BACKENDS = ["llguidance", pytest.param("xgrammar", marks=pytest.mark.skipif(not _has_xgrammar(),
                                                                            reason="xgrammar is not installed"))]


# ---- an independent oracle: a finite language and each token's exact bytes -----------------------------------
def _byte_decoder() -> dict[str, int]:
    # GPT-2's reversible byte <-> printable-character table, used by byte-level BPE tokenizers.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def token_bytes(tokenizer) -> list[bytes | None]:
    """Each id's bytes (None for special/added tokens, which no constraint here may produce)."""
    decoder, special = _byte_decoder(), set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    return [None if i in special else bytes(decoder[c] for c in piece)
            for i, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))]


def oracle_mask(language: set[str], prefix: bytes, pieces: list[bytes | None], vocab: int) -> torch.Tensor:
    """Allowed: a token whose bytes keep `prefix` a prefix of some word, and EOS exactly when `prefix` is a word."""
    prefixes = {w.encode()[:i] for w in language for i in range(len(w.encode()) + 1)}
    allowed = torch.tensor([bool(piece) and prefix + piece in prefixes for piece in pieces[:vocab]])
    allowed[EOS] = prefix in {w.encode() for w in language}
    return allowed


# Regexes with their (finite) languages, built together so the language is known without the backend.
_WORD = st.text(alphabet="abc ", min_size=1, max_size=3)


def _literal(word: str) -> tuple[str, str, set[str]]:
    # one Lark literal per character: llguidance lexes Lark literals greedily, so "ab" next to "a" would not be
    # the textbook language
    return re.escape(word).replace("\\ ", " "), "(" + " ".join(json.dumps(c) for c in word) + ")", {word}


def _combine(children: st.SearchStrategy) -> st.SearchStrategy:
    def alt(parts):
        return ("(?:" + "|".join(p[0] for p in parts) + ")", "(" + " | ".join(p[1] for p in parts) + ")",
                set().union(*(p[2] for p in parts)))

    def cat(parts):
        words = {""}
        for p in parts:
            words = {w + v for w in words for v in p[2]}
        return "".join(p[0] for p in parts), "(" + " ".join(p[1] for p in parts) + ")", words

    def opt(p):
        return f"(?:{p[0]})?", f"({p[1]})?", p[2] | {""}

    return st.one_of(st.lists(children, min_size=2, max_size=3).map(alt),
                     st.lists(children, min_size=2, max_size=2).map(cat), children.map(opt))


LANGUAGES = st.recursive(_WORD.map(_literal), _combine, max_leaves=5).filter(lambda r: 0 < len(r[2]) <= 60)


def _fill(backend, matcher) -> torch.Tensor:
    bitmask = allocate_bitmask(1, backend.vocab_size)
    backend.fill_bitmask([(matcher, 0, [])], bitmask)
    return bitmask_to_bool(bitmask, backend.vocab_size)[0]


def _walk_and_check(backend, spec: ConstraintSpec, language: set[str], pieces, data) -> None:
    matcher = backend.matcher(backend.compile(spec))
    prefix = b""
    for _ in range(12):
        mask = _fill(backend, matcher)
        expected = oracle_mask(language, prefix, pieces, backend.vocab_size)
        assert not (mask & ~expected).any(), f"prefix {prefix!r}: allowed but breaks it: {_ids(mask & ~expected)}"
        # Blocked although valid: only tokens inside text the grammar forces (llguidance steers forced text to
        # its canonical tokenization, e.g. " b" rather than " " then "b").
        forced = _forced(language, prefix)
        for token in _ids(expected & ~mask):
            assert forced.startswith(pieces[token]), f"prefix {prefix!r}: blocked but valid: {token}"
        # the backend's own matcher agrees token by token
        allowed = _ids(mask)
        for token in allowed:
            assert matcher.validate([token]) == 1
        for token in data.draw(st.lists(st.sampled_from(_ids(~expected)), max_size=5)):
            assert matcher.validate([token]) == 0
        if allowed == [EOS] or not allowed:
            break
        token = data.draw(st.sampled_from([t for t in allowed if t != EOS] or allowed))
        assert matcher.consume([token])
        prefix += pieces[token] or b""


def _forced(language: set[str], prefix: bytes) -> bytes:
    """The bytes every completion of `prefix` starts with (none when `prefix` is already a word)."""
    rests = [w.encode()[len(prefix):] for w in language if w.encode().startswith(prefix)]
    if b"" in rests:
        return b""
    common = rests[0]
    for rest in rests[1:]:
        common = common[: next((i for i, (x, y) in enumerate(zip(common, rest)) if x != y), min(len(common),
                                                                                                len(rest)))]
    return common


def _ids(mask: torch.Tensor) -> list[int]:
    return mask.nonzero().flatten().tolist()


@pytest.mark.parametrize("backend_name", BACKENDS)
@settings(max_examples=40, deadline=None)
@given(lang=LANGUAGES, kind=st.sampled_from(["regex", "grammar", "choice"]), data=st.data())
def test_mask_allows_only_tokens_that_keep_a_valid_prefix_and_blocks_only_tokens_that_break_it(backend_name, lang,
                                                                                              kind, data):
    regex, lark, language = lang
    backend = get_backend(backend_name, _tiny(), TINY_VOCAB, (EOS,), BACKEND_LOADERS)
    spec = {"regex": ConstraintSpec.regex(regex), "grammar": ConstraintSpec.grammar(f"start: {lark}"),
            "choice": ConstraintSpec.choice(sorted(language))}[kind]
    _walk_and_check(backend, spec, language, token_bytes(_tiny()), data)


@settings(max_examples=8, deadline=None)
@given(lang=LANGUAGES, data=st.data())
def test_mask_exactness_holds_on_the_bundled_model_s_tokenizer(smol_tokenizer, lang, data):
    regex, _, language = lang
    backend = get_backend("llguidance", smol_tokenizer, len(smol_tokenizer), (EOS,), BACKEND_LOADERS)
    _walk_and_check(backend, ConstraintSpec.regex(regex), language, _smol_pieces(smol_tokenizer), data)


@cache
def _smol_pieces(tokenizer) -> list[bytes | None]:
    return token_bytes(tokenizer)


# ---- bitmask application -----------------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(1, 100), extra=st.integers(0, 40), seed=st.integers(0, 2**16))
def test_apply_bitmask_blocks_exactly_the_cleared_bits_and_ids_past_the_mask(rows, vocab, extra, seed):
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, vocab, generator=g) < 0.5
    bitmask = torch.stack([token_bitmask(row.nonzero().flatten().tolist(), vocab) for row in allowed])
    logits = torch.randn(rows, vocab + extra, generator=g)
    out = apply_bitmask(logits, bitmask)
    expected = logits.clone()
    expected[:, :vocab][~allowed] = -float("inf")
    expected[:, vocab:] = -float("inf")
    assert torch.equal(out, expected) and torch.equal(bitmask_to_bool(bitmask, vocab), allowed)


# ---- the additionalProperties policy and specs ---------------------------------------------------------------------
def test_policy_forbids_unlisted_keys_only_where_the_schema_is_silent():
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},  # a key named "properties"
        "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "list": {"type": "array", "items": {"properties": {"y": {}}}}},
        "allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    out = forbid_additional_properties(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["properties"]["properties"]  # names, not a schema
    assert out["properties"]["open"]["additionalProperties"] is True
    assert out["properties"]["list"]["items"]["additionalProperties"] is False
    assert all("additionalProperties" not in part for part in out["allOf"])  # parts of an intersection stay open
    assert "\"additionalProperties\":false" not in ConstraintSpec.json_schema(schema).text


def test_schema_given_as_json_text_compiles_to_the_same_spec_as_the_mapping():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    proc = JsonSchemaProcessor()
    as_text = proc.spec(proc.Params.model_validate({"schema": json.dumps(schema)}))
    assert as_text == proc.spec(proc.Params.model_validate({"schema": schema}))
    with pytest.raises(ValueError, match="the schema is not valid JSON"):
        proc.Params.model_validate({"schema": "{type: object"})


# ---- processor level: drafts, forks, errors --------------------------------------------------------------------------
def _processor(cls, **options):
    proc = cls()
    proc.setup(ComponentInfo(tokenizer=_tiny(), vocab_size=TINY_VOCAB, eos_token_ids=(EOS,)))
    return proc, proc.Params(**options)


def _encode(text: str) -> list[int]:
    return list(_tiny().encode(text, add_special_tokens=False))


def _stepped_masks(proc, options, state, tokens: list[int]) -> list[torch.Tensor]:
    """The mask before each token and after the last, stepping a copy of the state one token at a time."""
    state = proc.fork_state(state)
    masks = []
    for token in [*tokens, None]:
        logits = torch.zeros(1, TINY_VOCAB)
        masks.append(proc(logits, BatchView([SamplingParams()], [[0]], [1], (EOS,), options=[options],
                                            states=[state])))
        if token is not None:
            state = proc.update_state(state, options, [token])
    return masks


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_draft_rows_get_the_mask_after_their_drafts_and_leave_the_state_alone(backend_name):
    proc, options = _processor(RegexProcessor, pattern="(the|a) (quick|lazy) (fox|dog)", backend=backend_name)
    prompt = [1, 5]
    a = proc.update_state(proc.init_state(options, prompt), options, _encode("the "))
    b = proc.init_state(options, prompt)
    accepted_a, accepted_b = prompt + _encode("the "), list(prompt)
    drafts_a = _encode("quick fox")[:3]
    bad = _encode("zz")[:1]  # rejected by the constraint: rows after it are never verified
    rows = [(a, accepted_a + drafts_a[:j], j) for j in range(len(drafts_a) + 1)]
    rows += [(b, accepted_b, 0), (b, accepted_b + bad, 1)]
    view = BatchView([SamplingParams()] * len(rows), [h for _, h, _ in rows], [len(prompt)] * len(rows), (EOS,),
                     options=[options] * len(rows), states=[s for s, _, _ in rows],
                     draft_offsets=[j for _, _, j in rows])
    before = _stepped_masks(proc, options, a, [])[0]
    out = proc(torch.zeros(len(rows), TINY_VOCAB), view)
    for j, expected in enumerate(_stepped_masks(proc, options, a, drafts_a)):
        assert torch.equal(out[j], expected[0]), f"draft offset {j}"
    assert torch.equal(out[len(drafts_a) + 1], _stepped_masks(proc, options, b, [])[0][0])
    eos_only = torch.full((TINY_VOCAB,), -float("inf"))
    eos_only[EOS] = 0
    assert torch.equal(out[-1], eos_only)
    assert torch.equal(_stepped_masks(proc, options, a, [])[0], before)  # the state saw no draft
    # a draft row scored without its offset-0 row (a subset of the rows) advances its own copy
    alone = proc(torch.zeros(1, TINY_VOCAB), view.select([2]))
    assert torch.equal(alone[0], out[2])


def test_forked_states_advance_independently():
    proc, options = _processor(ChoiceProcessor, choices=["abc", "abd"])
    parent = proc.update_state(proc.init_state(options, [1]), options, _encode("ab"))
    child = proc.fork_state(parent)
    proc.update_state(child, options, _encode("c"))
    assert child.matcher.is_stopped() and not parent.matcher.is_stopped()
    assert parent.matcher.validate(_encode("d")) == 1


def test_a_token_the_constraint_rejects_raises_with_the_reason_and_the_next_call_raises_too():
    proc, options = _processor(RegexProcessor, pattern="[0-9]+")
    state = proc.init_state(options, [1])
    with pytest.raises(ConstraintError, match="regex constraint rejected a token"):
        proc.update_state(state, options, _encode("x"))
    view = BatchView([SamplingParams()], [[1]], [1], (EOS,), options=[options], states=[state])
    with pytest.raises(ConstraintError, match=r"regex constraint rejected a token: .*satisfy the grammar"):
        proc(torch.zeros(1, TINY_VOCAB), view)


def test_a_complete_match_allows_only_eos_and_eos_is_accepted_after_it():
    proc, options = _processor(ChoiceProcessor, choices=["abc"])
    state = proc.update_state(proc.init_state(options, [1]), options, _encode("abc"))
    out = proc(torch.zeros(1, TINY_VOCAB), BatchView([SamplingParams()], [[1]], [1], (EOS,), options=[options],
                                                     states=[state]))
    assert _ids(out[0] == 0) == [EOS]
    proc.update_state(state, options, [EOS, EOS])  # ignore_eos keeps generating EOS; that stays valid
    assert state.matcher.error() is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_a_random_tiny_model_stays_inside_finite_regexes_and_choices_batched(device):
    # a random model proposes anything, so every token of its output was put there by the mask
    llm = LLM(tiny_model("llama"), _tiny(), device=device)
    patterns = ["(yes|no)", "[0-9]{2,4}", "[ab]{1,5}c", "(the|a) (fox|dog)"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24, processors=[{"regex": {"pattern": p}}])
              for i, p in enumerate(patterns)]
    params.append(SamplingParams(temperature=0, max_tokens=8, processors=[{"choice": {"choices": ["abc", "xyz"]}}]))
    outs = llm.generate(["The quick brown fox"] * len(params), params)
    for out, pattern in zip(outs, [*patterns, "abc|xyz"]):
        assert out.outputs[0].finish_reason == "stop" and re.fullmatch(pattern, out.text), (pattern, out.text)


# ---- refusal at submission / recipe load -------------------------------------------------------------------------


@pytest.mark.parametrize(("processor", "reason"), [
    ({"json_schema": {"schema": {"type": "array", "uniqueItems": True}}}, "Unimplemented keys: [\"uniqueItems\"]"),
    ({"json_schema": {"schema": {"type": "strng"}}}, "Invalid type: strng"),
    ({"regex": {"pattern": "a(b"}}, "unclosed group"),
    ({"grammar": {"grammar": "start: foo"}}, "unknown name: \"foo\""),
    ({"json": {"backend": "nope"}}, "unknown constraint backend 'nope'; known: llguidance, xgrammar"),
])
def test_a_constraint_that_cannot_compile_is_refused_without_an_engine_with_the_backend_reason(processor, reason):
    with pytest.raises(PlanError, match=re.escape(reason)) as info:
        Components(REGISTRY).resolve(SamplingParams(processors=[processor]))
    assert str(info.value).startswith(f"processors[0].{next(iter(processor))}: ")


def test_constraints_that_compile_resolve_without_an_engine():
    plan = Components(REGISTRY).resolve(SamplingParams(processors=[
        {"json_schema": {"schema": {"type": "object"}}}, "json", {"regex": {"pattern": "a+"}},
        {"grammar": {"grammar": 'root ::= "a" | "b"', "syntax": "gbnf"}}, {"choice": {"choices": ["x"]}}]))
    assert [stage.processor.name for stage in plan.stages] == ["json_schema", "json", "regex", "grammar", "choice"]


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_each_backend_refuses_a_bad_regex_at_submission_with_its_own_reason(backend_name):
    proc, _ = _processor(RegexProcessor, pattern="a")
    with pytest.raises(ConstraintError, match=r"(?i)unclosed|not closed"):
        proc.check_options(proc.Params(pattern="a(b", backend=backend_name))
    engine_free = RegexProcessor()  # a recipe check, before any engine exists
    with pytest.raises(ConstraintError, match=r"(?i)unclosed|not closed"):
        engine_free.check_options(proc.Params(pattern="a(b", backend=backend_name))


def test_a_tokenizer_the_backend_cannot_read_refuses_requests_instead_of_breaking_setup():
    class NotFast:
        """A tokenizer without a Rust backend (llguidance reads only fast tokenizers)."""

        def __len__(self):
            return 10

    proc = RegexProcessor()
    info = ComponentInfo(tokenizer=NotFast(), vocab_size=10, eos_token_ids=(EOS,))
    proc.setup(info)
    with pytest.raises(ConstraintError, match="llguidance"):
        proc.check_options_with(proc.Params(pattern="a"), info)


# ---- end to end on the bundled model -----------------------------------------------------------------------------
class _ForceParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    token_id: int
    after: int = 0


class ForceToken(LogitsProcessor):
    """Test processor: from the `after`-th generated token on, only `token_id` is possible."""

    name = "force_token"
    Params = _ForceParams
    needs_history = True

    def __call__(self, logits, batch):
        out = logits.clone()
        for row, opt in enumerate(batch.options):
            if len(batch.generated_ids(row)) >= opt.after:
                out[row] = -float("inf")
                out[row, opt.token_id] = 0.0
        return out


class _BanParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    token_ids: list[int]


class BanTokens(LogitsProcessor):
    """Test processor: `token_ids` are never possible."""

    name = "ban_tokens"
    Params = _BanParams

    def __call__(self, logits, batch):
        out = logits.clone()
        for row, opt in enumerate(batch.options):
            out[row, opt.token_ids] = -float("inf")
        return out


class _TestPlugin:
    @hookimpl
    def decodekit_register_processors(self, register):
        register(ForceToken.name, ForceToken)
        register(BanTokens.name, BanTokens)


SYSTEM = "You extract data from text and answer with JSON only."


@pytest.fixture(scope="module")
def smol_tokenizer(smol):
    """The bundled model's tokenizer (SmolLM2, 49152 ids, EOS <|im_end|> = 2)."""
    assert smol.engine.eos_token_ids == (EOS,)
    return smol.tokenizer


@pytest.fixture(scope="module")
def smol() -> LLM:
    pm = get_plugin_manager(load_entry_points=False)
    pm.register(_TestPlugin(), name="structured-test")
    return LLM("smollm2-135m-instruct", dtype="float32", device="cpu", plugin_manager=pm)


def _json_params(schema, extra=(), **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 128, **kw},
                          processors=[{"json_schema": {"schema": schema}}, *extra])


@pytest.fixture(scope="module")
def one_batch(smol):
    """32 schemas, 6 regexes and 3 choice lists, greedy, in one continuous batch."""
    convs, params = [], []
    for passage, what, schema in SCHEMAS:
        convs.append([{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": f"{passage}\n\nGive {what} as JSON."}])
        params.append(_json_params(schema))
    for question, pattern in REGEXES:
        convs.append([{"role": "user", "content": question}])
        params.append(SamplingParams(temperature=0, max_tokens=48, processors=[{"regex": {"pattern": pattern}}]))
    for question, choices in CHOICES:
        convs.append([{"role": "user", "content": question}])
        params.append(SamplingParams(temperature=0, max_tokens=16, processors=[{"choice": {"choices": choices}}]))
    outs = smol.chat(convs, params)
    return outs[: len(SCHEMAS)], outs[len(SCHEMAS) : -len(CHOICES)], outs[-len(CHOICES) :]


def test_every_output_for_32_schemas_parses_and_validates_and_ends_on_eos(one_batch, smol):
    assert len(SCHEMAS) >= 30
    for out, (_, what, schema) in zip(one_batch[0], SCHEMAS):
        assert out.error is None and out.outputs[0].finish_reason == "stop", (what, out.text)
        jsonschema.validate(json.loads(out.text), schema)
        assert out.outputs[0].token_ids[-1] in smol.engine.eos_token_ids


def test_regex_outputs_fullmatch(one_batch):
    for out, (_, pattern) in zip(one_batch[1], REGEXES):
        assert out.outputs[0].finish_reason == "stop" and re.fullmatch(pattern, out.text), (pattern, out.text)


def test_choice_outputs_are_one_of_the_choices(one_batch):
    for out, (_, choices) in zip(one_batch[2], CHOICES):
        assert out.outputs[0].finish_reason == "stop" and out.text in choices, (choices, out.text)


def _ask(smol, params_list, content="Tom Baker, 58, repairs clocks in Bristol. Give his record as JSON."):
    return smol.chat([[{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]]
                     * len(params_list), params_list)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130}},
          "required": ["name", "age"]}


def test_a_bad_schema_fails_only_its_request_with_the_backend_reason(smol):
    good = _json_params(PERSON, max_tokens=48)
    outs = _ask(smol, [good, _json_params({"type": "array", "uniqueItems": True}), good])
    assert outs[1].outputs[0].finish_reason == "error" and "uniqueItems" in outs[1].error
    for out in (outs[0], outs[2]):
        assert out.error is None and out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)


def test_a_token_that_breaks_the_constraint_midway_fails_only_its_request(smol):
    im_start = smol.tokenizer.convert_tokens_to_ids("<|im_start|>")
    broken = _json_params(PERSON, max_tokens=48, extra=[{"force_token": {"token_id": im_start, "after": 3}}])
    outs = _ask(smol, [_json_params(PERSON, max_tokens=48), broken])
    assert outs[1].outputs[0].finish_reason == "error"
    assert "json_schema constraint rejected a token" in outs[1].error
    assert outs[0].error is None
    jsonschema.validate(json.loads(outs[0].text), PERSON)


def test_parallel_samples_each_satisfy_the_schema(smol):
    (out,) = _ask(smol, [_json_params(PERSON, n=3, seed=0, temperature=1.0, max_tokens=48)],
                  "Invent a fictional person. Give the record as JSON.")
    assert len(out.outputs) == 3 and len({c.text for c in out.outputs}) > 1
    for choice in out.outputs:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), PERSON)


def test_every_beam_search_hypothesis_satisfies_the_schema(smol):
    (out,) = _ask(smol, [_json_params(PERSON, max_tokens=48, strategy={"beam_search": {
        "num_beams": 3, "num_return_sequences": 2}})])
    assert out.error is None and len(out.outputs) == 2
    for hypothesis in out.outputs:
        jsonschema.validate(json.loads(hypothesis.text), PERSON)


def test_top_k_1_sampling_after_the_mask_equals_greedy_constrained_decoding(smol):
    # the listed constraint runs before the implied temperature/top-k: top-1 is the best *allowed* token
    greedy, top1 = _ask(smol, [_json_params(PERSON, max_tokens=48),
                               _json_params(PERSON, max_tokens=48, temperature=0.7, top_k=1, seed=3)])
    assert top1.text == greedy.text and top1.outputs[0].finish_reason == "stop"


def test_a_processor_after_the_constraint_narrows_the_choices_in_order(smol):
    choices = ["Paris", "London", "Berlin"]
    question = [{"role": "user", "content": "What is the capital of France?"}]
    (first,) = smol.chat(question, SamplingParams(temperature=0, max_tokens=8,
                                                  processors=[{"choice": {"choices": choices}}]))
    # ban every token that could start the greedy choice (it has several tokenizations)
    starts = [t for t in range(len(smol.tokenizer)) if (text := smol.tokenizer.decode([t])) and
              first.text.startswith(text)]
    (second,) = smol.chat(question, SamplingParams(temperature=0, max_tokens=8, processors=[
        {"choice": {"choices": choices}}, {"ban_tokens": {"token_ids": starts}}]))
    assert first.text in choices and second.text in set(choices) - {first.text}


@pytest.mark.parametrize("name", ["json_output", "regex"])
def test_the_shipped_recipe_gives_outputs_that_satisfy_its_constraint(name, smol):
    from pathlib import Path

    from decodekit.recipe import load_recipe
    from decodekit.recipe_runner import read_inputs, run_recipe

    recipe = load_recipe(Path(__file__).parents[2] / "recipes" / f"{name}.yaml")
    requests, bad = read_inputs(recipe, Components(smol.engine.registry))
    assert requests and not bad
    result = run_recipe(recipe, smol, requests)
    (spec,) = recipe.processors
    for out in result.outputs:
        assert out.outputs[0].finish_reason == "stop", out.text
        if name == "json_output":
            jsonschema.validate(json.loads(out.text), spec.params["schema"])
        else:
            assert re.fullmatch(spec.params["pattern"], out.text)


def test_speculative_decoding_with_json_schemas_gives_the_same_greedy_output(smol, one_batch):
    """Draft tokens are validated by the constraint at every verified position (draft_offsets)."""
    convs, spec = [], []
    for passage, what, schema in SCHEMAS[:8]:
        convs.append([{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": f"{passage}\n\nGive {what} as JSON."}])
        spec.append(_json_params(schema, strategy={"speculative": {"proposer": "ngram", "num_speculative_tokens": 4,
                                                                   "adaptive": True}}))
    outs = smol.chat(convs, spec)
    assert [o.token_ids for o in outs] == [o.token_ids for o in one_batch[0][:8]]
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0


def test_the_no_op_unique_items_false_is_dropped_but_unique_items_true_still_refused():
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": False}
    spec = ConstraintSpec.json_schema(forbid_additional_properties(schema))
    assert "uniqueItems" not in spec.text
    kept = ConstraintSpec.json_schema(forbid_additional_properties({"type": "array", "uniqueItems": True}))
    assert '"uniqueItems":true' in kept.text


# ---- JSON options: coerce_one_of, lenient, separators; refusals that name the keyword and the option ----------------
# Two string branches llguidance cannot prove disjoint (so it refuses the oneOf by default), which are disjoint:
# every output matches exactly one, and `oneOf` validates.
CODE_ONE_OF = {"type": "object", "properties": {"code": {"oneOf": [
    {"type": "string", "pattern": "^[0-9]{1,3}$"}, {"type": "string", "pattern": "^[a-z]{1,3}$"}]}},
    "required": ["code"]}


def _refusal(params: dict) -> str:
    """The reason a json_schema request is refused without an engine (recipe check) and with one (tiny
    tokenizer); both must agree."""
    with pytest.raises(PlanError) as engine_free:
        Components(REGISTRY).resolve(SamplingParams(processors=[{"json_schema": params}]))
    proc = JsonSchemaProcessor()
    proc.setup(ComponentInfo(tokenizer=_tiny(), vocab_size=TINY_VOCAB, eos_token_ids=(EOS,)))
    with pytest.raises(ConstraintError) as engine:
        proc.check_options(proc.Params.model_validate(params))
    assert str(engine_free.value) == f"processors[0].json_schema: {engine.value}"
    return str(engine.value)


def test_an_overlapping_one_of_is_refused_naming_one_of_and_coerce_one_of():
    reason = _refusal({"schema": CODE_ONE_OF})
    assert reason.startswith("the schema uses 'oneOf'")
    assert "needs coerce_one_of: true (or lenient: true)" in reason
    assert "llguidance: oneOf constraints are not supported" in reason  # the backend's own words follow


@pytest.mark.parametrize("option", ["coerce_one_of", "lenient"])
def test_with_coerce_one_of_the_one_of_compiles_and_every_output_validates(option):
    llm = LLM(tiny_model("llama"), _tiny())
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=40,
                             processors=[{"json_schema": {"schema": CODE_ONE_OF, option: True}}]) for seed in range(6)]
    outs = llm.generate(["The code is"] * len(params), params)
    for out in outs:
        assert out.error is None and out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), CODE_ONE_OF)  # a random model: the mask did all of it


@pytest.mark.parametrize(("schema", "keyword"), [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems'"),
    ({"type": "object", "properties": {"when": {"type": "string", "format": "path"}}}, "'format': 'path'"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "dependencies": {"a": ["b"]}}, "'dependencies'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]},
      "then": {"required": ["b"]}}, "'if', 'then'"),
])
def test_lenient_accepts_what_llguidance_cannot_enforce_and_the_refusal_names_keyword_and_lenient(schema, keyword):
    reason = _refusal({"schema": schema})
    assert reason.startswith(f"the schema uses {keyword}")
    assert "lenient: true accepts" in reason
    plan = Components(REGISTRY).resolve(SamplingParams(processors=[{"json_schema": {"schema": schema,
                                                                                     "lenient": True}}]))
    assert [stage.processor.name for stage in plan.stages] == ["json_schema"]
    proc, options = _processor(JsonSchemaProcessor, schema=schema, lenient=True)
    proc.check_options(options)
    assert proc.init_state(options, [1]).matcher.error() is None


def test_a_refusal_inside_a_definition_says_where():
    schema = {"type": "object", "properties": {"x": {"$ref": "#/definitions/code"}},
              "definitions": {"code": CODE_ONE_OF["properties"]["code"]}}
    assert "(at json-schema:///#/definitions/code)" in _refusal({"schema": schema})


def _accepts(options: dict, text: str, schema: dict | None = None) -> bool:
    """Whether the json_schema constraint with these options takes `text` as a complete value (tiny tokenizer)."""
    proc, params = _processor(JsonSchemaProcessor, schema=schema or {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "string"}}}, "required": ["a", "b"]},
        **options)
    matcher = proc.init_state(params, [1]).matcher
    return matcher.consume(_encode(text)) and matcher.is_accepting()


def test_separator_and_escape_options_shape_the_json_text():
    assert _accepts({}, '{"a": 1, "b": ["x", "y"]}') and not _accepts({}, '{"a":1,"b":["x","y"]}')
    compact = {"item_separator": ",", "key_separator": ":"}
    assert _accepts(compact, '{"a":1,"b":["x","y"]}') and not _accepts(compact, '{"a": 1, "b": ["x", "y"]}')
    assert _accepts({"item_separator": " , "}, '{"a": 1 , "b": ["x" , "y"]}')
    assert _accepts({}, '{"a": 1, "b": ["x\\ny"]}')
    assert not _accepts({"allowed_escapes": "t"}, '{"a": 1, "b": ["x\\ny"]}')
    assert not _accepts({}, '{"a": 1, "b": ["\\u00e9"]}')
    assert _accepts({"allow_general_unicode_escapes": True}, '{"a": 1, "b": ["\\u00e9"]}')
    assert _accepts({"flexible_whitespace": True, "whitespace_pattern": "[ ]{0,2}"}, '{  "a": 1,"b" : ["x"]}')
    for bad, message in [({"item_separator": ";"}, "item_separator must be ','"),
                         ({"key_separator": "=>"}, "key_separator must be ':'"),
                         ({"allowed_escapes": "nq"}, "allowed_escapes may only hold JSON escape letters")]:
        with pytest.raises(ValueError, match=message):
            JsonSchemaProcessor.Params.model_validate({"schema": {"type": "object"}, **bad})


def test_the_options_are_part_of_the_spec_so_compiled_grammars_are_not_shared_across_them():
    proc = JsonSchemaProcessor()
    plain = proc.spec(proc.Params.model_validate({"schema": CODE_ONE_OF}))
    coerced = proc.spec(proc.Params.model_validate({"schema": CODE_ONE_OF, "coerce_one_of": True}))
    assert plain != coerced and hash(plain) != hash(coerced) and plain.text == coerced.text
    backend = get_backend("llguidance", _tiny(), TINY_VOCAB, (EOS,), BACKEND_LOADERS)
    backend.compile(coerced)
    with pytest.raises(ConstraintError, match="coerce_one_of"):
        backend.compile(plain)


def test_a_backend_that_cannot_honour_a_json_option_refuses_it_by_name():
    from decodekit.api.constraints import ConstraintBackend, JsonOptions

    llguidance_cls = backend_class("llguidance", BACKEND_LOADERS)

    class Plain(llguidance_cls):  # a backend that declares no JSON options
        name = "plain"
        json_options = ConstraintBackend.json_options

    backends = {**BACKEND_LOADERS, "plain": lambda: Plain}
    for with_engine in (False, True):
        proc = JsonSchemaProcessor()
        proc._available = backends
        if with_engine:
            proc.setup(ComponentInfo(tokenizer=_tiny(), vocab_size=TINY_VOCAB, eos_token_ids=(EOS,)))
        proc.check_options(proc.Params.model_validate({"schema": {"type": "object"}, "backend": "plain"}))
        with pytest.raises(ConstraintError, match=re.escape(
                "the plain backend cannot honour the JSON option lenient: true, key_separator: \":\" (the "
                "llguidance backend does)")):
            proc.check_options(proc.Params.model_validate({"schema": {"type": "object"}, "backend": "plain",
                                                           "lenient": True, "key_separator": ":"}))
    assert set(JsonOptions.model_fields) == set(llguidance_cls.json_options)


@pytest.mark.skipif(not _has_xgrammar(), reason="xgrammar is not installed")
def test_xgrammar_refuses_the_json_options_it_cannot_honour():
    proc, _ = _processor(JsonSchemaProcessor, schema={"type": "object"})
    with pytest.raises(ConstraintError, match="the xgrammar backend cannot honour the JSON option coerce_one_of"):
        proc.check_options(proc.Params.model_validate({"schema": CODE_ONE_OF, "backend": "xgrammar",
                                                       "coerce_one_of": True}))


# ---- the additionalProperties policy never forbids a key the schema requires ---------------------------------------
@pytest.mark.parametrize("schema", [
    # `required` names a key `properties` does not list (JSONSchemaBench Github_medium/o78017)
    {"type": "object", "properties": {"user": {"type": "string"}}, "required": ["user", "password_again"]},
    # a definition used as a part of `allOf`, beside a part with keys of its own
    {"definitions": {"base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
     "type": "object", "properties": {"item": {"allOf": [{"$ref": "#/definitions/base"}, {
         "properties": {"name": {"type": "string"}}, "required": ["name"]}]}}, "required": ["item"]},
    # a `$ref` with constraining siblings, and a parent whose `allOf` part names a key
    {"definitions": {"base": {"type": "object", "properties": {"id": {"type": "integer"}}}},
     "type": "object", "properties": {"item": {"$ref": "#/definitions/base", "required": ["extra"]}},
     "allOf": [{"required": ["item", "kind"], "properties": {"kind": {"const": "k"}}}]},
    # `anyOf` parts inside an `allOf` part
    {"definitions": {"b": {"type": "object", "allOf": [
        {"properties": {"schema": {"type": "string"}}, "required": ["schema"]},
        {"anyOf": [{"properties": {"impl": {"type": "string"}}, "required": ["impl"]},
                   {"properties": {"cls": {"type": "string"}}, "required": ["cls"]}]}]}},
     "type": "object", "properties": {"builder": {"$ref": "#/definitions/b"}}, "required": ["builder"]},
])
def test_the_strict_policy_keeps_every_key_the_schema_requires_or_combines(schema):
    import llguidance

    raw = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
    assert not llguidance.LLMatcher.validate_grammar(raw, None)  # llguidance compiles it as given
    Components(REGISTRY).resolve(SamplingParams(processors=[{"json_schema": {"schema": schema}}]))
    closed = forbid_additional_properties(schema)
    assert closed["additionalProperties"] is False  # the root is still closed
    assert schema != closed and forbid_additional_properties(json.loads(json.dumps(schema))) == closed


def test_a_closed_object_keeps_its_required_keys_as_any_value():
    closed = forbid_additional_properties({"type": "object", "properties": {"a": {"type": "integer"}},
                                           "required": ["a", "b"]})
    assert closed["properties"] == {"a": {"type": "integer"}, "b": {}}
    assert closed["additionalProperties"] is False
