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

Tools and reasoning: `tools` reach the chat template; tool_choice "required" or a named
function becomes a JSON-schema constraint on the reply (structured_outputs.py), "auto"
(with `--enable-auto-tool-choice --tool-call-parser NAME`) parses the reply with a tool
parser (tool_parsers.py); calls come back as `message.tool_calls` with finish_reason
"tool_calls" ("stop" where the request named the function, as OpenAI's), streamed as
`delta.tool_calls`. With `--reasoning-parser`, the thinking
goes to `reasoning_content` (reasoning_parsers.py), and a constraint applies to the
answer after it. A streamed reply goes through the same parsers as a growing text
(`ReplyStream`), so its deltas join into the full response.
"""

from collections.abc import AsyncIterator

from jengine.entrypoints.openai.chat_messages import template_messages
from jengine.entrypoints.openai.errors import param_of, to_openai_error
from jengine.entrypoints.openai.protocol import OpenAIError
from jengine.entrypoints.openai.protocol_chat import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    NamedToolChoice,
)
from jengine.entrypoints.openai.reasoning_parsers import (
    END as REASONING_END,
)
from jengine.entrypoints.openai.reasoning_parsers import ReplyStream, get_reasoning_parser
from jengine.entrypoints.openai.sampling_request import truncated
from jengine.entrypoints.openai.serving_engine import (
    EnginePrompt,
    OpenAIServing,
    PreparedRequest,
)
from jengine.entrypoints.openai.serving_models import ServingModels
from jengine.entrypoints.openai.structured_outputs import (
    constraint_field,
    tool_choice_constraint,
    tool_choice_of,
)
from jengine.entrypoints.openai.tool_parsers import (
    FirstCallOnly,
    NamedToolCallParser,
    RequiredToolCallParser,
    ToolParser,
    get_tool_parser,
)
from jengine.entrypoints.openai.usage_counts import StreamUsage
from jengine.outputs import CompletionOutput, RequestOutput
from jengine.sampling_params import RequestOutputKind


class OpenAIServingChat(OpenAIServing):
    chunk_type = ChatCompletionStreamResponse
    request_id_prefix = "chatcmpl-"

    def __init__(
        self,
        engine,
        models: ServingModels,
        *,
        enable_auto_tool_choice: bool = False,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        chat_template: str | None = None,
        return_tokens_as_token_ids: bool = False,
        enable_prompt_tokens_details: bool = False,
        response_role: str = "assistant",
        exclude_tools_when_tool_choice_none: bool = False,
    ):
        """`tool_call_parser` (with `enable_auto_tool_choice`): how tool_choice "auto"
        finds calls in a reply; `reasoning_parser`: how the reasoning is split off;
        `chat_template` (--chat-template): the Jinja template to use instead of the
        model's (a request's own `chat_template` wins over both); `response_role`: the
        replies' role; `exclude_tools_when_tool_choice_none`: tool_choice "none" keeps the
        tools from the template (else it sees them, as in vLLM)."""
        super().__init__(
            engine,
            models,
            return_tokens_as_token_ids=return_tokens_as_token_ids,
            enable_prompt_tokens_details=enable_prompt_tokens_details,
        )
        self.chat_template = chat_template
        self.response_role = response_role
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        self.auto_tool_parser = (
            get_tool_parser(tool_call_parser) if enable_auto_tool_choice else None
        )
        self.reasoning_parser = get_reasoning_parser(reasoning_parser) if reasoning_parser else None

    def prepare(self, request: ChatCompletionRequest) -> PreparedRequest:
        """Validate and render; one EnginePrompt whose engine id is the response id."""
        self.check_request(request)
        self.require_tokenizer()
        if request.top_logprobs and not request.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        tool_choice = tool_choice_of(request)
        if tool_choice == "auto" and request.tools and self.auto_tool_parser is None:
            raise OpenAIError(
                'tool_choice "auto" needs the server started with --enable-auto-tool-choice '
                "and --tool-call-parser",
                param="tool_choice",
            )
        tool_constraint = tool_choice_constraint(request)
        tools = None
        if request.tools and not (
            tool_choice == "none" and self.exclude_tools_when_tool_choice_none
        ):
            tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
        messages = template_messages(request.messages)
        template_kwargs = request.chat_template_kwargs
        if request.documents is not None:  # as transformers hands them to the template
            template_kwargs = {**(template_kwargs or {}), "documents": request.documents}
        text, token_ids = self.render(
            messages,
            request.add_generation_prompt,
            request.continue_final_message,
            template_kwargs,
            request.add_special_tokens,
            request.chat_template,
            tools,
        )
        text, token_ids = truncated(request, text, token_ids, self.max_model_len)
        requested, field = request.max_completion_tokens, "max_completion_tokens"
        if requested is None:
            requested, field = request.max_tokens, "max_tokens"
        max_tokens = self.max_tokens_for(requested, len(token_ids), "messages", field)
        params = self.sampling_params(
            request,
            max_tokens=max_tokens,
            logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            prompt_logprobs=request.prompt_logprobs,
        )
        tool_parser = self.tool_parser_for(request)
        if tool_parser is not None and tool_parser.keeps_special_tokens:
            params.skip_special_tokens = False  # the call markers may be special tokens
        if tool_constraint is not None:
            if params.structured_outputs is not None:
                raise OpenAIError(
                    "a forced tool call and an output constraint cannot be combined",
                    param="tool_choice",
                )
            params.structured_outputs = tool_constraint
        thinking = self.starts_thinking(text, token_ids)
        if params.structured_outputs is not None and thinking:
            params.structured_outputs.reasoning_end = REASONING_END  # enforce on the answer
        try:
            self.validate_prompt(
                token_ids, params, "tools" if tool_constraint else constraint_field(request)
            )
        except OpenAIError as e:
            if e.param == "logprobs":  # the chat API's name for the count
                e.param, e.message = "top_logprobs", e.message.replace("logprobs=", "top_logprobs=")
            raise
        request_id = self.response_id(request)
        prompt = EnginePrompt(text, token_ids, params, request_id)
        prepared = self.prepared(request, request_id, [prompt], messages)
        prepared.thinking = thinking
        return prepared

    # -- the template ---------------------------------------------------------------------

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        add_special_tokens: bool = False,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
    ) -> tuple[str, list[int]]:
        """Messages -> (prompt text, token ids) through `chat_template`, else the server's
        --chat-template, else the model's."""
        try:
            return self.engine.input_processor.render_chat(
                messages,
                add_generation_prompt,
                add_special_tokens,
                chat_template or self.chat_template,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            )
        except ValueError as e:
            raise to_openai_error(e, param_of(str(e)) or "messages") from None

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
            created=prepared.created,
            model=prepared.model,
            choices=[
                self.response_choice(request, seq, role, echo, num_logprobs, prepared.thinking)
                for seq in final.outputs
            ],
            usage=self.usage_of(finals),
            prompt_logprobs=self.logprob_format.prompt_logprobs(final, request.prompt_logprobs),
            prompt_token_ids=_prompt_ids_if_asked(request, prepared),
        )

    def response_choice(
        self,
        request: ChatCompletionRequest,
        seq: CompletionOutput,
        role: str,
        echo: str,
        num_logprobs: int | None,
        thinking: bool | None = None,
    ) -> ChatCompletionResponseChoice:
        """One finished sequence as a choice of the full response: reasoning split off
        (`thinking`: the reply starts inside a think block), then tool calls parsed out of
        the answer."""
        reasoning, answer = None, seq.text
        if self.reasoning_parser is not None:
            reasoning, answer = self.reasoning_parser.split(answer, True, thinking)
            reasoning = (reasoning or None) if request.include_reasoning else None
        content, tool_calls, called = answer, [], False
        tool_parser = self.tool_parser_for(request)
        if tool_parser is not None:
            content, tool_calls, called = tool_parser.extract(answer)
        if self.reasoning_parser is not None and not answer:
            content = None  # all reasoning, no answer (yet)
        finish_reason = request.finish_reason(seq.finish_reason, called)
        return ChatCompletionResponseChoice(
            index=seq.index,
            message=ChatMessage(
                role=role,
                content=echo + content if content is not None else (echo or None),
                reasoning_content=reasoning,
                tool_calls=tool_calls,
            ),
            logprobs=self.logprob_format.chat(
                seq.token_ids, seq.logprobs, num_logprobs, request.return_tokens_as_token_ids
            )
            if num_logprobs is not None
            else None,
            finish_reason=finish_reason,
            stop_reason=seq.stop_reason,
            token_ids=list(seq.token_ids) if request.return_token_ids else None,
        )

    def starts_thinking(self, text: str | None, token_ids: list[int]) -> bool | None:
        """Whether the reply to a prompt starts inside a think block, read from its text
        (decoded where truncation dropped it); None without --reasoning-parser."""
        if self.reasoning_parser is None:
            return None
        if text is None:
            text = self.tokenizer.decode(token_ids)
        return self.reasoning_parser.starts_thinking(text)

    def tool_parser_for(self, request: ChatCompletionRequest) -> ToolParser | None:
        """How this request's reply turns into tool calls (None: it is all content)."""
        if not request.tools:
            return None
        choice = tool_choice_of(request)
        if choice == "required":
            return RequiredToolCallParser([tool.function.name for tool in request.tools])
        if isinstance(choice, NamedToolChoice):
            return NamedToolCallParser(choice.function.name)
        if choice != "auto" or self.auto_tool_parser is None:
            return None
        if request.parallel_tool_calls is False:
            return FirstCallOnly(self.auto_tool_parser)
        return self.auto_tool_parser

    # -- streaming ------------------------------------------------------------------------

    async def stream_chunks(
        self, request: ChatCompletionRequest, prepared: PreparedRequest, counts: StreamUsage
    ) -> AsyncIterator[ChatCompletionStreamResponse]:
        role, echo = self._role_and_echo(request, prepared.messages)
        num_logprobs = prepared.prompts[0].params.logprobs
        for index in range(request.n):
            role_chunk = self._chunk(prepared, index, DeltaMessage(role=role, content=""))
            role_chunk.prompt_token_ids = _prompt_ids_if_asked(request, prepared)
            yield role_chunk
            if echo:
                yield self._chunk(prepared, index, DeltaMessage(content=echo))
        tool_parser = self.tool_parser_for(request)
        streams = [
            ReplyStream(self.reasoning_parser, tool_parser, prepared.thinking)
            for _ in range(request.n)
        ]
        async for _, output in self.generate(request, prepared, RequestOutputKind.DELTA):
            counts.cached_tokens[0] = output.num_cached_tokens
            for seq in output.outputs:
                counts.add(seq.index, len(seq.token_ids))
                # Logprobs and token ids come with every token, text or not yet.
                wants_per_token = seq.token_ids and (
                    num_logprobs is not None or request.return_token_ids
                )
                finished = seq.finish_reason is not None
                stream = streams[seq.index]
                deltas = stream.feed(seq.text, finished)
                if not request.include_reasoning:
                    deltas = [delta for delta in deltas if delta.reasoning_content is None]
                if not deltas and not finished and not wants_per_token:
                    continue
                logprobs = None
                if num_logprobs is not None:
                    logprobs = self.logprob_format.chat(
                        seq.token_ids, seq.logprobs, num_logprobs,
                        request.return_tokens_as_token_ids,
                    )  # fmt: skip
                token_ids = list(seq.token_ids) if request.return_token_ids else None
                finish_reason = request.finish_reason(seq.finish_reason, stream.called)
                deltas = deltas or [DeltaMessage()]
                for i, delta in enumerate(deltas):
                    last = i == len(deltas) - 1
                    chunk = self._chunk(
                        prepared,
                        seq.index,
                        delta,
                        logprobs if i == 0 else None,
                        finish_reason if last else None,
                        seq.stop_reason if last else None,
                    )
                    chunk.choices[0].token_ids = token_ids if i == 0 else None
                    yield chunk

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
            created=prepared.created,
            model=prepared.model,
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


def _prompt_ids_if_asked(request: ChatCompletionRequest, prepared: PreparedRequest):
    """vLLM's `prompt_token_ids`: the ids the engine got, when return_token_ids."""
    return list(prepared.prompts[0].token_ids) if request.return_token_ids else None
