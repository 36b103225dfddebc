"""AttentionMetadata: where the ragged batch's tokens sit in the paged KV cache.

Where it sits: the runner builds it from its padded host batch (numpy) for every step and
passes it to the model beside `input_ids` and `positions`; the model hands it to every
layer's attention. It is a pytree so the whole step can be one jitted function; the
query-block size is static (part of the tree structure), so each value compiles once.

Axis letters: T tokens, R requests, P pages per request.
"""

from dataclasses import dataclass, field

import jax


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: jax.Array  # [T] int32: page * block_size + offset where each new K/V goes
    kv_lens: jax.Array  # [R] int32: context length per request after this step (0 = padding)
    block_tables: jax.Array  # [R, P] int32: page ids of each request
    query_start_loc: jax.Array  # [R + 1] int32: cumulative new-token counts
    # Tokens served by one gather of a request's pages: 1 for decode-only steps.
    q_block_size: int = field(default=16, metadata=dict(static=True))
