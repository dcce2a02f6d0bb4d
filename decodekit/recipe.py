"""Recipes: one YAML file naming a model (and a draft model), engine limits, sampling defaults, an ordered list of
logits processors, stopping criteria, a search strategy, the inputs and the outputs.

A recipe is validated completely when it loads, before any model is loaded: its shape by pydantic
(`extra="forbid"` everywhere, so typos are refused), then every named plugin and its parameters by resolving the
default `SamplingParams` against the registry (`decodekit.core.plan.Components.resolve`), which also refuses
incompatible combinations. Every failure is a `RecipeError` whose message starts with the file and the key:
`recipes/x.yaml: processors[1].repetition_penalty.penalty: Input should be greater than 0, got -1`.

A recipe only names registered plugins; it is read with a safe YAML loader, so nothing in it executes code. The
syntax side (YAML, `--set` overrides, error messages) is in `decodekit.recipe_syntax`.

Example:
    >>> recipe = load_recipe("recipes/sampling.yaml", overrides=["sampling.temperature=0"])
    >>> llm = recipe.build_llm()
    >>> llm.generate("Once upon a time", recipe.params_for({"max_tokens": 32}))
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pluggy
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from decodekit.api.config import TARGET_DRAFT, EngineConfig
from decodekit.api.errors import ConfigError, DecodeKitError, RecipeError
from decodekit.api.params import SAMPLING_ALIASES, ComponentSpec, ReasoningParams, SamplingParams
from decodekit.core.plan import Components, Plan
from decodekit.core.registry import Registry
from decodekit.recipe_syntax import apply_override, format_validation_errors, parse_yaml, read_text_capped

if TYPE_CHECKING:  # the plan imports torch; `decodekit --help` reads recipes' field docs without it
    from decodekit.execution.plan import ExecutionPlan

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
COMPONENT_KEYS = ("processors", "stopping", "strategy")
TOP_LEVEL_KEYS = (*COMPONENT_KEYS, "reasoning")
"""`SamplingParams` fields a recipe sets at its top level, not under `sampling`."""
MAX_RECIPE_BYTES = 1 << 20
"""A recipe file larger than this (1 MiB) is refused before parsing; recipes are hand-written, prompts go in files."""
_SPECS: TypeAdapter[list[ComponentSpec]] = TypeAdapter(list[ComponentSpec])
_SPEC: TypeAdapter[ComponentSpec | None] = TypeAdapter(ComponentSpec | None)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class DraftConfig(_Section):
    """The draft model of speculative decoding (it must share the target model's tokenizer)."""

    model: str = Field(description="Draft model: bundled name, local folder, .gguf file or hub id; `target` for a "
                       "quantized copy of the target model itself (with `quantization`).")
    dtype: Dtype = Field("auto", description="The draft's dtype.")
    quantization: Literal["int8", "bf16", "q4_0", "q4_1", "q8_0"] | None = Field(
        None, description="Run the draft on int8, bf16 or GGUF-block (q4_0, q4_1, q8_0) copies of its weights (see "
        "the engine's `quantization`); required with `model: target`.")

    @model_validator(mode="after")
    def _check_target(self) -> DraftConfig:
        if self.model == TARGET_DRAFT and self.quantization is None:
            raise ValueError("`model: target` drafts with the target's own weights, which only pays when they run "
                             "faster: add `quantization: int8` (or q4_1)")
        return self


class InputsConfig(_Section):
    """Where a recipe's prompts come from (the command line's --prompt/--prompts replace them)."""

    chat: bool = Field(False, description="Wrap each prompt in the model's chat template.")
    system: str | None = Field(None, description="System prompt (with chat: true).")
    prompts: list[str] = Field(default_factory=list, description="Prompts, each one request.")
    file: str | None = Field(
        None, description="A .jsonl (one request object per line) or .txt (one prompt per line) file, relative to "
        "the recipe file.")

    tools: list[dict[str, Any]] | None = Field(
        None, description="Function tools every chat prompt may call (OpenAI's shape: {type: function, function: "
        "{name, description, parameters}}); calls are constrained to parse and validate (with chat: true).")
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="With tools: auto (text or calls, the default), required, none, or {type: function, "
        "function: {name: ...}}.")
    parallel_tool_calls: bool | None = Field(None, description="With tools: false allows one call per reply.")
    tool_format: str = Field("auto", description="The tool-call format calls are written in (a registered one: "
                             "json, hermes, llama3_json, mistral, ...); auto: the model's chat template's, else json.")

    @field_validator("system")
    @classmethod
    def _system_needs_chat(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("chat") is False:
            raise ValueError("a system prompt needs chat: true (it goes into the chat template)")
        return value

    @model_validator(mode="after")
    def _check_tools(self) -> InputsConfig:
        from decodekit.tool_calling import ToolRequestError, choose_tools, tool_specs

        if self.tools is None:
            if self.tool_choice not in (None, "none"):
                raise ValueError("tool_choice: asks for a tool call, but there are no tools")
            return self
        if not self.chat:
            raise ValueError("tools need chat: true (the chat template renders the conversation the calls end)")
        try:
            specs = tool_specs(self.tools)
            if self.tool_choice != "none":
                choose_tools(specs, self.tool_choice)
        except ToolRequestError as exc:
            raise ValueError(str(exc)) from None
        return self


class OutputsConfig(_Section):
    """What a run writes and reports besides the summary."""

    file: str | None = Field(None, description="Write one JSON line per request here (relative to the working "
                                               "directory; --output overrides it).")
    compare_plain: bool = Field(False, description="Also run the prompts with the plain `sample` strategy (same "
                                                   "processors) and report the speedup (runs A B B A).")


class Recipe(_Section):
    """A whole recipe. Build one with `load_recipe` (which also checks the plugin names and parameters)."""

    description: str | None = Field(None, description="What the recipe shows (one line).")
    model: str = Field(description="Model: bundled name, local folder, .gguf file or hub id.")
    dtype: Dtype = Field("auto", description=(
        "auto (bf16 on CUDA and on a CPU with bf16 dot products: AVX512-BF16 or AMX; float32 on other CPUs), "
        "float32, bfloat16, float16."))
    device: str | None = Field(None, description="cpu or cuda (default: cuda when available).")
    draft: DraftConfig | None = Field(None, description="A draft model for speculative decoding.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Engine limits and memory.")
    sampling: SamplingParams = Field(default_factory=SamplingParams,
                                     description="Default sampling parameters of every request.")
    processors: list[ComponentSpec] = Field(default_factory=list, description="Logits processors, in order.")
    stopping: list[ComponentSpec] = Field(default_factory=list, description="Extra stopping criteria.")
    strategy: ComponentSpec | None = Field(None, description="Search strategy (default: sample).")
    reasoning: ReasoningParams | None = Field(None, description="Phase-aware decoding for a reasoning model: its "
                                              "format, and per phase (thinking, answer) a budget, a wrap-up message, "
                                              "sampling and processors (docs/reasoning.md).")
    inputs: InputsConfig = Field(default_factory=InputsConfig, description="The prompts.")
    outputs: OutputsConfig = Field(default_factory=OutputsConfig, description="What to write and report.")

    _source: Path | None = PrivateAttr(None)

    @field_validator("engine", mode="before")
    @classmethod
    def _memory_is_text_or_bytes(cls, value: Any) -> Any:
        # `EngineConfig`'s size parser raises TypeError (not a validation error) on other types
        memory = value.get("kv_cache_memory", 0) if isinstance(value, dict) else 0
        if isinstance(memory, bool) or not isinstance(memory, (int, str)):
            raise ValueError(f"kv_cache_memory: expected a size like 1GiB or 512MB, got {memory!r}")
        return value

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str | None) -> str | None:
        if value is None:
            return value
        import torch

        try:
            torch.device(value)
        except (RuntimeError, TypeError):
            raise ValueError(f"not a device torch knows; use cpu or cuda (cuda:N), got {value!r}") from None
        return value

    @model_validator(mode="after")
    def _target_draft_dtype(self) -> Recipe:
        # `model: target` drafts with the target's own weights, loaded once in the target's dtype: a dtype of its
        # own cannot apply (the Python API refuses `draft_dtype` there too), and dropping it silently would mislead
        draft = self.draft
        if draft is not None and draft.model == TARGET_DRAFT and draft.dtype not in ("auto", self.dtype):
            raise ValueError(f"draft.dtype: `model: target` drafts with the target's own weights, in the target's "
                             f"dtype ({self.dtype}); remove draft.dtype ({draft.dtype}) or set the top-level dtype")
        return self

    @field_validator("sampling")
    @classmethod
    def _components_at_top_level(cls, value: SamplingParams) -> SamplingParams:
        misplaced = sorted(value.model_fields_set & set(TOP_LEVEL_KEYS))
        if misplaced:
            raise ValueError(f"set {', '.join(misplaced)} at the recipe's top level, not under sampling")
        return value

    @property
    def source(self) -> str:
        """The recipe's file as given (or "<recipe>" for one built from a mapping), for messages."""
        return str(self._source) if self._source is not None else "<recipe>"

    @property
    def base_dir(self) -> Path:
        """The folder relative paths in the recipe (inputs.file) are resolved against."""
        return self._source.parent if self._source is not None else Path.cwd()

    def default_params(self) -> SamplingParams:
        """The `SamplingParams` every request starts from: `sampling` plus processors, stopping and strategy."""
        fields = self.sampling.model_dump(exclude_unset=True)
        return SamplingParams.model_validate(
            {**fields, "processors": self.processors, "stopping": self.stopping, "strategy": self.strategy,
             "reasoning": self.reasoning})

    def params_for(self, override: Mapping[str, Any] | None = None, sampling_key: str = "") -> SamplingParams:
        """A request's parameters: the recipe's defaults with `override` merged over them (see `merge_params`;
        `sampling_key`: where the override's sampling fields sit in the input, for messages)."""
        return merge_params(self.default_params(), override or {}, sampling_key)

    def engine_options(self) -> dict[str, Any]:
        """The `EngineConfig` fields the recipe sets (the engine's defaults apply to the rest)."""
        return self.engine.model_dump(exclude_unset=True)

    def build_llm(self, plugin_manager: pluggy.PluginManager | None = None) -> Any:
        """Load the recipe's model (and draft) into an `LLM`."""
        from decodekit.llm import LLM

        options = self.engine_options()
        if self.draft is not None and self.draft.quantization is not None:
            options["draft_quantization"] = self.draft.quantization
        draft_dtype = self.draft.dtype if self.draft and self.draft.model != TARGET_DRAFT else None
        return LLM(self.model, dtype=self.dtype, device=self.device, plugin_manager=plugin_manager,
                   draft=self.draft.model if self.draft else None, draft_dtype=draft_dtype, **options)


