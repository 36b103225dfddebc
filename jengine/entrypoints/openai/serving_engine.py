"""What every serving layer shares: the opening checks, request -> SamplingParams, context
length checks, the run to AsyncLLM, and the skeleton of a response (a full JSON body, or
server-sent events). Exceptions become OpenAI errors in errors.py.

Where it sits: between the FastAPI routes (routes.py) and AsyncLLM. A subclass
(serving_completion, serving_chat) turns its request into a `PreparedRequest` in
`prepare`, then says how engine outputs become its response (`response`) and its stream
chunks (`stream_chunks`); this class runs the engine and frames the stream.

Promises: every problem with a request surfaces as an `OpenAIError` (400/404/503) from
`prepare`, before any text is streamed, so a bad request never reaches the engine and
never produces a 500. A stream always ends with `data: [DONE]`; an error after it started
comes as one OpenAI-shaped error event just before that; with `stream_options.include_usage`
a chunk with no choices and the request's usage comes last (and with `continuous_usage_stats`
every chunk carries its choice's usage so far, as vLLM's: its prompt's tokens and its own
completion tokens).
"""

import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from pydantic import BaseModel

from jengine.engine.input_processor import check_truncation
from jengine.engine.output_processor import RequestError
from jengine.entrypoints.openai.async_merge import merge_async_iterators
from jengine.entrypoints.openai.beam_requests import beam_outputs, check_beam_request
from jengine.entrypoints.openai.errors import engine_dead_error, param_of, to_openai_error
from jengine.entrypoints.openai.logprob_format import LogprobFormat
from jengine.entrypoints.openai.protocol import (
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    UNSUPPORTED_FIELDS,
    OpenAIError,
    SamplingRequest,
    UsageInfo,
    now,
    random_id,
)
from jengine.entrypoints.openai.sampling_request import sampling_params_of
from jengine.entrypoints.openai.serving_models import ServingModels
from jengine.entrypoints.openai.usage_counts import StreamUsage, usage
from jengine.fault_injection import FaultInjector
from jengine.lora_request import LoRARequest
from jengine.outputs import RequestOutput
from jengine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"


