"""The wire shapes of the OpenAI-compatible server: request bodies (OpenAI's fields plus decodekit's own) and
responses, as pydantic models.

Requests accept OpenAI's field names. Fields OpenAI defines that do not change decoding (`user`, `metadata`, ...)
are accepted and ignored; fields that would change decoding but that this server does not implement (`tools`,
`suffix`, ...) are refused by name unless their value is one that asks for nothing. Any other unknown field is
accepted and reported (logged, and named in the response's `X-Decodekit-Ignored-Fields` header), as vLLM does, so
clients that send newer OpenAI fields keep working, unless it looks like a typo of a known field
(`repetiton_penalty`), which is refused with the known name suggested; the server's `--strict-fields` refuses every
unknown field (`check_extra_fields`).
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Annotated, Any, Literal

from pydantic import AllowInfNan, BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt

from decodekit.api.params import MAX_LOGPROBS

NEG_INF_LOGPROB = -9999.0
"""What a -inf (or NaN) logprob is sent as: JSON has no infinities (vLLM sends the same value)."""

IGNORED_FIELDS = frozenset({
    "user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier",
})
"""OpenAI request fields that do not change decoding: accepted and ignored."""

UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    # field -> the values that ask for nothing (accepted); any other value is refused with a 400 naming the field
    "tools": (), "tool_choice": ("none", "auto"), "functions": (), "function_call": ("none", "auto"),
    "audio": (), "modalities": (["text"],), "prediction": (), "web_search_options": (),
    "verbosity": (), "suffix": (), "best_of": (1,),
}
"""OpenAI request fields that would change decoding and are not implemented, with the values that are harmless
(None, False and empty values always are)."""

MESSAGE_IGNORED_FIELDS = frozenset({"name", "refusal", "annotations"})
"""Fields of a chat message that are accepted and ignored."""

MESSAGE_UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {"function_call": (), "audio": ()}
"""Fields of a chat message that are refused unless empty."""

Int = StrictInt
"""A JSON integer: not a string (`"5"`), a boolean (`true`, which would count as 1) or a float (`5.0`)."""

Bool = StrictBool
"""A JSON boolean: not a string (`"yes"`) or a number."""

Float = Annotated[float, Strict(), AllowInfNan(False)]
"""A finite JSON number: an integer is taken (`"temperature": 1`); a string, a boolean, an infinity or NaN (which
Python's JSON parser reads from `Infinity`, `1e999` and `NaN`) is not."""


class WireModel(BaseModel):
    """A request model that keeps unknown fields (`model_extra`) so that they can be named in the error."""

    model_config = ConfigDict(extra="allow")


TYPO_CUTOFF = 0.85
"""How close (difflib's ratio) an unknown field must be to a known one to be taken for its typo and refused."""


@dataclass
class ExtraFields:
    """What `check_extra_fields` found: the first field to refuse as (param, message), and the unknown fields
    accepted and ignored."""

    refusal: tuple[str, str] | None = None
    ignored: list[str] = dataclass_field(default_factory=list)


def check_extra_fields(model: BaseModel, ignored: frozenset[str], unsupported: dict[str, tuple[Any, ...]],
                       where: str = "", strict: bool = False) -> ExtraFields:
    """Sort the extra fields of `model`: fields to ignore pass; an unsupported field is refused unless its value is
    harmless; an unknown field is refused when it looks like a typo of a known one (or always, with `strict`), and
    otherwise accepted and listed in `ignored`. `where` prefixes the param (`messages[0].`)."""
    known = sorted(type(model).model_fields)
    found = ExtraFields()
    for name, value in (model.model_extra or {}).items():
        param = f"{where}{name}"
        if name in ignored:
            continue
        if name in unsupported:
            if value in (None, False, [], {}, "") or value in unsupported[name]:
                continue
            found.refusal = param, f"{param}: not supported by this server"
            return found
        names = [*known, *ignored, *unsupported]
        typo = difflib.get_close_matches(name, names, n=1, cutoff=TYPO_CUTOFF)
        if typo or strict:
            close = typo or difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            found.refusal = param, f"{param}: unknown field{hint}"
            return found
        found.ignored.append(param)
    return found


def _readable(text: str) -> str:
    """`text` with any lone surrogate written as `\\udXXX` (it cannot be sent as UTF-8)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


_SURROGATE_BYTES = re.compile(rb"\\u[dD][89abcdefABCDEF]|\xed[\xa0-\xbf]")
"""What a lone surrogate can come from in a JSON body: a `\\uD800`-`\\uDFFF` escape, or the UTF-8-like bytes of one
(Python's parser decodes a body with `surrogatepass`)."""


def may_hold_surrogates(raw: bytes | bytearray) -> bool:
    """Whether a JSON body's bytes may hold a surrogate (a cheap scan before `lone_surrogate`'s walk); a body in
    UTF-16 or UTF-32 (which the parser also reads) always may."""
    return not json.detect_encoding(raw).startswith("utf-8") or _SURROGATE_BYTES.search(raw) is not None


def lone_surrogate(body: dict[str, Any]) -> tuple[str, str] | None:
    """The first text of a parsed JSON body (a value or a key, at any depth) that is not Unicode text, as
    (the top-level field it is in, message), or None when every text is.

    JSON may write half of a UTF-16 surrogate pair alone (`"hi \\ud800"`); Python's parser reads it into a string
    that no tokenizer takes and no UTF-8 response can carry.
    """
    containers = (str, dict, list)
    # (top-level field, path, value), depth first; iterative, as a body may nest as deep as the JSON parser allows
    stack: list[tuple[str, str, Any]] = [(_readable(k), _readable(k), v) for k, v in reversed(body.items())]
    texts: list[tuple[str, str, str]] = [(_readable(k), "a key of the body", k) for k in body]
    while True:
        for field, where, text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                return field, (f"{where}: not valid Unicode text: a lone surrogate (U+{ord(text[exc.start]):04X}) at "
                               f"character {exc.start}; JSON's \\uXXXX escapes must pair a high surrogate with a "
                               f"low one")
        if not stack:
            return None
        field, path, value = stack.pop()
        if isinstance(value, str):
            texts = [(field, path, value)]
        elif isinstance(value, dict):
            texts = [(field, f"a key of {path}", key) for key in value]
            stack.extend((field, f"{path}.{_readable(k)}", v) for k, v in reversed(value.items())
                         if isinstance(v, containers))
        else:
            texts = []
            if isinstance(value, list):
                stack.extend((field, f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value)))
                             if isinstance(v, containers))


