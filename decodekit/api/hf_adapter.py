"""The adapter that runs transformers-style logits processors (`(input_ids, scores) -> scores`) per request, batched
over the rows that use them: `hf_logits_processor(instance)` through the Python API, `hf_processor(cls)` for a
plugin to register under a name for recipes (docs/transformers-processors.md). Re-exported by `decodekit`.
"""

from __future__ import annotations

import functools
import inspect
import operator
import re
import sys
import threading
import types
import typing
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, TypeAdapter, create_model

from decodekit.api.params import ComponentSpec, StrictParams
from decodekit.api.processors import NEG_INF, BatchView, LogitsProcessor

# ---- transformers logits processors (docs/transformers-processors.md) --------------------------------------------
# The adapter lives here rather than in its plugin module (`decodekit_plugins.hf_processors`, which registers
# `hf_logits_processor`): `decodekit` exports `hf_processor` and `hf_logits_processor`, and may not import its own
# plugins (tools/architecture_map.py), whereas a plugin may import `decodekit`.

HFCallable = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""A transformers-style logits processor: `(input_ids [batch, len] long, scores [batch, vocab] float) -> scores`
(`transformers.LogitsProcessor` and its subclasses, `LogitsProcessorList`, logits-processor-zoo's classes)."""

_ENGINE_ARGS = frozenset({"device", "tokenizer"})
"""Constructor arguments `hf_processor` fills from the engine instead of exposing them as parameters."""

_SHARED_INSTANCES = 256
"""How many transformers instances one `hf_processor` processor keeps for distinct parameters (least recently used
ones are dropped, and rebuilt when asked for again)."""


class HFProcessorAdapter(LogitsProcessor):
    """Runs transformers-style `(input_ids, scores) -> scores` logits processors on decodekit's rows: the base of
    `hf_logits_processor` (an instance, from Python) and of the processors `hf_processor` makes from a class.

    Each row is handed over as transformers' `generate` hands a sequence over: `input_ids` is the row's whole history
    (prompt plus generated ids, plus the drafted ids of a speculative row: `BatchView.histories[row]`) and `scores`
    its logits in float32 (float64 logits stay float64). Rows that get the same transformers instance and have
    histories of the same length go in one call, whatever requests they belong to; rows of different lengths never
    share a call, since padding their `input_ids` would change what the processor sees (a pad token would count as
    an n-gram or a repeat). The processor gets a copy of the logits (transformers processors often write in place)
    and every -inf it is given stays -inf.

    Subclasses implement `hf_instance`: which transformers instance serves a row with these options.
    """

    def __init__(self) -> None:
        self._tokenizer: Any = None
        self._device = torch.device("cpu")
        self._eos: tuple[int, ...] = ()

    def setup(self, info: Any) -> None:
        """Keep what transformers constructors may need from the engine: its tokenizer, device and EOS ids."""
        self._tokenizer = info.tokenizer
        self._device = torch.device(info.device)
        self._eos = tuple(info.eos_token_ids)

    def hf_instance(self, options: Any, device: torch.device, eos_token_ids: tuple[int, ...]) -> HFCallable:
        """The transformers processor that serves a row with these options, its logits on `device`."""
        raise NotImplementedError

    @staticmethod
    def instance_problem(value: Any) -> str | None:
        """Why `value` cannot be run as a transformers processor instance (a class, not callable), or None."""
        if isinstance(value, type):
            return (f"give an instance, e.g. `{value.__name__}(...)`, not the class (to name a class in recipes, "
                    f"register it with `decodekit.hf_processor`)")
        if not callable(value):
            hint = (" (a recipe cannot build Python objects: register the class with `decodekit.hf_processor` in a "
                    "plugin and name that)" if isinstance(value, (str, dict)) else "")
            return (f"must be a transformers logits processor instance, callable as `(input_ids, scores) -> "
                    f"scores`, not a {type(value).__name__}{hint}")
        return None

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        """Run each group of rows (same transformers instance, same history length) through its instance."""
        eos = tuple(batch.eos_token_ids)
        instances: dict[int, HFCallable] = {}
        per_options: dict[int, HFCallable] = {}  # rows of one request share its options: look them up once
        groups: dict[tuple[int, int], list[int]] = {}
        for row, options in enumerate(batch.options):
            instance = per_options.get(id(options))
            if instance is None:
                instance = per_options[id(options)] = self.hf_instance(options, logits.device, eos)
            instances[id(instance)] = instance
            groups.setdefault((id(instance), len(batch.histories[row])), []).append(row)
        if len(groups) == 1:  # the common case: every row in one call, no gather or scatter
            (((only, _), rows),) = groups.items()
            return _run_hf(instances[only], logits, [batch.histories[r] for r in rows], fresh=False)
        out = torch.empty_like(logits)
        for (instance_id, _), rows in groups.items():
            index = torch.tensor(rows, device=logits.device)
            part = _run_hf(instances[instance_id], logits.index_select(0, index),
                           [batch.histories[r] for r in rows], fresh=True)
            out.index_copy_(0, index, part)
        return out


def _run_hf(instance: HFCallable, logits: torch.Tensor, histories: list[list[int]], fresh: bool) -> torch.Tensor:
    """One transformers call on rows of equal history length; `fresh`: `logits` is already a copy of ours."""
    work = logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32  # generate's float32
    scores = logits.to(work, copy=not fresh)  # the processor may write into it: never the engine's tensor
    masked = torch.isneginf(scores)
    # shaped explicitly: an empty history would give a 1-d tensor (every history here has the same length)
    input_ids = torch.tensor(histories, dtype=torch.long).reshape(len(histories), len(histories[0]))
    input_ids = input_ids.to(logits.device)
    result = instance(input_ids, scores)
    if not isinstance(result, torch.Tensor) or result.shape != scores.shape:
        got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
        raise TypeError(f"transformers processor {type(instance).__name__} returned {got} for scores of shape "
                        f"{tuple(scores.shape)}")
    # an earlier stage removed those tokens; a transformers processor may not know that -inf means "removed"
    return result.to(logits.dtype).masked_fill(masked, NEG_INF)


def hf_logits_processor(processor: HFCallable, *, per_request: bool = False) -> ComponentSpec:
    """A request's processor entry that runs a transformers-style logits processor instance.

    The instance is called as transformers' `generate` calls it, batched over the rows that use it (see
    `HFProcessorAdapter`). By default it is shared by every row of every request given this entry: it must be a
    pure function of `(input_ids, scores)`, as transformers' own processors are. `per_request=True` gives each
    request a deep copy of it instead, for processors that keep state between calls (logits-processor-zoo's).

    Example:
        >>> import transformers
        >>> SamplingParams(processors=[hf_logits_processor(transformers.NoRepeatNGramLogitsProcessor(2))])

    Raises:
        TypeError: `processor` is a class, or is not callable.
    """
    problem = HFProcessorAdapter.instance_problem(processor)
    if problem is not None:
        raise TypeError(f"hf_logits_processor: {problem}")
    params: dict[str, Any] = {"processor": processor}
    if per_request:
        params["per_request"] = True
    return ComponentSpec(name="hf_logits_processor", params=params)  # decodekit_plugins.hf_processors


class HFClassParams(StrictParams):
    """The base of the `Params` models `hf_processor` derives from constructors (unknown keys refused); a
    request's own transformers instance (`per_request=True`) rides along in a private attribute."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    _hf_instance: Any = PrivateAttr(default=None)


@dataclass(frozen=True)
class _HFArg:
    """One constructor argument exposed as a parameter."""

    name: str  # the constructor's name for it (the key recipes use)
    field: str  # the `Params` field holding it (differs when the name shadows a pydantic attribute)
    positional_only: bool


class _HFClassAdapter(HFProcessorAdapter):
    """A processor `hf_processor` made: builds transformers instances of `hf_class` from each request's options."""

    hf_class: ClassVar[type]
    hf_args: ClassVar[tuple[_HFArg, ...]] = ()
    engine_args: ClassVar[frozenset[str]] = frozenset()
    eos_from_engine: ClassVar[bool] = False  # `eos_token_id` is required by the constructor: default to the model's
    per_request: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        self._shared: OrderedDict[Hashable, HFCallable] = OrderedDict()
        self._lock = threading.Lock()  # requests are planned on the caller's thread, stepped on the engine's

    def check_options(self, options: Any) -> None:
        """Build the transformers instance now, so that a value its constructor refuses fails the request (or the
        recipe) when it is planned, with the key path.

        Inside an engine the instance is built with the engine's device, tokenizer and EOS ids (`setup` ran
        before), and kept for the request. Without one (`decodekit recipe check`) it is built on the CPU, or not
        at all when the constructor needs what only an engine has (a tokenizer, the model's EOS ids).
        """
        if "tokenizer" in self.engine_args and self._tokenizer is None:
            return
        if self.eos_from_engine and not self._eos and getattr(options, "eos_token_id", None) is None:
            return
        self.hf_instance(options, self._device, self._eos)

    def hf_instance(self, options: Any, device: torch.device, eos_token_ids: tuple[int, ...]) -> HFCallable:
        """The request's own instance (`per_request`), else the instance shared by every request with the same
        parameters (built on first use; parameters that cannot be compared get a per-request instance)."""
        where = (str(device), eos_token_ids)
        frozen = None if self.per_request else _freeze([getattr(options, a.field) for a in self.hf_args])
        if frozen is None:
            cached = options._hf_instance
            if cached is None or cached[0] != where:
                cached = (where, self._build(options, device, eos_token_ids))
                options._hf_instance = cached
            return cached[1]
        key = (frozen, where)
        with self._lock:
            instance = self._shared.get(key)
            if instance is not None:
                self._shared.move_to_end(key)
                return instance
            instance = self._build(options, device, eos_token_ids)
            self._shared[key] = instance
            if len(self._shared) > _SHARED_INSTANCES:
                self._shared.popitem(last=False)
            return instance

    def _build(self, options: Any, device: torch.device, eos_token_ids: tuple[int, ...]) -> HFCallable:
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for arg in self.hf_args:
            value = getattr(options, arg.field)
            if arg.name == "eos_token_id" and value is None and self.eos_from_engine:
                if not eos_token_ids:
                    raise ValueError("`eos_token_id` is not set and the model has no end-of-sequence id")
                value = eos_token_ids[0] if len(eos_token_ids) == 1 else list(eos_token_ids)
            if arg.positional_only:
                args.append(value)
            else:
                kwargs[arg.name] = value
        if "device" in self.engine_args:
            kwargs["device"] = device
        if "tokenizer" in self.engine_args:
            if self._tokenizer is None:
                raise ValueError(f"{self.hf_class.__name__} needs the engine's tokenizer, and there is none")
            kwargs["tokenizer"] = self._tokenizer
        try:
            return cast(HFCallable, self.hf_class(*args, **kwargs))
        except Exception as exc:  # the constructor's own validation: a bad value in the request
            given = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items() if k != "tokenizer")])
            raise ValueError(f"{self.hf_class.__name__}({given}) failed: {exc}") from exc


