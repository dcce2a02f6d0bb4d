"""Incremental detokenization through the Rust tokenizer, and requests whose caller reads only the final output."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from decodekit import LLM, SamplingParams
from decodekit.core.detokenizer import IncrementalDetokenizer, rust_decoder
from decodekit.models.tiny import tiny_model, tiny_tokenizer

_TOKENIZER = tiny_tokenizer()


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, len(_TOKENIZER) - 1), max_size=40), skip=st.booleans())
def test_the_rust_decoder_gives_transformers_text_token_by_token(ids, skip):
    assert rust_decoder(_TOKENIZER) is not None
    fast = IncrementalDetokenizer(_TOKENIZER, skip)
    slow = IncrementalDetokenizer(_TOKENIZER, skip)
    slow._backend = None  # transformers' own decode
    for token in ids:
        assert fast.add([token]) == slow.add([token])
    assert fast.flush() == slow.flush()
    assert fast.text == slow.text == _TOKENIZER.decode(ids, skip_special_tokens=skip)


def test_a_tokenizer_that_cleans_up_spaces_or_decodes_its_own_way_keeps_its_decode():
    cleaning = copy.deepcopy(_TOKENIZER)
    cleaning.clean_up_tokenization_spaces = True
    assert rust_decoder(cleaning) is None

    class Shouting(type(_TOKENIZER)):
        def decode(self, *args, **kwargs):
            return super().decode(*args, **kwargs).upper()

    shouting = copy.deepcopy(_TOKENIZER)
    shouting.__class__ = Shouting
    assert rust_decoder(shouting) is None
    detok = IncrementalDetokenizer(shouting)
    detok.add(_TOKENIZER("hello there").input_ids)
    assert detok.text == detok.text.upper() and detok.text.strip()


def test_generate_builds_only_final_outputs_and_a_streaming_caller_still_gets_deltas():
    llm = LLM(tiny_model("llama"), _TOKENIZER, kv_cache_memory="16MiB", block_size=4)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    seen = []
    streamed = llm.generate(prompts, params, on_output=seen.append)
    assert sum(not out.finished for out in seen) >= 2 * 7  # a delta every step for each request
    quiet = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in quiet] == [o.outputs[0].token_ids for o in streamed]
    assert [o.outputs[0].text for o in quiet] == [o.outputs[0].text for o in streamed]
    engine = llm.engine
    engine.add_request([5, 6, 7, 8], params, request_id="quiet", final_only=True)
    engine.add_request([9, 10, 11], params, request_id="loud")
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert [o.finished for o in outs if o.request_id == "quiet"] == [True]
    assert len([o for o in outs if o.request_id == "loud"]) >= 8
    quiet_final = next(o for o in outs if o.request_id == "quiet")
    assert quiet_final.outputs[0].token_ids == quiet[0].outputs[0].token_ids
    assert quiet_final.outputs[0].text == quiet[0].outputs[0].text