# ---- requests ----------------------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    """`stream_options`: `include_usage` adds a last chunk with the usage (and `"usage": null` on the others)."""

    model_config = ConfigDict(extra="forbid")

    include_usage: Bool | None = None
    continuous_usage_stats: Bool | None = Field(None, description="Every chunk carries the usage so far (vLLM's "
                                                "field).")


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema the output must match."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON schema.")
    strict: Bool | None = Field(None, description="True: objects may only have the keys they list (unless "
                                             "additionalProperties says otherwise); False: JSON Schema's rule.")


class ResponseFormat(BaseModel):
    """`response_format`: free text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(WireModel):
    """The fields chat and completions requests share: OpenAI's, then decodekit's own (what the openai client sends
    through `extra_body`). A field left out keeps the recipe's default."""

    model: str | None = Field(None, description="The served model's name (see GET /v1/models).")
    max_tokens: Int | None = Field(None, ge=0, description="0 only with `echo` (completions): the prompt scored, "
                                   "nothing generated.")
    temperature: Float | None = Field(None, ge=0.0)
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    n: Int | None = Field(None, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: Int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Float] | None = Field(None, description="Token id (as text) -> bias in [-100, 100].")
    response_format: ResponseFormat | None = None
    stream: Bool | None = Field(None, description="Server-sent events; null or left out: one JSON response.")
    stream_options: StreamOptions | None = None
    # decodekit's own
    top_k: Int | None = Field(None, ge=-1)
    min_p: Float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Float | None = Field(None, gt=0.0)
    min_tokens: Int | None = Field(None, ge=0)
    ignore_eos: Bool | None = None
    stop_token_ids: list[Int] | None = None
    processors: list[Any] | None = Field(None, description="Processors merged over the recipe's, by name.")
    stopping: list[Any] | None = Field(None, description="Stopping criteria merged over the recipe's, by name.")
    strategy: Any = Field(None, description="A strategy replacing the recipe's, e.g. {\"beam_search\": {...}}.")
    trace: Int | None = Field(None, ge=1, le=MAX_LOGPROBS, description="Record the decoding trace (per choice).")
    logprobs_mode: Literal["raw", "processed"] | None = Field(
        None, description="Logprobs of the model's distribution (raw) or of the one each token was drawn from.")
    prompt_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="The prompt tokens' logprobs, "
                                        "with this many alternatives each (vLLM's field).")
    thinking_token_budget: Int | None = Field(None, ge=0, description="Most tokens of thinking, then the end of "
                                              "the thinking is forced (vLLM's field; docs/reasoning.md).")
    reasoning: dict[str, Any] | None = Field(None, description="Phase-aware decoding, as a recipe's `reasoning:` "
                                             "(format, and per phase: budget, wrap_up, sampling, processors).")


class TextPart(BaseModel):
    """A text part of a message's content (the only kind this server takes)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class FunctionCallIn(BaseModel):
    """A call in an assistant message of the history: the function's name and its arguments as JSON text."""

    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str = "{}"


