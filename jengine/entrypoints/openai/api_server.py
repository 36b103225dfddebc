"""The OpenAI-compatible HTTP server: the FastAPI app factory and the uvicorn runner behind
`jengine serve`.

Where it sits: the top of the serving path, in the API process (which never imports jax):
middleware.py -> routes.py -> serving_completion / serving_chat (and serving_responses over
it) / serving_embedding / serving_tokenization -> AsyncLLM -> (ZMQ) -> engine-core process.
`build_app` only wires: the serving objects, the engine and the admission control on
`app.state`, the middleware (draining, CORS with --allowed-origins, API key, body size),
the exception handlers, and routes.py's router. `serve_http` runs it under shutdown.py's
`DrainingServer`.

Errors always have OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: bad
or missing fields and malformed JSON -> 400, unknown model -> 404, missing or wrong API key
(with --api-key) -> 401, body too large -> 413, queue full (--max-queued-requests) -> 429,
engine process dead or server shutting down -> 503 (and /health 503). A client that
disconnects, mid-stream or while waiting for a full response, aborts its request.
/openapi.json documents every one of them.
"""

import asyncio
import gc
import logging
import socket
import sys

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException

from jengine.config import EngineConfig
from jengine.engine.async_llm import AsyncLLM
from jengine.engine.client import EngineDeadError
from jengine.engine.input_processor import load_chat_template
from jengine.engine.mp_clients import AsyncMPClient
from jengine.entrypoints.openai.admission import Admission
from jengine.entrypoints.openai.errors import engine_dead_error, error_response
from jengine.entrypoints.openai.metrics import PrometheusStatLogger
from jengine.entrypoints.openai.middleware import (
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    DrainingMiddleware,
    RequestIdHeaderMiddleware,
    UnexpectedErrorMiddleware,
)
from jengine.entrypoints.openai.protocol import OpenAIError
from jengine.entrypoints.openai.routes import router, version
from jengine.entrypoints.openai.serving_chat import OpenAIServingChat
from jengine.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jengine.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from jengine.entrypoints.openai.serving_models import ServingModels
from jengine.entrypoints.openai.serving_responses import OpenAIServingResponses
from jengine.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from jengine.entrypoints.openai.shutdown import DrainingServer

logger = logging.getLogger(__name__)


