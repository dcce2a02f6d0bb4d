"""Registration goes through pluggy: its call order, `tryfirst`/`trylast` and wrappers hold, and each registered
name remembers the plugin that registered it."""

from __future__ import annotations

import pytest

from decodekit import hookimpl
from decodekit.api.errors import PluginError
from decodekit.core.plugin_manager import get_plugin_manager
from decodekit.core.registry import Registry
from decodekit.models import ModelLoader


def _loader(name: str) -> ModelLoader:
    return ModelLoader(name, lambda spec: spec == name, lambda spec, dtype, device: (None, None))


class _LoaderPlugin:
    @hookimpl
    def decodekit_register_model_loaders(self, register):
        register(_loader("third-party"))


class _LateLoaderPlugin:
    @hookimpl(trylast=True)
    def decodekit_register_model_loaders(self, register):
        register(_loader("fallback"))


def test_a_third_party_model_loader_is_tried_before_the_built_in_ones_and_trylast_puts_one_after():
    pm = get_plugin_manager(load_entry_points=False)
    builtin = [loader.name for loader in Registry.from_plugin_manager(pm).model_loaders]
    pm.register(_LoaderPlugin(), "loaders")
    pm.register(_LateLoaderPlugin(), "late")
    names = [loader.name for loader in Registry.from_plugin_manager(pm).model_loaders]
    assert names == ["third-party", *builtin, "fallback"]


def test_a_hook_wrapper_runs_around_the_other_registrations():
    seen: list[str] = []

    class Wrapper:
        @hookimpl(wrapper=True)
        def decodekit_register_processors(self, register):
            seen.append("before")
            result = yield
            seen.append("after")
            register("registered_by_wrapper", object)
            return result

    pm = get_plugin_manager(load_entry_points=False)
    pm.register(Wrapper(), "wrapper")
    registry = Registry.from_plugin_manager(pm)
    assert seen == ["before", "after"]
    assert list(registry.processors)[-1] == "registered_by_wrapper"  # after every plain implementation
    assert registry.processors["registered_by_wrapper"].plugin == "wrapper"


def test_each_entry_names_the_plugin_whose_hook_registered_it():
    pm = get_plugin_manager(load_entry_points=False)
    registry = Registry.from_plugin_manager(pm)
    assert registry.processors["top_k"].plugin == "decodekit_plugins.sampling"
    # registered by strategies.py's hook, though the class lives in beam_search.py
    assert registry.strategies["beam_search"].plugin == "decodekit_plugins.strategies"
    assert registry.constraint_backends["llguidance"].plugin == "decodekit_plugins.structured"


def test_constraint_backends_live_in_each_registry_not_in_the_process():
    class Backend:
        @hookimpl
        def decodekit_register_constraint_backends(self, register):
            register("my_backend", lambda: object)

    with_plugin = get_plugin_manager(load_entry_points=False)
    with_plugin.register(Backend(), "backend")
    assert "my_backend" in Registry.from_plugin_manager(with_plugin).backend_loaders()
    without = Registry.from_plugin_manager(get_plugin_manager(load_entry_points=False))
    assert "my_backend" not in without.backend_loaders()
    with pytest.raises(PluginError, match="unknown constraint backend 'my_backnd' \\(did you mean 'my_backend'\\?\\)"):
        Registry.from_plugin_manager(with_plugin).get("constraint_backends", "my_backnd")


def test_decodekit_plugins_calls_the_loader_and_command_hooks_through_pluggy_so_wrappers_run():
    """`decodekit plugins` credits each model loader and command to the plugin that registered it; it calls the two
    hooks through pluggy as `main` and the registry do, so a wrapper runs around the other implementations (called
    one by one around pluggy, a wrapper was only a generator never started, and what it registered was missing)."""
    from decodekit.cli.plugins import _loaders_and_commands

    order: list[str] = []

    class Commands:
        @hookimpl
        def decodekit_register_commands(self, cli):
            order.append("plain")

            @cli.command("plain-hello")
            def plain_hello() -> None:
                """Say hello."""

    class Wrapper:
        @hookimpl(wrapper=True)
        def decodekit_register_commands(self, cli):
            order.append("before")
            result = yield
            order.append("after")

            @cli.command("wrapped-hello")
            def wrapped_hello() -> None:
                """Say hello after the others."""

            return result

        @hookimpl(wrapper=True)
        def decodekit_register_model_loaders(self, register):
            result = yield
            register(_loader("after-the-others"))
            return result

    pm = get_plugin_manager(load_entry_points=False)
    pm.register(Commands(), "commands")
    pm.register(Wrapper(), "wrapper")
    pm.register(_LoaderPlugin(), "loaders")
    listed = _loaders_and_commands(pm)
    assert order == ["before", "plain", "after"]
    assert listed["commands"] == {"model_loaders": [], "commands": [{"name": "plain-hello",
                                                                      "description": "Say hello."}]}
    assert listed["wrapper"]["commands"] == [{"name": "wrapped-hello", "description": "Say hello after the others."}]
    assert [loader["name"] for loader in listed["wrapper"]["model_loaders"]] == ["after-the-others"]
    assert [loader["name"] for loader in listed["loaders"]["model_loaders"]] == ["third-party"]
    assert listed["loaders"]["commands"] == []
    assert "gguf" in {loader["name"] for loader in listed["decodekit_plugins.models"]["model_loaders"]}