def plain_params(params: SamplingParams) -> SamplingParams:
    """The same request with the plain `sample` strategy (what `outputs.compare_plain` measures against)."""
    return params.model_copy(update={"strategy": ComponentSpec(name="sample")})


def merge_params(base: SamplingParams, override: Mapping[str, Any], sampling_key: str = "") -> SamplingParams:
    """Merge a request's overrides over recipe defaults.

    `override` holds `SamplingParams` fields (or their transformers aliases, `SAMPLING_ALIASES`); each replaces the
    default (`max_new_tokens` replaces the recipe's `max_tokens`). `processors` and `stopping` entries
    named in both keep the recipe's position with their parameters merged (the override's win); new names are
    appended. `strategy` replaces the recipe's.

    `sampling_key` is where the override's sampling fields sit in the input (`sampling` on a prompts-file line),
    for the key paths of messages.

    Raises:
        RecipeError: an override is not a valid field or value (the message names the key).
    """
    if not isinstance(override, Mapping):
        raise RecipeError(f"overrides must be a mapping of sampling fields, got {type(override).__name__}")
    fields = base.model_dump(exclude_unset=True, exclude=set(COMPONENT_KEYS))
    for alias, target in SAMPLING_ALIASES.items():
        # an override in transformers' spelling replaces the recipe's value of the field it stands for (the base is
        # already in decodekit's names); `do_sample: true` keeps the recipe's temperature, so it stays to be checked
        if alias in override and not (alias == "do_sample" and override[alias] is True):
            fields.pop(target, None)
    fields.update({k: v for k, v in override.items() if k not in COMPONENT_KEYS})
    if base.reasoning is not None and isinstance(override.get("reasoning"), Mapping):
        fields["reasoning"] = merge_reasoning(base.reasoning, override["reasoning"])
    merged: dict[str, Any] = {
        "processors": _merge_specs(base.processors, override.get("processors"), "processors"),
        "stopping": _merge_specs(base.stopping, override.get("stopping"), "stopping"),
        "strategy": base.strategy,
    }
    if "strategy" in override:
        merged["strategy"] = _validate(_SPEC, override["strategy"], "strategy", ComponentSpec | None)
    try:
        return SamplingParams.model_validate({**fields, **merged})
    except ValidationError as exc:
        prefix = (sampling_key,) if sampling_key else ()
        raise RecipeError(format_validation_errors(exc, SamplingParams, prefix=prefix)) from None


