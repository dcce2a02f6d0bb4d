"""The JSONSchemaBench script's core (`benchmarks/jsonschemabench.py`) counts correctly: a few schemas from the
sample in `../shared/data/jsonschemabench/` (and made-up ones for the cases the sample may lack) through a tiny
random model, whose every token inside the schema was put there by the mask."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from decodekit import LLM
from decodekit.models.tiny import tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data" / "jsonschemabench"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("jsonschemabench", ROOT / "benchmarks" / "jsonschemabench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bench = _bench()


@pytest.fixture(scope="module")
def tiny_llm() -> LLM:
    return LLM(tiny_model("llama"), tiny_tokenizer(384))


def _case(subset: str, name: str):
    return bench.Case(subset, name, json.loads((DATA / subset / f"{name}.json").read_text()))


ONE_OF = {"type": "object", "properties": {"code": {"oneOf": [
    {"type": "string", "pattern": "^[0-9]{1,2}$"}, {"type": "string", "pattern": "^[a-z]{1,2}$"}]}},
    "required": ["code"]}
LONG = {"type": "object", "properties": {"text": {"type": "string", "minLength": 200}}, "required": ["text"]}
SMALL = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}


@pytest.mark.skipif(not DATA.is_dir(), reason="the JSONSchemaBench sample is not in ../shared")
def test_the_sample_loads_by_subset_in_name_order_with_a_limit():
    cases = bench.load_cases(DATA, ["Glaiveai2K", "Github_medium"], limit=2)
    assert [(c.subset, c.name) for c in cases] == [
        ("Github_medium", "o2068"), ("Github_medium", "o30940"),
        ("Glaiveai2K", "calculate_area_12486ef8"), ("Glaiveai2K", "calculate_area_1e9fe757")]
    assert all(isinstance(c.schema, dict) for c in cases)
    with pytest.raises(SystemExit, match="unknown subset"):
        bench.load_cases(DATA, ["nope"])


@pytest.mark.skipif(not DATA.is_dir(), reason="the JSONSchemaBench sample is not in ../shared")
def test_compiles_finishes_validates_and_truncates_are_counted_per_subset(tiny_llm):
    cases = [_case("Glaiveai2K", "calculate_area_12486ef8"), _case("Github_medium", "o4838"),  # o4838: oneOf
             bench.Case("made_up", "small", SMALL), bench.Case("made_up", "long", LONG),
             bench.Case("made_up", "one_of", ONE_OF)]
    options = bench.BenchOptions(max_tokens=24, temperature=1.0, prompt_chars=200)
    results = bench.run_benchmark(tiny_llm, cases, options)
    by_name = {r.name: r for r in results}
    assert not by_name["o4838"].llguidance_ok and not by_name["o4838"].decodekit_ok
    assert "coerce_one_of: true" in by_name["o4838"].decodekit_error
    assert by_name["small"].finish_reason == "stop" and by_name["small"].invalid is None
    assert by_name["long"].finish_reason == "length" and by_name["long"].invalid is None
    assert all(r.crash is None for r in results)
    summaries = bench.summarize(results)
    made_up, total = summaries["made_up"], summaries["total"]
    assert (made_up.schemas, made_up.llguidance, made_up.decodekit, made_up.truncated) == (3, 2, 2, 1)
    assert made_up.finished == made_up.valid == 1
    assert (total.schemas, total.crashes, total.llguidance_only, total.decodekit_only) == (5, 0, [], [])
    assert total.finished == total.valid and total.finished + total.truncated == total.decodekit
    assert list(summaries) == ["Glaiveai2K", "Github_medium", "made_up", "total"]

    # the same options reach both compilers: with coerce_one_of both accept the oneOf schemas
    coerced = bench.run_benchmark(tiny_llm, [cases[4]], bench.BenchOptions(coerce_one_of=True, max_tokens=24,
                                                                            temperature=1.0, prompt_chars=200))
    assert coerced[0].llguidance_ok and coerced[0].decodekit_ok and coerced[0].crash is None
    if coerced[0].finish_reason == "stop":
        assert coerced[0].invalid is None


def test_an_invalid_finished_output_and_a_crash_are_counted_and_fail_the_bar():
    summaries = bench.summarize([
        bench.CaseResult("s", "a", finish_reason="stop", text="{}"),
        bench.CaseResult("s", "b", finish_reason="stop", text="{}", invalid="at /: 'n' is a required property"),
        bench.CaseResult("s", "c", finish_reason="error", crash="accepted, then failed: boom"),
        bench.CaseResult("s", "d", decodekit_error="refused"),
    ])
    s = summaries["s"]
    assert (s.schemas, s.llguidance, s.decodekit, s.finished, s.valid, s.truncated, s.crashes) == (4, 4, 3, 2, 1, 0, 1)
    assert s.llguidance_only == ["s/d"]
    assert bench.validation_error(SMALL, '{"n": 3}') is None
    assert "required property" in bench.validation_error(SMALL, "{}")
    assert bench.validation_error(SMALL, '{"n": 3').startswith("not JSON")
    assert "not a 'email'" in bench.validation_error({"type": "string", "format": "email"}, '"nobody"')
