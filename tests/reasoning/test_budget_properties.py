"""The thinking budget is exact under every strategy, and the answer's constraint holds (hypothesis properties on a
tiny random Qwen3 with `<think>` markers): over random budgets, wrap-up messages, a bias towards ending the
thinking early, and the strategies (plain greedy and sampled, n > 1, best-of, beam search per beam, speculative
decoding with the n-gram, draft-model, int8 self-draft and eagle proposers). Greedy outputs equal with and
without speculation; seeded outputs equal alone and batched."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from decodekit import LLM, Proposer, SamplingParams, hookimpl
from decodekit.models.draft_head import DraftHead, DraftHeadConfig, save_head
from decodekit.testing import plugin_manager
from tests.helpers.reasoning_models import think_tokenizer, tiny_qwen3

WORDS = ["OK", " answer", " now", ".", " time", "!", " The", " end", "\n"]
ANSWER = "(yes|no)"
PROPERTY = settings(max_examples=6, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
"""Each example runs a few requests on an engine: a handful of examples, no shrinking (a failure prints its
example, which reproduces it: the examples are derandomized)."""


@pytest.fixture(scope="module")
def tok() -> Any:
    return think_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    return tiny_qwen3(tok)


@pytest.fixture(scope="module")
def llm(model: Any, tok: Any) -> LLM:
    """The target with a different tiny Qwen3 as its draft model."""
    return LLM(model, tok, draft=tiny_qwen3(tok, seed=3), kv_cache_memory="16MiB", block_size=4)


@pytest.fixture(scope="module")
def int8_llm(model: Any, tok: Any) -> LLM:
    """The target drafting with an int8 copy of itself."""
    return LLM(model, tok, draft="target", draft_quantization="int8", kv_cache_memory="16MiB", block_size=4)


@pytest.fixture(scope="module")
def head(model: Any, tmp_path_factory: Any) -> Path:
    """A random eagle head fitted to the target."""
    path = tmp_path_factory.mktemp("head") / "head.safetensors"
    torch.manual_seed(0)
    draft_head = DraftHead(DraftHeadConfig.for_target(model.config, 200, target="tiny"))
    with torch.no_grad():
        for parameter in draft_head.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.2)
        draft_head.draft_vocab.copy_(torch.randperm(model.config.vocab_size)[:200])
    save_head(draft_head, path)
    return path


def prompts(tok: Any, opened: bool) -> list[list[int]]:
    """Prompts that repeat a phrase (so n-gram lookup drafts), ending with `<think>` when `opened`."""
    think = tok.convert_tokens_to_ids("<think>")
    base = [tok.encode(text) for text in ("The quick brown fox. The quick brown fox.", "Hello world! Hello world!",
                                          "Paged attention stores keys. Paged attention")]
    return [[*ids, think] if opened else ids for ids in base]


def reasoning(budget: int, wrap: str, bias: float, answer: bool = True) -> dict[str, Any]:
    thinking: dict[str, Any] = {"budget": budget, "wrap_up": wrap}
    if bias:
        thinking["processors"] = [{"logit_bias": {"bias_strings": {"</think>": bias}}}]
    return {"format": "think_tags", "thinking": thinking,
            **({"answer": {"processors": [{"regex": {"pattern": ANSWER}}]}} if answer else {})}


def check_output(tok: Any, ids: list[int], text: str, finish: str | None, budget: int, wrap: str,
                 opened: bool) -> None:
    """The thinking has at most `budget` free tokens; unless the model closed it earlier, the wrap-up's tokens
    then `</think>` follow exactly at the budget; a finished answer matches its constraint."""
    think, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    wrap_ids = tok.encode(wrap, add_special_tokens=False) if wrap else []
    if not opened:
        assert ids[:1] == [think], "the format's opening is forced when the prompt did not open the thinking"
        ids = ids[1:]
    forced = [*wrap_ids, end]
    if end in ids:
        k = ids.index(end)
        assert k < budget or (k == budget + len(wrap_ids) and ids[budget:k] == wrap_ids), (budget, ids)
        if finish == "stop":
            assert re.fullmatch(ANSWER, text), text
    else:  # the output ended inside the thinking: before the budget, or while its end was being forced
        assert ids[budget:] == forced[: len(ids) - budget], (budget, ids)


budgets = st.integers(min_value=0, max_value=7)
wraps = st.lists(st.sampled_from(WORDS), max_size=3).map("".join)
biases = st.sampled_from([0.0, 3.0, 8.0])

STRATEGIES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0},
    "sampled": {"temperature": 1.0, "seed": 7},
    "n=2": {"temperature": 1.0, "seed": 7, "n": 2},
    "best_of": {"temperature": 1.0, "seed": 7, "strategy": {"best_of": {"best_of": 3}}},
    "beam search": {"strategy": {"beam_search": {"num_beams": 3, "num_return_sequences": 2}}},
    "ngram": {"temperature": 0, "strategy": {"speculative": {"proposer": "ngram", "num_speculative_tokens": 4}}},
    "draft": {"temperature": 1.0, "seed": 3, "strategy": {"speculative": {"proposer": "draft",
                                                                          "num_speculative_tokens": 3}}},
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@PROPERTY
@given(budget=budgets, wrap=wraps, bias=biases, opened=st.booleans())
def test_the_thinking_never_exceeds_its_budget_and_ends_exactly_there(llm, tok, name, budget, wrap, bias, opened):
    params = SamplingParams(max_tokens=20, **STRATEGIES[name], reasoning=reasoning(budget, wrap, bias))
    for out in llm.generate(prompts(tok, opened), params):
        assert out.error is None, out.error
        for o in out.outputs:
            check_output(tok, o.token_ids, o.text, o.finish_reason, budget, wrap, opened)
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks


def spec(proposer: str, head: Path | None = None) -> dict[str, Any]:
    options = {"head": str(head)} if head is not None else {}
    return {"speculative": {"proposer": proposer, "num_speculative_tokens": 4, "proposer_options": options}}


@pytest.mark.parametrize("proposer", ["ngram", "draft", "int8", "eagle"])
@settings(PROPERTY, max_examples=4)
@given(budget=budgets, wrap=wraps, bias=biases, opened=st.booleans())
def test_greedy_speculation_gives_plain_greedys_tokens_and_keeps_the_budget(
        llm, int8_llm, head, tok, proposer, budget, wrap, bias, opened):
    engine = int8_llm if proposer == "int8" else llm
    strategy = spec("draft" if proposer == "int8" else proposer, head if proposer == "eagle" else None)
    base = dict(max_tokens=24, temperature=0, reasoning=reasoning(budget, wrap, bias))
    plain = engine.generate(prompts(tok, opened), SamplingParams(**base))
    fast = engine.generate(prompts(tok, opened), SamplingParams(**base, strategy=strategy))
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    assert [o.outputs[0].reasoning_text for o in fast] == [o.outputs[0].reasoning_text for o in plain]
    for out in fast:
        check_output(tok, out.token_ids, out.text, out.finish_reason, budget, wrap, opened)


@PROPERTY
@given(budget=budgets, wrap=wraps, bias=biases, temperatures=st.tuples(
    st.sampled_from([0.0, 0.5, 1.0, 1.5]), st.sampled_from([0.0, 0.7, 1.2])))
def test_seeded_phase_sampling_gives_the_same_tokens_alone_and_batched(llm, tok, budget, wrap, bias, temperatures):
    thinking_t, answer_t = temperatures
    rules = reasoning(budget, wrap, bias, answer=False)
    rules["thinking"]["sampling"] = {"temperature": thinking_t}
    rules["answer"] = {"sampling": {"temperature": answer_t}}
    mine = SamplingParams(max_tokens=18, seed=11, reasoning=rules)
    others = [SamplingParams(max_tokens=12, temperature=0.9, seed=s) for s in range(3)]
    alone = llm.generate(prompts(tok, False)[:1], mine)[0]
    crowd = [*prompts(tok, False)[1:], prompts(tok, False)[0], prompts(tok, True)[1]]
    batched = llm.generate(crowd, [*others[:2], mine, others[2]])[2]
    assert batched.token_ids == alone.token_ids
    check_output(tok, alone.token_ids, alone.text, alone.finish_reason, budget, wrap, False)


class RepeatLast(Proposer):
    """Drafts the sequence's last token k times: a draft that crosses a forced marker without agreeing with it."""

    name = "repeat_last"

    def propose(self, ctx, seqs, ks, options):
        return [[seq.token_ids[-1]] * k for seq, k in zip(seqs, ks)], [None] * len(seqs)


