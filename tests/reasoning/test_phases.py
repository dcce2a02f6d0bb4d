"""Phases of a reasoning request: each phase samples with its own parameters (chi-square), the state machine over
tokens (multi-token markers, forced openings, budgets of 0), outputs split into the answer and the reasoning
(streamed deltas add up to them), the trace names each token's phase, gpt-oss's harmony channels on a tiny gpt-oss,
and bad settings refused naming the key."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from decodekit import LLM, SamplingParams
from decodekit.api.components import ComponentInfo
from decodekit.api.processors import BatchView, apply_processors
from decodekit.api.sampling import select_tokens
from decodekit.core.phases import MARKER, ROUTER
from decodekit.core.plan import Components
from decodekit.core.plugin_manager import get_plugin_manager
from decodekit.core.registry import Registry
from decodekit.models.tiny import tiny_tokenizer
from tests.engine.test_sampling_distribution import ALPHA, p_value
from tests.helpers.reasoning_models import harmony_tokenizer, think_tokenizer, tiny_gpt_oss, tiny_qwen3


def components(tok: Any) -> Components:
    registry = Registry.from_plugin_manager(get_plugin_manager(load_entry_points=False))
    return Components(registry, ComponentInfo(tokenizer=tok, vocab_size=len(tok), eos_token_ids=(2,)))


def test_each_phase_samples_from_its_own_temperatures_distribution():
    """Rows in the thinking draw from softmax(logits / 1.6), rows in the answer from softmax(logits / 0.5): each
    passes the chi-square test against its own phase's distribution and fails it against the other's."""
    tok = think_tokenizer()
    think, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    params = SamplingParams(reasoning={"thinking": {"sampling": {"temperature": 1.6}},
                                       "answer": {"sampling": {"temperature": 0.5}}})
    plan = components(tok).resolve(params)
    prompt = [*tok.encode("Hello world"), think]
    states = {}
    for phase, generated in (("thinking", [40, 41]), ("answer", [40, end, 41])):
        state = ROUTER.init_state(plan.phases, prompt)
        states[phase] = ROUTER.update_state(state, plan.phases, generated)
        assert state.cursor.phase == phase
    support = torch.tensor([5, 9, 17, 30, 44, 60, 71, 90, 120, 200])
    row = torch.full((len(tok),), -float("inf"))
    row[support] = torch.tensor([2.0, 1.6, 1.2, 1.0, 0.5, 0.3, 0.0, -0.5, -1.0, -2.0])
    draws = 8000
    rows = [("thinking", states["thinking"])] * draws + [("answer", states["answer"])] * draws
    histories = [prompt + ([40, 41] if phase == "thinking" else [40, end, 41]) for phase, _ in rows]
    batch = BatchView([params] * len(rows), histories, [len(prompt)] * len(rows), (2,),
                      generators=[torch.Generator().manual_seed(i) for i in range(len(rows))])
    processed = apply_processors(row.expand(len(rows), -1), batch, [plan.stages] * len(rows), [False] * len(rows),
                                 [[state] for _, state in rows])
    tokens = select_tokens(processed, [False] * len(rows), batch.generators)
    for i, (phase, temperature, other) in enumerate((("thinking", 1.6, 0.5), ("answer", 0.5, 1.6))):
        counts = torch.bincount(tokens[i * draws : (i + 1) * draws], minlength=len(tok))
        assert int(counts.sum() - counts[support].sum()) == 0
        own = torch.softmax(row[support].double() / temperature, dim=-1)
        wrong = torch.softmax(row[support].double() / other, dim=-1)
        assert p_value(counts[support], own) > ALPHA, phase
        assert p_value(counts[support], wrong) < 1e-9, phase


def test_a_multi_token_marker_is_recognised_when_complete_and_its_tokens_are_labelled_as_marker():
    """With markers as text (the tiny tokenizer splits `</think>` into several tokens), the phase changes on the
    marker's last token, its tokens leave the thinking's text, and until then they are held back as pending."""
    tok = tiny_tokenizer()
    plan = components(tok).resolve(SamplingParams(reasoning={"thinking": {"budget": 50}}))
    program = plan.phases
    prompt = tok.encode("Hello<think>\n", add_special_tokens=False)
    state = ROUTER.init_state(program, prompt)
    assert state.cursor.phase == "thinking" and state.cursor.forced_token is None  # the prompt opened it
    body, marker = tok.encode("fox jumps", add_special_tokens=False), tok.encode("</think>", add_special_tokens=False)
    assert len(marker) > 1
    ROUTER.update_state(state, program, [*body, *marker[:-1]])
    assert state.cursor.phase == "thinking"
    assert state.cursor.pending_marker(program) == len(marker) - 1
    ROUTER.update_state(state, program, [marker[-1], *body])
    assert state.cursor.phase == "answer"
    assert state.labels == ["thinking"] * len(body) + [MARKER] * len(marker) + ["answer"] * len(body)
    assert state.cursor.spent["thinking"] == len(body)  # the marker's tokens do not count against the budget


def test_a_prompt_that_did_not_open_the_thinking_gets_the_opening_forced_and_a_budget_of_0_closes_it_at_once():
    tok = think_tokenizer()
    think, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    program = components(tok).resolve(SamplingParams(reasoning={"thinking": {"budget": 0}})).phases
    state = ROUTER.init_state(program, tok.encode("Question?"))
    assert state.cursor.forced_token == think
    ROUTER.update_state(state, program, [think])
    assert state.cursor.forced_token == end  # budget 0: the closing follows the opening
    ROUTER.update_state(state, program, [end])
    assert state.cursor.phase == "answer" and state.labels == [MARKER, MARKER] and state.forced_at == [0, 1]
    closed = ROUTER.init_state(program, tok.encode("Question?<think>\n\n</think>\n\n"))
    assert closed.cursor.phase == "answer" and closed.cursor.forced_token is None  # enable_thinking: false


@pytest.fixture(scope="module")
def think_llm() -> LLM:
    tok = think_tokenizer()
    return LLM(tiny_qwen3(tok), tok, kv_cache_memory="16MiB", block_size=4)


def test_streamed_reasoning_and_answer_deltas_add_up_to_the_final_split(think_llm):
    tok = think_llm.tokenizer
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True, reasoning={
        "thinking": {"budget": 6, "wrap_up": " OK."}})
    deltas: list[Any] = []
    final = think_llm.generate(["Hello world"], params, on_output=deltas.append)[0].outputs[0]
    assert "".join(d.delta_reasoning_text[0] for d in deltas) == final.reasoning_text
    assert "".join(d.delta_text[0] for d in deltas) == final.text
    whole = tok.decode(final.token_ids)
    assert whole == f"<think>{final.reasoning_text}</think>{final.text}"
    assert final.reasoning_text.endswith(" OK.")
    assert final.reasoning_token_count == final.token_ids.index(tok.convert_tokens_to_ids("</think>")) + 1


def test_the_trace_names_each_tokens_phase_and_the_forced_ones(think_llm):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, trace=2,
                            reasoning={"thinking": {"budget": 2, "wrap_up": " OK"}})
    out = think_llm.generate(["Hello world"], params)[0].outputs[0]
    events = [e for e in out.trace if "index" in e]
    wrap = len(think_llm.tokenizer.encode(" OK", add_special_tokens=False))
    assert [e["phase"] for e in events[: 4 + wrap]] == ["marker", "thinking", "thinking", *["thinking"] * wrap,
                                                       "marker"]
    assert [e.get("forced", False) for e in events[: 4 + wrap]] == [True, False, False, *[True] * wrap, True]
    assert all(e["phase"] == "answer" for e in events[4 + wrap :])


def test_a_greedy_answer_after_a_sampled_thinking_is_the_argmax_of_the_answers_pipeline(think_llm):
    """Sampled thinking, greedy answer: the answer's tokens are what greedy decoding gives from the same thinking."""
    tok = think_llm.tokenizer
    rules = {"thinking": {"budget": 4, "sampling": {"temperature": 1.0}}, "answer": {"sampling": {"temperature": 0}}}
    mixed = think_llm.generate(["Hello world"], SamplingParams(max_tokens=14, seed=3, ignore_eos=True,
                                                               temperature=0, reasoning=rules))[0]
    end = mixed.token_ids.index(tok.convert_tokens_to_ids("</think>"))
    prompt = [*tok.encode("Hello world"), *mixed.token_ids[: end + 1]]
    greedy = think_llm.generate([prompt], SamplingParams(max_tokens=14 - end - 1, temperature=0,
                                                         ignore_eos=True))[0]
    assert mixed.token_ids[end + 1 :] == greedy.token_ids


