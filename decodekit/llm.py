"""The public Python API: `LLM` for offline batches, `AsyncLLM` for streaming with `async for` and abort."""

from __future__ import annotations

import asyncio
import dataclasses
import numbers
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

from decodekit.api.config import TARGET_DRAFT, EngineConfig
from decodekit.api.errors import ConfigError, DecodeKitError, RequestError
from decodekit.api.params import SamplingParams
from decodekit.api.sequence import RequestOutput
from decodekit.core.engine import Engine
from decodekit.core.plugin_manager import get_plugin_manager
from decodekit.core.registry import Registry
from decodekit.models import BUNDLED_MODEL_NAME, load_model

if TYPE_CHECKING:
    from decodekit.tool_calling import ToolPlan

Prompt = str | list[int] | Mapping[str, Any]
"""Text, token ids, or vLLM's prompt dicts: `{"prompt": text}` (`TextPrompt`), `{"prompt_token_ids": ids}`
(`TokensPrompt`)."""
Message = dict[str, str]


def build_engine(model: Any = BUNDLED_MODEL_NAME, tokenizer: Any = None, *, dtype: Any = "auto", device: Any = None,
                 plugin_manager: pluggy.PluginManager | None = None, draft: Any = None, draft_dtype: Any = None,
                 **engine_options: Any) -> Engine:
    """Load a model (and optionally a draft model for speculative decoding) and build an `Engine` with the
    installed plugins (see `EngineConfig` for options). The draft must share the target's vocabulary; `draft="target"`
    with `draft_quantization="int8"` drafts with an int8 copy of the target itself.

    Raises:
        ConfigError: bad engine options, no tokenizer, or a draft that cannot serve this target.
    """
    pm = plugin_manager or get_plugin_manager()
    registry = Registry.from_plugin_manager(pm)
    try:
        config = EngineConfig(**engine_options)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    loaded = load_model(model, tokenizer, dtype=dtype, device=device, loaders=registry.model_loaders)
    if loaded.tokenizer is None:
        raise ConfigError("a tokenizer is needed: pass `tokenizer=` with a model object")
    draft_loaded = None
    if draft == TARGET_DRAFT:
        if config.draft_quantization is None:
            raise ConfigError(f"draft {TARGET_DRAFT!r} drafts with the target's own weights, which only pays when they "
                              "run faster than the target: set draft_quantization (recipe: "
                              "`draft: {model: target, quantization: int8}`)")
        if draft_dtype is not None and str(draft_dtype) not in ("auto", str(loaded.dtype).removeprefix("torch.")):
            raise ConfigError(f"draft {TARGET_DRAFT!r} shares the target's {loaded.dtype} weights; leave draft_dtype "
                              "unset")
        # the same module, marked not owned: its quantized copy never re-lays the target's weights
        draft_loaded = dataclasses.replace(loaded, name=f"{loaded.name} ({config.draft_quantization} copy)",
                                           owned=False)
    elif draft is not None:
        draft_loaded = load_model(draft, loaded.tokenizer, dtype=draft_dtype or dtype, device=loaded.device,
                                  loaders=registry.model_loaders)
        target_vocab = loaded.model.config.get_text_config().vocab_size
        draft_vocab = draft_loaded.model.config.get_text_config().vocab_size
        if len(draft_loaded.tokenizer) != len(loaded.tokenizer) or draft_vocab != target_vocab:
            raise ConfigError(f"the draft model {draft_loaded.name!r} does not share the target's vocabulary "
                              f"(draft {draft_vocab} ids, target {target_vocab}); speculative decoding needs the "
                              "same tokenizer")
    return Engine(loaded, config, registry, pm, draft=draft_loaded)


