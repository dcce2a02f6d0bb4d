"""Stopping (EOS, stop ids, max/min tokens, stop strings), seeds and per-request isolation in a shared batch."""

from __future__ import annotations

import pytest

from decodekit import LLM, SamplingParams
from tests.helpers.reference import random_prompts


@pytest.fixture(scope="module")
def llm(request):
    from decodekit.models.tiny import tiny_model, tiny_tokenizer

    return LLM(tiny_model("llama"), tiny_tokenizer(), dtype="float32", device="cpu", block_size=8)


def _free_run(llm: LLM, prompt: list[int], n: int = 40):
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]


def test_max_tokens_finishes_with_length(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_stop_string_spanning_tokens_is_found_and_trimmed(llm):
    prompt = random_prompts(1, 8, 9, seed=11)[0]
    free = _free_run(llm, prompt)
    text = free.text
    # pick a stop string that straddles a token boundary: the last 2 chars of token 3's text + first of token 4
    prefix = llm.tokenizer.decode(free.token_ids[:4])
    stop = text[len(prefix) - 2 : len(prefix) + 1]
    assert len(stop) == 3
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == text[: text.index(stop)]
    kept = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
                                                 include_stop_str_in_output=True))[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_end_the_request_and_min_tokens_suppresses_them(llm):
    prompt = random_prompts(1, 8, 9, seed=12)[0]
    free = _free_run(llm, prompt)
    stop_id = free.token_ids[2]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == free.token_ids[:3] and out.finish_reason == "stop"
    delayed = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id],
                                                    min_tokens=10))[0]
    assert len(delayed.token_ids) >= 10
    assert stop_id not in delayed.token_ids[:9]


def test_eos_stops_unless_ignored(llm):
    # find a prompt whose greedy continuation hits EOS (id 2) soon
    eos = llm.engine.eos_token_ids
    for prompt in random_prompts(40, 3, 30, seed=13):
        free = _free_run(llm, prompt, 60)
        hits = [i for i, t in enumerate(free.token_ids) if t in eos]
        if hits:
            out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60))[0]
            assert out.token_ids == free.token_ids[: hits[0] + 1] and out.finish_reason == "stop"
            return
    pytest.skip("no prompt reached EOS with this random model")


def test_seeded_sample_is_the_same_alone_and_in_a_batch(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, min_p=0.01, seed=1234, max_tokens=24,
                            ignore_eos=True)
    prompt = random_prompts(1, 12, 13, seed=14)[0]
    alone = llm.generate([prompt], params)[0].token_ids
    others = random_prompts(7, 3, 60, seed=15)
    batched = llm.generate([*others[:3], prompt, *others[3:]],
                           [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)] * 3 + [params]
                           + [SamplingParams(temperature=0, max_tokens=10)] * 4)[3].token_ids
    assert alone == batched
    assert llm.generate([prompt], params.model_copy(update={"seed": 99}))[0].token_ids != alone


def test_prompt_longer_than_context_fails_alone(llm):
    too_long = [5] * 600  # the tiny model's context is 512
    outs = llm.generate([[5, 6, 7], too_long, [8, 9]], SamplingParams(temperature=0, max_tokens=5))
    assert outs[1].finish_reason == "error" and "context" in (outs[1].error or "")
    assert [o.finish_reason for o in (outs[0], outs[2])] != ["error", "error"]
    assert outs[0].error is None and len(outs[0].token_ids) >= 1


def test_a_raising_processor_fails_only_its_request(llm):
    from decodekit.api.processors import LogitsProcessor
    from decodekit.core.registry import Entry

    class Exploding(LogitsProcessor):
        name = "exploding"

        def __call__(self, logits, batch):
            raise RuntimeError("boom")

    llm.engine.registry.processors["exploding"] = Entry("exploding", Exploding, False, "test")
    try:
        outs = llm.generate([[5, 6, 7], [8, 9, 10]],
                            [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                             SamplingParams(temperature=0, max_tokens=5, processors=["exploding"])])
    finally:
        del llm.engine.registry.processors["exploding"]
    assert outs[0].error is None and len(outs[0].token_ids) == 5
    assert outs[1].finish_reason == "error" and "boom" in (outs[1].error or "")
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks


def test_abort_finishes_with_abort_and_frees_blocks(llm):
    engine = llm.engine
    req = engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.abort(req.request_id)
    outs = engine.step()
    final = [o for o in outs if o.request_id == req.request_id]
    assert final and final[0].finished and final[0].finish_reason == "abort"
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


def test_streamed_deltas_concatenate_to_the_final_text_and_hold_back_stop_prefixes(llm):
    prompt = random_prompts(1, 8, 9, seed=16)[0]
    free = _free_run(llm, prompt)
    stop = free.text[10:13]
    deltas: list[str] = []
    finals = []

    def collect(out):
        deltas.append(out.delta_text[0])
        if out.finished:
            finals.append(out)

    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
                 on_output=collect)
    assert "".join(deltas) == finals[0].text == free.text[: free.text.index(stop)]
    assert all(stop not in d for d in deltas)


def test_invalid_sampling_params_are_refused_with_the_field_name():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)
