"""`POST /v1/completions`: prompts (text, token ids, or batches of either) -> completions,
as one JSON body or as server-sent events.

Where it sits: api_server.py routes here; everything is validated (model, sampling fields,
prompt + max_tokens against max_model_len, token ids, logprob counts) before a request
reaches AsyncLLM, so errors are plain 400/404 bodies and never half a stream. Choice
`index` is prompt_index * n + sequence_index, as in OpenAI's API.
"""

from collections.abc import AsyncIterator

from jengine.engine.output_processor import RequestOutputKind
from jengine.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    OpenAIError,
    random_id,
)
from jengine.entrypoints.openai.serving_engine import (
    OpenAIServing,
    clamp_logprob,
    merge_async_iterators,
    sse,
    sse_error,
    stream_error,
    top_k_of,
    usage,
)
from jengine.outputs import Logprob, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    def prepare(self, request: CompletionRequest):
        """Validate; returns (request id, [(prompt text, token ids)], [SamplingParams])."""
        self.check_model(request.model)
        self.check_engine()
        self.check_stream_options(request)
        if request.suffix:
            raise OpenAIError("suffix is not supported", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError("best_of is not supported (use n)", param="best_of")
        prompts = self._tokenize(request)
        all_params = []
        for _, token_ids in prompts:
            max_tokens = self.max_tokens_for(request.max_tokens, len(token_ids), "prompt")
            prompt_logprobs = request.prompt_logprobs
            if request.echo and request.logprobs is not None:
                prompt_logprobs = max(prompt_logprobs or 0, request.logprobs)
            params = self.sampling_params(
                request,
                max_tokens=max_tokens,
                logprobs=request.logprobs,
                prompt_logprobs=prompt_logprobs,
            )
            self.validate_prompt(token_ids, params)
            all_params.append(params)
        return request.request_id or random_id("cmpl"), prompts, all_params

    def _tokenize(self, request: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        prompt = request.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise OpenAIError("prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        prompts = []
        for item in prompt:
            if isinstance(item, str):
                self.require_tokenizer()
                ids = self.tokenizer.encode(item, add_special_tokens=request.add_special_tokens)
                prompts.append((item, ids))
            else:
                prompts.append((None, list(item)))
        return prompts

    def _generators(self, request, request_id, prompts, all_params, kind):
        return [
            self.engine.generate(
                {"prompt_token_ids": ids, "prompt": text},
                params,
                f"{request_id}-{i}",
                priority=request.priority,
                output_kind=kind,
            )
            for i, ((text, ids), params) in enumerate(zip(prompts, all_params, strict=True))
        ]

    def _prompt_text(self, text: str | None, token_ids: list[int]) -> str:
        if text is not None:
            return text
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    # -- full response --------------------------------------------------------------------

    async def complete(self, request: CompletionRequest, request_id, prompts, all_params):
        finals: list[RequestOutput | None] = [None] * len(prompts)
        generators = self._generators(
            request, request_id, prompts, all_params, RequestOutputKind.FINAL_ONLY
        )
        try:
            async for i, output in merge_async_iterators(*generators):
                finals[i] = output
        except ValueError as e:  # e.g. a client-chosen request_id already in use
            raise OpenAIError(str(e)) from None
        choices = []
        num_prompt_tokens = num_generated = 0
        for i, output in enumerate(finals):
            text, token_ids = prompts[i]
            num_prompt_tokens += len(output.prompt_token_ids)
            for seq in output.outputs:
                num_generated += len(seq.token_ids)
                body, logprobs = seq.text, None
                if request.echo:
                    body = self._prompt_text(text, token_ids) + body
                if request.logprobs is not None:
                    ids, rows = list(seq.token_ids), list(seq.logprobs or [])
                    if request.echo:
                        ids = list(token_ids) + ids
                        rows = list(output.prompt_logprobs or [None] * len(token_ids)) + rows
                    logprobs = self._logprobs(ids, rows, request.logprobs, 0)
                choices.append(
                    CompletionResponseChoice(
                        index=i * request.n + seq.index,
                        text=body,
                        logprobs=logprobs,
                        finish_reason=seq.finish_reason,
                        stop_reason=seq.stop_reason,
                    )
                )
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=choices,
            usage=usage(num_prompt_tokens, num_generated),
        )

    # -- streaming ------------------------------------------------------------------------

    async def stream(
        self, request: CompletionRequest, request_id, prompts, all_params
    ) -> AsyncIterator[str]:
        n = request.n
        num_choices = len(prompts) * n
        completion_tokens = [0] * num_choices
        offsets = [0] * num_choices
        echoed = [False] * num_choices
        num_prompt_tokens = sum(len(ids) for _, ids in prompts)
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous_usage = include_usage and bool(options.continuous_usage_stats)
        try:
            generators = self._generators(
                request, request_id, prompts, all_params, RequestOutputKind.DELTA
            )
            async for prompt_index, output in merge_async_iterators(*generators):
                text, token_ids = prompts[prompt_index]
                for seq in output.outputs:
                    i = prompt_index * n + seq.index
                    body, ids, rows = seq.text, list(seq.token_ids), list(seq.logprobs or [])
                    completion_tokens[i] += len(ids)
                    if request.echo and not echoed[i] and (ids or seq.finish_reason):
                        echoed[i] = True
                        body = self._prompt_text(text, token_ids) + body
                        if request.logprobs is not None:
                            prompt_rows = output.prompt_logprobs or [None] * len(token_ids)
                            ids, rows = list(token_ids) + ids, list(prompt_rows) + rows
                    wants_logprobs = request.logprobs is not None and ids
                    if not body and seq.finish_reason is None and not wants_logprobs:
                        continue
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = self._logprobs(ids, rows, request.logprobs, offsets[i])
                        offsets[i] += sum(len(t) for t in logprobs.tokens)
                    chunk = CompletionStreamResponse(
                        id=request_id,
                        model=self.model_name,
                        choices=[
                            CompletionResponseChoice(
                                index=i,
                                text=body,
                                logprobs=logprobs,
                                finish_reason=seq.finish_reason,
                                stop_reason=seq.stop_reason,
                            )
                        ],
                    )
                    if continuous_usage:
                        chunk.usage = usage(num_prompt_tokens, sum(completion_tokens))
                    yield sse(chunk.model_dump_json())
            if include_usage:
                final = CompletionStreamResponse(
                    id=request_id,
                    model=self.model_name,
                    choices=[],
                    usage=usage(num_prompt_tokens, sum(completion_tokens)),
                )
                yield sse(final.model_dump_json())
        except Exception as e:
            yield sse_error(stream_error(e))
        yield "data: [DONE]\n\n"

    # -- logprobs -------------------------------------------------------------------------

    def _logprobs(
        self,
        token_ids: list[int],
        rows: list[dict[int, Logprob] | None],
        num: int,
        offset: int,
    ) -> CompletionLogProbs:
        """OpenAI's legacy shape; a prompt's first token has no logprob (None)."""
        out = CompletionLogProbs()
        for token_id, row in zip(token_ids, rows, strict=False):
            chosen = row.get(token_id) if row is not None else None
            token = self.token_str(token_id, chosen)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if row is None or chosen is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(clamp_logprob(chosen.logprob))
            top = {token: clamp_logprob(chosen.logprob)}
            for candidate_id, candidate in top_k_of(row, num):
                top.setdefault(
                    self.token_str(candidate_id, candidate), clamp_logprob(candidate.logprob)
                )
            out.top_logprobs.append(top)
        return out
