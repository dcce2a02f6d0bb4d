"""Conformance kits for the plugins that run inside the engine: stopping criteria, speculative-decoding proposers
and search strategies. Each runs the plugin on real sequences in a tiny in-process engine (`decodekit.testing`'s
tiny model and tokenizer, nothing downloaded) and raises one `ConformanceError` (an `AssertionError`) saying what is
wrong; re-exported by `decodekit.testing` beside the processor kit:

    >>> from decodekit.testing import check_proposer, check_stopping_criterion, check_strategy
    >>> check_stopping_criterion("my_criterion", {"count": 2}, plugins=[my_plugin])
    >>> check_proposer("my_proposer", {}, plugins=[my_plugin])
    >>> check_strategy("my_strategy", {"width": 3}, plugins=[my_plugin])

What each kit holds the plugin to:

- `check_stopping_criterion`: called directly on real sequences (token by token, as the stop stage calls it), its
  decisions are `StopDecision`s or None, the same on a second replay of the same tokens, never change the
  sequence or the request's parameters, and a `truncate_text_at` lies within the text; in the engine, its requests
  give the same outputs on a second run, alone and batched with others, and under speculative decoding (several
  tokens a step: those after a stop are dropped) the same outputs as without (greedy);
- `check_proposer`: speculative decoding with it is lossless: greedy requests give exactly plain greedy's tokens,
  seeded sampled requests the same tokens alone and batched (and on a second run); it proposed something (or the
  kit verified nothing); every KV block, the engine's and the proposer's own model's, is free once the requests
  finish;
- `check_strategy`: its requests (greedy, seeded sampled, and parallel when it accepts them) give the same outputs
  on a second run (same seeds), alone and mixed in one batch with requests of other strategies; outputs are well
  formed (a finish reason, token ids in the vocabulary, at most `max_tokens`, as many outputs as promised); every
  KV block is free once they finish; optionally (`lossless=True`) greedy requests give plain greedy's tokens.

Each returns a `KitReport` of what it exercised (stops seen, drafts proposed, request kinds the strategy refused),
so a test can tell a pass that checked something from one that checked nothing. A plugin is named as registered
(give its plugin module in `plugins=`), or given as a class or an instance, which the kit registers under its
`name`. Kits build a fresh engine per call and run for a few seconds on CPU.

This module is a front-end (it builds `LLM`s); the processor kit, which needs no engine, is `decodekit.api.testing`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache, wraps
from typing import Any

import torch

from decodekit.api.components import PlanError
from decodekit.api.errors import DecodeKitError
from decodekit.api.hookspecs import hookimpl
from decodekit.api.params import SamplingParams
from decodekit.api.sequence import Request, RequestOutput
from decodekit.api.sequence import Sequence as EngineSequence
from decodekit.api.stopping import StopDecision
from decodekit.api.testing import ConformanceError
from decodekit.core.detokenizer import IncrementalDetokenizer
from decodekit.core.plan import CriterionStage
from decodekit.core.registry import Registry
from decodekit.llm import LLM
from decodekit.models.tiny import tiny_model, tiny_tokenizer
from decodekit.plugin_testing import TINY_VOCAB_SIZE, plugin_manager

__all__ = ["KitReport", "check_proposer", "check_stopping_criterion", "check_strategy"]

_KINDS = {"stopping_criteria": "stopping criterion", "proposers": "proposer", "strategies": "strategy"}
_request_ids = itertools.count()


@dataclass(frozen=True)
class KitReport:
    """What a kit exercised, so a test can tell a meaningful pass from a vacuous one.

    Attributes:
        requests: requests the kit ran through the engine.
        stops: stopping kit: replayed sequences on which the criterion decided to stop at some token.
        draft_tokens: tokens proposed (speculative requests).
        accepted_tokens: of those, tokens the target accepted.
        skipped: what the kit did not check, and why (a request kind the strategy refuses, ...).
    """

    requests: int = 0
    stops: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    skipped: tuple[str, ...] = ()


# ---- registering a component given as a class or an instance -------------------------------------------------------
class _Registers:
    """A plugin registering one given component: how a kit called with a class or an instance (rather than a
    registered name) puts it in its engine."""

    def __init__(self, kind: str, name: str, factory: Callable[[], Any]) -> None:
        self.kind, self.name, self.factory = kind, name, factory

    def _register(self, kind: str, register: Callable[..., None]) -> None:
        if self.kind == kind:
            register(self.name, self.factory)

    @hookimpl
    def decodekit_register_stopping_criteria(self, register: Callable[..., None]) -> None:
        self._register("stopping_criteria", register)

    @hookimpl
    def decodekit_register_strategies(self, register: Callable[..., None]) -> None:
        self._register("strategies", register)

    @hookimpl
    def decodekit_register_proposers(self, register: Callable[..., None]) -> None:
        self._register("proposers", register)


def _named(kind: str, component: Any, plugins: Iterable[object]) -> tuple[str, list[object]]:
    """The registered name of `component` and the plugins that register it: a name as is; a class or an instance
    registered by an extra plugin under its `name` (an instance is the one the engine uses)."""
    plugins = list(plugins)
    if isinstance(component, str):
        return component, plugins
    name = getattr(component, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"a {_KINDS[kind]} is given by its registered name, or a class or instance with a `name`; "
                        f"got {component!r}")
    factory = component if isinstance(component, type) else (lambda: component)
    return name, [*plugins, _Registers(kind, name, factory)]


# ---- the kits' engine ----------------------------------------------------------------------------------------------
@contextmanager
def _one_thread() -> Iterator[None]:
    """Run torch on one thread while a kit runs. The tiny model's matrices are far too small to gain from
    intra-op threads, and on a shared machine the threads' spin-waits make each step ten times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _kit(function: Callable[..., KitReport]) -> Callable[..., KitReport]:
    """A kit runs on one torch thread (`_one_thread`)."""

    @wraps(function)
    def run(*args: Any, **kwargs: Any) -> KitReport:
        with _one_thread():
            return function(*args, **kwargs)

    return run


