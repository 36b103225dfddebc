"""How a quantized weight lies on the device: the layout every quantized matmul reads.

Where it sits: the loader (`models/quantize.py`) packs a weight into this layout once at
load, the model's `QuantizedLinear` holds its arrays as parameters, and
`quantized_matmul` (the XLA reference, the CPU kernel) reads it as it is, one layer at a
time. Tensor parallelism shards `values`, `scales` and `mins` along the same axis.

A weight [..., F, D] (F outputs, D inputs; a leading layer axis where stacked) is cut
along D into groups of `group_size` inputs (None: one group per output row, "per
channel"); within group g of row f:

    w[f, i] = scales[f, g] * q[f, i] + mins[f, g]        (mins: 0 where absent)

- `int8`: q is `values[f, i]`, int8, [..., F, D];
- `fp8`: q is `values[f, i]`, float8 e4m3 (OCP's e4m3fn: no infinities), [..., F, D];
- `uint4`: q in 0..15, two to a byte, `values` uint8 [..., F, D / 2]; each run of 32
  inputs is 16 bytes in GGUF's own order: byte j holds input j in its low nibble and input
  j + 16 in its high one (a GGUF block's quants, copied as they are); groups are whole
  runs (32 inputs, 128, or the row);
- `scales` and `mins` are [..., F, G] of the format's `scale_dtype`: float16 where a
  format's own scales are (GGUF's legacy blocks: Q4_0's d and -8 * d, Q4_1's d and m, are
  float16 exactly; 2 bytes a group less for a decode step to read), float32 otherwise (the
  K-quants' products of super-block and sub-block scales, scales computed at load). Either
  way the parts of a weight that do not depend on q are folded into them, so the matmuls
  know no zero points, and they widen to float32 exactly before any arithmetic.

Formats: `--quantization int8` (groups of 32) and `fp8` (per channel); GGUF's Q4_0 (mins
-8 d), Q4_1 and Q4_K as uint4 in groups of 32; Q8_0, Q5_0, Q5_1 and Q5_K as int8 in groups
of 32; Q6_K as int8 in groups of 16 (`models/quantize.GGUF_KEPT`); compressed-tensors
checkpoints' int4 as uint4, other int widths as int8, fp8 as fp8, in their own groups
(`models/compressed_tensors.py`).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("int8", "uint4", "fp8")
SCALE_DTYPES = ("float32", "float16")
UINT4_RUN = 32  # inputs whose 4-bit values interleave in 16 bytes (a GGUF block)


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """What a weight's arrays mean (static: part of the model's config, never traced)."""

    name: str  # what logs and errors call it: "int8", "Q8_0", "Q4_0", "Q4_1"
    kind: str  # "int8" | "uint4"
    group_size: int | None  # inputs per scale; None: the whole row (per channel)
    has_mins: bool = False
    scale_dtype: str = "float32"  # of scales and mins: "float32" | "float16"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"quantized kind {self.kind!r}: expected one of {KINDS}")
        if self.kind == "uint4" and (self.group_size or UINT4_RUN) % UINT4_RUN:
            raise ValueError(f"{self.name}: uint4 groups are multiples of {UINT4_RUN} inputs")
        if self.group_size is not None and self.group_size % 16:
            raise ValueError(f"{self.name}: groups are multiples of 16 inputs")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(
                f"{self.name}: scale dtype {self.scale_dtype!r}: expected one of {SCALE_DTYPES}"
            )

    def groups(self, dim: int) -> int:
        """Scales per row of `dim` inputs."""
        size = self.group_size or dim
        if dim % size or (self.kind == "uint4" and dim % UINT4_RUN):
            raise ValueError(f"{self.name}: rows of {dim} inputs are not whole groups of {size}")
        return dim // size

    def shapes(self, rows: tuple[int, ...], dim: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """Each array's shape and dtype for a weight [*rows, dim]."""
        stored, dtype = {
            "uint4": (dim // 2, "uint8"),
            "int8": (dim, "int8"),
            "fp8": (dim, "float8_e4m3fn"),
        }[self.kind]
        shapes = {
            "values": ((*rows, stored), dtype),
            "scales": ((*rows, self.groups(dim)), self.scale_dtype),
        }
        if self.has_mins:
            shapes["mins"] = shapes["scales"]
        return shapes

    def bytes_per_weight(self, dim: int) -> float:
        """Resident bytes per weight in rows of `dim` inputs."""
        shapes = self.shapes((1,), dim).values()
        return sum(np.prod(shape) * jnp.dtype(dtype).itemsize for shape, dtype in shapes) / dim


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
        mins = None if self.mins is None else fn(self.mins)
        return QuantizedWeight(fn(self.values), fn(self.scales), mins, self.format)


def dequantize(weight: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """The float weight [..., F, D] (float32 arithmetic, then `dtype`)."""
    values = weight.values
    if weight.format.kind == "uint4":
        # [..., D / 32, 16] bytes -> [..., D / 32, 2, 16]: low nibbles first, then high
        # ones (one elementwise shift XLA fuses into the dot's operand; a concatenate of
        # the two halves it does not, and XLA:CPU then runs 3x slower).
        runs = values.reshape(*values.shape[:-1], -1, 1, UINT4_RUN // 2)
        shifts = jnp.array([0, 4], jnp.uint8).reshape(2, 1)
        values = (runs >> shifts) & 0x0F
    q = values.reshape(*weight.scales.shape, -1)
    w = q.astype(jnp.float32) * weight.scales[..., None].astype(jnp.float32)
    if weight.mins is not None:
        w = w + weight.mins[..., None].astype(jnp.float32)
    return w.reshape(weight.shape).astype(dtype)
