"""Engine configuration: frozen, validated dataclasses, one per concern.

Where it sits: built once by the entry points (CLI flags, ``LLM(...)`` keyword arguments,
through ``EngineArgs`` in jengine/engine/arg_utils.py) and handed down read-only as one
``EngineConfig``: ``ModelConfig`` to the model loader and the runner, ``CacheConfig`` to the
KV-cache sizing in the runner and to the block pool, ``SchedulerConfig`` to the scheduler,
``CompilationConfig`` to the runner's compilation.

What it promises: the engine's defaults are the defaults of these dataclasses and are
written nowhere else (EngineArgs and the CLI flags read them); an instance that exists is
valid, a bad value raises ``ValueError`` naming the field at construction time, long before
a step runs; instances are frozen, so every component sees the same numbers for the life of
the engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from jengine.config_checks import require as _require
from jengine.pooling import PoolerConfig
from jengine.sampling_params import MAX_LOGPROBS
from jengine.speculative_config import SpeculativeConfig

# vLLM's `--quantization` values jengine takes (None: what the checkpoint holds; the
# methods are models/quantize.METHODS).
QUANTIZATION_CHOICES = (None, "none", "gguf", "compressed-tensors", "int8", "fp8", "fp8-rtn")


# vLLM's `--kv-cache-dtype` values jengine takes: "auto" is the model's dtype; "fp8" is
# fp8_e4m3 (jengine/runner/kv_cache_sizing.py maps them to element types).
KV_CACHE_DTYPE_CHOICES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")

# The multi-step program's sampled tokens are [K, S]; past a few dozen the host's share
# of a token is already negligible, and a stop wastes up to K - 1 tokens of compute.
MAX_SCHEDULER_STEPS = 64


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache layout and size.

    block_size: tokens per KV block (a power of two so page arithmetic is shifts).
    enable_prefix_caching: keep full blocks findable by content hash after their request
        ends, so a later request with the same prefix skips recomputing it.
    num_gpu_blocks: explicit block count (overrides any memory-derived count); includes the
        reserved null block 0.
    kv_cache_memory_bytes: explicit KV-cache byte budget (the CPU path; on accelerators it
        overrides gpu_memory_utilization).
    gpu_memory_utilization: fraction of device memory the engine may use in total (weights,
        activations and KV cache) when no explicit budget is given.
    kv_cache_dtype: vLLM's `--kv-cache-dtype`: the cache's element type ("auto": the model's;
        "fp8" / "fp8_e4m3" and "fp8_e5m2" hold K and V in one byte, saturated to the
        format's range, with no scale, as vLLM's uncalibrated fp8 cache).
    """

    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        bs = self.block_size
        _require(
            isinstance(bs, int) and bs >= 1 and bs & (bs - 1) == 0,
            "block_size",
            "must be a power of two >= 1",
            bs,
        )
        if self.num_gpu_blocks is not None:
            # One block is the reserved null block; at least one more must hold real tokens.
            _require(
                self.num_gpu_blocks >= 2, "num_gpu_blocks", "must be >= 2", self.num_gpu_blocks
            )
        if self.kv_cache_memory_bytes is not None:
            _require(
                self.kv_cache_memory_bytes > 0,
                "kv_cache_memory_bytes",
                "must be > 0",
                self.kv_cache_memory_bytes,
            )
        _require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            "must be in (0, 1]",
            self.gpu_memory_utilization,
        )
        _require(
            self.kv_cache_dtype in KV_CACHE_DTYPE_CHOICES,
            "kv_cache_dtype",
            f"must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}",
            self.kv_cache_dtype,
        )