@lru_cache(maxsize=4)
def _model(arch: str, seed: int) -> Any:
    """A tiny model, shared by the kits' engines (they only read its weights)."""
    return tiny_model(arch, seed=seed)


@lru_cache(maxsize=1)
def _tokenizer() -> Any:
    return tiny_tokenizer()


@dataclass
class _Harness:
    """A tiny engine for one kit call, with the models its proposers opened (their KV blocks are checked too)."""

    llm: LLM
    who: str
    opened: list[Any] = field(default_factory=list)
    requests: int = 0

    @classmethod
    def build(cls, plugins: Sequence[object], who: str, draft: Any = None) -> _Harness:
        target = _model("llama", 0)
        draft_model = target if isinstance(draft, str) and draft == "target" else draft
        llm = LLM(target, _tokenizer(), plugin_manager=plugin_manager(*plugins), device="cpu", draft=draft_model,
                  kv_cache_memory="16MiB", block_size=4, max_num_seqs=64)
        harness = cls(llm, who)
        info = llm.engine.components.info
        if info is not None and info.open_model is not None:
            # components are built (and set up) at their first request: wrap `open_model` before any, so a model a
            # proposer opens is seen, and its KV blocks checked, like the engine's own
            opener = info.open_model

            def recording(model: Any) -> Any:
                opened = opener(model)
                harness.opened.append(opened)
                return opened

            info.open_model = recording
        return harness

    def fail(self, rule: str, detail: str = "") -> ConformanceError:
        return ConformanceError(f"{self.who} {rule}" + (f": {detail}" if detail else ""))

    def resolve(self, params: SamplingParams) -> Any:
        """The plan the engine would make for `params` (`PlanError` when it refuses them)."""
        return self.llm.engine.components.resolve(params)

    def generate(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams],
                 what: str) -> list[RequestOutput]:
        """Run the requests together to the end, stepping the engine with a step budget (a plugin that never
        finishes its requests fails the kit instead of hanging it); raise if one failed."""
        engine = self.llm.engine
        ids = []
        for prompt, p in zip(prompts, params):
            rid = f"kit-{next(_request_ids)}"
            engine.add_request(list(prompt), p, request_id=rid)
            ids.append(rid)
        self.requests += len(ids)
        finals: dict[str, RequestOutput] = {}
        budget = 64 + sum(p.max_tokens * max(p.n, 1) + len(prompt) for prompt, p in zip(prompts, params)) * 2
        for _ in range(budget):
            if len(finals) == len(ids):
                break
            for out in engine.step():
                if out.finished and out.request_id in ids:
                    finals[out.request_id] = out
        if len(finals) < len(ids):
            for rid in ids:
                engine.abort(rid)
            for _ in range(budget):  # drain the aborts' outputs (bounded: the plugin is already known broken)
                if not engine.has_unfinished_requests():
                    break
                engine.step()
            raise self.fail(f"did not finish its requests within {budget} engine steps ({what})")
        outs = [finals[rid] for rid in ids]
        for i, out in enumerate(outs):
            if out.error is not None or any(o.finish_reason == "error" for o in out.outputs):
                raise self.fail(f"failed a request ({what}, request {i}: {_describe(params[i])})",
                                str(out.error))
        self.check_idle(what)
        return outs

    def check_idle(self, what: str) -> None:
        """Nothing left running, and every KV block free: the engine's, and those of models its proposers opened."""
        engine = self.llm.engine
        if engine.has_unfinished_requests() or engine.requests:
            raise self.fail(f"left requests behind after they finished ({what})",
                            f"{len(engine.requests)} request record(s) still in the engine")
        pools: list[tuple[str, Any]] = [("the engine's", engine.allocator)]
        pools += [(f"the proposer's own model's (#{i})", getattr(m, "allocator", None))
                  for i, m in enumerate(self.opened)]
        for label, allocator in pools:
            if allocator is None:
                continue
            held = allocator.num_blocks - allocator.num_free_blocks
            if held:
                raise self.fail("did not free every KV block", f"{held} of {label} {allocator.num_blocks} KV blocks "
                                f"are still held after every request finished ({what}): a sequence was forked, "
                                f"kept or dropped without `ctx.free`/`release`")


