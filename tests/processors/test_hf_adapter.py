"""The transformers adapter (`hf_logits_processor`, `hf_processor`): transformers' processors run through it give
exactly decodekit's native logits, mixed batches decode as transformers' `generate` does (speculation and beam
search included), parameters derived from constructors catch typos, it passes the conformance kit, and every Python
block of docs/transformers-processors.md runs."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as hf
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import decodekit
from decodekit import BatchView, SamplingParams, hf_logits_processor, hf_processor, hookimpl
from decodekit.api.components import ComponentInfo
from decodekit.api.errors import RecipeError
from decodekit.api.processors import apply_processors as run_pipelines
from decodekit.core.plan import Components
from decodekit.core.registry import Registry
from decodekit.recipe import describe_recipe, recipe_from_data
from decodekit.testing import (
    TINY_EOS_TOKEN_ID,
    check_processor,
    histories,
    logits_tensors,
    plugin_manager,
    tiny_llm,
    tiny_model,
    tiny_tokenizer,
)
from decodekit_plugins.hf_processors import HFLogitsProcessor
from tests.helpers.reference import random_prompts

DOC = Path(__file__).resolve().parents[2] / "docs" / "transformers-processors.md"


class CountingBoost:
    """A stateful processor in logits-processor-zoo's manner: it counts its calls (starting again when a call is not
    one token longer than the last) and adds `step` per call so far to one token's logit."""

    def __init__(self, token_id: int, step: float = 2.0):
        self.token_id, self.step = token_id, step
        self.length: int | None = None
        self.count = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.length is None or input_ids.shape[1] != self.length + 1:
            self.count = 0
        self.length = input_ids.shape[1]
        scores[:, self.token_id] += self.step * self.count
        self.count += 1
        return scores


class Recorder:
    """A pure processor that records the shape of every `input_ids` it is given, and writes into `scores` (bans
    token 0) as transformers processors may."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls.append(tuple(input_ids.shape))
        scores[:, 0] = -float("inf")
        return scores


class HFPlugin:
    """Registers transformers classes the way docs/transformers-processors.md teaches."""

    @hookimpl
    def decodekit_register_processors(self, register):
        register("no_repeat_ngram_hf", hf_processor(hf.NoRepeatNGramLogitsProcessor, name="no_repeat_ngram_hf"))
        register("min_length_hf", hf_processor(hf.MinLengthLogitsProcessor, name="min_length_hf"))
        register("counting_boost", hf_processor(CountingBoost, name="counting_boost", per_request=True))


PLUGIN = HFPlugin()
REGISTRY = Registry.from_plugin_manager(plugin_manager(PLUGIN))
COMPONENTS = Components(REGISTRY, ComponentInfo(tiny_tokenizer(), 0, (TINY_EOS_TOKEN_ID,), "cpu", "tiny"))


def _process(logits: torch.Tensor, params: SamplingParams, rows: list[list[int]], prompt_lens: list[int]):
    """Run a request's pipeline on rows as the engine's sampler step does (one shared set of components, so that
    hypothesis examples do not each build a registry)."""
    plan = COMPONENTS.resolve(params)
    batch = BatchView([params] * len(rows), [list(h) for h in rows], prompt_lens, (TINY_EOS_TOKEN_ID,))
    return run_pipelines(logits, batch, [plan.stages] * len(rows))


@pytest.fixture(scope="module")
def hf_model():
    """The tiny model `tiny_llm()` runs (same architecture and seed), for transformers' `generate`."""
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llm():
    return tiny_llm(PLUGIN, kv_cache_memory="16MiB", block_size=4)


