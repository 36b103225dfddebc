"""What the completion and chat serving layers share: model-name checks, request ->
SamplingParams, context-length checks, logprob formatting, streaming helpers.

Where it sits: between the FastAPI routes (api_server.py) and AsyncLLM. Every problem
with a request surfaces here as an `OpenAIError` (400/404/503) before any text is
streamed, so a bad request never reaches the engine and never produces a 500.
"""

import asyncio
import math
import re
from collections.abc import AsyncIterator

from jengine.engine.client import EngineDeadError
from jengine.entrypoints.openai.protocol import (
    OpenAIError,
    SamplingRequest,
    UsageInfo,
)
from jengine.outputs import Logprob
from jengine.sampling_params import SamplingParams

LOGIT_BIAS_LIMIT = 100.0  # OpenAI clamps biases to [-100, 100]


class OpenAIServing:
    def __init__(self, engine, served_model_names: list[str], model_path: str | None):
        self.engine = engine
        self.served_model_names = served_model_names
        self.model_path = model_path
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.get_tokenizer()

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")

    def check_engine(self) -> None:
        if self.engine.errored:
            raise engine_dead_error(self.engine.dead_error())

    def check_stream_options(self, request: SamplingRequest) -> None:
        if request.stream_options is not None and not request.stream:
            raise OpenAIError("stream_options needs stream=true", param="stream_options")

    def require_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise OpenAIError("this model has no tokenizer; only token-id prompts work")

    # -- sampling parameters --------------------------------------------------------------

    def sampling_params(
        self,
        request: SamplingRequest,
        *,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
    ) -> SamplingParams:
        bias = None
        if request.logit_bias:
            bias = {}
            for key, value in request.logit_bias.items():
                try:
                    token_id = int(key)
                except ValueError:
                    raise OpenAIError(
                        f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                    ) from None
                if not math.isnan(value):
                    value = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, value))
                bias[token_id] = value
        try:
            return SamplingParams(
                n=request.n,
                presence_penalty=_default(request.presence_penalty, 0.0),
                frequency_penalty=_default(request.frequency_penalty, 0.0),
                repetition_penalty=_default(request.repetition_penalty, 1.0),
                temperature=_default(request.temperature, 1.0),
                top_p=_default(request.top_p, 1.0),
                top_k=_default(request.top_k, 0),
                min_p=_default(request.min_p, 0.0),
                seed=request.seed,
                stop=request.stop,
                stop_token_ids=request.stop_token_ids,
                ignore_eos=request.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                logit_bias=bias,
                include_stop_str_in_output=request.include_stop_str_in_output,
                skip_special_tokens=request.skip_special_tokens,
                spaces_between_special_tokens=request.spaces_between_special_tokens,
            )
        except (ValueError, TypeError) as e:
            raise OpenAIError(str(e), param=_param_of(str(e))) from None

    def max_tokens_for(self, requested: int | None, prompt_len: int, what: str) -> int:
        """Check prompt + completion against max_model_len; None means all that is left."""
        if prompt_len >= self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your request has {prompt_len} input tokens. Please reduce the "
                f"length of the input {what}.",
                param="messages" if what == "messages" else "prompt",
            )
        if requested is None:
            return self.max_model_len - prompt_len
        if requested < 1:
            raise OpenAIError(f"max_tokens must be at least 1, got {requested}", param="max_tokens")
        if prompt_len + requested > self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {prompt_len + requested} tokens ({prompt_len} in "
                f"the {what}, {requested} in the completion). Please reduce the length of "
                f"the {what} or completion.",
                param="max_tokens",
            )
        return requested

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        try:
            self.engine.input_processor.validate(token_ids, params)
        except ValueError as e:
            raise OpenAIError(str(e), param=_param_of(str(e)) or "prompt") from None

    # -- logprobs -------------------------------------------------------------------------

    def token_str(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


def top_k_of(row: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely candidates of one position (rank order; the chosen token appears
    only if it is among them)."""
    ranked = sorted(row.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
    return ranked[:k]


def clamp_logprob(value: float) -> float:
    # JSON has no -inf; OpenAI and vLLM report -9999.0 for impossible tokens.
    return max(value, -9999.0) if not math.isnan(value) else -9999.0


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def engine_dead_error(error: BaseException | None = None) -> OpenAIError:
    detail = f": {error}" if error else ""
    return OpenAIError(f"The engine is not available{detail}", 503)


def sse(data: str) -> str:
    return f"data: {data}\n\n"


def sse_error(error: OpenAIError) -> str:
    return sse(error.to_response().model_dump_json())


def stream_error(e: BaseException) -> OpenAIError:
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, EngineDeadError):
        return engine_dead_error(e)
    if isinstance(e, ValueError):
        return OpenAIError(str(e))
    return OpenAIError(f"internal error: {type(e).__name__}: {e}", 500)


async def merge_async_iterators(*iterators: AsyncIterator) -> AsyncIterator[tuple[int, object]]:
    """Yield (index of source, item) from several async iterators as items arrive; closing
    the merged iterator cancels (and so aborts) every source still running."""
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            aclose = getattr(iterators[0], "aclose", None)
            if aclose is not None:
                await aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(index: int, iterator: AsyncIterator) -> None:
        try:
            async for item in iterator:
                await queue.put((index, item))
            await queue.put((index, done))
        except Exception as e:
            await queue.put((index, e))

    tasks = [asyncio.create_task(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _default(value, default):
    return default if value is None else value


_PARAM_NAMES = {
    "n",
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
}


def _param_of(message: str) -> str | None:
    """SamplingParams errors start with the field name ("top_p must be ...")."""
    match = re.match(r"[a-z_]+", message)
    return match.group(0) if match and match.group(0) in _PARAM_NAMES else None