def test_gpt_oss_harmony_channels_split_thinking_and_answer_and_keep_the_budget():
    tok = harmony_tokenizer()
    llm = LLM(tiny_gpt_oss(tok), tok, kv_cache_memory="16MiB", block_size=4)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello?"}], tokenize=False,
                                     add_generation_prompt=True, reasoning_effort="low")
    assert "Reasoning: low" in prompt and prompt.endswith("<|start|>assistant")
    params = SamplingParams(max_tokens=60, temperature=0, reasoning={
        "format": "harmony", "thinking": {"budget": 5, "wrap_up": " done."},
        "answer": {"processors": [{"regex": {"pattern": "(yes|no)"}}]}})
    out = llm.generate([prompt], params, add_special_tokens=False)[0].outputs[0]
    whole = tok.decode(out.token_ids, skip_special_tokens=False)
    assert whole.startswith("<|channel|>analysis<|message|>")
    closing = "<|end|><|start|>assistant<|channel|>final<|message|>"
    thinking, answer = whole[len("<|channel|>analysis<|message|>") :].split(closing, 1)
    assert out.reasoning_text == thinking and thinking.endswith(" done.")
    assert out.finish_reason == "stop" and re.fullmatch("(yes|no)", out.text) and f"{out.text}</s>" == answer
    opening = len(tok.encode("<|channel|>analysis<|message|>", add_special_tokens=False))
    free = len(out.token_ids) - opening - len(tok.encode(" done." + closing + answer, add_special_tokens=False))
    assert free == 5


