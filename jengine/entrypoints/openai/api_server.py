"""The OpenAI-compatible HTTP server: FastAPI app factory and the uvicorn runner behind
`jengine serve`.

Where it sits: the top of the serving path, in the API process (which never imports jax):
routes -> serving_completion / serving_chat -> AsyncLLM -> (ZMQ) -> engine-core process.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON or SSE), GET /v1/models,
GET /health, GET /metrics (Prometheus), POST /tokenize, POST /detokenize, GET /version.

Errors always have OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: bad
or missing fields and malformed JSON -> 400, unknown model -> 404, missing or wrong API key
(with --api-key, on /v1/*) -> 401, engine process dead -> 503 (and /health 503). A
client that disconnects, mid-stream or while waiting for a full response, aborts its
request.
"""

import asyncio
import gc
import importlib.metadata
import logging
import secrets
import signal
import socket
import sys

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jengine.engine.async_llm import AsyncLLM
from jengine.engine.client import EngineDeadError
from jengine.entrypoints.openai.metrics import CONTENT_TYPE_LATEST, PrometheusStatLogger
from jengine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    OpenAIError,
    TokenizeRequest,
    TokenizeResponse,
)
from jengine.entrypoints.openai.serving_chat import OpenAIServingChat
from jengine.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jengine.entrypoints.openai.serving_engine import engine_dead_error

logger = logging.getLogger(__name__)


def version() -> str:
    try:
        return importlib.metadata.version("jengine")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.to_response().model_dump(), status_code=error.status_code)


class APIKeyMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware, which would get between a stream and its client's
    disconnect): /v1/* needs `Authorization: Bearer <key>`; other routes are open."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] == "http"
            and scope["method"] != "OPTIONS"
            and scope["path"].startswith("/v1")
        ):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(auth, self.expected):
                error = OpenAIError("Unauthorized: missing or invalid API key", 401, "api_key")
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(request: Request, coro):
    """Run a full (non-streamed) response; if the client goes away first, cancel it, which
    aborts its requests in the engine. Returns None in that case."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watch):
            if not task.done():
                task.cancel()
    if work.cancelled() or not work.done():
        await asyncio.gather(work, return_exceptions=True)
        return None
    return work.result()


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for error in exc.errors():
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        if error.get("type") == "json_invalid":
            parts.append(f"malformed JSON body: {error.get('msg')}")
            continue
        where = ".".join(loc)
        param = param or where or None
        parts.append(f"{where}: {error.get('msg')}" if where else str(error.get("msg")))
    return "; ".join(parts) or "invalid request", param


def build_app(
    engine: AsyncLLM,
    served_model_names: list[str] | None = None,
    *,
    api_key: str | None = None,
) -> FastAPI:
    model_path = engine.config.model.model
    names = list(served_model_names or [model_path])
    prometheus = PrometheusStatLogger(names[0], engine.num_blocks)
    engine.stat_loggers.append(prometheus)
    completion = OpenAIServingCompletion(engine, names, model_path)
    chat = OpenAIServingChat(engine, names, model_path)

    app = FastAPI(title="jengine", version=version())
    app.state.engine = engine
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.exception_handler(OpenAIError)
    async def on_openai_error(request: Request, exc: OpenAIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(OpenAIError(message, 400, param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        return error_response(OpenAIError(str(exc.detail), exc.status_code))

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(request: Request, exc: EngineDeadError):
        return error_response(engine_dead_error(exc))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(OpenAIError(f"internal error: {type(exc).__name__}", 500))

    # -- generation -----------------------------------------------------------------------

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw_request: Request):
        prepared = completion.prepare(body)
        if body.stream:
            return StreamingResponse(
                completion.stream(body, *prepared), media_type="text/event-stream"
            )
        response = await run_unless_disconnected(raw_request, completion.complete(body, *prepared))
        return response if response is not None else Response(status_code=499)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request):
        prepared = chat.prepare(body)
        if body.stream:
            return StreamingResponse(chat.stream(body, *prepared), media_type="text/event-stream")
        response = await run_unless_disconnected(raw_request, chat.complete(body, *prepared))
        return response if response is not None else Response(status_code=499)

    # -- model info, tokenizer --------------------------------------------------------------

    @app.get("/v1/models")
    async def show_models() -> ModelList:
        return ModelList(
            data=[
                ModelCard(id=name, root=model_path, max_model_len=engine.max_model_len)
                for name in names
            ]
        )

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        completion.check_model(body.model)
        completion.require_tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError("give exactly one of prompt and messages", param="prompt")
        if body.prompt is not None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = engine.tokenizer.encode(body.prompt, add_special_tokens=special)
        else:
            _, tokens = chat.render(
                chat.messages(body.messages),
                body.add_generation_prompt,
                body.continue_final_message,
                body.chat_template_kwargs,
                bool(body.add_special_tokens),
            )
        return TokenizeResponse(
            count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens
        )

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        completion.check_model(body.model)
        completion.require_tokenizer()
        bad = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise OpenAIError(
                f"token ids {bad[:5]} are out of vocabulary (the vocabulary has "
                f"{engine.vocab_size} tokens)",
                param="tokens",
            )
        return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens))

    # -- operations -------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if engine.errored:
            return error_response(engine_dead_error(engine.dead_error()))
        return Response(status_code=200)

    @app.get("/version")
    async def show_version():
        return {"version": version()}

    @app.get("/metrics")
    async def metrics():
        if not engine.errored:
            try:
                prometheus.record_engine_stats(await engine.get_engine_stats(timeout=5.0))
            except (EngineDeadError, TimeoutError, RuntimeError) as e:
                logger.warning("could not read engine stats for /metrics: %s", e)
        return Response(prometheus.render(), media_type=CONTENT_TYPE_LATEST)

    return app


# -- running it -------------------------------------------------------------------------------


def bind_socket(host: str | None, port: int) -> socket.socket:
    """Bind before the engine starts, so a taken port fails in a second, not after warmup."""
    host = host or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


async def serve_http(args) -> None:
    from jengine.engine.arg_utils import EngineArgs

    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        raise SystemExit(
            f"error: cannot listen on {args.host or '0.0.0.0'}:{args.port}: {e}"
        ) from None
    engine_args = EngineArgs.from_cli_args(args)
    engine = AsyncLLM.from_engine_args(
        engine_args,
        log_stats=not args.disable_log_stats,
        log_stats_interval=args.log_stats_interval,
    )
    try:
        names = args.served_model_name or [engine_args.model]
        app = build_app(engine, names, api_key=args.api_key)
        config = uvicorn.Config(
            app,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            timeout_keep_alive=5,
            timeout_graceful_shutdown=5,
        )
        server = uvicorn.Server(config)
        # uvicorn shuts down gracefully on SIGTERM, then re-raises it; make that reach the
        # `finally` below (engine shutdown) instead of killing the process on the spot.
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
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
        sock.close()


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt("terminated")


def run_server(args) -> None:
    asyncio.run(serve_http(args))
