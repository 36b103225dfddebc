"""`POST /v1/chat/completions`: messages -> the model's chat template -> completions, as one
JSON body or as server-sent events (`chat.completion.chunk`).

Where it sits: api_server.py routes here; the chat template is applied in the API process
(HF tokenizer), then the prompt goes through the same checks as a completion. Streams
start, per choice, with a `{"role": "assistant", "content": ""}` delta, as OpenAI's do.
`max_completion_tokens` wins over the deprecated `max_tokens`; with neither, the reply may
fill the rest of the context. `echo` prepends the last message's content when it has the
reply's role (vLLM's meaning for chat).
"""

from collections.abc import AsyncIterator

from jengine.engine.output_processor import RequestOutputKind
from jengine.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    OpenAIError,
    random_id,
)
from jengine.entrypoints.openai.serving_engine import (
    OpenAIServing,
    clamp_logprob,
    sse,
    sse_error,
    stream_error,
    top_k_of,
    usage,
)
from jengine.outputs import Logprob

_TEMPLATE_RESERVED = {"tokenize", "add_generation_prompt", "continue_final_message"}


class OpenAIServingChat(OpenAIServing):
    response_role = "assistant"

    def prepare(self, request: ChatCompletionRequest):
        """Validate; returns (request id, prompt text, token ids, SamplingParams, messages)."""
        self.check_model(request.model)
        self.check_engine()
        self.check_stream_options(request)
        self.require_tokenizer()
        fmt = request.response_format
        if fmt is not None and fmt.get("type", "text") != "text":
            raise OpenAIError(
                f"response_format type {fmt.get('type')!r} is not supported",
                param="response_format",
            )
        if request.top_logprobs and not request.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        messages = self.messages(request.messages)
        text, token_ids = self.render(
            messages,
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template_kwargs,
            request.add_special_tokens,
        )
        requested = request.max_completion_tokens
        if requested is None:
            requested = request.max_tokens
        max_tokens = self.max_tokens_for(requested, len(token_ids), "messages")
        params = self.sampling_params(
            request,
            max_tokens=max_tokens,
            logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            prompt_logprobs=request.prompt_logprobs,
        )
        try:
            self.validate_prompt(token_ids, params)
        except OpenAIError as e:
            if e.param == "logprobs":
                e.param = "top_logprobs"  # the chat API's name for the count
            raise
        request_id = request.request_id or random_id("chatcmpl")
        return request_id, text, token_ids, params, messages

    @staticmethod
    def messages(params) -> list[dict]:
        messages = []
        for index, message in enumerate(params):
            content = message.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise OpenAIError(
                            "only text content parts are supported",
                            param=f"messages.{index}.content",
                        )
                    parts.append(part["text"])
                content = "\n".join(parts)
            entry = {"role": message.role, "content": content or ""}
            if message.name is not None:
                entry["name"] = message.name
            messages.append(entry)
        return messages

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        add_special_tokens: bool = False,
    ) -> tuple[str, list[int]]:
        if add_generation_prompt and continue_final_message:
            raise OpenAIError(
                "add_generation_prompt and continue_final_message cannot both be true",
                param="continue_final_message",
            )
        kwargs = {k: v for k, v in (chat_template_kwargs or {}).items()}
        if _TEMPLATE_RESERVED & kwargs.keys():
            raise OpenAIError(
                f"chat_template_kwargs may not set {sorted(_TEMPLATE_RESERVED & kwargs.keys())}",
                param="chat_template_kwargs",
            )
        if continue_final_message:
            kwargs["continue_final_message"] = True
        try:
            text = self.engine.input_processor.apply_chat_template(
                messages, add_generation_prompt, **kwargs
            )
        except Exception as e:  # jinja errors, raise_exception() in templates, ...
            raise OpenAIError(f"could not apply the chat template: {e}", param="messages") from e
        return text, self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _role(self, request: ChatCompletionRequest, messages: list[dict]) -> str:
        return self.response_role if request.add_generation_prompt else messages[-1]["role"]

    def _echo_text(self, request, messages, role) -> str:
        if request.echo and messages and messages[-1]["role"] == role:
            return messages[-1]["content"] or ""
        return ""

    # -- full response --------------------------------------------------------------------

    async def complete(self, request: ChatCompletionRequest, request_id, text, ids, params, msgs):
        final = None
        try:
            async for output in self.engine.generate(
                {"prompt_token_ids": ids, "prompt": text},
                params,
                request_id,
                priority=request.priority,
                output_kind=RequestOutputKind.FINAL_ONLY,
            ):
                final = output
        except ValueError as e:  # e.g. a client-chosen request_id already in use
            raise OpenAIError(str(e)) from None
        role = self._role(request, msgs)
        echo = self._echo_text(request, msgs, role)
        choices = [
            ChatCompletionResponseChoice(
                index=seq.index,
                message=ChatMessage(role=role, content=echo + seq.text),
                logprobs=self._logprobs(seq.token_ids, seq.logprobs, params.logprobs)
                if params.logprobs is not None
                else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for seq in final.outputs
        ]
        return ChatCompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=choices,
            usage=usage(len(ids), sum(len(seq.token_ids) for seq in final.outputs)),
        )

    # -- streaming ------------------------------------------------------------------------

    async def stream(
        self, request: ChatCompletionRequest, request_id, text, ids, params, msgs
    ) -> AsyncIterator[str]:
        n = request.n
        role = self._role(request, msgs)
        echo = self._echo_text(request, msgs, role)
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous_usage = include_usage and bool(options.continuous_usage_stats)
        completion_tokens = [0] * n

        def chunk(index, delta, logprobs=None, finish_reason=None, stop_reason=None):
            response = ChatCompletionStreamResponse(
                id=request_id,
                model=self.model_name,
                choices=[
                    ChatCompletionResponseStreamChoice(
                        index=index,
                        delta=delta,
                        logprobs=logprobs,
                        finish_reason=finish_reason,
                        stop_reason=stop_reason,
                    )
                ],
            )
            if continuous_usage:
                response.usage = usage(len(ids), sum(completion_tokens))
            return sse(response.model_dump_json())

        try:
            for index in range(n):
                yield chunk(index, DeltaMessage(role=role, content=""))
                if echo:
                    yield chunk(index, DeltaMessage(content=echo))
            async for output in self.engine.generate(
                {"prompt_token_ids": ids, "prompt": text},
                params,
                request_id,
                priority=request.priority,
                output_kind=RequestOutputKind.DELTA,
            ):
                for seq in output.outputs:
                    completion_tokens[seq.index] += len(seq.token_ids)
                    wants_logprobs = params.logprobs is not None and seq.token_ids
                    if not seq.text and seq.finish_reason is None and not wants_logprobs:
                        continue
                    logprobs = None
                    if params.logprobs is not None:
                        logprobs = self._logprobs(seq.token_ids, seq.logprobs, params.logprobs)
                    yield chunk(
                        seq.index,
                        DeltaMessage(content=seq.text),
                        logprobs,
                        seq.finish_reason,
                        seq.stop_reason,
                    )
            if include_usage:
                final = ChatCompletionStreamResponse(
                    id=request_id,
                    model=self.model_name,
                    choices=[],
                    usage=usage(len(ids), sum(completion_tokens)),
                )
                yield sse(final.model_dump_json())
        except Exception as e:
            yield sse_error(stream_error(e))
        yield "data: [DONE]\n\n"

    # -- logprobs -------------------------------------------------------------------------

    def _logprobs(
        self, token_ids: list[int], rows: list[dict[int, Logprob]] | None, num: int
    ) -> ChatCompletionLogProbs:
        content = []
        for token_id, row in zip(token_ids, rows or [], strict=False):
            chosen = row.get(token_id)
            token = self.token_str(token_id, chosen)
            content.append(
                ChatCompletionLogProbsContent(
                    token=token,
                    logprob=clamp_logprob(chosen.logprob) if chosen else -9999.0,
                    bytes=list(token.encode("utf-8", errors="replace")),
                    top_logprobs=[
                        ChatCompletionLogProb(
                            token=(t := self.token_str(candidate_id, candidate)),
                            logprob=clamp_logprob(candidate.logprob),
                            bytes=list(t.encode("utf-8", errors="replace")),
                        )
                        for candidate_id, candidate in top_k_of(row, num)
                    ],
                )
            )
        return ChatCompletionLogProbs(content=content)