class RepeatLastPlugin:
    @hookimpl
    def decodekit_register_proposers(self, register):
        register(RepeatLast.name, RepeatLast)


def test_a_draft_that_crosses_the_budget_is_cut_where_the_forced_marker_begins(model, tok, monkeypatch):
    """Drafts that reach the forced `</think>` (budget 3) disagreeing with it are cut there before scoring; with the
    cut patched out they reach verification, which rejects them: both runs give the same tokens."""
    from decodekit.core.stages import propose

    end = tok.convert_tokens_to_ids("</think>")
    engine = LLM(model, tok, kv_cache_memory="16MiB", block_size=4, plugin_manager=plugin_manager(RepeatLastPlugin()))
    strategy = engine.engine.components.get("strategies", "speculative")
    original = strategy.select

    def run() -> tuple[list[int], list[tuple[int, list[int]]]]:
        seen: list[tuple[int, list[int]]] = []

        def record(ctx, seqs, logits):
            seen.extend((seq.num_generated, list(seq.draft_token_ids)) for seq in seqs)
            return original(ctx, seqs, logits)

        strategy.select = record
        params = SamplingParams(max_tokens=12, temperature=0, reasoning=reasoning(3, "", 0.0, answer=False),
                                strategy=spec("repeat_last"))
        return engine.generate(prompts(tok, True)[:1], params)[0].token_ids, seen

    def crossing(seen: list[tuple[int, list[int]]]) -> list[int]:
        return [draft[3 - n] for n, draft in seen if n <= 3 < n + len(draft)]

    cut_ids, cut_seen = run()
    monkeypatch.setattr(propose, "usable_draft", lambda state, draft: len(draft))
    uncut_ids, uncut_seen = run()
    assert cut_ids == uncut_ids and cut_ids[3] == end
    assert crossing(uncut_seen) and all(token != end for token in crossing(uncut_seen))
    assert not crossing(cut_seen)
