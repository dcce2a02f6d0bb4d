"""Requests to decodekit and back: a chat or completions body becomes prompts and `SamplingParams` (the recipe's
defaults with the request's fields merged over them), and engine outputs become OpenAI's responses (logprobs in
the wire's shapes: `logprob_shapes.py`; streamed chunks: `chunks.py`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError

from decodekit.api.errors import DecodeKitError
from decodekit.api.params import ComponentSpec, SamplingParams
from decodekit.api.sequence import CompletionOutput, RequestOutput
from decodekit.api.tools import ToolCallFormat
from decodekit.recipe import Recipe
from decodekit.serve.errors import APIError, param_of
from decodekit.serve.logprob_shapes import (
    TextOffsets,
    chat_logprobs,
    completion_logprobs,
    echoed_logprobs,
    vllm_prompt_logprobs,
)
from decodekit.serve.protocol import (
    IGNORED_FIELDS,
    MESSAGE_IGNORED_FIELDS,
    MESSAGE_UNSUPPORTED_FIELDS,
    UNSUPPORTED_FIELDS,
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ExtraFields,
    SamplingFields,
    Usage,
    check_extra_fields,
)
from decodekit.serve.reasoning import apply_reasoning, message_fields, template_kwargs, token_details
from decodekit.serve.tool_calls import plan_request, read_output
from decodekit.tool_calling import ToolPlan, template_text

_SPECS: TypeAdapter[list[ComponentSpec]] = TypeAdapter(list[ComponentSpec])
_PLAIN_FIELDS = ("temperature", "top_p", "n", "seed", "top_k", "min_p", "min_tokens", "ignore_eos", "stop_token_ids",
                 "trace", "logprobs_mode", "prompt_logprobs")


@dataclass
class PreparedRequest:
    """A request ready for the engine.

    Attributes:
        prompts: one engine request each (text or token ids).
        params: the recipe's defaults with the request's fields merged over them.
        add_special_tokens: False for a chat prompt (its template holds the special tokens).
        origins: which request field asked for what (see `decodekit.serve.errors.param_of`).
        prompt_field: `messages` or `prompt`.
        top_logprobs: how many alternatives each token's logprobs show (None: no logprobs).
        include_usage: streaming: end with a usage chunk.
        tokenizer: the engine's tokenizer, which places the legacy logprobs' `text_offset` (None: every offset 0,
            as the text is empty without one).
        echo: each completions choice starts with its prompt (text, and logprobs where asked).
        generate: False for `max_tokens: 0` with `echo`: the prompt is scored, the one token the engine generates
            for it is not returned.
        prompt_logprobs: the request's `prompt_logprobs` field (returned in vLLM's shape; None: not asked).
        ignored_fields: unknown fields the request sent that the server accepted and ignored (reported in the
            response's `X-Decodekit-Ignored-Fields` header).
        continuous_usage: streaming: every chunk carries the usage so far (`stream_options.continuous_usage_stats`).
        tools: how the request calls tools (None: it does not); its outputs are read back as calls or text.
    """

    prompts: list[str | list[int]]
    params: SamplingParams
    add_special_tokens: bool
    origins: dict[str, str] = field(default_factory=dict)
    prompt_field: str = "prompt"
    top_logprobs: int | None = None
    include_usage: bool = False
    tokenizer: Any = None
    echo: bool = False
    generate: bool = True
    prompt_logprobs: int | None = None
    ignored_fields: list[str] = field(default_factory=list)
    continuous_usage: bool = False
    tools: ToolPlan | None = None

    def refusal(self, output: RequestOutput) -> APIError | None:
        """A 400 for an output the engine refused before running it (an invalid prompt, or a plan that cannot
        run: unknown plugin, bad parameters, a combination a strategy refuses), naming the request field."""
        if output.error is None or output.metrics.first_scheduled_time is not None:
            return None
        return APIError(400, output.error, param=param_of(output.error, self.params, self.origins, self.prompt_field))


def prepare_chat(request: ChatCompletionRequest, recipe: Recipe, tokenizer: Any, strict_fields: bool = False,
                 tool_format: type[ToolCallFormat] | None = None) -> PreparedRequest:
    """A chat request's prompt (the conversation rendered by the tokenizer's chat template) and parameters.

    With `tool_format` (the server's tool-call format), `tools` are offered as the format says and the output is
    constrained to the format's calls (`tool_choice`: `auto` text or calls, `required` or a named function calls
    only; `parallel_tool_calls: false` one call); assistant tool calls and `role: tool` results in the history are
    written as the format writes them.

    Raises:
        APIError: 400 naming the field at fault.
    """
    ignored: list[str] = []
    for i, message in enumerate(request.messages):
        _sort_extra(check_extra_fields(message, MESSAGE_IGNORED_FIELDS, MESSAGE_UNSUPPORTED_FIELDS,
                                       f"messages[{i}].", strict_fields), ignored)
    if request.top_logprobs is not None and not request.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
    if request.max_tokens == 0:
        raise APIError(400, "max_tokens: 0 generates nothing; it is for completions with echo: true",
                       param="max_tokens")
    overrides, origins = _overrides(request, recipe, strict_fields, ignored)
    if request.max_completion_tokens is not None:
        overrides["max_tokens"] = request.max_completion_tokens
        origins["max_tokens"] = "max_completion_tokens"
    top = None
    if request.logprobs:
        top = request.top_logprobs or 0
        overrides["logprobs"] = top
        origins["logprobs"] = "top_logprobs" if request.top_logprobs is not None else "logprobs"
    plan = None
    if tool_format is None:
        if request.tools and request.tool_choice != "none":
            raise APIError(400, "tools: this server has no tool-call format", param="tools")
        prompt = render_chat(tokenizer, request.messages, request.add_generation_prompt,
                             request.continue_final_message, template_kwargs(request))
    else:
        plan, messages, tools_for_template = plan_request(request, tool_format, template_text(tokenizer))
        if plan is not None:
            # calls only (`required` or a named function): `response_format` shapes a text answer, and there is none
            kept = [p for p in overrides.get("processors", [])
                    if origins.get(f"processors:{p.name}") != "response_format"]
            overrides["processors"] = [*kept, plan.processor()]
            origins[f"processors:{overrides['processors'][-1].name}"] = "tools"
        variables = template_kwargs(request)
        if tools_for_template is not None:  # the format leaves the tools to the model's own chat template
            variables["tools"] = tools_for_template
        prompt = render_conversation(tokenizer, messages, request.add_generation_prompt,
                                     request.continue_final_message, variables)
    apply_reasoning(request, recipe, overrides, origins)
    return PreparedRequest([prompt], _params(recipe, overrides, origins, "messages"), False, origins, "messages", top,
                           _include_usage(request), prompt_logprobs=request.prompt_logprobs, ignored_fields=ignored,
                           continuous_usage=_continuous_usage(request), tools=plan)


def prepare_completion(request: CompletionRequest, recipe: Recipe, tokenizer: Any = None, strict_fields: bool = False,
                       strategies: Callable[[str], Any] | None = None) -> PreparedRequest:
    """A completions request's prompts and parameters (`tokenizer` places the logprobs' `text_offset`).

    `echo` starts each choice with its prompt; with `logprobs` the prompt tokens' logprobs come first (the engine's
    prompt logprobs, with as many alternatives), so `max_tokens: 1, logprobs: 1, echo: true` is the
    loglikelihood request of lm-evaluation-harness, and `max_tokens: 0` returns the prompt alone. `strategies`
    gives a strategy's class by name (None for an unknown one): `echo` is refused with a strategy whose outputs do not
    continue the prompt token by token (`Strategy.continues_prompt`).

    Raises:
        APIError: 400 naming the field at fault.
    """
    prompts = request.prompts()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise APIError(400, "prompt: must not be empty", param="prompt")
    echo = bool(request.echo)
    if request.max_tokens == 0 and not echo:
        raise APIError(400, "max_tokens: 0 generates nothing; it needs echo: true (the prompt scored)",
                       param="max_tokens")
    if echo and (request.n or 1) > 1:
        raise APIError(400, "echo: one choice per prompt (n: 1); the prompt is the same for every choice",
                       param="echo")
    if echo and request.stream:
        raise APIError(400, "echo: not with stream: true on this server; send the request unstreamed", param="echo")
    ignored: list[str] = []
    overrides, origins = _overrides(request, recipe, strict_fields, ignored)
    if request.max_tokens == 0:
        overrides["max_tokens"] = 1  # the engine generates one token for the prompt's last row; it is not returned
    if request.logprobs is not None:
        overrides["logprobs"] = request.logprobs
        if echo:  # the prompt's logprobs too, with as many alternatives (a larger prompt_logprobs keeps its own)
            overrides["prompt_logprobs"] = max(request.logprobs, request.prompt_logprobs or 0)
            origins["prompt_logprobs"] = "logprobs"
    apply_reasoning(request, recipe, overrides, origins)
    params = _params(recipe, overrides, origins, "prompt")
    if echo and params.n > 1:
        raise APIError(400, f"echo: one choice per prompt; the recipe's n is {params.n} (send n: 1)", param="echo")
    strategy = strategies(params.strategy.name) if echo and params.strategy is not None and strategies else None
    if params.strategy is not None and strategy is not None and not strategy.continues_prompt:
        raise APIError(400, f"echo: not with {params.strategy.name} (its choices are whole sequences scored "
                            "together, not continuations of the prompt); send strategy: sample", param="echo")
    return PreparedRequest(prompts, params, True, origins, "prompt", request.logprobs, _include_usage(request),
                           tokenizer, echo, request.max_tokens != 0, request.prompt_logprobs, ignored,
                           _continuous_usage(request))


def render_chat(tokenizer: Any, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None) -> str:
    """The conversation rendered by the tokenizer's chat template, ready for the assistant's turn (a `developer`
    message is given to the template as `system`), or with the last message left open to be continued
    (`continue_final_message`); `template_kwargs` are more variables for the template.

    Raises:
        APIError: 400 when the model has no chat template, the options contradict each other, or the template
            refuses the conversation.
    """
    conversation = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    return render_conversation(tokenizer, conversation, add_generation_prompt, continue_final_message,
                               template_kwargs)


def render_conversation(tokenizer: Any, conversation: list[dict[str, str]], add_generation_prompt: bool = True,
                        continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None) -> str:
    """`render_chat` of messages already in the template's shape (`role`, `content`)."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "messages: this model has no chat template; use /v1/completions", param="messages")
    if continue_final_message and add_generation_prompt:
        raise APIError(400, "continue_final_message: continues the last message, so it needs add_generation_prompt: "
                            "false", param="continue_final_message")
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise APIError(400, "continue_final_message: the last message must be the assistant's to continue it",
                       param="continue_final_message")
    reserved = {"conversation", "tokenize", "add_generation_prompt", "continue_final_message", "messages"}
    clash = sorted(reserved & set(template_kwargs or {}))
    if clash:
        raise APIError(400, f"chat_template_kwargs: {clash[0]!r} is set by the request's own fields",
                       param="chat_template_kwargs")
    try:
        return str(tokenizer.apply_chat_template(conversation, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message,
                                                 **(template_kwargs or {})))
    except Exception as exc:  # jinja2's errors (a template may raise on roles it does not accept)
        raise APIError(400, f"messages: the model's chat template refused the conversation: {exc}",
                       param="messages") from None