def _freeze(value: Any) -> Hashable | None:
    """A hashable stand-in for a parameter value (its type included: 1 and 1.0 build different instances), or None
    for a value that cannot be compared reliably (a tensor, an arbitrary object)."""
    if value is None or isinstance(value, (str, bytes, int, float, bool)):
        return (type(value).__name__, value)
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_freeze(v) for v in value]
        if any(item is None for item in items):
            return None
        return (type(value).__name__, frozenset(items) if isinstance(value, (set, frozenset)) else tuple(items))
    if isinstance(value, dict):
        pairs = [(_freeze(k), _freeze(v)) for k, v in value.items()]
        return None if any(k is None or v is None for k, v in pairs) else ("dict", tuple(pairs))
    return None


def hf_processor(cls: type, *, name: str | None = None, per_request: bool = False) -> type[HFProcessorAdapter]:
    """A decodekit processor class for a transformers-style logits processor class, to register in a plugin.

    Its `Params` are the constructor's arguments (a pydantic model derived from the signature: required arguments
    required, defaults kept, annotations used where pydantic can check them and `Any` otherwise, descriptions
    from the class docstring's `Args:`; unknown keys are refused). Arguments the engine provides are not
    parameters: `device` (where the logits are) and `tokenizer` (the engine's); a required `eos_token_id` becomes
    optional and defaults to the model's end-of-sequence ids. `*args` and `**kwargs` are not exposed.

    Each distinct set of parameters gets one instance, shared by every request that gives those parameters (their
    rows of equal history length go in one call), so the class must be a pure function of `(input_ids, scores)`
    as transformers' own are. `per_request=True` builds one instance per request instead, for processors that
    keep state between calls.

    Example:
        >>> @hookimpl
        ... def decodekit_register_processors(register):
        ...     register("no_repeat_ngram_hf", hf_processor(transformers.NoRepeatNGramLogitsProcessor))

    then `processors: [{no_repeat_ngram_hf: {ngram_size: 2}}]` in a recipe.

    Args:
        cls: the transformers-style processor class.
        name: the processor's name in error messages, traces and `recipe explain`; give the name it is registered
            under (default: `hf:<class name>`).
        per_request: build one instance per request (stateful processors).
    """
    if not isinstance(cls, type):
        raise TypeError(f"hf_processor takes a class, got {type(cls).__name__} (to run an instance, use "
                        f"`hf_logits_processor(instance)` in the request's processors)")
    return _hf_class_adapter(cls, name or f"hf:{cls.__name__}", per_request)


