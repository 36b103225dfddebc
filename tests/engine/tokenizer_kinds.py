"""Tokenizers of the kinds users bring, trained here on the tiny model's text and saved as
transformers saves them: byte-level BPE without a decoder, sentencepiece-style (Metaspace
with byte fallback, as Llama 2 and Mistral ship), and word-level. Each gets the tiny chat
template, so the same tests run on all of them and on the real ones (the bundled model's,
SmolLM2's)."""

import json
import os

from tests.entrypoints.tiny_model import CHAT_TEMPLATE, EOS, SPECIAL_TOKENS, training_text

UNK = "<unk>"


def byte_level_without_decoder():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer)
    assert tokenizer.decoder is None
    return tokenizer


def sentencepiece_style():
    """BPE over Metaspace ('▁' for spaces) with byte fallback: the 256 byte pieces
    (<0x00>..<0xFF>) are ordinary vocabulary, as in Llama 2's and Mistral's."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    def metaspace(tokenizer):
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tokenizer.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]  # fmt: skip
        )
        return tokenizer

    trained = metaspace(Tokenizer(models.BPE(unk_token=UNK)))
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=[UNK, *SPECIAL_TOKENS], show_progress=False
    )
    trained.train_from_iterator(training_text(), trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = metaspace(Tokenizer(models.BPE(vocab, merges, unk_token=UNK, byte_fallback=True)))
    tokenizer.add_special_tokens([UNK, *SPECIAL_TOKENS])
    return tokenizer


def word_level():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=[UNK, *SPECIAL_TOKENS], show_progress=False)
    tokenizer.train_from_iterator(training_text(), trainer)
    return tokenizer


KINDS = {
    "byte-level-no-decoder": byte_level_without_decoder,
    "sentencepiece-style": sentencepiece_style,
    "word-level": word_level,
}


def save_tokenizer(kind: str, path: str) -> str:
    """Train the `kind` tokenizer and save it in `path` as transformers does."""
    from transformers import PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    backend = KINDS[kind]()
    unk = UNK if backend.token_to_id(UNK) is not None else None
    PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS, unk_token=unk, chat_template=CHAT_TEMPLATE
    ).save_pretrained(path)
    return path
