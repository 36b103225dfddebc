"""`POST /v1/embeddings`: inputs -> one embedding each, from an embedding engine.

Where it sits: routes.py calls `create_embedding`; the server's engine runs `--runner
pooling` (jengine/pooling.py), and each input goes to `AsyncLLM.encode` as its own engine
request, all at once. It shares the opening checks and the run's error handling with the
generation layers (serving_engine.py); there is no stream.

Promises: vLLM's `truncate_prompt_tokens` keeps each input's last k tokens; every problem
with a request (an input that is empty, too long or outside the vocabulary, `dimensions`
the model does not allow, a server that does not embed) is a 400 naming the field before
anything reaches the engine; `encoding_format="base64"` is the
little-endian float32 bytes of the same floats `"float"` gives (what the `openai` client
decodes).
"""

import base64

import numpy as np

from jengine.engine.output_processor import RequestError
from jengine.entrypoints.openai.async_merge import merge_async_iterators
from jengine.entrypoints.openai.errors import to_openai_error
from jengine.entrypoints.openai.protocol import OpenAIError
from jengine.entrypoints.openai.protocol_embeddings import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from jengine.entrypoints.openai.sampling_request import truncated
from jengine.entrypoints.openai.serving_engine import OpenAIServing
from jengine.outputs import EmbeddingRequestOutput
from jengine.pooling import PoolingParams

# OpenAI's limit on inputs per request.
MAX_INPUTS = 2048


class OpenAIServingEmbedding(OpenAIServing):
    request_id_prefix = "embd-"

    def prepare(self, request: EmbeddingRequest) -> tuple[list[list[int]], PoolingParams]:
        """The checked token ids of every input and the request's PoolingParams."""
        self.check_model(request.model)
        self.check_engine()
        self.check_extra_fields(request)
        self.check_truncation(request.truncate_prompt_tokens)
        pooler = self.engine.input_processor.pooler
        if pooler is None:
            raise OpenAIError(
                "this model does not serve embeddings: start the server with --runner pooling",
                param="model",
            )
        if request.messages is not None:  # it once failed as "input: Field required", or
            # beside an input was dropped with a log line
            raise OpenAIError(
                "messages (vLLM's chat-style embedding input) is not supported: send the "
                "text as input",
                param="messages",
            )
        inputs = request.input
        if inputs is None:
            raise OpenAIError("input is required", param="input")
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not inputs:
            raise OpenAIError("input is empty", param="input")
        if len(inputs) > MAX_INPUTS:
            raise OpenAIError(
                f"input has {len(inputs)} items; at most {MAX_INPUTS} are allowed", param="input"
            )
        if any(isinstance(item, str) for item in inputs):
            self.require_tokenizer()
        prompts = [
            truncated(request, None, token_ids, self.max_model_len)[1]
            for token_ids in (
                self.tokenizer.encode(item, add_special_tokens=request.add_special_tokens)
                if isinstance(item, str)
                else list(item)
                for item in inputs
            )
        ]
        for token_ids in prompts:
            try:
                self.engine.input_processor.validate_tokens(token_ids)
            except ValueError as e:
                raise OpenAIError(str(e), param="input") from None
        try:
            params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize)
            params.verified(pooler)
        except ValueError as e:
            raise OpenAIError(str(e), param="dimensions") from None
        return prompts, params

    async def create_embedding(
        self, request: EmbeddingRequest, prompts: list[list[int]], params: PoolingParams
    ) -> EmbeddingResponse:
        request_id = self.response_id(request)
        generators = [
            self.engine.encode(
                {"prompt_token_ids": token_ids},
                params,
                self.engine_request_id(request, f"{request_id}-{i}"),
                priority=request.priority,
                lora_request=self.models.lora_request(request.model),
            )
            for i, token_ids in enumerate(prompts)
        ]
        outputs: list[EmbeddingRequestOutput | None] = [None] * len(prompts)
        try:
            async for index, output in merge_async_iterators(*generators):
                outputs[index] = output
        except (ValueError, RequestError) as e:
            raise to_openai_error(e) from None
        encoding = request.encoding_format
        data = [
            EmbeddingData(index=i, embedding=encode_embedding(o.outputs.embedding, encoding))
            for i, o in enumerate(outputs)
        ]
        num_tokens = sum(map(len, prompts))
        return EmbeddingResponse(
            id=request_id,
            model=self.models.response_name(request.model),
            data=data,
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )


def encode_embedding(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, "<f4").tobytes()).decode("ascii")
    return embedding
