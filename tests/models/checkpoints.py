"""Tiny random-weight HF checkpoints of every supported family, written with save_pretrained.

Weights are drawn wider than HF's init (norm scales around 1, biases non-zero) so that a
mismatch in any tensor shows in the logits.
"""

import torch
import transformers

VOCAB = 256

BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

FAMILIES = {
    "llama2": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(num_key_value_heads=4),
    ),
    "llama3": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(num_key_value_heads=1, sliding_window=None),
    ),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(tie_word_embeddings=True),
    ),
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(head_dim=32, num_attention_heads=8, num_key_value_heads=2),
    ),
    # Qwen3 with `use_sliding_window`: a window on the layers from max_window_layers on.
    "qwen3-window": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
    ),
    # Fused qkv and gate_up tensors, a sliding window in every layer, partial rotary.
    "phi3": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(
            sliding_window=7,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # Mixtures of experts: top-2 of 4 (Mixtral renormalises; Qwen3 with norm_topk_prob;
    # Qwen2 without, and with its shared expert).
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96),
    ),
    "qwen3-moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
        ),
    ),
    "qwen2-moe": (
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=80,
            norm_topk_prob=False,
        ),
    ),
    # Local layers with a window shorter than the tests' prompts, soft-capping low enough
    # to bend the scores, query_pre_attn_scalar other than head_dim.
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        dict(
            head_dim=16,
            num_hidden_layers=4,
            sliding_window=6,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        ),
    ),
    # Five local layers to a global one (the pattern, cut to 4 layers: local, local,
    # global, local), each kind with its own rope (the global one linearly scaled). An
    # attention soft-cap in the config, which Gemma 3's attention never applies.
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            head_dim=32,
            attn_logit_softcapping=2.0,
            num_hidden_layers=4,
            sliding_window=5,
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
            },
        ),
    ),
}


def make_checkpoint(
    family: str,
    path: str,
    *,
    seed: int = 0,
    torch_dtype=torch.float32,
    config_overrides: dict | None = None,
    **save_kwargs,
):
    """Write a random `family` checkpoint to `path`; returns the HF model (float32, eval)."""
    config_cls, model_cls, overrides = FAMILIES[family]
    config = config_cls(**{**BASE, **overrides, **(config_overrides or {})})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
            else:
                param.copy_(0.08 * torch.randn_like(param))
    model.to(torch_dtype).save_pretrained(path, **save_kwargs)
    return model.float()


def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Logits [S, V] of one sequence, computed alone (the oracle)."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()
