"""Rotary position embedding parameters: what a checkpoint's config asks for, and the
inverse frequencies it gives.

Where it sits: a family's config reads `RopeConfig.from_hf` once at load; the decoder's
`layers.rope_cos_sin` turns each step's positions into cos/sin tables with `inv_freq` and
`attention_factor`. The engine's arguments (jax-free) read `exact_context_length` from the
same config. The promise is transformers' numbers: inverse frequencies in float32 by HF's
formulas, cos/sin scaled by the type's attention factor (YaRN, LongRoPE) as HF's rotary
modules scale them.

Supported types: default, linear, llama3, yarn, dynamic, longrope; and a GGUF's
`freq_factors` (llama.cpp's rope_freqs: each inverse frequency's divisor). Two of them
change their frequencies with the sequence's length in transformers, so jengine serves
them only as far as the frequencies stay fixed (`exact_context_length`): "dynamic" (NTK)
is the default rotation up to max_position_embeddings; "longrope" (Phi-3 128k, Phi-3.5,
Phi-4 mini) uses its short factors up to original_max_position_embeddings, and past it
transformers recomputes the sequence's whole cache with its long factors, which a paged
cache whose blocks are shared between requests does not do.
"""

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters as HF writes them (`rope_parameters` or the older
    `rope_theta` + `rope_scaling`)."""

    head_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn, longrope
    partial_rotary_factor: float = 1.0
    freq_factors: tuple[float, ...] | None = None
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: whole dimensions bound its ramp
    short_factor: tuple[float, ...] | None = None  # longrope, within its original length
    # cos and sin are multiplied by it (YaRN's and LongRoPE's attention scaling).
    attention_factor: float = 1.0

    SUPPORTED = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")

    def __post_init__(self) -> None:
        half = self.rotary_dim // 2
        for name in ("freq_factors", "short_factor"):
            values = getattr(self, name)
            if values is not None and len(values) != half:
                raise ValueError(
                    f"rope {name} has {len(values)} values; the rotary dimension "
                    f"{self.rotary_dim} takes {half}"
                )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, hf_config: dict, head_dim: int) -> "RopeConfig":
        params = rope_parameters(hf_config)
        theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
        rope_type = rope_type_of(params)
        if rope_type not in cls.SUPPORTED:
            raise ValueError(
                f"rope type {rope_type!r} is not supported (supported: {', '.join(cls.SUPPORTED)})"
            )
        if rope_type == "longrope" and not params.get("short_factor"):
            raise ValueError("rope type 'longrope' needs its short_factor list")
        original = _original_length(hf_config, params)
        factor = params.get("factor")
        max_positions = hf_config.get("max_position_embeddings")
        if factor is None and rope_type in ("yarn", "longrope") and max_positions:
            factor = max_positions / original  # DeepSeek's and Phi-3's configs leave it out
        factor = 1.0 if factor is None else float(factor)
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            attention_factor = _default_attention_factor(rope_type, factor, params, original)
        return cls(
            head_dim=head_dim,
            theta=float(theta),
            rope_type=rope_type,
            factor=factor,
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(original),
            partial_rotary_factor=float(
                params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
            ),
            freq_factors=tuple(params["freq_factors"]) if params.get("freq_factors") else None,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)),
            short_factor=tuple(map(float, params["short_factor"]))
            if rope_type == "longrope"
            else None,
            attention_factor=float(attention_factor),
        )

    def inv_freq(self) -> np.ndarray:
        """[rotary_dim / 2] inverse frequencies, as HF's rope init functions compute them."""
        dim = self.rotary_dim
        exponents = np.arange(0, dim, 2, dtype=np.float32) / dim
        if self.rope_type == "longrope":
            return 1.0 / (np.asarray(self.short_factor, np.float32) * self.theta**exponents)
        inv_freq = 1.0 / (self.theta**exponents)
        if self.freq_factors is not None:
            inv_freq = inv_freq / np.asarray(self.freq_factors, np.float32)
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "llama3":
            return self._llama3(inv_freq)
        if self.rope_type == "yarn":
            return self._yarn()
        return inv_freq  # default; dynamic within max_position_embeddings

    def _llama3(self, inv_freq: np.ndarray) -> np.ndarray:
        low_freq_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_freq_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return np.where(is_medium, smoothed, scaled)

    def _yarn(self) -> np.ndarray:
        """YaRN: the frequencies that turn fewer than beta_slow times over the original
        length are interpolated (divided by factor), those that turn more than beta_fast
        times are kept, and a linear ramp over dimensions blends the ones between."""
        dim = self.rotary_dim

        def correction_dim(rotations: float) -> float:
            turns = self.original_max_position_embeddings / (rotations * 2 * math.pi)
            return dim * math.log(turns) / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as HF: no division by zero
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extrapolation_weight = 1 - ramp
        pos_freqs = self.theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
        extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)
        return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight


def rope_parameters(hf_config: dict) -> dict:
    """The rope parameters of an HF config, whichever way it writes them (transformers 5's
    `rope_parameters` over the older `rope_scaling`)."""
    return {**(hf_config.get("rope_scaling") or {}), **(hf_config.get("rope_parameters") or {})}


def exact_context_length(hf_config: dict) -> tuple[int, str] | None:
    """The longest sequence whose rotation equals transformers' and why it stops there, or
    None for any length: rope types whose frequencies change with the sequence's length
    are served only where they do not (the module docstring)."""
    params = rope_parameters(hf_config)
    rope_type = rope_type_of(params)
    if rope_type == "dynamic" and "max_position_embeddings" in hf_config:
        length = int(hf_config["max_position_embeddings"])
        why = "past it transformers raises the base with each sequence's length"
    elif rope_type == "longrope":
        length = _original_length(hf_config, params)
        why = (
            "past it transformers recomputes a sequence's whole cache with the long factors, "
            "which jengine's shared KV blocks do not"
        )
    else:
        return None
    return length, f"its {rope_type!r} rope is exact up to {length} tokens ({why})"


def rope_type_of(params: dict) -> str:
    """The rope type `rope_parameters` names (either key; "su" is longrope's older name)."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    return "longrope" if rope_type == "su" else rope_type  # older Phi-3 128k files' name


def _original_length(hf_config: dict, params: dict) -> int:
    """The pretraining context a scaled rope starts from, by transformers' rule: a
    top-level original_max_position_embeddings (Phi-3's) wins over the rope parameters',
    which default to max_position_embeddings."""
    if "original_max_position_embeddings" in hf_config:
        return int(hf_config["original_max_position_embeddings"])
    default = hf_config.get("max_position_embeddings", 8192)
    return int(params.get("original_max_position_embeddings", default))


def _default_attention_factor(rope_type: str, factor: float, params: dict, original: int) -> float:
    """The cos/sin scale transformers infers when the config gives no attention_factor."""
    if rope_type == "yarn":
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        return _yarn_mscale(factor)
    if rope_type == "longrope" and factor > 1.0:
        return math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