@functools.cache
def _hf_class_adapter(cls: type, name: str, per_request: bool) -> type[HFProcessorAdapter]:
    """`hf_processor`'s work, once per class: plugins register on every registry build (every engine)."""
    try:
        signature = inspect.signature(cls, eval_str=True)
    except Exception:  # an annotation that names something only imported for type checkers
        signature = inspect.signature(cls)
    namespace = vars(sys.modules[cls.__module__]) if cls.__module__ in sys.modules else {}
    described = _arg_descriptions(cls.__doc__ or "")
    fields: dict[str, Any] = {}
    hf_args: list[_HFArg] = []
    engine_args: set[str] = set()
    eos_from_engine = False
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.name in _ENGINE_ARGS:
            engine_args.add(param.name)
            continue
        annotation = _pydantic_type(param.annotation, namespace)
        description = described.get(param.name)
        default = param.default
        if default is param.empty and param.name == "eos_token_id":
            eos_from_engine, default = True, None
            description = (description + " " if description else "") + "(default: the model's end-of-sequence ids)"
        if default is None and annotation is not Any:
            annotation = annotation | None
        field = f"{param.name}_" if hasattr(BaseModel, param.name) else param.name  # `json`, `copy`, `schema`, ...
        info = Field(description=description, alias=param.name if field != param.name else None)
        if default is not param.empty:
            info = Field(default, description=description, alias=param.name if field != param.name else None)
        fields[field] = (annotation, info)
        hf_args.append(_HFArg(param.name, field, param.kind is param.POSITIONAL_ONLY))
    params = create_model(f"{cls.__name__}Params", __base__=HFClassParams, __module__=__name__, **fields)
    params.__doc__ = f"Parameters of `{name}`: the arguments of `{cls.__module__}.{cls.__qualname__}`."
    summary = _summary(cls.__doc__) or f"The transformers-style processor `{cls.__name__}`"
    doc = (f"{summary.rstrip('.')} (`{cls.__name__}`, run by `decodekit.hf_processor`).\n\n"
           + ("One instance per request." if per_request else "One instance per distinct set of parameters."))
    attrs = {"__doc__": doc, "__module__": __name__, "__qualname__": f"HF{cls.__name__}", "name": name,
             "Params": params, "hf_class": cls, "hf_args": tuple(hf_args), "engine_args": frozenset(engine_args),
             "eos_from_engine": eos_from_engine, "per_request": per_request}
    return cast("type[HFProcessorAdapter]", type(f"HF{cls.__name__}", (_HFClassAdapter,), attrs))


