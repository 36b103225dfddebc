"""jengine: a JAX-native LLM inference and serving engine in the mould of vLLM V1.

Public API (importing it loads jax through the offline engine; the API-server process
imports only `jengine.entrypoints.openai`, which does not):
    LLM, SamplingParams, RequestOutput, CompletionOutput, LoRARequest,
    PoolingParams, EmbeddingRequestOutput (an embedding engine: `LLM(runner="pooling")`),
    and the engine pieces vLLM names at its top level: LLMEngine, AsyncLLM, EngineArgs
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

_ENGINE = {
    "EngineArgs": "jengine.engine.arg_utils",
    "LLMEngine": "jengine.engine.llm_engine",
    "AsyncLLM": "jengine.engine.async_llm",
}


def __getattr__(name):
    # LLM pulls in jax; load it only when asked so `import jengine.sampling_params` and
    # the API server stay jax-free.
    if name == "LLM":
        from jengine.entrypoints.llm import LLM

        return LLM
    if name in _ENGINE:  # vLLM's top-level names for the engine and its arguments
        import importlib

        return getattr(importlib.import_module(_ENGINE[name]), name)
    raise AttributeError(f"module 'jengine' has no attribute {name!r}")


__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineArgs",
    "LLMEngine",
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
