"""`POST /v1/completions`: prompts (text, token ids, or batches of either) -> completions,
as one JSON body or as server-sent events.

Where it sits: routes.py calls `prepare`, then `complete` or `stream` (serving_engine.py's
skeleton, which runs one engine request per prompt); this class adds only what is
completion-specific: batches of prompts, `echo` of the prompt, and OpenAI's legacy logprob
shape. Everything is validated (model, sampling fields, prompt + max_tokens against
max_model_len, token ids, logprob counts) before a request reaches AsyncLLM, so errors are
plain 400/404 bodies and never half a stream. Choice `index` is
prompt_index * n + sequence_index, as in OpenAI's API.
"""

from collections.abc import AsyncIterator

from jengine.entrypoints.openai.logprob_format import clamp_logprob
from jengine.entrypoints.openai.protocol import (
    MAX_PROMPTS,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    OpenAIError,
)
from jengine.entrypoints.openai.sampling_request import truncated
from jengine.entrypoints.openai.serving_engine import (
    EnginePrompt,
    OpenAIServing,
    PreparedRequest,
)
from jengine.entrypoints.openai.structured_outputs import constraint_field
from jengine.entrypoints.openai.usage_counts import StreamUsage
from jengine.outputs import CompletionOutput, Logprob, RequestOutput
from jengine.sampling_params import RequestOutputKind