def _hf_greedy(model, prompt: list[int], max_new_tokens: int, processors: list[Any]) -> list[int]:
    """transformers' greedy continuation with `logits_processor=processors`, cut after EOS like decodekit's."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                         logits_processor=hf.LogitsProcessorList(processors))
    ids = out[0, len(prompt):].tolist()
    return ids[: ids.index(TINY_EOS_TOKEN_ID) + 1] if TINY_EOS_TOKEN_ID in ids else ids


# ---- the same logits as decodekit's native processors --------------------------------------------------------
NATIVE = {
    "repetition_penalty": (lambda: hf.RepetitionPenaltyLogitsProcessor(1.3),
                           SamplingParams(processors=[{"repetition_penalty": {"penalty": 1.3}}])),
    "no_repeat_ngram_2": (lambda: hf.NoRepeatNGramLogitsProcessor(2),
                          SamplingParams(processors=[{"no_repeat_ngram": {"ngram_size": 2}}])),
    "no_repeat_ngram_3": (lambda: hf.NoRepeatNGramLogitsProcessor(3),
                          SamplingParams(processors=[{"no_repeat_ngram": {"ngram_size": 3}}])),
    "top_k": (lambda: hf.TopKLogitsWarper(5), SamplingParams(top_k=5)),
    "temperature": (lambda: hf.TemperatureLogitsWarper(0.7), SamplingParams(temperature=0.7)),
    "min_p": (lambda: hf.MinPLogitsWarper(0.1), SamplingParams(min_p=0.1)),
}


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_transformers_processors_through_hf_logits_processor_give_exactly_the_native_logits(name):
    make, native = NATIVE[name]
    adapted = SamplingParams(processors=[hf_logits_processor(make())])

    @settings(max_examples=30, deadline=None, database=None)
    @given(data=st.data())
    def check(data):
        vocab, rows = data.draw(st.integers(2, 40)), data.draw(st.integers(1, 6))
        logits = data.draw(logits_tensors(rows, vocab))  # ties, -inf entries
        rows_ids = [data.draw(histories(vocab, min_size=1)) for _ in range(rows)]  # repeats; lengths differ
        prompt_lens = [data.draw(st.integers(1, len(h))) for h in rows_ids]
        ours = _process(logits, adapted, rows_ids, prompt_lens)
        theirs = _process(logits, native, rows_ids, prompt_lens)
        assert torch.equal(ours, theirs)

    check()


def test_the_class_form_gives_the_same_logits_as_the_instance_form():
    logits = torch.randn(3, 30)
    rows = [[1, 2, 1, 2, 3], [4, 4, 4], [5, 6, 5]]
    by_class = _process(logits, SamplingParams(processors=[{"no_repeat_ngram_hf": {"ngram_size": 2}}]), rows,
                        [1, 1, 1])
    by_instance = _process(logits, SamplingParams(processors=[hf_logits_processor(
        hf.NoRepeatNGramLogitsProcessor(2))]), rows, [1, 1, 1])
    assert torch.equal(by_class, by_instance) and bool(by_class.isinf().any())


# ---- batching, copies, masks ------------------------------------------------------------------------------------
def test_rows_sharing_an_instance_and_a_history_length_go_in_one_call_and_equal_row_by_row():
    shared, other = Recorder(), Recorder()
    options = [HFLogitsProcessor.Params(processor=p) for p in (shared, shared, other, shared, shared)]
    rows = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 2, 3, 4], []]
    logits = torch.randn(5, 12)
    batch = BatchView([SamplingParams()] * 5, rows, [1, 1, 1, 1, 0], options=options)
    out = HFLogitsProcessor()(logits, batch)
    assert sorted(shared.calls) == [(1, 0), (1, 4), (2, 3)] and other.calls == [(1, 3)]
    one_by_one = torch.cat([HFLogitsProcessor()(logits[r : r + 1], batch.select([r])) for r in range(5)])
    assert torch.equal(out, one_by_one)


def test_the_adapter_never_writes_into_the_engines_logits_and_keeps_their_masks():
    def unmask(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores.zero_()  # writes in place and would bring every removed token back
        return scores

    logits = torch.tensor([[1.0, -float("inf"), 3.0], [-float("inf"), 2.0, 0.5]])
    pristine = logits.clone()
    batch = BatchView([SamplingParams()] * 2, [[1], [2]], [1, 1], options=[HFLogitsProcessor.Params(
        processor=unmask)] * 2)
    out = HFLogitsProcessor()(logits, batch)
    assert torch.equal(logits, pristine)
    assert out.tolist() == [[0.0, -float("inf"), 0.0], [-float("inf"), 0.0, 0.0]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_scores_reach_the_processor_in_float32_or_float64_and_come_back_in_the_logits_dtype(dtype):
    seen: list[torch.dtype] = []

    def record(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        seen.append(scores.dtype)
        assert input_ids.dtype == torch.long
        return scores

    batch = BatchView([SamplingParams()], [[1, 2]], [1], options=[HFLogitsProcessor.Params(processor=record)])
    out = HFLogitsProcessor()(torch.zeros(1, 4, dtype=dtype), batch)
    assert out.dtype == dtype and seen == [torch.float64 if dtype == torch.float64 else torch.float32]


# ---- the conformance kit -----------------------------------------------------------------------------------------
def test_hf_logits_processor_passes_the_conformance_kit():
    instances = [hf.RepetitionPenaltyLogitsProcessor(1.3), hf.NoRepeatNGramLogitsProcessor(2),
                 hf.TopKLogitsWarper(3), hf.TemperatureLogitsWarper(0.7), hf.MinPLogitsWarper(0.2),
                 hf.LogitsProcessorList([hf.NoRepeatNGramLogitsProcessor(1), hf.TopKLogitsWarper(2)])]
    options = st.builds(HFLogitsProcessor.Params, processor=st.sampled_from(instances))
    check_processor(HFLogitsProcessor(), options, max_examples=40, derandomize=True)


@pytest.mark.parametrize(("cls", "options"), [
    (hf.NoRepeatNGramLogitsProcessor, st.fixed_dictionaries({"ngram_size": st.integers(1, 4)})),
    (hf.RepetitionPenaltyLogitsProcessor, st.fixed_dictionaries({"penalty": st.floats(0.5, 2.0)})),
    (hf.MinLengthLogitsProcessor, st.fixed_dictionaries({"min_length": st.integers(0, 30)})),  # EOS from the case
    (hf.TopKLogitsWarper, st.fixed_dictionaries({"top_k": st.integers(1, 10)})),
], ids=["no_repeat_ngram", "repetition_penalty", "min_length", "top_k"])
def test_processors_made_by_hf_processor_pass_the_conformance_kit(cls, options):
    check_processor(hf_processor(cls)(), options, max_examples=30, derandomize=True)


# ---- end to end: mixed batches against transformers' generate ------------------------------------------------
def test_a_mixed_batch_decodes_adapter_requests_as_transformers_generate_and_the_others_as_alone(llm, hf_model):
    prompts = random_prompts(6, 3, 12, seed=31)
    ngram = hf.NoRepeatNGramLogitsProcessor(2)  # one instance shared by two requests
    with_ngram = SamplingParams(temperature=0, max_tokens=12, processors=[
        hf_logits_processor(ngram), hf_logits_processor(hf.RepetitionPenaltyLogitsProcessor(1.3))])
    by_class = SamplingParams(temperature=0, max_tokens=12, processors=[{"no_repeat_ngram_hf": {"ngram_size": 2}},
                                                                         {"min_length_hf": {"min_length": 10}}])
    plain = SamplingParams(temperature=0, max_tokens=12)
    native = SamplingParams(temperature=0, max_tokens=12, processors=[{"repetition_penalty": {"penalty": 1.3}}])
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=12)
    params = [with_ngram, plain, by_class, native, with_ngram, sampled]
    outs = llm.generate(prompts, params)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    for i in (0, 4):
        want = _hf_greedy(hf_model, prompts[i], 12, [hf.NoRepeatNGramLogitsProcessor(2),
                                                     hf.RepetitionPenaltyLogitsProcessor(1.3)])
        assert outs[i].outputs[0].token_ids == want
    want = _hf_greedy(hf_model, prompts[2], 12, [hf.NoRepeatNGramLogitsProcessor(2),
                                                 hf.MinLengthLogitsProcessor(10, TINY_EOS_TOKEN_ID)])
    assert outs[2].outputs[0].token_ids == want
    for i in (1, 3, 5):
        alone = llm.generate([prompts[i]], params[i])[0]
        assert outs[i].outputs[0].token_ids == alone.outputs[0].token_ids
    assert outs[1].outputs[0].token_ids == _hf_greedy(hf_model, prompts[1], 12, [])


def test_speculative_rows_through_the_adapter_give_the_tokens_of_plain_decoding(llm):
    prompts = [(p * 4)[:30] for p in random_prompts(2, 4, 9, seed=32)]  # repeated phrases: n-gram drafts match
    processors = [hf_logits_processor(hf.RepetitionPenaltyLogitsProcessor(1.1)),
                  hf_logits_processor(hf.NoRepeatNGramLogitsProcessor(6))]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, processors=processors)
    spec = plain.model_copy(update={"strategy": {"speculative": {"proposer": "ngram", "num_speculative_tokens": 4}}})
    native = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, processors=[
        {"repetition_penalty": {"penalty": 1.1}}, {"no_repeat_ngram": {"ngram_size": 6}}])
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    got = llm.generate(prompts, spec)
    assert [o.outputs[0].token_ids for o in got] == want
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, native)] == want
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0  # drafts were verified through the adapter


def test_beam_search_rows_through_the_adapter_match_transformers_beam_search(llm, hf_model):
    prompts = random_prompts(2, 3, 16, seed=33)
    params = SamplingParams(max_tokens=8, temperature=0, processors=[
        hf_logits_processor(hf.RepetitionPenaltyLogitsProcessor(1.5))],
        strategy={"beam_search": {"num_beams": 3, "num_return_sequences": 2}})
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, num_beams=3,
                                num_return_sequences=2, output_scores=True, return_dict_in_generate=True,
                                pad_token_id=0, logits_processor=hf.LogitsProcessorList([
                                    hf.RepetitionPenaltyLogitsProcessor(1.5)]))
        want = []
        for row in ref.sequences[:, len(prompt):].tolist():
            want.append(row[: row.index(TINY_EOS_TOKEN_ID) + 1] if TINY_EOS_TOKEN_ID in row else row)
        assert [o.token_ids for o in out.outputs] == want
        assert [o.score for o in out.outputs] == pytest.approx(ref.sequences_scores.tolist(), abs=1e-4)


# ---- state ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["instance", "class"])
def test_stateful_processors_get_one_instance_per_request_and_decode_as_transformers(llm, hf_model, form):
    prompts = random_prompts(3, 3, 12, seed=34)
    entry = (hf_logits_processor(CountingBoost(7), per_request=True) if form == "instance"
             else {"counting_boost": {"token_id": 7}})
    params = SamplingParams(temperature=0, max_tokens=10, processors=[entry])
    outs = llm.generate(prompts, params)  # one SamplingParams for all three: the copies are per request
    for prompt, out in zip(prompts, outs):
        want = _hf_greedy(hf_model, prompt, 10, [CountingBoost(7)])  # a fresh instance, as its docs ask
        assert out.outputs[0].token_ids == want and 7 in want


# ---- parameters, errors --------------------------------------------------------------------------------------
def test_params_are_derived_from_the_constructor_signature():
    params = hf_processor(hf.MinLengthLogitsProcessor).Params
    fields = params.model_fields
    assert list(fields) == ["min_length", "eos_token_id"]  # `device` is the engine's
    assert fields["min_length"].is_required() and fields["min_length"].annotation is int
    assert not fields["eos_token_id"].is_required()  # the model's EOS ids by default
    assert "minimum length" in (fields["min_length"].description or "")  # from the docstring's Args:
    top_k = hf_processor(hf.TopKLogitsWarper).Params
    assert top_k(top_k=3).filter_value == -float("inf") and top_k(top_k=3).min_tokens_to_keep == 1
    with pytest.raises(ValueError, match="top_kk"):
        top_k(top_k=3, top_kk=4)

    class Untyped:
        def __init__(self, strength, tokenizer, *args, device="cpu", flag: bool = False, **kwargs):
            self.tokenizer = tokenizer

    untyped = hf_processor(Untyped).Params
    assert list(untyped.model_fields) == ["strength", "flag"]
    assert untyped(strength=object()).flag is False  # no annotation: anything goes


def test_hf_processor_returns_one_class_per_registration_and_uses_the_engines_tokenizer():
    assert hf_processor(hf.NoRepeatNGramLogitsProcessor) is hf_processor(hf.NoRepeatNGramLogitsProcessor)
    assert hf_processor(hf.NoRepeatNGramLogitsProcessor).name == "hf:NoRepeatNGramLogitsProcessor"

    class NeedsTokenizer:
        def __init__(self, tokenizer, text: str):
            self.token = tokenizer.encode(text, add_special_tokens=False)[-1]

        def __call__(self, input_ids, scores):
            scores[:, self.token] = -float("inf")
            return scores

    proc = hf_processor(NeedsTokenizer)()
    options = proc.Params(text="Paris")
    proc.check_options(options)  # no engine, no tokenizer: nothing to build yet, no error either
    proc.setup(ComponentInfo(tiny_tokenizer(), 384, (2,), "cpu", "tiny"))
    token = tiny_tokenizer().encode("Paris", add_special_tokens=False)[-1]
    batch = BatchView([SamplingParams()], [[1]], [1], options=[options])
    assert proc(torch.zeros(1, 384), batch)[0, token] == -float("inf")


def test_a_typo_in_a_recipe_parameter_of_a_registered_class_is_an_error_naming_the_key():
    data = yaml.safe_load("model: m\nprocessors:\n  - no_repeat_ngram_hf: {ngram_sise: 2}\n")
    with pytest.raises(RecipeError) as info:
        recipe_from_data(data, registry=REGISTRY)
    assert ("processors[0].no_repeat_ngram_hf.ngram_sise: unknown key 'ngram_sise' (did you mean 'ngram_size'?); "
            "known keys: ngram_size") in str(info.value)


def test_a_value_the_constructor_refuses_fails_the_recipe_with_the_key_and_its_message():
    data = yaml.safe_load("model: m\nprocessors: [{no_repeat_ngram_hf: {ngram_size: 0}}]\n")
    with pytest.raises(RecipeError, match=r"processors\[0\]\.no_repeat_ngram_hf: NoRepeatNGramLogitsProcessor\("
                                          r"ngram_size=0\) failed: `ngram_size` has to be a strictly positive"):
        recipe_from_data(data, registry=REGISTRY)


@pytest.mark.parametrize("spec", ["hf_logits_processor", "{hf_logits_processor: {processor: NoRepeat}}"])
def test_hf_logits_processor_in_a_recipe_says_a_recipe_cannot_give_an_instance(spec):
    with pytest.raises(RecipeError) as info:
        recipe_from_data(yaml.safe_load(f"model: m\nprocessors: [{spec}]\n"), registry=REGISTRY)
    message = str(info.value)
    assert "processors[0].hf_logits_processor" in message and "hf_processor" in message


def test_hf_logits_processor_refuses_a_class_or_something_not_callable():
    with pytest.raises(TypeError, match=r"NoRepeatNGramLogitsProcessor\(\.\.\.\)`, not the class"):
        hf_logits_processor(hf.NoRepeatNGramLogitsProcessor)
    with pytest.raises(TypeError, match="not a int"):
        hf_logits_processor(3)
    with pytest.raises(TypeError, match="takes a class"):
        hf_processor(hf.NoRepeatNGramLogitsProcessor(2))


def test_a_failing_transformers_processor_fails_only_its_request(llm):
    def broken(input_ids, scores):
        raise RuntimeError("boom")

    outs = llm.generate([[5, 6, 7], [8, 9, 10]], [
        SamplingParams(temperature=0, max_tokens=4, processors=[hf_logits_processor(broken)]),
        SamplingParams(temperature=0, max_tokens=4)])
    assert outs[0].finish_reason == "error" and "hf_logits_processor" in outs[0].error and "boom" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 4


def test_every_processor_schema_renders_for_decodekit_plugins():
    for entry in REGISTRY.processors.values():
        if entry.params_model is not None:
            entry.params_model.model_json_schema()
    assert "hf_logits_processor" in REGISTRY.processors


# ---- docs/transformers-processors.md ---------------------------------------------------------------------------
def _doc_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), re.S)


@pytest.fixture
def doc_plugin():
    """The page's plugin block, importable as the package it describes."""
    (code,) = [b for b in _doc_blocks("python") if "@hookimpl" in b]
    module = types.ModuleType("my_hf_processors")
    exec(compile(code, f"{DOC}:my_hf_processors", "exec"), module.__dict__)
    sys.modules["my_hf_processors"] = module
    yield module
    del sys.modules["my_hf_processors"]


