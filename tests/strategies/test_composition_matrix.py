"""The composition matrix (issue 44 item 4), generated from the registry (`tests/helpers/composition_matrix.py`): every
control x every decoding mode x every proposer either runs and holds its rules (greedy equal to the
non-speculative run, seeded equal alone and batched, the trace consistent) or is refused with the engine's reason;
nothing is silently dropped. The default run takes a subset in which every component appears; `-m matrix` runs the
whole matrix. A chi-square test checks that speculative sampling under processors draws the target's distribution,
and a component a plugin registers is in the matrix by being registered."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

from decodekit import SamplingParams, hookimpl
from decodekit.api.processors import BatchView, LogitsProcessor
from decodekit.api.proposer import Proposer
from decodekit.core.registry import Registry
from decodekit.testing.errors import ConformanceError
from decodekit.testing.parts import apply_processors, plugin_manager
from tests.engine.test_sampling_distribution import ALPHA, p_value
from tests.helpers import composition_matrix as cm

REGISTRY = cm.registry()
FAST = cm.fast_cells(REGISTRY)
ALL = cm.all_cells(REGISTRY)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Iterator[cm.MatrixModels]:
    # one torch thread, as the kits run: the tiny model gains nothing from two, and their spin-waits on a shared
    # machine make each step many times slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield cm.build_models(tmp_path_factory.mktemp("matrix"))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def references() -> dict[str, Any]:
    return {}


def _check(models: cm.MatrixModels, references: dict[str, Any], cell: cm.Cell) -> None:
    with torch.inference_mode(False):
        outcome = cm.run_cell(models, cell, references)
    assert outcome.status in ("Y", "refused", "skipped")
    if outcome.status != "Y":  # a refusal says why, naming the key the request wrote
        assert outcome.reason.strip()


@pytest.mark.parametrize("cell", FAST, ids=[c.id for c in FAST])
def test_a_cell_of_the_fast_subset_runs_equal_or_is_refused_with_a_reason(models, references, cell):
    _check(models, references, cell)


@pytest.mark.matrix
@pytest.mark.parametrize("cell", ALL, ids=[c.id for c in ALL])
def test_a_cell_of_the_whole_matrix_runs_equal_or_is_refused_with_a_reason(models, references, cell):
    _check(models, references, cell)


def test_the_fast_subset_has_every_control_mode_and_speculation_of_the_registry():
    controls, modes, specs = cm.controls(REGISTRY), cm.modes(REGISTRY), cm.speculations(REGISTRY)
    assert {c.control.label for c in FAST} == {c.label for c in controls}
    assert {c.mode.name for c in FAST} == {m.name for m in modes}
    assert {c.speculation for c in FAST if c.speculation} == set(specs)
    names = {c.name for c in controls}
    assert set(REGISTRY.processors) | set(REGISTRY.stopping_criteria) <= names
    assert set(REGISTRY.tool_formats) | set(REGISTRY.reasoning_formats) <= names
    assert {s.proposer for s in specs} == set(REGISTRY.proposers)
    assert {"greedy", "seeded", "n=2", "beam_search", "best_of"} <= {m.name for m in modes}
    assert {s.label for s in specs if s.fallback} >= {"ngram→draft", "ngram→eagle"}  # chained proposers
    assert {s.engine for s in specs if s.proposer == "draft"} == {"main", "int8"}  # the int8 self-draft too


NO_EFFECT_ON_GREEDY = {
    "eos": "the tiny model does not write its EOS within the cells' 10 tokens",
    "max_tokens": "it is the request's own limit, on in every cell",
    "time_limit": "600 s is never reached",
}
"""Controls that do not change a greedy output on the matrix's model, and why (argmax-invariant processors aside)."""


def test_every_control_changes_the_greedy_output_so_no_cell_is_vacuous(models):
    """Each control's example parameters change plain greedy decoding on the matrix's model (except the ones that
    cannot: argmax-invariant processors, and `NO_EFFECT_ON_GREEDY`): a speculative greedy cell equal to the plain
    run then proves the control applied under speculation, not that it did nothing in either."""
    greedy = next(m for m in cm.modes(REGISTRY) if m.name == "greedy")
    harness = models.harness("main")
    idle = []
    with torch.inference_mode(False):
        for control in cm.controls(REGISTRY):
            if control.missing or control.argmax_invariant:
                continue
            ps = cm.prompts(models, control)
            with_it = harness.generate(ps, [cm.cell_params(cm.Cell(control, greedy, None))] * len(ps), "with")
            without = harness.generate(ps, [SamplingParams(**{**cm.BASE, **greedy.update})] * len(ps), "without")
            if [o.outputs[0].token_ids for o in with_it] == [o.outputs[0].token_ids for o in without]:
                idle.append(control.name)
    assert sorted(idle) == sorted(NO_EFFECT_ON_GREEDY)


