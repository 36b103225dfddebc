"""Standard benchmark workloads and the CPU benchmark model (bench/README.md).

Token ids with seed 0, so every engine sees exactly the same requests.
"""

import os

import numpy as np

from .tokenizer import write_bench_tokenizer

# The CPU benchmark model: a random-weight Llama of about 56M parameters, float32.
BENCH_MODEL = dict(
    vocab_size=32000,
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=1408,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def workload_a(seed: int = 0, num_requests: int = 128):
    """A: 128 requests, prompt length uniform in [64, 256], exactly 128 output tokens."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(64, 257, size=num_requests)
    prompts = [rng.integers(100, 31000, size=int(n)).tolist() for n in lengths]
    return prompts, 128


def workload_c(seed: int = 0):
    """C: one request, 128-token prompt, 256 output tokens."""
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 31000, size=128).tolist()], 256


def make_bench_model(path: str, seed: int = 0) -> str:
    """Write the random-weight benchmark Llama (HF format) to `path` once, with its
    tokenizer (bench/tokenizer.py: every token streams as text)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        import torch
        import transformers

        torch.manual_seed(seed)
        config = transformers.LlamaConfig(**BENCH_MODEL)
        transformers.LlamaForCausalLM(config).save_pretrained(path)
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        write_bench_tokenizer(path)
    return path


def workload_prefix(seed: int = 0, num_requests: int = 64, shared_len: int = 1024):
    """Prefix: `num_requests` requests sharing a `shared_len`-token system prompt, each
    with its own 32-token question and 16 output tokens."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(100, 31000, size=shared_len).tolist()
    prompts = [shared + rng.integers(100, 31000, size=32).tolist() for _ in range(num_requests)]
    return prompts, 16