def build_app(
    engine: AsyncLLM,
    served_model_names: list[str] | None = None,
    *,
    api_key: str | None = None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    chat_template: str | None = None,
    max_queued_requests: int | None = None,
    max_request_body_bytes: int | None = None,
    allowed_origins: list[str] | None = None,
    allowed_methods: list[str] | None = None,
    allowed_headers: list[str] | None = None,
    allow_credentials: bool = False,
    lora_modules: dict[str, str] | None = None,
    allow_runtime_lora_updating: bool = False,
    return_tokens_as_token_ids: bool = False,
    enable_prompt_tokens_details: bool = False,
    enable_request_id_headers: bool = False,
    response_role: str = "assistant",
    exclude_tools_when_tool_choice_none: bool = False,
) -> FastAPI:
    """The app. CORS headers are sent only with `allowed_origins` (none by default: a web
    page on another origin cannot use the server from its visitors' browsers).
    `lora_modules`: LoRA adapters served by name (name -> PEFT folder);
    `allow_runtime_lora_updating`: the load/unload endpoints answer (else 404)."""
    model_path = engine.config.model.model
    names = list(served_model_names or [model_path])
    lora = engine.config.lora
    replicas = engine.config.parallel.data_parallel_size
    prometheus = PrometheusStatLogger(
        names[0], engine.num_blocks, engine.max_model_len, engine.config.cache,
        # Each replica's pool (alike; the engine's count sums their usable blocks).
        replica_blocks=(engine.num_blocks - 1) // replicas + 1,
        max_loras=lora.max_loras if lora is not None else None,
    )  # fmt: skip
    engine.stat_loggers.append(prometheus)
    models = ServingModels(names, model_path, engine.max_model_len, lora_modules)
    chat = OpenAIServingChat(
        engine,
        models,
        enable_auto_tool_choice=enable_auto_tool_choice,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        chat_template=chat_template,
        return_tokens_as_token_ids=return_tokens_as_token_ids,
        enable_prompt_tokens_details=enable_prompt_tokens_details,
        response_role=response_role,
        exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none,
    )

    app = FastAPI(title="jengine", version=version())
    app.state.engine = engine
    app.state.prometheus = prometheus
    app.state.models = models
    app.state.allow_runtime_lora_updating = allow_runtime_lora_updating
    app.state.serving_completion = OpenAIServingCompletion(
        engine,
        models,
        return_tokens_as_token_ids=return_tokens_as_token_ids,
        enable_prompt_tokens_details=enable_prompt_tokens_details,
    )
    app.state.serving_chat = chat
    app.state.serving_responses = OpenAIServingResponses(chat)
    app.state.serving_tokenization = OpenAIServingTokenization(engine, models, chat)
    app.state.serving_embedding = OpenAIServingEmbedding(engine, models)
    parallel = engine.config.parallel
    app.state.admission = Admission(
        engine.config.scheduler.max_num_seqs * parallel.data_parallel_size, max_queued_requests
    )
    # Added innermost first: a request meets draining, CORS, the key, then the body limit.
    app.add_middleware(UnexpectedErrorMiddleware)
    if max_request_body_bytes is not None:
        app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=allowed_origins,
            allow_methods=allowed_methods or ["*"],
            allow_headers=allowed_headers or ["*"],
            allow_credentials=allow_credentials,
        )
    if enable_request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    app.add_middleware(DrainingMiddleware, admission=app.state.admission)
    for exc_class, handler in EXCEPTION_HANDLERS.items():
        app.add_exception_handler(exc_class, handler)
    app.include_router(router)
    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema, less the 422 it documents for every body: validation errors are
    400s here (documented on each route, with OpenAI's error body)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        app.openapi_schema = schema
    return app.openapi_schema


# -- exception handlers: everything becomes an OpenAI-shaped error body ----------------------


async def _on_openai_error(request: Request, exc: OpenAIError):
    return error_response(exc)


async def _on_validation_error(request: Request, exc: RequestValidationError):
    message, param = _validation_message(exc)
    return error_response(OpenAIError(message, 400, param))


async def _on_http_error(request: Request, exc: StarletteHTTPException):
    return error_response(OpenAIError(str(exc.detail), exc.status_code))


async def _on_engine_dead(request: Request, exc: EngineDeadError):
    return error_response(engine_dead_error(exc))


EXCEPTION_HANDLERS = {
    OpenAIError: _on_openai_error,
    RequestValidationError: _on_validation_error,
    StarletteHTTPException: _on_http_error,
    EngineDeadError: _on_engine_dead,
}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for error in exc.errors():
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        if error.get("type") == "json_invalid":
            parts.append(f"malformed JSON body: {error.get('msg')}")
            continue
        where = ".".join(loc)
        # A whole-model check names the field it is about in its context.
        param = param or where or (error.get("ctx") or {}).get("param") or None
        parts.append(f"{where}: {error.get('msg')}" if where else str(error.get("msg")))
    return "; ".join(parts) or "invalid request", param


# -- running it -------------------------------------------------------------------------------


async def serve_http(
    args, engine: AsyncLLM, chat_template: str | None, sock: socket.socket
) -> None:
    """Serve on `sock` (bound) in front of `engine` (ready); the caller shuts both down."""
    try:
        names = args.served_model_name or [args.model]
        app = build_app(
            engine,
            names,
            lora_modules=args.lora_modules,
            allow_runtime_lora_updating=args.allow_runtime_lora_updating,
            api_key=args.api_key,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            chat_template=chat_template,
            max_queued_requests=args.max_queued_requests,
            max_request_body_bytes=args.max_request_body_bytes,
            allowed_origins=args.allowed_origins,
            allowed_methods=args.allowed_methods,
            allowed_headers=args.allowed_headers,
            allow_credentials=args.allow_credentials,
            return_tokens_as_token_ids=args.return_tokens_as_token_ids,
            enable_prompt_tokens_details=args.enable_prompt_tokens_details,
            enable_request_id_headers=args.enable_request_id_headers,
            response_role=args.response_role,
            exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        )
        for lora in app.state.models.loras.values():  # --lora-modules read (checked) now
            try:
                await engine.add_lora(lora)
            except Exception as e:
                raise SystemExit(f"error: --lora-modules {lora.lora_name}: {e}") from None
        config = uvicorn.Config(
            app,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            timeout_keep_alive=5,
            # After the drain (DrainingServer): time for responses still being written.
            timeout_graceful_shutdown=5,
        )
        server = DrainingServer(config, engine, app.state.admission, args.shutdown_timeout)
        # Start-up objects live as long as the server: keep them out of GC scans.
        gc.collect()
        gc.freeze()
        if "jax" in sys.modules:
            logger.warning("jax was imported in the API process; it should not be")
        host, port = sock.getsockname()[:2]
        logger.info(
            "serving %s on http://%s:%d (engine pid %d)", names[0], host, port, engine.engine_pid
        )
        await server.serve(sockets=[sock])
    finally:
        engine.shutdown()


def run_server(args, config: EngineConfig, engine_core: AsyncMPClient, sock) -> None:
    """Serve on `sock` (bound) in front of `engine_core`, whose processes `jengine serve`
    started before it imported this module; the caller shuts both down."""
    try:
        chat_template = load_chat_template(args.chat_template)
    except ValueError as e:
        raise SystemExit(f"error: --chat-template: {e}") from None
    # The wait for the engine (its load and warmup: minutes) is outside the event loop,
    # where Ctrl-C raises at once; asyncio.run's first Ctrl-C only cancels its task, which
    # a wait that never awaits leaves running to the end of warmup.
    engine = AsyncLLM(
        config,
        log_stats=not args.disable_log_stats,
        log_stats_interval=args.log_stats_interval,
        engine_core=engine_core,
    )
    asyncio.run(serve_http(args, engine, chat_template, sock))
