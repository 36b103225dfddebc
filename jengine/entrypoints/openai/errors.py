"""How failures become OpenAI-shaped errors: the one mapping of exceptions to `OpenAIError`,
and the JSON response that carries one.

Where it sits: the serving layers raise `OpenAIError` (or let the engine's ValueError /
EngineDeadError through `to_openai_error`); api_server.py's exception handlers and the
streaming skeleton in serving_engine.py turn them into `{"error": {"message", "type",
"param", "code"}}`, as a JSON body or as one server-sent event.
"""

import re

from fastapi.responses import JSONResponse

from jengine.engine.client import EngineDeadError
from jengine.engine.output_processor import RequestFailedError
from jengine.entrypoints.openai.protocol import OpenAIError


def to_openai_error(
    error: BaseException,
    param: str | None = None,
    *,
    bad_input: tuple[type[Exception], ...] = (ValueError,),
) -> OpenAIError:
    """An OpenAIError as it is; the engine gone (EngineDeadError) -> 503; input the engine
    side refused (a ValueError, unless `bad_input` says otherwise) -> 400 naming `param`;
    anything else -> 500."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, EngineDeadError):
        return engine_dead_error(error)
    if isinstance(error, bad_input):
        return OpenAIError(str(error), param=param)
    if isinstance(error, RequestFailedError):  # the engine's own words, not a crash
        return OpenAIError(str(error), 500)
    return OpenAIError(f"internal error: {type(error).__name__}: {error}", 500)


def engine_dead_error(error: BaseException | None = None) -> OpenAIError:
    detail = f": {error}" if error else ""
    return OpenAIError(f"The engine is not available{detail}", 503)


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(
        error.to_response().model_dump(), status_code=error.status_code, headers=error.headers
    )


# Request fields that SamplingParams and the input processor name first in their errors.
_PARAM_NAMES = {
    "n",
    "structured_outputs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "continue_final_message",
    "chat_template_kwargs",
}


def param_of(message: str) -> str | None:
    """The request field an engine-side check's message starts with ("top_p must be ...")."""
    match = re.match(r"[a-z_]+", message)
    return match.group(0) if match and match.group(0) in _PARAM_NAMES else None
