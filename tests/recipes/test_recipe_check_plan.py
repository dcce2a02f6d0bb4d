"""`decodekit recipe check` asks the engine's own plan of how the model runs (`execution.plan`), from the model's
config.json alone: it prints the plan the engine then makes when it loads the model, and refuses, naming the key,
an engine option the engine would refuse."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from decodekit import LLM
from decodekit.api.config import EngineConfig
from decodekit.api.errors import ConfigError
from decodekit.cli import app
from decodekit.execution.plan import plan_from_config
from decodekit.models.loader import peek_config
from tests.helpers.tiny_folders import tiny_overrides


def _check(recipe, tiny_dir, *sets: str):
    extra = [arg for item in sets for arg in ("--set", item)]
    return CliRunner().invoke(app, ["recipe", "check", str(recipe), *tiny_overrides(tiny_dir), *extra])


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model: m\n")
    return path


@pytest.mark.parametrize("options", [{}, {"quantization": "int8"}, {"quantization": "bf16"},
                                     {"fused_decoder": False}, {"prepack_weights": False}])
def test_the_plan_from_the_config_is_the_plan_the_engine_makes_when_it_loads_the_model(tiny_dir, options):
    config = EngineConfig(kv_cache_memory="16MiB", **options)
    planned = plan_from_config(peek_config(str(tiny_dir)), "tiny", torch.float32, torch.device("cpu"), config)
    engine = LLM(str(tiny_dir), dtype="float32", device="cpu", kv_cache_memory="16MiB", **options).engine
    assert planned is not None
    assert planned.describe() == engine.plan.describe()
    assert (planned.geometry, planned.max_model_len, planned.kv_dtype, planned.kv_pool_blocks()) == \
        (engine.plan.geometry, engine.plan.max_model_len, engine.plan.kv_dtype, engine.allocator.num_blocks)


def test_recipe_check_prints_how_the_model_runs_here(recipe, tiny_dir):
    result = _check(recipe, tiny_dir, "engine.quantization=int8")
    assert result.exit_code == 0, result.stderr
    assert "runs: fused decoder, native kernels, int8 weights, float32 activations, float32 KV cache" in result.stderr


def test_recipe_check_refuses_what_the_engine_refuses_naming_the_key(recipe, tiny_dir):
    # float16 weights on a CPU run transformers' own forward, whose linear layers the native kernels cannot take
    result = _check(recipe, tiny_dir, "dtype=float16", "engine.native_kernels=true")
    assert result.exit_code != 0
    assert "engine.native_kernels: they run float32 on a CPU, not torch.float16 on cpu" in result.stderr
    with pytest.raises(ConfigError, match=r"native_kernels: they run float32 on a CPU, not torch.float16 on cpu"):
        LLM(str(tiny_dir), dtype="float16", device="cpu", kv_cache_memory="16MiB", native_kernels=True)


def test_a_config_transformers_cannot_build_leaves_a_note_not_an_error(recipe, tmp_path, tiny_dir):
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text('{"model_type": "no-such-architecture", "num_hidden_layers": 2}')
    recipe.write_text(f"model: {odd}\n")
    result = CliRunner().invoke(app, ["recipe", "check", str(recipe), "--set", "device=cpu"])
    assert result.exit_code == 0, result.stderr
    assert "not checked against the model's KV size, nor how the model runs here" in result.stderr


def test_recipe_check_says_why_a_choice_was_not_the_obvious_one(recipe, tiny_dir):
    result = _check(recipe, tiny_dir, "dtype=float16")
    assert result.exit_code == 0, result.stderr
    assert "runs: transformers' forward" in result.stderr
    assert "(fused decoder off: torch.float16 weights on a CPU run faster in transformers' own forward)" in \
        result.stderr