@dataclass
class EnginePrompt:
    """One prompt as the engine gets it, with its own SamplingParams and engine request id
    (the response id itself, or `<id>-<i>` for the i-th prompt of a completion batch)."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams
    request_id: str


@dataclass
class PreparedRequest:
    """A request that passed every check: what `prepare` hands to `complete`/`stream`."""

    request_id: str  # the response's `id`
    prompts: list[EnginePrompt]
    messages: list[dict] | None = None  # chat: the conversation, as the template got it
    model: str = ""  # the response's `model`: the adapter's name, or the served model's
    lora_request: LoRARequest | None = None
    # chat with --reasoning-parser: whether the reply starts inside a think block
    thinking: bool | None = None
    # The response's `created` (every chunk's, as OpenAI's): when the request was taken.
    created: int = field(default_factory=now)


class OpenAIServing:
    # Set by the generation subclasses: the stream chunk model of their API (for the final
    # usage chunk) and the prefix of the response ids they make up.
    chunk_type: type[BaseModel]
    request_id_prefix: str

    def __init__(
        self,
        engine,
        models: ServingModels,
        *,
        return_tokens_as_token_ids: bool = False,
        enable_prompt_tokens_details: bool = False,
    ):
        """`return_tokens_as_token_ids` (--return-tokens-as-token-ids): what a request that
        does not say gets; `enable_prompt_tokens_details` (--enable-prompt-tokens-details):
        usage tells how many prompt tokens the prefix cache served."""
        self.engine = engine
        self.models = models
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.get_tokenizer()
        self.faults = FaultInjector.from_env()
        self.logprob_format = LogprobFormat(self.tokenizer)

    # -- opening checks -------------------------------------------------------------------

    def check_request(self, request: SamplingRequest) -> None:
        """What every generation request is checked for first: model, engine,
        stream_options, the bounds on stop strings."""
        self.check_model(request.model)
        self.check_engine()
        if self.engine.input_processor.pooler is not None:
            raise OpenAIError(
                "this model serves embeddings (--runner pooling): use /v1/embeddings; it "
                "generates nothing",
                param="model",
            )
        try:
            self.engine.input_processor.validate_priority(request.priority)
        except ValueError as e:
            raise OpenAIError(str(e), param="priority") from None
        if request.return_tokens_as_token_ids is None:  # decided here, once, for the formatting
            request.return_tokens_as_token_ids = self.return_tokens_as_token_ids
        if request.stream_options is not None and not request.stream:
            raise OpenAIError("stream_options needs stream=true", param="stream_options")
        self.check_extra_fields(request)
        check_beam_request(request, self.engine.input_processor.max_logprobs)
        self.check_truncation(request.truncate_prompt_tokens)
        if request.stream and request.prompt_logprobs is not None:
            # vLLM refuses them above 0 and streams none at 0: nothing silently dropped here.
            raise OpenAIError(
                "prompt_logprobs are not available when stream=true", param="prompt_logprobs"
            )
        stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
        if len(stops) > MAX_STOP_SEQUENCES:
            raise OpenAIError(
                f"stop has {len(stops)} strings; at most {MAX_STOP_SEQUENCES} are allowed",
                param="stop",
            )
        if any(len(stop) > MAX_STOP_CHARS for stop in stops):
            raise OpenAIError(
                f"stop strings may be at most {MAX_STOP_CHARS} characters long", param="stop"
            )

    def check_extra_fields(self, request) -> None:
        """Fields the request model does not know: vLLM's unsupported ones are a 400, the
        rest are accepted and logged, as vLLM does."""
        extra = request.model_extra or {}
        for name in UNSUPPORTED_FIELDS:
            if extra.get(name) not in (None, False, [], {}):
                raise OpenAIError(f"{name} is not supported", param=name)
        if extra:
            logger.warning("request fields ignored: %s", ", ".join(sorted(extra)))

    def check_truncation(self, truncate: int | None) -> None:
        try:
            check_truncation(truncate, self.max_model_len)
        except ValueError as e:
            raise OpenAIError(str(e), param="truncate_prompt_tokens") from None

    def check_model(self, model: str | None) -> None:
        self.models.lora_request(model)  # a 404 for a name neither served nor loaded

    def prepared(self, request: SamplingRequest, request_id: str, prompts, messages=None):
        """The checked request, with the adapter its `model` names."""
        for prompt in prompts:
            prompt.request_id = self.engine_request_id(request, prompt.request_id)
        return PreparedRequest(
            request_id,
            prompts,
            messages,
            model=self.models.response_name(request.model),
            lora_request=self.models.lora_request(request.model),
        )

    def check_engine(self) -> None:
        if self.engine.errored:
            raise engine_dead_error(self.engine.dead_error())

    def require_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise OpenAIError("this model has no tokenizer; only token-id prompts work")

    @staticmethod
    def engine_request_id(request, engine_id: str) -> str:
        """`engine_id` (the response's id, a batch's `<id>-<i>`) with a suffix of its own
        where the client chose the id, as vLLM's: a retry under the id of a request still
        ending, or two requests with one id at once, run side by side (the second was
        refused as in use, also while the first's abort was on its way)."""
        return f"{engine_id}-{uuid.uuid4().hex[:8]}" if request.request_id else engine_id

    def response_id(self, request: SamplingRequest) -> str:
        """`<prefix><id>` (`chatcmpl-...`) of the client's id (its X-Request-Id header, else
        its `request_id`), as vLLM's; a fresh one without."""
        if request.request_id:
            return f"{self.request_id_prefix}{request.request_id}"
        return random_id(self.request_id_prefix)

    # -- sampling parameters --------------------------------------------------------------

    def sampling_params(
        self,
        request: SamplingRequest,
        *,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
    ) -> SamplingParams:
        return sampling_params_of(
            request, self.engine.sampling_defaults, max_tokens, logprobs, prompt_logprobs
        )

    def max_tokens_for(
        self, requested: int | None, prompt_len: int, what: str, field: str = "max_tokens"
    ) -> int:
        """Check prompt + completion against max_model_len (errors name `field`); None: all
        that is left, or the checkpoint's recommended max_tokens if less."""
        if prompt_len >= self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your request has {prompt_len} input tokens. Please reduce the "
                f"length of the input {what}.",
                param="messages" if what == "messages" else "prompt",
            )
        if requested is None:  # the rest of the context, or less if the checkpoint says so
            left = self.max_model_len - prompt_len
            return min(self.engine.sampling_defaults.get("max_tokens") or left, left)
        if requested < 1:
            raise OpenAIError(f"{field} must be at least 1, got {requested}", param=field)
        if prompt_len + requested > self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {prompt_len + requested} tokens ({prompt_len} in "
                f"the {what}, {requested} in the completion). Please reduce the length of "
                f"the {what} or completion.",
                param=field,
            )
        return requested

    def validate_prompt(
        self, token_ids: list[int], params: SamplingParams, constraint_field: str
    ) -> None:
        """The engine's checks of a prompt and its parameters; a refused output constraint
        names `constraint_field`, the request field it came from."""
        try:
            self.engine.input_processor.validate(token_ids, params)
        except ValueError as e:
            param = param_of(str(e)) or "prompt"
            if param == "structured_outputs":
                param = constraint_field
            raise to_openai_error(e, param) from None

    # -- running the engine ---------------------------------------------------------------

    def generate(
        self, request: SamplingRequest, prepared: PreparedRequest, kind: RequestOutputKind
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) of every prompt's engine request, as they arrive; closing
        it aborts the requests still running. With use_beam_search: each prompt's beams,
        once, as one finished output."""
        if getattr(request, "use_beam_search", False):
            return beam_outputs(self.engine, request, prepared)
        generators = [
            self.engine.generate(
                {
                    "prompt_token_ids": prompt.token_ids,
                    "prompt": prompt.text,
                    "cache_salt": request.cache_salt,
                },
                prompt.params,
                prompt.request_id,
                priority=request.priority,
                output_kind=kind,
                lora_request=prepared.lora_request,
            )
            for prompt in prepared.prompts
        ]
        return merge_async_iterators(*generators)

    async def complete(self, request: SamplingRequest, prepared: PreparedRequest) -> BaseModel:
        """The full (non-streamed) response."""
        finals: list[RequestOutput | None] = [None] * len(prepared.prompts)
        try:
            async for index, output in self.generate(
                request, prepared, RequestOutputKind.FINAL_ONLY
            ):
                finals[index] = output
        except (ValueError, RequestError) as e:
            # A constraint the engine refused (400) or one that failed mid-way (500): the
            # engine's words either way.
            raise to_openai_error(e) from None
        if self.faults is not None:
            self.faults.check("format", prepared.request_id)
        return self.response(request, prepared, finals)

    def response(
        self, request: SamplingRequest, prepared: PreparedRequest, finals: list[RequestOutput]
    ) -> BaseModel:
        """The subclass's full response from the final output of every prompt."""
        raise NotImplementedError

    def usage_of(self, finals: list[RequestOutput]) -> UsageInfo:
        """A full response's usage: every prompt's tokens and every sequence's."""
        cached = sum(final.num_cached_tokens for final in finals)
        return usage(
            sum(len(final.prompt_token_ids) for final in finals),
            sum(len(seq.token_ids) for final in finals for seq in final.outputs),
            cached if self.enable_prompt_tokens_details else None,
        )

    async def stream(
        self, request: SamplingRequest, prepared: PreparedRequest
    ) -> AsyncIterator[str]:
        """The SSE body: `stream_chunks` framed as events, then the usage chunk (with
        stream_options.include_usage), an error event if anything failed, and `[DONE]`.
        Closing it (the client went away) closes `stream_chunks`, which aborts the engine
        requests still running."""
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous_usage = include_usage and bool(options.continuous_usage_stats)
        counts = StreamUsage(
            [len(prompt.token_ids) for prompt in prepared.prompts],
            with_details=self.enable_prompt_tokens_details,
            n=request.n,
        )
        try:
            async with aclosing(self.stream_chunks(request, prepared, counts)) as chunks:
                async for chunk in chunks:
                    if self.faults is not None:
                        self.faults.check("format", prepared.request_id)
                    if continuous_usage:
                        choice = chunk.choices[0].index if chunk.choices else None
                        chunk.usage = counts.info() if choice is None else counts.of_choice(choice)
                    yield sse(chunk.model_dump_json())
            if include_usage:
                final = self.chunk_type(
                    id=prepared.request_id,
                    created=prepared.created,
                    model=prepared.model,
                    choices=[],
                    usage=counts.info(),
                )
                yield sse(final.model_dump_json())
        except Exception as e:
            error = to_openai_error(e)
            if error.status_code >= 500:
                logger.error("stream %s ended with an error: %r", prepared.request_id, e)
            yield sse(error.to_response().model_dump_json())
        yield SSE_DONE

    def stream_chunks(
        self, request: SamplingRequest, prepared: PreparedRequest, counts: StreamUsage
    ) -> AsyncIterator[BaseModel]:
        """The subclass's stream chunks, in order; adds each delta's tokens to `counts`
        before yielding the chunk that carries them."""
        raise NotImplementedError


# -- small helpers ----------------------------------------------------------------------------


def sse(data: str) -> str:
    return f"data: {data}\n\n"
