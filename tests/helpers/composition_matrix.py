"""The composition matrix (issue 44 item 4): every control the registry holds (each processor, stopping criterion,
constraint kind, tool-call format and reasoning format) x every decoding mode (greedy, seeded sampling, n > 1, and
each other registered strategy: best-of, beam search, ...) x every proposer (and "none", and model-free proposers
chained to each other one), generated from the registry, so a component a plugin adds is in the matrix by being
installed.

A cell runs on tiny in-process models (a Llama target, a Qwen2 draft, a random EAGLE head, the target's own int8
copy) through the kits' `Harness` (a step budget; every KV block, the engine's and the proposers' models', free at
the end), and ends in one `Outcome`:
- "Y": it ran, and held every rule that applies: without a proposer, a seeded or greedy request gives the same
  outputs alone and batched; with one, greedy gives exactly the non-speculative run's outputs (and the same
  processor stages in its trace, token by token) and seeded sampling the same outputs alone and batched; the trace
  agrees with the outputs (one event per token, the finish reason, drafts and acceptances adding up to the metrics).
- "refused": the engine refused the request when planning it, with the reason (a strategy's `check_compatible`).
- "skipped": the part is not installed here (a constraint backend), with the reason.
Anything else (a request that fails while running, outputs that differ, a control missing from the trace) raises
`ConformanceError`: no cell is silently dropped.

Where a component needs parameters, they come from its own `example` attribute (a mapping of its parameters) when it
declares one, else from `EXAMPLES` below, else from its defaults; a component with required parameters and none of
these fails the matrix, saying so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import NoRepeatNGramLogitsProcessor

from decodekit import SamplingParams, hf_logits_processor
from decodekit.api.errors import DecodeKitError
from decodekit.api.sequence import RequestOutput
from decodekit.api.tools import ToolSpec
from decodekit.core.plan import Components
from decodekit.core.registry import Registry
from decodekit.models.tiny import tiny_model, tiny_tokenizer
from decodekit.testing.engine_harness import Harness, compare_outputs, plan_error, run_alone
from decodekit.testing.errors import ConformanceError
from decodekit.testing.parts import plugin_manager
from decodekit.tool_calling import ToolPlan
from tests.helpers.reasoning_models import HARMONY_TOKENS

# ---- the parameters of components that need some ------------------------------------------------------------------
EXAMPLES: dict[str, Callable[[], dict[str, Any]]] = {
    # SamplingParams fields (the default processors: switched on by their field)
    "temperature": lambda: {"temperature": 0.7},
    "top_k": lambda: {"top_k": 5},
    "top_p": lambda: {"top_p": 0.8},
    "min_p": lambda: {"min_p": 0.2},
    "min_tokens": lambda: {"min_tokens": 6, "ignore_eos": False, "stop_token_ids": list(range(3, 60))},
    # a parameter that is a Python object (transformers' processor instance), which a class attribute cannot hold
    "hf_logits_processor": lambda: {"processors": [hf_logits_processor(NoRepeatNGramLogitsProcessor(2))]},
    # stopping criteria
    "eos": lambda: {"ignore_eos": False},
    "stop_token_ids": lambda: {"stop_token_ids": list(range(3, 60))},
    "stop_strings": lambda: {"stop": ["e", "a"]},
}
"""Parameters for shipped components that a request switches on by its `SamplingParams` fields (the default
processors and stopping criteria) or that cannot declare an `example` (a Python object); the others declare their
own (`LogitsProcessor.example`, `StoppingCriterion.example`). Each bites on the tiny random model: stop ids and
strings end requests mid-way, min_tokens holds them back."""

PROPOSER_OPTIONS: dict[str, Callable[[MatrixModels], dict[str, Any]]] = {
    "eagle": lambda models: {"head": str(models.head_path)},
}
"""`proposer_options` for proposers that need a file of this run's (a head fitted to the tiny target)."""

STRATEGY_OPTIONS: dict[str, dict[str, Any]] = {
    "beam_search": {"num_beams": 3},
    "diverse_beam_search": {"num_beams": 4, "num_beam_groups": 2},
    "best_of": {"best_of": 3},
}
"""Smaller than the defaults, where that keeps a cell fast (the parameters are the strategies' own)."""

