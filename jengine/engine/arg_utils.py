"""EngineArgs: the engine's knobs as one flat dataclass, the CLI flags that set them (vLLM's
names), and the step that turns them into a validated `EngineConfig`.

Where it sits: `jengine serve` / `jengine generate` parse flags into EngineArgs; `LLM(...)`
takes its fields as keyword arguments; `AsyncLLM.from_engine_args` and
`LLMEngine.from_engine_args` build their EngineConfig from it. The defaults are those of the
config dataclasses (jengine/config.py), read here and by every flag, so they are written
once. Jax-free (the API process uses it): the model's own limits come from its config (the
folder's config.json or a GGUF's metadata).
"""

import argparse
import logging
import os
import secrets
from dataclasses import dataclass, field, fields

from jengine.config import (
    KV_CACHE_DTYPE_CHOICES,
    QUANTIZATION_CHOICES,
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    default_compilation_cache_dir,
)
from jengine.config_checks import check_number_types
from jengine.models.checkpoint import holds_base_model, read_hf_config, resolve_model
from jengine.models.rope_config import exact_context_length, rope_parameters, rope_type_of
from jengine.pooling import PoolerConfig

logger = logging.getLogger(__name__)

# What a field's annotation admits (a numpy integer is an int; an int is a float).
# Set to 1, max_model_len may exceed the checkpoint's context (trained_context_length).
ALLOW_LONG_MAX_MODEL_LEN = "JENGINE_ALLOW_LONG_MAX_MODEL_LEN"


def trained_context_length(hf_config: dict) -> int | None:
    """The context a checkpoint was trained for, as vLLM reads it: max_position_embeddings,
    times the factor of a linear or dynamic rope scaling (a 4096-position model scaled 4x
    serves 16K), or a YaRN scaling's original length times its factor. Not Gemma 3's,
    whose factor scales its global layers only (vLLM leaves it too); llama3 and longrope
    scalings already state the scaled length."""
    length = hf_config.get("max_position_embeddings")
    rope = rope_parameters(hf_config)
    rope_type = rope_type_of(rope)
    if length is None or "gemma3" in str(hf_config.get("model_type")) or "factor" not in rope:
        return length
    if rope_type == "yarn":
        length = rope.get("original_max_position_embeddings", length)
    elif rope_type not in ("linear", "dynamic"):
        return length
    return int(length * float(rope["factor"]))