def merge_reasoning(base: ReasoningParams, override: Mapping[str, Any]) -> dict[str, Any]:
    """A request's `reasoning` over the recipe's: `format` replaced, each phase's settings merged key by key (its
    `processors` appended to the recipe's, its `sampling` merged field by field)."""
    merged: dict[str, Any] = base.model_dump()
    for key, value in override.items():
        phase = merged.get(key)
        if key == "format" or not isinstance(value, Mapping) or not isinstance(phase, dict):
            merged[key] = value
            continue
        merged[key] = {**phase, **value, "sampling": {**phase["sampling"], **dict(value.get("sampling") or {})},
                       "processors": [*phase["processors"], *list(value.get("processors") or [])]}
    return merged


def _merge_specs(base: list[ComponentSpec], override: Any, key: str) -> list[ComponentSpec]:
    if override is None:
        return list(base)
    merged = list(base)
    for spec in _validate(_SPECS, override, key, list[ComponentSpec]):
        at = next((i for i, s in enumerate(merged) if s.name == spec.name), None)
        if at is None:
            merged.append(spec)
        else:
            merged[at] = ComponentSpec(name=spec.name, params={**merged[at].params, **spec.params})
    return merged


def _validate(adapter: TypeAdapter[Any], value: Any, key: str, root: Any) -> Any:
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        raise RecipeError(format_validation_errors(exc, root, prefix=(key,))) from None