BASE: dict[str, Any] = {"max_tokens": 10, "ignore_eos": True, "trace": 2}
"""What every cell's request sets before its mode and control (the trace is asked for everywhere: it is checked)."""


# ---- the axes ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Control:
    """One component switched on in a request: `update` sets its `SamplingParams` fields."""

    kind: Literal["processor", "constraint", "stopping", "tools", "reasoning"]
    name: str
    update: Callable[[], dict[str, Any]]
    opening: str = ""  # text the prompt ends with (a reasoning format's opening marker)
    stage: str | None = None  # the processor stage the trace must show for it
    argmax_invariant: bool = False  # its stage may be left out of greedy rows (it cannot change the argmax)
    missing: str | None = None  # why it cannot run here (not installed)

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.name}"


@dataclass(frozen=True, eq=False)
class Mode:
    """How a request decodes without speculation: greedy, seeded sampling, n > 1, or another strategy."""

    name: str
    update: dict[str, Any]
    speculates: bool  # whether a proposer can drive this mode (plain decoding modes; not beams, best-of, ...)


@dataclass(frozen=True)
class Speculation:
    """A strategy that takes a proposer, the proposer, and which engine it runs on ("int8": the target's own int8
    copy as the draft model)."""

    strategy: str
    proposer: str
    engine: Literal["main", "int8"] = "main"
    fallback: str | None = None  # a second proposer chained after the first (`fallback`)
    tree: bool = False  # the proposer drafts a tree of branches (`tree:`, proposers with `supports_tree`)

    @property
    def label(self) -> str:
        suffix = " (int8 self-draft)" if self.engine == "int8" else ""
        chain = f"→{self.fallback}" if self.fallback else ""
        name = self.proposer if self.strategy == "speculative" else f"{self.strategy}/{self.proposer}"
        return name + (" tree" if self.tree else "") + chain + suffix


@dataclass(frozen=True)
class Cell:
    """One control under one mode, with a speculation or without (None)."""

    control: Control
    mode: Mode
    speculation: Speculation | None

    @property
    def id(self) -> str:
        spec = self.speculation.label if self.speculation else "plain"
        return f"{self.control.label}-{self.mode.name}-{spec}".replace(" ", "_")


@dataclass(frozen=True)
class Outcome:
    """What a cell did: "Y" (ran and held every rule), "refused" (with the engine's reason) or "skipped"."""

    status: Literal["Y", "refused", "skipped"]
    reason: str = ""


def registry() -> Registry:
    """The registry of decodekit's plugins and every installed third-party plugin."""
    return Registry.from_plugin_manager(plugin_manager(entry_points=True))


def _params_example(entry: Any) -> dict[str, Any] | None:
    """A component's own `example` parameters, or {} when its parameters all have defaults, or None."""
    example = getattr(entry.factory, "example", None)
    if isinstance(example, dict):
        return example
    model = entry.params_model
    if model is None or not any(f.is_required() for f in model.model_fields.values()):
        return {}
    return None


def _no_example(kind: str, name: str) -> Callable[[], dict[str, Any]]:
    def fail() -> dict[str, Any]:
        raise ConformanceError(f"{kind} {name!r} needs parameters: declare `example` (a mapping of its parameters) on "
                               "it, or add it to EXAMPLES in tests/helpers/composition_matrix.py")
    return fail


def _processor_update(name: str, entry: Any) -> Callable[[], dict[str, Any]]:
    if name in EXAMPLES and getattr(entry.factory, "example", None) is None:
        return EXAMPLES[name]
    example = _params_example(entry)
    if example is None:
        return _no_example("processor", name)
    return lambda: {"processors": [{name: example}]}


def _backend_missing(loader: Callable[[], Any]) -> str | None:
    try:
        loader()
    except ImportError as exc:
        return f"not installed here ({exc})"
    return None


