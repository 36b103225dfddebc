"""The request and response bodies of `POST /v1/embeddings` (OpenAI's, with vLLM's extras).

Where it sits: routes.py validates a body into `EmbeddingRequest`; serving_embedding.py
runs it through an embedding engine (`--runner pooling`) and answers an
`EmbeddingResponse`.
"""

from typing import Annotated, Literal

from pydantic import Field

from jengine.entrypoints.openai.protocol import _INT64, OpenAIBaseModel, RequestModel, now


class EmbeddingRequest(RequestModel):
    """`input`: a string, a list of strings, a list of token ids, or a list of those."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None  # required: see prepare
    # vLLM's chat-style embedding input, which jengine refuses by name
    messages: list | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    # vLLM's extras
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # each input's last k tokens (-1: max_model_len)
    normalize: bool | None = None
    request_id: str | None = None
    priority: Annotated[int, Field(**_INT64)] = 0


class EmbeddingData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    # floats, or with encoding_format="base64" their little-endian float32 bytes in base64
    embedding: list[float] | str


class EmbeddingUsage(OpenAIBaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
