"""What the engine kits (`stopping_kit`, `proposer_kit`, `strategy_kit`) share: a fresh tiny in-process engine per
kit call (`Harness`: the tiny model and tokenizer of `parts`, nothing downloaded) that runs requests with a step
budget and checks that every request left the engine and every KV block is free; a component given as a class or
an instance registered under its `name` (`registered_name`); the default prompts; comparing two runs' outputs; and
`KitReport`, what a kit exercised. Kits run on one torch thread (`on_one_thread`).

This module is a front-end (it builds `LLM`s); the processor kit, which needs no engine, is `processor_kit`.
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

from decodekit.api.errors import DecodeKitError
from decodekit.api.hookspecs import hookimpl
from decodekit.api.params import SamplingParams
from decodekit.api.sequence import RequestOutput
from decodekit.llm import LLM
from decodekit.models.tiny import tiny_model, tiny_tokenizer
from decodekit.testing.errors import ConformanceError
from decodekit.testing.parts import TINY_VOCAB_SIZE, plugin_manager

_KINDS = {"stopping_criteria": "stopping criterion", "proposers": "proposer", "strategies": "strategy"}
_request_ids = itertools.count()


def new_request_id(prefix: str = "kit") -> str:
    """A request id no other kit request has (`prefix-N`)."""
    return f"{prefix}-{next(_request_ids)}"


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


def registered_name(kind: str, component: Any, plugins: Iterable[object]) -> tuple[str, list[object]]:
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


def on_one_thread(function: Callable[..., KitReport]) -> Callable[..., KitReport]:
    """A kit runs on one torch thread (`_one_thread`)."""

    @wraps(function)
    def run(*args: Any, **kwargs: Any) -> KitReport:
        with _one_thread():
            return function(*args, **kwargs)

    return run


@lru_cache(maxsize=4)
def shared_tiny_model(arch: str, seed: int) -> Any:
    """A tiny model, shared by the kits' engines (they only read its weights)."""
    return tiny_model(arch, seed=seed)


@lru_cache(maxsize=1)
def _tokenizer() -> Any:
    return tiny_tokenizer()


@dataclass
class Harness:
    """A tiny engine for one kit call, with the models its proposers opened (their KV blocks are checked too)."""

    llm: LLM
    who: str
    opened: list[Any] = field(default_factory=list)
    requests: int = 0

    @classmethod
    def build(cls, plugins: Sequence[object], who: str, draft: Any = None, *, target: Any = None,
              tokenizer: Any = None, **engine_options: Any) -> Harness:
        """A fresh engine on `target` (default: the shared tiny Llama) and `tokenizer` (default: the tiny one);
        `draft="target"` drafts with the target itself, or with its quantized copy when `draft_quantization` is
        among the `engine_options`."""
        target = shared_tiny_model("llama", 0) if target is None else target
        self_copy = isinstance(draft, str) and draft == "target" and "draft_quantization" not in engine_options
        options = {"kv_cache_memory": "16MiB", "block_size": 4, "max_num_seqs": 64, **engine_options}
        llm = LLM(target, _tokenizer() if tokenizer is None else tokenizer, plugin_manager=plugin_manager(*plugins),
                  device="cpu", draft=target if self_copy else draft, **options)
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
        """The error for a rule the component broke: `<who> <rule>: <detail>`."""
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
            rid = new_request_id()
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
                raise self.fail(f"failed a request ({what}, request {i}: {describe_params(params[i])})",
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


def describe_params(params: SamplingParams) -> str:
    """A short description of a kit request's parameters."""
    kind = "greedy" if params.greedy else f"sampled (temperature {params.temperature}, seed {params.seed})"
    extra = [f"n={params.n}"] if params.n > 1 else []
    if params.strategy is not None:
        extra.append(f"strategy {params.strategy.name} {params.strategy.params}")
    return ", ".join([kind, *extra])


def kit_prompts(count: int, seed: int, repetitive: bool = True) -> list[list[int]]:
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


def short_ids(ids: list[int], limit: int = 12) -> str:
    """Token ids for a message: all of them, or the first `limit` and how many there are."""
    return str(ids) if len(ids) <= limit else f"{ids[:limit]}... ({len(ids)} tokens)"


def _difference(a: _Outputs, b: _Outputs) -> str:
    """Where two requests' outputs first differ."""
    if len(a) != len(b):
        return f"{len(a)} outputs vs {len(b)}"
    for k, (x, y) in enumerate(zip(a, b)):
        for label, i in (("token ids", 0), ("finish reason", 2), ("stop reason", 3), ("text", 1)):
            if x[i] != y[i]:
                first = x[i] if label != "token ids" else short_ids(x[i])  # type: ignore[arg-type]
                second = y[i] if label != "token ids" else short_ids(y[i])  # type: ignore[arg-type]
                return f"output {k}: {label} {first!r} vs {second!r}"
    return "equal"


def compare_outputs(harness: Harness, rule: str, first: Sequence[RequestOutput], second: Sequence[RequestOutput],
                    params: Sequence[SamplingParams], labels: tuple[str, str], scores: bool = False) -> None:
    """Raise naming the first request whose outputs differ between two runs (token ids, texts, finish and stop
    reasons; with `scores`, the strategies' scores within 1e-4)."""
    for i, (x, y) in enumerate(zip(first, second)):
        a, b = _outputs(x), _outputs(y)
        if a != b:
            raise harness.fail(rule, f"request {i} ({describe_params(params[i])}): {labels[0]} vs {labels[1]}: "
                                     f"{_difference(a, b)}")
        if scores:
            for k, (p, q) in enumerate(zip(x.outputs, y.outputs)):
                if (p.score is None) != (q.score is None) or (
                        p.score is not None and q.score is not None
                        and not math.isclose(p.score, q.score, rel_tol=1e-4, abs_tol=1e-4)):
                    raise harness.fail(rule, f"request {i} ({describe_params(params[i])}) output {k}: score "
                                             f"{p.score} ({labels[0]}) vs {q.score} ({labels[1]})")


def run_alone(harness: Harness, prompts: Sequence[list[int]],
              params: Sequence[SamplingParams]) -> list[RequestOutput]:
    """Run each request on its own, one after the other (what batched runs are compared with)."""
    return [harness.generate([p], [sp], "alone")[0] for p, sp in zip(prompts, params)]


def plan_error(harness: Harness, params: SamplingParams) -> str | None:
    """Why the engine refuses to plan `params`, or None when it accepts them."""
    try:
        harness.resolve(params)
    except (DecodeKitError, ValueError) as exc:
        return str(exc)
    return None
