"""The HTTP routes of the OpenAI-compatible server, on one FastAPI `APIRouter`.

Where it sits: api_server.py's `build_app` puts the serving objects and the engine on
`app.state` and includes `router`; each route here only finds its serving object there and
hands the validated body on. Generation routes share `generation_response`: once the
request passed its checks, admission.py admits it (or answers 429/503); a stream becomes
a `text/event-stream` response; a full response is awaited unless the client hangs up
first, which aborts its requests and answers 499. Every route documents its error
responses (OpenAI's error body) in /openapi.json.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, GET /v1/models,
POST /tokenize, POST /detokenize, GET /health, GET /version, GET /metrics (Prometheus), and with
--allow-runtime-lora-updating POST /v1/load_lora_adapter and /v1/unload_lora_adapter.
"""

import asyncio
import importlib.metadata
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from jengine.engine.client import EngineDeadError
from jengine.entrypoints.openai.admission import Ticket
from jengine.entrypoints.openai.errors import engine_dead_error, error_response
from jengine.entrypoints.openai.metrics import CONTENT_TYPE_LATEST
from jengine.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    OpenAIError,
    SamplingRequest,
)
from jengine.entrypoints.openai.protocol_chat import ChatCompletionRequest, ChatCompletionResponse
from jengine.entrypoints.openai.protocol_embeddings import EmbeddingRequest, EmbeddingResponse
from jengine.entrypoints.openai.protocol_responses import ResponseObject, ResponsesRequest
from jengine.entrypoints.openai.protocol_tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from jengine.entrypoints.openai.serving_engine import OpenAIServing
from jengine.entrypoints.openai.serving_models import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)

logger = logging.getLogger(__name__)

# What /openapi.json documents besides each route's 200: every error is OpenAI's body.
ERROR_RESPONSES = {
    code: {"model": ErrorResponse, "description": description}
    for code, description in (
        (400, "Bad request: a field is missing, malformed or out of bounds"),
        (401, "Missing or wrong API key (with --api-key)"),
        (404, "Unknown model"),
        (413, "Request body too large"),
        (429, "Too many queued requests (with --max-queued-requests); see Retry-After"),
        (503, "The engine is not available, or the server is shutting down"),
    )
}
router = APIRouter(responses=ERROR_RESPONSES)


def version() -> str:
    try:
        return importlib.metadata.version("jengine")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


# -- generation -------------------------------------------------------------------------------


async def generation_response(
    serving: OpenAIServing, body: SamplingRequest, raw_request: Request
) -> Response:
    """Validate and admit (errors raise before any byte is sent), then stream or answer
    in full."""
    _client_request_id(body, raw_request)
    prepared = await _prepare(serving, body, raw_request)
    admission = raw_request.app.state.admission
    num_sequences = sum(prompt.params.n for prompt in prepared.prompts)
    ticket = admission.admit(num_sequences, "n" if len(prepared.prompts) == 1 else "prompt")
    if body.stream:
        return StreamingResponse(
            _released_after(serving.stream(body, prepared), ticket),
            media_type="text/event-stream",
            # Also here: a stream cut off before its first chunk never runs its `finally`.
            background=BackgroundTask(ticket.release),
        )
    try:
        response = await run_unless_disconnected(raw_request, serving.complete(body, prepared))
    finally:
        ticket.release()
    return response if response is not None else Response(status_code=499)


# A body this large is prepared (its template rendered, its text tokenized: seconds for
# megabytes) in a worker thread, where the tokenizer lets go of the GIL: a 4 MB prompt held
# every other stream and /health for 11 s. Smaller ones stay on the event loop, in the
# order they came. A chunked body has no Content-Length: its bytes, already read and kept
# by the request, are counted.
_PREPARE_ASIDE_BYTES = 256 * 1024


async def _prepare(serving, body, raw_request: Request):
    size = int(raw_request.headers.get("content-length") or 0) or len(await raw_request.body())
    if size < _PREPARE_ASIDE_BYTES:
        return serving.prepare(body)
    return await asyncio.to_thread(serving.prepare, body)


def _client_request_id(body, raw_request: Request) -> None:
    """An `X-Request-Id` header names the request over its body's `request_id` (vLLM's
    order), so a tracing proxy's id reaches the response's and the engine's logs."""
    header = raw_request.headers.get("X-Request-Id")
    if header:
        body.request_id = header


