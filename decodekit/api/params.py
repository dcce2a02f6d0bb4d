"""`SamplingParams`: what one request asks for (vLLM's names), validated eagerly with pydantic."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StrictParams(BaseModel):
    """A base for components' `Params` models: unknown keys are refused, so a typo in a recipe is an error that
    names the key rather than a setting silently ignored."""

    model_config = ConfigDict(extra="forbid")


class ComponentSpec(BaseModel):
    """A named plugin component and its parameters, as a recipe or request names it.

    Accepted shapes: `"top_k"`, `{"top_k": {"k": 40}}`, or `{"name": "top_k", "params": {"k": 40}}`. The
    parameters are validated later against the component's own pydantic model (see `decodekit.core.plan`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Registered name of the component.")
    params: dict[str, Any] = Field(default_factory=dict, description="The component's parameters.")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        if isinstance(data, str):
            return {"name": data}
        if isinstance(data, dict) and "name" not in data and len(data) == 1:
            ((name, params),) = data.items()
            if params is None:
                params = {}
            if not isinstance(params, dict):
                raise ValueError(f"parameters of {name!r} must be a mapping, got {type(params).__name__}")
            return {"name": name, "params": params}
        return data


SAMPLING_ALIASES: Mapping[str, str] = MappingProxyType({
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "num_return_sequences": "n",
    "eos_token_id": "stop_token_ids",
    "stop_strings": "stop",
    "do_sample": "temperature",
})
"""transformers' `generate()` / `GenerationConfig` names `SamplingParams` also accepts: alias -> decodekit's field.

`eos_token_id` takes one id or a list; `do_sample=False` means `temperature: 0` (greedy) and `do_sample=True` keeps
the temperature (which then must not be 0). An alias given together with its field is an error naming both. The
aliases are read when parameters are validated; a validated `SamplingParams` (and its dump) has only the field."""


def resolve_aliases(data: Mapping[str, Any]) -> dict[str, Any]:
    """`data` with transformers' spellings (`SAMPLING_ALIASES`) replaced by decodekit's field names.

    Raises:
        ValueError: an alias and its field are both given, or an alias' value has the wrong shape (the message
            names the key the user wrote).
    """
    out = dict(data)
    for alias, target in SAMPLING_ALIASES.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if alias == "do_sample":
            _resolve_do_sample(out, value)
            continue
        if target in out:
            raise ValueError(f"`{alias}` is transformers' name for `{target}`: give one of them, not both "
                             f"(got {alias}={value!r} and {target}={out[target]!r})")
        if alias == "eos_token_id":
            value = _token_id_list(value)
        out[target] = value
    return out


def _resolve_do_sample(out: dict[str, Any], value: Any) -> None:
    """Apply `do_sample` to the mapping in place: False is greedy (temperature 0), True keeps the temperature."""
    if not isinstance(value, bool):
        raise ValueError(f"`do_sample` must be true or false, got {value!r}")
    temperature = out.get("temperature")
    # transformers warns and ignores a temperature when do_sample=False; here a contradiction is an error, since
    # silently dropping either setting would decode differently from what one of them asks
    if value is False and temperature not in (None, 0, 0.0):
        raise ValueError(f"`do_sample=False` asks for greedy decoding but `temperature={temperature!r}` asks for "
                         "sampling: give one of them (temperature 0 is greedy)")
    if value is True and temperature in (0, 0.0) and not isinstance(temperature, bool):
        raise ValueError("`do_sample=True` asks for sampling but `temperature=0` asks for greedy decoding: give a "
                         "temperature above 0, or leave do_sample out")
    if value is False:
        out["temperature"] = 0.0


