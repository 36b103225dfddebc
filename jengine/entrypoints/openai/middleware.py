"""The server's ASGI middleware: what every HTTP request passes before a route sees it.

Where it sits: api_server.py's `build_app` wraps the FastAPI app in these (outermost
first: draining, CORS, API key, body size). All are pure ASGI, not BaseHTTPMiddleware,
which would get between a stream and its client's disconnect. Every refusal is OpenAI's
error body:
- `APIKeyMiddleware` (with --api-key): `Authorization: Bearer <key>`, compared in constant
  time, on /v1/*, /tokenize, /detokenize and /metrics; 401 otherwise. /health and
  /version stay open (probes carry no key).
- `BodySizeLimitMiddleware`: a body over --max-request-body-bytes is a 413, whether its
  Content-Length says so up front or its chunks add up to it (a chunked body is read
  here, never more than the limit, then handed on).
- `RequestIdHeaderMiddleware` (with --enable-request-id-headers, vLLM's): every response
  carries `X-Request-Id`, the request's own or a fresh one.
- `UnexpectedErrorMiddleware`, innermost: an exception no route turned into an error body
  is a 500 in OpenAI's shape, logged, and the connection stays open for the client's next
  request (Starlette's own last-resort handler re-raises after its 500, and uvicorn then
  closed a keep-alive connection, failing that next request).
- `DrainingMiddleware`, outermost, so it sees a request the moment uvicorn has read it:
  once shutdown began, every request arriving but /metrics and /version is a 503 at once
  (/health included, so load balancers stop sending traffic); before that it counts the
  requests in flight, which the shutdown waits for (received means served).
"""

import logging
import secrets
import uuid

from jengine.entrypoints.openai.admission import Admission, shutting_down_error
from jengine.entrypoints.openai.errors import error_response
from jengine.entrypoints.openai.protocol import OpenAIError

logger = logging.getLogger(__name__)

PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/metrics")
OPEN_WHILE_DRAINING = ("/metrics", "/version")


def _is_http(scope) -> bool:
    return scope["type"] == "http"


class APIKeyMiddleware:
    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if (
            _is_http(scope)
            and scope["method"] != "OPTIONS"  # CORS preflights carry no credentials
            and scope["path"].startswith(PROTECTED_PREFIXES)
        ):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(auth, self.expected):
                error = OpenAIError("Unauthorized: missing or invalid API key", 401, "api_key")
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestIdHeaderMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if not _is_http(scope):
            await self.app(scope, receive, send)
            return
        request_id = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(f"The request body is larger than {limit} bytes", 413)


class BodySizeLimitMiddleware:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if not _is_http(scope):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            # h11 holds the body to its Content-Length, so that is all there is to check.
            if not declared.isdigit() or int(declared) <= self.max_bytes:
                await self.app(scope, receive, send)
                return
            await error_response(_too_large(self.max_bytes))(scope, receive, send)
            return
        # A chunked body: read it here, up to the limit, and hand it on in one piece.
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                await error_response(_too_large(self.max_bytes))(scope, receive, send)
                return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class DrainingMiddleware:
    def __init__(self, app, admission: Admission):
        self.app = app
        self.admission = admission

    async def __call__(self, scope, receive, send):
        if not _is_http(scope) or scope["path"].startswith(OPEN_WHILE_DRAINING):
            await self.app(scope, receive, send)
            return
        if self.admission.draining:
            await error_response(shutting_down_error())(scope, receive, send)
            return
        self.admission.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.num_in_flight -= 1


class UnexpectedErrorMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if not _is_http(scope):
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            if started:  # half a response is out: only closing the connection ends it
                raise
            logger.exception("unhandled error in %s %s", scope["method"], scope["path"])
            error = OpenAIError(f"internal error: {type(e).__name__}", 500)
            await error_response(error)(scope, receive, send)