def _describe(params: SamplingParams) -> str:
    """A short description of a kit request's parameters."""
    kind = "greedy" if params.greedy else f"sampled (temperature {params.temperature}, seed {params.seed})"
    extra = [f"n={params.n}"] if params.n > 1 else []
    if params.strategy is not None:
        extra.append(f"strategy {params.strategy.name} {params.strategy.params}")
    return ", ".join([kind, *extra])


def _prompts(count: int, seed: int, repetitive: bool = True) -> list[list[int]]:
    """Token-id prompts (ids 3..383): random ones, and (`repetitive`) ones that repeat a phrase, so prompt lookup
    finds matches and speculation has something to verify."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = int(torch.randint(4, 10, (1,), generator=g))
        ids = torch.randint(3, TINY_VOCAB_SIZE, (n,), generator=g).tolist()
        out.append((ids * 4)[:24] if repetitive and i % 2 == 0 else ids)
    return out


_Outputs = list[tuple[list[int], str, str | None, str | int | None]]


def _outputs(out: RequestOutput) -> _Outputs:
    return [(list(o.token_ids), o.text, o.finish_reason, o.stop_reason) for o in out.outputs]


def _short(ids: list[int], limit: int = 12) -> str:
    return str(ids) if len(ids) <= limit else f"{ids[:limit]}... ({len(ids)} tokens)"


def _difference(a: _Outputs, b: _Outputs) -> str:
    """Where two requests' outputs first differ."""
    if len(a) != len(b):
        return f"{len(a)} outputs vs {len(b)}"
    for k, (x, y) in enumerate(zip(a, b)):
        for label, i in (("token ids", 0), ("finish reason", 2), ("stop reason", 3), ("text", 1)):
            if x[i] != y[i]:
                first = x[i] if label != "token ids" else _short(x[i])  # type: ignore[arg-type]
                second = y[i] if label != "token ids" else _short(y[i])  # type: ignore[arg-type]
                return f"output {k}: {label} {first!r} vs {second!r}"
    return "equal"