def _token_id_list(value: Any) -> Any:
    """`eos_token_id` as `stop_token_ids` takes it: one id becomes a list of one."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise ValueError(f"`eos_token_id` must be a token id or a list of token ids, got {value!r}")


def _alias_schema(schema: dict[str, Any]) -> None:
    """Add the aliases to `SamplingParams`' JSON schema, so a document using them validates against it (the model
    refuses unknown keys, so the schema says `additionalProperties: false`), and forbid an alias beside its field."""
    properties = schema.get("properties", {})
    for alias, target in SAMPLING_ALIASES.items():
        if alias == "do_sample":
            entry: dict[str, Any] = {"type": "boolean"}
        elif alias == "eos_token_id":
            entry = {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"type": "integer"}}]}
        elif alias == "stop_strings":
            entry = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
        else:
            entry = {k: v for k, v in properties.get(target, {}).items() if k not in ("default", "title")}
        entry["description"] = f"transformers' name for `{target}` (an alias: give one of them)."
        properties[alias] = entry
    schema["properties"] = properties
    schema["allOf"] = [*schema.get("allOf", []),
                       *({"not": {"required": [alias, target]}} for alias, target in SAMPLING_ALIASES.items())]


PHASE_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p")
"""The `SamplingParams` fields a reasoning phase may set for itself (`PhaseParams.sampling`); the others (max
tokens, seed, stop strings, n, ...) belong to the whole request."""


class PhaseParams(StrictParams):
    """One phase of a reasoning request (`thinking`, `answer`, ...): its own sampling, processors and budget.

    Example (recipe): `thinking: {budget: 256, wrap_up: "\\nTime to answer.\\n", sampling: {temperature: 1.0}}`
    """

    budget: int | None = Field(None, ge=0, description="Most tokens the model writes in this phase; then the "
                               "wrap-up message and the format's end marker are forced. None: no limit.")
    wrap_up: str = Field("", description="Text forced before the end marker when the budget ends the phase (a "
                         "recipe may set it for the budgets requests set).")
    sampling: dict[str, Any] = Field(default_factory=dict, description="This phase's own sampling fields ("
                                     + ", ".join(PHASE_SAMPLING_FIELDS) + "), over the request's.")
    processors: list[ComponentSpec] = Field(default_factory=list, description="Processors applied in this phase "
                                            "only (after the request's own), e.g. a constraint on the answer.")

    @model_validator(mode="after")
    def _check(self) -> PhaseParams:
        unknown = sorted(set(self.sampling) - set(PHASE_SAMPLING_FIELDS))
        if unknown:
            raise ValueError(f"sampling: {', '.join(unknown)} apply to the whole request, not to one phase (a phase "
                             f"sets {', '.join(PHASE_SAMPLING_FIELDS)})")
        return self


class ReasoningParams(BaseModel):
    """Phase-aware decoding for a reasoning model: its format, and each phase's settings by name.

    Example (recipe): `reasoning: {format: think_tags, thinking: {budget: 256}, answer: {sampling: {temperature:
    0.7}}}`. Every key other than `format` names a phase of the format (`thinking`, `answer`, ...).
    """

    model_config = ConfigDict(extra="allow", frozen=True)
    __pydantic_extra__: dict[str, PhaseParams] = Field(init=False)

    format: str = Field("think_tags", description="A registered reasoning format: think_tags (Qwen3, DeepSeek-R1, "
                        "SmolLM3), harmony (gpt-oss).")

    @property
    def phases(self) -> dict[str, PhaseParams]:
        """The phases' settings, by phase name."""
        return dict(self.__pydantic_extra__ or {})


MAX_LOGPROBS = 20
"""The most alternatives `SamplingParams.logprobs` may ask for per token (vLLM's default `max_logprobs`)."""