def test_every_python_block_of_the_docs_page_runs(doc_plugin, monkeypatch):
    # `LLM()` on the page loads the bundled model: here, a tiny random one with the page's plugin installed
    monkeypatch.setattr(decodekit, "LLM", lambda *args, **kwargs: tiny_llm(doc_plugin))
    blocks = [b for b in _doc_blocks("python") if "@hookimpl" not in b]
    assert len(blocks) >= 4
    namespace: dict[str, Any] = {}
    for index, code in enumerate(blocks):  # one session, as a reader runs them
        exec(compile(code, f"{DOC}:block {index}", "exec"), namespace)
    assert all(o.error is None for o in namespace["outputs"])


def test_the_docs_recipe_loads_with_the_docs_plugin(doc_plugin):
    (recipe,) = _doc_blocks("yaml")
    registry = Registry.from_plugin_manager(plugin_manager(doc_plugin))
    loaded = recipe_from_data(yaml.safe_load(recipe), registry=registry)
    assert [s.name for s in loaded.processors] == ["no_repeat_ngram_hf", "min_length_hf"]
    plan = describe_recipe(loaded, registry)["plan"]["processors"]  # `decodekit recipe explain`
    assert plan[:2] == [{"no_repeat_ngram_hf": {"ngram_size": 3}},
                        {"min_length_hf": {"min_length": 20, "eos_token_id": None}}]
