"""The front end's tokenizer: the HF tokenizer of the model (folder or GGUF) and its EOS ids.

Where it sits: `LLM`, `LLMEngine` and `AsyncLLM` load it once at start-up; the input
processor tokenizes prompts with it and the output processor detokenizes outputs. Runs in
the front-end process (jax-free): only tokenizer files are read, never weights.
"""

import json
import os

from transformers import AutoTokenizer

from jengine.config import EngineConfig
from jengine.models.checkpoint import gguf_file
from jengine.models.gguf_reader import read_gguf

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(config: EngineConfig):
    """The HF tokenizer of the model folder, or None when it ships none (token ids only)."""
    return load_tokenizer_from(config.model.tokenizer or config.model.model)


def load_tokenizer_from(path: str | None):
    """The HF tokenizer in `path` (a folder, or a GGUF's tokenizer as transformers builds it
    from the file's metadata), or None when there is none there."""
    if path is None:
        return None
    gguf_path = gguf_file(path)
    if gguf_path is not None:
        if "tokenizer.ggml.model" not in read_gguf(gguf_path).metadata:
            return None
        folder, name = os.path.split(os.path.abspath(gguf_path))
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if os.path.isdir(path) and not any(
        os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES
    ):
        return None
    return AutoTokenizer.from_pretrained(path)


def eos_token_ids_of(path: str | None, tokenizer) -> list[int]:
    """EOS ids as HF generate sees them: generation_config.json, then config.json, then the
    tokenizer. Several ids (Llama 3, the bundled model's `<|end|>`) all end generation."""
    for name in ("generation_config.json", "config.json"):
        file = os.path.join(path, name) if path else None
        if file and os.path.isfile(file):
            with open(file) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                return eos if isinstance(eos, list) else [eos]
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return [tokenizer.eos_token_id]
    return []
