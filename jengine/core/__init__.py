"""Scheduling and memory: pure Python + numpy, never imports jax.

Data flow: ``Request`` -> ``Scheduler.schedule()`` -> ``SchedulerOutput`` -> (runner) ->
``ModelRunnerOutput`` -> ``Scheduler.update_from_output()`` -> ``EngineCoreOutputs``.
The ``KVCacheManager`` / ``BlockPool`` pair decides which KV blocks each request uses.
"""

from jengine.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from jengine.core.kv_cache_manager import KVCacheManager
from jengine.core.kv_cache_utils import BlockHash, extend_block_hashes, hash_block_tokens
from jengine.core.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    LogprobsArrays,
    LogprobsLists,
    ModelRunnerOutput,
    SchedulerStats,
)
from jengine.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jengine.core.scheduler import Scheduler, WaitingQueue

__all__ = [
    "BlockHash",
    "BlockPool",
    "CachedRequestData",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "FinishReason",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "LogprobsArrays",
    "LogprobsLists",
    "ModelRunnerOutput",
    "NewRequestData",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
    "WaitingQueue",
    "extend_block_hashes",
    "hash_block_tokens",
]
