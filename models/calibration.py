"""Calibration inputs for rounding that weighs each weight's errors by its inputs (GPTQ,
`models/gptq.py`), taken from the model itself: no dataset.

Where it sits: `models/loader.quantized_params` calls `own_input_grams` on the float model
before it quantizes the linear weights with `--quantization fp8`; nothing at serve time.

Promises:
- `own_samples`: NUM_SEQUENCES sequences of SEQ_LEN tokens (fewer where the model has
  fewer positions), each the start token (the checkpoint's BOS) then the model's own
  samples at temperature 1, from a fixed key: the same tokens for the same weights on the
  same backend; one compiled loop of decode steps over a scratch paged cache
  (`attention_metadata.paged_decode_step`);
- `input_grams`: one pass of those tokens through all layers returns, for each linear
  weight, the Gram matrix of its inputs (sum of x x^T over the tokens, float32, [L, in,
  in]), as `DecoderForCausalLM.input_grams` defines it.
Measured on SmolLM2 (bench/README.md): fp8 by GPTQ calibrated on 64 x 96 of its own
tokens moved perplexity over five texts by +0.23% (geometric mean; each within 1.3%),
against +0.76% on 16 x 384 and +2.18% rounded to nearest (16 x 384 did as well as 11K
tokens of real text in an earlier measurement). The shape matters for the load's time: 95
decode steps of 64 rows (~15 s on the 2-core VM) instead of 383 of 16 (~30 s: at 16 rows
the matmuls run at about half the rate); the Gram pass (~15 s) is the same 6,144 tokens.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jengine.models.attention_metadata import SCRATCH_BLOCK_SIZE, paged_batch, paged_decode_step

NUM_SEQUENCES = 64
SEQ_LEN = 96  # a multiple of SCRATCH_BLOCK_SIZE
SEED = 0


def own_input_grams(model: nnx.Module, start_token: int) -> dict[str, np.ndarray]:
    """The Gram matrices of each linear weight's inputs over the model's own samples (of
    SEQ_LEN tokens, or as many whole pages as the model has positions)."""
    positions = model.config.max_position_embeddings
    seq_len = min(SEQ_LEN, positions - positions % SCRATCH_BLOCK_SIZE)
    return input_grams(model, own_samples(model, start_token, NUM_SEQUENCES, seq_len))


def own_samples(model: nnx.Module, start_token: int, num_sequences: int, seq_len: int):
    """[num_sequences, seq_len] tokens: `start_token`, then the model's samples."""
    graphdef, state = nnx.split(model)
    num_pages = num_sequences * seq_len // SCRATCH_BLOCK_SIZE + 1

    @jax.jit
    def sample(state):
        model = nnx.merge(graphdef, state)
        cache = jnp.zeros(model.kv_cache_shape(num_pages, SCRATCH_BLOCK_SIZE), model.dtype)
        tokens = jnp.full((num_sequences, seq_len), start_token, jnp.int32)

        def step(position, carry):
            tokens, cache, key = carry
            positions, metadata = paged_decode_step(num_sequences, seq_len, position)
            hidden, cache = model(tokens[:, position], positions, cache, metadata)
            key, subkey = jax.random.split(key)
            drawn = jax.random.categorical(subkey, model.compute_logits(hidden))
            tokens = tokens.at[:, position + 1].set(drawn.astype(jnp.int32))
            return tokens, cache, key

        carry = (tokens, cache, jax.random.key(SEED))
        return jax.lax.fori_loop(0, seq_len - 1, step, carry)[0]

    return sample(state)


def input_grams(model: nnx.Module, tokens: jax.Array) -> dict[str, np.ndarray]:
    """{linear weight name: [L, in, in] Gram matrix of its inputs} over `tokens` [B, S]."""
    graphdef, state = nnx.split(model)
    positions, metadata, num_pages = paged_batch(*tokens.shape)

    @jax.jit
    def grams(state, tokens):
        model = nnx.merge(graphdef, state)
        cache = jnp.zeros(model.kv_cache_shape(num_pages, SCRATCH_BLOCK_SIZE), model.dtype)
        return model.input_grams(tokens.reshape(-1), positions, cache, metadata)

    return {name: np.asarray(gram) for name, gram in grams(state, tokens).items()}