def _compare(harness: _Harness, rule: str, first: Sequence[RequestOutput], second: Sequence[RequestOutput],
             params: Sequence[SamplingParams], labels: tuple[str, str], scores: bool = False) -> None:
    """Raise naming the first request whose outputs differ between two runs (token ids, texts, finish and stop
    reasons; with `scores`, the strategies' scores within 1e-4)."""
    for i, (x, y) in enumerate(zip(first, second)):
        a, b = _outputs(x), _outputs(y)
        if a != b:
            raise harness.fail(rule, f"request {i} ({_describe(params[i])}): {labels[0]} vs {labels[1]}: "
                                     f"{_difference(a, b)}")
        if scores:
            for k, (p, q) in enumerate(zip(x.outputs, y.outputs)):
                if (p.score is None) != (q.score is None) or (
                        p.score is not None and q.score is not None
                        and not math.isclose(p.score, q.score, rel_tol=1e-4, abs_tol=1e-4)):
                    raise harness.fail(rule, f"request {i} ({_describe(params[i])}) output {k}: score {p.score} "
                                             f"({labels[0]}) vs {q.score} ({labels[1]})")


def _solo(harness: _Harness, prompts: Sequence[list[int]], params: Sequence[SamplingParams]) -> list[RequestOutput]:
    return [harness.generate([p], [sp], "alone")[0] for p, sp in zip(prompts, params)]


def _plan_error(harness: _Harness, params: SamplingParams) -> str | None:
    try:
        harness.resolve(params)
    except (DecodeKitError, ValueError) as exc:
        return str(exc)
    return None


# ---- stopping criteria ---------------------------------------------------------------------------------------------
def _snapshot(seq: EngineSequence) -> dict[str, Any]:
    """What a criterion reads and must leave alone: the sequence's tokens, text and status, and the request's
    parameters and prompt (`stash` and `state` are the plugins' own, for a criterion's per-sequence state)."""
    return {
        "token_ids": list(seq.token_ids), "num_prompt_tokens": seq.num_prompt_tokens, "text": seq.text,
        "new_text_len": seq.new_text_len, "status": seq.status, "finish_reason": seq.finish_reason,
        "stop_reason": seq.stop_reason, "draft_token_ids": list(seq.draft_token_ids),
        "detokenizer text": seq.detokenizer.text, "request params": seq.request.params.model_dump(),
        "request prompt": list(seq.request.prompt_token_ids),
    }


def _replay(harness: _Harness, stage: CriterionStage, plan: Any, params: SamplingParams, prompt: list[int],
            generated: list[int]) -> list[StopDecision | None]:
    """Call the criterion on `prompt + generated` token by token, as the stop stage does (the newest token
    detokenized first), on a fresh request and sequence; check each call's decision and that nothing changed."""
    tokenizer = harness.llm.tokenizer
    engine = harness.llm.engine
    request = Request(f"kit-replay-{next(_request_ids)}", None, list(prompt), params)
    request.plan = plan
    seq = EngineSequence(request, list(prompt), len(prompt))
    seq.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
    request.sequences.append(seq)
    decisions: list[StopDecision | None] = []
    for position, token in enumerate(generated):
        seq.token_ids.append(token)
        delta = seq.detokenizer.add([token])
        seq.new_text_len = len(delta)
        seq.text = seq.detokenizer.text
        before = _snapshot(seq)
        where = f"at generated token {position} of {_short(generated)} (prompt {_short(prompt)})"
        try:
            decision = stage.check(seq, params, engine.eos_token_ids)
        except Exception as exc:
            raise harness.fail(f"raised {exc!r}", where) from exc
        after = _snapshot(seq)
        changed = [key for key in before if before[key] != after[key]]
        if changed:
            key = changed[0]
            raise harness.fail(f"changed the sequence it was checking ({', '.join(changed)})",
                               f"{where}: {key} {before[key]!r} -> {after[key]!r}; a criterion only reads the "
                               f"sequence (per-sequence state goes in `seq.stash`)")
        if decision is not None:
            if not isinstance(decision, StopDecision):
                raise harness.fail("returned something that is not a StopDecision or None",
                                   f"{where}: {type(decision).__name__}")
            if decision.finish_reason not in ("stop", "length"):
                raise harness.fail("returned a finish reason other than 'stop' or 'length'",
                                   f"{where}: {decision.finish_reason!r}")
            cut = decision.truncate_text_at
            if cut is not None and (not isinstance(cut, int) or isinstance(cut, bool) or not 0 <= cut <= len(seq.text)):
                raise harness.fail("returned a truncate_text_at outside the text",
                                   f"{where}: {cut!r} for a text of {len(seq.text)} characters ({seq.text!r})")
        decisions.append(decision)
    return decisions


