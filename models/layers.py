"""Building blocks of the decoder as pure functions: RMSNorm (with Gemma's 1 + w), rotary
embeddings, the gated MLP (SiLU or GELU-tanh).

Where it sits: `models/decoder.py` calls these inside its per-layer scan body. They promise
the numerics of Hugging Face transformers (PyTorch) for the same weights: RMSNorm and
rotary angles are computed in float32 and cast back, as HF does, so f32 logits agree to
~1e-5 and bf16 rounding happens at the same places.
"""

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

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


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters as HF writes them (`rope_parameters` or the older
    `rope_theta` + `rope_scaling`). Supported types: default, linear, llama3; and a GGUF's
    `freq_factors` (llama.cpp's rope_freqs: each inverse frequency's divisor)."""

    head_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0
    freq_factors: tuple[float, ...] | None = None

    SUPPORTED = ("default", "linear", "llama3")

    def __post_init__(self) -> None:
        dim = int(self.head_dim * self.partial_rotary_factor)
        if self.freq_factors is not None and len(self.freq_factors) != dim // 2:
            raise ValueError(
                f"rope freq_factors (a GGUF's rope_freqs) has {len(self.freq_factors)} values; "
                f"the rotary dimension {dim} takes {dim // 2}"
            )

    @classmethod
    def from_hf(cls, hf_config: dict, head_dim: int) -> "RopeConfig":
        params = dict(hf_config.get("rope_parameters") or {})
        legacy = hf_config.get("rope_scaling") or {}
        params = {**legacy, **params}
        theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in cls.SUPPORTED:
            raise ValueError(
                f"rope type {rope_type!r} is not supported (supported: {', '.join(cls.SUPPORTED)})"
            )
        return cls(
            head_dim=head_dim,
            theta=float(theta),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", 8192)
            ),
            partial_rotary_factor=float(
                params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
            ),
            freq_factors=tuple(params["freq_factors"]) if params.get("freq_factors") else None,
        )

    def inv_freq(self) -> jax.Array:
        """[rotary_dim / 2] inverse frequencies, as HF's rope init functions compute them."""
        dim = int(self.head_dim * self.partial_rotary_factor)
        inv_freq = 1.0 / (self.theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
        if self.freq_factors is not None:
            inv_freq = inv_freq / jnp.asarray(self.freq_factors, jnp.float32)
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "llama3":
            low_freq_wavelen = self.original_max_position_embeddings / self.low_freq_factor
            high_freq_wavelen = self.original_max_position_embeddings / self.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
            smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
            return jnp.where(is_medium, smoothed, scaled)
        return inv_freq


def rope_cos_sin(rope: RopeConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [T, rotary_dim] in f32 for the given positions (HF layout: halves)."""
    freqs = positions.astype(jnp.float32)[:, None] * rope.inv_freq()[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


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