def controls(reg: Registry) -> list[Control]:
    """Every processor, constraint kind (with each installed backend), stopping criterion, tool-call format and
    reasoning format in the registry, each with parameters that make it bite."""
    constraint_kinds = {name for name, entry in reg.processors.items()
                        if entry.params_model is not None and "backend" in entry.params_model.model_fields}
    out: list[Control] = []
    for name, entry in reg.processors.items():
        kind: Literal["processor", "constraint"] = "constraint" if name in constraint_kinds else "processor"
        out.append(Control(kind, name, _processor_update(name, entry), stage=name,
                           argmax_invariant=getattr(entry.factory, "argmax_invariant", False)))
    default_backend = next(iter(reg.processors[k].params_model.model_fields["backend"].default
                                for k in sorted(constraint_kinds)), None)
    for backend, entry in reg.constraint_backends.items():
        if backend == default_backend:
            continue
        missing = _backend_missing(entry.factory)
        for kind_name in sorted(constraint_kinds):
            base = _processor_update(kind_name, reg.processors[kind_name])
            out.append(Control("constraint", f"{kind_name}@{backend}", _with_backend(base, backend), stage=kind_name,
                               missing=missing))
    for name, entry in reg.stopping_criteria.items():
        example = _params_example(entry)
        if getattr(entry.factory, "example", None) is None and name in EXAMPLES:
            update = EXAMPLES[name]
        elif example is None:
            update = _no_example("stopping criterion", name)
        else:
            update = lambda n=name, e=example: {"stopping": [{n: e}]}  # noqa: E731
        out.append(Control("stopping", name, update))
    tool = ToolSpec("lookup", "Look a word up.", {"type": "object", "properties": {"word": {
        "type": "string", "maxLength": 5}}, "required": ["word"]})
    for name, entry in reg.tool_formats.items():
        spec = ToolPlan(entry.factory(), [tool], "required", False).processor()
        out.append(Control("tools", name, lambda s=spec: {"processors": [s]}, stage=spec.name))
    for name, entry in reg.reasoning_formats.items():
        fmt = entry.factory()
        opening = next(t.marker for t in fmt.transitions if t.to == fmt.phases[0])
        out.append(Control("reasoning", name, lambda n=name, p=fmt.phases[0]: {
            "reasoning": {"format": n, p: {"budget": 3, "wrap_up": "ok"}}}, opening=opening))
    return out


def _with_backend(base: Callable[[], dict[str, Any]], backend: str) -> Callable[[], dict[str, Any]]:
    def update() -> dict[str, Any]:
        data = base()
        ((name, params),) = data["processors"][0].items()
        return {**data, "processors": [{name: {**params, "backend": backend}}]}
    return update


def modes(reg: Registry) -> list[Mode]:
    """Greedy, seeded sampling and n = 2 (plain decoding, what proposers drive), then every other registered strategy
    that takes no proposer, with its default (or `STRATEGY_OPTIONS`) parameters, seeded where it samples."""
    # greedy requests carry a seed too: a processor that draws (xtc) keys its draws on the seed and position, so
    # even its greedy tokens are the same with speculation as without
    out = [Mode("greedy", {"temperature": 0.0, "seed": 10}, True),
           Mode("seeded", {"temperature": 0.9, "seed": 11}, True),
           Mode("n=2", {"temperature": 0.9, "seed": 12, "n": 2}, True)]
    components = Components(reg)
    for name, entry in reg.strategies.items():
        if name == "sample" or _takes_proposer(entry):
            continue
        options = STRATEGY_OPTIONS.get(name)
        if options is None:
            options = _params_example(entry)
        if options is None:
            raise ConformanceError(f"strategy {name!r} needs parameters: declare `example` on it or add it to "
                                   "STRATEGY_OPTIONS in tests/helpers/composition_matrix.py")
        # sampled where the strategy samples, greedy where it is deterministic (beams refuse a temperature)
        candidates = [{"temperature": 0.9, "seed": 13}, {"temperature": 0.0, "seed": 13},
                      {"temperature": 0.0, "seed": 13, "ignore_eos": False}]
        update = next((c for c in candidates if _plans(components, {**BASE, **c, "strategy": {name: options}})),
                      candidates[0])
        out.append(Mode(name, {**update, "strategy": {name: options}}, False))
    return out


def _plans(components: Components, update: dict[str, Any]) -> bool:
    try:
        components.resolve(SamplingParams(**update))
    except (DecodeKitError, ValueError):
        return False
    return True