@_kit
def check_stopping_criterion(criterion: Any, options: dict[str, Any] | None = None, *, plugins: Iterable[object] = (),
                             params: dict[str, Any] | None = None, prompts: Sequence[list[int]] | None = None,
                             max_tokens: int = 24, seed: int = 0) -> KitReport:
    """Check a stopping criterion on real sequences, directly and in a tiny engine; raise `ConformanceError` on the
    first rule it breaks (see the module docstring).

    Args:
        criterion: its registered name, or a `StoppingCriterion` class or instance (registered under its `name`).
        options: its parameters (a criterion requests name in `stopping:`); None for a default criterion, which
            `params` switch on instead.
        plugins: the plugins that register it (modules or objects with `@hookimpl` functions).
        params: `SamplingParams` fields of every request the criterion serves (`{"stop": ["\\n"]}` for the
            default stop-string criterion, `{"min_tokens": 2}`, ...).
        prompts: token-id prompts (default: a few random and repetitive ones, ids 3..383).
        max_tokens: tokens per request.
        seed: varies the default prompts and the sampled requests' seeds.

    Returns:
        what was exercised; `stops` counts the replayed sequences it stopped (0: choose options that stop).
    """
    name, plugins = _named("stopping_criteria", criterion, plugins)
    harness = _Harness.build(plugins, f"stopping criterion {name!r}", draft="target")
    entry = harness.llm.engine.registry.stopping_criteria.get(name)
    if entry is None:
        raise harness.fail("is not registered", f"known: {sorted(harness.llm.engine.registry.stopping_criteria)}")
    fields = {"max_tokens": max_tokens, **(params or {})}
    if not entry.default:
        fields["stopping"] = [*fields.get("stopping", []), {name: options or {}}]
    elif options:
        raise ValueError(f"{name!r} is a default criterion: it takes no options (switch it on with `params=`)")
    greedy_fields = {"temperature": 0.0, **fields}
    greedy = SamplingParams(**greedy_fields)
    sampled = SamplingParams(**{**fields, "temperature": 0.8, "seed": 1000 + seed})
    prompts = list(prompts) if prompts is not None else _prompts(3, seed)
    try:
        plans = [harness.resolve(p) for p in (greedy, sampled)]
    except PlanError as exc:
        raise harness.fail("refused the kit's requests", str(exc)) from None
    stages = [next((c for c in plan.criteria if c.criterion.name == name), None) for plan in plans]
    if stages[0] is None or stages[1] is None:
        raise harness.fail("does not apply to the kit's requests",
                           "a default criterion applies where `is_active(params)`: pass `params=` that switch it on")

    # directly: real sequences, generated as the criterion's requests are (their processors apply) but with
    # nothing to stop them before max_tokens, replayed twice
    unstopped = {**fields, "ignore_eos": True, "stop": [], "stop_token_ids": [], "stopping": [], "strategy": None}
    stops = 0
    for plan, stage, request_params in zip(plans, stages, (greedy, sampled)):
        assert stage is not None
        source = SamplingParams(**{**unstopped, "temperature": request_params.temperature,
                                   "seed": request_params.seed})
        runs = harness.generate(prompts, [source] * len(prompts), "runs to replay, nothing stopping them")
        for prompt, run in zip(prompts, runs):
            first = _replay(harness, stage, plan, request_params, prompt, run.token_ids)
            second = _replay(harness, stage, plan, request_params, prompt, run.token_ids)
            if first != second:
                at = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
                raise harness.fail("is not deterministic: two replays of the same tokens got different decisions",
                                   f"generated token {at} of {_short(run.token_ids)}: {first[at]!r} vs "
                                   f"{second[at]!r} (does it depend on something besides the sequence, its "
                                   f"options and its own state in `seq.stash`?)")
            stops += any(d is not None for d in first)

    # in the engine: alone, batched with other requests, a second time, and under speculative decoding
    mine = [p for prompt in prompts for p in (greedy, sampled)]
    mine_prompts = [prompt for prompt in prompts for _ in (greedy, sampled)]
    others = [SamplingParams(temperature=0.0, max_tokens=max_tokens + 3, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=77 + seed, max_tokens=max(1, max_tokens - 5))]
    alone = _solo(harness, mine_prompts, mine)
    batch_prompts = [*mine_prompts, *(prompts[i % len(prompts)] for i in range(len(others)))]
    batch_params = [*mine, *others]
    batched = harness.generate(batch_prompts, batch_params, "batched")[: len(mine)]
    again = harness.generate(batch_prompts, batch_params, "batched, second run")[: len(mine)]
    _compare(harness, "gives different outputs on a second run", batched, again, mine, ("first run", "second run"))
    _compare(harness, "gives different outputs batched than alone", alone, batched, mine, ("alone", "batched"))
    skipped: list[str] = []
    draft_tokens = accepted = 0
    # the target as its own draft: every draft is accepted, so steps bring several tokens and a stop lands
    # inside a step's tokens
    spec = SamplingParams(**{**greedy_fields, "strategy": {"speculative": {"proposer": "draft",
                                                                           "num_speculative_tokens": 4}}})
    refused = _plan_error(harness, spec) if greedy.strategy is None else "the requests name their own strategy"
    if refused is None:
        spec_params = [spec] * len(prompts)
        speculative = harness.generate(prompts, spec_params, "speculative decoding")
        plain_greedy = [out for out, p in zip(alone, mine) if p.greedy]
        _compare(harness, "gives different outputs under speculative decoding (several tokens a step: those after "
                          "a stop must be dropped)", plain_greedy, speculative, spec_params,
                 ("without speculation", "with"))
        draft_tokens = sum(o.metrics.num_draft_tokens for o in speculative)
        accepted = sum(o.metrics.num_accepted_tokens for o in speculative)
    else:
        skipped.append(f"speculative decoding: {refused}")
    return KitReport(harness.requests, stops, draft_tokens, accepted, tuple(skipped))


