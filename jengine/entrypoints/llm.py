"""LLM: the offline batch API, with vLLM's names — `LLM(model=...).generate(prompts, params)`.

Where it sits: the top of the offline path: LLM -> LLMEngine -> InprocClient -> EngineCore,
all in this process, so JAX research code can hand over a params pytree (`params=`, on
its own `mesh=` if it likes) or a Flax module (`model=`), generate, `update_weights(...)`
and generate again without recompiling. With `data_parallel_size > 1` the replicas run
in their own processes instead (LLMEngine over a SyncMPClient).

Promises: outputs in input order; every request either completes or raises a ValueError
before anything runs (bad prompts and sampling values are checked up front), so a bad
entry in a batch never leaves work half-done in the engine.
"""

import itertools
import logging
import numbers
from collections.abc import Sequence
from dataclasses import fields

import msgspec
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

from jengine.beam_search import BeamSearchOutput, beam_search
from jengine.engine.arg_utils import EngineArgs
from jengine.engine.core import EngineCore
from jengine.engine.llm_engine import LLMEngine
from jengine.engine.tokenizer import load_tokenizer
from jengine.entrypoints.llm_params import own_module_copy, own_module_from_params
from jengine.entrypoints.openai.cli_args import take_met_offline
from jengine.lora_request import LoRARequest
from jengine.models.default import default_model, describe_default
from jengine.models.lora import adapter_from_weights
from jengine.outputs import EmbeddingRequestOutput, RequestOutput
from jengine.pooling import PoolingParams
from jengine.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# Adapters added in memory get ids from here up, apart from the ids users give folders.
IN_MEMORY_LORA_IDS = 1 << 30

PROGRESS_BAR_MIN_PROMPTS = 8


