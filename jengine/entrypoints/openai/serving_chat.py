"""`POST /v1/chat/completions`: messages -> the model's chat template -> completions, as one
JSON body or as server-sent events (`chat.completion.chunk`).

Where it sits: routes.py calls `prepare`, then `complete` or `stream` (serving_engine.py's
skeleton); this class adds only what is chat-specific: converting the messages, rendering
them with the chat template (in the API process, through the input processor's
`render_chat`), the reply's role, `echo`, and the chat logprob shape. Streams start, per
choice, with a `{"role": "assistant", "content": ""}` delta, as OpenAI's do.
`max_completion_tokens` wins over the deprecated `max_tokens`; with neither, the reply may
fill the rest of the context. `echo` prepends the last message's content when it has the
reply's role (vLLM's meaning for chat).

Extension points (tool calling slots in here, not in the stream skeleton):
`convert_message` (one request message -> the template's dict), `response_choice` (one
finished sequence -> a choice of the full response), `delta_message` (one streamed delta).
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
    ChatMessageParam,
    DeltaMessage,
    OpenAIError,
)
from jengine.entrypoints.openai.serving_engine import (
    EnginePrompt,
    OpenAIServing,
    PreparedRequest,
    StreamUsage,
    clamp_logprob,
    usage,
)
from jengine.outputs import CompletionOutput, Logprob, RequestOutput

_TEMPLATE_RESERVED = {"tokenize", "add_generation_prompt", "continue_final_message"}


class OpenAIServingChat(OpenAIServing):
    response_role = "assistant"
    chunk_type = ChatCompletionStreamResponse
    request_id_prefix = "chatcmpl"

    def prepare(self, request: ChatCompletionRequest) -> PreparedRequest:
        """Validate and render; one EnginePrompt whose engine id is the response id."""
        self.check_request(request)
        self.require_tokenizer()
        response_format = request.response_format
        if response_format is not None and response_format.get("type", "text") != "text":
            raise OpenAIError(
                f"response_format type {response_format.get('type')!r} is not supported",
                param="response_format",
            )
        if request.top_logprobs and not request.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        messages = self.convert_messages(request.messages)
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
        request_id = self.response_id(request)
        prompt = EnginePrompt(text, token_ids, params, request_id)
        return PreparedRequest(request_id, [prompt], messages)

    # -- messages and the template --------------------------------------------------------

    def convert_messages(self, message_params: list[ChatMessageParam]) -> list[dict]:
        """The request's messages as the chat template takes them."""
        return [self.convert_message(index, m) for index, m in enumerate(message_params)]

    def convert_message(self, index: int, message: ChatMessageParam) -> dict:
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
        return entry

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        add_special_tokens: bool = False,
    ) -> tuple[str, list[int]]:
        """Messages -> (prompt text, token ids) through the model's chat template."""
        if add_generation_prompt and continue_final_message:
            raise OpenAIError(
                "add_generation_prompt and continue_final_message cannot both be true",
                param="continue_final_message",
            )
        template_kwargs = dict(chat_template_kwargs or {})
        if _TEMPLATE_RESERVED & template_kwargs.keys():
            raise OpenAIError(
                "chat_template_kwargs may not set "
                f"{sorted(_TEMPLATE_RESERVED & template_kwargs.keys())}",
                param="chat_template_kwargs",
            )
        if continue_final_message:
            template_kwargs["continue_final_message"] = True
        try:
            return self.engine.input_processor.render_chat(
                messages, add_generation_prompt, add_special_tokens, **template_kwargs
            )
        except Exception as e:  # jinja errors, raise_exception() in templates, ...
            raise OpenAIError(f"could not apply the chat template: {e}", param="messages") from e

    def _role_and_echo(
        self, request: ChatCompletionRequest, messages: list[dict]
    ) -> tuple[str, str]:
        """The reply's role, and the text `echo` puts before it."""
        role = self.response_role if request.add_generation_prompt else messages[-1]["role"]
        echo = ""
        if request.echo and messages and messages[-1]["role"] == role:
            echo = messages[-1]["content"] or ""
        return role, echo

    # -- full response --------------------------------------------------------------------

    def response(
        self,
        request: ChatCompletionRequest,
        prepared: PreparedRequest,
        finals: list[RequestOutput],
    ) -> ChatCompletionResponse:
        [final] = finals
        role, echo = self._role_and_echo(request, prepared.messages)
        num_logprobs = prepared.prompts[0].params.logprobs
        return ChatCompletionResponse(
            id=prepared.request_id,
            model=self.model_name,
            choices=[self.response_choice(seq, role, echo, num_logprobs) for seq in final.outputs],
            usage=usage(
                len(prepared.prompts[0].token_ids),
                sum(len(seq.token_ids) for seq in final.outputs),
            ),
        )

    def response_choice(
        self, seq: CompletionOutput, role: str, echo: str, num_logprobs: int | None
    ) -> ChatCompletionResponseChoice:
        """One finished sequence as a choice of the full response."""
        return ChatCompletionResponseChoice(
            index=seq.index,
            message=ChatMessage(role=role, content=echo + seq.text),
            logprobs=self._logprobs(seq.token_ids, seq.logprobs, num_logprobs)
            if num_logprobs is not None
            else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    # -- streaming ------------------------------------------------------------------------

    async def stream_chunks(
        self, request: ChatCompletionRequest, prepared: PreparedRequest, counts: StreamUsage
    ) -> AsyncIterator[ChatCompletionStreamResponse]:
        role, echo = self._role_and_echo(request, prepared.messages)
        num_logprobs = prepared.prompts[0].params.logprobs
        for index in range(request.n):
            yield self._chunk(prepared, index, DeltaMessage(role=role, content=""))
            if echo:
                yield self._chunk(prepared, index, DeltaMessage(content=echo))
        async for _, output in self.generate(request, prepared, RequestOutputKind.DELTA):
            for seq in output.outputs:
                counts.completion_tokens += len(seq.token_ids)
                wants_logprobs = num_logprobs is not None and seq.token_ids
                if not seq.text and seq.finish_reason is None and not wants_logprobs:
                    continue
                logprobs = None
                if num_logprobs is not None:
                    logprobs = self._logprobs(seq.token_ids, seq.logprobs, num_logprobs)
                yield self._chunk(
                    prepared,
                    seq.index,
                    self.delta_message(seq),
                    logprobs,
                    seq.finish_reason,
                    seq.stop_reason,
                )

    def delta_message(self, seq: CompletionOutput) -> DeltaMessage:
        """What one streamed delta of a sequence adds to the reply."""
        return DeltaMessage(content=seq.text)

    def _chunk(
        self,
        prepared: PreparedRequest,
        index: int,
        delta: DeltaMessage,
        logprobs: ChatCompletionLogProbs | None = None,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(
            id=prepared.request_id,
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
                            token=candidate,
                            logprob=logprob,
                            bytes=list(candidate.encode("utf-8", errors="replace")),
                        )
                        for candidate, logprob in self.top_logprobs(row, num)
                    ],
                )
            )
        return ChatCompletionLogProbs(content=content)
