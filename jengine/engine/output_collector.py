"""RequestOutputCollector: one request's outputs on their way from AsyncLLM's output
handler to the coroutine that reads them (`AsyncLLM.generate`).

Where it sits: the handler `put`s every RequestOutput of the request (or the error that
ends it); `generate` awaits `get`. Promise: at most one item is pending, whatever the
reader's pace. A DELTA output merges into the pending one (texts joined, tokens and
logprobs appended, the newest finish state); a CUMULATIVE or FINAL_ONLY output replaces
it; an error replaces anything and stays. So a client that reads its stream slowly holds
at most its own unread text, and the handler never waits for it: other requests are
never stalled and no queue grows without bound.
"""

import asyncio

from jengine.outputs import CompletionOutput, RequestOutput
from jengine.sampling_params import RequestOutputKind


class RequestOutputCollector:
    def __init__(self, output_kind: RequestOutputKind):
        self.output_kind = output_kind
        self._pending: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        pending = self._pending
        if isinstance(pending, BaseException):
            return  # the request already ended with an error
        if pending is None or isinstance(item, BaseException):
            self._pending = item
        elif self.output_kind == RequestOutputKind.DELTA:
            _merge_delta(pending, item)
        else:
            self._pending = item
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while self._pending is None:
            await self._ready.wait()
        item, self._pending = self._pending, None
        self._ready.clear()
        return item


def _merge_delta(pending: RequestOutput, new: RequestOutput) -> None:
    """Fold the delta `new` into the unread delta `pending` (both freshly built by the
    output processor, so they are the collector's to change)."""
    by_index = {completion.index: completion for completion in pending.outputs}
    for completion in new.outputs:
        earlier = by_index.get(completion.index)
        if earlier is None:
            pending.outputs.append(completion)
            by_index[completion.index] = completion
        else:
            _extend(earlier, completion)
    pending.finished = new.finished
    pending.num_cached_tokens = new.num_cached_tokens
    if new.prompt_logprobs is not None:
        pending.prompt_logprobs = new.prompt_logprobs


def _extend(earlier: CompletionOutput, later: CompletionOutput) -> None:
    earlier.text += later.text
    earlier.token_ids.extend(later.token_ids)
    if later.logprobs is not None:
        earlier.logprobs = (earlier.logprobs or []) + later.logprobs
    earlier.cumulative_logprob = later.cumulative_logprob
    earlier.finish_reason = later.finish_reason
    earlier.stop_reason = later.stop_reason