SchedulingPolicy = Literal["fcfs", "priority"]


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler may put into one step.

    max_num_seqs: requests running at once (and so at most per step).
    max_num_batched_tokens: the per-step token budget shared by prefill chunks and decodes.
    max_model_len: longest sequence (prompt + output) a request may reach.
    policy: "fcfs" (arrival order) or "priority" (lower value first, then arrival order;
        the lowest-priority running request is the one preempted).
    long_prefill_token_threshold: if > 0, a request gets at most this many tokens per step,
        so one long prompt cannot take the whole budget from the others.
    async_scheduling: schedule and dispatch step N+1 before step N's sampled tokens reach
        the host (vLLM's --async-scheduling); the engine core turns it off where it is
        not exact (speculative decoding).
    num_scheduler_steps: decode steps run by one program launch (vLLM V0's
        --num-scheduler-steps): while every running request decodes and none waits to
        start, each step samples this many tokens per request on the device, so the host's
        work and the launch are paid once per that many tokens. The tokens are exactly
        those of single steps; tokens sampled past a stop are discarded. Streams receive
        tokens in bursts of this size. 1: off.
    """

    # vLLM's CPU server defaults; EngineArgs raises the budget to max_num_seqs if needed.
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: SchedulingPolicy = "fcfs"
    long_prefill_token_threshold: int = 0
    async_scheduling: bool = True
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1", self.max_num_seqs)
        _require(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            "must be >= 1",
            self.max_num_batched_tokens,
        )
        # Every running request needs at least one token per step to make progress.
        _require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            "max_num_batched_tokens",
            f"must be >= max_num_seqs ({self.max_num_seqs})",
            self.max_num_batched_tokens,
        )
        _require(self.max_model_len >= 1, "max_model_len", "must be >= 1", self.max_model_len)
        _require(
            self.policy in ("fcfs", "priority"),
            "policy",
            "must be 'fcfs' or 'priority'",
            self.policy,
        )
        _require(
            self.long_prefill_token_threshold >= 0,
            "long_prefill_token_threshold",
            "must be >= 0",
            self.long_prefill_token_threshold,
        )
        _require(
            1 <= self.num_scheduler_steps <= MAX_SCHEDULER_STEPS,
            "num_scheduler_steps",
            f"must be between 1 and {MAX_SCHEDULER_STEPS}",
            self.num_scheduler_steps,
        )


@dataclass(frozen=True)
class ModelConfig:
    """Which weights, in which precision, and how long a sequence may get.

    model: an HF checkpoint folder, or None when the caller hands over a Flax module.
    tokenizer: folder with the tokenizer files (defaults to `model`); None with no model
        means token-id prompts only.
    dtype: "auto" (bf16 on accelerators, f32 on CPU), "float32", "bfloat16", "float16".
    quantization: vLLM's `--quantization`: None keeps what the checkpoint holds (a GGUF's
        block-quantized weights, a compressed-tensors checkpoint's packed ones stay
        quantized; "gguf" / "compressed-tensors" insist on it), "none" dequantizes them,
        "int8" (groups of 32) and "fp8" (per channel; GPTQ-rounded at load, "fp8-rtn":
        rounded to nearest) quantize the linear weights (weight-only).
    max_model_len: None -> the model's context (arg_utils.trained_context_length).
    seed: seeds the engine's sampling of requests that bring no seed.
    attention_impl: force "reference" / "cpu" / "gpu" / "tpu" attention (None: by backend).
    runner: vLLM's `--runner`: "generate", or "pooling" for an embedding engine, which
        pools each prompt as `pooler` says (jengine/pooling.py) and generates nothing.
    pooler: the pooling of a "pooling" runner (None otherwise).
    generation_config: vLLM's `--generation-config`: "auto", "vllm" or a folder
        (jengine/generation_config.py).
    max_logprobs: vLLM's `--max-logprobs`: the most top logprobs a request may ask for,
        a token or a prompt position (-1: the whole vocabulary); the sampling programs
        compute that many whenever a request asks for any.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    quantization: str | None = None
    max_model_len: int | None = None
    seed: int = 0
    attention_impl: str | None = None
    runner: str = "generate"
    pooler: PoolerConfig | None = None
    generation_config: str = "auto"
    max_logprobs: int = MAX_LOGPROBS

    def __post_init__(self) -> None:
        _require(
            self.runner in ("generate", "pooling"),
            "runner",
            "must be generate or pooling",
            self.runner,
        )
        _require(
            (self.pooler is not None) == (self.runner == "pooling"),
            "pooler",
            "is set for the pooling runner and only for it",
            self.pooler,
        )
        _require(
            self.dtype in ("auto", "float32", "bfloat16", "float16", "float", "half"),
            "dtype",
            "must be auto, float32, bfloat16 or float16",
            self.dtype,
        )
        _require(
            self.quantization in QUANTIZATION_CHOICES,
            "quantization",
            f"must be one of {', '.join(q for q in QUANTIZATION_CHOICES if q)} (or unset)",
            self.quantization,
        )
        if self.max_model_len is not None:
            _require(self.max_model_len >= 1, "max_model_len", "must be >= 1", self.max_model_len)
        _require(
            self.attention_impl in (None, "reference", "cpu", "gpu", "tpu"),
            "attention_impl",
            "must be reference, cpu, gpu or tpu",
            self.attention_impl,
        )
        _require(self.max_logprobs >= -1, "max_logprobs", "must be >= -1", self.max_logprobs)

    def num_top_logprobs(self, vocab_size: int) -> int:
        """`max_logprobs` for a vocabulary of `vocab_size`: all of it for -1, never more."""
        return vocab_size if self.max_logprobs == -1 else min(self.max_logprobs, vocab_size)