class LLM:
    def __init__(
        self,
        model: str | nnx.Module | None = None,
        *,
        params=None,
        mesh: Mesh | None = None,
        **engine_kwargs,
    ):
        """`model`: an HF folder, a .gguf, `smollm2`, `shakespeare` (default: `smollm2` when
        it is installed, else `shakespeare`) or a Flax module; `params`:
        weights (a params State or nested dict) to use instead of the folder's, host
        arrays or jax arrays in any layout; `mesh`: the `jax.sharding.Mesh` to run on
        (e.g. the training mesh `params` live on): the model is split tensor-parallel over
        all its devices, and weights on it reach the engine device to device. Other
        keyword arguments are EngineArgs fields, with vLLM's names (`dtype`,
        `max_model_len`, `max_num_seqs`, `max_num_batched_tokens`, `block_size`,
        `enable_prefix_caching`, `kv_cache_memory_bytes`, `num_gpu_blocks_override`,
        `gpu_memory_utilization`, `scheduling_policy`, `seed`, `tokenizer`, ...)."""
        take_met_offline(engine_kwargs)
        if unknown := set(engine_kwargs) - {f.name for f in fields(EngineArgs)} - {"model"}:
            raise ValueError(f"unknown LLM arguments: {sorted(unknown)}")
        module = model if isinstance(model, nnx.Module) else None
        path = None if module is not None else model
        if module is None and path is None:
            path = default_model()
            logger.info(describe_default(path))
        self._lora_ids: dict[str, int] = {}  # adapters added in memory: name -> id
        self._next_lora_ids = itertools.count(IN_MEMORY_LORA_IDS)  # never reused
        if engine_kwargs.get("data_parallel_size", 1) > 1:
            if module is not None or params is not None:
                raise ValueError(
                    "data_parallel_size > 1 runs each replica in its own process, loaded "
                    "from a checkpoint: pass model=PATH, not a module or params"
                )
            self.engine_core = None  # the replicas run in their own processes
            self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=path, **engine_kwargs))
            return
        dtype = engine_kwargs.get("dtype", "auto")
        devices = None
        if mesh is not None:
            devices = mesh.devices.flatten().tolist()
            size = engine_kwargs.setdefault("tensor_parallel_size", len(devices))
            if size != len(devices):
                raise ValueError(
                    f"tensor_parallel_size={size} but the mesh has {len(devices)} devices"
                )
        if module is None and params is not None:
            module = own_module_from_params(path, params, dtype, engine_kwargs.get("quantization"))
        elif module is not None:
            module = own_module_copy(module, params, dtype)
        if module is not None and engine_kwargs.get("max_model_len") is None:
            engine_kwargs["max_model_len"] = module.config.max_position_embeddings
        config = EngineArgs(model=path, **engine_kwargs).create_engine_config()
        self.engine_core = EngineCore(config, model=module, devices=devices)
        tokenizer = load_tokenizer(config)
        self.llm_engine = LLMEngine.from_engine_core(config, self.engine_core, tokenizer)

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no SamplingParams: the
        checkpoint's recommended sampling (its generation_config.json, unless the engine
        was made with `generation_config="vllm"`), else SamplingParams' own defaults."""
        return SamplingParams(**self.llm_engine.sampling_defaults)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    # -- generation ---------------------------------------------------------------------

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list; returns one RequestOutput per prompt, in order.

        A prompt is a string, a list of token ids, or a dict of "prompt" or
        "prompt_token_ids" and optionally "cache_salt" (vLLM's: only prompts with the same
        salt share prefix-cache blocks).
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base
        model); an engine made with `enable_lora=True` reads each folder the first time.
        """
        # An empty list is a list of the wrong length, not "none given".
        params = self.get_default_sampling_params() if sampling_params is None else sampling_params
        return self._run_prompts(prompts, params, use_tqdm, priority, lora_request)

    def beam_search(
        self,
        prompts,
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: the best `params.beam_width` continuations of each prompt (a
        string, token ids or a prompt dict), in order (jengine/beam_search.py);
        `lora_request` as `generate` takes it."""
        del use_tqdm  # vLLM's; a step is one short generate, shown by none
        return beam_search(self, prompts, params, lora_request)

    def embed(
        self,
        prompts,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embed one prompt or a list with an embedding engine (`runner="pooling"`); returns
        one EmbeddingRequestOutput per prompt, in order (`.outputs.embedding`).
        `truncate_prompt_tokens` (vLLM's): embed each prompt's last k tokens (-1: the last
        max_model_len), over what the pooling params say."""
        if pooling_params is None:
            pooling_params = PoolingParams()
        if truncate_prompt_tokens is not None:

            def truncating(params: PoolingParams) -> PoolingParams:
                return msgspec.structs.replace(
                    params, truncate_prompt_tokens=truncate_prompt_tokens
                )

            if isinstance(pooling_params, PoolingParams):
                pooling_params = truncating(pooling_params)
            else:
                pooling_params = [truncating(params) for params in pooling_params]
        return self._run_prompts(prompts, pooling_params, use_tqdm, None, lora_request)

    def _run_prompts(self, prompts, params, use_tqdm, priority, lora_request) -> list:
        """Validate every prompt, then send and run them all (see `generate`)."""
        prompts = _token_ids_as_ints(prompts)  # numpy token ids, as research code holds them
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if not isinstance(prompts, list | tuple):
            raise TypeError(
                "prompts must be a string, a list of token ids, a prompt dict or a list of "
                f"those, got {type(prompts).__name__}"
            )
        prompts = [_token_ids_as_ints(prompt) for prompt in prompts]
        if isinstance(params, SamplingParams | PoolingParams):
            params = [params] * len(prompts)
        elif not isinstance(params, list | tuple) or not all(
            isinstance(p, SamplingParams | PoolingParams) for p in params
        ):
            raise TypeError(
                "sampling_params must be a SamplingParams or a list of them (embed's "
                f"pooling_params: PoolingParams), got {type(params).__name__}"
            )
        if len(params) != len(prompts):
            kind = "pooling" if params and isinstance(params[0], PoolingParams) else "sampling"
            raise ValueError(f"got {len(params)} {kind} params for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"got {len(lora_request)} LoRA requests for {len(prompts)} prompts")
        # Tokenize and validate every prompt (once) before sending any, so a bad prompt
        # leaves nothing half-queued.
        engine = self.llm_engine
        requests = [
            engine.input_processor.process(
                engine.next_request_id(),
                prompt,
                params,
                priority[i] if priority else 0,
                lora_request=lora_request[i],
            )
            for i, (prompt, params) in enumerate(zip(prompts, params, strict=True))
        ]
        for lora in dict.fromkeys(r for r in lora_request if r is not None):
            self.add_lora(lora)  # each adapter read and checked before anything is sent
        for text, request in requests:
            engine.add_processed_request(request, text, RequestOutputKind.FINAL_ONLY)
        ids = [request.request_id for _, request in requests]
        return self._run_engine(ids, use_tqdm and len(prompts) >= PROGRESS_BAR_MIN_PROMPTS)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list, as vLLM's `LLM.chat`: each
        rendered through `chat_template` (a Jinja template; default: the model's) with
        `tools` and `chat_template_kwargs` (e.g. `{"enable_thinking": False}`) passed to
        it; `continue_final_message` (with `add_generation_prompt=False`) continues the
        last message instead of answering it. Content may be a string or OpenAI's text
        parts. The reply is text: parse tool calls from it as the model writes them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        render = self.llm_engine.input_processor.render_chat
        prompts = []
        for conversation in conversations:
            text, token_ids = render(
                conversation,
                add_generation_prompt,
                chat_template=chat_template,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            )
            prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _run_engine(self, request_ids: list[str], show_progress: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", disable=not show_progress)
        try:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        except BaseException:
            self.llm_engine.abort_request(request_ids)
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (as vLLM's `LLM.reset_prefix_cache`), e.g. so that a
        benchmark's second pass over the same prompts computes them again. Returns False,
        forgetting nothing, while a request holds KV blocks."""
        return self.llm_engine.client.call_utility("reset_prefix_cache")

    # -- research integration --------------------------------------------------------------

    def update_weights(self, params) -> None:
        """Swap in new weights of the same shapes (a params pytree, State or module)."""
        if self.engine_core is None:
            raise ValueError(
                "update_weights needs the engine in this process (data_parallel_size 1)"
            )
        self.engine_core.update_weights(params)

    def add_lora(self, lora: LoRARequest | str, weights=None, alpha: float | None = None):
        """Register a LoRA adapter with the engine (made with `enable_lora=True`); returns
        the `LoRARequest` that selects it.

        `lora`: a LoRARequest naming a PEFT folder (read now, once: registering it again
        changes nothing), or a name for an adapter handed over in memory as `weights`:
        {target: (A [layers, r, in], B [layers, out, r])} (jax or numpy arrays; targets
        among q/k/v/o_proj and gate/up/down_proj), as a training loop holds it, scaled by
        `alpha / r` (default alpha: r). Adding a name again replaces its weights under a
        new id (ids are never reused, so no cached prefix of other weights is matched).
        No recompile either way."""
        if weights is None:
            if not isinstance(lora, LoRARequest):
                raise ValueError("add_lora(name, weights): weights are needed for a name")
            self.llm_engine.client.call_utility("add_lora", lora)
            return lora
        if self.engine_core is None:
            raise ValueError("adapters in memory need the engine in this process")
        slots = self.engine_core.runner.lora
        if slots is None:
            raise ValueError("this engine does not serve LoRA adapters (enable_lora=True)")
        adapter = adapter_from_weights(lora, weights, alpha, slots.model_config)
        request = LoRARequest(lora, next(self._next_lora_ids))
        self.engine_core.add_lora(request, adapter)
        previous = self._lora_ids.get(lora)
        self._lora_ids[lora] = request.lora_int_id
        if previous is not None:
            self.engine_core.remove_lora(previous)
        return request

    def remove_lora(self, lora: LoRARequest | str) -> bool:
        """Forget an adapter (by its LoRARequest, or the name it was added under in
        memory); a ValueError while a request still uses it."""
        if isinstance(lora, str):
            name, lora_id = lora, self._lora_ids.get(lora)
        else:
            name, lora_id = lora.lora_name, lora.lora_int_id
        if lora_id is None:
            return False
        removed = self.llm_engine.client.call_utility("remove_lora", lora_id)
        if self._lora_ids.get(name) == lora_id:  # an in-memory adapter's name is free again
            del self._lora_ids[name]
        return removed

    def shutdown(self) -> None:
        """Stop the engine processes, if any (data parallelism); idempotent."""
        self.llm_engine.shutdown()


def _token_ids_as_ints(prompt):
    """A prompt of numpy token ids (an array, numpy integers; bare or a dict's
    `prompt_token_ids`) as a list of ints."""
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return {**prompt, "prompt_token_ids": _token_ids_as_ints(prompt["prompt_token_ids"])}
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], numbers.Integral):
        return [int(t) if isinstance(t, numbers.Integral) else t for t in prompt]
    return prompt
