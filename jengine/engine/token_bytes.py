"""The bytes a vocabulary piece stands for, read from the piece itself.

Where it sits: token_table.py builds llguidance's table from it where the tokenizer's
decoder cannot be read; the API server's logprob_format.py gives OpenAI's `bytes` of a
logprob entry from it where the token's text cannot carry them (a character split over
tokens decodes to U+FFFD). Jax-free.

Promises: a byte-fallback piece (`<0x0A>`, Llama 2's and Mistral's) is its byte; a piece
written in the GPT-2 byte alphabet (a byte-level vocabulary's, `Ġ` for a space) is the bytes
it spells; for anything else the piece says nothing (None): its decoded text is its bytes.
"""

import re

BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def byte_decoder() -> dict[str, int]:
    """The GPT-2 byte alphabet (a ByteLevel pre-tokenizer's) back to bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def piece_bytes(piece: str, alphabet: dict[str, int] | None) -> bytes | None:
    """The bytes `piece` stands for: a byte-fallback piece's byte, or with `alphabet` (a
    byte-level vocabulary's `byte_decoder()`) the bytes its characters spell; else None."""
    fallback = BYTE_FALLBACK.match(piece)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    if alphabet is not None and piece and all(char in alphabet for char in piece):
        return bytes(alphabet[char] for char in piece)
    return None