def default_compilation_cache_dir() -> str:
    return os.environ.get("JENGINE_COMPILATION_CACHE", os.path.expanduser("~/.cache/jengine/xla"))


@dataclass(frozen=True)
class CompilationConfig:
    """How the runner keeps compiled programs.

    cache_dir: folder of jax's persistent compilation cache, so a second start loads the
        step programs instead of compiling them (default: $JENGINE_COMPILATION_CACHE, else
        ~/.cache/jengine/xla). None leaves jax's process-wide cache setting alone, for
        research code that manages its own.
    warmup: compile every step shape at start-up, so serving never compiles (the default);
        False compiles each shape the first time a step needs it: what one-shot commands
        (`jengine chat`, `jengine generate`) want, since one request needs few shapes.
    """

    cache_dir: str | None = field(default_factory=default_compilation_cache_dir)
    warmup: bool = True


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over devices, processes and hosts.

    tensor_parallel_size: devices each weight and the KV cache are split over (a
        `jax.sharding.Mesh` axis, Megatron-style; jengine/runner/sharding.py).
    enable_expert_parallel: in a mixture-of-experts model, place whole experts over those
        devices (each computes the tokens routed to its experts) instead of splitting every
        expert's features (vLLM's --enable-expert-parallel; models/moe.py).
    data_parallel_size: engine-core processes, each a whole replica of the model on its
        own devices, behind one front end that balances requests over them
        (jengine/engine/client.py).
    coordinator_address, num_hosts, host_rank: multi-host SPMD through
        `jax.distributed` (jengine/runner/distributed.py): the tensor-parallel mesh spans
        the devices of `num_hosts` processes; host 0 schedules and serves, the others
        follow its steps.
    """

    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1
    coordinator_address: str | None = None
    num_hosts: int = 1
    host_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "num_hosts"):
            value = getattr(self, name)
            _require(value >= 1, name, "must be >= 1", value)
        _require(
            0 <= self.host_rank < self.num_hosts,
            "host_rank",
            f"must be in [0, num_hosts={self.num_hosts})",
            self.host_rank,
        )
        if self.num_hosts > 1:
            _require(
                self.coordinator_address is not None,
                "coordinator_address",
                "is needed (host:port of host 0) when num_hosts > 1",
                self.coordinator_address,
            )
            _require(
                self.data_parallel_size == 1,
                "data_parallel_size",
                "must be 1 with num_hosts > 1 (one multi-host replica)",
                self.data_parallel_size,
            )

    @property
    def multi_host(self) -> bool:
        return self.num_hosts > 1


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (vLLM's `--enable-lora` flags; models/lora.py, runner/lora_slots.py).

    max_loras: adapters on the device at once, so the most in one step.
    max_lora_rank: the slots' rank; an adapter of a lower rank is zero-padded (exact).
    max_cpu_loras: adapters kept read on the host (None: max_loras), more while
        unfinished requests use them; one dropped is read again when a request names it.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1, "max_loras", "must be >= 1", self.max_loras)
        _require(self.max_lora_rank >= 1, "max_lora_rank", "must be >= 1", self.max_lora_rank)
        _require(
            self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
            "max_cpu_loras",
            f"must be >= max_loras={self.max_loras}",
            self.max_cpu_loras,
        )

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras


@dataclass(frozen=True)
class EngineConfig:
    """All parts together; what `EngineCore` is built from."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None  # None: LoRA off
