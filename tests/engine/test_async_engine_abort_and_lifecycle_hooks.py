"""The async streaming API, abort, and the plugin seam (hooks, registry, allow-list)."""

from __future__ import annotations

import asyncio

import pytest

from decodekit import LLM, AsyncLLM, SamplingParams, hookimpl
from decodekit.api.errors import PluginError
from decodekit.core.plugin_manager import DEFAULT_PLUGINS, get_plugin_manager
from decodekit.core.registry import Registry
from decodekit.models.tiny import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def async_llm():
    llm = AsyncLLM(tiny_model("llama"), tiny_tokenizer(), dtype="float32", device="cpu")
    yield llm
    llm.shutdown()


def test_async_stream_yields_deltas_that_add_up_to_the_offline_result(async_llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def collect(prompt):
        return [out async for out in async_llm.generate(prompt, params)]

    async def main():
        return await asyncio.gather(*(collect([5 + i, 6, 7, 8]) for i in range(4)))

    streams = asyncio.run(main())
    for stream in streams:
        assert stream[-1].finished and len(stream[-1].token_ids) == 12
        assert [t for o in stream for t in o.delta_token_ids[0]] == stream[-1].token_ids
        assert "".join(o.delta_text[0] for o in stream) == stream[-1].text


def test_async_abort_ends_the_stream_with_finish_reason_abort(async_llm):
    async def main():
        seen = []
        async for out in async_llm.generate([5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True),
                                            request_id="victim"):
            seen.append(out)
            if len(seen) == 3:
                async_llm.abort("victim")
        return seen

    seen = asyncio.run(main())
    assert seen[-1].finished and seen[-1].finish_reason == "abort"
    assert len(seen[-1].token_ids) < 400


class _Recorder:
    """A plugin recording lifecycle hooks and registering a processor that bans token 7."""

    def __init__(self):
        self.events: list[str] = []

    @hookimpl
    def decodekit_register_processors(self, register):
        from decodekit.api.processors import LogitsProcessor

        class BanSeven(LogitsProcessor):
            name = "ban_seven"

            def __call__(self, logits, batch):
                return logits.index_fill(1, __import__("torch").tensor([7]), -float("inf"))

        register("ban_seven", BanSeven)

    @hookimpl
    def decodekit_engine_started(self, engine):
        self.events.append("engine_started")

    @hookimpl
    def decodekit_request_added(self, request):
        self.events.append(f"added:{request.request_id}")

    @hookimpl
    def decodekit_request_finished(self, request, output):
        self.events.append(f"finished:{request.request_id}:{output.finish_reason}")

    @hookimpl
    def decodekit_step_finished(self, engine, outputs):
        if "step" not in self.events:
            self.events.append("step")


def test_plugin_hooks_fire_and_a_registered_processor_applies_only_where_asked(plugin_manager):
    recorder = _Recorder()
    plugin_manager.register(recorder, name="recorder")
    llm = LLM(tiny_model("llama"), tiny_tokenizer(), dtype="float32", device="cpu", plugin_manager=plugin_manager)
    outs = llm.generate([[7, 7, 7], [7, 7, 7]], [
        SamplingParams(temperature=1.0, seed=1, max_tokens=30, ignore_eos=True, processors=["ban_seven"]),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
    ])
    assert 7 not in outs[0].token_ids
    assert recorder.events[0] == "engine_started" and "step" in recorder.events
    added = [e for e in recorder.events if e.startswith("added:")]
    finished = [e for e in recorder.events if e.startswith("finished:")]
    assert len(added) == 2 and len(finished) == 2 and all(e.endswith(":length") for e in finished)


def test_registry_lists_the_builtins_and_suggests_close_names(plugin_manager):
    registry = Registry.from_plugin_manager(plugin_manager)
    assert {"temperature", "top_k", "top_p", "min_p", "min_tokens"} <= set(registry.processors)
    assert {"eos", "max_tokens", "stop_strings", "stop_token_ids"} <= set(registry.stopping_criteria)
    assert "sample" in registry.strategies
    with pytest.raises(PluginError, match=r"did you mean 'top_p'.*known: .*temperature"):
        registry.get("processors", "top_q")


def test_duplicate_registration_names_the_two_plugins(plugin_manager):
    class Dup:
        @hookimpl
        def decodekit_register_processors(self, register):
            register("top_k", object)

    plugin_manager.register(Dup(), name="dup")
    with pytest.raises(PluginError, match="'top_k' from plugin 'dup' is already registered"):
        Registry.from_plugin_manager(plugin_manager)


def test_allow_list_env_var_keeps_entry_point_plugins_out(monkeypatch):
    monkeypatch.setenv("DECODEKIT_PLUGINS", "")
    pm = get_plugin_manager()
    names = {pm.get_name(p) for p in pm.get_plugins()}
    assert names == set(DEFAULT_PLUGINS)
