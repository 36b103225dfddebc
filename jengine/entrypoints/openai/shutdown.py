"""Graceful shutdown of `jengine serve`: SIGTERM or SIGINT drains the server, then stops it.

Where it sits: api_server.py runs the app under `DrainingServer` (a uvicorn Server) and
shuts the engine down once `serve` returns. On the first signal:
1. what had already reached the server is read first: a few turns of the event loop
   accept the connections and parse the requests the kernel already holds, so each
   request received before the signal is counted in flight (middleware.py);
2. `Admission.draining` turns on: from then on /health and every request that arrives
   answer 503, while every request received before keeps running, even one still being
   parsed or tokenized;
3. it waits until no request is in flight and the engine has nothing unfinished, at most
   --shutdown-timeout seconds; then admission closes and what is still running ends with
   a 503 error (the error event of a stream, the error body of a full response) and is
   aborted in the engine;
4. uvicorn stops: it closes the listening socket and waits for the responses still being
   written; `serve` returns and the engine process is shut down. Exit code 0.
A second signal skips the wait of step 3: what is still running ends with the 503 error
at once, then the server stops as in step 4 (uvicorn's own handling of it cut the streams
with no error event, and logged each). A third is uvicorn's: the exit is forced.
"""

import asyncio
import logging
import time

import uvicorn

from jengine.engine.async_llm import AsyncLLM
from jengine.entrypoints.openai.admission import TIMED_OUT, Admission, shutting_down_error

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.05
# Turns of the event loop that take in what the kernel held at the signal: accepting a
# connection, starting to read it, parsing the request and entering the app each take one.
_CATCH_UP_TURNS = 8


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        engine: AsyncLLM,
        admission: Admission,
        shutdown_timeout: float,
    ):
        super().__init__(config)
        self.engine = engine
        self.admission = admission
        self.shutdown_timeout = shutdown_timeout
        self._drain: asyncio.Task | None = None
        self._hurried = False  # a second signal: the wait is skipped

    def handle_exit(self, sig: int, frame) -> None:
        # Runs in the main thread, between two steps of the event loop.
        if self._drain is None and not self.should_exit:
            loop = asyncio.get_running_loop()
            self._drain = loop.create_task(self._drain_then_exit(), name="graceful_shutdown")
        elif self._drain is not None and not self._drain.done() and not self._hurried:
            self._hurried = True
        else:
            super().handle_exit(sig, frame)

    def _unfinished(self) -> int:
        return max(self.admission.num_in_flight, self.engine.num_unfinished_requests)

    async def _drain_then_exit(self) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        for _ in range(_CATCH_UP_TURNS):
            await asyncio.sleep(0)
        self.admission.draining = True
        engine = self.engine
        logger.info(
            "shutting down: new requests are refused; waiting up to %.0fs for %d running",
            self.shutdown_timeout,
            self._unfinished(),
        )
        while self._unfinished() and time.monotonic() < deadline and not self._hurried:
            if engine.errored:
                break
            await asyncio.sleep(_POLL_SECONDS)
        self.admission.closed = True
        left = engine.num_unfinished_requests
        if left and not engine.errored:
            why = "a second signal" if self._hurried else "shutdown timeout"
            logger.warning("%s: ending %d unfinished requests with an error", why, left)
            detail = "" if self._hurried else f"{TIMED_OUT} ({self.shutdown_timeout:g}s)"
            await engine.abort_all(shutting_down_error(detail))
        self.should_exit = True
