"""How a quantized weight lies on the device: the layout every quantized matmul reads.

Where it sits: the loader (`models/quantize.py`) packs a weight into a `QuantizedWeight`
once at load, the model's `QuantizedLinear` holds its arrays as parameters, and
`quantized_matmul` (the XLA reference, the CPU kernel) reads it as it is, one layer at a
time. Tensor parallelism shards `values`, `scales` and `mins` along the same axis.

A weight [..., F, D] (F outputs, D inputs; a leading layer axis where stacked) is cut
along D into groups of `group_size` inputs (`group_size == D`: one group per output row,
"per channel"); within group g of row f:

    w[f, i] = scales[f, g] * (q[f, i] - zero_point) + mins[f, g]    (mins: 0 where absent)

- `int8`: q is `values[f, i]`, int8, [..., F, D];
- `uint4`: q in 0..15, two to a byte, `values` uint8 [..., F, D / 2]; each group of 32
  inputs is 16 bytes in GGUF's own order: byte j holds input j in its low nibble and input
  j + 16 in its high one (a GGUF block's quants, copied as they are);
- `scales` and `mins` are [..., F, D / group_size], float16 (GGUF's block scales, kept as
  the file has them) or float32.

Formats: int8 per channel (`--quantization int8`), GGUF Q8_0 (int8, groups of 32, f16
scales), Q4_0 (uint4, zero point 8), Q4_1 (uint4 with f16 mins). With
`quantized_activations` the product is that of the dequantized weight with x rounded to
int8 per group of 32 (`quantize_activations`), as llama.cpp computes its block formats.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("int8", "uint4")
ACTIVATION_GROUP = 32  # inputs per scale of quantized activations (and of uint4 weights)


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """What a weight's arrays mean (static: part of the model's config, never traced)."""

    name: str  # what logs and errors call it: "int8", "Q8_0", "Q4_0", "Q4_1"
    kind: str  # "int8" | "uint4"
    group_size: int | None  # inputs per scale; None: the whole row (per channel)
    scale_dtype: str = "float32"  # "float32" | "float16"
    zero_point: int = 0
    has_mins: bool = False
    # True: x is quantized to int8 per group of 32 inputs before the product (llama.cpp's
    # numerics for its block formats; integer dot products on CPU); False: float x.
    quantized_activations: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"quantized kind {self.kind!r}: expected one of {KINDS}")
        if self.kind == "uint4" and self.group_size != ACTIVATION_GROUP:
            raise ValueError(f"uint4 weights come in groups of {ACTIVATION_GROUP} inputs")
        if self.quantized_activations and self.group_size != ACTIVATION_GROUP:
            raise ValueError(f"quantized activations need groups of {ACTIVATION_GROUP} inputs")

    def groups(self, dim: int) -> int:
        """Scales per row of `dim` inputs."""
        size = self.group_size or dim
        if dim % size:
            raise ValueError(f"{self.name}: rows of {dim} inputs are not whole groups of {size}")
        return dim // size

    def shapes(self, rows: tuple[int, ...], dim: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """Each array's shape and dtype for a weight [*rows, dim]."""
        stored = dim // 2 if self.kind == "uint4" else dim
        value_dtype = "uint8" if self.kind == "uint4" else "int8"
        shapes = {
            "values": ((*rows, stored), value_dtype),
            "scales": ((*rows, self.groups(dim)), self.scale_dtype),
        }
        if self.has_mins:
            shapes["mins"] = ((*rows, self.groups(dim)), self.scale_dtype)
        return shapes

    def bytes_per_weight(self, dim: int) -> float:
        """Resident bytes per weight in rows of `dim` inputs."""
        return (
            sum(
                np.prod(shape) * np.dtype(dtype).itemsize
                for shape, dtype in self.shapes((1,), dim).values()
            )
            / dim
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized weight's arrays and their format (a pytree; `format` is static)."""

    values: jax.Array
    scales: jax.Array
    mins: jax.Array | None
    format: QuantFormat = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape, [..., F, D]."""
        dim = self.values.shape[-1] * (2 if self.format.kind == "uint4" else 1)
        return (*self.values.shape[:-1], dim)

    def map(self, fn) -> "QuantizedWeight":
        """`fn` applied to each array (a row gather, a layer slice, a leading axis)."""
        return QuantizedWeight(
            fn(self.values),
            fn(self.scales),
            None if self.mins is None else fn(self.mins),
            self.format,
        )


def quantize_activations(x: jax.Array) -> jax.Array:
    """x [..., D] with each group of 32 inputs rounded to int8 steps of its own scale,
    max|x| / 127 (as float: what the CPU kernel's integer product computes, exactly)."""
    groups = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, ACTIVATION_GROUP)
    amax = jnp.max(jnp.abs(groups), axis=-1, keepdims=True)
    inverse = jnp.where(amax > 0, 127.0 / amax, 0.0)
    quantized = jnp.round(groups * inverse) * (amax / 127.0)
    return quantized.reshape(x.shape).astype(x.dtype)


def dequantize(weight: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """The float weight [..., F, D] (float32 arithmetic, then `dtype`)."""
    fmt = weight.format
    values = weight.values
    if fmt.kind == "uint4":
        # [..., D / 32, 16] bytes -> [..., D / 32, 32]: low nibbles first, then high ones.
        blocks = values.reshape(*values.shape[:-1], -1, 16)
        q = jnp.concatenate([blocks & 0x0F, blocks >> 4], axis=-1)
    else:
        q = values.reshape(*values.shape[:-1], weight.scales.shape[-1], -1)
    q = q.astype(jnp.float32)
    if fmt.zero_point:
        q = q - fmt.zero_point
    w = q * weight.scales.astype(jnp.float32)[..., None]
    if weight.mins is not None:
        w = w + weight.mins.astype(jnp.float32)[..., None]
    return w.reshape(weight.shape).astype(dtype)
