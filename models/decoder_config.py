"""What a decoder is, as data: `DecoderConfig` (the sizes and the knobs families differ
by), the family-independent parameter names, and the HF tensor names most families share.

Where it sits: family files (`models/llama.py`, `gemma.py`, ...) subclass the config and
read HF `config.json` into it; `models/decoder.py` builds and runs the model it
describes; the loader and the sharding code key on the names here.
"""

from dataclasses import dataclass
from typing import ClassVar

from jengine.models.rope_config import RopeConfig
from jengine.pallas_kernels.quantized_matmul import QuantFormat

LINEAR_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# An MoE layer's weights in place of gate/up/down (models/moe.py), read by layer index too.
MOE_WEIGHTS = (
    "router",
    "expert_gate",
    "expert_up",
    "expert_down",
    "shared_gate_proj",
    "shared_up_proj",
    "shared_down_proj",
    "shared_expert_gate",
)

# HF per-layer tensor name -> our stacked name: the Llama family's names, which most
# families share. Our `post_attention_layernorm` is the norm before the MLP (Llama's);
# a family with norms around each block's output as well (Gemma's "sandwich") names them
# `attn_output_norm` and `mlp_output_norm`.
HF_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm",
    "post_attention_layernorm.weight": "post_attention_layernorm",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.o_proj.bias": "o_bias",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
    "mlp.gate_proj.bias": "gate_bias",
    "mlp.up_proj.bias": "up_bias",
    "mlp.down_proj.bias": "down_bias",
}
HF_TOP_NAMES = {
    "model.embed_tokens.weight": "embed_tokens",
    "model.norm.weight": "norm",
    "lm_head.weight": "lm_head",
}


@dataclass(frozen=True)
class DecoderConfig:
    """The architecture: sizes and the knobs families differ by. A family's subclass reads
    it from an HF `config.json` (`from_hf`) and names its tensors (`hf_layer_names`)."""

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
    qk_norm: bool = False  # Qwen3, Gemma 3
    # Keys a token sees: the last `sliding_window` positions, in every layer or, with
    # `local_layers`, in the layers it flags (Gemma's local layers; the rest are global).
    sliding_window: int | None = None
    local_layers: tuple[bool, ...] | None = None
    local_rope: RopeConfig | None = None  # Gemma 3: the windowed layers' own rope
    hidden_act: str = "silu"  # the gated MLP's: "silu" or "gelu_tanh"
    norm_plus_one: bool = False  # Gemma: RMSNorm scales by (1 + w), in float32
    sandwich_norms: bool = False  # Gemma: norms on the attention's and MLP's outputs too
    embedding_multiplier: float | None = None  # Gemma: embeddings times sqrt(D)
    query_pre_attn_scalar: float | None = None  # Gemma: sm_scale = scalar ** -0.5
    attn_soft_cap: float | None = None  # Gemma 2: cap * tanh(score / cap)
    final_soft_cap: float | None = None  # Gemma 2: the same on the logits
    # Mixture of experts (models/moe.py): 0 experts is a dense MLP in every layer.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights (Mixtral: yes)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0: none
    expert_parallel: bool = False  # under a mesh: experts whole, spread over its devices
    # LoRA (models/lora.py): adapter slots (slot 0: none) of one rank on these projections.
    lora_slots: int = 0
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    # Zero rows past `vocab_size` in the embedding and LM head (tensor parallelism pads the
    # vocabulary to a multiple of its size); their logits are cut off, never sampled.
    vocab_padding: int = 0
    # Weights held quantized: (parameter name, format) pairs, e.g. ("q_proj", Q4_1);
    # the loader sets them (models/quantize.py).
    quantization: tuple[tuple[str, QuantFormat], ...] = ()

    hf_layer_names: ClassVar[dict[str, str]] = HF_LAYER_NAMES
    hf_top_names: ClassVar[dict[str, str]] = HF_TOP_NAMES
    # HF's per-expert tensors, "<expert prefix>.<e>.<name>.weight" -> our stacked
    # [L, E, ...] weight (the MoE families set them).
    hf_expert_prefix: ClassVar[str] = "mlp.experts"
    hf_expert_names: ClassVar[dict[str, str]] = {}
    # Checkpoint tensors that hold several of our weights (Phi-3's qkv_proj, gate_up_proj):
    # the name `hf_layer_names` gives the fused tensor -> the weights it splits into along
    # its rows, in order (the loader splits them once; the step never sees them fused).
    fused_weights: ClassVar[dict[str, tuple[str, ...]]] = {}

    def quant_format(self, name: str) -> QuantFormat | None:
        return dict(self.quantization).get(name)

    @property
    def padded_vocab_size(self) -> int:
        return self.vocab_size + self.vocab_padding

    def split_sizes(self, fused: str) -> tuple[int, ...]:
        """Rows of each weight a fused tensor holds (`fused_weights`)."""
        q_size = self.num_attention_heads * self.head_dim
        kv_size = self.num_key_value_heads * self.head_dim
        rows = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
        rows |= {"gate_proj": self.intermediate_size, "up_proj": self.intermediate_size}
        return tuple(rows[name] for name in self.fused_weights[fused])

    @property
    def sm_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf(cls, hf: dict) -> "DecoderConfig":
        raise NotImplementedError(f"{cls.__name__} is not read from a config.json")


def sizes_from_hf(hf: dict) -> dict:
    """The config fields every family reads alike from an HF config.json: the sizes (the
    head dim: `head_dim`, else hidden size / heads) and the RMSNorm epsilon."""
    num_heads = hf["num_attention_heads"]
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    )


def sliding_windows_from_hf(hf: dict) -> tuple[int | None, tuple[bool, ...] | None]:
    """(sliding_window, local_layers) from an HF config: `layer_types` names the layers
    with a window ("sliding_attention"); without it, Qwen2/3's `use_sliding_window` puts
    one on the layers from `max_window_layers` on, and otherwise `sliding_window` applies
    to every layer (Mistral). One window in every layer comes back without flags."""
    window = hf.get("sliding_window")
    if not window:
        return None, None
    num_layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types:
        local = tuple(t == "sliding_attention" for t in types)
    elif hf.get("use_sliding_window"):
        first = hf.get("max_window_layers", 0)
        local = tuple(i >= first for i in range(num_layers))
    else:
        local = (True,) * num_layers
    if len(local) != num_layers:
        raise ValueError(f"layer_types names {len(local)} layers, the model has {num_layers}")
    if not any(local):
        return None, None
    return int(window), None if all(local) else local
