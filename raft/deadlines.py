"""Deadlines for many futures with one timer: a request that is not answered in time fails
with the error the caller chose, without a task or timer of its own.

Requests are filed in buckets of 1/PER_S seconds (a deadline is rounded up, so it fails at
most one bucket late, never early) and a bucket is looked at once, when it is due. Nearly
every request is answered long before its deadline: this keeps what it costs to file and
forget one to a dict lookup and a list append. (A heap of single deadlines cost 6-8 % of a
busy leader's event loop, pushing and later popping one entry per write.)

A bucket's time is n / PER_S: uvloop's clock is whole milliseconds divided by 1000, so
the two are the same float when the bucket's timer fires (n * 0.01 may be one float step
above it, and the timer would find nothing due and spin until the next millisecond).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import math
from collections.abc import Callable

PER_S = 100  # buckets per second


def bucket_of(deadline: float) -> int | None:
    """The bucket a deadline (loop.time()) falls due in, rounded up (never early); None for
    one that never does (an infinite timeout)."""
    if not math.isfinite(deadline):
        if deadline > 0 or deadline != deadline:
            return None
        deadline = 0.0
    n = math.ceil(deadline * PER_S)
    if n / PER_S < deadline:  # the product was rounded down
        n += 1
    return n


class Deadlines:
    def __init__(self, make_error: Callable[[], BaseException]) -> None:
        # make_error gives each expired waiter its own exception instance
        self._make_error = make_error
        self._buckets: dict[int, dict] = {}  # (dicts: discard() takes one out)
        self._due: list[int] = []  # heap of the buckets' numbers (deadline * PER_S, rounded up)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0
        self._closed = False

    def add(self, deadline: float, fut) -> int | None:
        """Fail fut at `deadline` (loop.time()) unless it is done by then. After close(),
        nothing is filed (and no timer armed): the owner fails what it still holds.
        Returns the bucket it is filed in, for discard (None: not filed)."""
        if self._closed:
            return None
        n = bucket_of(deadline)
        if n is None:
            return None
        bucket = self._buckets.get(n)
        if bucket is not None:
            bucket[fut] = None
            return n
        self._buckets[n] = {fut: None}
        heapq.heappush(self._due, n)
        if self._timer is None or n < self._timer_at:
            self._arm(0.0)
        return n

    @contextlib.contextmanager
    def held(self, deadline: float | None, fut):
        """fut under `deadline` (None: none) while the block runs, and forgotten when it ends,
        answered or not (what fut holds need not live on until its deadline)."""
        bucket = self.add(deadline, fut) if deadline is not None else None
        try:
            yield
        finally:
            if bucket is not None:
                self.discard(bucket, fut)

    def discard(self, bucket: int, fut) -> None:
        """Forget fut, done long before its deadline (what it holds need not live until then)."""
        b = self._buckets.get(bucket)
        if b is not None:
            b.pop(fut, None)

    def _arm(self, not_before: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._due:
            self._timer_at = self._due[0]
            self._timer = asyncio.get_running_loop().call_at(max(self._timer_at / PER_S, not_before), self._fire)

    def _fire(self) -> None:
        self._timer = None
        now = asyncio.get_running_loop().time()
        due = self._due
        fired = False
        while due and due[0] / PER_S <= now:
            fired = True
            for fut in self._buckets.pop(heapq.heappop(due)):
                if not fut.done():
                    fut.set_exception(self._make_error())
        # A loop whose timers fire a little before their time (asyncio allows its clock's
        # resolution) comes back a millisecond later, instead of at once and again.
        self._arm(0.0 if fired else now + 0.001)

    def close(self) -> None:
        self._closed = True
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