@dataclass
class EngineArgs:
    model: str | None = ModelConfig.model
    tokenizer: str | None = ModelConfig.tokenizer
    dtype: str = ModelConfig.dtype
    quantization: str | None = ModelConfig.quantization
    # None: the model's context (trained_context_length).
    max_model_len: int | None = None
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    # None: SchedulerConfig's budget, raised to max_num_seqs if that is larger, capped at
    # max_num_seqs * max_model_len.
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int = SchedulerConfig.long_prefill_token_threshold
    block_size: int = CacheConfig.block_size
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    num_gpu_blocks_override: int | None = CacheConfig.num_gpu_blocks
    kv_cache_memory_bytes: int | None = CacheConfig.kv_cache_memory_bytes
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    kv_cache_dtype: str = CacheConfig.kv_cache_dtype
    scheduling_policy: str = SchedulerConfig.policy
    async_scheduling: bool = SchedulerConfig.async_scheduling
    num_scheduler_steps: int = SchedulerConfig.num_scheduler_steps
    # None (vLLM's): unseeded sampling differs from run to run (a seed drawn at start).
    seed: int | None = ModelConfig.seed
    attention_impl: str | None = ModelConfig.attention_impl
    generation_config: str = ModelConfig.generation_config
    max_logprobs: int = ModelConfig.max_logprobs
    # None leaves jax's process-wide compilation cache setting alone.
    compilation_cache_dir: str | None = field(default_factory=default_compilation_cache_dir)
    warmup: bool = CompilationConfig.warmup
    tensor_parallel_size: int = ParallelConfig.tensor_parallel_size
    enable_expert_parallel: bool = ParallelConfig.enable_expert_parallel
    data_parallel_size: int = ParallelConfig.data_parallel_size
    coordinator_address: str | None = ParallelConfig.coordinator_address
    num_hosts: int = ParallelConfig.num_hosts
    host_rank: int = ParallelConfig.host_rank
    # vLLM's --speculative-config: a dict, or JSON text on the command line.
    speculative_config: dict | str | None = None
    enable_lora: bool = False
    max_loras: int = LoRAConfig.max_loras
    max_lora_rank: int = LoRAConfig.max_lora_rank
    max_cpu_loras: int | None = LoRAConfig.max_cpu_loras
    runner: str = ModelConfig.runner
    # vLLM's --pooler-config: {"pooling_type": ..., "normalize": ...}, or JSON text.
    pooler_config: dict | str | None = None

    def create_engine_config(self) -> EngineConfig:
        """Validate and build; `model` may be None only for an in-memory model (then
        `max_model_len` must be given)."""
        check_number_types(self)
        max_model_len = self.max_model_len
        model = None if self.model is None else resolve_model(self.model)
        hf_config = {}
        if model is None:
            if max_model_len is None:
                raise ValueError("EngineArgs.model must name a checkpoint folder")
        else:
            hf_config = read_hf_config(model)  # fail here, not in the engine process
        trained_len = trained_context_length(hf_config)
        exact_len, why = exact_context_length(hf_config) or (None, "")
        if max_model_len is None:
            max_model_len = trained_len or SchedulerConfig.max_model_len
            if exact_len is not None and max_model_len > exact_len:
                logger.warning("max_model_len is %d, not %d: %s", exact_len, max_model_len, why)
                max_model_len = exact_len
        elif exact_len is not None and max_model_len > exact_len:
            raise ValueError(f"max_model_len={max_model_len} is longer than {exact_len}: {why}")
        elif (
            trained_len is not None
            and max_model_len > trained_len  # a number: check_number_types saw to it
            and os.environ.get(ALLOW_LONG_MAX_MODEL_LEN) != "1"
        ):
            raise ValueError(
                f"max_model_len={max_model_len} is longer than the model's context "
                f"({trained_len}: its max_position_embeddings, times a linear, dynamic or "
                "YaRN rope scaling's factor): positions past it were never trained. Set "
                f"{ALLOW_LONG_MAX_MODEL_LEN}=1 to allow it anyway (as vLLM's "
                "VLLM_ALLOW_LONG_MAX_MODEL_LEN)"
            )
        speculative = SpeculativeConfig.from_value(self.speculative_config)
        pooler = self._pooler_config(model, hf_config, speculative)
        if pooler is not None and pooler.max_seq_length is not None:
            # sentence-transformers embeds at most max_seq_length tokens (cutting the rest):
            # longer prompts are refused, or cut by truncate_prompt_tokens (as vLLM's).
            if self.max_model_len is None:
                max_model_len = min(max_model_len, pooler.max_seq_length)
            elif max_model_len > pooler.max_seq_length:
                raise ValueError(
                    f"max_model_len={max_model_len} is longer than the embedding model's "
                    f"max_seq_length ({pooler.max_seq_length}, its sentence_bert_config.json)"
                )
        # The default budget, raised to max_num_seqs (one token each) and capped at what
        # max_num_seqs requests of max_model_len can use: a larger budget only adds
        # step shapes to compile.
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:  # 0 is a value, refused by SchedulerConfig
            max_num_batched_tokens = max(
                self.max_num_seqs,
                min(SchedulerConfig.max_num_batched_tokens, self.max_num_seqs * max_model_len),
            )
        if self.num_scheduler_steps > 1 and (speculative is not None or self.runner == "pooling"):
            # Drafts are verified, and pooled vectors taken, one step at a time.
            raise ValueError(
                "num_scheduler_steps > 1 combines with neither speculative decoding nor the "
                "pooling runner"
            )
        return EngineConfig(
            model=ModelConfig(
                model=model,
                tokenizer=self.tokenizer,
                dtype=self.dtype,
                quantization=self.quantization,
                max_model_len=max_model_len,
                seed=self.seed if self.seed is not None else secrets.randbits(31),
                attention_impl=self.attention_impl,
                runner=self.runner,
                pooler=pooler,
                generation_config=self.generation_config,
                max_logprobs=self.max_logprobs,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                # Mean and first-token pooling read every prompt token's hidden state, which
                # a prefix hit would skip computing (vLLM turns the cache off for them too).
                enable_prefix_caching=self.enable_prefix_caching
                and (pooler is None or pooler.pooling_type == "LAST"),
                num_gpu_blocks=self.num_gpu_blocks_override,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_dtype=self.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                policy=self.scheduling_policy,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                async_scheduling=self.async_scheduling,
                num_scheduler_steps=self.num_scheduler_steps,
            ),
            compilation=CompilationConfig(
                cache_dir=self.compilation_cache_dir or None, warmup=self.warmup
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                enable_expert_parallel=self.enable_expert_parallel,
                data_parallel_size=self.data_parallel_size,
                coordinator_address=self.coordinator_address,
                num_hosts=self.num_hosts,
                host_rank=self.host_rank,
            ),
            speculative=speculative,
            lora=self._lora_config(speculative),
        )

    def _pooler_config(self, model, hf_config: dict, speculative) -> PoolerConfig | None:
        if self.runner != "pooling":
            if self.pooler_config is not None:
                raise ValueError("pooler_config is for the pooling runner (--runner pooling)")
            if holds_base_model(hf_config):
                raise ValueError(
                    f"{model} is a base model without an LM head "
                    f"({hf_config['architectures'][0]}): it "
                    "embeds (--runner pooling) but cannot generate"
                )
            return None
        if speculative is not None:
            raise ValueError("the pooling runner does not generate: no speculative_config")
        return PoolerConfig.from_checkpoint(model, hf_config, self.pooler_config)

    def _lora_config(self, speculative) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        # Refused rather than half-done: a draft model would propose without the adapter,
        # and a follower host would not have the adapters the leader reads.
        if speculative is not None:
            raise ValueError("enable_lora does not combine with speculative decoding yet")
        if self.num_hosts > 1:
            raise ValueError("enable_lora does not combine with multi-host serving yet")
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, model_flag: bool = True) -> None:
        """The engine's flags; every default is EngineArgs' own."""
        group = parser.add_argument_group("engine")

        def add(flag: str, **kwargs) -> None:
            name = flag[2:].replace("-", "_")
            group.add_argument(flag, default=getattr(EngineArgs, name, None), **kwargs)

        if model_flag:
            add(
                "--model",
                help="HF checkpoint folder, .gguf file or 'smollm2' (default: smollm2 when "
                "installed, else the bundled model)",
            )
        add("--tokenizer", help="tokenizer folder or .gguf (default: the model's)")
        add(
            "--dtype",
            choices=["auto", "float32", "bfloat16", "float16", "float", "half"],
            help="weights dtype (the KV cache's too unless --kv-cache-dtype); auto = bf16 on "
            "accelerators, f32 on CPU",
        )
        add(
            "--quantization",
            choices=[q for q in QUANTIZATION_CHOICES if q],
            help="weights held quantized: int8 or fp8 (the linear weights, weight-only; fp8 "
            "rounded by GPTQ, calibrated on the model's own samples at load; fp8-rtn rounded "
            "to nearest); "
            "none (dequantize a quantized checkpoint); default: what the checkpoint holds "
            "(a GGUF's blocks and a compressed-tensors checkpoint's packed weights stay "
            "quantized)",
        )
        add("--max-model-len", type=int, help="default: the model's context length")
        add("--max-num-seqs", type=int, help="requests running at once")
        add(
            "--max-num-batched-tokens",
            type=int,
            help=f"tokens per step (default: {SchedulerConfig.max_num_batched_tokens}, "
            "or max-num-seqs if larger)",
        )
        add(
            "--long-prefill-token-threshold",
            type=int,
            help="at most this many tokens of one request per step (0: no limit)",
        )
        add("--block-size", type=int, help="tokens per KV-cache block")
        add("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
        add(
            "--num-gpu-blocks-override",
            type=int,
            help="KV-cache blocks to allocate, one of them the null block padding writes to "
            "(N - 1 hold tokens)",
        )
        add("--kv-cache-memory-bytes", type=int, help="KV-cache budget (default on CPU: 1 GiB)")
        add("--gpu-memory-utilization", type=float)
        add(
            "--kv-cache-dtype",
            choices=list(KV_CACHE_DTYPE_CHOICES),
            help="the KV cache's element type: auto (the model's dtype), bfloat16, or fp8 "
            "(= fp8_e4m3) / fp8_e5m2, one byte a value (saturated, no scale): 4x the tokens "
            "of a float32 cache in the same memory",
        )
        add("--scheduling-policy", choices=["fcfs", "priority"])
        add(
            "--async-scheduling",
            action=argparse.BooleanOptionalAction,
            help="schedule the next step while the device runs this one (default on; off "
            "with speculative decoding)",
        )
        add(
            "--num-scheduler-steps",
            type=int,
            help="decode steps per program launch while every request decodes (tokens "
            "stream in bursts of this size; 1: off)",
        )
        add("--seed", type=int)
        add("--attention-impl", choices=["reference", "cpu", "gpu", "tpu"])
        add("--tensor-parallel-size", type=int, help="devices to split the model over")
        add(
            "--enable-expert-parallel",
            action="store_true",
            help="mixture-of-experts models: whole experts spread over the tensor-parallel "
            "devices instead of each expert split over them",
        )
        add(
            "--data-parallel-size",
            type=int,
            help="engine-core replicas behind one server, requests balanced over them",
        )
        add(
            "--coordinator-address",
            help="host:port of host 0's jax.distributed coordinator (multi-host)",
        )
        add("--num-hosts", type=int, help="processes (hosts) the tensor-parallel mesh spans")
        add(
            "--host-rank",
            type=int,
            help="this host's rank; 0 serves, the others follow its steps",
        )
        add(
            "--speculative-config",
            help='speculative decoding as JSON, e.g. {"method": "ngram", '
            '"num_speculative_tokens": 3, "prompt_lookup_max": 3}',
        )
        add(
            "--enable-lora",
            action="store_true",
            help="serve LoRA adapters (PEFT folders) beside the base model",
        )
        add("--max-loras", type=int, help="LoRA adapters on the device at once (in one step)")
        add("--max-lora-rank", type=int, help="the highest LoRA rank served")
        add(
            "--max-cpu-loras",
            type=int,
            help="LoRA adapters kept read in host memory (default: max-loras)",
        )
        add(
            "--runner",
            choices=["generate", "pooling"],
            help="pooling: an embedding model (/v1/embeddings, LLM.embed) that pools the "
            "prompt's hidden states instead of generating",
        )
        add(
            "--pooler-config",
            help='the pooling runner\'s pooling as JSON, e.g. {"pooling_type": "MEAN", '
            '"normalize": true} (default: the checkpoint\'s sentence-transformers config, '
            "else LAST, normalized)",
        )
        add(
            "--generation-config",
            help='sampling defaults: "auto" (the model folder\'s generation_config.json '
            'recommends them), "vllm" (ignore the file) or a folder holding one',
        )
        add(
            "--max-logprobs",
            type=int,
            help="the most top logprobs a request may ask for, per token or prompt position "
            "(-1: the whole vocabulary); this many are computed whenever one asks",
        )
        add(
            "--warmup",
            action=argparse.BooleanOptionalAction,
            help="compile every step shape at start-up (--no-warmup: when first used)",
        )
        group.add_argument(
            "--compilation-cache-dir",
            default=default_compilation_cache_dir(),
            help="jax's persistent compilation cache (default: $JENGINE_COMPILATION_CACHE, "
            "else ~/.cache/jengine/xla); '' leaves jax's setting alone",
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