BAD = {
    "an unknown format": ({"format": "nope"}, r"reasoning\.format: unknown reasoning format 'nope'"),
    "a phase the format lacks": ({"commentary": {"processors": [{"regex": {"pattern": "a"}}]}},
                                 r"reasoning\.commentary: the think_tags format has no phase 'commentary'"),
    "a budget on the answer": ({"answer": {"budget": 4}}, r"reasoning\.answer\.budget: .*cannot end its 'answer'"),
    "a wrap-up with the marker": ({"thinking": {"budget": 4, "wrap_up": "bye</think>"}},
                                  r"reasoning\.thinking\.wrap_up: .*marker '</think>'"),
    "a bad processor in a phase": ({"answer": {"processors": [{"top_k": {"top_k": 0}}]}},
                                   r"reasoning\.answer\.processors\[0\]\.top_k"),
    "a phase temperature out of range": ({"answer": {"sampling": {"temperature": -1}}},
                                         r"reasoning\.answer\.sampling.*temperature"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_reasoning_settings_fail_that_request_alone_naming_the_key(think_llm, case):
    rules, message = BAD[case]
    good = SamplingParams(max_tokens=4, temperature=0, reasoning={"thinking": {"budget": 2}})
    bad, ok = think_llm.generate(["Hello", "Hello"], [SamplingParams(max_tokens=4, reasoning=rules), good])
    assert bad.finish_reason == "error" and re.search(message, bad.error), bad.error
    assert ok.error is None and ok.outputs[0].reasoning_text is not None
