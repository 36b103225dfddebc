"""On-device sampling and logprobs: pure functions traced into the jitted step.

Where it sits: `model_runner.py` calls `sample` on the logits of the last token of every
request and `top_logprobs` for logprobs; only the sampled ids and requested logprobs go
back to the host.

Promises:
- greedy (temperature 0) is argmax after logit bias, penalties and min_tokens masking;
- random sampling uses a key derived only from the request's seed and how many tokens it
  has generated, so the same seed and params give the same tokens whatever else shares
  the batch (and after preemption);
- vLLM's semantics and order: logit bias, min_tokens (EOS and stop ids masked), penalties
  (repetition over prompt + output, presence / frequency over output), temperature,
  min-p, top-k, top-p (`truncation.py`);
- logprobs are the model's raw log-softmax (vLLM's default `raw_logprobs`), with the
  sampled token's rank;
- work a batch does not ask for (penalties, truncation, random draws) is skipped with
  `branches.branch`, so on CPU and TPU a greedy batch pays for an argmax only (on GPUs
  every branch runs: a conditional there makes the host wait for the device).

Per-request state that outlives a step (output token counts, prompt-token mask, dense
logit bias) sits on device in `SamplingState`, one row per persistent batch slot.
"""

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jengine.core.kv_cache_utils import cdiv
from jengine.runner.branches import branch
from jengine.runner.truncation import truncate
from jengine.sampling_params import GREEDY_TEMPERATURE_EPS


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingState:
    """Per-slot history the penalties and logit bias need ([S, V] each), and each slot's
    last sampled token ([S]: the next step's input under async scheduling)."""

    output_counts: jax.Array  # int32: how often each token was generated
    prompt_mask: jax.Array  # bool: token occurs in the prompt
    logit_bias: jax.Array  # float32: dense bias (zero where none)
    last_token: jax.Array  # int32

    @classmethod
    def zeros(cls, num_slots: int, vocab_size: int) -> "SamplingState":
        return cls(
            jnp.zeros((num_slots, vocab_size), jnp.int32),
            jnp.zeros((num_slots, vocab_size), jnp.bool_),
            jnp.zeros((num_slots, vocab_size), jnp.float32),
            jnp.zeros((num_slots,), jnp.int32),
        )


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingMetadata:
    """Per-request sampling parameters of one step, [R] each unless noted."""

    slots: jax.Array  # int32: row of the request in SamplingState
    temperature: jax.Array  # float32; below GREEDY_TEMPERATURE_EPS means greedy
    top_k: jax.Array  # int32; 0 = off
    top_p: jax.Array  # float32; 1 = off
    min_p: jax.Array  # float32; 0 = off
    seeds: jax.Array  # uint32: the request's seed (drawn by the engine if not given)
    output_index: jax.Array  # int32: tokens the request generated before this one
    presence_penalty: jax.Array  # float32
    frequency_penalty: jax.Array  # float32
    repetition_penalty: jax.Array  # float32
    use_history: jax.Array  # bool: penalties or logit bias read this request's slot
    suppressed_ids: jax.Array  # [R, MAX_SUPPRESSED_IDS] int32, -1 = none
    sample_mask: jax.Array  # bool: this step yields a token (False mid-prefill, padding)


def argmax(x: jax.Array, block: int = 128) -> jax.Array:
    """[rows, V] -> [rows] int32 first index of each row's maximum, as `jnp.argmax`.

    XLA:CPU lowers `jnp.argmax` to a (value, index) reduction that does not vectorize
    (~4.8 ms for [64, 32000] on the 2-core CPU). Here a plain max picks the first block of
    `block` columns holding the maximum and the index reduction runs on that block only
    (~0.3 ms); the first block with the maximum holds its first occurrence, so ties
    resolve as in `jnp.argmax`.
    """
    rows, vocab = x.shape
    num_blocks = cdiv(vocab, block)
    x = jnp.pad(x, ((0, 0), (0, num_blocks * block - vocab)), constant_values=-jnp.inf)
    x = x.reshape(rows, num_blocks, block)
    best_block = jnp.argmax(jnp.max(x, axis=-1), axis=-1)  # [rows]
    values = jnp.take_along_axis(x, best_block[:, None, None], axis=1)[:, 0]  # [rows, block]
    return (best_block * block + jnp.argmax(values, axis=-1)).astype(jnp.int32)


