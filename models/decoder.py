"""The decoder-only transformer every supported family runs on, in Flax nnx: one layer
stack whose knobs (norm style, activation, sandwich norms, soft-capping, per-layer sliding
windows and rope, q/k norm, embedding scale) a family's config sets.

Where it sits: a family file (`models/llama.py`, `phi3.py`, `gemma.py`, `mixtral.py`,
`qwen_moe.py`) turns an HF `config.json` into a `DecoderConfig` subclass and names its
tensors; `models/loader.py` builds the family's model (a `DecoderForCausalLM`); the runner
splits it once (`nnx.split`) and jits a pure step over its state. One call runs one ragged
batch (`input_ids[T]`, `positions[T]`) over the paged KV cache and returns the hidden
states and the updated cache; `compute_logits` turns chosen rows into logits;
`input_grams` runs a batch to measure each linear weight's inputs (`models/calibration.py`).

Promises:
- layer weights are stacked on a leading `layers` axis and the layers run under one
  `lax.scan` with the whole KV cache in the carry, so compile time does not grow with depth
  and the cache is updated in place (docs/architecture.md, "One step, end to end"); linear
  weights are [L, out, in] as HF stores them, read by layer index (`stacked_matmul`), not
  sliced out as the scan's `xs`; what differs per layer (a sliding window, its rope) rides
  in the scan's `xs` as values, so the step stays one compiled body;
- parameter names are the family-independent ones below (`LINEAR_WEIGHTS`, the norms),
  which sharding, quantization and weight updates key on;
- numerics follow Hugging Face transformers for the same checkpoint (tests/models);
- each token writes its K/V into its slot and attends to its own request's pages only.

Axis letters: T tokens, D model dim, N q heads, K kv heads, H head dim, F MLP dim, V vocab.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jengine.models.attention_metadata import AttentionMetadata
from jengine.models.decoder_config import (  # noqa: F401 (re-exported for the families)
    HF_LAYER_NAMES,
    HF_TOP_NAMES,
    LINEAR_WEIGHTS,
    MOE_WEIGHTS,
    DecoderConfig,
    sizes_from_hf,
    sliding_windows_from_hf,
)
from jengine.models.layers import apply_rope, float32_matmuls, gated_mlp, rms_norm, rope_cos_sin
from jengine.models.lora import lora_delta
from jengine.models.lora import param_names as lora_param_names
from jengine.models.lora import projection_sizes as lora_projection_sizes
from jengine.models.moe import moe_mlp, sharded_moe_mlp
from jengine.models.quantized_linear import (
    QuantizedLinear,
    embedding_rows,
    leading_axis,
    matmul,
    matmuls,
    param_value,
)
from jengine.pallas_kernels import ragged_paged_attention, update_kv_cache


class DecoderLayers(nnx.Module):
    """All decoder layers' weights, stacked on a leading axis of size L; linear weights are
    [out, in], as HF stores them (`stacked_matmul` reads a layer's rows in place)."""

    def __init__(self, config: DecoderConfig, *, dtype, rngs: nnx.Rngs):
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

        unit = 0.0 if c.norm_plus_one else 1.0  # a norm weight that scales by 1
        self.input_layernorm = filled(unit, D)
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
            self.q_norm, self.k_norm = filled(unit, c.head_dim), filled(unit, c.head_dim)
        self.post_attention_layernorm = filled(unit, D)
        if c.sandwich_norms:
            self.attn_output_norm, self.mlp_output_norm = filled(unit, D), filled(unit, D)
        if c.num_experts:
            E, M = c.num_experts, c.moe_intermediate_size
            self.router = nnx.Param(init(rngs.params(), (L, E, D), dtype))
            self.expert_gate = nnx.Param(init(rngs.params(), (L, E, M, D), dtype))
            self.expert_up = nnx.Param(init(rngs.params(), (L, E, M, D), dtype))
            self.expert_down = nnx.Param(init(rngs.params(), (L, E, D, M), dtype))
            if c.shared_expert_intermediate_size:
                S = c.shared_expert_intermediate_size
                self.shared_gate_proj = nnx.Param(init(rngs.params(), (L, S, D), dtype))
                self.shared_up_proj = nnx.Param(init(rngs.params(), (L, S, D), dtype))
                self.shared_down_proj = nnx.Param(init(rngs.params(), (L, D, S), dtype))
                self.shared_expert_gate = nnx.Param(init(rngs.params(), (L, 1, D), dtype))
        else:
            self.gate_proj, self.up_proj, self.down_proj = (
                weight(F, D, name="gate_proj"),
                weight(F, D, name="up_proj"),
                weight(D, F, name="down_proj"),
            )
        if c.lora_slots:
            if c.num_experts and set(c.lora_targets) & {"gate_proj", "up_proj", "down_proj"}:
                raise ValueError("LoRA on a mixture of experts' MLP is not supported")
            sizes = lora_projection_sizes(c)
            slots, rank = c.lora_slots, c.lora_rank  # slot 0 (no adapter) is not stored
            for target in c.lora_targets:
                out, inputs = sizes[target]
                a_name, b_name = lora_param_names(target)
                setattr(self, a_name, nnx.Param(jnp.zeros((L, slots, rank, inputs), dtype)))
                setattr(self, b_name, nnx.Param(jnp.zeros((L, slots, out, rank), dtype)))
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
        in_place = (*LINEAR_WEIGHTS, *MOE_WEIGHTS)
        linear = {
            name: param_value(getattr(self, name)) for name in in_place if hasattr(self, name)
        }
        rest = {
            name: value.value
            for name, value in vars(self).items()
            if isinstance(value, nnx.Param) and name not in in_place
        }
        return linear, rest


class DecoderForCausalLM(nnx.Module):
    def __init__(self, config: DecoderConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
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
        self.layers = DecoderLayers(config, dtype=dtype, rngs=rngs)
        self.norm = nnx.Param(jnp.full((c.hidden_size,), 0.0 if c.norm_plus_one else 1.0, dtype))
        if not c.tie_word_embeddings:
            self.lm_head = table("lm_head")

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """[L, 2, K, num_blocks, block_size, H], the layout the attention kernels read."""
        c = self.config
        return (c.num_hidden_layers, 2, c.num_key_value_heads, num_blocks, block_size, c.head_dim)

    @float32_matmuls
    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        kv_cache: jax.Array,
        metadata: AttentionMetadata,
        *,
        attention_impl: str | None = None,
        mesh: Mesh | None = None,
        lora_slots: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """One ragged batch through all layers. Returns (hidden [T, D], updated kv_cache).
        With a `mesh` (tensor parallel), attention runs per device under `shard_map`.
        `lora_slots` [T]: each token's LoRA adapter slot (0 or None: none)."""
        hidden, kv_cache, _ = self._run_layers(
            input_ids,
            positions,
            kv_cache,
            metadata,
            attention_impl=attention_impl,
            mesh=mesh,
            lora_slots=lora_slots,
        )
        return hidden, kv_cache

    @float32_matmuls
    def input_grams(
        self, input_ids: jax.Array, positions: jax.Array, kv_cache: jax.Array, metadata
    ) -> dict[str, jax.Array]:
        """One batch through all layers; returns, for each linear weight of the layers,
        the Gram matrix of its inputs, sum over tokens of x x^T in float32, [L, in, in]
        (what GPTQ's rounding weighs errors by: `models/gptq.py`). Padding tokens count."""
        return self._run_layers(input_ids, positions, kv_cache, metadata, input_grams=True)[2]

    def _run_layers(
        self,
        input_ids,
        positions,
        kv_cache,
        metadata,
        *,
        attention_impl=None,
        mesh=None,
        lora_slots=None,
        input_grams: bool = False,
    ):
        """(hidden, kv_cache, {weight name: [L, in, in] Gram matrix} or None)."""
        c = self.config
        T = input_ids.shape[0]
        N, K, H = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        hidden = embedding_rows(param_value(self.embed_tokens), input_ids, self.dtype)
        if c.embedding_multiplier is not None:  # in the hidden dtype, as HF rounds it
            hidden = hidden * jnp.asarray(c.embedding_multiplier, hidden.dtype)
        cos, sin = rope_cos_sin(c.rope, positions)
        if c.local_rope is not None:
            local_cos, local_sin = rope_cos_sin(c.local_rope, positions)
        tables = (
            metadata.slot_mapping,
            metadata.kv_lens,
            metadata.block_tables,
            metadata.query_start_loc,
        )
        # One window for every layer stays static; layers with their own (Gemma's local
        # and global) pass each layer's through the scan (0: none).
        per_layer_windows = c.local_layers is not None and c.sliding_window is not None

        def attend(q, k, v, cache, layer_index, window, slot_mapping, kv_lens, tables_, starts):
            """Write this layer's K/V, then attend: (attn [T, N, H], cache)."""
            cache = update_kv_cache(cache, layer_index, k, v, slot_mapping)
            attn = ragged_paged_attention(
                q,
                cache,
                layer_index,
                kv_lens,
                tables_,
                starts,
                sm_scale=c.sm_scale,
                q_block_size=metadata.q_block_size,
                sliding_window=window if per_layer_windows else c.sliding_window,
                soft_cap=c.attn_soft_cap,
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
                in_specs=(heads, heads, heads, cache_spec, P(), P(), P(), P(), P(), P()),
                out_specs=(heads, cache_spec),
                check_vma=False,
            )

        weights, vectors = self.layers.stacked()
        # XLA cannot partition the CPU kernel's custom call over a mesh.
        matmul_impl = "reference" if mesh is not None else None

        def norm(x, weight):
            return rms_norm(x, weight, c.rms_norm_eps, plus_one=c.norm_plus_one)

        def layer(carry, xs):
            h, cache = carry
            p, layer_index, is_local = xs
            grams = {}  # filled only when asked: the scan's per-layer outputs

            def with_lora(name: str, x, out):
                if name not in c.lora_targets or lora_slots is None:
                    return out
                a_name, b_name = lora_param_names(name)
                return out + lora_delta(x, p[a_name], p[b_name], lora_slots)

            def linears(*names: str):
                """x -> the projections `names` of x: one kernel call for all of them where
                it can, plus each one's LoRA delta."""

                def project(x):
                    if input_grams:
                        x32 = x.astype(jnp.float32)
                        grams.update(dict.fromkeys(names, x32.T @ x32))
                    outs = matmuls(x, [weights[n] for n in names], layer_index, impl=matmul_impl)
                    return tuple(with_lora(n, x, out) for n, out in zip(names, outs, strict=True))

                return project

            def linear(name: str):
                return lambda x: linears(name)(x)[0]

            x = norm(h, p["input_layernorm"])
            q, k, v = linears("q_proj", "k_proj", "v_proj")(x)
            if c.qkv_bias:
                q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
            q, k, v = q.reshape(T, N, H), k.reshape(T, K, H), v.reshape(T, K, H)
            if c.qk_norm:
                q, k = norm(q, p["q_norm"]), norm(k, p["k_norm"])
            layer_cos, layer_sin = cos, sin
            if c.local_rope is not None:
                layer_cos = jnp.where(is_local, local_cos, cos)
                layer_sin = jnp.where(is_local, local_sin, sin)
            q, k = apply_rope(q, layer_cos, layer_sin), apply_rope(k, layer_cos, layer_sin)
            window = jnp.where(is_local, c.sliding_window or 0, 0).astype(jnp.int32)
            attn, cache = attend(q, k, v, cache, layer_index, window, *tables)
            out = linear("o_proj")(attn.reshape(T, N * H))
            if c.o_bias:
                out = out + p["o_bias"]
            if c.sandwich_norms:
                out = norm(out, p["attn_output_norm"])
            h = h + out
            x = norm(h, p["post_attention_layernorm"])
            if c.num_experts:
                moe = {name: weights[name] for name in MOE_WEIGHTS if name in weights}
                if mesh is None:
                    out = moe_mlp(x, moe, c, layer_index)
                else:
                    out = sharded_moe_mlp(x, moe, c, layer_index, mesh)
            else:
                biases = (p["gate_bias"], p["up_bias"], p["down_bias"]) if c.mlp_bias else None
                gate_up = linears("gate_proj", "up_proj")
                out = gated_mlp(x, gate_up, linear("down_proj"), biases, activation=c.hidden_act)
            if c.sandwich_norms:
                out = norm(out, p["mlp_output_norm"])
            h = h + out
            return (h, cache), grams or None

        layer_ids = jnp.arange(c.num_hidden_layers, dtype=jnp.int32)
        local = c.local_layers or (c.sliding_window is not None,) * c.num_hidden_layers
        local = jnp.asarray(local)
        xs = (vectors, layer_ids, local)
        (hidden, kv_cache), grams = jax.lax.scan(layer, (hidden, kv_cache), xs)
        return norm(hidden, self.norm.value), kv_cache, grams

    @float32_matmuls
    def compute_logits(self, hidden: jax.Array, *, mesh: Mesh | None = None) -> jax.Array:
        """[R, D] final hidden states -> [R, V] f32 logits (computed in the model dtype, as HF;
        a padded vocabulary's rows cut off). `mesh`: the head is split over it."""
        head = self.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        # The head as a one-layer stack: read in place by the CPU kernels (up to their rows).
        impl = "reference" if mesh is not None else None
        logits = matmul(hidden, leading_axis(param_value(head)), 0, impl=impl)
        if self.config.final_soft_cap is not None:  # in the model dtype, as HF
            cap = self.config.final_soft_cap
            logits = jnp.tanh(logits / cap) * cap
        logits = logits.astype(jnp.float32)
        return logits[:, : self.config.vocab_size] if self.config.vocab_padding else logits
