"""vLLM's `use_beam_search` on the completion and chat routes: `n` beams of each prompt,
found by jengine/beam_search.py over the engine, answered as the route answers `n`
sampled choices (streamed as one chunk per beam once the search ends).

Where it sits: OpenAIServing.check_request calls `check_beam_request` while it checks a
request; OpenAIServing.generate hands the prepared prompts to `beam_outputs` instead of
the engine when the request asks for beams.

Promises: beam search takes the fields vLLM's takes (n as beam_width, max_tokens,
temperature, ignore_eos, length_penalty, include_stop_str_in_output, logprobs); a request
that also sets a field that would change sampling (stop strings, penalties, seeds, output
constraints, ...) is a 400 naming it, where vLLM ignores it; `length_penalty` without beam
search is a 400 too.
"""

from collections.abc import AsyncIterator

from jengine.beam_search import beam_search_output
from jengine.entrypoints.openai.async_merge import merge_async_iterators
from jengine.entrypoints.openai.protocol import OpenAIError, SamplingRequest
from jengine.outputs import RequestOutput
from jengine.sampling_params import BeamSearchParams

# Request fields beam search does not apply: set with use_beam_search, each is a 400.
NOT_WITH_BEAMS = (
    "stop", "stop_token_ids", "seed", "top_p", "top_k", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids",
    "bad_words", "min_tokens", "prompt_logprobs", "best_of", "response_format",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
)  # fmt: skip


def check_beam_request(request, max_logprobs: int) -> None:
    """A completion or chat request's beam fields (other routes have none)."""
    if not isinstance(request, SamplingRequest):
        return
    if not request.use_beam_search:
        if request.length_penalty != 1.0:
            raise OpenAIError(
                "length_penalty applies only with use_beam_search", param="length_penalty"
            )
        return
    fields = type(request).model_fields
    for name in NOT_WITH_BEAMS:
        value = getattr(request, name, None)
        if name in request.model_fields_set and value not in (None, [], {}, fields[name].default):
            raise OpenAIError(f"{name} does not apply with use_beam_search", param=name)
    tool_choice = getattr(request, "tool_choice", None)  # chat: a forced call constrains
    if tool_choice == "required" or isinstance(tool_choice, dict):
        raise OpenAIError("a forced tool call does not apply with use_beam_search",
                          param="tool_choice")  # fmt: skip
    if 2 * request.n > max_logprobs:
        raise OpenAIError(
            f"n={request.n} beams take {2 * request.n} logprobs a step, more than the "
            f"server's --max-logprobs ({max_logprobs})",
            param="n",
        )


def beam_outputs(engine, request: SamplingRequest, prepared) -> AsyncIterator:
    """(prompt index, its finished RequestOutput of n beams) for every prompt, as each
    search ends; closing it cancels the searches still running."""

    async def search(prompt) -> AsyncIterator[RequestOutput]:
        params = BeamSearchParams(
            beam_width=request.n,
            max_tokens=prompt.params.max_tokens,
            ignore_eos=request.ignore_eos,
            temperature=request.temperature or 0.0,
            length_penalty=request.length_penalty,
            include_stop_str_in_output=request.include_stop_str_in_output,
        )
        yield await beam_search_output(
            engine,
            prompt.token_ids,
            params,
            prompt.request_id,
            lora_request=prepared.lora_request,
            cache_salt=request.cache_salt,
            num_logprobs=prompt.params.logprobs,
        )

    return merge_async_iterators(*(search(prompt) for prompt in prepared.prompts))
