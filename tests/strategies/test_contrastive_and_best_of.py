"""Contrastive search and best-of-n, shipped as plugins through the public strategy hooks only.

Contrastive search is checked against a reference implementation of its published definition (Su et al. 2022)
written here on a plain transformers forward: every step recomputes the whole sequence and each candidate with the
untouched model (no KV cache, no decodekit), on tiny models under all three engine forwards, on the bundled model,
and batched with other requests. Best-of-n is checked against its definition: the `n` returned are the
highest-scoring of the `best_of` sequences, whose scores are their tokens' log-probabilities.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from decodekit import LLM, SamplingParams
from tests.helpers.reference import assert_idle, hf_greedy, random_prompts


@torch.no_grad()
def reference_contrastive(model, prompt: list[int], penalty_alpha: float, top_k: int, max_new: int,
                          eos: int | None) -> list[int]:
    """Su et al. 2022, eq. (1)-(2): among the top-k tokens of p(. | x<t), pick argmax of
    (1 - alpha) * p(v | x<t) - alpha * max_j cos(h_v, h_xj), h the model's last hidden states (after the final norm,
    what the LM head reads), j over every earlier token of the context, prompt included."""
    ids = list(prompt)
    base = model.base_model
    for _ in range(max_new):
        context = base(torch.tensor([ids])).last_hidden_state[0]  # [t, hidden]
        probs = torch.softmax(model.get_output_embeddings()(context[-1]).float(), dim=-1)
        top_probs, top_ids = torch.topk(probs, k=top_k)
        scores = []
        for p, token in zip(top_probs.tolist(), top_ids.tolist()):
            h = base(torch.tensor([[*ids, token]])).last_hidden_state[0, -1]
            penalty = torch.nn.functional.cosine_similarity(h[None], context, dim=-1).max().item()
            scores.append((1 - penalty_alpha) * p - penalty_alpha * penalty)
        ids.append(top_ids[max(range(len(scores)), key=scores.__getitem__)].item())
        if ids[-1] == eos:
            break
    return ids[len(prompt):]


def _contrastive(alpha: float, k: int, max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **extra,
                          strategy={"contrastive_search": {"penalty_alpha": alpha, "top_k": k}})


@pytest.fixture(params=["transformers", "native", "torch-ops"])
def engine_llm(request, model, tokenizer):
    """An engine on the tiny model under each forward: transformers modules, fused native, fused torch ops."""
    if request.param == "transformers":
        return LLM(model, tokenizer, dtype="float32", device="cpu", fused_decoder=False, block_size=8,
                   max_num_batched_tokens=64)
    return LLM(copy.deepcopy(model), tokenizer, dtype="float32", device="cpu", fused_decoder=True,
               native_kernels=request.param == "native", block_size=8, max_num_batched_tokens=64)


@pytest.mark.parametrize(("alpha", "k"), [(0.6, 4), (0.3, 6), (0.0, 3), (1.0, 2)])
def test_contrastive_search_equals_the_published_definition_on_tiny_models(request, engine_llm, model, alpha, k):
    forward = request.node.callspec.params["engine_llm"]
    if (alpha, k) != (0.6, 4) and forward != "native" and "slow" not in request.config.getoption("-m"):
        pytest.skip("the other (alpha, k) pairs run on every forward with -m slow; here on the native one")
    prompts = random_prompts(3, 4, 30, seed=7)
    eos = model.generation_config.eos_token_id
    outs = engine_llm.generate(prompts, _contrastive(alpha, k, 12))
    for prompt, out in zip(prompts, outs):
        assert out.error is None
        assert out.token_ids == reference_contrastive(model, prompt, alpha, k, 12, eos)
    assert_idle(engine_llm)


def test_contrastive_search_batched_with_other_strategies_equals_it_alone(llama, tokenizer):
    llm = LLM(llama, tokenizer, dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=48)
    prompts = random_prompts(6, 5, 40, seed=3)
    contrastive = _contrastive(0.6, 4, 10)
    alone = [o.token_ids for o in llm.generate(prompts[:2], contrastive)]
    mixed = llm.generate(prompts, [contrastive, contrastive, SamplingParams(temperature=0, max_tokens=10),
                                   SamplingParams(temperature=0, max_tokens=10,
                                                  strategy={"beam_search": {"num_beams": 3}}),
                                   SamplingParams(temperature=0.8, seed=5, max_tokens=10, n=2),
                                   SamplingParams(temperature=0, max_tokens=10,
                                                  strategy={"speculative": {"num_speculative_tokens": 3}})])
    assert [o.token_ids for o in mixed[:2]] == alone
    assert mixed[2].token_ids == hf_greedy(llama, prompts[2], 10)
    assert mixed[5].token_ids == hf_greedy(llama, prompts[5], 10)
    eos = llama.generation_config.eos_token_id
    assert alone[0] == reference_contrastive(llama, prompts[0], 0.6, 4, 10, eos)
    assert_idle(llm)


def test_contrastive_search_is_exact_under_preemption_and_chunked_prefill(llama, tokenizer):
    # 30 blocks of 4 tokens for 6 requests of up to 40 + 16 tokens each, 4 candidates each: they must be preempted
    # and recomputed (the hidden states start over), and prompts are prefilled in 16-token chunks
    llm = LLM(llama, tokenizer, dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16,
              kv_cache_memory=30 * 4 * 2 * 2 * 2 * 16 * 4)
    prompts = random_prompts(6, 20, 40, seed=11)
    outs = llm.generate(prompts, _contrastive(0.5, 4, 16))
    eos = llama.generation_config.eos_token_id
    for prompt, out in zip(prompts, outs):
        assert out.error is None and out.token_ids == reference_contrastive(llama, prompt, 0.5, 4, 16, eos)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_idle(llm)


def test_contrastive_search_candidates_keep_a_constraint_and_logprobs_read_the_row_they_came_from(llama, tokenizer):
    llm = LLM(llama, tokenizer, dtype="float32", device="cpu")
    prompt = random_prompts(1, 8, 9, seed=4)[0]
    banned = set(range(3, 200))
    out = llm.generate([prompt], _contrastive(0.9, 8, 8, logprobs=2, trace=3,
                                              processors=[{"logit_bias": {"bias": {str(t): -100 for t in
                                                                                   banned}}}]))[0]
    assert out.error is None, out.error
    assert out.token_ids and not banned & set(out.token_ids)
    choice = out.outputs[0]
    # each token's (raw) logprob is read from the row it was chosen from: the position before it, a step earlier
    with torch.no_grad():
        logits = llama(torch.tensor([prompt + out.token_ids])).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    assert len(choice.logprobs) == len(out.token_ids)
    for i, token in enumerate(out.token_ids):
        assert math.isclose(choice.logprobs[i][token].logprob, expected[i, token].item(), abs_tol=1e-4)
    events = [e for e in choice.trace if "token" in e]
    assert [e["token"] for e in events] == out.token_ids
    assert all(e["strategy"] == "contrastive_search" and e["stages"] for e in events)
    assert_idle(llm)


@pytest.mark.slow
def test_contrastive_search_on_the_bundled_model_equals_the_published_definition():
    llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu")
    pristine = __import__("decodekit.models", fromlist=["load_model"]).load_model(
        "smollm2-135m-instruct", dtype="float32", device="cpu").model
    prompts = [llm.apply_chat_template([{"role": "user", "content": f"Write one sentence about {t}."}])
               for t in ("the sea", "owls")]
    ids = [llm.engine.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    outs = llm.generate(ids + ids[:1], [_contrastive(0.6, 4, 8), _contrastive(0.6, 4, 8),
                                        SamplingParams(temperature=0, max_tokens=8)])
    eos = llm.engine.eos_token_ids[0]
    for prompt, out in zip(ids, outs):
        assert out.token_ids == reference_contrastive(pristine, prompt, 0.6, 4, 8, eos)


def test_contrastive_search_refuses_n_above_one_naming_the_key(llama, tokenizer):
    llm = LLM(llama, tokenizer, dtype="float32", device="cpu")
    out = llm.generate([[5, 6, 7]], _contrastive(0.6, 4, 4, n=2))[0]
    assert out.error is not None and "n must be 1" in out.error
    bad = llm.generate([[5, 6, 7]], SamplingParams(strategy={"contrastive_search": {"penalty_alfa": 0.5}}))[0]
    assert bad.error is not None and "penalty_alfa" in bad.error and "penalty_alpha" in bad.error


# ---- best-of-n -------------------------------------------------------------------------------------------------
def test_best_of_returns_the_n_highest_scoring_samples_best_first_with_their_logprobs(llama, tokenizer):
    llm = LLM(llama, tokenizer, dtype="float32", device="cpu")
    prompt = random_prompts(1, 6, 7, seed=9)[0]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, n=2, logprobs=0, logprobs_mode="processed",
                            strategy={"best_of": {"best_of": 5}})
    out = llm.generate([prompt], params)[0]
    assert out.error is None and len(out.outputs) == 2
    scores = [c.score for c in out.outputs]
    assert scores == sorted(scores, reverse=True)
    for choice in out.outputs:  # the score is the sum of the tokens' logprobs under the sampled distribution
        assert math.isclose(choice.score, choice.cumulative_logprob, rel_tol=1e-5, abs_tol=1e-5)
    # the other three samples: the same five seeded samples come out of plain parallel sampling with n=5
    everything = llm.generate([prompt], SamplingParams(temperature=1.0, seed=3, max_tokens=6, n=5, logprobs=0,
                                                       strategy={"best_of": {"best_of": 5}}))[0]
    all_scores = sorted((c.score for c in everything.outputs), reverse=True)
    assert [pytest.approx(s) for s in all_scores[:2]] == scores
    assert llm.generate([prompt], params)[0].token_ids == out.token_ids  # seeded: same again
    assert_idle(llm)


def test_best_of_streams_only_its_final_output_and_keeps_stop_strings(llama, tokenizer):
    llm = LLM(llama, tokenizer, dtype="float32", device="cpu")
    engine = llm.engine
    request = engine.add_request([5, 6, 7, 8], SamplingParams(temperature=1.0, seed=1, max_tokens=5, n=1,
                                                              strategy={"best_of": {"best_of": 3}}))
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert [o.finished for o in outputs] == [True]
    assert len(outputs[0].outputs) == 1 and request.finished


def test_best_of_below_n_is_refused_naming_both(llama, tokenizer):
    llm = LLM(llama, tokenizer, dtype="float32", device="cpu")
    out = llm.generate([[5, 6]], SamplingParams(n=3, strategy={"best_of": {"best_of": 2}}))[0]
    assert out.error is not None and "best_of (2) must be >= n (3)" in out.error