# ---- proposers -----------------------------------------------------------------------------------------------------
@_kit
def check_proposer(proposer: Any, options: dict[str, Any] | None = None, *, plugins: Iterable[object] = (),
                   draft: Any = None, strategy: str = "speculative", num_speculative_tokens: int = 3,
                   prompts: Sequence[list[int]] | None = None, max_tokens: int = 16, seed: int = 0) -> KitReport:
    """Check that speculative decoding with a proposer is lossless and leaves nothing behind, in a tiny engine;
    raise `ConformanceError` on the first rule it breaks (see the module docstring).

    Args:
        proposer: its registered name, or a `Proposer` class or instance (registered under its `name`).
        options: its `proposer_options`.
        plugins: the plugins that register it (and `strategy`, when that is a plugin's).
        draft: the engine's draft model for a proposer that `needs_draft` (default: a tiny model of another
            architecture and seed, so drafts are sometimes rejected); `"target"`: the target model itself.
        strategy: the strategy that runs the proposer (its parameters: `proposer`, `proposer_options`,
            `num_speculative_tokens`).
        num_speculative_tokens: draft tokens per step.
        prompts: token-id prompts (default: a few random and repetitive ones).
        max_tokens: tokens per request.
        seed: varies the default prompts and the sampled requests' seeds.
    """
    name, plugins = _named("proposers", proposer, plugins)
    registry = Registry.from_plugin_manager(plugin_manager(*plugins))
    if name not in registry.proposers:
        raise ConformanceError(f"proposer {name!r} is not registered; known: {sorted(registry.proposers)}")
    if draft is None and getattr(registry.proposers[name].factory, "needs_draft", False):
        draft = _model("qwen2", 3)  # another model than the target: some drafts are rejected and rolled back
    harness = _Harness.build(plugins, f"proposer {name!r}", draft=draft)
    spec = {strategy: {"proposer": name, "proposer_options": options or {},
                       "num_speculative_tokens": num_speculative_tokens}}
    prompts = list(prompts) if prompts is not None else _prompts(4, seed)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    spec_greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, strategy=spec)
    error = _plan_error(harness, spec_greedy)
    if error is not None:
        raise harness.fail("refused the kit's requests", error)
    plain = harness.generate(prompts, [greedy] * len(prompts), "plain greedy")
    speculative = harness.generate(prompts, [spec_greedy] * len(prompts), "speculative greedy, batched")
    _compare(harness, f"is not lossless: speculative greedy decoding ({strategy}) gives other tokens than plain "
                      "greedy decoding", plain, speculative, [spec_greedy] * len(prompts), ("plain", "speculative"))
    sampled = [SamplingParams(temperature=0.8, seed=500 + seed + i, max_tokens=max_tokens, ignore_eos=True,
                              strategy=spec) for i in range(len(prompts))]
    alone = _solo(harness, prompts, sampled)
    mixed_prompts = [*prompts, *prompts]
    mixed = [*sampled, *([spec_greedy] * len(prompts))]
    mixed_prompts.append(prompts[0])
    mixed.append(SamplingParams(temperature=0.7, seed=9, max_tokens=max_tokens, ignore_eos=True))
    batched = harness.generate(mixed_prompts, mixed, "seeded sampled, batched")
    again = harness.generate(mixed_prompts, mixed, "seeded sampled, batched, second run")
    n = len(prompts)
    _compare(harness, "gives different tokens on a second run of seeded sampled requests", batched[:n], again[:n],
             sampled, ("first run", "second run"))
    _compare(harness, "gives a seeded sampled request different tokens alone and batched", alone, batched[:n],
             sampled, ("alone", "batched"))
    _compare(harness, "is not lossless when batched with sampled requests", plain, batched[n : 2 * n],
             [spec_greedy] * n, ("plain", "speculative"))
    runs = [*speculative, *alone, *batched, *again]
    drafted = sum(o.metrics.num_draft_tokens for o in runs)
    if drafted == 0:
        raise harness.fail("proposed no draft token on any of the kit's requests, so nothing was verified",
                           "pass `prompts=` on which it drafts")
    return KitReport(harness.requests, 0, drafted, sum(o.metrics.num_accepted_tokens for o in runs))


