"""min-p, top-k and top-p: which tokens a random draw may take, traced into the jitted step.

Where it sits: `sampler.py` calls `truncate` on the temperature-scaled logits of the rows
that sample at random, before the draw; masked tokens become -inf.

Promises, as vLLM: min-p keeps tokens of probability at least min_p times the largest;
top-k keeps the k largest logits, ties with the k-th included; top-p keeps the smallest
set of largest logits whose probabilities (renormalized over what top-k kept) reach top_p,
ties with its smallest included, and always the largest.

How, without sorting a vocabulary (XLA:CPU's sort of [1, 32000] takes ~12 ms, of
[64, 32000] ~0.6 s on the 2-core CPU): the thresholds are read from each row's
TRUNCATION_CANDIDATES largest logits (`lax.top_k`: ~0.5 ms, ~21 ms). A batch where some
row's kept set may reach past them (a top_k above them, or a nucleus wider than them, as
a flat distribution's is) finds that threshold by bisection instead, in 32 passes over
the rows (top_p 0.9 over flat rows: ~1.2 ms at [1, 32000], ~55-70 ms at [64, 32000]).
The two searches cost ~1 s of compile in each sampling program (~2.2 -> ~3.5 s at
[1, 32000]; a serve warmup of 48 step shapes, 140 -> 154 s).
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jengine.runner.branches import branch

TRUNCATION_CANDIDATES = 256
_SIGN = np.uint32(0x80000000)  # the float sign bit


def truncate(
    logits: jax.Array, meta, num_candidates: int = TRUNCATION_CANDIDATES, *, select: bool
) -> jax.Array:
    """[R, V] temperature-scaled logits with what min-p, top-k and top-p drop set to -inf
    (`meta`: the sampler's `SamplingMetadata`, [R] top_k, top_p, min_p; `select`: as
    `branches.branch`'s)."""
    vocab = logits.shape[-1]
    probs = jax.nn.softmax(logits, axis=-1)
    logits = jnp.where(probs < meta.min_p[:, None] * probs.max(-1, keepdims=True), -jnp.inf, logits)
    num_candidates = min(num_candidates, vocab)
    # Read only through gathers: a slice of them too makes XLA:CPU sort the whole row.
    candidates = jax.lax.top_k(logits, num_candidates)[0]  # descending
    kth = branch(
        jnp.any(meta.top_k > num_candidates),
        partial(_kth_by_bisection, unroll=select),
        lambda logits, top_k: _kth_of_largest(candidates, top_k),
        logits,
        meta.top_k,
        select=select,
    )
    # Probabilities once top-k has cut the row at kth: over every logit it keeps, ties too.
    log_normalizer = jax.nn.logsumexp(jnp.where(logits >= kth, logits, -jnp.inf), -1, keepdims=True)
    probs = jnp.where(candidates >= kth, jnp.exp(candidates - log_normalizer), 0.0)
    # The candidates hold a row's nucleus unless it may reach past them: more tokens
    # survive top-k than there are candidates, and theirs fall short of top_p.
    survivors = jnp.sum(logits >= kth, axis=-1)
    short = jnp.sum(probs, axis=-1) < meta.top_p
    undecided = (meta.top_p < 1.0) & (survivors > num_candidates) & short
    nucleus = branch(
        jnp.any(undecided),
        partial(_nucleus_by_bisection, unroll=select),
        lambda logits, kth, log_normalizer, top_p: _nucleus(candidates, probs, top_p),
        logits,
        kth,
        log_normalizer,
        meta.top_p,
        select=select,
    )
    return jnp.where(logits < jnp.maximum(nucleus, kth), -jnp.inf, logits)


def _kth_of_largest(largest: jax.Array, top_k: jax.Array) -> jax.Array:
    """[R, 1] the top_k-th of each row's largest logits in descending order (as many as
    its top_k), -inf where top_k is off."""
    k = jnp.clip(top_k, 1, largest.shape[-1])
    kth = jnp.take_along_axis(largest, (k - 1)[:, None], axis=-1)
    return jnp.where(top_k[:, None] > 0, kth, -jnp.inf)


def _nucleus(largest: jax.Array, probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """[R, 1] the smallest logit top-p keeps, from each row's largest logits in descending
    order (enough to hold every kept one) and their probabilities; -inf where top_p is 1."""
    exclusive_cumsum = jnp.cumsum(probs, axis=-1) - probs
    keep = exclusive_cumsum < top_p[:, None]  # the first token is always kept
    nucleus = jnp.min(jnp.where(keep, largest, jnp.inf), axis=-1, keepdims=True)
    # top_p 1 keeps everything (rounding must not let the cumsum drop the tail).
    return jnp.where(top_p[:, None] < 1.0, nucleus, -jnp.inf)


def _kth_by_bisection(logits: jax.Array, top_k: jax.Array, unroll: bool) -> jax.Array:
    """[R, 1] as `_kth_of_largest` for any top_k: the least value with fewer than top_k
    logits above it."""
    k = jnp.clip(top_k, 1, logits.shape[-1])[:, None].astype(jnp.float32)
    kth = _least_value_with_less_above(logits, 1.0, k, unroll)
    return jnp.where(top_k[:, None] > 0, kth, -jnp.inf)


def _nucleus_by_bisection(logits, kth, log_normalizer, top_p, unroll: bool) -> jax.Array:
    """[R, 1] as `_nucleus` over the whole row: the least value with less than top_p of
    the probability (top-k cut at `kth`, `log_normalizer` the kept logits') above it."""
    probs = jnp.where(logits >= kth, jnp.exp(logits - log_normalizer), 0.0)
    nucleus = _least_value_with_less_above(logits, probs, top_p[:, None], unroll)
    return jnp.where(top_p[:, None] < 1.0, nucleus, -jnp.inf)


def _least_value_with_less_above(logits, weights, limit, unroll: bool) -> jax.Array:
    """[R, 1] the least value v (a logit of the row, or -inf) whose logits above it weigh
    less than `limit` (> 0) in total, by halving the range of float32 values from -inf to
    the row's largest in the order of `_order_key`: the weight above v only falls as v
    rises, and 32 halvings cover any uint32 range.

    A loop on CPU and TPU; `unroll`ed on GPUs (where `branches.selects`), which launch
    each turn of a loop from the host (`tests/runner/test_gpu_programs.py`). Unrolled,
    XLA:CPU took ~2x as long to compile the sampling programs, which warmup compiles one
    per step shape.
    """

    def halve(_, bounds):
        low, high = bounds  # the weight above low's value is at least limit, high's less
        middle = high - (high - low) // 2  # high once they meet: its answer is known
        value = _from_order_key(middle)
        less = jnp.sum(jnp.where(logits > value, weights, 0.0), -1, keepdims=True) < limit
        return jnp.where(less, low, middle), jnp.where(less, middle, high)

    largest = jnp.max(logits, axis=-1, keepdims=True)
    bounds = (_order_key(jnp.full_like(largest, -jnp.inf)) - 1, _order_key(largest))
    if unroll:
        for turn in range(32):
            bounds = halve(turn, bounds)
    else:
        bounds = jax.lax.fori_loop(0, 32, halve, bounds)
    return _from_order_key(bounds[1])


def _order_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 in the same order (-inf lowest; -0.0 just below +0.0)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >= _SIGN, ~bits, bits | _SIGN)


def _from_order_key(key: jax.Array) -> jax.Array:
    """uint32 -> float32: the inverse of `_order_key`."""
    bits = jnp.where(key >= _SIGN, key & ~_SIGN, ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)
