"""Several async streams as one: what a request of several engine requests (a completions
batch, n embeddings) reads its outputs through.

Where it sits: `OpenAIServing.generate` and the embeddings route merge one engine stream
per prompt here. Promises: items come as they arrive, each with its source's index; an
error in one source ends the merged stream with that error; closing the merged stream
cancels every source still running, which aborts its engine request.
"""

import asyncio
from collections.abc import AsyncIterator


async def merge_async_iterators(*iterators: AsyncIterator) -> AsyncIterator[tuple[int, object]]:
    """Yield (index of source, item) from several async iterators as items arrive; closing
    the merged iterator cancels (and so aborts) every source still running."""
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            aclose = getattr(iterators[0], "aclose", None)
            if aclose is not None:
                await aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(index: int, iterator: AsyncIterator) -> None:
        try:
            async for item in iterator:
                await queue.put((index, item))
            await queue.put((index, done))
        except Exception as e:
            await queue.put((index, e))

    tasks = [asyncio.create_task(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