# ---- strategies ----------------------------------------------------------------------------------------------------
_VARIANTS: tuple[dict[str, Any], ...] = (
    {"temperature": 0.0},
    {"temperature": 0.8, "seed": 7},
    {"temperature": 0.8, "seed": 11, "n": 2},
)
"""The kinds of request `check_strategy` sends a strategy by default: greedy, seeded sampled, parallel sampled."""


def _others(harness: _Harness, max_tokens: int, seed: int) -> list[SamplingParams]:
    """Requests of other strategies to batch the strategy's with: plain greedy, parallel sampling and (when
    registered) beam search; those this engine's registry cannot plan are left out."""
    candidates = [
        SamplingParams(temperature=0.0, max_tokens=max_tokens + 3),
        SamplingParams(temperature=0.7, seed=31 + seed, max_tokens=max(1, max_tokens - 3), n=2),
        SamplingParams(temperature=0.0, max_tokens=max_tokens, strategy={"beam_search": {"num_beams": 2}}),
    ]
    return [p for p in candidates if _plan_error(harness, p) is None]


def _check_well_formed(harness: _Harness, outs: Sequence[RequestOutput], params: Sequence[SamplingParams],
                       expected: Sequence[int | None]) -> None:
    vocab = harness.llm.engine.vocab_size
    for i, (out, p, want) in enumerate(zip(outs, params, expected)):
        where = f"request {i} ({_describe(p)})"
        if want is not None and len(out.outputs) != want:
            raise harness.fail("returned another number of outputs than promised",
                               f"{where}: {len(out.outputs)} outputs, expected {want}")
        if not out.outputs:
            raise harness.fail("returned no output", where)
        for k, o in enumerate(out.outputs):
            if o.finish_reason not in ("stop", "length"):
                raise harness.fail("finished an output without a finish reason ('stop' or 'length')",
                                   f"{where} output {k}: {o.finish_reason!r}")
            bad = [t for t in o.token_ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise harness.fail("returned token ids outside the vocabulary", f"{where} output {k}: {bad[:8]}")
            if len(o.token_ids) > p.max_tokens:
                raise harness.fail("returned more tokens than max_tokens",
                                   f"{where} output {k}: {len(o.token_ids)} > {p.max_tokens}")


@_kit
def check_strategy(strategy: Any, options: dict[str, Any] | None = None, *, plugins: Iterable[object] = (),
                   params: Sequence[dict[str, Any]] | None = None, prompts: Sequence[list[int]] | None = None,
                   max_tokens: int = 10, draft: Any = None,
                   num_outputs: Callable[[Any, SamplingParams], int] | None = None, lossless: bool = False,
                   seed: int = 0) -> KitReport:
    """Check a search strategy in a tiny engine: the same outputs alone and batched with other strategies'
    requests and on a second run, well-formed outputs, every KV block freed; raise `ConformanceError` on the
    first rule it breaks (see the module docstring).

    Args:
        strategy: its registered name, or a `Strategy` class or instance (registered under its `name`).
        options: its parameters (`strategy: {name: options}`).
        plugins: the plugins that register it.
        params: the kinds of request to send it, as `SamplingParams` fields (default: greedy, seeded sampled, and
            seeded parallel sampling with n=2); kinds the strategy refuses when planned are skipped (and listed in
            the report), but it must accept one.
        prompts: token-id prompts (default: a few random and repetitive ones).
        max_tokens: tokens per request.
        draft: the engine's draft model, if the strategy needs one (`"target"`: the target model itself).
        num_outputs: how many outputs a request promises, given the validated options and its parameters (default:
            `params.n`).
        lossless: greedy requests must give exactly plain greedy decoding's tokens (speculative decoding).
        seed: varies the default prompts.
    """
    name, plugins = _named("strategies", strategy, plugins)
    harness = _Harness.build(plugins, f"strategy {name!r}", draft=draft)
    if name not in harness.llm.engine.registry.strategies:
        raise harness.fail("is not registered", f"known: {sorted(harness.llm.engine.registry.strategies)}")
    prompts = list(prompts) if prompts is not None else _prompts(3, seed)
    kinds: list[SamplingParams] = []
    skipped: list[str] = []
    for variant in params if params is not None else _VARIANTS:
        p = SamplingParams(**{"max_tokens": max_tokens, **variant, "strategy": {name: options or {}}})
        error = _plan_error(harness, p)
        if error is None:
            kinds.append(p)
        else:
            skipped.append(f"{_describe(p)}: {error}")
    if not kinds:
        raise harness.fail("refused every kind of request the kit sends", "; ".join(skipped))
    mine = [p for p in kinds for _ in prompts]
    mine_prompts = [prompt for _ in kinds for prompt in prompts]
    expected = []
    for p in mine:
        plan = harness.resolve(p)
        expected.append(num_outputs(plan.strategy_options, p) if num_outputs is not None else p.n)

    alone = _solo(harness, mine_prompts, mine)
    _check_well_formed(harness, alone, mine, expected)
    others = _others(harness, max_tokens, seed)
    batch_params: list[SamplingParams] = []
    batch_prompts: list[list[int]] = []
    order: list[int] = []  # where each of the strategy's requests sits in the mixed batch
    for i, (prompt, p) in enumerate(zip(mine_prompts, mine)):
        if others:  # interleave: the strategy's requests share every step with other strategies' requests
            batch_params.append(others[i % len(others)])
            batch_prompts.append(prompts[(i + 1) % len(prompts)])
        order.append(len(batch_params))
        batch_params.append(p)
        batch_prompts.append(prompt)
    first = harness.generate(batch_prompts, batch_params, "batched with other strategies")
    second = harness.generate(batch_prompts, batch_params, "batched, second run")
    batched, again = [first[j] for j in order], [second[j] for j in order]
    _check_well_formed(harness, batched, mine, expected)
    _compare(harness, "is not deterministic: the same seeds gave other outputs on a second run", batched, again,
             mine, ("first run", "second run"), scores=True)
    _compare(harness, "gives different outputs batched than alone (does it draw from the global RNG, or let "
                      "one request's state reach another?)", alone, batched, mine, ("alone", "batched"), scores=True)
    if lossless:
        greedy = [(prompt, p) for prompt, p in zip(mine_prompts, mine) if p.greedy]
        if not greedy:
            skipped.append("lossless: the strategy refused greedy requests")
        else:
            plain_params = [p.model_copy(update={"strategy": None}) for _, p in greedy]
            plain = harness.generate([g[0] for g in greedy], plain_params, "plain greedy")
            ours = [out for out, p in zip(alone, mine) if p.greedy]
            _compare(harness, "is not lossless: greedy requests give other tokens than plain greedy decoding",
                     plain, ours, [p for _, p in greedy], ("plain", name))
    runs = [*alone, *batched, *again]
    return KitReport(harness.requests, 0, sum(o.metrics.num_draft_tokens for o in runs),
                     sum(o.metrics.num_accepted_tokens for o in runs), tuple(skipped))
