"""The front end's tokenizer: the HF tokenizer of the model (folder or GGUF) and its EOS ids.

Where it sits: `LLM`, `LLMEngine` and `AsyncLLM` load it once at start-up; the input
processor tokenizes prompts with it and the output processor detokenizes outputs. Runs in
the front-end process (jax-free): only tokenizer files are read, never weights. The
engine process needs a tokenizer only for its first constrained request, so transformers
(~1 s to import) is imported when a tokenizer is loaded, not with this module.
"""

import json
import logging
import os

from jengine.config import EngineConfig
from jengine.models.checkpoint import gguf_file
from jengine.models.gguf_reader import read_gguf

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_GGUF_STRING_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
_GGUF_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


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
        return gguf_tokenizer(gguf_path)
    if not os.path.isdir(path):  # transformers would read it as a hub id (none reachable)
        raise ValueError(f"tokenizer {path!r} is not a folder or a GGUF file")
    if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return with_byte_level_decoder(AutoTokenizer.from_pretrained(path))


def with_byte_level_decoder(tokenizer):
    """`tokenizer`, given the ByteLevel decoder if it has a ByteLevel pre-tokenizer and no
    decoder: saved so, it decodes to its byte alphabet with spaces between tokens
    ('hell o Ġwor ld'), and the ByteLevel decoder is the one inverse of that pre-tokenizer."""
    from tokenizers import decoders

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.decoder is not None:
        return tokenizer
    if _byte_level(backend):
        logger.warning("the tokenizer has a ByteLevel pre-tokenizer and no decoder; decoding it")
        backend.decoder = decoders.ByteLevel()
    return tokenizer


def _byte_level(backend) -> bool:
    """Whether a `tokenizers.Tokenizer` splits text into the GPT-2 byte alphabet."""
    return "ByteLevel" in json.dumps(json.loads(backend.to_str()).get("pre_tokenizer"))


def gguf_tokenizer(path: str):
    """The tokenizer transformers builds from a GGUF's metadata (its own converter, so the
    same vocabulary, merges, pre-tokenizer split, special tokens and chat template), fed by
    jengine's reader: transformers' GGUF reader needs torch, which a serving install lacks.
    None when the file carries no tokenizer."""
    from transformers import PreTrainedTokenizerFast

    try:  # transformers >= 5.18
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:  # before, the whole GGUF integration was one module
        from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    metadata = read_gguf(path, string_arrays=_GGUF_STRING_ARRAYS).metadata
    if "tokenizer.ggml.model" not in metadata:
        return None
    tokenizer_dict, tokenizer_config = (
        {
            name: metadata[f"tokenizer.{key}"]
            for key, name in renames.items()
            if f"tokenizer.{key}" in metadata
        }
        for renames in (
            GGUF_TOKENIZER_MAPPING["tokenizer"],
            GGUF_TOKENIZER_MAPPING["tokenizer_config"],
        )
    )
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # As transformers: older sentencepiece files have no flag and llama.cpp adds BOS.
        tokenizer_config.setdefault("add_bos_token", True)
    tokens = tokenizer_dict["tokens"]
    for name, key in _GGUF_SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokens[token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    if _byte_level(backend):
        # Before 5.18 transformers led a GPT-2 vocabulary's decoder with ByteFallback
        # (decoding the same), which llguidance reads as a vocabulary of literal pieces:
        # every grammar then failed at the first space ('Ġ').
        from tokenizers import decoders

        backend.decoder = decoders.ByteLevel()
    # The file's special tokens win: before 5.18 the converter's settings repeat them, and
    # for SmolLM2 named <|im_start|> (the BOS) as the EOS where the file says <|im_end|>.
    return PreTrainedTokenizerFast(tokenizer_object=backend, **{**extra, **tokenizer_config})


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


def grammar_tokenizer(config: EngineConfig, vocab_size: int):
    """llguidance's view of the model's tokenizer (token_table.py), over the model's whole
    (padded) vocabulary, and whether it tokenizes text exactly; built when the first
    constrained request arrives."""
    from jengine.engine.token_table import llguidance_tokenizer

    tokenizer = load_tokenizer(config)
    if tokenizer is None:
        raise ValueError("structured outputs need the model's tokenizer; none is configured")
    return llguidance_tokenizer(tokenizer, vocab_size)
