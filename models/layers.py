"""Building blocks of the decoder as pure functions: RMSNorm (with Gemma's 1 + w), rotary
embeddings, the gated MLP (SiLU or GELU-tanh).

Where it sits: `models/decoder.py` calls these inside its per-layer scan body. They promise
the numerics of Hugging Face transformers (PyTorch) for the same weights: RMSNorm and
rotary angles are computed in float32 and cast back, as HF does, so f32 logits agree to
~1e-5 and bf16 rounding happens at the same places.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jengine.models.rope_config import RopeConfig

# A linear layer without its bias: [T, in] -> [T, out].
Linear = Callable[[jax.Array], jax.Array]


def float32_matmuls(method):
    """A model method whose matmuls multiply in full float32 when the model's `dtype` is
    float32: on a GPU, jax's default precision runs float32 matmuls as TF32 (~1e-3
    relative error; measured on an H100: logprobs 1.9e-3 off transformers'), which
    PyTorch's default, and so transformers', does not. Set while tracing, so it is part
    of the compiled step; bfloat16 models keep the default."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if jnp.dtype(self.dtype) != jnp.float32:
            return method(self, *args, **kwargs)
        with jax.default_matmul_precision("highest"):
            return method(self, *args, **kwargs)

    return wrapper


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, plus_one: bool = False):
    """HF LlamaRMSNorm: normalize in f32, cast back, then scale. `plus_one`: Gemma's,
    which scales by (1 + weight) in f32 and casts back last."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if plus_one:
        return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * x32.astype(x.dtype)


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # HF's gelu_pytorch_tanh
}


def gated_mlp(x, gate_up, down: Linear, biases=None, *, activation="silu"):
    """down(act(gate(x)) * up(x)), `gate_up(x)` giving (gate(x), up(x)) (one kernel call for
    both where it can); `biases` = (gate, up, down) or None."""
    g, u = gate_up(x)
    if biases is not None:
        g, u = g + biases[0], u + biases[1]
    out = down(ACTIVATIONS[activation](g) * u)
    return out if biases is None else out + biases[2]


def rope_cos_sin(rope: RopeConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [T, rotary_dim] in f32 for the given positions (HF layout: halves),
    scaled by the rope's attention factor as HF scales them."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(rope.inv_freq())[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    if rope.attention_factor == 1.0:
        return jnp.cos(emb), jnp.sin(emb)
    return jnp.cos(emb) * rope.attention_factor, jnp.sin(emb) * rope.attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half rotary embedding of x [T, heads, H]; cos/sin [T, rotary_dim]."""
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    cos = cos[:, None, :].astype(x.dtype)
    sin = sin[:, None, :].astype(x.dtype)
    half = rotary_dim // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    out = x_rot * cos + rotated * sin
    return out if rotary_dim == x.shape[-1] else jnp.concatenate([out, x_pass], axis=-1)
