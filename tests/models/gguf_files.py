"""Write small GGUF files for the tests with the `gguf` package's writer, the way
llama.cpp's converter lays out a Llama, Qwen2, Qwen3, Gemma 2 or Gemma 3: its tensor names,
q/k rows permuted for its rotary embedding (llama only), Gemma's norm weights plus one,
norms in F32, 2-D weights in the type asked for, Gemma's window and soft-caps in the
metadata."""

import json
import os

import gguf
import numpy as np
from safetensors.numpy import load_file

# HF name (after "model.layers.N.") -> llama.cpp name (after "blk.N.")
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# What the other architectures add or name differently.
_MORE_NAMES = {
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_GEMMA_NAMES = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# HF model_type -> llama.cpp's architecture name
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
}


def permute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter on a q or k weight (what the loader must undo)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_tensors(folder: str) -> dict[str, np.ndarray]:
    """The HF folder's tensors under llama.cpp's names, q/k permuted for llama, Gemma's
    norms plus one (float32)."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    arch = GGUF_ARCH[config.get("model_type", "llama")]
    names = {**_LAYER_NAMES, **_MORE_NAMES, **(_GEMMA_NAMES if "gemma" in arch else {})}
    heads = {}
    if arch == "llama":
        heads = {
            "attn_q.weight": config["num_attention_heads"],
            "attn_k.weight": config.get("num_key_value_heads") or config["num_attention_heads"],
        }
    tensors = {}
    for name, array in load_file(os.path.join(folder, "model.safetensors")).items():
        array = array.astype(np.float32)
        if "gemma" in arch and name.endswith("norm.weight"):
            array = array + 1  # llama.cpp's converter: its RMSNorm multiplies by the weight
        if name in _TOP_NAMES:
            if name == "lm_head.weight" and config.get("tie_word_embeddings"):
                continue
            tensors[_TOP_NAMES[name]] = array
            continue
        _, _, layer, suffix = name.split(".", 3)
        ours = names[suffix]
        if ours in heads:
            array = permute_rotary(array, heads[ours])
        tensors[f"blk.{layer}.{ours}"] = array
    return tensors


# K-quant type -> the byte offsets of its float16 super-block scales (d, and dmin where it
# has mins) and the value they get in random blocks: weights of ~0.1 at most.
K_QUANT_SCALES = {"Q4_K": ((0, 2), 1e-4), "Q5_K": ((0, 2), 5e-5), "Q6_K": ((208,), 2e-5)}


def random_k_blocks(tensor_type: str, shape: tuple[int, ...], rng) -> np.ndarray:
    """Random blocks of a K-quant type for a [rows, D] weight (D a multiple of 256): random
    quants and sub-block scales, small super-block scales. Random weights, not the
    folder's: the tests compare the file kept quantized with the same file dequantized."""
    qtype = gguf.GGMLQuantizationType[tensor_type]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, dim = shape
    blocks = rng.integers(0, 256, (rows, dim // block_size, type_size), dtype=np.uint8)
    offsets, value = K_QUANT_SCALES[tensor_type]
    for offset in offsets:
        blocks[..., offset : offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def write_llama_gguf(
    folder: str,
    path: str,
    tensor_type: str = "F32",
    *,
    arch: str | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    tensor_types: dict[str, str] | None = None,
) -> str:
    """Convert the HF `folder` to a GGUF at `path` (no tokenizer metadata), its matrices in
    `tensor_type` or, by name, `tensor_types`; `arch` (default: the folder's) names the
    architecture in the file."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    arch = arch or GGUF_ARCH[config.get("model_type", "llama")]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config["num_hidden_layers"])
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if "gemma" in arch:
        writer.add_sliding_window(config["sliding_window"])
        if config.get("layer_types"):
            local = [kind == "sliding_attention" for kind in config["layer_types"]]
            writer.add_sliding_window_pattern(local)
        if config.get("attn_logit_softcapping"):
            writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers'
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "llama3":
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        freqs = llama3_rope_freqs(rope, head_dim, rope.get("rope_theta", 10000.0))
        extra_tensors = {"rope_freqs.weight": freqs, **(extra_tensors or {})}
    writer.add_vocab_size(config["vocab_size"])
    rng = np.random.default_rng(0)
    for name, array in {**gguf_tensors(folder), **(extra_tensors or {})}.items():
        type_name = (tensor_types or {}).get(name, tensor_type)
        qtype = gguf.GGMLQuantizationType[type_name]
        if array.ndim == 1 or type_name == "F32":
            writer.add_tensor(name, array)
        elif type_name in K_QUANT_SCALES:  # the gguf package cannot quantize to these
            writer.add_tensor(name, random_k_blocks(type_name, array.shape, rng), raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama3_rope_freqs(rope: dict, head_dim: int, theta: float) -> np.ndarray:
    """What llama.cpp's converter writes for Llama 3's rope scaling: each inverse
    frequency's divisor (its own formula, written out apart from the engine's)."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    divisors = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < old_context / high:
            divisors.append(1.0)
        elif wavelen > old_context / low:
            divisors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(divisors, np.float32)
