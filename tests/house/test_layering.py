"""The house's rules hold: no import runs up the layers, first-party plugins use only the public API, and the
module map in docs/architecture.md is the code's own (tools/architecture_map.py)."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "tools" / "architecture_map.py"
_SPEC = importlib.util.spec_from_file_location("architecture_map", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
architecture_map = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(architecture_map)


def test_no_import_runs_up_the_layers_and_plugins_use_only_the_public_api():
    assert architecture_map.violations(architecture_map.graph()) == []


def test_the_module_map_in_the_architecture_doc_matches_the_code():
    assert architecture_map.problems() == []


@pytest.mark.parametrize(("module", "target", "why"), [
    ("decodekit.api.strategy", "decodekit.core.engine", "layer 0"),
    ("decodekit.core.engine", "decodekit.llm", "layer 3"),
    ("decodekit.models.loader", "decodekit.execution.runner", "layer 1"),
    ("decodekit.core.engine", "decodekit_plugins.speculative", "plugin module"),
    ("decodekit_plugins.speculative", "decodekit.execution.blocks", "public API only"),
])
def test_an_import_up_the_layers_is_reported(module, target, why):
    found = architecture_map.violations({module: {target}})
    assert len(found) == 1 and why in found[0]


def test_an_import_cycle_is_reported_with_its_path():
    graph = {"decodekit.execution.runner": {"decodekit.execution.cuda_graphs"},
             "decodekit.execution.cuda_graphs": {"decodekit.execution.items", "decodekit.execution.runner"},
             "decodekit.execution.items": set()}
    assert architecture_map.violations(graph) == ["import cycle: decodekit.execution.cuda_graphs -> "
                                                  "decodekit.execution.runner -> decodekit.execution.cuda_graphs"]


def test_imports_down_the_layers_and_plugin_api_imports_are_allowed():
    graph = {"decodekit.llm": {"decodekit.core.engine", "decodekit.api.params", "decodekit.execution.plan"},
             "decodekit.core.engine": {"decodekit.models", "decodekit.api.sequence", "decodekit.execution"},
             "decodekit.execution.plan": {"decodekit.models.loader", "decodekit.api.config"},
             "decodekit_plugins.beam_search": {"decodekit", "decodekit.api.strategy", "decodekit.models"}}
    assert architecture_map.violations(graph) == []


@pytest.mark.parametrize("name", [
    # what README.md, docs/writing-plugins.md and docs/plugins/ teach, at the paths they teach it
    "decodekit:LLM", "decodekit:AsyncLLM", "decodekit:SamplingParams", "decodekit:hookimpl",
    "decodekit:LogitsProcessor", "decodekit:BatchView", "decodekit:StoppingCriterion", "decodekit:StopDecision",
    "decodekit:Strategy", "decodekit:select_tokens", "decodekit.api.strategy:Strategy",
    "decodekit.api.strategy:StrategyResult", "decodekit.api.strategy:StepContext", "decodekit.api.proposer:Proposer",
    "decodekit.api.processors:BatchView", "decodekit.api.processors:LogitsProcessor",
    "decodekit.api.processors:apply_processors", "decodekit.api.components:ComponentInfo",
    "decodekit.testing:check_processor", "decodekit.testing:ConformanceError", "decodekit.testing:cases",
    "decodekit.testing:batch_views", "decodekit.testing:logits_tensors", "decodekit.testing:histories",
    "decodekit.api.constraints:ConstraintBackend", "decodekit.api.constraints:Matcher",
    "decodekit.api.constraints:lazy_backend", "decodekit.api.constraints:get_backend",
    "decodekit.api.constraints:ConstraintSpec", "decodekit.models:ModelLoader", "decodekit.core.engine:Engine",
    "decodekit.api.sequence:Request", "decodekit.api.sequence:RequestOutput",
    "decodekit.api.hookspecs:decodekit_register_processors", "decodekit.api.stopping:StoppingCriterion",
    "decodekit.api.params:SamplingParams", "decodekit.api.errors:DecodeKitError", "decodekit.api.config:EngineConfig",
    "decodekit.core.plugin_manager:get_plugin_manager", "decodekit.core.registry:Registry",
])
def test_every_taught_name_stays_importable_where_the_docs_teach_it(name):
    module, _, attr = name.partition(":")
    assert getattr(importlib.import_module(module), attr) is not None


@pytest.mark.parametrize("module", [
    "decodekit.plan", "decodekit.plugins", "decodekit.config", "decodekit.registry", "decodekit.hookspecs",
    "decodekit.errors", "decodekit.strategy", "decodekit.processors", "decodekit.params", "decodekit.stopping",
    "decodekit.constraints", "decodekit.core.sampler", "decodekit.core.sequence",
])
def test_the_old_re_export_paths_are_gone(module):
    # one path per name: the docs teach `decodekit`, `decodekit.api.*` and `decodekit.testing`
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(module)


@pytest.mark.parametrize("path", ["decodekit/api/testing.py", "decodekit/kits.py", "decodekit/plugin_testing.py",
                                  "decodekit/testing.py"])
def test_the_testing_kit_lives_only_in_decodekit_testing(path):
    # the kit's parts moved into the `decodekit/testing/` package; its old modules are gone, not re-exported (checked
    # as files: an editable install of another checkout would still import them by name)
    assert not (_PATH.parent.parent / path).exists()
