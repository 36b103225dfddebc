"""Scheduling and memory: pure Python + numpy, never imports jax.

Data flow: ``Request`` -> ``Scheduler.schedule()`` -> ``SchedulerOutput`` -> (runner) ->
``ModelRunnerOutput`` -> ``Scheduler.update_from_output()`` -> ``EngineCoreOutputs``
(defined with the other cross-process messages in jengine/protocol.py).
The ``KVCacheManager`` / ``BlockPool`` pair decides which KV blocks each request uses.
"""

from jengine.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from jengine.core.kv_cache_manager import KVCacheManager
from jengine.core.kv_cache_utils import BlockHash, extend_block_hashes, hash_block_tokens
from jengine.core.outputs import LogprobsArrays, ModelRunnerOutput
from jengine.core.request_queue import WaitingQueue
from jengine.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jengine.core.scheduler import Scheduler

__all__ = [
    "BlockHash",
    "BlockPool",
    "CachedRequestData",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "LogprobsArrays",
    "ModelRunnerOutput",
    "NewRequestData",
    "Scheduler",
    "SchedulerOutput",
    "WaitingQueue",
    "extend_block_hashes",
    "hash_block_tokens",
]