def _pydantic_type(annotation: Any, namespace: dict[str, Any]) -> Any:
    """The annotation when pydantic can validate it and describe it in a JSON schema; for a union, the members it
    can (a recipe cannot give a tensor anyway); `Any` otherwise."""
    if isinstance(annotation, str):
        try:
            annotation = eval(annotation, namespace)  # a string annotation, resolved where the class was defined
        except Exception:
            return Any
    if annotation is inspect.Parameter.empty:
        return Any
    if _schema_ok(annotation):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kept = [a for a in typing.get_args(annotation) if _schema_ok(a)]
        if kept:
            return functools.reduce(operator.or_, kept)
    return Any


def _schema_ok(annotation: Any) -> bool:
    try:
        TypeAdapter(annotation).json_schema()
    except Exception:
        return False
    return True


_DOC_ARG = re.compile(r"^(\s*)(\w+)\s*\((.*)\)\s*:\s*(.*)$")  # `name (type): text` (Google and numpy-ish styles)
_DOC_LINK = re.compile(r"\[`~?([\w.]+)`\]")  # transformers' cross-references: [`LogitsProcessor`]


def _arg_descriptions(doc: str) -> dict[str, str]:
    """Each argument's description in a class docstring (`name (type): text`, continued on more indented lines)."""
    lines = inspect.cleandoc(doc).splitlines()
    out: dict[str, str] = {}
    for i, line in enumerate(lines):
        match = _DOC_ARG.match(line)
        if match is None or match.group(2) in out:
            continue
        indent = len(match.group(1))
        text = [match.group(4)] if match.group(4) else []
        for more in lines[i + 1 :]:
            if not more.strip() or len(more) - len(more.lstrip()) <= indent:
                break
            text.append(more.strip())
        if text:
            out[match.group(2)] = _DOC_LINK.sub(r"\1", " ".join(text))
    return out


def _summary(doc: str | None) -> str:
    """The first sentence of a docstring, on one line (transformers' first sentences run over several lines)."""
    paragraph = " ".join(inspect.cleandoc(doc or "").split("\n\n", 1)[0].split())
    sentence = re.split(r"(?<=\.)\s", paragraph, maxsplit=1)[0]
    return _DOC_LINK.sub(r"\1", sentence).strip()
