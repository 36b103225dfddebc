"""LoRA adapters on the device: a fixed number of slots in the model's params, filled and
evicted least-recently-used from the adapters known to the engine.

Where it sits: `ModelRunner` owns one when the engine serves LoRA (`LoRAConfig`). The
engine core registers adapters with `add` (a PEFT folder the first time a request names
its id, or an adapter handed over in memory by `LLM.add_lora`) and drops them with
`remove`. Before each step the runner calls `assign(params, ids)` with the adapters the
step's requests use, which returns the params with any missing adapter written into a
slot, then `token_slots` for every token's slot index (`PreparedStep.lora_slots`; slot 0
is the base model, slot s lives at index s - 1).
The model adds each token's own low-rank product to every targeted projection
(`models/lora.py`).

Promises:
- loading an adapter writes values into slots of fixed shape (max_loras slots of
  max_lora_rank on every target): nothing recompiles, whatever the adapters' ranks and
  targets; the writer is compiled at warmup;
- a step never holds more adapters than slots (the scheduler admits no more distinct
  adapters than `max_loras` among running requests), and an adapter a step uses is never
  evicted for another the same step needs;
- adapters read from a folder are kept on the host up to `max_cpu_loras` (least recently
  used dropped first), beyond it while requests still use them; one dropped is read again
  when a request next names it (`add`), so a folder that can no longer be read fails that
  request, never a step; adapters handed over in memory stay until removed (there is
  nothing to read them from again);
- one id means one adapter: a second folder under a registered id is a ValueError, and
  an in-memory adapter added again under its id replaces it (its slot is rewritten).
"""

from collections import OrderedDict

import jax
import numpy as np

from jengine.config import LoRAConfig
from jengine.lora_request import LoRARequest
from jengine.models.lora import LoRAAdapter, param_names, projection_sizes, read_peft_adapter
from jengine.runner.prepared_step import PreparedStep, padded


