"""The Llama family in Flax nnx: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm).

Where it sits: `models/loader.py` builds a `LlamaForCausalLM` from an HF folder; the runner
splits it once (`nnx.split`) and jits a pure step over its state. One call runs one ragged
batch (`input_ids[T]`, `positions[T]`) over the paged KV cache and returns the hidden
states and the updated cache; `compute_logits` turns chosen rows into logits.

Promises:
- layer weights are stacked on a leading `layers` axis and the layers run under one
  `lax.scan` with the whole KV cache in the carry, so compile time does not grow with depth
  and the cache is updated in place (docs/architecture.md, "One step, end to end"); linear
  weights are [L, out, in] as HF stores them, read by layer index (`stacked_matmul`), not
  sliced out as the scan's `xs`;
- numerics follow Hugging Face transformers for the same checkpoint (tests/models);
- each token writes its K/V into its slot and attends to its own request's pages only.

Axis letters: T tokens, D model dim, N q heads, K kv heads, H head dim, F MLP dim, V vocab.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jengine.models.attention_metadata import AttentionMetadata
from jengine.models.layers import RopeConfig, apply_rope, rms_norm, rope_cos_sin, silu_mlp
from jengine.models.quantized_linear import (
    QuantizedLinear,
    embedding_rows,
    leading_axis,
    matmul,
    param_value,
)
from jengine.pallas_kernels import ragged_paged_attention, update_kv_cache
from jengine.pallas_kernels.quantized_matmul import QuantFormat

LINEAR_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LlamaConfig:
    """The architecture, read from an HF `config.json` (see `from_hf`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2, or Llama with attention_bias
    o_bias: bool = False  # Llama / Qwen3 with attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3
    sliding_window: int | None = None
    # Zero rows past `vocab_size` in the embedding and LM head (tensor parallelism pads the
    # vocabulary to a multiple of its size); their logits are cut off, never sampled.
    vocab_padding: int = 0
    # Weights held quantized: (parameter name, format) pairs, e.g. ("q_proj", Q4_1);
    # the loader sets them (models/quantize.py).
    quantization: tuple[tuple[str, QuantFormat], ...] = ()

    def quant_format(self, name: str) -> QuantFormat | None:
        return dict(self.quantization).get(name)

    @property
    def padded_vocab_size(self) -> int:
        return self.vocab_size + self.vocab_padding

    @classmethod
    def from_hf(cls, hf: dict) -> "LlamaConfig":
        model_type = hf.get("model_type", "llama")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        attention_bias = bool(hf.get("attention_bias", False))
        sliding_window = None
        if model_type == "mistral":
            sliding_window = hf.get("sliding_window")
        elif model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
            raise ValueError(f"{model_type} with use_sliding_window=true is not supported")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(hf, head_dim),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or (model_type != "mistral" and attention_bias),
            o_bias=model_type in ("llama", "qwen3") and attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=sliding_window,
        )


