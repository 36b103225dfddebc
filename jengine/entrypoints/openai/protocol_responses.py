"""The request and response bodies of OpenAI's Responses API (`POST /v1/responses`).

Where it sits: routes.py validates a body into `ResponsesRequest`; serving_responses.py
turns it into a chat completion request and the chat reply back into a `ResponseObject`.
Only what jengine serves is typed strictly (function tools, text formats, message and
function-call input items); other fields are accepted and, where they would change the
result, refused by serving_responses.py with a 400 naming them.
"""

from typing import Annotated, Any, Literal

from pydantic import Field, model_serializer

from jengine.entrypoints.openai.protocol import _INT64, OpenAIBaseModel, RequestModel
from jengine.entrypoints.openai.protocol_chat import ToolParameters


class FunctionTool(OpenAIBaseModel):
    """A function the model may call; the Responses API's flat form of a chat tool."""

    type: Literal["function"] = "function"
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: ToolParameters = None
    strict: bool | None = None


class FunctionToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    name: str


class TextFormat(OpenAIBaseModel):
    """`text.format`: plain text, any JSON object, or JSON under a schema. Echoed as
    OpenAI's response gives it: the schema's fields only for "json_schema", and only
    those the request set."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_serializer(mode="wrap")
    def _echo(self, handler) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        return {k: v for k, v in handler(self).items() if v is not None}


class TextConfig(OpenAIBaseModel):
    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(RequestModel):
    model: str | None = None
    # A string (one user message) or input items: messages (role + content, `type`
    # "message" or absent), "function_call" and "function_call_output" items.
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=_INT64["le"])] | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    # OpenAI's {"include_obfuscation": bool}: jengine pads no stream events, so it is
    # taken and changes nothing.
    stream_options: dict[str, Any] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    # Refused when set (serving_responses.py): jengine keeps no responses.
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    # Logprobs: either asks for them (serving_responses.py).
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's extras, as on the other generation routes.
    priority: Annotated[int, Field(**_INT64)] = 0
    request_id: str | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int]  # {"cached_tokens": from the prefix cache}
    output_tokens_details: dict[str, int]  # {"reasoning_tokens": --reasoning-parser's share}


class ResponseObject(OpenAIBaseModel):
    """What `POST /v1/responses` answers (and streams in its created/completed events)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = Field(default_factory=TextConfig)
    usage: ResponseUsage | None = None
    incomplete_details: dict[str, str] | None = None
    error: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool = False
    previous_response_id: str | None = None
    truncation: Literal["disabled"] = "disabled"