def _apply_history(raw: jax.Array, meta: SamplingMetadata, state: SamplingState):
    counts = state.output_counts[meta.slots]
    prompt = state.prompt_mask[meta.slots]
    logits = raw + state.logit_bias[meta.slots]
    rep = meta.repetition_penalty[:, None]
    seen = prompt | (counts > 0)
    # vLLM / HF repetition penalty: divide positive logits, multiply negative ones.
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - meta.frequency_penalty[:, None] * counts
    logits = logits - meta.presence_penalty[:, None] * (counts > 0)
    # Slots of requests without penalties or bias hold stale history: leave them alone.
    return jnp.where(meta.use_history[:, None], logits, raw)


def _draw(logits: jax.Array, meta: SamplingMetadata, block: int = 128) -> jax.Array:
    """[R] a token of each row drawn from softmax(row), by one uniform number per row
    (from the request's seed and output index) found in the row's cumulative
    probabilities: the first token whose cumulative sum exceeds it.

    The Gumbel-max trick drew a number per vocabulary entry instead (~3.3 ms a row of
    49152 and 63 ms for [64, 32000] on the 2-core CPU, against ~0.5 and ~3.3 ms here). The
    cumulative sum goes in two levels, as `argmax`: over blocks of `block` columns, then
    inside the block the draw falls in. A token of probability 0 (masked) is never drawn:
    should rounding between the two levels land the draw on one, the row's argmax is taken.
    """

    def uniform(seed, index):
        key = jax.random.fold_in(jax.random.key(seed), index)
        return jax.random.uniform(key, (), jnp.float32)

    rows, vocab = logits.shape
    num_blocks = cdiv(vocab, block)
    weights = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))  # the largest is 1
    weights = jnp.pad(weights, ((0, 0), (0, num_blocks * block - vocab)))
    weights = weights.reshape(rows, num_blocks, block)
    block_mass = jnp.sum(weights, axis=-1)  # [R, num_blocks]
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    target = jax.vmap(uniform)(meta.seeds, meta.output_index) * block_cdf[:, -1]  # [R]
    chosen = jnp.minimum(jnp.sum(block_cdf <= target[:, None], axis=-1), num_blocks - 1)
    before = jnp.take_along_axis(block_cdf - block_mass, chosen[:, None], axis=-1)  # [R, 1]
    inside = jnp.take_along_axis(weights, chosen[:, None, None], axis=1)[:, 0]  # [R, block]
    offset = jnp.sum(before + jnp.cumsum(inside, axis=-1) <= target[:, None], axis=-1)
    offset = jnp.minimum(offset, block - 1)
    drawn = chosen * block + offset
    drawn_weight = jnp.take_along_axis(inside, offset[:, None], axis=-1)[:, 0]
    return jnp.where(drawn_weight > 0, drawn, argmax(logits)).astype(jnp.int32)


def _sample_general(logits, meta: SamplingMetadata, state: SamplingState, select: bool):
    logits = branch(
        jnp.any(meta.use_history),
        _apply_history,
        lambda l, m, s: l,
        logits,
        meta,
        state,
        select=select,
    )
    rows = jnp.arange(logits.shape[0])[:, None]
    suppressed = jnp.where(meta.suppressed_ids >= 0, meta.suppressed_ids, logits.shape[-1])
    logits = logits.at[rows, suppressed].set(-jnp.inf, mode="drop")

    greedy = meta.temperature < GREEDY_TEMPERATURE_EPS
    greedy_ids = argmax(logits)

    def random_ids(logits):
        scaled = logits / jnp.where(greedy, 1.0, meta.temperature)[:, None]
        truncating = jnp.any((meta.top_k > 0) | (meta.top_p < 1.0) | (meta.min_p > 0.0))
        scaled = branch(
            truncating,
            partial(truncate, select=select),
            lambda l, m: l,
            scaled,
            meta,
            select=select,
        )
        return _draw(scaled, meta)

    all_greedy = jnp.all(greedy | ~meta.sample_mask)
    sampled_random = branch(all_greedy, lambda l: greedy_ids, random_ids, logits, select=select)
    return jnp.where(greedy, greedy_ids, sampled_random)


