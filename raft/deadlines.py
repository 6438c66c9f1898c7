"""Deadlines for many futures with one timer: a request that is not answered in time fails
with the error the caller chose, without a task or timer of its own."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable


class Deadlines:
    def __init__(self, make_error: Callable[[], BaseException]) -> None:
        # make_error gives each expired waiter its own exception instance
        self._make_error = make_error
        self._heap: list[tuple[float, int, asyncio.Future]] = []
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    def add(self, deadline: float, fut: asyncio.Future) -> None:
        """Fail fut at `deadline` (loop.time()) unless it is done by then."""
        heapq.heappush(self._heap, (deadline, next(self._seq), fut))
        if self._timer is None or deadline < self._timer_at:
            self._arm()

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._heap:
            self._timer_at = self._heap[0][0]
            self._timer = asyncio.get_running_loop().call_at(self._timer_at, self._fire)

    def _fire(self) -> None:
        self._timer = None
        now = asyncio.get_running_loop().time()
        heap = self._heap
        while heap and (heap[0][0] <= now or heap[0][2].done()):
            _, _, fut = heapq.heappop(heap)
            if not fut.done():
                fut.set_exception(self._make_error())
        self._arm()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._heap.clear()


class AllOf:
    """Several waiters under one deadline (one heap entry for a whole batch)."""

    __slots__ = ("waiters",)

    def __init__(self, waiters: list) -> None:
        self.waiters = waiters

    def done(self) -> bool:
        return all(w.done() for w in self.waiters)

    def set_exception(self, exc: BaseException) -> None:
        for w in self.waiters:
            if not w.done():
                w.set_exception(exc)