# ---- loading ----------------------------------------------------------------------------------------------------
def load_recipe(path: str | Path, overrides: Sequence[str] = (), *,
                plugin_manager: pluggy.PluginManager | None = None, registry: Registry | None = None) -> Recipe:
    """Read, override (`key.path=value` items, as `--set` gives them) and fully validate a recipe file.

    Raises:
        RecipeError: the file is missing, too large (`MAX_RECIPE_BYTES`), not UTF-8 or not valid YAML (with the
            line), its aliases expand too far, a key is unknown, a value is invalid, a plugin name is unknown, or the
            combination cannot run.
    """
    source = Path(path)
    text = read_text_capped(source, MAX_RECIPE_BYTES, "recipe")
    return recipe_from_data(parse_yaml(text, str(source)), overrides, source=source, plugin_manager=plugin_manager,
                            registry=registry)


def recipe_from_data(data: Any, overrides: Sequence[str] = (), *, source: Path | None = None,
                     plugin_manager: pluggy.PluginManager | None = None, registry: Registry | None = None) -> Recipe:
    """Validate an already-parsed recipe mapping (see `load_recipe`)."""
    label = str(source) if source is not None else "<recipe>"
    if not isinstance(data, dict):
        got = "an empty file" if data is None else type(data).__name__
        raise RecipeError(f"{label}: a recipe is a mapping of keys (model, sampling, processors, ...), got {got}")
    for item in overrides:
        data = apply_override(data, item)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(format_validation_errors(exc, Recipe, label)) from None
    recipe._source = source
    if recipe.inputs.file is not None and not (recipe.base_dir / recipe.inputs.file).is_file():
        raise RecipeError(f"{label}: inputs.file: no such file {str(recipe.base_dir / recipe.inputs.file)!r}")
    check_recipe(recipe, registry or _registry(plugin_manager))
    return recipe


def _registry(plugin_manager: pluggy.PluginManager | None) -> Registry:
    from decodekit.core.plugin_manager import get_plugin_manager

    return Registry.from_plugin_manager(plugin_manager or get_plugin_manager())


def check_recipe(recipe: Recipe, registry: Registry) -> Plan:
    """Resolve the recipe's default request (and its plain comparison) against the registry; return the plan.

    Raises:
        RecipeError: an unknown plugin name (the known ones listed), invalid plugin parameters, a strategy that
            refuses the combination, or a proposer that needs a draft model the recipe does not give.
    """
    components = Components(registry)
    try:
        params = recipe.default_params()
        plan = components.resolve(params)
        if recipe.outputs.compare_plain:
            components.resolve(plain_params(params))
    except (DecodeKitError, ValueError) as exc:  # PlanError, or a plugin's own ValueError
        raise RecipeError(f"{recipe.source}: {exc}") from None
    if recipe.draft is None:  # without a model loaded, a proposer cannot see that the engine would have no draft
        for proposer in components.built("proposers"):
            if getattr(proposer, "needs_draft", False):
                raise RecipeError(f"{recipe.source}: strategy.{plan.strategy.name}: proposer {proposer.name!r} needs "
                                  "a draft model: add `draft: {model: <a smaller model with the same tokenizer>}`")
    return plan