def sample(
    logits: jax.Array, meta: SamplingMetadata, state: SamplingState, *, select: bool
) -> tuple[jax.Array, SamplingState]:
    """[R, V] f32 logits -> ([R] int32 sampled ids, state with the new tokens counted and
    each sampling slot's last token set); `select` as `branches.branch`'s."""
    # A plain greedy batch (no history) is an argmax of the logits as they are; the general
    # path copies the [R, V] logits at least once (~2 ms at 64 rows, ~50 us at one). Ids
    # masked until min_tokens do not leave it: where a row's argmax is not one of them, it
    # is the argmax with them masked too (the first maximum stays first among fewer ids).
    plain_greedy = ~jnp.any(meta.use_history) & jnp.all(
        (meta.temperature < GREEDY_TEMPERATURE_EPS) | ~meta.sample_mask
    )
    unmasked = branch(
        plain_greedy,
        argmax,
        lambda l: jnp.full(l.shape[:1], -1, jnp.int32),
        logits,
        select=select,
    )
    hits_masked = jnp.any(unmasked[:, None] == meta.suppressed_ids, axis=-1) & meta.sample_mask
    sampled = branch(
        plain_greedy & ~jnp.any(hits_masked),
        lambda l, m, s: unmasked,
        partial(_sample_general, select=select),
        logits,
        meta,
        state,
        select=select,
    ).astype(jnp.int32)

    # Count the new token for penalties; rows that yield nothing write out of range.
    count_rows = jnp.where(meta.sample_mask, meta.slots, state.output_counts.shape[0])
    counts = state.output_counts.at[count_rows, sampled].add(1, mode="drop")
    last_token = state.last_token.at[count_rows].set(sampled, mode="drop")
    return sampled, SamplingState(counts, state.prompt_mask, state.logit_bias, last_token)


def top_logprobs(
    logits: jax.Array, token_ids: jax.Array, num_logprobs: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Raw logprobs of `token_ids` plus the top `num_logprobs` of each row.

    Returns ids [rows, k+1] (column 0 = the given token), logprobs [rows, k+1] and the
    1-based rank of the given token in its row.
    """
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    top_values, top_ids = jax.lax.top_k(logprobs, num_logprobs)
    chosen = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)
    ranks = jnp.sum(logprobs > chosen, axis=-1) + 1
    ids = jnp.concatenate([token_ids[:, None], top_ids], axis=-1).astype(jnp.int32)
    values = jnp.concatenate([chosen, top_values], axis=-1)
    return ids, values, ranks.astype(jnp.int32)


def slot_history_args(length: int, request=None, tokens=()) -> tuple:
    """`write_slot_history`'s arguments after the state, -1 padded to `length`, for
    `request` (the input batch's `CachedRequestState`; None: warmup's call) whose prompt +
    outputs are `tokens`."""
    slot, num_prompt_tokens, logit_bias = 0, 0, None
    if request is not None:
        slot, num_prompt_tokens = request.slot, request.num_prompt_tokens
        logit_bias = request.sampling_params.logit_bias
    prompt = np.full(length, -1, np.int32)
    output = np.full(length, -1, np.int32)
    bias_ids = np.full(length, -1, np.int32)
    bias_values = np.zeros(length, np.float32)
    prompt[:num_prompt_tokens] = tokens[:num_prompt_tokens]
    generated = tokens[num_prompt_tokens:]
    output[: len(generated)] = generated
    bias = list((logit_bias or {}).items())[:length]
    bias_ids[: len(bias)] = [int(token) for token, _ in bias]
    bias_values[: len(bias)] = [value for _, value in bias]
    return np.int32(slot), prompt, output, bias_ids, bias_values


def write_slot_history(
    state: SamplingState,
    slot: jax.Array,
    prompt_ids: jax.Array,
    output_ids: jax.Array,
    bias_ids: jax.Array,
    bias_values: jax.Array,
) -> SamplingState:
    """Reset one slot's history for a request that (re)enters the batch.

    Ids are padded with -1 to fixed lengths so one compiled function serves every request.
    """
    vocab = state.output_counts.shape[1]

    def valid(ids):
        return jnp.where(ids >= 0, ids, vocab)  # out of range: dropped

    counts = jnp.zeros((vocab,), jnp.int32).at[valid(output_ids)].add(1, mode="drop")
    prompt = jnp.zeros((vocab,), jnp.bool_).at[valid(prompt_ids)].set(True, mode="drop")
    bias = jnp.zeros((vocab,), jnp.float32).at[valid(bias_ids)].set(bias_values, mode="drop")
    return SamplingState(
        state.output_counts.at[slot].set(counts),
        state.prompt_mask.at[slot].set(prompt),
        state.logit_bias.at[slot].set(bias),
        state.last_token,
    )


def fold_seed(seed: int) -> int:
    """A request's seed as the sampler's uint32: a seed below 2**32 is itself, and the high
    half of a larger (or negative) 64-bit one is mixed in, so that such seeds stay apart."""
    seed &= (1 << 64) - 1
    return (seed ^ (seed >> 32) * 0x9E3779B1) & 0xFFFFFFFF