class OpenAIServingCompletion(OpenAIServing):
    chunk_type = CompletionStreamResponse
    request_id_prefix = "cmpl-"

    def prepare(self, request: CompletionRequest) -> PreparedRequest:
        """Validate; one EnginePrompt (engine id `<id>-<i>`) per prompt of the batch."""
        self.check_request(request)
        if request.suffix:
            raise OpenAIError("suffix is not supported", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError("best_of is not supported (use n)", param="best_of")
        request_id = self.response_id(request)
        prompts = []
        for index, (text, token_ids) in enumerate(self._tokenize(request)):
            text, token_ids = truncated(request, text, token_ids, self.max_model_len)
            max_tokens = self.max_tokens_for(request.max_tokens, len(token_ids), "prompt")
            prompt_logprobs = request.prompt_logprobs
            if request.echo and request.logprobs is not None:
                counts = (prompt_logprobs or 0, request.logprobs)  # -1: the whole vocabulary
                prompt_logprobs = -1 if -1 in counts else max(counts)
            params = self.sampling_params(
                request,
                max_tokens=max_tokens,
                logprobs=request.logprobs,
                prompt_logprobs=prompt_logprobs,
            )
            self.validate_prompt(token_ids, params, constraint_field(request))
            prompts.append(EnginePrompt(text, token_ids, params, f"{request_id}-{index}"))
        return self.prepared(request, request_id, prompts)

    def _tokenize(self, request: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        prompt = request.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise OpenAIError("prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        if len(prompt) > MAX_PROMPTS:
            raise OpenAIError(
                f"prompt has {len(prompt)} prompts; at most {MAX_PROMPTS} are allowed",
                param="prompt",
            )
        prompts = []
        for item in prompt:
            if isinstance(item, str):
                self.require_tokenizer()
                ids = self.tokenizer.encode(item, add_special_tokens=request.add_special_tokens)
                prompts.append((item, ids))
            else:
                prompts.append((None, list(item)))
        return prompts

    def _prompt_text(self, prompt: EnginePrompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.tokenizer.decode(prompt.token_ids) if self.tokenizer is not None else ""

    def _with_prompt_logprobs(self, prompt: EnginePrompt, output: RequestOutput, ids, rows):
        """Echo: the prompt's tokens and logprob rows (None for the first) before the reply's."""
        prompt_rows = output.prompt_logprobs or [None] * len(prompt.token_ids)
        return list(prompt.token_ids) + ids, list(prompt_rows) + rows

    # -- full response --------------------------------------------------------------------

    def response(
        self,
        request: CompletionRequest,
        prepared: PreparedRequest,
        finals: list[RequestOutput],
    ) -> CompletionResponse:
        choices = []
        for i, (prompt, output) in enumerate(zip(prepared.prompts, finals, strict=True)):
            for seq in output.outputs:
                body, logprobs = seq.text, None
                if request.echo:
                    body = self._prompt_text(prompt) + body
                if request.logprobs is not None:
                    ids, rows = list(seq.token_ids), list(seq.logprobs or [])
                    if request.echo:
                        ids, rows = self._with_prompt_logprobs(prompt, output, ids, rows)
                    logprobs = self._logprobs(ids, rows, request, 0)
                choice = self._choice(i * request.n + seq.index, seq, body, logprobs)
                choice.prompt_logprobs = self.logprob_format.prompt_logprobs(
                    output, request.prompt_logprobs
                )
                if request.return_token_ids:
                    choice.prompt_token_ids = list(prompt.token_ids)
                    choice.token_ids = list(seq.token_ids)
                choices.append(choice)
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(
            id=prepared.request_id,
            created=prepared.created,
            model=prepared.model,
            choices=choices,
            usage=self.usage_of(finals),
        )

    # -- streaming ------------------------------------------------------------------------

    async def stream_chunks(
        self, request: CompletionRequest, prepared: PreparedRequest, counts: StreamUsage
    ) -> AsyncIterator[CompletionStreamResponse]:
        n = request.n
        offsets = [0] * (len(prepared.prompts) * n)
        echoed = [False] * (len(prepared.prompts) * n)
        started = [False] * (len(prepared.prompts) * n)  # a chunk of choice i went out
        async for prompt_index, output in self.generate(request, prepared, RequestOutputKind.DELTA):
            prompt = prepared.prompts[prompt_index]
            counts.cached_tokens[prompt_index] = output.num_cached_tokens
            for seq in output.outputs:
                i = prompt_index * n + seq.index
                body, ids, rows = seq.text, list(seq.token_ids), list(seq.logprobs or [])
                counts.add(i, len(ids))
                if request.echo and not echoed[i] and (ids or seq.finish_reason):
                    echoed[i] = True
                    body = self._prompt_text(prompt) + body
                    if request.logprobs is not None:
                        ids, rows = self._with_prompt_logprobs(prompt, output, ids, rows)
                # Logprobs and token ids come with every token, text or not yet.
                wants_per_token = ids and (request.logprobs is not None or request.return_token_ids)
                if not body and seq.finish_reason is None and not wants_per_token:
                    continue
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._logprobs(ids, rows, request, offsets[i])
                    offsets[i] += sum(len(t) for t in logprobs.tokens)
                choice = self._choice(i, seq, body, logprobs)
                if request.return_token_ids:
                    choice.token_ids = list(seq.token_ids)
                    if not started[i]:
                        choice.prompt_token_ids = list(prompt.token_ids)
                started[i] = True
                yield CompletionStreamResponse(
                    id=prepared.request_id,
                    created=prepared.created,
                    model=prepared.model,
                    choices=[choice],
                )

    @staticmethod
    def _choice(
        index: int, seq: CompletionOutput, text: str, logprobs: CompletionLogProbs | None
    ) -> CompletionResponseChoice:
        return CompletionResponseChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    # -- logprobs -------------------------------------------------------------------------

    def _logprobs(
        self,
        token_ids: list[int],
        rows: list[dict[int, Logprob] | None],
        request: CompletionRequest,
        offset: int,
    ) -> CompletionLogProbs:
        """OpenAI's legacy shape; a prompt's first token has no logprob (None). Offsets
        count the tokens as written (as vLLM's, also when they are "token_id:<id>")."""
        num, as_ids = request.logprobs, request.return_tokens_as_token_ids
        out = CompletionLogProbs()
        for token_id, row in zip(token_ids, rows, strict=False):
            chosen = row.get(token_id) if row is not None else None
            token = self.logprob_format.token_str(token_id, chosen, as_ids)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if row is None or chosen is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(clamp_logprob(chosen.logprob))
            top = {token: clamp_logprob(chosen.logprob)}
            for _, candidate, logprob in self.logprob_format.top_logprobs(row, num, as_ids):
                top.setdefault(candidate, logprob)
            out.top_logprobs.append(top)
        return out