def check_models(recipe: Recipe, registry: Registry) -> dict[str, str]:
    """Resolve the recipe's `model` (and `draft.model`) to the loader that would load it, loading nothing
    (`decodekit.models.resolve_model`: the bundled name, an existing .gguf file, a folder with a config.json, a hub id
    in the local Hugging Face cache, or a spec a plugin's loader accepts). Returns each key's loader name.

    Raises:
        RecipeError: no loader accepts a model, or its loader's check refused it; the message names the key and
            says what would be accepted.
    """
    from decodekit.models import resolve_model

    specs = {"model": recipe.model}
    if recipe.draft is not None and recipe.draft.model != TARGET_DRAFT:
        specs["draft.model"] = recipe.draft.model
    found = {}
    for key, spec in specs.items():
        try:
            found[key] = resolve_model(spec, registry.model_loaders).name
        except DecodeKitError as exc:
            raise RecipeError(f"{recipe.source}: {key}: {exc}") from None
    if "draft.model" in specs:  # a draft must share the target's vocabulary; compared where configs tell it cheaply
        from decodekit.models.loader import peek_vocab_size

        target, draft = peek_vocab_size(specs["model"]), peek_vocab_size(specs["draft.model"])
        if target is not None and draft is not None and target != draft:
            raise RecipeError(f"{recipe.source}: draft.model: {specs['draft.model']!r} has a vocabulary of {draft} "
                              f"ids and the target {specs['model']!r} {target}; speculative decoding needs a draft "
                              "with the target's tokenizer")
    return found


