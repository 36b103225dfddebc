"""The device side of a step: weights, KV cache, the jitted step, warmup, KV sizing.

Where it sits: `EngineCore` owns one ModelRunner; each step it calls
`execute(SchedulerOutput) -> ModelRunnerOutput`. This is the only place that holds jax
arrays; the scheduler sees numbers and lists only.

Promises:
- the step is pure jitted functions over pytrees: the model `(params, kv_cache, inputs)
  -> (kv_cache, logits, hidden)` with the KV cache donated (updated in place), then
  sampling `(sampling_state, logits, ...) -> (sampling_state, ids, logprobs)` with the
  sampling state donated;
- `warmup()` compiles every shape in `BucketSpec.all_shapes()` (and the slot-history
  writer); afterwards serving compiles nothing, and `compiles_after_warmup` counts any
  compile that happens anyway (tests assert it stays 0);
- the KV capacity comes from a memory budget (`kv_cache_memory_bytes`, or a fraction of
  accelerator memory) and is reported as tokens and max concurrency;
- `update_weights(params)` swaps in new weights of the same shapes without recompiling.
"""

import logging
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jengine.core.outputs import LogprobsArrays, ModelRunnerOutput
from jengine.core.sched_output import SchedulerOutput
from jengine.runner.buckets import BucketSpec, StepShape
from jengine.runner.input_batch import (
    CachedRequestState,
    InputBatch,
    PreparedStep,
    neutral_sampling_arrays,
)
from jengine.runner.sampler import (
    SamplingMetadata,
    SamplingState,
    sample,
    top_logprobs,
    write_slot_history,
)
from models import AttentionMetadata
from pallas_kernels.ragged_paged_attention import resolve_impl

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
CPU_DEFAULT_KV_BYTES = 1 << 30
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ForwardInputs:
    input_ids: jax.Array  # [T]
    positions: jax.Array  # [T]
    attention: AttentionMetadata
    logits_indices: jax.Array  # [R]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SampleOutputs:
    sampled: jax.Array  # [R]
    logprob_ids: jax.Array  # [R, k+1]
    logprobs: jax.Array  # [R, k+1]
    ranks: jax.Array  # [R]


# The step is three jitted pure functions rather than one so that each compiles per the
# bucket axes it depends on: the model per (T, R, P, Bq), sampling per R, prompt logprobs
# per T. Warmup then compiles far fewer programs; a step pays two extra dispatches.


def _forward(graphdef, attention_impl, params, kv_cache, inputs: ForwardInputs):
    model = nnx.merge(graphdef, params)
    hidden, kv_cache = model(
        inputs.input_ids,
        inputs.positions,
        kv_cache,
        inputs.attention,
        attention_impl=attention_impl,
    )
    return kv_cache, model.compute_logits(hidden[inputs.logits_indices]), hidden


def _sample(sampling_state, logits, meta: SamplingMetadata, want_logprobs):
    sampled, sampling_state = sample(logits, meta, sampling_state)

    def compute(_):
        return top_logprobs(logits, sampled, MAX_LOGPROBS)

    def skip(_):  # the branch not taken costs nothing
        rows = logits.shape[0]
        return (
            jnp.zeros((rows, MAX_LOGPROBS + 1), jnp.int32),
            jnp.zeros((rows, MAX_LOGPROBS + 1), jnp.float32),
            jnp.zeros((rows,), jnp.int32),
        )

    logprobs = jax.lax.cond(want_logprobs, compute, skip, None)
    return sampling_state, SampleOutputs(sampled, *logprobs)


def _prompt_logprobs(graphdef, params, hidden, targets):
    """Logprobs of each position's next prompt token: logits for all T rows, [T, k+1]."""
    model = nnx.merge(graphdef, params)
    return top_logprobs(model.compute_logits(hidden), targets, MAX_LOGPROBS)


