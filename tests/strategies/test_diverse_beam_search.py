"""Diverse (group) beam search: the same hypotheses and scores as a reference written here from the published
definition (Vijayakumar et al. 2016) with the rules of transformers' group beam search (`BeamSearchScorer` and
`BeamHypotheses`, before it left transformers' core), on a plain transformers forward without a KV cache."""

from __future__ import annotations

import re

import pytest
import torch

from decodekit import LLM, SamplingParams
from tests.helpers.reference import random_prompts


class Hypotheses:
    """transformers' `BeamHypotheses`: the `n` best finished hypotheses of one group."""

    def __init__(self, n, length_penalty, early_stopping, max_new_tokens):
        self.n, self.lp, self.early, self.max_new = n, length_penalty, early_stopping, max_new_tokens
        self.beams = []  # (score, generated tokens)
        self.worst = 1e9

    def add(self, tokens, sum_logprobs, generated_len):
        score = sum_logprobs / generated_len**self.lp
        if len(self.beams) < self.n or score > self.worst:
            self.beams.append((score, tokens))
            if len(self.beams) > self.n:
                ranked = sorted((s, i) for i, (s, _) in enumerate(self.beams))
                del self.beams[ranked[0][1]]
                self.worst = ranked[1][0]
            else:
                self.worst = min(score, self.worst)

    def is_done(self, best_sum_logprobs, generated_len):
        if len(self.beams) < self.n:
            return False
        if self.early is True:
            return True
        length = self.max_new if self.early == "never" and self.lp > 0 else generated_len
        return self.worst >= best_sum_logprobs / length**self.lp


@torch.no_grad()
def reference(model, prompt, max_new, num_beams, groups, penalty, lp, early, num_return, eos):
    """Diverse beam search on full recomputes: per step, group after group, log-softmax minus `penalty` per beam
    of an earlier group that chose the token this step, then `BeamSearchScorer.process` for the group alone;
    `finalize` at the end. Returns the best `num_return` (generated tokens, score), best first."""
    size = num_beams // groups
    hyps = [Hypotheses(size, lp, early, max_new) for _ in range(groups)]
    done = [False] * groups
    beams = [[([], 0.0)] + [([], -1e9)] * (size - 1) for _ in range(groups)]  # transformers' initial beams
    for step in range(max_new):
        chosen = []  # the new beams' tokens of this step, groups so far
        for g in range(groups):
            if done[g]:
                continue
            logits = model(torch.tensor([prompt + tokens for tokens, _ in beams[g]])).logits[:, -1].float()
            logp = logits.log_softmax(-1)
            vocab = logp.shape[-1]
            logp = logp - penalty * torch.bincount(torch.tensor(chosen, dtype=torch.long), minlength=vocab)
            scores = logp + torch.tensor([s for _, s in beams[g]])[:, None]
            top, index = scores.view(-1).topk(max(2, 1 + len(eos)) * size)
            new = []
            for rank, (score, i) in enumerate(zip(top.tolist(), index.tolist())):
                parent, token = divmod(i, vocab)
                if token in eos:
                    if rank < size:
                        hyps[g].add(beams[g][parent][0] + [token], score, step + 1)
                else:
                    new.append((beams[g][parent][0] + [token], score))
                if len(new) == size:
                    break
            beams[g] = new
            chosen += [tokens[-1] for tokens, _ in new]
            done[g] = hyps[g].is_done(top.max().item(), step + 1)
        if all(done):
            break
    for g in range(groups):  # finalize
        if not done[g]:
            for tokens, score in beams[g]:
                hyps[g].add(tokens, score, len(tokens))
    ranked = sorted((h for group in hyps for h in group.beams), key=lambda h: h[0])
    best = [ranked.pop() for _ in range(num_return)]
    return [tokens for _, tokens in best], [score for score, _ in best]


def _diverse(num_beams=4, groups=2, penalty=0.5, length_penalty=1.0, early_stopping=False, num_return=2,
             max_tokens=8, **extra):
    return SamplingParams(max_tokens=max_tokens, temperature=0, **extra, strategy={"diverse_beam_search": {
        "num_beams": num_beams, "num_beam_groups": groups, "diversity_penalty": penalty,
        "length_penalty": length_penalty, "early_stopping": early_stopping, "num_return_sequences": num_return}})


@pytest.fixture
def frequent_eos(llama):
    """A frequent token as EOS, so hypotheses finish at different lengths and groups finish at different steps."""
    llama.generation_config.eos_token_id = 5
    yield llama
    llama.generation_config.eos_token_id = 2