def _sort_extra(found: ExtraFields, ignored: list[str]) -> None:
    """Refuse the field `found` refuses (a 400 naming it), else add the unknown fields it accepted to `ignored`."""
    if found.refusal is not None:
        raise APIError(400, found.refusal[1], param=found.refusal[0])
    ignored.extend(found.ignored)


def _include_usage(request: SamplingFields) -> bool:
    return bool(request.stream and request.stream_options and request.stream_options.include_usage)


def _continuous_usage(request: SamplingFields) -> bool:
    return bool(request.stream and request.stream_options and request.stream_options.continuous_usage_stats)


def _overrides(request: SamplingFields, recipe: Recipe, strict_fields: bool, ignored: list[str]
               ) -> tuple[dict[str, Any], dict[str, str]]:
    """The request's fields as `Recipe.params_for` overrides, and which field asked for which processor (unknown
    fields accepted are added to `ignored`)."""
    _sort_extra(check_extra_fields(request, IGNORED_FIELDS, UNSUPPORTED_FIELDS, strict=strict_fields), ignored)
    overrides: dict[str, Any] = {name: getattr(request, name) for name in _PLAIN_FIELDS
                                 if getattr(request, name) is not None}
    origins: dict[str, str] = {}
    if request.max_tokens is not None:
        overrides["max_tokens"] = request.max_tokens
    if request.stop is not None:
        overrides["stop"] = [request.stop] if isinstance(request.stop, str) else request.stop
    for key in ("processors", "stopping"):
        specs = _specs(getattr(request, key), key)
        if specs is not None:
            overrides[key] = specs
            origins.update({f"{key}:{s.name}": key for s in specs})
    if request.strategy is not None:
        overrides["strategy"] = request.strategy
    processors: list[ComponentSpec] = list(overrides.get("processors", []))
    recipe_names = {s.name for s in recipe.processors}

    def add(name: str, params: dict[str, Any], source: str, noop: bool) -> None:
        if noop and name not in recipe_names:
            return  # nothing to do, and nothing of the recipe's to override
        processors.append(ComponentSpec(name=name, params=params))
        origins[f"processors:{name}"] = source

    if request.repetition_penalty is not None:
        add("repetition_penalty", {"penalty": request.repetition_penalty}, "repetition_penalty",
            request.repetition_penalty == 1.0)
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(request, name)
        if value is not None:
            add(name, {"penalty": value}, name, value == 0.0)
    if request.logit_bias is not None:
        add("logit_bias", {"bias": _logit_bias(request.logit_bias)}, "logit_bias", not request.logit_bias)
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        add("json", {}, "response_format", False)
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(400, "response_format.json_schema: required with type json_schema",
                           param="response_format.json_schema")
        options: dict[str, Any] = {"schema": fmt.json_schema.schema_}
        if fmt.json_schema.strict is not None:
            options["strict"] = fmt.json_schema.strict
        add("json_schema", options, "response_format", False)
    if processors:
        overrides["processors"] = processors
    return overrides, origins