def dtype_choice(recipe: Recipe) -> str | None:
    """Where the recipe leaves the dtype to `auto`: the dtype its model will load in on this machine and why (what
    `run` logs as it loads: `models.loader.auto_dtype`), e.g. "dtype: auto -> bfloat16 on cpu (this CPU has bf16
    ..."; None for a dtype the recipe names."""
    import torch

    from decodekit.models.loader import STORED_AUTO_REASON, auto_dtype, auto_stored_loader

    if recipe.dtype != "auto":
        return None
    device = torch.device(recipe.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    chosen, why = auto_dtype(device)
    if auto_stored_loader(recipe.model, device) is not None:
        chosen, why = torch.float32, STORED_AUTO_REASON
    return f"dtype: auto -> {str(chosen).removeprefix('torch.')} on {device.type} ({why})"


@dataclass(frozen=True)
class MachineCheck:
    """What `check_machine` found: notes on what it could not check, and how the model will run here (the plan
    `run` makes when it builds the engine; None where the model's config.json is not on disk yet)."""

    notes: list[str]
    plan: ExecutionPlan | None = None


def check_machine(recipe: Recipe) -> MachineCheck:
    """The checks `run` makes when it builds the engine that need no model loaded: the device exists on this
    machine, `engine.cuda_graphs: true` has a CUDA device (and the fused decoder) to run on, and, where the model's
    config.json is on disk, the engine's own plan of how the model (and its draft) runs here
    (`execution.plan.plan_from_config`: every `engine` option it refuses is refused now) and that
    `engine.kv_cache_memory` holds at least two KV blocks of it.

    Raises:
        RecipeError: the recipe cannot run here; the message names the file and the key.
    """
    import torch

    where = recipe.source
    device = torch.device(recipe.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RecipeError(f"{where}: device: {recipe.device!r} was asked for, but this torch build sees no CUDA device "
                          "(torch.cuda.is_available() is False); use device: cpu or leave it unset")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise RecipeError(f"{where}: device: 'mps' was asked for, but this machine has no MPS device; use device: "
                          "cpu or leave it unset")
    engine = recipe.engine
    if engine.cuda_graphs:
        reason = (f"they need the model on a CUDA device, not {device}" if device.type != "cuda"
                  else "they capture the fused decoder, which engine.fused_decoder: false turns off"
                  if engine.fused_decoder is False else None)
        if reason is not None:
            raise RecipeError(f"{where}: engine.cuda_graphs: {reason}; set cuda_graphs to false or leave it unset")
    memory, block = engine.kv_cache_memory, engine.block_size
    if memory < 2 * block * _MIN_KV_BYTES_PER_SLOT:  # too small for any model
        raise RecipeError(f"{where}: engine.kv_cache_memory: {memory} bytes cannot hold 2 KV blocks of "
                          f"{block} tokens for any model; raise it (e.g. 256MiB)")
    plan = _plan(recipe, device)
    if plan is None:
        if "://" in recipe.model:  # a plugin's model loader: its models have no config.json to read, nothing to say
            return MachineCheck([])
        return MachineCheck([f"engine.kv_cache_memory: not checked against the model's KV size, nor how the model "
                             f"runs here ({recipe.model!r} has no config.json on disk that transformers can build "
                             "yet); `decodekit run` checks both when the model loads"])
    _check_kv_memory(recipe, plan)
    return MachineCheck([], plan)


_MIN_KV_BYTES_PER_SLOT = 4
"""The least one token slot of the KV pool can cost: one layer, one KV head of size 1, keys and values, 2 bytes."""


def _plan(recipe: Recipe, device: Any) -> ExecutionPlan | None:
    """The engine's plan for the recipe's model (and draft) on `device`, from their config.json files."""
    import torch

    from decodekit.execution.plan import plan_from_config
    from decodekit.models.loader import auto_stored_loader, default_dtype, peek_config

    config = peek_config(recipe.model)
    if config is None:
        return None
    dtype = default_dtype(device) if recipe.dtype == "auto" else getattr(torch, recipe.dtype)
    # a GGUF under dtype auto on a CPU: float32, with the file's quantized weights as stored (read, not loaded)
    keeper = auto_stored_loader(recipe.model, device) if recipe.dtype == "auto" else None
    stored = None
    if keeper is not None and keeper.stored is not None:
        dtype, stored = torch.float32, functools.partial(keeper.stored, recipe.model)
    options = recipe.engine
    draft_config, draft_dtype, self_draft = None, None, False
    if recipe.draft is not None:
        options = options.model_copy(update={"draft_quantization": recipe.draft.quantization})
        self_draft = recipe.draft.model == TARGET_DRAFT
        if not self_draft:
            draft_config = peek_config(recipe.draft.model)
            if draft_config is None:
                return None
            draft_dtype = (default_dtype(device) if recipe.draft.dtype == "auto"
                           else getattr(torch, recipe.draft.dtype))
    try:
        return plan_from_config(config, recipe.model, dtype, device, options, draft_config, draft_dtype, self_draft,
                                stored)
    except ConfigError as exc:  # its message starts with the option's name
        raise RecipeError(f"{recipe.source}: engine.{exc}") from None
    except DecodeKitError as exc:  # the model itself (an attention decodekit does not page)
        raise RecipeError(f"{recipe.source}: model: {exc}") from None


def _check_kv_memory(recipe: Recipe, plan: ExecutionPlan) -> None:
    engine, where = recipe.engine, recipe.source
    memory, block = engine.kv_cache_memory, engine.block_size
    geometry, element = plan.geometry, plan.kv_dtype
    layers, kv_heads, head_dim = geometry.num_layers, geometry.num_kv_heads, geometry.head_dim
    per_block = plan.kv_block_bytes()
    if memory // per_block < 2:
        raise RecipeError(f"{where}: engine.kv_cache_memory: {memory} bytes holds fewer than 2 KV blocks of "
                          f"{per_block} bytes for {recipe.model!r} ({layers} layers x {kv_heads} KV heads x "
                          f"{head_dim} x keys and values x {str(element).removeprefix('torch.')} x {block} "
                          "tokens); raise it")


def describe_recipe(recipe: Recipe, registry: Registry) -> dict[str, Any]:
    """The recipe with every default filled in, and its default request's plan: the processors in the order they
    run (those the sampling fields imply included), the stopping criteria that apply, and the strategy."""
    plan = check_recipe(recipe, registry)

    def named(name: str, options: BaseModel | None) -> dict[str, Any] | str:
        return {name: options.model_dump(mode="json")} if options is not None else name

    fields = recipe.model_dump(mode="json", exclude=set(COMPONENT_KEYS))
    fields["sampling"] = {k: v for k, v in fields["sampling"].items() if k not in COMPONENT_KEYS}
    return {
        "recipe": recipe.source,
        **fields,
        "processors": [{s.name: s.params} for s in recipe.processors],
        "stopping": [{s.name: s.params} for s in recipe.stopping],
        "strategy": {recipe.strategy.name: recipe.strategy.params} if recipe.strategy else None,
        "plan": {
            "processors": [named(s.processor.name, s.options) for s in plan.stages],
            "stopping": [c.criterion.name if c.default else named(c.criterion.name, c.options) for c in plan.criteria],
            "strategy": named(plan.strategy.name, plan.strategy_options),
        },
    }