COMBOS = [  # num_beams, groups, penalty, length_penalty, early_stopping, num_return
    (4, 2, 0.5, 1.0, False, 2),
    (6, 3, 1.5, 0.5, True, 3),
    (4, 4, 1.0, 2.0, "never", 4),  # groups of one beam
    (6, 2, 3.0, -1.0, False, 6),
    (4, 2, 0.0, 1.0, False, 4),  # no penalty: two identical groups
]


@pytest.mark.parametrize(("num_beams", "groups", "penalty", "length_penalty", "early_stopping", "num_return"), COMBOS)
def test_diverse_beam_search_matches_the_reference(frequent_eos, tokenizer, num_beams, groups, penalty,
                                                   length_penalty, early_stopping, num_return):
    llm = LLM(frequent_eos, tokenizer, kv_cache_memory="16MiB", block_size=4)
    eos = llm.engine.eos_token_ids
    prompts = random_prompts(3, 3, 16, seed=17)
    params = _diverse(num_beams, groups, penalty, length_penalty, early_stopping, num_return)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        want, scores = reference(frequent_eos, prompt, 8, num_beams, groups, penalty, length_penalty,
                                 early_stopping, num_return, eos)
        assert [o.token_ids for o in out.outputs] == want
        assert [o.score for o in out.outputs] == pytest.approx(scores, abs=1e-4)
        assert [o.finish_reason for o in out.outputs] == ["stop" if t[-1] in eos else "length" for t in want]
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks


def test_the_penalty_makes_the_groups_differ(llama, tokenizer):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    prompt = random_prompts(1, 5, 6, seed=3)
    same = llm.generate(prompt, _diverse(penalty=0.0, num_return=4))[0].outputs
    diverse = llm.generate(prompt, _diverse(penalty=5.0, num_return=4))[0].outputs
    assert len({tuple(o.token_ids) for o in same}) == 2  # each group found the same two hypotheses
    assert len({tuple(o.token_ids) for o in diverse}) == 4
    assert len({o.token_ids[0] for o in diverse}) > len({o.token_ids[0] for o in same})


def test_processed_logprobs_are_the_processors_and_leave_the_penalties_to_the_score(frequent_eos, tokenizer):
    llm = LLM(frequent_eos, tokenizer, kv_cache_memory="16MiB", block_size=4)
    prompt = random_prompts(1, 5, 6, seed=8)
    for penalty in (0.0, 0.05):  # a small penalty: group 1 still shares some of group 0's tokens, and pays
        out = llm.generate(prompt, _diverse(penalty=penalty, num_return=4, logprobs=0, logprobs_mode="processed",
                                            processors=[{"repetition_penalty": {"penalty": 1.3}}]))[0]
        paid = [sum(entry[t].logprob for entry, t in zip(o.logprobs, o.token_ids)) - o.score * len(o.token_ids)
                for o in out.outputs]  # length_penalty 1.0
        if penalty == 0.0:
            assert paid == pytest.approx([0.0] * 4, abs=1e-4)
        else:  # whole multiples of the penalty
            assert [p / penalty for p in paid] == pytest.approx([round(p / penalty) for p in paid], abs=1e-2)
            assert max(paid) > 0.0


def test_diverse_requests_batched_with_greedy_and_beam_requests_equal_them_alone(llama, tokenizer):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    prompts = random_prompts(5, 3, 30, seed=5)
    diverse = [_diverse(4, 2, 0.7, num_return=3), _diverse(6, 3, 1.2, 0.5, True, num_return=2)]
    greedy = SamplingParams(max_tokens=8, temperature=0)
    beam = SamplingParams(max_tokens=8, temperature=0, strategy={"beam_search": {"num_beams": 3,
                                                                                 "num_return_sequences": 2}})
    params = [diverse[0], greedy, diverse[1], beam, diverse[0]]
    alone = [llm.generate([p], q)[0] for p, q in zip(prompts, params)]
    mixed = llm.generate(prompts, params)
    for a, m in zip(alone, mixed):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in m.outputs]
        assert [o.score for o in a.outputs] == pytest.approx([o.score for o in m.outputs], abs=1e-5)
    assert len(mixed[0].outputs) == 3 and len(mixed[2].outputs) == 2 and len(mixed[3].outputs) == 2
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks


