"""Recipe and prompts files cannot hang or exhaust the process: YAML aliases have an expansion budget, files have a
size cap read without trusting `stat`, and bad bytes are a `RecipeError`, never a traceback."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from decodekit.api.errors import RecipeError
from decodekit.cli import app
from decodekit.core.plan import Components
from decodekit.core.plugin_manager import get_plugin_manager
from decodekit.core.registry import Registry
from decodekit.recipe import MAX_RECIPE_BYTES, load_recipe
from decodekit.recipe_runner import read_inputs
from decodekit.recipe_syntax import MAX_ALIAS_NODES, parse_value, parse_yaml

REGISTRY = Registry.from_plugin_manager(get_plugin_manager(load_entry_points=False))
# The classic "billion laughs": nine levels of nine aliases, 9**9 strings once expanded.
LOL_BOMB = "model: m\nsampling:\n  extra:\n    l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 9))


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_billion_laughs_under_sampling_extra_is_refused_quickly_naming_aliases_and_the_line(tmp_path):
    path = _write(tmp_path, "bomb.yaml", LOL_BOMB)
    start = time.perf_counter()
    with pytest.raises(RecipeError) as info:
        load_recipe(path, registry=REGISTRY)
    assert time.perf_counter() - start < 2.0
    message = str(info.value)
    assert message.startswith(f"{path}: aliases (*name) expand to more than {MAX_ALIAS_NODES} nodes")
    assert message.endswith("(reached at alias *l4) at line 9, column 14; write the values out instead")


def test_recipe_check_of_the_alias_bomb_exits_2_with_one_message_and_no_traceback(tmp_path):
    path = _write(tmp_path, "bomb.yaml", LOL_BOMB)
    result = CliRunner().invoke(app, ["recipe", "check", str(path)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert result.stderr.startswith(f"error: {path}: aliases (*name) expand to more than")
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_an_alias_inside_its_own_anchor_is_refused_instead_of_building_a_cycle():
    with pytest.raises(RecipeError, match=r"alias \*x is used inside its own anchor \(a cycle\) at line 1, column 11$"):
        parse_yaml("a: &x [1, *x]\n", "x.yaml")


def test_a_set_value_with_an_alias_bomb_stays_text():
    bomb = "[" + ", ".join(["&a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"] + ["*a"] * 20_000) + "]"
    assert parse_value(bomb) == bomb


def test_ordinary_anchors_aliases_and_merge_keys_still_load(tmp_path):
    path = _write(tmp_path, "x.yaml", (
        "model: m\n"
        "sampling:\n"
        "  temperature: 0.7\n"
        "  extra: {tags: &tags [a, b], again: *tags, base: &base {x: 1, y: 2}, merged: {<<: *base, y: 3}}\n"
        "processors:\n"
        "  - top_p: &p {top_p: 0.9}\n"
        "  - top_k: {top_k: 40}\n"
        "inputs: {prompts: [one, two]}\n"))
    extra = load_recipe(path, registry=REGISTRY).sampling.extra
    assert extra["again"] == extra["tags"] == ["a", "b"] and extra["merged"] == {"x": 1, "y": 3}


def test_merge_keys_may_be_overridden_but_real_duplicate_keys_are_still_refused():
    with pytest.raises(RecipeError, match="duplicate key 'y'"):
        parse_yaml("b: &b {x: 1}\nm: {<<: *b, y: 2, y: 3}\n", "x.yaml")


def test_recipe_check_of_dev_zero_exits_2_naming_the_file_and_the_cap_without_traceback():
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero here")
    start = time.perf_counter()
    result = CliRunner().invoke(app, ["recipe", "check", "/dev/zero"])
    assert time.perf_counter() - start < 5.0
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert result.stderr.startswith("error: /dev/zero: the recipe is larger than 1 MiB")
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_a_recipe_one_byte_over_the_cap_is_refused_and_one_at_the_cap_is_read(tmp_path):
    filler = "model: m\n# " + "x" * MAX_RECIPE_BYTES
    path = _write(tmp_path, "big.yaml", filler[: MAX_RECIPE_BYTES + 1])
    with pytest.raises(RecipeError, match=rf"^{re.escape(str(path))}: the recipe is larger than 1 MiB"):
        load_recipe(path, registry=REGISTRY)
    path.write_text(filler[:MAX_RECIPE_BYTES])
    assert load_recipe(path, registry=REGISTRY).model == "m"


def test_a_recipe_that_is_not_utf8_is_a_recipe_error_naming_the_byte(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_bytes(b"model: m\ndescription: caf\xe9\n")
    message = rf"^{re.escape(str(path))}: the recipe is not UTF-8 text \(byte 0xe9 at offset 25\)$"
    with pytest.raises(RecipeError, match=message):
        load_recipe(path, registry=REGISTRY)


def test_an_oversized_prompts_file_is_refused_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr("decodekit.recipe_runner.MAX_PROMPTS_FILE_BYTES", 1024)
    prompts = _write(tmp_path, "p.txt", "hello\n" * 200)
    recipe = load_recipe(_write(tmp_path, "x.yaml", "model: m\ninputs: {file: p.txt}\n"), registry=REGISTRY)
    with pytest.raises(RecipeError, match=rf"^{re.escape(str(prompts))}: the prompts file is larger than 1024"):
        read_inputs(recipe, Components(REGISTRY))


def test_a_prompts_file_that_is_not_utf8_is_a_recipe_error(tmp_path):
    (tmp_path / "p.jsonl").write_bytes(b'{"prompt": "\xff"}\n')
    recipe = load_recipe(_write(tmp_path, "x.yaml", "model: m\n"), registry=REGISTRY)
    with pytest.raises(RecipeError, match=r"p\.jsonl: the prompts file is not UTF-8 text \(byte 0xff"):
        read_inputs(recipe, Components(REGISTRY), [], tmp_path / "p.jsonl")


def test_recipe_check_refuses_the_draft_proposer_without_a_draft_model_and_accepts_it_with_one(tmp_path):
    body = "model: smollm2-135m-instruct\nstrategy:\n  speculative:\n    proposer: draft\n"
    path = tmp_path / "spec.yaml"
    path.write_text(body)
    result = CliRunner().invoke(app, ["recipe", "check", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "strategy.speculative: proposer 'draft' needs a draft model: add `draft:" in " ".join(result.output.split())
    path.write_text(body + "draft:\n  model: smollm2-135m-instruct\n")
    assert CliRunner().invoke(app, ["recipe", "check", str(path)]).exit_code == 0
