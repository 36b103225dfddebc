"""The grammar library's view of a tokenizer: the bytes each token adds to the text.

Where it sits: the engine core's `StructuredOutputManager` builds one `LLTokenizer` (from
`llguidance_tokenizer`, through engine/tokenizer.py) when the first constrained request
arrives; llguidance then masks tokens by the bytes they add. Jax-free.

Promises: a table for every tokenizer transformers can load, and each token's bytes are
what the front end's detokenizer adds to the text for it, so the grammar constrains the
very text the client gets:
- where the tokenizer's own metadata says how tokens decode (a ByteLevel, Metaspace or
  byte-fallback decoder), llguidance reads it (its own tested conversion), except that
  added tokens the tokenizer does not call special are their text, as the detokenizer
  writes them;
- where it does not (no decoder: a word-level vocabulary; a decoder llguidance does not
  know), the table comes from the vocabulary itself: byte-fallback tokens (`<0x0A>`) are
  their byte, the GPT-2 byte alphabet (a byte-level vocabulary) is mapped back to bytes,
  anything else is what decoding it after an ordinary token adds (a word-level
  vocabulary's " word"), and special tokens are marked as llguidance wants (a 0xFF byte
  first) so no text can spell them. Ids the model has beyond the tokenizer are empty.
  Text cannot always be turned back into such tokens (a word-level vocabulary has no
  token for a lone " "), so llguidance is told not to force the text a grammar fixes
  into tokens of its own choosing: the model samples it, token by token, under the mask.
"""

from __future__ import annotations

import json
import logging

from llguidance import LLTokenizer, TokenizerWrapper

from jengine.engine.token_bytes import byte_decoder, piece_bytes

logger = logging.getLogger(__name__)

_SPECIAL_MARK = b"\xff"  # llguidance: a token that text never matches


def llguidance_tokenizer(hf_tokenizer, vocab_size: int) -> tuple[LLTokenizer, bool]:
    """llguidance's tokenizer over the model's whole vocabulary (`vocab_size` may exceed
    the tokenizer's: the extra ids are never allowed), and whether it turns any text into
    tokens that spell exactly that text (what llguidance needs to force text a grammar
    fixes; see the module docstring)."""
    from llguidance.hf import from_tokenizer

    try:
        converted = from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
    except (ValueError, RuntimeError) as e:  # llguidance cannot read the decoder
        logger.info("structured outputs: token bytes from the vocabulary itself (%s)", e)
        table = VocabularyTable(hf_tokenizer, vocab_size)
        return LLTokenizer(TokenizerWrapper(table), n_vocab=vocab_size), False
    plain_added = {
        token_id: token.content
        for token_id, token in hf_tokenizer.added_tokens_decoder.items()
        if not token.special and token_id < vocab_size
    }
    if not plain_added:
        return converted, True
    table = PlainAddedTokens(converted, hf_tokenizer, plain_added, vocab_size)
    return LLTokenizer(TokenizerWrapper(table), n_vocab=vocab_size), True


class PlainAddedTokens:
    """llguidance's own conversion, except that added tokens the tokenizer does not call
    special (Qwen's `<think>`, `<tool_call>`) are their text: llguidance marks every added
    token special, yet tokenizes text into them, so a grammar whose fixed text holds one
    forced a token it then refused. Text is still tokenized by the conversion."""

    def __init__(self, converted: LLTokenizer, hf_tokenizer, plain_added: dict, vocab_size: int):
        self.converted = converted
        self.eos_token_id = hf_tokenizer.eos_token_id
        self.bos_token_id = hf_tokenizer.bos_token_id
        self.tokens, self.special_token_ids = [], []
        for token_id in range(vocab_size):
            spelled = converted.decode_bytes([token_id])
            if token_id in plain_added:
                spelled = plain_added[token_id].encode()
            elif converted.is_special_token(token_id):
                spelled = _SPECIAL_MARK + spelled
                self.special_token_ids.append(token_id)
            self.tokens.append(spelled)

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text, not bytes")  # TokenizerWrapper probes which it takes
        return self.converted.tokenize_str(text)


class VocabularyTable:
    """What llguidance's `TokenizerWrapper` asks of a tokenizer, built from the vocabulary."""

    def __init__(self, hf_tokenizer, vocab_size: int):
        self.hf_tokenizer = hf_tokenizer
        self.eos_token_id = hf_tokenizer.eos_token_id
        self.bos_token_id = hf_tokenizer.bos_token_id
        backend = hf_tokenizer.backend_tokenizer
        added = backend.get_added_tokens_decoder()
        self.special_token_ids = [i for i, token in added.items() if token.special]
        pieces = backend.get_vocab(with_added_tokens=True)
        by_id = {i: piece for piece, i in pieces.items()}
        special = set(self.special_token_ids)
        ordinary = [i for i in sorted(by_id) if i not in special and i < vocab_size]
        byte_level = _is_byte_level(backend, [by_id[i] for i in ordinary])
        decoded = {} if byte_level else _decoded_after_anchor(backend, ordinary)
        alphabet = byte_decoder() if byte_level else None
        tokens = [b""] * vocab_size
        for token_id, piece in by_id.items():
            if token_id >= vocab_size:
                continue
            if token_id in special:
                tokens[token_id] = _SPECIAL_MARK + piece.encode()
                continue
            spelled = piece_bytes(piece, alphabet)
            if spelled is None:
                spelled = decoded.get(token_id, piece).encode()
            tokens[token_id] = spelled
        self.tokens = tokens

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text, not bytes")  # TokenizerWrapper probes which it takes
        return self.hf_tokenizer.encode(text, add_special_tokens=False)


def _is_byte_level(backend, pieces: list[str]) -> bool:
    """A ByteLevel pre-tokenizer or decoder, or a vocabulary written in its alphabet."""
    config = json.loads(backend.to_str())
    if "ByteLevel" in json.dumps([config.get("pre_tokenizer"), config.get("decoder")]):
        return True
    alphabet = byte_decoder()
    marked = sum(piece[:1] in ("\u0120", "\u010a") for piece in pieces)  # 'Ġ', 'Ċ'
    in_alphabet = sum(all(char in alphabet for char in piece) for piece in pieces)
    return marked > 0 and in_alphabet == len(pieces)


def _decoded_after_anchor(backend, token_ids: list[int]) -> dict[int, str]:
    """What each token adds to the decoded text after an ordinary token: decoders that join
    or strip (word-level's spaces, Metaspace's leading one) count as the detokenizer does."""
    anchor = next(
        (i for i in token_ids if backend.decode([i]).strip().isalnum()),
        token_ids[0] if token_ids else None,
    )
    if anchor is None:
        return {}
    base = backend.decode([anchor])
    pairs = backend.decode_batch([[anchor, i] for i in token_ids])
    return {
        token_id: text[len(base) :] if text.startswith(base) else backend.decode([token_id])
        for token_id, text in zip(token_ids, pairs, strict=True)
    }