class LoRASlots:
    def __init__(self, config: LoRAConfig, model_config, tensor_parallel=None):
        """`model_config`: the model's as its checkpoint has it (adapters are written for
        that; `tensor_parallel` lays them out as the engine holds the model)."""
        self.num_slots = config.max_loras
        self.rank = config.max_lora_rank
        self.num_cpu_loras = config.num_cpu_loras
        self.model_config = model_config
        self.tensor_parallel = tensor_parallel
        self.requests: dict[int, LoRARequest] = {}  # every registered adapter
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # read, LRU first
        self.in_memory: set[int] = set()  # handed over, never dropped from the host
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # id -> slot, LRU first
        self.free_slots = list(range(self.num_slots, 0, -1))
        self.num_loads = 0  # adapters written into a slot since start
        self._write = None  # jitted at the first write, with the slots' own shardings

    # -- registry ------------------------------------------------------------------------

    def add(
        self,
        request: LoRARequest,
        adapter: LoRAAdapter | None = None,
        in_use: frozenset[int] = frozenset(),
    ) -> bool:
        """Register an adapter: read from `request.lora_path` unless `adapter` is given
        (read again if it was dropped from the host). Returns False when a folder adapter
        is registered already. `in_use`: the adapters unfinished requests use, kept on the
        host. ValueError for what cannot be served (its reason named)."""
        lora_id = request.lora_int_id
        known = self.requests.get(lora_id)
        if adapter is None:
            if known is not None:
                if known.lora_path != request.lora_path:
                    raise ValueError(
                        f"LoRA id {lora_id} is adapter {known.lora_name!r} "
                        f"({known.lora_path or 'in memory'}), not {request.lora_path!r}"
                    )
                if lora_id not in self.adapters:  # dropped from the host: read again
                    self._keep(lora_id, self._read(known), in_use)
                return False
            if not request.lora_path:
                raise ValueError(
                    f"LoRA adapter {request.lora_name!r} (id {lora_id}) is not registered "
                    "and has no path to read it from"
                )
            adapter = self._read(request)
        self._check(adapter)
        if lora_id in self.slot_of:  # replaced: its slot must be written again
            self.free_slots.append(self.slot_of.pop(lora_id))
        self.requests[lora_id] = request
        if not request.lora_path:
            self.in_memory.add(lora_id)
        self._keep(lora_id, adapter, in_use)
        return True

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter (requests still using it must have ended). False if unknown."""
        if self.requests.pop(lora_id, None) is None:
            return False
        self.adapters.pop(lora_id, None)
        self.in_memory.discard(lora_id)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        return True

    def _check(self, adapter: LoRAAdapter) -> None:
        targets = set(self.model_config.lora_targets)
        if adapter.rank > self.rank:
            raise ValueError(
                f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, above "
                f"max_lora_rank={self.rank}"
            )
        if not set(adapter.weights) <= targets:
            raise ValueError(
                f"LoRA adapter {adapter.name!r} targets {sorted(set(adapter.weights) - targets)}"
                f"; this model takes adapters on {sorted(targets)}"
            )
        sizes, layers = projection_sizes(self.model_config), self.model_config.num_hidden_layers
        for target, (a, b) in adapter.weights.items():
            out, inputs = sizes[target]
            if a.shape != (layers, adapter.rank, inputs) or b.shape != (layers, out, adapter.rank):
                raise ValueError(
                    f"LoRA adapter {adapter.name!r} does not fit this model: its {target} A "
                    f"{a.shape} and B {b.shape}, the model's [{layers}, r, {inputs}] and "
                    f"[{layers}, {out}, r]"
                )

    def _read(self, request: LoRARequest) -> LoRAAdapter:
        return read_peft_adapter(request.lora_path, self.model_config, request.lora_name)

    def _keep(self, lora_id: int, adapter: LoRAAdapter, in_use: frozenset[int]) -> None:
        self.adapters[lora_id] = adapter
        self.adapters.move_to_end(lora_id)
        read = [i for i in self.adapters if i not in self.in_memory]  # LRU first
        excess = len(read) - self.num_cpu_loras
        # Those of waiting and running requests stay: a step never reads a folder.
        for victim in [i for i in read if i not in in_use and i != lora_id][: max(0, excess)]:
            del self.adapters[victim]

    # -- slots ---------------------------------------------------------------------------

    def assign(self, params, lora_ids):
        """Put the adapters `lora_ids` (at most `max_loras` distinct ones besides 0, the
        base model) in slots, writing the missing ones into `params`; returns the params."""
        lora_ids = set(lora_ids) - {0}
        needed = [i for i in lora_ids if i not in self.slot_of]
        for lora_id in lora_ids:
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
        for lora_id in needed:
            if lora_id not in self.requests:
                raise ValueError(f"LoRA adapter id {lora_id} is not registered")
            if not self.free_slots:  # the least recently used one this step does not use
                victim = next(i for i in self.slot_of if i not in lora_ids)
                self.free_slots.append(self.slot_of.pop(victim))
            slot = self.free_slots.pop()
            self.adapters.move_to_end(lora_id)  # on the host since its request was added
            params = self.write(params, slot, self.adapters[lora_id])
            self.slot_of[lora_id] = slot
            self.num_loads += 1
        return params

    def token_slots(self, prepared: PreparedStep, lora_ids: list[int]) -> np.ndarray:
        """[T] each token's slot in `prepared`, whose request i uses adapter `lora_ids[i]`
        (assigned; 0: the base model, slot 0)."""
        slots = np.array([self.slot_of.get(i, 0) for i in lora_ids], np.int32)
        counts = np.diff(prepared.query_start_loc[: len(lora_ids) + 1])
        return padded(np.repeat(slots, counts), prepared.shape.num_tokens)

    def write(self, params, slot: int, adapter: LoRAAdapter | None):
        """`params` with `adapter`'s weights (zeros for None) in `slot`: every target
        written, a target the adapter lacks with zeros, so one program serves all."""
        leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        where = {}
        for index, (path, _) in enumerate(leaves):
            names = [str(getattr(p, "key", getattr(p, "name", ""))) for p in path]
            lora_names = [n for n in names if n.startswith("lora_")]
            if lora_names:
                where[lora_names[0]] = index
        current = {name: leaves[i][1] for name, i in where.items()}
        arrays = self._slot_arrays(adapter, current)
        if self._write is None:  # outputs placed as the inputs: the step never recompiles
            shardings = {name: value.sharding for name, value in current.items()}
            self._write = jax.jit(_write_slot, donate_argnums=0, out_shardings=shardings)
        written = self._write(current, np.int32(slot), arrays)
        flat = [leaf for _, leaf in leaves]
        for name, index in where.items():
            flat[index] = written[name]
        return jax.tree_util.tree_unflatten(treedef, flat)

    def _slot_arrays(self, adapter: LoRAAdapter | None, current) -> dict[str, np.ndarray]:
        padded = adapter.slot_arrays(self.rank) if adapter is not None else {}
        arrays = {}
        for target in self.model_config.lora_targets:
            a_name, b_name = param_names(target)
            a_shape, b_shape = current[a_name].shape, current[b_name].shape
            a, b = padded.get(target, (None, None))
            if b is not None and self.tensor_parallel is not None:
                b = self.tensor_parallel.fit_lora_b(target, b, self.model_config)
            dtype = current[a_name].dtype
            arrays[a_name] = np.zeros((a_shape[0], *a_shape[2:]), dtype) if a is None else a
            arrays[b_name] = np.zeros((b_shape[0], *b_shape[2:]), dtype) if b is None else b
        return arrays


def _write_slot(lora_params: dict, slot, arrays: dict) -> dict:
    """Each [L, S, ...] slot array with `arrays[name]` [L, ...] at slot `slot` (>= 1)."""
    return {
        name: value.at[:, slot - 1].set(arrays[name].astype(value.dtype))
        for name, value in lora_params.items()
    }
