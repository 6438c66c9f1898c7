"""Deadlines for many futures with one timer: a request that is not answered in time fails
with the error the caller chose, without a task or timer of its own.

Requests are filed in buckets of GRAIN seconds (a deadline is rounded up, so it fails at
most GRAIN late and never early) and a bucket is looked at once, when it is due. Nearly
every request is answered long before its deadline: this keeps what it costs to file and
forget one to a dict lookup and a list append. (A heap of single deadlines cost 6-8 % of a
busy leader's event loop, pushing and later popping one entry per write.)
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Callable

GRAIN = 0.01


class Deadlines:
    def __init__(self, make_error: Callable[[], BaseException]) -> None:
        # make_error gives each expired waiter its own exception instance
        self._make_error = make_error
        self._buckets: dict[int, list] = {}
        self._due: list[int] = []  # heap of the buckets' numbers (their deadline / GRAIN)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0

    def add(self, deadline: float, fut) -> None:
        """Fail fut at `deadline` (loop.time()) unless it is done by then."""
        n = math.ceil(deadline / GRAIN)
        bucket = self._buckets.get(n)
        if bucket is not None:
            bucket.append(fut)
            return
        self._buckets[n] = [fut]
        heapq.heappush(self._due, n)
        if self._timer is None or n < self._timer_at:
            self._arm()

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._due:
            self._timer_at = self._due[0]
            self._timer = asyncio.get_running_loop().call_at(self._timer_at * GRAIN, self._fire)

    def _fire(self) -> None:
        self._timer = None
        now = asyncio.get_running_loop().time()
        due = self._due
        while due and due[0] * GRAIN <= now:
            for fut in self._buckets.pop(heapq.heappop(due)):
                if not fut.done():
                    fut.set_exception(self._make_error())
        self._arm()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._buckets.clear()
        self._due.clear()


class AllOf:
    """Several waiters under one deadline (one entry for a whole batch)."""

    __slots__ = ("waiters",)

    def __init__(self, waiters: list) -> None:
        self.waiters = waiters

    def done(self) -> bool:
        return all(w.done() for w in self.waiters)

    def set_exception(self, exc: BaseException) -> None:
        for w in self.waiters:
            if not w.done():
                w.set_exception(exc)
