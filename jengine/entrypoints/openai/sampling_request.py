"""An OpenAI request's sampling fields as the engine's SamplingParams, and the prompt
truncation it asks for.

Where it sits: the generation routes (serving_engine.OpenAIServing.sampling_params,
serving_completion.py, serving_chat.py) call `sampling_params_of` and `truncated`; a bad
field is an `OpenAIError` naming it.
"""

import math

from jengine.engine.input_processor import last_prompt_tokens
from jengine.entrypoints.openai.errors import param_of, to_openai_error
from jengine.entrypoints.openai.protocol import OpenAIError, SamplingRequest
from jengine.entrypoints.openai.structured_outputs import structured_outputs_of
from jengine.generation_config import given_over
from jengine.sampling_params import SamplingParams

LOGIT_BIAS_LIMIT = 100.0  # OpenAI clamps biases to [-100, 100]
# The request fields a checkpoint may recommend a value for (unset: its value, else
# SamplingParams' own default).
TUNABLE = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
)


def sampling_params_of(
    request: SamplingRequest,
    recommended: dict,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None,
) -> SamplingParams:
    """The request's sampling fields as SamplingParams; a field it leaves unset takes the
    checkpoint's `recommended` value (jengine/generation_config.py), else jengine's."""
    bias = _logit_bias(request.logit_bias)
    try:
        return SamplingParams(
            n=request.n,
            **given_over(recommended, {name: getattr(request, name) for name in TUNABLE}),
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
            structured_outputs=structured_outputs_of(request),
            allowed_token_ids=request.allowed_token_ids,
            bad_words=request.bad_words,
        )
    except (ValueError, TypeError) as e:
        raise to_openai_error(e, param_of(str(e)), bad_input=(ValueError, TypeError)) from None


def truncated(
    request: SamplingRequest, text: str | None, token_ids: list[int], max_model_len: int
) -> tuple[str | None, list[int]]:
    """The prompt `truncate_prompt_tokens` keeps; a prompt that lost tokens loses its text
    too (echo then decodes what is kept)."""
    kept = last_prompt_tokens(token_ids, request.truncate_prompt_tokens, max_model_len)
    return (text, token_ids) if len(kept) == len(token_ids) else (None, kept)


def _logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """Keys to token ids, values clamped to OpenAI's range."""
    if not logit_bias:
        return None
    bias = {}
    for key, value in logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise OpenAIError(
                f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
        if not math.isnan(value):
            value = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, value))
        bias[token_id] = value
    return bias
