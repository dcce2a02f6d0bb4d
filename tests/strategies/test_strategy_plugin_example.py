"""The example strategy in docs/writing-plugins.md runs as written, through the public registration hook."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

from decodekit import LLM, SamplingParams
from decodekit.core.plugin_manager import get_plugin_manager
from tests.helpers.reference import random_prompts

DOC = Path(__file__).resolve().parents[2] / "docs" / "writing-plugins.md"


def _example_plugin() -> SimpleNamespace:
    section = DOC.read_text().split("## Writing a search strategy", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)
    return SimpleNamespace(**namespace)


def test_the_documented_top_starts_strategy_forks_and_continues_greedily(llama, tokenizer):
    plugin = _example_plugin()
    pm = get_plugin_manager(load_entry_points=False)
    pm.register(plugin, "top_starts_doc_example")
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4, plugin_manager=pm)
    prompts = random_prompts(3, 5, 20, seed=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                strategy={"top_starts": {"n": 3}}))
    for prompt, out in zip(prompts, outs):
        assert len(out.outputs) == 3 and len({o.token_ids[0] for o in out.outputs}) == 3
        for o in out.outputs:  # after its first token, each continuation is the greedy one
            greedy = llm.generate([prompt + o.token_ids[:1]],
                                  SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
            assert o.token_ids[1:] == greedy.token_ids
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks
    bad = llm.generate(prompts[:1], SamplingParams(max_tokens=2, strategy={"top_starts": {"n": 0}}))[0]
    assert "strategy.top_starts.n: Input should be greater than or equal to 1" in bad.error


_OLD_STYLE_EXAMPLE = '''
import torch
from pydantic import BaseModel, ConfigDict, Field

from decodekit import hookimpl
from decodekit.api.strategy import Strategy


class TopStartsParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n: int = Field(3, ge=1, le=16)


class TopStarts(Strategy):
    name = "top_starts"
    Params = TopStartsParams

    def num_sequences(self, options, params):
        return options.n

    def select(self, ctx, seqs, logits):
        logprobs = torch.log_softmax(ctx.process(logits, seqs), dim=-1)
        for seq, row in zip(seqs, logprobs):
            if seq.num_generated == 0:
                top = row.topk(seq.request.plan.strategy_options.n)
                children = [seq] + [ctx.fork(seq) for _ in range(len(top.indices) - 1)]
                for child, token, score in zip(children, top.indices.tolist(), top.values.tolist()):
                    child.state["first_logprob"] = score
                    ctx.append_token(child, token)
            else:
                ctx.append_token(seq, int(row.argmax()))


@hookimpl
def decodekit_register_strategies(register):
    register(TopStarts.name, TopStarts)
'''


def test_a_strategy_written_against_the_earlier_docs_gives_the_same_outputs(llama, tokenizer):
    """Raw scores plus `ctx.process` and the string-keyed `state` (the contract before the process stage and the
    stash) still work, and agree with the documented example."""
    outputs = []
    for code in (_OLD_STYLE_EXAMPLE, None):
        if code is None:
            plugin = _example_plugin()
        else:
            namespace: dict = {}
            exec(compile(code, "old_style_example", "exec"), namespace)
            plugin = SimpleNamespace(**namespace)
        pm = get_plugin_manager(load_entry_points=False)
        pm.register(plugin, "top_starts_example")
        llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4, plugin_manager=pm)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, strategy={"top_starts": {"n": 3}},
                                processors=[{"repetition_penalty": {"penalty": 1.3}}])
        outputs.append([[o.token_ids for o in out.outputs] for out in llm.generate(random_prompts(3, 5, 20, seed=6),
                                                                                     params)])
    assert outputs[0] == outputs[1]