class SamplingParams(BaseModel):
    """How to decode one request. Field names follow vLLM/OpenAI so users can carry their settings over.

    Example:
        >>> SamplingParams(temperature=0, max_tokens=32, stop=["\\n\\n"])
    """

    # the aliases are not fields (a dump has one name per setting), so the schema lists them separately
    model_config = ConfigDict(extra="forbid", validate_assignment=True, json_schema_extra=_alias_schema)
    key_aliases: ClassVar[Mapping[str, str]] = SAMPLING_ALIASES
    """Other spellings accepted for some fields (transformers' names; see `SAMPLING_ALIASES`)."""

    max_tokens: int = Field(16, ge=1, description="Most tokens to generate.")
    min_tokens: int = Field(0, ge=0, description="EOS and stop tokens are suppressed until this many are made.")
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy (argmax).")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 or -1 disables.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Keep the smallest set whose probability reaches p.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Keep tokens with p >= min_p * p_max.")
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1,
                             description="Per-request seed: same tokens alone or batched with others.")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="Return each generated token's logprob and rank, with this many most "
                                             "likely alternatives (0: the token's own only). None: no logprobs.")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                        description="Return each prompt token's logprob after the first (raw), with "
                                                    "this many alternatives. The prompt is then computed in full, "
                                                    "not served from the prefix cache.")
    trace: int | None = Field(None, ge=1, le=MAX_LOGPROBS,
                              description="Record the decoding trace, keeping this many top candidates per stage: "
                                          "per token, the candidates before and after each processor, how the "
                                          "token was chosen, the drafts, and why the request stopped.")
    logprobs_mode: Literal["raw", "processed"] = Field(
        "raw", description="`raw`: log-softmax of the model's logits (vLLM's default); `processed`: of the "
                           "distribution the token was drawn from, after the request's processors.")
    stop: list[str] = Field(default_factory=list, description="Stop strings (matched across token boundaries).")
    stop_token_ids: list[int] = Field(default_factory=list, description="Token ids that end the request.")
    include_stop_str_in_output: bool = Field(False, description="Keep the matched stop string in the text.")
    ignore_eos: bool = Field(False, description="Keep generating past the model's EOS token.")
    skip_special_tokens: bool = Field(True, description="Drop special tokens from the decoded text.")
    n: int = Field(1, ge=1, description="Number of sequences to return (parallel sampling strategy).")
    processors: list[ComponentSpec] = Field(
        default_factory=list,
        description="Extra logits processors, applied in this order before the temperature/top-k/top-p/min-p ones.",
    )
    stopping: list[ComponentSpec] = Field(
        default_factory=list, description="Extra stopping criteria (EOS, stop ids/strings and max tokens always apply)."
    )
    strategy: ComponentSpec | None = Field(
        None, description="Search strategy; default: parallel sampling when n > 1, else plain sampling/greedy."
    )
    extra: dict[str, Any] = Field(
        default_factory=dict, description="Parameters for processors, stopping criteria or strategies from plugins."
    )
    reasoning: ReasoningParams | None = Field(
        None, description="Phase-aware decoding for reasoning models: each phase (thinking, answer) with its own "
                          "sampling, processors and budget (docs/reasoning.md)."
    )

    @model_validator(mode="before")
    @classmethod
    def _normalize(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = resolve_aliases(data)
            if data.get("top_k") == -1:
                data = {**data, "top_k": 0}
            if isinstance(data.get("stop"), str):
                data = {**data, "stop": [data["stop"]]}
        return data

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"`min_tokens` ({self.min_tokens}) must be <= `max_tokens` ({self.max_tokens})")
        if any(s == "" for s in self.stop):
            raise ValueError("`stop` strings must be non-empty")
        return self

    @property
    def greedy(self) -> bool:
        """True when the request decodes by argmax: its temperature is 0, and so is every reasoning phase's."""
        if self.temperature != 0.0:
            return False
        return self.reasoning is None or all(
            p.sampling.get("temperature", 0.0) == 0.0 for p in self.reasoning.phases.values())

    def for_phase(self, phase: PhaseParams | None) -> SamplingParams:
        """These parameters with one reasoning phase's sampling fields over them (validated: a bad value raises
        `ValidationError` naming the field)."""
        if phase is None or not phase.sampling:
            return self
        return SamplingParams.model_validate({**dict(self), **phase.sampling})
