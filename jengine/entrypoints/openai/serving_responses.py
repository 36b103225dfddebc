"""`POST /v1/responses`: OpenAI's Responses API, served through the chat path.

Where it sits: routes.py hands a `ResponsesRequest` to `prepare`; this class turns it into
a `ChatCompletionRequest` (`instructions` as the system message, input items as messages,
function tools and `text.format` as the chat's tools and response_format) and lets the
server's chat serving (serving_chat.py) render, constrain, run and parse it: one copy of
templating, tools, structured outputs and streaming. The chat reply then becomes a
response object: reasoning (with --reasoning-parser) as a "reasoning" item, the text as a
"message" item with one output_text part, each tool call as a "function_call" item whose
`call_id` the client sends back in a "function_call_output" item; usage as input tokens
(the prefix cache's share among them) and output tokens (the reasoning's share among them);
status "incomplete" when max_output_tokens cut the reply.

A stream is the Responses event sequence, each event `event: <type>` + its JSON with a
`sequence_number`: response.created, response.in_progress; per item in order,
response.output_item.added, then its deltas (response.reasoning_text.delta,
response.content_part.added + response.output_text.delta, or
response.function_call_arguments.delta), their .done events and response.output_item.done;
last response.completed (or response.incomplete). An error mid-stream is an "error" event
naming the cause.

vLLM's extra fields (`extra_body`: top_k, repetition_penalty, seed, stop, chat_template, ...)
reach the chat request as on the chat route; a chat field a response has no place for (n,
echo, messages, max_tokens, ...) is a 400 naming it.

Decided: jengine keeps no responses, so `store: true`, `previous_response_id`,
`conversation` and `background: true` are 400s naming the field (a client sends the
conversation as input items instead, as with `store: false`). Logprobs
(`include: ["message.output_text.logprobs"]`, or `top_logprobs`) are the chat route's, one
entry per generated token, on the message's output_text part and on each text delta; a
reply that is only function calls has no part to carry them (as OpenAI's), and with
--reasoning-parser they are a 400, since the reasoning's tokens would mix with the answer's.
"""

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import pydantic

