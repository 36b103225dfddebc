"""EngineArgs: the engine's knobs as one flat dataclass, the CLI flags that set them (vLLM's
names), and the step that turns them into a validated `EngineConfig`.

Where it sits: `jengine serve` / `jengine generate` parse flags into EngineArgs;
`AsyncLLM.from_engine_args` and `LLMEngine.from_engine_args` build their EngineConfig from
it. Jax-free (the API process uses it): the model's defaults come from its config.json.
"""

import argparse
import json
import os
from dataclasses import dataclass, fields

from jengine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig


def read_model_config(path: str) -> dict:
    """config.json of an HF checkpoint folder, with a clear error if it is not one."""
    if not os.path.isdir(path):
        raise ValueError(f"model path {path!r} is not a directory (no model hub is reachable)")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"model folder {path!r} has no config.json")
    with open(config_path) as f:
        return json.load(f)


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    scheduling_policy: str = "fcfs"
    seed: int = 0
    attention_impl: str | None = None

    def create_engine_config(self) -> EngineConfig:
        """Validate and build; `model` may be None only for an in-memory model (then
        `max_model_len` must be given)."""
        max_model_len = self.max_model_len
        if self.model is None:
            if max_model_len is None:
                raise ValueError("EngineArgs.model must name a checkpoint folder")
        elif max_model_len is None:
            hf_config = read_model_config(self.model)
            max_model_len = hf_config.get("max_position_embeddings", 2048)
        else:
            read_model_config(self.model)  # fail here, not in the engine process
        return EngineConfig(
            model=ModelConfig(
                model=self.model,
                tokenizer=self.tokenizer,
                dtype=self.dtype,
                max_model_len=max_model_len,
                seed=self.seed,
                attention_impl=self.attention_impl,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                num_gpu_blocks=self.num_gpu_blocks_override,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens or max(2048, self.max_num_seqs),
                max_model_len=max_model_len,
                policy=self.scheduling_policy,
            ),
        )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, model_flag: bool = True) -> None:
        group = parser.add_argument_group("engine")
        if model_flag:
            group.add_argument(
                "--model", default=None, help="HF checkpoint folder (default: bundled model)"
            )
        group.add_argument("--tokenizer", default=None, help="tokenizer folder (default: model)")
        group.add_argument(
            "--dtype",
            default="auto",
            choices=["auto", "float32", "bfloat16", "float16", "float", "half"],
            help="weights and KV cache dtype; auto = bf16 on accelerators, f32 on CPU",
        )
        group.add_argument("--max-model-len", type=int, default=None)
        group.add_argument("--max-num-seqs", type=int, default=EngineArgs.max_num_seqs)
        group.add_argument("--max-num-batched-tokens", type=int, default=None)
        group.add_argument("--block-size", type=int, default=16)
        group.add_argument(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=True,
        )
        group.add_argument("--num-gpu-blocks-override", type=int, default=None)
        group.add_argument("--kv-cache-memory-bytes", type=int, default=None)
        group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        group.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
        group.add_argument("--seed", type=int, default=0)
        group.add_argument(
            "--attention-impl", choices=["reference", "cpu", "gpu", "tpu"], default=None
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