class _EchoProposer(Proposer):
    """Proposes the sequence's last token again, k times (a third party's proposer, for the matrix)."""

    name = "echo_matrix"

    def propose(self, ctx, seqs, ks, options):
        return [[seq.token_ids[-1]] * k for seq, k in zip(seqs, ks)], [None] * len(seqs)


class _Boost(LogitsProcessor):
    """Adds `amount` to token `token` (a third party's processor, declaring its own example parameters)."""

    name = "boost_matrix"
    example: ClassVar[dict[str, Any]] = {"token": 50, "amount": 3.0}

    from decodekit.api.params import StrictParams as _Base

    class Params(_Base):
        token: int
        amount: float

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        out = logits.clone()
        for i, options in enumerate(batch.options):
            out[i, options.token] += options.amount
        return out


class _SkipsDrafts(LogitsProcessor):
    """A broken processor, lost under speculation the way vLLM's and SGLang's are: it boosts token 45 on every row
    except those that verify a draft."""

    name = "skips_drafts_matrix"

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        out = logits.clone()
        for i, offset in enumerate(batch.draft_offsets):
            if offset == 0:
                out[i, 45] += 50.0
        return out


class _Plugin:
    def __init__(self, *processors: type) -> None:
        self.processors = processors

    @hookimpl
    def decodekit_register_processors(self, register):
        for proc in self.processors:
            register(proc.name, proc)

    @hookimpl
    def decodekit_register_proposers(self, register):
        register(_EchoProposer.name, _EchoProposer)


def test_a_plugins_processor_and_proposer_are_in_the_matrix_by_being_registered(models):
    plugin = _Plugin(_Boost)
    cells = cm.all_cells(Registry.from_plugin_manager(plugin_manager(plugin)))
    boost = [c for c in cells if c.control.name == "boost_matrix"]
    assert boost and any(c.speculation and c.speculation.proposer == "echo_matrix" for c in cells)
    assert cm.cell_params(boost[0]).processors[0].params == _Boost.example  # its own example parameters
    with_plugin = models.with_plugins(plugin)
    assert any(c.speculation and c.speculation.label == "ngram→echo_matrix" for c in cells)  # chained too
    ran = [cm.run_cell(with_plugin, c, {}) for c in boost if c.speculation and c.speculation.label == "echo_matrix"]
    assert [o.status for o in ran] == ["Y", "Y", "Y"]  # greedy, seeded, n = 2


def test_a_control_lost_under_speculation_fails_its_cell(models):
    """The matrix can fail: a processor that skips the rows verifying drafts gives speculative greedy other tokens
    than plain greedy, and its cell raises instead of passing or being recorded as refused."""
    plugin = _Plugin(_SkipsDrafts)
    cell = next(c for c in cm.all_cells(Registry.from_plugin_manager(plugin_manager(plugin)))
                if c.control.name == "skips_drafts_matrix" and c.mode.name == "greedy" and c.speculation
                and c.speculation.proposer == "ngram")
    with pytest.raises(ConformanceError, match="not lossless"):
        cm.run_cell(models.with_plugins(plugin), cell, {})


CHI_PROPOSERS = [pytest.param(s, id=s.label, marks=() if (s.proposer, s.engine) == ("draft", "main") else
                               pytest.mark.matrix) for s in cm.speculations(REGISTRY)]


@pytest.mark.parametrize("spec", CHI_PROPOSERS)
def test_speculative_sampling_under_processors_draws_the_targets_two_token_distribution(models, spec):
    """Chi-square on the joint distribution of the first two tokens (the second is a drafted position) of seeded
    speculative requests with a history-dependent penalty, allowed tokens and a temperature, against the target's
    own processed distribution computed from transformers' logits. The default run checks the draft model; the
    others run under `-m matrix`."""
    allowed = [40, 41, 42, 43]
    control = {"processors": [{"allowed_token_ids": {"token_ids": allowed}},
                              {"repetition_penalty": {"penalty": 2.0}}], "temperature": 1.5}
    prompt = [40, 41, 42, 43, 40, 41, 42, 43, 40]
    harness = models.harness(spec.engine)
    draws = 1500
    # three tokens, so that the second is drafted (no draft runs past max_tokens) and verified
    params = [SamplingParams(max_tokens=3, ignore_eos=True, seed=10_000 + i, **control,
                             strategy=cm.strategy_spec(spec, models, k=2)) for i in range(draws)]
    counts = torch.zeros(len(allowed), len(allowed))
    drafted = 0
    with torch.inference_mode(False):
        for start in range(0, draws, 250):
            outs = harness.generate([prompt] * len(params[start:start + 250]), params[start:start + 250], "chi-square")
            for out in outs:
                a, b = out.outputs[0].token_ids[:2]
                counts[allowed.index(a), allowed.index(b)] += 1
                drafted += out.metrics.num_draft_tokens
    assert drafted > 0
    expected = _two_token_distribution(models, prompt, SamplingParams(**control), allowed)
    assert p_value(counts.flatten(), expected.flatten()) > ALPHA


