"""The example strategy in docs/writing-plugins.md runs as written, through the public registration hook."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

from decodekit import LLM, SamplingParams
from decodekit.plugins import get_plugin_manager
from tests.conftest import random_prompts

DOC = Path(__file__).resolve().parent.parent / "docs" / "writing-plugins.md"


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
