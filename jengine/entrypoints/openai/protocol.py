"""Pydantic models of the OpenAI-compatible HTTP API: errors, the request fields that
completions and chat share, and completions' requests, responses and stream chunks (chat
completions' own: protocol_chat.py).

Where it sits: FastAPI validates request bodies against these models (a bad or missing
field becomes a 400 in OpenAI's error shape, see api_server.py); the serving layers
(serving_completion.py, serving_chat.py) turn them into SamplingParams and build the
responses. Pydantic lives only in this HTTP layer; the engine speaks msgspec.

Field names and defaults follow OpenAI's API, plus vLLM's extra sampling fields (top_k,
min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids, ...), which the
official client sends through `extra_body`. Unknown fields are accepted and ignored (the
log names them), as vLLM does, except vLLM's own fields that jengine does not implement
(`UNSUPPORTED_FIELDS`): each of those, set, is a 400.
"""

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator
from pydantic_core import PydanticCustomError

# Bounds that keep every integer inside msgpack's 64-bit range and the fan-out sane.
_INT64 = dict(ge=-(2**63), le=2**63 - 1)
MAX_N = 128
# Bounds on what one request may ask for (each a 400 naming its field; the serving layer
# checks the ones a union type would make unreadable as schema errors).
MAX_PROMPTS = 256  # prompts in one completion request
MAX_STOP_SEQUENCES = 64
MAX_STOP_CHARS = 1024  # per stop string
MAX_LOGIT_BIAS_ENTRIES = 1024


def random_id(prefix: str) -> str:
    """`prefix` (its separator included: OpenAI's `chatcmpl-`, `resp_`) and a fresh hex."""
    return f"{prefix}{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def _lone_surrogate_at(value: Any, path: tuple = ()) -> tuple | None:
    """Where in a JSON value a string holds a lone UTF-16 surrogate ("\\ud800" is valid JSON
    but no Unicode character: no tokenizer or UTF-8 encoder takes it), else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
    elif isinstance(value, dict):
        for key, item in value.items():
            if (found := _lone_surrogate_at(item, (*path, key))) is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if (found := _lone_surrogate_at(item, (*path, index))) is not None:
                return found
    return None


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class RequestModel(OpenAIBaseModel):
    """A request body: its text anywhere must be Unicode (a 400 naming the field, not a
    tokenizer's TypeError as a 500)."""

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data: Any) -> Any:
        if (path := _lone_surrogate_at(data)) is not None:
            where = ".".join(map(str, path))
            raise PydanticCustomError(
                "lone_surrogate",
                "{param} holds a lone UTF-16 surrogate, which is not a Unicode character",
                {"param": where},
            )
        return data


# -- errors ---------------------------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class OpenAIError(Exception):
    """Raised anywhere in request handling; api_server turns it into an ErrorResponse."""

    TYPES = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        405: "MethodNotAllowedError",
        413: "RequestTooLargeError",
        429: "RateLimitError",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.headers = headers  # e.g. Retry-After on a 429

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(
                message=self.message,
                type=self.TYPES.get(self.status_code, "Error"),
                param=self.param,
                code=self.status_code,
            )
        )


# -- shared request fields ------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(OpenAIBaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(RequestModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    seed: Annotated[int, Field(**_INT64)] | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    echo: bool = False
    # vLLM's extra sampling fields
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=2**31 - 1)] = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None  # -1: all
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None
    priority: Annotated[int, Field(**_INT64)] = 0
    request_id: str | None = None
    allowed_token_ids: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = None
    # vLLM's output fields: the prompt's and the reply's token ids beside the text; logprob
    # tokens as "token_id:<id>" (for tokens whose text does not survive JSON).
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool | None = None  # None: the server's default
    # Prefix-cache blocks are shared only among requests with the same salt.
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    bad_words: list[str] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, and the
    # older guided_* names (jengine/entrypoints/openai/structured_outputs.py).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's beam search: n beams (entrypoints/openai/beam_requests.py).
    use_beam_search: bool = False
    length_penalty: float = 1.0


# vLLM's request fields that jengine does not implement: set, each is a 400 naming it,
# where an unknown field would be accepted and ignored (a user asking for beam search or
# a prompt's embeddings must not get an ordinary answer as if they had been applied).
UNSUPPORTED_FIELDS = (
    "use_beam_search",  # declared (so never extra) on the completion and chat routes
    "logits_processors",
    "prompt_embeds",
    "repetition_detection",
)


# -- completions ----------------------------------------------------------------------------

TokenId = Annotated[int, Field(**_INT64)]


class CompletionRequest(SamplingRequest):
    prompt: list[TokenId] | list[list[TokenId]] | str | list[str]
    max_tokens: Annotated[int, Field(**_INT64)] | None = 16
    logprobs: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None  # -1: all
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # With --enable-prompt-tokens-details: how many prompt tokens the prefix cache served.
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class PromptLogprob(OpenAIBaseModel):
    """vLLM's entry of one candidate at one prompt position (`prompt_logprobs`)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's `prompt_logprobs` of a response: one entry per prompt token, None for the first
# (nothing precedes it); else token id -> its entry, the prompt's own token included.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids (a stream: first chunk)
    token_ids: list[int] | None = None  # return_token_ids (a stream: each chunk's new ones)


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class StreamChunk(OpenAIBaseModel):
    """A stream chunk carries vLLM's token-id fields only where they have ids: the prompt's
    once, the reply's in the chunks that bring them."""

    @model_serializer(mode="wrap")
    def _drop_absent_token_ids(self, handler):
        data = handler(self)
        for part in (data, *data.get("choices", ())):
            for key in ("prompt_token_ids", "token_ids"):
                if key in part and part[key] is None:
                    del part[key]
        return data


class CompletionStreamResponse(StreamChunk):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None