from jengine.entrypoints.openai.errors import to_openai_error
from jengine.entrypoints.openai.protocol import OpenAIError
from jengine.entrypoints.openai.protocol_chat import ChatCompletionRequest
from jengine.entrypoints.openai.protocol_responses import (
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from jengine.entrypoints.openai.responses_items import (
    Events,
    StreamedItems,
    chat_messages,
    output_items,
)
from jengine.entrypoints.openai.serving_chat import OpenAIServingChat
from jengine.entrypoints.openai.serving_engine import OpenAIServing, PreparedRequest
from jengine.entrypoints.openai.usage_counts import StreamUsage
from jengine.outputs import RequestOutput

# The `include` entry that asks for the output text's logprobs (other entries, such as
# "reasoning.encrypted_content", ask for nothing jengine could add and are let through).
LOGPROBS_ITEM = "message.output_text.logprobs"


# The chat request's fields that stand for a Responses request's own.
_FIELDS_AS_CHAT = {
    "response_format": "text.format",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
}


# Chat fields a response has no place for: sent as extras, each is a 400 (others, vLLM's
# sampling and template extras, reach the chat request as they would on the chat route).
_CHAT_ONLY_FIELDS = (
    "messages", "n", "echo", "logprobs", "prompt_logprobs", "return_token_ids",
    "return_tokens_as_token_ids", "use_beam_search", "length_penalty", *_FIELDS_AS_CHAT,
)  # fmt: skip


def responses_field(chat_field: str | None) -> str | None:
    """The Responses field a chat request's field (an error's param) came from."""
    head, dot, rest = (chat_field or "").partition(".")
    if head == "messages":
        return "input"  # instructions add a message: the indices differ
    if head in _FIELDS_AS_CHAT:
        return _FIELDS_AS_CHAT[head] + dot + rest
    return chat_field


def wants_logprobs(request: ResponsesRequest) -> bool:
    return LOGPROBS_ITEM in (request.include or ()) or request.top_logprobs is not None


@dataclass
class PreparedResponse(PreparedRequest):
    chat_request: ChatCompletionRequest | None = None


class OpenAIServingResponses(OpenAIServing):
    request_id_prefix = "resp_"

    def __init__(self, chat: OpenAIServingChat):
        super().__init__(chat.engine, chat.models)
        self.chat = chat

    def prepare(self, request: ResponsesRequest) -> PreparedResponse:
        for name, refused in (
            ("store", request.store),
            ("previous_response_id", request.previous_response_id),
            ("background", request.background),
            ("conversation", request.conversation),
        ):
            if refused:
                raise OpenAIError(
                    f"{name} is not supported: jengine keeps no responses; send the whole "
                    "conversation as input items (store=false)",
                    param=name,
                )
        if wants_logprobs(request) and self.chat.reasoning_parser is not None:
            raise OpenAIError(
                "include: logprobs are not served beside --reasoning-parser on /v1/responses; "
                "/v1/chat/completions returns them (logprobs=true, top_logprobs)",
                param="include",
            )
        chat_request = self.chat_request(request)
        try:
            prepared = self.chat.prepare(chat_request)
        except OpenAIError as e:
            e.param = responses_field(e.param)  # what the client sent, not what it became
            raise
        # The response's id is `resp_...` (the chat route's engine ids prefix it again).
        fields = {**vars(prepared), "request_id": chat_request.request_id}
        return PreparedResponse(**fields, chat_request=chat_request)

    def chat_request(self, request: ResponsesRequest) -> ChatCompletionRequest:
        fmt = request.text.format if request.text else None
        response_format = None
        if fmt is not None and fmt.type == "json_object":
            response_format = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            schema = dict(name=fmt.name, description=fmt.description, strict=fmt.strict)
            response_format = {
                "type": "json_schema",
                "json_schema": {**schema, "schema": fmt.schema_},
            }
        extra = request.model_extra or {}
        for name in _CHAT_ONLY_FIELDS:
            if name in extra:
                instead = responses_field(name)
                raise OpenAIError(
                    f"{name} is a chat completions field, not one of /v1/responses"
                    + (f": use {instead}" if instead != name else ""),
                    param=name,
                )
        tool_choice = request.tool_choice
        if tool_choice is not None and not isinstance(tool_choice, str):
            tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
        body = dict(
            model=request.model,
            messages=chat_messages(request),
            max_completion_tokens=request.max_output_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            stream=request.stream,
            tools=[
                {
                    "type": "function",
                    "function": tool.model_dump(exclude={"type"}, exclude_none=True),
                }
                for tool in request.tools or []
            ]
            or None,
            tool_choice=tool_choice,
            parallel_tool_calls=request.parallel_tool_calls,
            response_format=response_format,
            logprobs=wants_logprobs(request),
            top_logprobs=request.top_logprobs if wants_logprobs(request) else None,
            user=request.user,
            priority=request.priority,
            request_id=self.response_id(request),
            cache_salt=request.cache_salt,
            # A stream's reasoning tokens are counted from its token ids at the end.
            return_token_ids=self.chat.reasoning_parser is not None,
        )
        try:
            return ChatCompletionRequest.model_validate({**extra, **body})
        except pydantic.ValidationError as e:
            error = e.errors()[0]
            where = ".".join(str(part) for part in error.get("loc", ()))
            raise OpenAIError(f"{where}: {error.get('msg')}", param="input") from None

    # -- full response --------------------------------------------------------------------

    def response(
        self, request: ResponsesRequest, prepared: PreparedResponse, finals: list[RequestOutput]
    ) -> ResponseObject:
        chat = self.chat.response(prepared.chat_request, prepared, finals)
        [choice] = chat.choices
        output = output_items(choice.message, choice.logprobs, choice.finish_reason == "length")
        counts = StreamUsage(
            [chat.usage.prompt_tokens],
            chat.usage.completion_tokens,
            {0: finals[0].num_cached_tokens},
        )
        reasoning_tokens = self.reasoning_tokens(prepared, finals[0].outputs[0].token_ids)
        return self.response_object(
            request, prepared, output, choice.finish_reason, counts, reasoning_tokens
        )

    def reasoning_tokens(self, prepared: PreparedResponse, token_ids: list[int]) -> int:
        """How many of the reply's tokens the reasoning parser counts as reasoning."""
        parser = self.chat.reasoning_parser
        if parser is None or not token_ids:
            return 0
        skip = prepared.prompts[0].params.skip_special_tokens
        return parser.num_reasoning_tokens(
            token_ids,
            lambda ids: self.tokenizer.decode(ids, skip_special_tokens=skip),
            prepared.thinking,
        )

    def response_object(
        self,
        request: ResponsesRequest,
        prepared: PreparedResponse,
        output: list[dict],
        finish_reason: str | None,
        counts: StreamUsage,
        reasoning_tokens: int = 0,
        error: dict | None = None,
    ) -> ResponseObject:
        """The response with `output`; in progress while `finish_reason` is None, failed
        with an `error`. Its usage always tells the cached input tokens and the reasoning
        tokens (OpenAI's Responses API always has both fields); its sampling knobs are the
        ones used (the model's defaults where the request set none, as OpenAI's)."""
        status, incomplete = "completed", None
        if error is not None:
            status = "failed"
        elif finish_reason is None:
            status = "in_progress"
        elif finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        used = prepared.prompts[0].params
        return ResponseObject(
            id=prepared.request_id,
            created_at=prepared.created,
            status=status,
            model=prepared.model,
            output=output,
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            temperature=used.temperature if request.temperature is None else request.temperature,
            top_p=used.top_p if request.top_p is None else request.top_p,
            tools=request.tools or [],
            tool_choice=request.tool_choice or "auto",
            parallel_tool_calls=request.parallel_tool_calls is not False,
            text=request.text or {},
            usage=None
            if finish_reason is None and error is None
            else ResponseUsage(
                input_tokens=counts.prompt_tokens,
                output_tokens=counts.completion_tokens,
                total_tokens=counts.prompt_tokens + counts.completion_tokens,
                input_tokens_details={"cached_tokens": counts.num_cached_tokens},
                output_tokens_details={"reasoning_tokens": reasoning_tokens},
            ),
            incomplete_details=incomplete,
            error=error,
            metadata=request.metadata,
        )

    # -- streaming ------------------------------------------------------------------------

    async def stream(
        self, request: ResponsesRequest, prepared: PreparedResponse
    ) -> AsyncIterator[str]:
        events = Events()
        counts = StreamUsage([len(prepared.prompts[0].token_ids)])
        started = self.response_object(request, prepared, [], None, counts)
        yield events("response.created", response=started)
        yield events("response.in_progress", response=started)
        items = StreamedItems(events)
        finish_reason = None
        token_ids = []  # the chat request asks for them when there is reasoning to count
        try:
            chunks = self.chat.stream_chunks(prepared.chat_request, prepared, counts)
            async with aclosing(chunks) as chunks:
                async for chunk in chunks:
                    [choice] = chunk.choices
                    token_ids += choice.token_ids or []
                    delta = choice.delta
                    for event in items.feed(
                        delta.reasoning_content, delta.content, choice.logprobs
                    ):
                        yield event
                    for call in delta.tool_calls or []:
                        items.add_call_delta(call)
                    finish_reason = choice.finish_reason or finish_reason
            for event in items.finish(finish_reason == "length"):
                yield event
            final = self.response_object(
                request,
                prepared,
                items.output,
                finish_reason,
                counts,
                self.reasoning_tokens(prepared, token_ids),
            )
            done = "response.incomplete" if final.status == "incomplete" else "response.completed"
            yield events(done, response=final)
        except Exception as e:
            error = to_openai_error(e)
            yield events(
                "error", code=str(error.status_code), message=error.message, param=error.param
            )
            # The response ends failed, with what it had written (OpenAI's last event).
            failed = {"code": "server_error", "message": error.message}
            final = self.response_object(
                request, prepared, items.output, finish_reason, counts, error=failed
            )
            yield events("response.failed", response=final)
