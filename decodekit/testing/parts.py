"""Ready-made parts for a plugin's own tests: a tiny model and tokenizer, an `LLM` with the plugin registered, and
named processors run on logits the way the engine runs them. All are built in-process (nothing is downloaded):

    >>> from decodekit.testing import apply_processors, tiny_llm
    >>> import my_plugin
    >>> llm = tiny_llm(my_plugin)                       # decodekit's plugins plus yours, on a 2-layer random model
    >>> out = llm.generate([[5, 6, 7]], SamplingParams(processors=[{"my_processor": {"strength": 2.0}}]))
    >>> apply_processors(torch.randn(2, 384), SamplingParams(processors=["my_processor"]), [[1, 5], [1, 6]],
    ...                  plugins=[my_plugin])

The tiny model's outputs are random (its weights are), but deterministic for a seed, and its shapes are a real
decoder's (grouped-query attention, RoPE): what a plugin's test needs to exercise batching, forks, speculation and
the KV cache without the bundled model's weight and time. The engine kits run on these parts too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import pluggy
import torch

from decodekit.api.components import ComponentInfo
from decodekit.api.params import SamplingParams
from decodekit.api.processors import BatchView, init_states, update_states
from decodekit.api.processors import apply_processors as run_pipelines
from decodekit.core.plan import Components
from decodekit.core.plugin_manager import get_plugin_manager
from decodekit.core.registry import Registry
from decodekit.llm import LLM
from decodekit.models.tiny import tiny_model, tiny_tokenizer

TINY_VOCAB_SIZE = 384
"""The tiny tokenizer's and tiny model's vocabulary size (ids 0-2 are `<pad>`, `<s>`, `</s>`)."""
TINY_EOS_TOKEN_ID = 2
"""The tiny model's end-of-sequence id (`</s>`)."""


def plugin_manager(*plugins: object, entry_points: bool = False) -> pluggy.PluginManager:
    """decodekit's own plugins plus `plugins` (modules or objects with `@hookimpl` functions), registered as an
    installed package's entry point would be.

    Args:
        plugins: the plugins under test; need not be installed.
        entry_points: also load the installed third-party plugins (off by default, so a test sees only what it
            names, whatever else is installed on the machine).
    """
    pm = get_plugin_manager(load_entry_points=entry_points)
    for plugin in plugins:
        if not pm.is_registered(plugin):
            pm.register(plugin, name=getattr(plugin, "__name__", None) or type(plugin).__name__)
    return pm


def tiny_llm(*plugins: object, arch: str = "llama", seed: int = 0, entry_points: bool = False,
             **options: Any) -> LLM:
    """An `LLM` on a tiny random model ("llama", "qwen2" or "mistral" style, 2 layers, vocabulary 384) and the
    tiny tokenizer, with `plugins` registered beside decodekit's own.

    Args:
        plugins: the plugins under test.
        arch: the tiny model's architecture.
        seed: seeds the model's random weights.
        entry_points: also load the installed third-party plugins.
        **options: engine options (`EngineConfig`'s fields, `draft=`, ...), as `LLM` takes them.
    """
    options.setdefault("device", "cpu")
    return LLM(tiny_model(arch, seed=seed), tiny_tokenizer(), plugin_manager=plugin_manager(
        *plugins, entry_points=entry_points), **options)


def apply_processors(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams],
                     histories: Sequence[Sequence[int]], *, prompt_lens: Sequence[int] | None = None,
                     plugins: Iterable[object] = (), tokenizer: Any = None,
                     eos_token_ids: Sequence[int] = (TINY_EOS_TOKEN_ID,)) -> torch.Tensor:
    """Run each row's processors, named in its `SamplingParams` (and those its sampling fields imply: temperature,
    top-p, penalties...), on `logits` `[rows, vocab]`, as the engine's sampler step does; returns the processed
    logits (the input is not modified).

    Components are built and set up (`setup(info)`) as in an engine, with `tokenizer` (default: the tiny one) and
    the logits' width as the vocabulary. Stateful processors get a state built from each row's prompt and then
    updated with its generated ids; seeded requests get their generator. Invalid parameters raise the same
    `PlanError` (naming the key) that a request would get.

    Args:
        logits: raw scores, one row per history.
        params: one `SamplingParams` for every row, or one per row.
        histories: each row's prompt plus generated ids, up to the position being scored.
        prompt_lens: each row's prompt length (default: the whole history is prompt).
        plugins: plugins to register beside decodekit's own (the processor under test).
        tokenizer: the tokenizer processors get in `setup` (default: the tiny tokenizer).
        eos_token_ids: the end-of-sequence ids processors see.
    """
    rows = logits.shape[0]
    row_params = [params] * rows if isinstance(params, SamplingParams) else list(params)
    lens = [len(h) for h in histories] if prompt_lens is None else list(prompt_lens)
    if not len(row_params) == len(histories) == len(lens) == rows:
        raise ValueError(f"{rows} logits rows need as many params, histories and prompt lengths; got "
                         f"{len(row_params)}, {len(histories)}, {len(lens)}")
    info = ComponentInfo(tokenizer if tokenizer is not None else tiny_tokenizer(), logits.shape[-1],
                         tuple(eos_token_ids), logits.device, "tiny")
    components = Components(Registry.from_plugin_manager(plugin_manager(*plugins)), info)
    plans = [components.resolve(p) for p in row_params]
    states = []
    for plan, history, prompt_len in zip(plans, histories, lens):
        row_states = init_states(plan.stages, list(history[:prompt_len]))
        if len(history) > prompt_len:
            row_states = update_states(plan.stages, row_states, list(history[prompt_len:]))
        states.append(row_states)
    generators = [None if p.seed is None else torch.Generator(device=logits.device).manual_seed(p.seed)
                  for p in row_params]
    batch = BatchView(row_params, [list(h) for h in histories], lens, tuple(eos_token_ids), logits.device,
                      generators=generators)
    return run_pipelines(logits, batch, [plan.stages for plan in plans], None, states)
