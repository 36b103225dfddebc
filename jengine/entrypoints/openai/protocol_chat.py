"""The request and response bodies of chat completions (`POST /v1/chat/completions`):
messages, tools, logprobs, whole responses and stream chunks.

Where it sits: routes.py validates a body into `ChatCompletionRequest`; serving_chat.py
renders it, runs it and answers with these models; the Responses API goes through the same
request (serving_responses.py). The fields shared with completions (sampling, vLLM's
extras) are `SamplingRequest`'s, in protocol.py.
"""

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_serializer

from jengine.entrypoints.openai.protocol import (
    _INT64,
    OpenAIBaseModel,
    PromptLogprobs,
    SamplingRequest,
    StreamChunk,
    UsageInfo,
    now,
    random_id,
)


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("call_"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageParam(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # role "tool": which call this is the result of


def _object_schema(parameters: dict[str, Any] | None) -> dict[str, Any] | None:
    """A function's parameters are a JSON Schema of an object, as OpenAI's API checks:
    the arguments a call sends are one."""
    if parameters is not None and parameters.get("type", "object") != "object":
        raise ValueError(
            f'parameters must be a JSON Schema of type "object", got type '
            f"{json.dumps(parameters['type'])}"
        )
    return parameters


ToolParameters = Annotated[dict[str, Any] | None, AfterValidator(_object_schema)]


class FunctionDefinition(OpenAIBaseModel):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: ToolParameters = None
    strict: bool | None = None


class ChatCompletionToolParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessageParam], Field(min_length=1)]
    max_tokens: Annotated[int, Field(**_INT64)] | None = None  # deprecated by OpenAI
    max_completion_tokens: Annotated[int, Field(**_INT64)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = 0  # -1: all (vLLM's)
    tools: list[ChatCompletionToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None  # a Jinja template instead of the server's
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None  # for RAG templates (vLLM's field)
    include_reasoning: bool = True  # False: the reasoning parser's part is left out

    def finish_reason(self, finish_reason: str | None, called_tools: bool) -> str | None:
        """A reply's OpenAI finish_reason: "tool_calls" where it stopped after calling
        tools (`called_tools`: calls made, all complete; one cut short by a stop string
        keeps "stop"), except where this request named the function ("stop", as OpenAI's
        and vLLM's)."""
        named = self.tool_choice is not None and not isinstance(self.tool_choice, str)
        if called_tools and finish_reason == "stop" and not named:
            return "tool_calls"
        return finish_reason


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(OpenAIBaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        # OpenAI sends only what a delta carries: {"role": ...} or {"content": ...}.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's new ones


class ChatCompletionStreamResponse(StreamChunk):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: each choice's role chunk