class ModelRunner:
    def __init__(
        self,
        model: nnx.Module,
        *,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        num_blocks: int | None = None,
        seed: int = 0,
        attention_impl: str | None = None,
    ):
        self.config = model.config
        self.dtype = model.dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buckets = BucketSpec.create(
            max_num_seqs, max_num_batched_tokens, max_model_len, block_size
        )
        self.input_batch = InputBatch(self.buckets, block_size, seed)
        self.graphdef, params = nnx.split(model)
        # Committed to the device from the start, like the weights update_weights puts
        # there later: committed and uncommitted inputs would be different jit cache keys.
        self.device = jax.devices()[0]
        self.params = jax.device_put(params, self.device)
        self._kv_cache_shape = model.kv_cache_shape
        self.num_blocks = num_blocks or self._blocks_from_budget(
            kv_cache_memory_bytes, gpu_memory_utilization
        )
        self.kv_cache = jax.device_put(
            jnp.zeros(self._kv_cache_shape(self.num_blocks, block_size), self.dtype), self.device
        )
        self.sampling_state = jax.device_put(
            SamplingState.zeros(max_num_seqs, self.config.vocab_size), self.device
        )
        # Resolved once here (building the CPU kernel if need be) so start-up reports what
        # really runs.
        q = jax.ShapeDtypeStruct(
            (1, self.config.num_attention_heads, self.config.head_dim), self.dtype
        )
        self.attention_impl = resolve_impl(attention_impl, q, self.kv_cache, self.device.platform)
        self._forward_fn = jax.jit(
            partial(_forward, self.graphdef, self.attention_impl), donate_argnums=1
        )
        self._sample_fn = jax.jit(_sample, donate_argnums=0)
        self._prompt_logprobs_fn = jax.jit(partial(_prompt_logprobs, self.graphdef))
        self._write_history = jax.jit(write_slot_history, donate_argnums=0)
        self._executing = False
        self.compiles_after_warmup = 0
        # jax keeps listeners forever: hold the runner weakly so a dropped engine (and its
        # KV cache) can be freed.
        on_event = weakref.WeakMethod(self._on_compile_event)
        jax.monitoring.register_event_duration_secs_listener(
            lambda *args, **kwargs: (method := on_event()) and method(*args, **kwargs)
        )

    # -- memory ---------------------------------------------------------------------------

    @property
    def kv_bytes_per_block(self) -> int:
        shape = self._kv_cache_shape(1, self.block_size)
        return int(np.prod(shape)) * jnp.dtype(self.dtype).itemsize

    def _blocks_from_budget(self, kv_cache_memory_bytes, gpu_memory_utilization) -> int:
        if kv_cache_memory_bytes is None:
            kv_cache_memory_bytes = self._default_kv_budget(gpu_memory_utilization)
        num_blocks = kv_cache_memory_bytes // self.kv_bytes_per_block
        pages = self.buckets.max_pages
        if num_blocks < pages + 1:
            raise ValueError(
                f"a KV cache budget of {kv_cache_memory_bytes} bytes holds {num_blocks} "
                f"blocks; one request of max_model_len={self.max_model_len} needs {pages} "
                "plus the null block: raise kv_cache_memory_bytes or lower max_model_len"
            )
        return int(num_blocks)

    def _default_kv_budget(self, gpu_memory_utilization: float) -> int:
        device = jax.devices()[0]
        if device.platform == "cpu":
            return CPU_DEFAULT_KV_BYTES
        stats = device.memory_stats() or {}
        limit = stats.get("bytes_limit")
        if not limit:
            return CPU_DEFAULT_KV_BYTES
        weights = sum(x.nbytes for x in jax.tree.leaves(self.params))
        # Headroom for the largest step's activations, dominated by its f32 logits.
        activations = 4 * self.buckets.max_num_batched_tokens * self.config.vocab_size * 4
        return max(0, int(limit * gpu_memory_utilization) - weights - activations)

    def capacity_report(self) -> str:
        tokens = (self.num_blocks - 1) * self.block_size
        gib = self.num_blocks * self.kv_bytes_per_block / (1 << 30)
        return (
            f"KV cache: {self.num_blocks - 1} blocks x {self.block_size} tokens = {tokens} "
            f"tokens ({gib:.3f} GiB); max concurrency at max_model_len={self.max_model_len}: "
            f"{tokens / self.max_model_len:.2f}x"
        )

    # -- compilation ----------------------------------------------------------------------

    def _on_compile_event(self, event: str, duration: float, **kwargs) -> None:
        # The listener is process-wide: count only compiles inside this runner's steps.
        if self._executing and event == _COMPILE_EVENT:
            self.compiles_after_warmup += 1
            logger.warning("XLA compile after warmup (%.2fs)", duration)

    def warmup(self) -> int:
        """Compile every step shape; returns how many model shapes there were.

        The programs are first compiled ahead of time on a thread pool (XLA compiles
        outside the GIL, one program per core) into the persistent compilation cache;
        the sequential dummy steps that follow then only load them.
        """
        shapes = self.buckets.all_shapes()
        token_counts = sorted({s.num_tokens for s in shapes})
        hidden = {
            t: jax.device_put(jnp.zeros((t, self.config.hidden_size), self.dtype), self.device)
            for t in token_counts
        }  # committed, like the forward's output it stands in for
        targets = {t: np.zeros(t, np.int32) for t in token_counts}
        programs = [
            (
                self._forward_fn,
                self.params,
                self.kv_cache,
                self._forward_inputs(self._dummy_step(s)),
            )
            for s in shapes
        ] + [(self._prompt_logprobs_fn, self.params, hidden[t], targets[t]) for t in token_counts]
        if jax.config.jax_compilation_cache_dir:
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                list(pool.map(lambda p: p[0].lower(*p[1:]).compile(), programs))
        outputs = [self._run(self._dummy_step(shape)) for shape in shapes]
        outputs += [
            self._prompt_logprobs_fn(self.params, hidden[t], targets[t]) for t in token_counts
        ]
        self.sampling_state = self._write_history(self.sampling_state, *self._history_args(None))
        # Wait for every warmup program, not only the last cache update: dispatch is
        # asynchronous, and a queue of unfinished warmup work (the prompt-logprob programs
        # take seconds) would otherwise delay the first request.
        jax.block_until_ready((outputs, self.kv_cache, self.sampling_state))
        return len(shapes)

    def _dummy_step(self, shape: StepShape) -> PreparedStep:
        T, R, P = shape.num_tokens, shape.num_reqs, shape.num_pages
        zeros_t = np.zeros(T, np.int32)
        return PreparedStep(
            shape=shape,
            req_ids=[],
            input_ids=zeros_t,
            positions=zeros_t,
            slot_mapping=zeros_t,
            query_start_loc=np.zeros(R + 1, np.int32),
            kv_lens=np.zeros(R, np.int32),
            block_tables=np.zeros((R, P), np.int32),
            logits_indices=np.zeros(R, np.int32),
            sampling=neutral_sampling_arrays(R),
            num_logprobs=[],
        )

    # -- one step -------------------------------------------------------------------------

    @staticmethod
    def _forward_inputs(prepared: PreparedStep) -> ForwardInputs:
        return ForwardInputs(
            input_ids=prepared.input_ids,
            positions=prepared.positions,
            attention=AttentionMetadata(
                slot_mapping=prepared.slot_mapping,
                kv_lens=prepared.kv_lens,
                block_tables=prepared.block_tables,
                query_start_loc=prepared.query_start_loc,
                q_block_size=prepared.shape.q_block_size,
            ),
            logits_indices=prepared.logits_indices,
        )

    def _run(self, prepared: PreparedStep):
        """Dispatch one step; returns (SampleOutputs, prompt logprobs or None) on device."""
        inputs = self._forward_inputs(prepared)
        self.kv_cache, logits, hidden = self._forward_fn(self.params, self.kv_cache, inputs)
        want_logprobs = np.bool_(any(n is not None for n in prepared.num_logprobs))
        self.sampling_state, sampled = self._sample_fn(
            self.sampling_state, logits, SamplingMetadata(**prepared.sampling), want_logprobs
        )
        prompt_logprobs = None
        if prepared.prompt_logprob_rows:
            prompt_logprobs = self._prompt_logprobs_fn(self.params, hidden, prepared.prompt_targets)
        return sampled, prompt_logprobs

    def _history_args(self, state: CachedRequestState | None):
        """Fixed-length (-1 padded) arguments of `write_slot_history` for one request."""
        length = self.max_model_len
        prompt = np.full(length, -1, np.int32)
        output = np.full(length, -1, np.int32)
        bias_ids = np.full(length, -1, np.int32)
        bias_values = np.zeros(length, np.float32)
        slot = np.int32(0)
        if state is not None:
            slot = np.int32(state.slot)
            prompt[: state.num_prompt_tokens] = state.token_ids[: state.num_prompt_tokens]
            generated = state.token_ids[state.num_prompt_tokens :]
            output[: len(generated)] = generated
            bias = list((state.sampling_params.logit_bias or {}).items())[:length]
            bias_ids[: len(bias)] = [int(token) for token, _ in bias]
            bias_values[: len(bias)] = [value for _, value in bias]
        return slot, prompt, output, bias_ids, bias_values

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._executing = True
        try:
            return self._execute(sched)
        finally:
            self._executing = False

    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for state in self.input_batch.update(sched):
            if state.uses_history:
                self.sampling_state = self._write_history(
                    self.sampling_state, *self._history_args(state)
                )
        if sched.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        prepared = self.input_batch.prepare(sched)
        return self._to_runner_output(prepared, *self._run(prepared))

    def _to_runner_output(self, prepared: PreparedStep, outputs: SampleOutputs, prompt_lp):
        num = len(prepared.req_ids)
        sampled = np.asarray(outputs.sampled)[:num]
        mask = prepared.sample_mask[:num]
        sampled_token_ids = [[int(t)] if m else [] for t, m in zip(sampled, mask, strict=True)]
        self.input_batch.record_sampled(prepared.req_ids, sampled_token_ids)

        logprobs = None
        if any(n is not None for n in prepared.num_logprobs):
            rows = np.nonzero(mask)[0]
            logprobs = LogprobsArrays(
                np.asarray(outputs.logprob_ids)[rows],
                np.asarray(outputs.logprobs)[rows],
                np.asarray(outputs.ranks)[rows],
            )
        prompt_logprobs = {}
        if prompt_lp is not None:
            ids, values, ranks = (np.asarray(x) for x in prompt_lp)
            for req_id, (begin, end) in prepared.prompt_logprob_rows.items():
                prompt_logprobs[req_id] = LogprobsArrays(
                    ids[begin:end], values[begin:end], ranks[begin:end]
                )
        return ModelRunnerOutput(
            req_ids=prepared.req_ids,
            req_id_to_index={r: i for i, r in enumerate(prepared.req_ids)},
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            prompt_logprobs_dict=prompt_logprobs,
        )

    # -- weights --------------------------------------------------------------------------

    def update_weights(self, params) -> None:
        """Swap in weights of the same shapes (a params State, pure dict or model).

        Arrays are cast on the host when their dtype differs, so nothing compiles.
        """
        if isinstance(params, nnx.Module):
            params = nnx.state(params)
        if not isinstance(params, nnx.State):
            state = jax.tree.map(lambda x: x, self.params)
            try:
                nnx.replace_by_pure_dict(state, params)
            except (KeyError, ValueError) as e:
                raise ValueError(f"update_weights: params do not fit the model: {e}") from e
            params = state
        new_leaves, new_tree = jax.tree.flatten(params)
        old_leaves, old_tree = jax.tree.flatten(self.params)
        if new_tree != old_tree:
            raise ValueError("update_weights: params have a different structure than the model")
        leaves = []
        for new, old in zip(new_leaves, old_leaves, strict=True):
            if new.shape != old.shape:
                raise ValueError(f"update_weights: a weight of shape {old.shape} got {new.shape}")
            if new.dtype != old.dtype:
                new = np.asarray(new).astype(old.dtype)
            leaves.append(jax.device_put(new, self.device))
        self.params = jax.tree.unflatten(old_tree, leaves)


def enable_compilation_cache(path: str | None = None) -> str:
    """Persist compiled executables on disk so a second start is fast."""
    path = path or os.environ.get(
        "JENGINE_COMPILATION_CACHE", os.path.expanduser("~/.cache/jengine/xla")
    )
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