def _normalize_prompts(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [[t for t in items if isinstance(t, int)]]  # one prompt given as token ids
    return items  # type: ignore[return-value]


def _normalize_params(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    listed = list(params)
    if len(listed) != n:
        raise ConfigError(f"got {len(listed)} SamplingParams for {n} prompts; give one, or one per prompt")
    return listed


def _normalize_priorities(priorities: Sequence[int] | None, n: int) -> list[int]:
    if priorities is None:
        return [0] * n
    try:
        listed = list(priorities) if not isinstance(priorities, (str, bytes, Mapping)) else None
    except TypeError:
        listed = None
    if listed is None:
        raise ConfigError(f"priorities: give a list of {n} integers (one per prompt), got "
                          f"{type(priorities).__name__}")
    if len(listed) != n:
        raise ConfigError(f"got {len(listed)} priorities for {n} prompts; give one per prompt")
    bad = next((p for p in listed if isinstance(p, bool) or not isinstance(p, numbers.Integral)), None)
    if bad is not None:
        raise ConfigError(f"priorities: each is an integer, got {bad!r}")
    return [int(p) for p in listed]


class LLM:
    """Offline generation, vLLM-style: `LLM(model=...).generate(prompts, SamplingParams(...))`.

    Args:
        model: "smollm2-135m-instruct" (bundled), a local HF folder, a .gguf file, a hub id, or a HF model object.
        tokenizer: the tokenizer, when `model` is a model object.
        dtype: "auto" (bf16 on CUDA and on a CPU with bf16 dot products, AVX512-BF16 or AMX; float32 on other
            CPUs), "float32", "bfloat16", "float16".
        device: "cpu" or "cuda" (default: CUDA when available).
        draft: a draft model for speculative decoding (same forms as `model`; same tokenizer as the target), or
            "target" for a quantized copy of the target itself (with `draft_quantization="int8"`).
        draft_dtype: the draft's dtype (default: `dtype`).
        **engine_options: `EngineConfig` fields, e.g. `kv_cache_memory="512MiB"`, `max_num_seqs=64`.
    """

    def __init__(self, model: Any = BUNDLED_MODEL_NAME, tokenizer: Any = None, *, dtype: Any = "auto",
                 device: Any = None, plugin_manager: pluggy.PluginManager | None = None, draft: Any = None,
                 draft_dtype: Any = None, **engine_options: Any):
        self.engine = build_engine(model, tokenizer, dtype=dtype, device=device, plugin_manager=plugin_manager,
                                   draft=draft, draft_dtype=draft_dtype, **engine_options)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's worker processes (a model split by `tensor_parallel_size`; also done at exit)."""
        self.engine.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priorities: Sequence[int] | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
        add_special_tokens: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists), all batched together; outputs in prompt order.

        A request that fails (e.g. a prompt longer than the context) comes back with `finish_reason == "error"`
        and `.error` set; the others are unaffected.
        """
        prompt_list = _normalize_prompts(prompts)
        # every per-prompt list is checked before any request is queued: a mismatch must not leave some queued
        param_list = _normalize_params(params, len(prompt_list))
        priority_list = _normalize_priorities(priorities, len(prompt_list))
        ids: list[str] = []
        try:
            for prompt, p, priority in zip(prompt_list, param_list, priority_list):
                rid = f"gen-{uuid.uuid4().hex[:12]}"
                self.engine.add_request(prompt, p, request_id=rid, priority=priority,
                                        add_special_tokens=add_special_tokens, final_only=on_output is None)
                ids.append(rid)
        except BaseException:
            self._withdraw(ids)  # the requests queued before the failure would run in the next call
            raise
        finals: dict[str, RequestOutput] = {}
        wanted = set(ids)
        while len(finals) < len(ids):
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    finals[out.request_id] = out
                if on_output is not None:
                    on_output(out)
        return [finals[rid] for rid in ids]

    def _withdraw(self, ids: list[str]) -> None:
        """Abort requests this call queued and step until their (aborted) outputs are out of the engine."""
        pending = {rid for rid in ids if self.engine.abort(rid)}
        while pending and self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    pending.discard(out.request_id)

    def apply_chat_template(self, messages: list[Message], tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """Render a conversation with the tokenizer's chat template, ready for the assistant's turn (`tools`: tool
        definitions for a template that takes them)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError("this tokenizer has no chat template; use generate() with a plain prompt")
        extra = {"tools": list(tools)} if tools else {}
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra))

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        tool_format: str = "auto",
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or to several.

        With `tools` (OpenAI's function tool definitions) the replies call them as `tool_choice` asks (`auto`, the
        default: text or calls; `required` or `{"type": "function", "function": {"name": ...}}`: calls only;
        `none`: text), one call or several (`parallel_tool_calls`), written in `tool_format` (a registered
        tool-call format; `auto`: the one the model's chat template shows, else `json`) and constrained so that
        every call parses and validates against its function's `parameters`. Each output's `tool_calls` holds the
        calls read back (`finish_reason` "tool_calls"); `text` keeps what the model wrote. Assistant `tool_calls`
        and `role: "tool"` messages in a conversation are written as the format writes them.

        Raises:
            RequestError: bad tools, `tool_choice` or tool messages (the message names the field).
            ConfigError: an unknown `tool_format` (the known ones named).
        """
        conversations: list[list[Message]] = (
            [messages] if messages and isinstance(messages[0], dict) else messages)  # type: ignore[assignment]
        chats = [self.chat_prompt(conv, tools, tool_choice, parallel_tool_calls, tool_format)
                 for conv in conversations]
        plan = chats[0][1] if chats else None
        if plan is not None:
            given = params if isinstance(params, Sequence) else [params or SamplingParams()] * len(chats)
            params = [plan.constrain(p) for p in given]
        # the template already holds the special tokens
        outputs = self.generate([prompt for prompt, _ in chats], params, add_special_tokens=False)
        return [plan.read_into(o) for o in outputs] if plan is not None else outputs

    def chat_prompt(self, messages: list[Message], tools: Sequence[Mapping[str, Any]] | None = None,
                    tool_choice: str | Mapping[str, Any] | None = None, parallel_tool_calls: bool | None = None,
                    tool_format: str = "auto") -> tuple[str, ToolPlan | None]:
        """A conversation's prompt, and with `tools` its tool plan (as `chat` takes them; None: no tool calling):
        generate with `plan.constrain(params)` and read a finished output's calls with `plan.read_into(output)`.

        Raises:
            RequestError: bad tools, `tool_choice` or tool messages (the message names the field).
            ConfigError: an unknown `tool_format`.
        """
        from decodekit.tool_calling import (
            choose_format,
            conversation,
            formats_of,
            plan_tools,
            template_text,
            template_tools,
            tool_specs,
        )

        if tools is None and not any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
            return self.apply_chat_template(messages), None
        template = template_text(self.tokenizer)
        fmt = choose_format(tool_format, formats_of(self.engine.registry), template)
        plan = plan_tools(tool_specs(tools or []), tool_choice, parallel_tool_calls, fmt, template)
        return self.apply_chat_template(conversation(messages, fmt(), plan), template_tools(plan, tools or [])), plan


class AsyncLLM:
    """An engine running in a background thread, streamed with `async for` and cancellable with `abort`.

    Example:
        >>> llm = AsyncLLM(model="smollm2-135m-instruct")
        >>> async for out in llm.generate("Hello", SamplingParams(max_tokens=8)):
        ...     print(out.delta_text[0], end="")
    """

    def __init__(self, model: Any = BUNDLED_MODEL_NAME, tokenizer: Any = None, *, engine: Engine | None = None,
                 **options: Any) -> None:
        self.engine = engine or build_engine(model, tokenizer, **options)
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | Exception]]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="decodekit-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stopped:
            self._drain_commands()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # keep serving: report to every stream, then go on
                for rid in list(self._streams):
                    self._deliver(rid, DecodeKitError(f"engine step failed: {exc!r}"))
                    self.engine.abort(rid)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)

    def _drain_commands(self) -> None:
        # lowered before taking them: a command put after this raises it again, so no run outlasts a waiting command
        self.engine.run_interrupt.lower()
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                rid, prompt, params, priority, add_special_tokens = payload
                try:
                    self.engine.add_request(prompt, params, request_id=rid, priority=priority,
                                            add_special_tokens=add_special_tokens)
                except Exception as exc:
                    self._deliver(rid, exc)
            elif kind == "abort":
                self.engine.abort(payload)

    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, q = target
        loop.call_soon_threadsafe(q.put_nowait, item)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       priority: int = 0, add_special_tokens: bool = True) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs: each carries `delta_text`; the last has `finished=True`.

        Leaving the loop early (or cancelling the task) aborts the request. Text is tokenized with the tokenizer's
        special tokens (e.g. BOS) unless `add_special_tokens` is False, as for a prompt rendered by a chat template.
        """
        rid = request_id or f"req-{uuid.uuid4().hex[:12]}"
        if rid in self._streams:  # the first stream must keep its queue: refuse the second one instead
            raise RequestError(f"request id {rid!r} is already in use by a running stream")
        q: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), q)
        self._command(("add", (rid, prompt, params or SamplingParams(), priority, add_special_tokens)))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Cancel a request; its stream ends with finish reason "abort"."""
        self._command(("abort", request_id))

    def _command(self, command: tuple[str, Any]) -> None:
        """Hand the engine thread a command; a decode run in progress ends after its current token to take it
        (`Engine.run_interrupt`), so neither a new request nor an abort waits for a run of up to 32 tokens."""
        self._commands.put(command)
        self.engine.run_interrupt.raise_()
        self._wake.set()

    def shutdown(self) -> None:
        """Stop the background thread."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)
