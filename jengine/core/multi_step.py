"""Multi-step decoding: when a step may run several decode steps in one program launch.

Where it sits: a mixin of `Scheduler` (jengine/core/scheduler.py), whose state it uses
(running, waiting, the KV cache manager). `schedule()` asks `_num_decode_steps()` first;
with K > 1 every running request is scheduled one token, gets slots for K, and its
counters advance by K: the runner runs K decode steps in one program, each step's input
the token the step before sampled on the device, and returns K tokens per request
(`SchedulerOutput.num_decode_steps`).

What it promises: K > 1 only where it changes no token a request emits:
- every running request is decoding (its next token is its last), unconstrained (a
  grammar advances on each token on the host), not crossing min_tokens within the tokens
  it may emit (the EOS and stop ids it masks are the same for all of them: masked in
  every step or in none; tokens past max_tokens are dropped anyway), short of max_tokens,
  and has room for K more tokens within max_model_len;
- no waiting request could start now (it would wait K steps), and no grammar is compiling;
- the free pool holds every block the K tokens need, so the step never preempts for them.
Tokens sampled past a request's stop are discarded by `update_from_output` like any token
past a stop; their slots were the request's own and are freed with it.
"""

from __future__ import annotations


class MultiStep:
    """Mixin of `Scheduler`: its state is the scheduler's."""

    def _num_decode_steps(self) -> int:
        """K (`num_scheduler_steps`) when this step may decode K tokens per request, else 1."""
        config = self.config
        num_steps = config.num_scheduler_steps
        running = self.running
        if (
            num_steps == 1
            or not running
            or len(running) > config.max_num_batched_tokens
            or self.waiting_for_grammar
            or (len(self.waiting) and len(running) < config.max_num_seqs)
        ):
            return 1
        kv_cache_manager = self.kv_cache_manager
        max_model_len = self.max_model_len
        num_new_blocks = 0
        for request in running:
            num_computed = request.num_computed_tokens
            placeholders = request.num_output_placeholders
            num_output = len(request.output_token_ids) + placeholders
            params = request.sampling_params
            max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len
            # Output tokens it may have after this step (any past max_tokens are dropped).
            num_emitted = min(num_output + num_steps, max_tokens)
            if (
                len(request.all_token_ids) + placeholders - num_computed != 1
                or request.structured_output is not None
                or num_computed + num_steps > max_model_len
                or num_output < params.min_tokens < num_emitted
                or num_output >= max_tokens
            ):
                return 1
            num_new_blocks += kv_cache_manager.num_blocks_to_grow(request, num_computed + num_steps)
        return num_steps if num_new_blocks <= kv_cache_manager.num_free_blocks else 1