async def _released_after(stream: AsyncIterator[str], ticket: Ticket) -> AsyncIterator[str]:
    try:
        async for event in stream:
            yield event
    finally:
        ticket.release()
        await stream.aclose()


# One server-sent event (OpenAPI before 3.2 has a stream's `schema` describe each event):
# `data` is a chunk's JSON, an error body, or "[DONE]".
_SERVER_SENT_EVENT = {
    "type": "object",
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
    "required": ["data"],
}


def _full_or_streamed(response_model: type) -> dict:
    """The 200 of a generation route: a JSON body, or server-sent events with stream=true."""
    return {
        200: {
            "model": response_model,
            "content": {"text/event-stream": {"schema": _SERVER_SENT_EVENT}},
        }
    }


@router.post("/v1/completions", responses=_full_or_streamed(CompletionResponse))
async def create_completion(body: CompletionRequest, raw_request: Request):
    serving = raw_request.app.state.serving_completion
    return await generation_response(serving, body, raw_request)


@router.post("/v1/chat/completions", responses=_full_or_streamed(ChatCompletionResponse))
async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request):
    serving = raw_request.app.state.serving_chat
    return await generation_response(serving, body, raw_request)


@router.post("/v1/responses", responses=_full_or_streamed(ResponseObject))
async def create_response(body: ResponsesRequest, raw_request: Request):
    serving = raw_request.app.state.serving_responses
    return await generation_response(serving, body, raw_request)


@router.post("/v1/embeddings")
async def create_embedding(body: EmbeddingRequest, raw_request: Request) -> EmbeddingResponse:
    serving = raw_request.app.state.serving_embedding
    _client_request_id(body, raw_request)
    prompts, params = await _prepare(serving, body, raw_request)
    ticket = raw_request.app.state.admission.admit(len(prompts), "input")
    try:
        response = await run_unless_disconnected(
            raw_request, serving.create_embedding(body, prompts, params)
        )
    finally:
        ticket.release()
    return response if response is not None else Response(status_code=499)


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


# -- model info, tokenizer --------------------------------------------------------------------


@router.get("/v1/models")
async def show_models(raw_request: Request) -> ModelList:
    return raw_request.app.state.models.model_list()


# Plain text on success, as vLLM answers; errors are OpenAI's JSON body like every route's.
_PLAIN_SUCCESS = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}}


@router.post("/v1/load_lora_adapter", responses=_PLAIN_SUCCESS)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, raw_request: Request):
    state = _lora_updating(raw_request)
    await state.models.load(state.engine, body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", responses=_PLAIN_SUCCESS)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, raw_request: Request):
    state = _lora_updating(raw_request)
    await state.models.unload(state.engine, body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _lora_updating(raw_request: Request):
    """The app's state, where runtime LoRA updates are allowed (else a 404, as though the
    routes were not there: vLLM adds them only then)."""
    state = raw_request.app.state
    if not state.allow_runtime_lora_updating:
        raise OpenAIError("Not Found (start with --allow-runtime-lora-updating)", 404)
    return state


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, raw_request: Request) -> TokenizeResponse:
    return raw_request.app.state.serving_tokenization.tokenize(body)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, raw_request: Request) -> DetokenizeResponse:
    return raw_request.app.state.serving_tokenization.detokenize(body)


# -- operations -------------------------------------------------------------------------------


@router.get("/health", response_class=Response, responses={200: {"description": "Healthy"}})
@router.get("/ping", response_class=Response, include_in_schema=False)
@router.post("/ping", response_class=Response, include_in_schema=False)
async def health(raw_request: Request):
    """/health; /ping is vLLM's alias of it (SageMaker's probe)."""
    engine = raw_request.app.state.engine
    if engine.errored:
        return error_response(engine_dead_error(engine.dead_error()))
    return Response(status_code=200)


@router.get("/version")
async def show_version():
    return {"version": version()}


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(raw_request: Request):
    engine = raw_request.app.state.engine
    prometheus = raw_request.app.state.prometheus
    if not engine.errored:
        try:
            prometheus.record_engine_stats(await engine.get_engine_stats(timeout=5.0))
        except TimeoutError:
            # A step that compiles (--no-warmup) or runs long holds the engine's answer.
            logger.warning("could not read engine stats for /metrics: no answer in 5 s")
        except (EngineDeadError, RuntimeError) as e:
            logger.warning("could not read engine stats for /metrics: %s", e)
    return Response(prometheus.render(), media_type=CONTENT_TYPE_LATEST)