def test_diverse_beam_search_survives_preemption_with_the_same_results(llama, tokenizer):
    prompts = random_prompts(6, 20, 40, seed=21)
    params = _diverse(4, 2, 0.8, num_return=3, max_tokens=12)
    roomy = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4).generate(prompts, params)
    tight = LLM(llama, tokenizer, kv_cache_memory=48 * 4 * 2 * 2 * 2 * 16 * 4, block_size=4,  # 48 blocks
                max_num_batched_tokens=24)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [[o.token_ids for o in r.outputs] for r in outs] == [[o.token_ids for o in r.outputs] for r in roomy]
    assert tight.engine.allocator.num_free_blocks == tight.engine.allocator.num_blocks


def test_a_traced_request_says_which_group_chose_each_token_and_what_it_was_penalized_for(frequent_eos, tokenizer):
    llm = LLM(frequent_eos, tokenizer, kv_cache_memory="16MiB", block_size=4)
    out = llm.generate(random_prompts(1, 4, 10, seed=34), _diverse(4, 2, 2.0, num_return=4, trace=3))[0]
    groups, penalized = set(), []
    for completion in out.outputs:
        events = [e for e in completion.trace if "token" in e]
        assert [e["token"] for e in events] == completion.token_ids
        assert all(e["chosen_by"] == "diverse beam search" and e["strategy"] == "diverse_beam_search"
                   for e in events)
        for event in events:
            beam, step = event["beam"], event["beams"]
            assert beam["group"] == step["group"]
            mine = [c for c in step["candidates"] if c["parent"] == beam["parent"] and c["token"] == event["token"]]
            assert len(mine) == 1 and mine[0]["score"] == pytest.approx(beam["score"], abs=1e-5)
            assert mine[0]["fate"] == ("kept" if beam["index"] is not None else "finished")
            # group 0 is never penalized; group 1 by 2.0 per beam of group 0 that chose the token this step
            assert step["group"] == 1 or step["diversity"] == []
            assert all(d["penalty"] in (2.0, 4.0) for d in step["diversity"])
            penalized += step["diversity"]
        groups.add(events[-1]["beam"]["group"])
        assert events[-1]["beam"]["final_score"] == pytest.approx(completion.score, abs=1e-5)
    assert groups == {0, 1} and penalized


@pytest.mark.parametrize(("options", "message"), [
    ({"num_beams": 6, "num_beam_groups": 4},
     r"strategy\.diverse_beam_search: num_beams \(6\) must be divisible by num_beam_groups \(4\)"),
    ({"num_beam_groups": 1}, r"strategy\.diverse_beam_search\.num_beam_groups: Input should be greater than 1"),
    ({"diversity_penalty": -0.5},
     r"strategy\.diverse_beam_search\.diversity_penalty: Input should be greater than or equal to 0"),
    ({"num_beams": 4, "num_return_sequences": 5}, r"num_return_sequences \(5\) must be <= num_beams \(4\)"),
    ({"num_groups": 2}, r"strategy\.diverse_beam_search\.num_groups: unknown key 'num_groups' \(did you mean "
                        r"'num_beam_groups'\?\)"),
])
def test_bad_options_fail_the_request_with_an_error_naming_the_key(llama, tokenizer, options, message):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB")
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0,
                                                   strategy={"diverse_beam_search": options}))[0]
    assert out.finish_reason == "error"
    assert out.error is not None and re.search(message, out.error), out.error


def test_sampling_warpers_and_n_are_refused_like_beam_search(llama, tokenizer):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB")
    outs = llm.generate([[5, 6, 7]] * 2, [SamplingParams(max_tokens=4, temperature=0.7, strategy="diverse_beam_search"),
                                          SamplingParams(max_tokens=4, temperature=0, n=2,
                                                         strategy="diverse_beam_search")])
    assert "warpers (temperature)" in outs[0].error
    assert "use diverse_beam_search.num_return_sequences instead of n" in outs[1].error


@pytest.mark.slow
def test_diverse_beam_search_matches_the_reference_on_the_bundled_model():
    """SmolLM2-135M (decodekit's fused decoder against transformers' forward); short prompts, as the reference
    recomputes every prefix at every step."""
    from decodekit.models import load_model

    llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu")
    pristine = load_model("smollm2-135m-instruct", dtype="float32", device="cpu").model
    eos = llm.engine.eos_token_ids
    prompts = ["The capital of France is", "My favourite colour is"]
    params = _diverse(4, 2, 1.0, 1.0, False, num_return=4, max_tokens=6)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        ids = llm.tokenizer(prompt).input_ids
        want, scores = reference(pristine, ids, 6, 4, 2, 1.0, 1.0, False, 4, eos)
        assert [o.token_ids for o in out.outputs] == want
        assert [o.score for o in out.outputs] == pytest.approx(scores, abs=1e-4)
        assert len({tuple(o.token_ids) for o in out.outputs}) == 4