def _specs(value: Any, key: str) -> list[ComponentSpec] | None:
    if value is None:
        return None
    try:
        return _SPECS.validate_python(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
        raise APIError(400, f"{key}{where}: {first['msg']}", param=key) from None


_TOKEN_ID = re.compile(r"[0-9]+")
"""A `logit_bias` key: a token id in ASCII decimal digits (`int` would also take " 5", "+5", "1_0" and "²")."""

_MAX_ID_DIGITS = 12
"""A longer id is past any vocabulary: it is refused before `int` reads it (`int` refuses over 4300 digits)."""


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """`logit_bias` as the `logit_bias` processor's `bias`: token id -> bias. Ids past the vocabulary are refused
    by the processor (its error names `logit_bias`)."""
    out: dict[int, float] = {}
    keys: dict[int, str] = {}
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key):
            raise APIError(400, f"logit_bias: keys are token ids in decimal digits, got {key!r}", param="logit_bias")
        digits = key.lstrip("0") or "0"
        if len(digits) > _MAX_ID_DIGITS:
            raise APIError(400, f"logit_bias: token id {digits[:_MAX_ID_DIGITS]}... is not in the vocabulary",
                           param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise APIError(400, f"logit_bias: biases are between -100 and 100, got {value} for {key}",
                           param="logit_bias")
        token = int(digits)
        if token in out:
            raise APIError(400, f"logit_bias: token id {token} is given twice ({keys[token]!r} and {key!r})",
                           param="logit_bias")
        out[token], keys[token] = value, key
    return out


def _params(recipe: Recipe, overrides: dict[str, Any], origins: dict[str, str], prompt_field: str) -> SamplingParams:
    try:
        return recipe.params_for(overrides)
    except DecodeKitError as exc:
        message = str(exc)
        raise APIError(400, message, param=param_of(message, None, origins, prompt_field)) from None


# ---- outputs -------------------------------------------------------------------------------------------------------
def prompt_text(output: RequestOutput, prepared: PreparedRequest) -> str:
    """An echoed choice's prompt text: the prompt as given, or its token ids decoded."""
    if output.prompt is not None:
        return output.prompt
    if prepared.tokenizer is None:
        return ""
    return prepared.tokenizer.decode(list(output.prompt_token_ids),
                                     skip_special_tokens=prepared.params.skip_special_tokens)


def usage(outputs: Sequence[RequestOutput], generated: bool = True) -> Usage:
    """Token counts over the requests' final outputs (every returned sequence's tokens; none where the request
    generated nothing: `max_tokens: 0`)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs) if generated else 0
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 completion_tokens_details=token_details(outputs))


def choice_extras(choice: CompletionOutput) -> dict[str, Any]:
    """decodekit's fields on a choice (`ChoiceExtras`): why it stopped, the strategy's score, the trace."""
    return {"stop_reason": choice.stop_reason, "score": choice.score, "trace": choice.trace}


def chat_response(response_id: str, created: int, model: str, output: RequestOutput, prepared: PreparedRequest
                  ) -> ChatCompletionResponse:
    """A non-streamed chat completion: one choice per returned sequence."""
    choices = []
    for c in output.outputs:
        logprobs = None
        if prepared.top_logprobs is not None:
            logprobs = chat_logprobs(c.token_ids, c.logprobs or [], prepared.top_logprobs)
        message, finish = AssistantMessage(content=c.text, **message_fields(c)), c.finish_reason
        if prepared.tools is not None:
            content, calls = read_output(prepared.tools, c.text)
            message = AssistantMessage(content=content, tool_calls=calls or None, **message_fields(c))
            finish = "tool_calls" if calls else finish
        choices.append(ChatChoice(index=c.index, message=message, logprobs=logprobs, finish_reason=finish,
                                  **choice_extras(c)))
    return ChatCompletionResponse(id=response_id, created=created, model=model, choices=choices,
                                  usage=usage([output]), prompt_logprobs=(vllm_prompt_logprobs(output)
                                                                          if prepared.prompt_logprobs is not None
                                                                          else None))


def completion_response(response_id: str, created: int, model: str, outputs: Sequence[RequestOutput],
                        prepared: PreparedRequest) -> CompletionResponse:
    """A non-streamed completion: the choices of every prompt, numbered on from one prompt to the next (each
    starting with its prompt under `echo`)."""
    choices = []
    for base, output in zip(choice_bases(outputs), outputs):
        for c in output.outputs:
            tokens = list(c.token_ids) if prepared.generate else []
            entries = (c.logprobs or []) if prepared.generate else []
            text = c.text if prepared.generate else ""
            logprobs = None
            if prepared.echo:
                text = prompt_text(output, prepared) + text
                if prepared.top_logprobs is not None:
                    logprobs = echoed_logprobs(output, prepared.tokenizer, prepared.params.skip_special_tokens,
                                               tokens, entries)
            elif prepared.top_logprobs is not None:
                offsets = TextOffsets(prepared.tokenizer, prepared.params.skip_special_tokens).extend(tokens)
                logprobs = completion_logprobs(tokens, entries, offsets)
            choices.append(CompletionChoice(
                index=base + c.index, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
                prompt_logprobs=vllm_prompt_logprobs(output) if prepared.prompt_logprobs is not None else None,
                **choice_extras(c)))
    return CompletionResponse(id=response_id, created=created, model=model, choices=choices,
                              usage=usage(outputs, prepared.generate))


def choice_bases(first_outputs: Sequence[RequestOutput]) -> list[int]:
    """The index of each prompt's first choice: the choices of earlier prompts come first."""
    bases, total = [], 0
    for out in first_outputs:
        bases.append(total)
        total += len(out.outputs)
    return bases