def test_parallel_sampling_under_speculation_draws_every_sequences_tokens_from_the_target_distribution(models):
    """Chi-square as above, for seeded requests with n = 2 under the draft model: the fork (which takes its first
    token from its parent's row and then drafts on its own) and the parent each draw the target's two-token
    distribution."""
    allowed = [40, 41, 42, 43]
    control = {"processors": [{"allowed_token_ids": {"token_ids": allowed}},
                              {"repetition_penalty": {"penalty": 2.0}}], "temperature": 1.5}
    prompt = [40, 41, 42, 43, 40, 41, 42, 43, 40]
    harness = models.harness("main")
    draws = 750
    spec = cm.Speculation("speculative", "draft")
    params = [SamplingParams(max_tokens=3, ignore_eos=True, seed=20_000 + i, n=2, **control,
                             strategy=cm.strategy_spec(spec, models, k=2)) for i in range(draws)]
    counts = [torch.zeros(len(allowed), len(allowed)) for _ in range(2)]
    drafted = 0
    with torch.inference_mode(False):
        for start in range(0, draws, 250):
            outs = harness.generate([prompt] * len(params[start:start + 250]), params[start:start + 250], "chi-square")
            for out in outs:
                for k, completion in enumerate(out.outputs):
                    a, b = completion.token_ids[:2]
                    counts[k][allowed.index(a), allowed.index(b)] += 1
                drafted += out.metrics.num_draft_tokens
    assert drafted > draws  # both sequences of most requests verified a draft
    expected = _two_token_distribution(models, prompt, SamplingParams(**control), allowed)
    for k in range(2):
        assert p_value(counts[k].flatten(), expected.flatten()) > ALPHA


def _two_token_distribution(models: cm.MatrixModels, prompt: list[int], params: SamplingParams,
                            allowed: list[int]) -> torch.Tensor:
    """P(t1, t2) over the allowed ids: the target's logits (transformers) through the request's own pipeline."""
    with torch.no_grad():
        first = models.target(torch.tensor([prompt])).logits[0, -1:].float()
        p1 = torch.softmax(apply_processors(first, params, [prompt], tokenizer=models.tokenizer), dim=-1)[0]
        seconds = torch.cat([models.target(torch.tensor([[*prompt, t]])).logits[0, -1:].float() for t in allowed])
        histories = [[*prompt, t] for t in allowed]
        p2 = torch.softmax(apply_processors(seconds, [params] * len(allowed), histories,
                                            prompt_lens=[len(prompt)] * len(allowed), tokenizer=models.tokenizer),
                           dim=-1)
    return p1[allowed][:, None] * p2[:, allowed]


def test_the_table_replaces_only_its_own_section_and_counts_every_cell(models, tmp_path):
    cells = [c for c in FAST if c.control.name in ("repetition_penalty", "logit_bias")]
    with torch.inference_mode(False):
        outcomes = cm.run_cells(models, cells)
    section = cm.render(outcomes)
    ran, refused = (sum(o.status == s for o in outcomes.values()) for s in ("Y", "refused"))
    assert f"Cells: {len(cells)}: {ran} ran (Y), {refused} refused with a reason" in section
    doc = tmp_path / "speculative.md"
    doc.write_text("# Speculative decoding\n\n## Draft trees\n\ntrees\n\n## Composition matrix\n\nold\n\n"
                   "## After\n\nx\n")
    cm.write_section(doc, section)
    text = doc.read_text()
    assert "old" not in text and text.count("## Composition matrix") == 1
    assert "## Draft trees\n\ntrees" in text and text.rstrip().endswith("## After\n\nx")
    assert "[#26330](https://github.com/sgl-project/sglang/issues/26330)" in text
