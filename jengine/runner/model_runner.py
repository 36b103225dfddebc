"""The device side of a step: weights, KV cache, sampling state; warmup and execute.

Where it sits: `EngineCore` owns one ModelRunner; each step it calls
`dispatch(SchedulerOutput) -> InFlightStep`, which queues the step's device work, and
later `collect(InFlightStep) -> ModelRunnerOutput`, which waits for its sampled tokens
(`execute` is both at once). Under async scheduling the engine dispatches step N+1
before it collects step N. This is the only place that holds jax arrays; the
scheduler sees numbers and lists only. The runner follows the scheduler with
`input_batch.InputBatch` (host arrays), runs the jitted programs of `step_programs.py`
on them, sizes its KV cache with `kv_cache_sizing.py` and compiles through
`compilation.py`.

Promises:
- the KV cache and the sampling state are donated to the step functions (updated in
  place); params, cache and state are committed to one device from the start;
- `warmup()` compiles every shape in `BucketSpec.all_shapes()` (the decode shapes also
  as multi-step decodes when `num_decode_steps` > 1), every row selection of
  `BucketSpec.all_row_selections()` and the slot-history writer; afterwards serving
  compiles nothing, and `compiles_after_warmup` counts any compile inside `execute`
  anyway (tests assert it stays 0);
- the KV capacity comes from a memory budget (`kv_cache_memory_bytes`, or a fraction of
  accelerator memory) unless `num_blocks` is given, and `capacity_report()` reports it as
  tokens and max concurrency;
- speculative decoding: a request's drafts run as one query block after its last token,
  every position is sampled as it would be without drafts, and the drafts are kept up to
  the first the model disagrees with (`step_outputs`): the same tokens as without
  speculation, and for one-hot (n-gram) drafts exact rejection sampling;
- steps are collected in the order they were dispatched, at most one step behind: a
  request's token still on the way is read by the next step from the device
  (`SamplingState.last_token`), and a request dropped in between never gets it;
- `update_weights(params)` swaps in new weights of the same shapes without recompiling
  the step; weights already on the engine's devices are resharded there, never through
  the host.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import SingleDeviceSharding

from jengine.config import LoRAConfig
from jengine.core.outputs import ModelRunnerOutput
from jengine.core.sched_output import SchedulerOutput
from jengine.models.lora import with_lora_slots
from jengine.pallas_kernels.ragged_paged_attention import resolve_impl
from jengine.runner import distributed
from jengine.runner.buckets import BucketSpec, StepShape
from jengine.runner.compilation import CompileCounter, compile_ahead_of_time
from jengine.runner.draft_model import DraftModel, check_draft_model
from jengine.runner.grammar_mask import DeviceBitmasks, place_grammar_rows
from jengine.runner.huge_pages import move_to_huge_pages, zeros_in_huge_pages
from jengine.runner.input_batch import InputBatch
from jengine.runner.kv_cache_sizing import KVCacheSizing, default_kv_budget, weights_report
from jengine.runner.lora_slots import LoRASlots
from jengine.runner.pooler import Pooler, host_rows
from jengine.runner.prepared_step import PreparedStep
from jengine.runner.sampler import SamplingState, slot_history_args
from jengine.runner.sharding import TensorParallel
from jengine.runner.step import ForwardInputs, sampling_args
from jengine.runner.step_outputs import InFlightStep, collected_output
from jengine.runner.step_programs import StepPrograms
from jengine.runner.weight_update import updated_params
from jengine.sampling_params import MAX_LOGPROBS


class ModelRunner:
    """Holds the device state of one engine and runs its steps (see the module promises)."""

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
        kv_cache_dtype: str = "auto",
        seed: int = 0,
        attention_impl: str | None = None,
        tensor_parallel_size: int = 1,
        expert_parallel: bool = False,
        devices: Sequence[jax.Device] | None = None,
        draft_model: nnx.Module | None = None,
        num_speculative_tokens: int = 0,
        lora_config: LoRAConfig | None = None,
        pooling_type: str | None = None,
        num_decode_steps: int = 1,
        max_logprobs: int = MAX_LOGPROBS,
    ):
        """`devices`: where to run (default: the first of `jax.devices()`), e.g. the
        devices of the mesh a user's params live on. `draft_model`: speculative decoding's
        draft (`draft_model.py`), proposing `num_speculative_tokens` per step.
        `lora_config`: serve LoRA adapters (`lora_slots.py`). `pooling_type`: an
        embedding engine's pooling (`pooler.py`; None: a generating engine).
        `num_decode_steps`: K > 1 compiles multi-step decodes of K steps too.
        `kv_cache_dtype`: vLLM's `--kv-cache-dtype` name, for the draft's cache too.
        `max_logprobs`: the top logprobs the sampling programs compute (at most the
        vocabulary)."""
        if draft_model is not None:
            check_draft_model(draft_model, model, tensor_parallel_size)
        if lora_config is not None:
            model = with_lora_slots(model, lora_config.max_loras, lora_config.max_lora_rank)
        checkpoint_config = model.config  # before tensor parallelism repeats any KV head
        self.tensor_parallel = tp = None
        if tensor_parallel_size > 1:
            self.tensor_parallel = tp = TensorParallel.create(
                tensor_parallel_size, model.config, devices, expert_parallel=expert_parallel
            )
            model = tp.fit_model(model)
        self.config = model.config
        self.dtype = model.dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buckets = BucketSpec.create(
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            block_size,
            # The draft's proposal programs are per request bucket and read the sampled rows.
            sample_rows_fixed=draft_model is not None,
        )
        self.input_batch = InputBatch(self.buckets, block_size, seed)
        self.pooler = None if pooling_type is None else Pooler(pooling_type)
        self.lora = None if lora_config is None else LoRASlots(lora_config, checkpoint_config, tp)
        self.graphdef, params = nnx.split(model)
        # Committed to the device(s) from the start, like the weights update_weights puts
        # there later: committed and uncommitted inputs would be different jit cache keys.
        # Tensor parallel: weights and cache split over the mesh, the rest replicated.
        # (jax.devices() spans every host; the local ones are this process's)
        self.device = devices[0] if devices is not None else jax.local_devices()[0]
        self.replicated = tp.replicated() if tp else SingleDeviceSharding(self.device)
        self.bitmasks = DeviceBitmasks(self.config.vocab_size, self.replicated)
        self.params = jax.device_put(params, tp.param_shardings(params) if tp else self.device)
        self.huge_pages = move_to_huge_pages(self.params)
        self.kv_sizing = KVCacheSizing.create(
            model.kv_cache_shape,
            self.dtype,
            kv_cache_dtype=kv_cache_dtype,
            block_size=block_size,
            max_model_len=max_model_len,
            max_pages=self.buckets.max_pages,
            num_shards=tp.size if tp else 1,
        )
        if draft_model is not None:
            self.kv_sizing = DraftModel.sharing_blocks(self.kv_sizing, draft_model, kv_cache_dtype)
        if not num_blocks:
            budget = kv_cache_memory_bytes or default_kv_budget(
                self.device,
                self.params,
                max_num_batched_tokens=self.buckets.max_num_batched_tokens,
                vocab_size=self.config.vocab_size,
                gpu_memory_utilization=gpu_memory_utilization,
            )
            num_blocks = self.kv_sizing.blocks_from_budget(budget)
        self.num_blocks = num_blocks
        if jax.process_count() > 1:  # every host must build the same cache: the smallest
            self.num_blocks = int(multihost_utils.process_allgather(self.num_blocks).min())
        cache_shape = model.kv_cache_shape(self.num_blocks, block_size)
        self.kv_cache = jax.jit(  # made in place on each device, never whole on one
            lambda: jnp.zeros(cache_shape, self.kv_sizing.dtype),
            out_shardings=tp.kv_cache_sharding() if tp else SingleDeviceSharding(self.device),
        )()
        # Attention's walks read the cache's pages scattered: in 2 MiB pages, fewer TLB misses.
        self.kv_cache_huge_pages = zeros_in_huge_pages(self.kv_cache)
        self.sampling_state = jax.device_put(
            SamplingState.zeros(max_num_seqs, self.config.vocab_size), self.replicated
        )
        # Resolved once here (building the CPU kernel if need be) so start-up reports what
        # really runs.
        q = jax.ShapeDtypeStruct(
            (1, self.config.num_attention_heads, self.config.head_dim), self.dtype
        )
        self.attention_impl = resolve_impl(attention_impl, q, self.kv_cache, self.device.platform)
        self.num_decode_steps = num_decode_steps
        self.programs = StepPrograms.create(
            self.graphdef,
            self.attention_impl,
            tp.mesh if tp else None,
            platform=self.device.platform,
            num_logprobs=min(max_logprobs, self.config.vocab_size),
            block_size=block_size,
            num_decode_steps=num_decode_steps,
        )
        self._compile_counter = CompileCounter()
        self.draft = None
        if draft_model is not None:
            self.draft = DraftModel(
                draft_model,
                num_speculative_tokens=num_speculative_tokens,
                num_blocks=self.num_blocks,
                block_size=block_size,
                max_model_len=max_model_len,
                device=self.device,
                attention_impl=attention_impl,
                kv_cache_dtype=kv_cache_dtype,
            )

    # -- memory ---------------------------------------------------------------------------

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_sizing.bytes_per_block

    def capacity_report(self) -> str:
        return self.kv_sizing.capacity_report(self.num_blocks)

    def weights_report(self) -> str:
        params = nnx.to_pure_dict(self.params)
        return weights_report(params, self.config, self.dtype, self.kv_sizing)

    @property
    def compiles_after_warmup(self) -> int:
        """XLA compiles inside `execute` (after warmup, there should be none)."""
        return self._compile_counter.count

    # -- warmup ---------------------------------------------------------------------------

    def warmup(self) -> int:
        """Compile every step shape; returns how many model shapes there were.

        The programs are first compiled ahead of time on a thread pool into the persistent
        compilation cache (when there is one); the sequential dummy steps that follow then
        only load them.
        """
        shapes = self.buckets.all_shapes()
        lora = self.lora is not None
        steps = PreparedStep.warmup_steps(shapes, lora, self.num_decode_steps)
        token_counts = sorted({s.num_tokens for s in shapes})

        def zero_rows(num_rows: int):  # committed, like the forward's outputs they stand for
            zeros = jnp.zeros((num_rows, self.config.hidden_size), self.dtype)
            return jax.device_put(zeros, self.replicated)

        hidden = {t: zero_rows(t) for t in token_counts}
        targets = {t: np.zeros(t, np.int32) for t in token_counts}
        programs = [program for step in steps for program in self._step_programs(step)]
        # The dummy steps sample S = R rows; the selections of fewer rows run alone.
        selections = [(zero_rows(r), s) for r, s in self.buckets.all_row_selections()]
        programs += [(self.programs.first_rows, *args) for args in selections]
        programs += [
            (self.programs.prompt_logprobs, self.params, hidden[t], targets[t])
            for t in token_counts
        ]
        if self.draft is not None:
            programs += self.draft.programs(map(PreparedStep.padding, shapes), self.replicated)
        compile_ahead_of_time(programs)
        distributed.wait_for_every_host("jengine: warmup compiled")
        outputs = [self._run(step)[:2] for step in steps]
        if lora:  # the slot writer (slots are empty: writing zeros changes nothing)
            self.params = self.lora.write(self.params, 1, None)
        if self.draft is not None:
            drafts = self.draft.programs(map(PreparedStep.padding, shapes), self.replicated)
            outputs += [self.draft.propose(*program[3:]) for program in drafts]
        outputs += [
            self.programs.prompt_logprobs(self.params, hidden[t], targets[t]) for t in token_counts
        ]
        # The sampling program alone, at each S a selection keeps (decode shapes sample
        # inside their own program; the other shapes' dummy steps sampled their R rows).
        for rows, num_rows in selections:
            dummy = PreparedStep.padding(StepShape(num_rows, num_rows, 1, 1))
            rows, args = (
                self.programs.first_rows(rows, num_rows),
                sampling_args(dummy, self.bitmasks),
            )
            self.sampling_state, sampled = self.programs.sample(
                self.sampling_state, self.params, rows, *args
            )
            outputs.append(sampled)
        history = slot_history_args(self.max_model_len)  # compiles the slot-history writer
        self.sampling_state = self.programs.write_history(self.sampling_state, *history)
        # Wait for every warmup program, not only the last cache update: dispatch is
        # asynchronous, and a queue of unfinished warmup work (the prompt-logprob programs
        # take seconds) would otherwise delay the first request.
        jax.block_until_ready((outputs, self.kv_cache, self.sampling_state))
        self._compile_counter.warmed_up = True
        return len(shapes)

    # -- one step -------------------------------------------------------------------------

    def _run(self, prepared: PreparedStep):
        """Dispatch one step; returns (SampleOutputs, prompt logprobs or None, hidden) on
        device. A decode step is one program (`decode_step`, or `multi_decode_step` for
        several), any other two."""
        inputs = ForwardInputs.from_prepared(prepared)
        sampling = sampling_args(prepared, self.bitmasks)
        if prepared.num_steps > 1:
            self.kv_cache, self.sampling_state, sampled = self.programs.multi_decode(
                self.params, self.kv_cache, inputs, self.sampling_state, *sampling
            )
            return sampled, None, None
        if prepared.shape.is_decode:
            self.kv_cache, self.sampling_state, hidden, sampled = self.programs.decode(
                self.params, self.kv_cache, inputs, self.sampling_state, *sampling
            )
        else:
            self.kv_cache, hidden, rows = self.programs.forward(
                self.params, self.kv_cache, inputs, self.sampling_state.last_token
            )
            if prepared.num_sample_rows < prepared.shape.num_reqs:
                rows = self.programs.first_rows(rows, prepared.num_sample_rows)
            self.sampling_state, sampled = self.programs.sample(
                self.sampling_state, self.params, rows, *sampling
            )
        prompt_logprobs = None
        if prepared.prompt_logprob_rows:
            prompt_logprobs = self.programs.prompt_logprobs(
                self.params, hidden, prepared.prompt_targets
            )
        return sampled, prompt_logprobs, hidden

    def _step_programs(self, prepared: PreparedStep) -> list[tuple]:
        """`(jitted program, *arguments)` of a step like `prepared` (its rows as a shape):
        the one program of a decode step, or the forward and the sampling program."""
        inputs = ForwardInputs.from_prepared(prepared)
        sampling = sampling_args(prepared, self.bitmasks)
        state, params = self.sampling_state, self.params
        if prepared.shape.is_decode:
            decode = self.programs.multi_decode if prepared.num_steps > 1 else self.programs.decode
            return [(decode, params, self.kv_cache, inputs, state, *sampling)]
        rows = jax.ShapeDtypeStruct(
            (prepared.num_sample_rows, self.config.hidden_size),
            self.dtype,
            sharding=self.replicated,
        )
        return [
            (self.programs.forward, params, self.kv_cache, inputs, state.last_token),
            (self.programs.sample, state, params, rows, *sampling),
        ]

    def lower_step(self, prepared: PreparedStep) -> list:
        """The lowered programs of a step like `prepared` (for inspecting what a step
        compiles to: collectives, custom calls), as `_step_programs` lists them."""
        return [program.lower(*args) for program, *args in self._step_programs(prepared)]

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its results."""
        return self.collect(self.dispatch(scheduler_output))

    def dispatch(self, scheduler_output: SchedulerOutput) -> InFlightStep:
        """Queue one step's device work; its results stay on the device until `collect`."""
        with self._compile_counter.counting():
            return self._dispatch(scheduler_output)

    def _dispatch(self, scheduler_output: SchedulerOutput) -> InFlightStep:
        batch = self.input_batch
        for state in batch.update(scheduler_output):
            if state.uses_history:
                tokens = batch.all_token_ids(state.req_id)
                history = slot_history_args(self.max_model_len, state, tokens)
                self.sampling_state = self.programs.write_history(self.sampling_state, *history)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return InFlightStep(None, None, None, None, batch.num_removals)
        prepared = batch.prepare(scheduler_output)
        if self.lora is not None:
            lora_ids = [batch.requests[r].lora_id for r in prepared.req_ids]
            self.params = self.lora.assign(self.params, lora_ids)
            prepared.lora_slots = self.lora.token_slots(prepared, lora_ids)
        if scheduler_output.grammar_bitmask is not None:
            prepared.grammar_bitmask = place_grammar_rows(prepared, scheduler_output)
        outputs, prompt_logprobs, hidden = self._run(prepared)
        drafts = None
        if scheduler_output.num_lookahead_tokens and self.draft is not None:
            # Dispatched before the host waits for the step: the host's work on the
            # sampled tokens overlaps the proposal.
            drafts = self.draft.propose_after(prepared, outputs.sampled)
        if prepared.spec_drafts is None:
            batch.mark_sampling(prepared)
        if self.pooler is None:
            hidden = None  # not kept alive: only pooling reads it on the host
        return InFlightStep(prepared, outputs, prompt_logprobs, drafts, batch.num_removals, hidden)

    def collect(self, step: InFlightStep) -> ModelRunnerOutput:
        """Wait for a dispatched step's sampled tokens (the oldest not yet collected)."""
        if step.prepared is None:
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        output = collected_output(step, self.input_batch)
        if self.pooler is not None:
            output.pooler_output = self.pooler.pool(
                step.prepared, host_rows(step.hidden), self.input_batch.requests
            )
        if step.drafts is not None:
            output.draft_token_ids = step.drafts.lists()
        return output

    # -- weights --------------------------------------------------------------------------

    def update_weights(self, params) -> None:
        """Swap in weights of the same shapes (a params State, pure dict or model), as host
        arrays (cast on the host when their dtype differs) or as jax arrays in any layout over
        the engine's devices (which they never leave). Each new weight ends up with its old
        weight's sharding, so the step never recompiles."""
        self.params = updated_params(self.params, params, self.tensor_parallel, self.config)
        self.huge_pages = move_to_huge_pages(self.params)