def _takes_proposer(entry: Any) -> bool:
    model = entry.params_model
    return model is not None and "proposer" in model.model_fields


def speculations(reg: Registry) -> list[Speculation]:
    """Every registered proposer under every strategy that takes one; a proposer that needs a draft model runs
    twice: with a smaller model, and with the target's own int8 copy. Where the strategy chains proposers
    (`fallback`), each model-free proposer (no draft model, no hidden states: prompt lookup) is chained to each
    other proposer too."""
    out = []
    for strategy, s_entry in reg.strategies.items():
        if not _takes_proposer(s_entry):
            continue
        takes_tree = "tree" in s_entry.params_model.model_fields
        for proposer, p_entry in reg.proposers.items():
            out.append(Speculation(strategy, proposer))
            if getattr(p_entry.factory, "needs_draft", False):
                out.append(Speculation(strategy, proposer, "int8"))
            if takes_tree and getattr(p_entry.factory, "supports_tree", False):
                out.append(Speculation(strategy, proposer, tree=True))
        if "fallback" not in s_entry.params_model.model_fields:
            continue
        free = [name for name, entry in reg.proposers.items() if not getattr(entry.factory, "needs_draft", False)
                and not getattr(entry.factory, "hidden_states", False) and _params_example(entry) == {}]
        out += [Speculation(strategy, first, fallback=second) for first in free for second in reg.proposers
                if second != first]
    return out


def all_cells(reg: Registry) -> list[Cell]:
    """The whole matrix: every control under every mode without speculation, and under every speculation in the
    modes a proposer drives."""
    cs, ms, ss = controls(reg), modes(reg), speculations(reg)
    plain = [Cell(c, m, None) for c in cs for m in ms]
    spec = [Cell(c, m, s) for c in cs for m in ms if m.speculates for s in ss]
    return plain + spec


def fast_cells(reg: Registry) -> list[Cell]:
    """A subset in which every control, mode and speculation appears at least once: control i under mode i (mod
    the modes) without speculation, and under speculation i (mod) in a mode proposers drive."""
    cs, ms, ss = controls(reg), modes(reg), speculations(reg)
    spec_modes = [m for m in ms if m.speculates]
    rows = max(len(cs), len(ms), len(ss))
    cells = []
    for i in range(rows):
        control = cs[i % len(cs)]
        cells.append(Cell(control, ms[i % len(ms)], None))
        cells.append(Cell(control, spec_modes[i % len(spec_modes)], ss[i % len(ss)]))
    return list(dict.fromkeys(cells))


# ---- the models and engines ---------------------------------------------------------------------------------------
@dataclass
class MatrixModels:
    """The tiny models every cell shares: a tokenizer with every reasoning format's markers, a Llama target, a
    Qwen2 draft of the same vocabulary, an EAGLE head fitted to the target, and one engine per draft setting."""

    tokenizer: Any
    target: Any
    draft: Any
    head_path: Path
    plugins: tuple[object, ...] = ()  # plugins the engines register beside decodekit's own
    engines: dict[str, Harness] = dataclasses.field(default_factory=dict)

    def with_plugins(self, *plugins: object) -> MatrixModels:
        """The same models, with engines (built when first used) that also register `plugins`."""
        return dataclasses.replace(self, plugins=plugins, engines={})

    def harness(self, engine: str) -> Harness:
        """The engine for `engine` ("main": the Qwen2 draft; "int8": the target's own int8 copy), built once."""
        if engine not in self.engines:
            options: dict[str, Any] = {"draft": self.draft}
            if engine == "int8":
                options = {"draft": "target", "draft_quantization": "int8"}
            self.engines[engine] = Harness.build(self.plugins, f"matrix ({engine} engine)", target=self.target,
                                                 tokenizer=self.tokenizer, **options)
        return self.engines[engine]


def matrix_tokenizer() -> Any:
    """The tiny tokenizer with Qwen3's `<think>` markers and gpt-oss's harmony tokens, so every reasoning format
    shipped has its markers as tokens."""
    tok = tiny_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    return tok


