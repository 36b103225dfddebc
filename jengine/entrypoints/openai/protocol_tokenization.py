"""The bodies of the model list (`GET /v1/models`) and of vLLM's `POST /tokenize` and
`POST /detokenize`.

Where it sits: serving_models.py and serving_tokenization.py build and read these; the
generation routes' bodies are in protocol.py.
"""

from typing import Any, Literal

from pydantic import Field

from jengine.entrypoints.openai.protocol import OpenAIBaseModel, RequestModel, TokenId, now
from jengine.entrypoints.openai.protocol_chat import ChatCompletionToolParam, ChatMessageParam


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "jengine"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeRequest(RequestModel):
    """Either `prompt` (a completion prompt) or `messages` (run through the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolParam] | None = None  # they reach the template
    return_token_strs: bool = False  # vLLM's: each token as the vocabulary writes it


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
