"""WaitingQueue: the order in which waiting requests get to start (or restart).

Where it sits: the scheduler adds every new request here, puts preempted requests back,
and each step admits requests from its head while the token budget, the KV blocks and
`max_num_seqs` allow.

What it promises: FCFS serves requests in arrival order, and a preempted request goes back
to the very front; under the priority policy the order is (priority, arrival), lower
first, and a preempted request simply rejoins at its rank (ahead of later arrivals). Ties
keep insertion order.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from jengine.request import Request


class WaitingQueue:
    """Requests waiting to (re)start: arrival order for FCFS, (priority, arrival) otherwise.

    FCFS puts a preempted request back at the very front; under the priority policy it
    simply rejoins at its (priority, arrival) rank, which is ahead of later arrivals.
    """

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()  # keeps heap order total and stable

    def _push(self, request: Request) -> None:
        key = (request.priority, request.arrival_time, next(self._tiebreak), request)
        heapq.heappush(self._heap, key)

    def add(self, request: Request) -> None:
        if self.policy == "priority":
            self._push(request)
        else:
            self._fifo.append(request)

    def add_preempted(self, request: Request) -> None:
        if self.policy == "priority":
            self._push(request)
        else:
            self._fifo.appendleft(request)

    def peek(self) -> Request:
        return self._heap[0][3] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3] if self.policy == "priority" else self._fifo.popleft()

    def remove(self, request: Request) -> None:
        if self.policy == "priority":
            self._heap = [e for e in self._heap if e[3] is not request]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(request)

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._fifo)

    def __iter__(self) -> Iterator[Request]:
        """In scheduling order."""
        if self.policy == "priority":
            return iter([e[3] for e in sorted(self._heap)])
        return iter(self._fifo)