class ToolCallIn(BaseModel):
    """An assistant message's tool call in the history."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(WireModel):
    """One message of a conversation: a text, an assistant's tool calls, or a tool's result (`role: tool`)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The message's text (parts joined)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDef(BaseModel):
    """A function tool: its name, what it does, and the JSON schema of its arguments."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class ToolDef(BaseModel):
    """One entry of `tools`."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    """The function a named `tool_choice` names."""

    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call that function."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    add_generation_prompt: Bool = Field(True, description="End the rendered conversation ready for the "
                                        "assistant's turn.")
    continue_final_message: Bool = Field(False, description="Render the last (assistant) message open, so the "
                                         "model continues it (with add_generation_prompt: false).")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="More variables for the chat template "
                                                        "(e.g. enable_thinking).")
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = Field(
        None, description="Given to the chat template (gpt-oss writes it into its system message).")
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool | None = None
    logprobs: Bool | None = None
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`: `prompt` is a text, texts, token ids, or lists of token ids."""

    prompt: str | list[Int] | list[str] | list[list[Int]]
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Bool | None = Field(None, description="Each choice starts with its prompt (and, with `logprobs`, the "
                              "prompt tokens' logprobs: null for the first).")

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one engine request each."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and all(isinstance(t, int) for t in self.prompt):
            return [list(self.prompt)]  # type: ignore[arg-type]
        return list(self.prompt)  # type: ignore[arg-type]


# ---- responses ---------------------------------------------------------------------------------------------------
def _omit_none(value: Any) -> bool:
    return value is None


class CompletionTokensDetails(BaseModel):
    """`usage.completion_tokens_details`: how many of the completion's tokens were the thinking's."""

    reasoning_tokens: int


class Usage(BaseModel):
    """Token counts of a response (every choice's tokens count)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = Field(None, exclude_if=_omit_none)


class TopLogprob(BaseModel):
    """One candidate token at a position (chat logprobs)."""

    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    """A generated token's logprob and the most likely tokens at its position (chat logprobs)."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """A chat choice's logprobs."""

    content: list[TokenLogprob] | None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs: per token its text, logprob, the most likely tokens and its offset."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token's logprob in `prompt_logprobs` (vLLM's shape): its value, rank (1 is the most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""Per prompt token (null for the first, which nothing predicts): token id -> its logprob, the prompt's token
first, then the most likely ones."""


class ChoiceExtras(BaseModel):
    """decodekit's fields on a choice, sent only when set: why it stopped (the stop string or token, or the
    criterion), the strategy's score (beam search) and the decoding trace."""

    stop_reason: str | int | None = Field(None, exclude_if=_omit_none)
    score: float | None = Field(None, exclude_if=_omit_none)
    trace: list[dict[str, Any]] | None = Field(None, exclude_if=_omit_none)


class FunctionCallOut(BaseModel):
    """A call's function: its name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str


class ToolCallOut(BaseModel):
    """A tool call of a generated message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class FunctionCallDelta(BaseModel):
    """What a streamed chunk adds to a call's function: its name (on the call's first delta) or a fragment of its
    arguments' JSON text."""

    name: str | None = Field(None, exclude_if=_omit_none)
    arguments: str


class ToolCallDelta(BaseModel):
    """What a streamed chunk adds to call `index` of a message: its first delta carries `id`, `type` and the name
    (with empty arguments), the later ones fragments of the arguments (OpenAI's shape)."""

    index: int
    id: str | None = Field(None, exclude_if=_omit_none)
    type: Literal["function"] | None = Field(None, exclude_if=_omit_none)
    function: FunctionCallDelta


class AssistantMessage(BaseModel):
    """The generated message of a chat choice."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = Field(None, exclude_if=_omit_none)
    reasoning_content: str | None = Field(None, exclude_if=_omit_none)  # a reasoning request's thinking
    reasoning: str | None = Field(None, exclude_if=_omit_none)  # the same, by vLLM's newer name


class DeltaMessage(BaseModel):
    """What a chat chunk adds to a choice's message."""

    role: Literal["assistant"] | None = Field(None, exclude_if=_omit_none)
    content: str | None = Field(None, exclude_if=_omit_none)
    tool_calls: list[ToolCallDelta] | None = Field(None, exclude_if=_omit_none)
    reasoning_content: str | None = Field(None, exclude_if=_omit_none)
    reasoning: str | None = Field(None, exclude_if=_omit_none)


class ChatChoice(ChoiceExtras):
    """One choice of a chat completion (`message`), or its delta in a streamed chunk (`delta`)."""

    index: int
    message: AssistantMessage | None = Field(None, exclude_if=_omit_none)
    delta: DeltaMessage | None = Field(None, exclude_if=_omit_none)
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class CompletionChoice(ChoiceExtras):
    """One choice of a completion (also a streamed chunk's delta)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=_omit_none)


class Envelope(BaseModel):
    """What every response and chunk carries, in OpenAI's order: its id, object type, creation time, model and
    choices; `usage` when it is sent."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Any]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatCompletionResponse(Envelope):
    """A non-streamed chat completion."""

    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=_omit_none)


class ChatCompletionChunk(Envelope):
    """One server-sent event of a streamed chat completion."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChoice]


class CompletionResponse(Envelope):
    """A completion, or one streamed chunk of it (same object)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    """One entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "decodekit"
    root: str | None = None


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
