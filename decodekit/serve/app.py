"""The FastAPI app of `decodekit serve`: OpenAI's chat and completions endpoints over a recipe's engine, the model
list, the Responses API for text, vLLM's tokenizer endpoints (`/tokenize`, `/detokenize`, `/tokenizer_info`), health
and metrics; the API key, the body size limit and the error shapes; and `run_server`, uvicorn with a graceful
shutdown.

Example:
    >>> recipe = load_recipe("recipes/quickstart.yaml")
    >>> app = create_app(recipe, ServeOptions(port=8000))
    >>> run_server(app, ServeOptions(port=8000))
"""

from __future__ import annotations

import hmac
import json
import logging
import signal
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import pluggy
from fastapi import APIRouter, Depends, FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from decodekit.api.sequence import RequestOutput
from decodekit.core.plugin_manager import get_plugin_manager
from decodekit.llm import AsyncLLM
from decodekit.recipe import Recipe
from decodekit.serve.chunks import DONE_EVENT, ChunkStream, sse
from decodekit.serve.convert import (
    PreparedRequest,
    chat_response,
    completion_response,
    prepare_chat,
    prepare_completion,
)
from decodekit.serve.errors import APIError, error_body, validation_error
from decodekit.serve.metrics import ServerMetrics
from decodekit.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    ToolCallOut,
    lone_surrogate,
    may_hold_surrogates,
)
from decodekit.serve.responses_api import ResponseBuilder, ResponsesRequest, ResponseStore, Turn, to_chat
from decodekit.serve.responses_stream import ResponseEvents
from decodekit.serve.service import RequestGroup, ServingEngine
from decodekit.serve.streaming import ClientGone, EventStream, unless_disconnected
from decodekit.serve.tokenizer_api import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    tokenize,
    tokenizer_info,
)
from decodekit.serve.tool_calls import read_output
from decodekit.tool_calling import choose_format, formats_of, template_text

log = logging.getLogger("decodekit.serve")
IGNORED_FIELDS_HEADER = "X-Decodekit-Ignored-Fields"
"""The response header that names the request's unknown fields the server accepted and ignored."""
M = TypeVar("M", bound=BaseModel)


