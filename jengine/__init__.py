"""jengine: a JAX-native LLM inference and serving engine in the mould of vLLM V1.

Public API (importing it loads jax through the offline engine; the API-server process
imports only `jengine.entrypoints.openai`, which does not):
    LLM, SamplingParams, RequestOutput, CompletionOutput, LoRARequest,
    PoolingParams, EmbeddingRequestOutput (an embedding engine: `LLM(runner="pooling")`)
"""

from jengine.lora_request import LoRARequest
from jengine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
)
from jengine.pooling import PoolingParams
from jengine.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name):
    # LLM pulls in jax; load it only when asked so `import jengine.sampling_params` and
    # the API server stay jax-free.
    if name == "LLM":
        from jengine.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'jengine' has no attribute {name!r}")


__all__ = [
    "LLM",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "Logprob",
    "LoRARequest",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