def build_models(folder: Path) -> MatrixModels:
    """The shared tiny models (the head file is written into `folder`)."""
    from tests.strategies.test_eagle import _random_head

    tok = matrix_tokenizer()
    target = tiny_model("llama", vocab_size=len(tok), seed=0)
    draft = tiny_model("qwen2", vocab_size=len(tok), seed=3)
    head_path = folder / "matrix-head.safetensors"
    _random_head(target, head_path, draft_vocab=120, seed=2)
    return MatrixModels(tok, target, draft, head_path)


# ---- running a cell -------------------------------------------------------------------------------------------------
def prompts(models: MatrixModels, control: Control) -> list[list[int]]:
    """Three prompts: two repetitive (prompt lookup finds matches), one not; ending in the control's opening."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(3):
        ids = torch.randint(3, 380, (int(torch.randint(5, 9, (1,), generator=g)),), generator=g).tolist()
        out.append((ids * 4)[:20] if i != 1 else ids)
    if control.opening:
        tail = models.tokenizer.encode(control.opening, add_special_tokens=False)
        out = [p + tail for p in out]
    return out


def cell_params(cell: Cell, models: MatrixModels | None = None, with_speculation: bool = True) -> SamplingParams:
    """The request of a cell (without its speculation when asked: the non-speculative reference); `models` gives
    the files proposers read (needed for a cell with such a proposer)."""
    data: dict[str, Any] = dict(BASE)
    data.update(cell.mode.update)
    data.update(cell.control.update())
    if with_speculation and cell.speculation is not None:
        data["strategy"] = strategy_spec(cell.speculation, models)
    return SamplingParams(**data)


def strategy_spec(spec: Speculation, models: MatrixModels | None, k: int = 3) -> dict[str, Any]:
    """`SamplingParams.strategy` for a speculation drafting `k` tokens a step."""
    options = {"proposer": spec.proposer, "num_speculative_tokens": k,
               "proposer_options": _proposer_options(spec.proposer, models, chained=spec.fallback is not None)}
    if spec.fallback is not None:
        options.update(fallback=spec.fallback, fallback_options=_proposer_options(spec.fallback, models))
    if spec.tree:  # two branches wherever the draft is unsure: every cell's rows run as probes over shared blocks
        options["tree"] = TREE_OPTIONS
    return {spec.strategy: options}


TREE_OPTIONS: dict[str, Any] = {"width": 2, "max_nodes": 8, "threshold": 0.9}
"""The tree of a tree cell: a second branch wherever the draft's own token is below 90% (tiny random models are
unsure nearly everywhere, so most steps verify two branches)."""


CHAIN_OPTIONS: dict[str, dict[str, Any]] = {"ngram": {"prompt_lookup_min": 2}}
"""A chain's first link's options: prompt lookup of two tokens or more, so the second link drafts where the context
offers no real match (without it, a one-token match is nearly always found)."""


def _proposer_options(name: str, models: MatrixModels | None, chained: bool = False) -> dict[str, Any]:
    if chained and name in CHAIN_OPTIONS:
        return CHAIN_OPTIONS[name]
    if name not in PROPOSER_OPTIONS:
        return {}
    if models is None:
        raise ValueError(f"proposer {name!r} reads a file of the matrix's models: pass `models`")
    return PROPOSER_OPTIONS[name](models)
_FILLER = SamplingParams(max_tokens=BASE["max_tokens"], temperature=0.8, seed=99, ignore_eos=True)


def run_cell(models: MatrixModels, cell: Cell, references: dict[str, list[RequestOutput]]) -> Outcome:
    """Run one cell; return its outcome, or raise `ConformanceError` saying which rule it broke."""
    if cell.control.missing:
        return Outcome("skipped", cell.control.missing)
    harness = models.harness(cell.speculation.engine if cell.speculation else "main")
    harness.who = f"cell {cell.id}"
    params = cell_params(cell, models)
    refused = plan_error(harness, params)
    if refused is not None:
        return Outcome("refused", refused)
    ps = prompts(models, cell.control)
    # batched beside requests of other kinds: a plain seeded one and (with speculation) the same control unspeculated
    batch_prompts = [*ps, ps[0]]
    batch_params = [params] * len(ps) + [_FILLER]
    batched = harness.generate(batch_prompts, batch_params, "batched")[: len(ps)]
    for out in batched:
        check_trace(harness, cell, out)
    if cell.speculation is not None and params.greedy:  # (a control may make a greedy mode sample: temperature)
        plain = reference(models, cell, references)
        compare_outputs(harness, "is not lossless: speculative greedy gives other outputs than plain greedy", plain,
                        batched, [params] * len(ps), ("plain", "speculative"))
        for p_out, s_out in zip(plain, batched):
            _same_stages(harness, p_out, s_out)
        return Outcome("Y")
    alone = run_alone(harness, ps, [params] * len(ps))
    compare_outputs(harness, "gives a request different outputs alone and batched", alone, batched,
                    [params] * len(ps), ("alone", "batched"), scores=True)
    return Outcome("Y")


def reference(models: MatrixModels, cell: Cell, references: dict[str, list[RequestOutput]]) -> list[RequestOutput]:
    """The cell's control and mode without speculation, batched on the main engine (computed once per pair)."""
    key = f"{cell.control.label}|{cell.mode.name}"
    if key not in references:
        harness = models.harness("main")
        ps = prompts(models, cell.control)
        params = cell_params(cell, models, with_speculation=False)
        references[key] = harness.generate([*ps, ps[0]], [params] * len(ps) + [_FILLER], "plain reference")[: len(ps)]
    return references[key]


