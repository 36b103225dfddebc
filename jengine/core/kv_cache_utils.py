"""Content hashes of full KV blocks (the keys of the prefix cache).

Where it sits: the KV cache manager hashes each request's full blocks of tokens; the block
pool maps hash -> cached block. Two requests share a block exactly when their hashes match.

What it promises: ``hash_block_tokens(parent, tokens, extra_keys)`` is a chained hash, so a
block's hash identifies the *whole* prefix up to and including it, not just its own tokens
(the same 16 tokens after different prefixes have different K/V). It is sha256-based and
seed-free: the same tokens give the same hash in every process and every run, which keeps
prefix caching deterministic and would let hashes be shared between processes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

import msgspec

BlockHash = int

# The parent of a request's first block. A fixed constant (not random): determinism across
# runs matters more here than resistance to adversarial collisions, which sha256 over the
# full chain already makes impractical.
ROOT_BLOCK_HASH: BlockHash = int.from_bytes(hashlib.sha256(b"jengine/root").digest()[:16], "little")


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> BlockHash:
    """Hash of (parent hash, this block's token ids, extra keys), truncated to 128 bits.

    extra_keys carries anything besides token ids that changes the block's K/V (a LoRA id,
    a multimodal input hash, a cache salt); it must be msgpack-encodable.
    """
    if parent_hash is None:
        parent_hash = ROOT_BLOCK_HASH
    h = hashlib.sha256(parent_hash.to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra_keys is not None:
        h.update(msgspec.msgpack.encode(extra_keys))
    return int.from_bytes(h.digest()[:16], "little")


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple | None = None,
) -> list[BlockHash]:
    """Append the hashes of full blocks of ``token_ids`` not hashed yet; return the new ones.

    Incremental: a decoding request completes a block every ``block_size`` steps, and only
    that block is hashed, chained onto the last known hash.
    """
    start = len(block_hashes)
    num_full = len(token_ids) // block_size
    parent = block_hashes[-1] if block_hashes else None
    new: list[BlockHash] = []
    for i in range(start, num_full):
        parent = hash_block_tokens(
            parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys
        )
        new.append(parent)
    block_hashes.extend(new)
    return new


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