@dataclass
class ServeOptions:
    """How the server listens and what it accepts.

    Attributes:
        host: the address to bind (loopback unless told otherwise).
        port: the TCP port.
        api_key: when set, `/v1/*` requires `Authorization: Bearer <key>` (401 otherwise).
        served_model_name: another name the model answers to (GET /v1/models lists it first).
        max_waiting: refuse requests (429) while this many accepted ones have not started (None: unbounded).
        max_body_bytes: refuse larger request bodies (413).
        graceful_shutdown_s: on SIGTERM, how long in-flight requests may take to finish before they are cancelled.
        strict_fields: refuse every request field the server does not know (400); by default one that is not a typo
            of a known field is accepted, logged and named in the `X-Decodekit-Ignored-Fields` response header.
        vllm_metrics: also export the metrics under vLLM's names (`vllm:...`, labelled with `model_name`).
        tool_format: the tool-call format (a registered `ToolCallFormat`) requests with `tools` are served in; `auto`:
            the one whose signature the model's chat template holds (`decodekit.api.tools.detect_tool_format`), else
            `json`.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_waiting: int | None = None
    max_body_bytes: int = 4 << 20
    graceful_shutdown_s: float = 30.0
    strict_fields: bool = False
    vllm_metrics: bool = False
    tool_format: str = "auto"


def create_app(recipe: Recipe, options: ServeOptions | None = None, *,
               plugin_manager: pluggy.PluginManager | None = None) -> FastAPI:
    """Load the recipe's model (and draft) and build the app that serves it; its engine runs in a background thread
    from now on, and stops when the app shuts down (uvicorn's lifespan).

    Raises:
        DecodeKitError: the model (or draft) does not load.
    """
    options = options or ServeOptions()
    pm = plugin_manager or get_plugin_manager()
    metrics = ServerMetrics(options.vllm_metrics, options.served_model_name or recipe.model)
    pm.register(metrics, name=f"decodekit-serve-metrics-{id(metrics)}")
    llm = recipe.build_llm(pm)
    metrics.attach(llm.engine)
    service = ServingEngine(recipe, AsyncLLM(engine=llm.engine), served_model_name=options.served_model_name,
                            max_waiting=options.max_waiting)
    return build_app(service, metrics, options)


def build_app(service: ServingEngine, metrics: ServerMetrics, options: ServeOptions) -> FastAPI:
    """The app over an engine already running (see `create_app`)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        service.shutdown()

    def strategy_class(name: str) -> Any:
        entry = service.engine.registry.strategies.get(name)
        return entry.factory if entry is not None else None  # an unknown name: the engine refuses it, naming it

    tool_format = choose_format(options.tool_format, formats_of(service.engine.registry),
                                template_text(service.tokenizer))
    app = FastAPI(title="decodekit", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.state.metrics = metrics
    _install_error_handlers(app, metrics)

    async def check_api_key(request: Request) -> None:
        if options.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), options.api_key.encode()):
            raise APIError(401, "Incorrect API key provided: send `Authorization: Bearer <key>`",
                           code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.get("/models")
    async def list_models() -> Response:
        return _json(ModelList(data=[_card(service, name) for name in service.names]))

    @v1.get("/models/{name:path}")
    async def get_model(name: str) -> Response:
        return _json(_card(service, service.check_model(name)))

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, ChatCompletionRequest, options.max_body_bytes)
        model = service.check_model(body.model)
        prepared = prepare_chat(body, service.recipe, service.tokenizer, options.strict_fields, tool_format)
        return await _respond(request, service, prepared, model, chat=True, stream=bool(body.stream))

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        body = await read_body(request, CompletionRequest, options.max_body_bytes)
        model = service.check_model(body.model)
        prepared = prepare_completion(body, service.recipe, service.tokenizer, options.strict_fields,
                                      strategy_class)
        return await _respond(request, service, prepared, model, chat=False, stream=bool(body.stream))

    responses_store = ResponseStore()

    @v1.post("/responses")
    async def responses(request: Request) -> Response:
        body = await read_body(request, ResponsesRequest, options.max_body_bytes)
        model = service.check_model(body.model)
        chat, conversation = to_chat(body, responses_store)
        prepared = prepare_chat(chat, service.recipe, service.tokenizer, options.strict_fields, tool_format)
        built = ResponseBuilder(body, model)
        response = await _respond_responses(request, service, prepared, built, conversation,
                                            responses_store if body.store is not False else None)
        if prepared.ignored_fields:
            response.headers[IGNORED_FIELDS_HEADER] = ", ".join(prepared.ignored_fields)
        return response

    @v1.get("/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        return JSONResponse(responses_store.get(response_id, "response_id").body)

    app.include_router(v1)
    tokens = APIRouter(dependencies=[Depends(check_api_key)])  # at the root, where vLLM serves them

    @tokens.post("/tokenize")
    async def tokenize_text(request: Request) -> Response:
        body = await read_body(request, TokenizeRequest, options.max_body_bytes)
        service.check_model(body.model)
        return _json(tokenize(service.tokenizer, body, service.engine.max_model_len))

    @tokens.post("/detokenize")
    async def detokenize_ids(request: Request) -> Response:
        body = await read_body(request, DetokenizeRequest, options.max_body_bytes)
        service.check_model(body.model)
        return _json(detokenize(service.tokenizer, body, service.engine.vocab_size))

    @tokens.get("/tokenizer_info")
    async def get_tokenizer_info() -> Response:
        return JSONResponse(tokenizer_info(service.tokenizer, service.engine.max_model_len))

    app.include_router(tokens)

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def read_body(request: Request, model: type[M], limit: int) -> M:
    """The JSON body, at most `limit` bytes, validated into `model`.

    Raises:
        APIError: 413 over the limit; 400 for a body that is not a JSON object, that holds a text that is not
            Unicode (a lone surrogate), or that `model` refuses (naming the field).
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "the body is not valid JSON: it nests too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(data).__name__}")
    if may_hold_surrogates(body):
        found = lone_surrogate(data)
        if found is not None:  # no tokenizer takes such a text: refuse it here, naming the field
            raise APIError(400, found[1], param=found[0])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


async def _respond(request: Request, service: ServingEngine, prepared: PreparedRequest, model: str, *, chat: bool,
                   stream: bool) -> Response:
    """Run a prepared request: a JSON response, or an event stream once every prompt has started (so a request the
    engine refuses is still a 400). A client that disconnects aborts its requests. Unknown fields the request sent
    and the server ignored are logged and named in the `X-Decodekit-Ignored-Fields` header."""
    response = await _run(request, service, prepared, model, chat=chat, stream=stream)
    if prepared.ignored_fields:
        log.info("request fields ignored (unknown to this server): %s", ", ".join(prepared.ignored_fields))
        response.headers[IGNORED_FIELDS_HEADER] = ", ".join(prepared.ignored_fields)
    return response


async def _run(request: Request, service: ServingEngine, prepared: PreparedRequest, model: str, *, chat: bool,
               stream: bool) -> Response:
    service.admit()
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    group = service.open(prepared.prompts, prepared.params, prepared.add_special_tokens)
    try:
        firsts = await unless_disconnected(request, group.first_outputs())
        for out in firsts:
            refusal = prepared.refusal(out)
            if refusal is not None:
                raise refusal
    except BaseException:
        await group.close()
        raise
    if stream:
        chunks = ChunkStream(chat, response_id, created, model, prepared, firsts)
        return EventStream(_events(group, chunks, prepared.include_usage))
    try:
        finals = await unless_disconnected(request, group.finals())
    finally:
        await group.close()
    failed = next((o.error for o in finals if o.error is not None), None)
    if failed is not None:
        raise APIError(500, f"the request failed while generating: {failed}", type="server_error")
    if chat:
        return _json(chat_response(response_id, created, model, finals[0], prepared))
    return _json(completion_response(response_id, created, model, finals, prepared))


async def _respond_responses(request: Request, service: ServingEngine, prepared: PreparedRequest,
                             built: ResponseBuilder, conversation: list[dict[str, Any]],
                             store: ResponseStore | None) -> Response:
    """Run a Responses request: the response object, or its events streamed; the finished response is stored
    (with the conversation it continued) for `previous_response_id`, unless `store: false`."""
    service.admit()
    group = service.open(prepared.prompts, prepared.params, prepared.add_special_tokens)
    try:
        firsts = await unless_disconnected(request, group.first_outputs())
        refusal = prepared.refusal(firsts[0])
        if refusal is not None:
            raise refusal
    except BaseException:
        await group.close()
        raise

    def finish(final: RequestOutput, message: tuple[str | None, list[ToolCallOut]] | None = None) -> dict[str, Any]:
        # `message`: a stream's reading of the output (its calls keep the ids they streamed with)
        text = final.outputs[0].text
        calls: list[ToolCallOut] = []
        if prepared.tools is not None:  # tool calling: the output reads back as text, calls, or text then calls
            content, calls = message if message is not None else read_output(prepared.tools, text)
            text = content or ""
        body = built.body("completed", text=text, output=final, calls=calls)
        if store is not None:
            answer: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                answer = {"role": "assistant", "content": text or None,
                          "tool_calls": [c.model_dump(exclude_none=True) for c in calls]}
            store.put(built.response_id, Turn([*conversation, answer], body))
        return body

    if built.request.stream:
        async def events() -> AsyncGenerator[str, None]:
            stream = ResponseEvents(built, prepared.tools)
            try:
                for event in stream.opening():
                    yield event
                async for _, out in group.outputs():
                    if out.error is not None:
                        yield sse(json.dumps(error_body(f"the request failed while generating: {out.error}",
                                                        "server_error")))
                        return
                    for event in stream.step(out):
                        yield event
                    if out.finished:
                        for event in stream.closing(finish(out, stream.message)):
                            yield event
            finally:
                await group.close()

        return EventStream(events())
    try:
        finals = await unless_disconnected(request, group.finals())
    finally:
        await group.close()
    if finals[0].error is not None:
        raise APIError(500, f"the request failed while generating: {finals[0].error}", type="server_error")
    return JSONResponse(finish(finals[0]))


async def _events(group: RequestGroup, chunks: ChunkStream, include_usage: bool) -> AsyncGenerator[str, None]:
    """The stream's events: chunks, then the usage chunk if asked, then `[DONE]`; a failure mid-stream is an
    `{"error": ...}` event. Closing the generator aborts the requests still running."""
    try:
        async for index, out in group.outputs():
            if out.error is not None:
                yield sse(json.dumps(error_body(f"the request failed while generating: {out.error}", "server_error")))
                break
            for event in chunks.events(index, out):
                yield event
        else:
            if include_usage:
                yield chunks.usage_event()
        yield DONE_EVENT
    except APIError as exc:
        yield sse(json.dumps(exc.body()))
        yield DONE_EVENT
    finally:
        await group.close()


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def _card(service: ServingEngine, name: str) -> ModelCard:
    return ModelCard(id=name, created=int(service.started), root=service.recipe.model)


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every error in OpenAI's shape, counted by status in the metrics."""

    def reply(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
        metrics.http_error(status)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return reply(exc.status, exc.body(), exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = "not_found" if exc.status_code == 404 else None
        return reply(exc.status_code, error_body(str(exc.detail), param=None, code=code), dict(exc.headers or {}))

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the client has gone (nginx's "client closed request")

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("request failed", exc_info=exc)
        return reply(500, error_body(f"internal error: {exc!r}", "server_error"))


def run_server(app: FastAPI, options: ServeOptions) -> None:
    """Serve `app` with uvicorn until SIGTERM or SIGINT: then stop accepting connections, let in-flight requests
    finish (up to `graceful_shutdown_s`, then cancel them) and stop the engine thread; return normally."""
    import uvicorn

    config = uvicorn.Config(app, host=options.host, port=options.port, lifespan="on", access_log=False,
                            timeout_graceful_shutdown=int(options.graceful_shutdown_s), log_level="info")
    # uvicorn re-raises the signal that stopped it once it has shut down; with these handlers in place that is a
    # no-op, so a SIGTERM ends the process with status 0 after a graceful shutdown.
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in handled}
    try:
        uvicorn.Server(config).run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