def _stages(out: RequestOutput) -> list[list[list[str]]]:
    return [[[s["stage"] for s in e.get("stages", [])] for e in c.trace or [] if "token" in e] for c in out.outputs]


def _same_stages(harness: Harness, plain: RequestOutput, spec: RequestOutput) -> None:
    """Token by token, the speculative trace went through the same processor stages as the plain one."""
    if _stages(plain) != _stages(spec):
        raise harness.fail("ran other processor stages under speculation than without (a control was lost)",
                           f"plain {_stages(plain)[0][:3]} vs speculative {_stages(spec)[0][:3]}")


def check_trace(harness: Harness, cell: Cell, out: RequestOutput) -> None:
    """The trace agrees with the outputs: one token event per token in order, the finish reason last, the control's
    processor stage on every token it processed, drafts and acceptances adding up to the metrics."""
    drafted = accepted = 0
    for k, completion in enumerate(out.outputs):
        trace = completion.trace
        if trace is None:
            raise harness.fail("returned no trace for a request that asked for one", f"output {k}")
        events = [e for e in trace if "token" in e]
        if [e["token"] for e in events] != list(completion.token_ids):
            raise harness.fail("traced other tokens than it returned", f"output {k}: "
                               f"{[e['token'] for e in events]} vs {list(completion.token_ids)}")
        if trace[-1].get("finished") != completion.finish_reason:
            raise harness.fail("ended its trace with another finish reason than the output's",
                               f"output {k}: {trace[-1]} vs {completion.finish_reason!r}")
        stage = cell.control.stage
        if stage is not None and not (cell.control.argmax_invariant and _greedy(out)):
            missing = [e["index"] for e in events if "stages" in e and e.get("phase") is None
                       and stage not in [s["stage"] for s in e["stages"]]]
            if missing:
                raise harness.fail(f"did not run the control's processor {stage!r} on every token (lost)",
                                   f"output {k}, tokens {missing}")
        for e in events:
            if "drafts" in e:  # a draft tree's step drafted its nodes (the kept branch is `proposed`)
                drafted += e["drafts"].get("tree_nodes", len(e["drafts"]["proposed"]))
                accepted += e["drafts"]["accepted"]
    counted = (out.metrics.num_draft_tokens, out.metrics.num_accepted_tokens)
    if cell.speculation is not None and (drafted, accepted) != counted:  # the request's: all its sequences'
        raise harness.fail("traced other drafts than its metrics count",
                           f"trace {drafted} drafted / {accepted} accepted, metrics {counted[0]} / {counted[1]}")


def _greedy(out: RequestOutput) -> bool:
    return out.outputs[0].trace is not None and all(
        e.get("chosen_by") in ("argmax", "draft accepted") for e in out.outputs[0].trace if "token" in e)


