"""The two-part option check every component kind shares: `check_options(options)` (static) runs wherever a plan is
made, `decodekit recipe check` included; `check_options_with(options, info)` runs only inside an engine, after
`setup(info)`. A recipe whose options only an engine can judge passes a recipe check; the engine refuses the
request naming the key; plugins written with only `check_options` (and the old set-up flag) keep working."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import Field
from typer.testing import CliRunner

from decodekit import SamplingParams, StopDecision, StoppingCriterion, hookimpl
from decodekit.api.components import ComponentInfo, PlanError
from decodekit.api.errors import RecipeError
from decodekit.api.params import StrictParams
from decodekit.api.processors import BatchView, LogitsProcessor
from decodekit.api.proposer import PROPOSER_OPTIONS_PATH, Proposer
from decodekit.cli import app
from decodekit.core.plan import Components
from decodekit.core.registry import Registry
from decodekit.recipe import load_recipe
from decodekit.testing import TINY_VOCAB_SIZE, apply_processors, plugin_manager, tiny_llm
from decodekit_plugins.strategies import SampleStrategy

CALLS: list[tuple[str, str]] = []  # (component, method) in call order: what ran where


class TokenParams(StrictParams):
    token: int = Field(ge=0, description="A token id: only an engine knows its vocabulary.")


def _static(name: str, options: Any) -> None:
    CALLS.append((name, "check_options"))
    if options.token == 13:
        raise ValueError("13 is refused everywhere")


def _with_engine(name: str, options: Any, info: Any) -> None:
    CALLS.append((name, "check_options_with"))
    if info.tokenizer is None:
        raise ValueError("needs the engine's tokenizer")
    if options.token >= info.vocab_size:
        raise ValueError(f"token {options.token} is past the vocabulary ({info.vocab_size})")


class Ban(LogitsProcessor):
    """Masks one token id."""

    name = "ban_token"
    Params = TokenParams

    def setup(self, info: Any) -> None:
        CALLS.append((self.name, "setup"))

    def check_options(self, options: Any) -> None:
        _static(self.name, options)

    def check_options_with(self, options: Any, info: Any) -> None:
        _with_engine(self.name, options, info)

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        out = logits.clone()
        for row, options in enumerate(batch.options):
            out[row, options.token] = -float("inf")
        return out


class StopAt(StoppingCriterion):
    """Stops at one token id."""

    name = "stop_at_token"
    Params = TokenParams

    def check_options(self, options: Any) -> None:
        _static(self.name, options)

    def check_options_with(self, options: Any, info: Any) -> None:
        _with_engine(self.name, options, info)

    def check(self, seq: Any, params: SamplingParams, eos_token_ids: tuple[int, ...],
              options: Any = None) -> StopDecision | None:
        return StopDecision("stop", options.token) if seq.token_ids[-1] == options.token else None


class CheckedSample(SampleStrategy):
    """Plain sampling with a token parameter it checks."""

    name = "checked_sample"
    Params = TokenParams

    def check_options(self, options: Any) -> None:
        _static(self.name, options)

    def check_options_with(self, options: Any, info: Any) -> None:
        _with_engine(self.name, options, info)


class Fixed(Proposer):
    """Drafts one fixed token, k times."""

    name = "fixed"
    Params = TokenParams

    def check_options(self, options: Any) -> None:
        _static(self.name, options)

    def check_options_with(self, options: Any, info: Any) -> None:
        _with_engine(self.name, options, info)

    def propose(self, ctx: Any, seqs: list[Any], ks: list[int],
                options: list[Any]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        return [[o.token] * k for o, k in zip(options, ks)], [None] * len(seqs)


class LegacyBan(Ban):
    """A processor written before `check_options_with`: one `check_options` and a set-up flag."""

    name = "legacy_ban"

    def __init__(self) -> None:
        self._vocab_size: int | None = None

    def setup(self, info: Any) -> None:
        self._vocab_size = info.vocab_size

    def check_options(self, options: Any) -> None:
        if options.token == 13:
            raise ValueError("13 is refused everywhere")
        if self._vocab_size is not None and options.token >= self._vocab_size:
            raise ValueError(f"token {options.token} is past the vocabulary ({self._vocab_size})")

    check_options_with = LogitsProcessor.check_options_with  # what an old plugin inherits: nothing


class LegacyProposer(Fixed):
    """A proposer written before the lifecycle: it overrides `check` itself."""

    name = "legacy_fixed"

    def __init__(self) -> None:
        self.info: Any = None

    def setup(self, info: Any) -> None:
        self.info = info

    def check(self, options: Any) -> None:
        CALLS.append((self.name, "check"))
        if self.info is not None and options.token >= self.info.vocab_size:
            raise ValueError(f"token {options.token} is past the vocabulary ({self.info.vocab_size})")


class Plugin:
    """Registers the components above."""

    @hookimpl
    def decodekit_register_processors(self, register: Callable[..., None]) -> None:
        register(Ban.name, Ban)
        register(LegacyBan.name, LegacyBan)

    @hookimpl
    def decodekit_register_stopping_criteria(self, register: Callable[..., None]) -> None:
        register(StopAt.name, StopAt)

    @hookimpl
    def decodekit_register_strategies(self, register: Callable[..., None]) -> None:
        register(CheckedSample.name, CheckedSample)

    @hookimpl
    def decodekit_register_proposers(self, register: Callable[..., None]) -> None:
        register(Fixed.name, Fixed)
        register(LegacyProposer.name, LegacyProposer)


PLUGIN = Plugin()
REGISTRY = Registry.from_plugin_manager(plugin_manager(PLUGIN))


@pytest.fixture(autouse=True)
def _fresh_calls():
    CALLS.clear()


@pytest.fixture(scope="module")
def llm():
    return tiny_llm(PLUGIN, kv_cache_memory="16MiB", block_size=4)


def _recipe(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text("model: smollm2-135m-instruct\n" + textwrap.dedent(body))
    return path


def _spec(proposer: str, token: int) -> dict[str, Any]:
    return {"speculative": {"proposer": proposer, "proposer_options": {"token": token},
                            "num_speculative_tokens": 2}}


# ---- recipe check: static checks only ------------------------------------------------------------------------
def test_recipe_check_accepts_options_only_an_engine_can_judge_and_runs_no_setup_time_check(tmp_path):
    load_recipe(_recipe(tmp_path, """\
        processors: [{ban_token: {token: 1000}}, {legacy_ban: {token: 1000}}]
        stopping: [{stop_at_token: {token: 1000}}]
        strategy: {checked_sample: {token: 1000}}
        """), registry=REGISTRY)
    load_recipe(_recipe(tmp_path, """\
        strategy: {speculative: {proposer: fixed, proposer_options: {token: 1000}}}
        """), registry=REGISTRY)
    assert ("ban_token", "check_options") in CALLS and ("fixed", "check_options") in CALLS
    assert {method for _, method in CALLS} == {"check_options"}  # neither setup nor check_options_with


def test_the_shipped_processors_token_and_string_checks_wait_for_the_engine(tmp_path):
    """Token ids past any vocabulary and strings (which need a tokenizer) pass `decodekit recipe check`."""
    path = _recipe(tmp_path, """\
        processors:
          - logit_bias: {bias: {"100000": 5}, bias_strings: {" hello": 2}}
          - bad_words: {words: [darn], words_ids: [[100000]]}
          - allowed_token_ids: {token_ids: [5, 100000]}
          - dry: {sequence_breakers: ["\\n"]}
          - regex: {pattern: "[0-9]+"}
        """)
    result = CliRunner().invoke(app, ["recipe", "check", str(path)])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(("body", "path"), [
    ("processors: [{ban_token: {token: 13}}]", "processors[0].ban_token"),
    ("processors: [{top_p: {top_p: 0.9}}, {legacy_ban: {token: 13}}]", "processors[1].legacy_ban"),
    ("stopping: [{stop_at_token: {token: 13}}]", "stopping[0].stop_at_token"),
    ("strategy: {checked_sample: {token: 13}}", "strategy.checked_sample"),
    ("strategy: {speculative: {proposer: fixed, proposer_options: {token: 13}}}", PROPOSER_OPTIONS_PATH),
])
def test_a_static_check_still_refuses_the_recipe_naming_the_key(tmp_path, body, path):
    with pytest.raises(RecipeError) as info:
        load_recipe(_recipe(tmp_path, body + "\n"), registry=REGISTRY)
    assert str(info.value).endswith(f"r.yaml: {path}: 13 is refused everywhere")


# ---- the engine: both checks, in order, after setup ---------------------------------------------------------
@pytest.mark.parametrize(("params", "message"), [
    ({"processors": [{"ban_token": {"token": 1000}}]},
     "processors[0].ban_token: token 1000 is past the vocabulary (384)"),
    ({"stopping": [{"stop_at_token": {"token": 1000}}]},
     "stopping[0].stop_at_token: token 1000 is past the vocabulary (384)"),
    ({"strategy": {"checked_sample": {"token": 1000}}},
     "strategy.checked_sample: token 1000 is past the vocabulary (384)"),
    ({"strategy": _spec("fixed", 1000)},
     "strategy.speculative.proposer_options: token 1000 is past the vocabulary (384)"),
    ({"processors": [{"logit_bias": {"bias": {"1000": 5}}}]},
     "processors[0].logit_bias: `bias` token ids must be below the vocabulary size 384, got [1000]"),
    ({"processors": [{"bad_words": {"words_ids": [[7, 1000]]}}]},
     "processors[0].bad_words: `words_ids` must be below the vocabulary size 384, got [1000]"),
    ({"processors": [{"top_k": {"top_k": 5}}, {"allowed_token_ids": {"token_ids": [5, 1000]}}]},
     "processors[1].allowed_token_ids: `token_ids` must be below the vocabulary size 384, got [1000]"),
])
def test_the_engine_refuses_a_request_failing_the_setup_time_check_naming_the_key(llm, params, message):
    good = SamplingParams(max_tokens=3, temperature=0)
    outs = llm.generate([[5, 6, 7], [5, 6, 7], [8, 9]], [good, SamplingParams(max_tokens=3, temperature=0, **params),
                                                          good])
    assert (outs[1].finish_reason, outs[1].error) == ("error", message)
    assert outs[0].error is None and outs[2].error is None
    assert outs[0].token_ids == llm.generate([[5, 6, 7]], good)[0].token_ids


def test_in_the_engine_setup_comes_first_then_the_static_check_then_the_setup_time_check():
    llm = tiny_llm(PLUGIN, kv_cache_memory="16MiB", block_size=4)  # its own: components are built at first use
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, processors=[
        {"ban_token": {"token": 9}}], stopping=[{"stop_at_token": {"token": 300}}],
        strategy={"checked_sample": {"token": 4}}))[0]
    assert out.error is None and 9 not in out.token_ids
    for name in ("ban_token", "stop_at_token", "checked_sample"):
        mine = [method for who, method in CALLS if who == name and method != "setup"]
        assert mine == ["check_options", "check_options_with"], (name, CALLS)
    assert CALLS.index(("ban_token", "setup")) < CALLS.index(("ban_token", "check_options_with"))


def test_a_proposer_gets_both_checks_in_the_engine_and_its_drafts_are_verified(llm):
    plain = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0))[0]
    spec = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, strategy=_spec("fixed", 9)))[0]
    assert spec.error is None and spec.token_ids == plain.token_ids
    assert [m for who, m in CALLS if who == "fixed"] == ["check_options", "check_options_with"]


def test_the_shipped_string_checks_run_in_the_engine_with_its_tokenizer(llm):
    params = SamplingParams(max_tokens=4, temperature=0, processors=[
        {"logit_bias": {"bias_strings": {" hello": -100}}}, {"bad_words": {"words": ["fox"]}},
        {"dry": {"sequence_breakers": ["\n"]}}])
    assert llm.generate([[5, 6, 7]], params)[0].error is None


def test_without_a_tokenizer_the_setup_time_check_refuses_strings_naming_the_key():
    components = Components(REGISTRY, ComponentInfo(tokenizer=None, vocab_size=TINY_VOCAB_SIZE))
    for processor, message in [
        ({"logit_bias": {"bias_strings": {" hello": 2}}}, "processors[0].logit_bias: `bias_strings` need a tokenizer"),
        ({"bad_words": {"words": ["darn"]}}, "processors[0].bad_words: `words` need a tokenizer"),
        ({"dry": {"sequence_breakers": ["\n"]}}, "processors[0].dry: `sequence_breakers` strings need a tokenizer"),
    ]:
        with pytest.raises(PlanError) as info:
            components.resolve(SamplingParams(processors=[processor]))
        assert str(info.value).startswith(message)
    # token ids need no tokenizer
    components.resolve(SamplingParams(processors=[{"dry": {"sequence_breakers": [], "sequence_breaker_ids": [[3]]}}]))


def test_apply_processors_runs_the_setup_time_check_as_the_engine_does():
    with pytest.raises(PlanError, match=r"^processors\[0\]\.ban_token: token 500 is past the vocabulary \(384\)$"):
        apply_processors(torch.zeros(1, TINY_VOCAB_SIZE), SamplingParams(processors=[{"ban_token": {"token": 500}}]),
                         [[1, 2]], plugins=[PLUGIN])


# ---- plugins written before the lifecycle --------------------------------------------------------------------
def test_a_plugin_with_only_check_options_and_a_set_up_flag_keeps_working(tmp_path, llm):
    load_recipe(_recipe(tmp_path, "processors: [{legacy_ban: {token: 1000}}]\n"), registry=REGISTRY)
    outs = llm.generate([[5, 6, 7]] * 3, [SamplingParams(max_tokens=3, temperature=0, processors=[
        {"legacy_ban": {"token": t}}]) for t in (9, 1000, 13)])
    assert outs[0].error is None and 9 not in outs[0].token_ids
    assert outs[1].error == "processors[0].legacy_ban: token 1000 is past the vocabulary (384)"
    assert outs[2].error == "processors[0].legacy_ban: 13 is refused everywhere"


def test_a_proposer_overriding_check_keeps_working_in_both_places(tmp_path, llm):
    load_recipe(_recipe(tmp_path, "strategy: {speculative: {proposer: legacy_fixed, proposer_options: "
                                  "{token: 1000}}}\n"), registry=REGISTRY)
    assert CALLS == [("legacy_fixed", "check")]
    outs = llm.generate([[5, 6, 7]] * 2, [SamplingParams(max_tokens=3, temperature=0, strategy=_spec("legacy_fixed", t))
                                          for t in (9, 1000)])
    assert outs[0].error is None
    assert outs[1].error == "strategy.speculative: token 1000 is past the vocabulary (384)"


def test_a_proposer_built_by_hand_runs_only_its_static_check():
    proposer = Fixed()
    proposer.check(TokenParams(token=1000))  # no engine: nothing can say 1000 is too large
    with pytest.raises(ValueError, match="13 is refused everywhere"):
        proposer.check(TokenParams(token=13))


def test_the_processor_kit_runs_the_setup_time_check_when_given_the_engines_info(tokenizer):
    from hypothesis import strategies as st

    from decodekit.testing import check_processor
    from decodekit_plugins.biases import LogitBiasProcessor

    info = ComponentInfo(tokenizer=tokenizer, vocab_size=TINY_VOCAB_SIZE)
    processor = LogitBiasProcessor()
    processor.setup(info)
    options = st.just(LogitBiasProcessor.Params(bias={300: 1.0}, bias_strings={" the": 2.0}))
    check_processor(processor, options, max_examples=3, vocab=TINY_VOCAB_SIZE, info=info)
    small = ComponentInfo(tokenizer=tokenizer, vocab_size=100)  # what an engine with a smaller vocabulary says
    with pytest.raises(ValueError, match=r"`bias` token ids must be below the vocabulary size 100, got \[300\]"):
        check_processor(processor, options, max_examples=3, vocab=TINY_VOCAB_SIZE, info=small)
