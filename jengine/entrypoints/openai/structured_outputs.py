"""What an HTTP request asks the output to be: OpenAI's `response_format`, vLLM's
`structured_outputs` body field and its older `guided_*` names, and the grammar a
`tool_choice` of "required" or a named function stands for.

Where it sits: `OpenAIServing.sampling_params` turns a request into a
`StructuredOutputsParams` here (the engine enforces it, jengine/core/structured_output.py);
the chat route asks `tool_choice_constraint` for the tool-call grammar. Every problem is a
400 naming the field, before anything runs. Jax-free, like the rest of the API process.
"""

from __future__ import annotations

from jengine.entrypoints.openai.protocol import OpenAIError, SamplingRequest
from jengine.entrypoints.openai.protocol_chat import (
    ChatCompletionRequest,
    ChatCompletionToolParam,
    NamedToolChoice,
)
from jengine.sampling_params import StructuredOutputsParams

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_outputs_of(request: SamplingRequest) -> StructuredOutputsParams | None:
    """The one constraint a request asks for (None: free text)."""
    found: dict[str, StructuredOutputsParams] = {}
    if request.structured_outputs is not None:
        found["structured_outputs"] = _params("structured_outputs", request.structured_outputs)
    for name, kind in _GUIDED.items():
        value = getattr(request, name)
        if value is not None:
            found[name] = _params(name, {kind: value})
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            found["response_format"] = StructuredOutputsParams(json_object=True)
        else:
            schema = response_format.json_schema
            if schema is None or schema.schema_ is None:
                raise OpenAIError(
                    "response_format of type json_schema needs json_schema.schema",
                    param="response_format",
                )
            found["response_format"] = _params("response_format", {"json": schema.schema_})
    if len(found) > 1:
        raise OpenAIError(
            f"give one output constraint, not {len(found)}: {', '.join(sorted(found))}",
            param=sorted(found)[0],
        )
    return next(iter(found.values()), None)


def constraint_field(request: SamplingRequest) -> str:
    """The field a request's output constraint came from: what an error about the
    constraint (a schema the grammar compiler refused) names."""
    fmt = request.response_format
    if fmt is not None and fmt.type != "text":
        return "response_format"
    guided = (name for name in _GUIDED if getattr(request, name) is not None)
    return next(guided, "structured_outputs")


def _params(field: str, values: dict) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**values)
    except (TypeError, ValueError) as e:
        raise OpenAIError(f"{field}: {e}", param=field) from None


# -- tools --------------------------------------------------------------------------------


def tool_choice_of(request: ChatCompletionRequest) -> str | NamedToolChoice:
    """ "none", "auto", "required" or a named function (OpenAI's default: "auto" with
    tools, "none" without)."""
    if request.tool_choice is not None:
        return request.tool_choice
    return "auto" if request.tools else "none"


def tool_choice_constraint(request: ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The grammar a forced tool call stands for: with "required", a JSON array of one or
    more `{"name": ..., "parameters": {...}}` calls of the request's tools; with a named
    function, that function's arguments object. None for "none" and "auto"."""
    choice = tool_choice_of(request)
    if choice in ("none", "auto"):
        return None
    tools = request.tools or []
    if not tools:
        raise OpenAIError(f"tool_choice {_describe(choice)} needs tools", param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        tool = find_tool(tools, choice.function.name)
        return _params("tools", {"json": _parameters(tool)})
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"enum": [tool.function.name]},
                "parameters": _parameters(tool),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if request.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return _params("tools", {"json": schema})


def find_tool(tools: list[ChatCompletionToolParam], name: str) -> ChatCompletionToolParam:
    for tool in tools:
        if tool.function.name == name:
            return tool
    raise OpenAIError(
        f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
    )


def _parameters(tool: ChatCompletionToolParam) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _describe(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"