def run_cells(models: MatrixModels, cells: Iterable[Cell]) -> dict[Cell, Outcome]:
    """Run every cell (raising at the first that breaks a rule)."""
    references: dict[str, list[RequestOutput]] = {}
    return {cell: run_cell(models, cell, references) for cell in cells}


__all__ = ["EXAMPLES", "Cell", "Control", "MatrixModels", "Mode", "Outcome", "Speculation", "all_cells",
           "build_models", "controls", "fast_cells", "modes", "run_cell", "run_cells", "speculations"]


# ---- the table in docs/speculative.md -------------------------------------------------------------------------------
HEADING = "## Composition matrix"

PEERS = Path(__file__).with_name("composition_peers.md")
"""The table against vLLM, SGLang, llama.cpp and TensorRT-LLM (hand-written: what their trackers say, with links)."""


def render(outcomes: dict[Cell, Outcome]) -> str:
    """The "Composition matrix" section: counts, the speculative table (controls x proposer and mode), the strategy
    table (controls x modes without a proposer), the refusals' reasons, and the peers' table."""
    reasons: dict[str, int] = {}

    def mark(outcome: Outcome | None) -> str:
        if outcome is None:
            return ""
        if outcome.status == "Y":
            return "Y"
        number = reasons.setdefault(f"{outcome.status}: {outcome.reason}", len(reasons) + 1)
        return f"{'R' if outcome.status == 'refused' else 'S'}{number}"

    by_key = {(c.control.label, c.mode.name, c.speculation.label if c.speculation else None): o
              for c, o in outcomes.items()}
    controls = list(dict.fromkeys(c.control.label for c in outcomes))
    spec_cols = list(dict.fromkeys((c.speculation.label, c.mode.name) for c in outcomes if c.speculation))
    plain_cols = list(dict.fromkeys(c.mode.name for c in outcomes if c.speculation is None))
    counts = {s: sum(o.status == s for o in outcomes.values()) for s in ("Y", "refused", "skipped")}
    lines = [HEADING, "",
             "Generated from the registry by `make matrix` (`pytest tests/strategies/test_composition_matrix.py -m "
             "matrix`, then `python tools/composition_matrix.py --write`), on tiny in-process models; the default "
             "test run takes a subset in which every component appears. **Y**: ran, "
             "greedy output equal to the non-speculative run, seeded output equal alone and batched, the trace "
             "consistent (every token, the finish reason, the control's processor stage, drafts adding up to the "
             "metrics). **R*n***: refused when the request is planned, with reason *n* below. **S*n***: the part "
             "is not installed here. A cell that does neither fails the test: there are no silent drops.", "",
             f"Cells: {len(outcomes)}: {counts['Y']} ran (Y), {counts['refused']} refused with a reason, "
             f"{counts['skipped']} skipped (not installed), 0 silent drops.", "",
             "### Under speculation (proposer / mode)", "",
             "| control | " + " | ".join(f"{s} / {m}" for s, m in spec_cols) + " |",
             "|---|" + "---|" * len(spec_cols)]
    for control in controls:
        lines.append(f"| {control} | " + " | ".join(mark(by_key.get((control, m, s))) for s, m in spec_cols) + " |")
    lines += ["", "### Without a proposer (mode or strategy)", "",
              "| control | " + " | ".join(plain_cols) + " |", "|---|" + "---|" * len(plain_cols)]
    for control in controls:
        lines.append(f"| {control} | " + " | ".join(mark(by_key.get((control, m, None))) for m in plain_cols) + " |")
    lines += ["", "Reasons:", ""]
    lines += [f"{n}. {reason.replace('|', '/')}" for reason, n in reasons.items()]
    return "\n".join(lines) + "\n\n" + PEERS.read_text()


def write_section(path: Path, section: str) -> None:
    """Put `section` in the markdown file at `path` in place of its "Composition matrix" heading's section (up to
    the next heading of the same level), or at its end; other headings stay as they are."""
    text = path.read_text() if path.exists() else "# Speculative decoding\n\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == HEADING), None)
    if start is None:
        path.write_text(text.rstrip("\n") + "\n\n" + section)
        return
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    rest = "".join(lines[end:])
    path.write_text("".join(lines[:start]) + section + ("\n" + rest if rest else ""))
