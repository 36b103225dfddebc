"""Shared by the offline engine tests: their engine shapes, prompts and the HF oracle."""

import numpy as np
import torch

from tests.models.checkpoints import VOCAB

# Small enough that warmup compiles few shapes (and the persistent XLA cache makes every
# engine after the first start quickly); chunked prefill is forced by the 32-token budget.
ENGINE_KWARGS = dict(
    max_model_len=96, max_num_seqs=8, max_num_batched_tokens=32, block_size=4, dtype="float32"
)


def random_prompts(n: int, seed: int = 0, low: int = 3, high: int = 60) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=int(k)).tolist() for k in rng.integers(low, high, size=n)]


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()