class LlamaDecoderLayers(nnx.Module):
    """All decoder layers' weights, stacked on a leading axis of size L; linear weights are
    [out, in], as HF stores them (`stacked_matmul` reads a layer's rows in place)."""

    def __init__(self, config: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        L, D, F = c.num_hidden_layers, c.hidden_size, c.intermediate_size
        q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        init = nnx.initializers.normal(0.02)

        def weight(*shape, name: str):
            fmt = c.quant_format(name)
            if fmt is not None:
                return QuantizedLinear(fmt, (L, *shape[:-1]), shape[-1])
            return nnx.Param(init(rngs.params(), (L, *shape), dtype))

        def filled(value, *shape):
            return nnx.Param(jnp.full((L, *shape), value, dtype))

        self.input_layernorm = filled(1.0, D)
        self.q_proj, self.k_proj, self.v_proj = (
            weight(q_size, D, name="q_proj"),
            weight(kv_size, D, name="k_proj"),
            weight(kv_size, D, name="v_proj"),
        )
        self.o_proj = weight(D, q_size, name="o_proj")
        if c.qkv_bias:
            self.q_bias, self.k_bias, self.v_bias = (
                filled(0.0, q_size),
                filled(0.0, kv_size),
                filled(0.0, kv_size),
            )
        if c.o_bias:
            self.o_bias = filled(0.0, D)
        if c.qk_norm:
            self.q_norm, self.k_norm = filled(1.0, c.head_dim), filled(1.0, c.head_dim)
        self.post_attention_layernorm = filled(1.0, D)
        self.gate_proj, self.up_proj, self.down_proj = (
            weight(F, D, name="gate_proj"),
            weight(F, D, name="up_proj"),
            weight(D, F, name="down_proj"),
        )
        if c.mlp_bias:
            self.gate_bias, self.up_bias, self.down_bias = (
                filled(0.0, F),
                filled(0.0, F),
                filled(0.0, D),
            )

    def stacked(self) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
        """The weights as dicts of [L, ...] arrays: the linear weights (arrays or
        `QuantizedWeight`s), which the scan body reads in place by layer index, and the rest
        (norms, biases), the scan's `xs`."""
        linear = {name: param_value(getattr(self, name)) for name in LINEAR_WEIGHTS}
        rest = {
            name: value.value
            for name, value in vars(self).items()
            if isinstance(value, nnx.Param) and name not in LINEAR_WEIGHTS
        }
        return linear, rest


class LlamaForCausalLM(nnx.Module):
    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.config = config
        self.dtype = dtype
        c = config

        def table(name: str):
            """[V, D]: the embedding or the LM head."""
            fmt = c.quant_format(name)
            if fmt is not None:
                return QuantizedLinear(fmt, (c.padded_vocab_size,), c.hidden_size)
            init = nnx.initializers.normal(0.02)
            return nnx.Param(init(rngs.params(), (c.padded_vocab_size, c.hidden_size), dtype))

        self.embed_tokens = table("embed_tokens")
        self.layers = LlamaDecoderLayers(config, dtype=dtype, rngs=rngs)
        self.norm = nnx.Param(jnp.ones((c.hidden_size,), dtype))
        if not c.tie_word_embeddings:
            self.lm_head = table("lm_head")

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """[L, 2, K, num_blocks, block_size, H], the layout the attention kernels read."""
        c = self.config
        return (c.num_hidden_layers, 2, c.num_key_value_heads, num_blocks, block_size, c.head_dim)

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        kv_cache: jax.Array,
        metadata: AttentionMetadata,
        *,
        attention_impl: str | None = None,
        mesh: Mesh | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """One ragged batch through all layers. Returns (hidden [T, D], updated kv_cache).
        With a `mesh` (tensor parallel), attention runs per device under `shard_map`."""
        c = self.config
        T = input_ids.shape[0]
        N, K, H = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        hidden = embedding_rows(param_value(self.embed_tokens), input_ids, self.dtype)
        cos, sin = rope_cos_sin(c.rope, positions)
        tables = (
            metadata.slot_mapping,
            metadata.kv_lens,
            metadata.block_tables,
            metadata.query_start_loc,
        )

        def attend(q, k, v, cache, layer_index, slot_mapping, kv_lens, block_tables, starts):
            """Write this layer's K/V, then attend: (attn [T, N, H], cache)."""
            cache = update_kv_cache(cache, layer_index, k, v, slot_mapping)
            attn = ragged_paged_attention(
                q,
                cache,
                layer_index,
                kv_lens,
                block_tables,
                starts,
                sm_scale=H**-0.5,
                q_block_size=metadata.q_block_size,
                sliding_window=c.sliding_window,
                impl=attention_impl,
            )
            return attn, cache

        if mesh is not None:
            # Tensor parallel: heads and the cache's KV heads are split over the mesh axis;
            # each device attends with its own heads (XLA cannot partition a custom call).
            heads = P(None, mesh.axis_names[0], None)
            cache_spec = P(None, None, mesh.axis_names[0], None, None, None)
            attend = jax.shard_map(
                attend,
                mesh=mesh,
                in_specs=(heads, heads, heads, cache_spec, P(), P(), P(), P(), P()),
                out_specs=(heads, cache_spec),
                check_vma=False,
            )

        weights, vectors = self.layers.stacked()
        # XLA cannot partition the CPU kernel's custom call over a mesh.
        matmul_impl = "reference" if mesh is not None else None

        def layer(carry, xs):
            h, cache = carry
            p, layer_index = xs

            def linear(name: str):
                return lambda x: matmul(x, weights[name], layer_index, impl=matmul_impl)

            x = rms_norm(h, p["input_layernorm"], c.rms_norm_eps)
            q, k, v = linear("q_proj")(x), linear("k_proj")(x), linear("v_proj")(x)
            if c.qkv_bias:
                q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
            q, k, v = q.reshape(T, N, H), k.reshape(T, K, H), v.reshape(T, K, H)
            if c.qk_norm:
                q = rms_norm(q, p["q_norm"], c.rms_norm_eps)
                k = rms_norm(k, p["k_norm"], c.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            attn, cache = attend(q, k, v, cache, layer_index, *tables)
            out = linear("o_proj")(attn.reshape(T, N * H))
            if c.o_bias:
                out = out + p["o_bias"]
            h = h + out
            x = rms_norm(h, p["post_attention_layernorm"], c.rms_norm_eps)
            mlp_biases = (p["gate_bias"], p["up_bias"], p["down_bias"]) if c.mlp_bias else None
            mlp = (linear("gate_proj"), linear("up_proj"), linear("down_proj"))
            h = h + silu_mlp(x, *mlp, mlp_biases)
            return (h, cache), None

        layer_ids = jnp.arange(c.num_hidden_layers, dtype=jnp.int32)
        (hidden, kv_cache), _ = jax.lax.scan(layer, (hidden, kv_cache), (vectors, layer_ids))
        return rms_norm(hidden, self.norm.value, c.rms_norm_eps), kv_cache

    def compute_logits(self, hidden: jax.Array, *, mesh: Mesh | None = None) -> jax.Array:
        """[R, D] final hidden states -> [R, V] f32 logits (computed in the model dtype, as HF;
        a padded vocabulary's rows cut off). `mesh`: the head is split over it."""
        head = self.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        # The head as a one-layer stack: read in place by the CPU kernels for a few rows.
        impl = "reference" if mesh is not None else None
        logits = matmul(hidden, leading_axis(param_value(head)), 0, impl=impl)
        logits = logits.astype(jnp.float32)
        return logits[:, : self.config.vocab_size] if self.config.vocab_padding else logits
