"""Watches: every committed change under a prefix, in commit order, each exactly once, from
any revision the node's history still holds (statemachine/history.py).

A watch starts at an index (its cursor). While the cursor is at or below the applied index
it reads history: the changes the state machine recorded, each with the key before and
after it. Once it has caught up it joins the live fan-out: the state machine hands
each applied batch's changes to the WatchHub, which finds the watches whose prefix matches
(one dictionary probe per distinct prefix length, however many watches there are) and appends
the event to their buffers. Going from history to live happens without an await in between,
so nothing is missed or seen twice.

Each buffer is bounded (bytes of keys and values), and so is what all of a node's buffers
hold together (--watch-budget-bytes). A watch that falls further behind, or wants more when
the node's budget is spent, is taken out of the fan-out and its buffer dropped: an
in-process watch then reads on from the history; a stream (HTTP) ends with SlowWatcher, and
its client resumes from the last index it saw + 1. History is read a chunk at a time, and a
stream sends each chunk before it reads the next.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import Callable

from ..common.results import Event
from ..errors import KVError, SlowWatcher, WatchCompacted
from ..statemachine.commands import KeyValue
from .samples import Sample, gauge

# Changes (of every key) read per step of a catch-up: a stream sends each step's events
# before it reads the next (waiting for the socket to drain).
HISTORY_CHUNK_CHANGES = 256
EVENT_OVERHEAD = 100  # bytes an event costs a buffer beyond its key and value


class RichEvent(Event):
    """An Event with the key as etcd's API reports it: `kv` after the change (for a delete,
    its key and the deleting index), `prev` before it (None for a new key)."""

    kv: KeyValue
    prev: KeyValue | None


def rich_event(index: int, key: str, value: bytes | None, kv: KeyValue, prev: KeyValue | None) -> RichEvent:
    ev = RichEvent(index, key, value)
    ev.kv, ev.prev = kv, prev
    return ev


class Watch:
    """An async iterator of Events under a prefix, in commit order. Close it when done.
    `next_batch` is the batch-at-a-time interface the HTTP stream uses."""

    __slots__ = ("_hub", "prefix", "rich", "cursor", "_limit", "_resume", "_buf", "_bytes", "_live", "_wake", "_failure", "_closed", "_pending", "__weakref__")

    def __init__(self, hub: WatchHub, prefix: str, cursor: int, buffer_bytes: int, resume_when_behind: bool, rich: bool = False) -> None:
        self._hub, self.prefix, self.rich = hub, prefix, rich  # rich: wants RichEvents (the node makes them while one is open)
        self.cursor = cursor  # every change before this index has been handed out
        self._limit, self._resume = buffer_bytes, resume_when_behind
        self._buf: list[Event] = []
        self._bytes = 0
        self._live = False  # in the hub's fan-out
        self._wake: asyncio.Future | None = None
        self._failure: KVError | None = None
        self._closed = False
        self._pending: deque[Event] = deque()  # a batch being iterated one event at a time

    # -- the hub's side ----------------------------------------------------------------------

    def _push(self, ev: Event, size: int) -> bool:
        """Buffer an event; False when the buffer overflowed (the hub drops this watch)."""
        if not self._live or ev.index < self.cursor:
            return True
        hub = self._hub
        if self._buf and hub.buffered + size > hub.budget:
            # The node's watches together hold as much as it allows: the one that is behind
            # and wants more goes (one that has taken everything still gets the change).
            return self._behind(f"the node's watches hold {hub.buffered} bytes of changes not yet taken, its limit (--watch-budget-bytes)")
        self._buf.append(ev)
        self._bytes += size
        hub.buffered += size
        self._notify()
        if self._bytes <= self._limit or len(self._buf) == 1:  # one change larger than the bound still passes
            return True
        return self._behind(f"this watcher fell more than {self._limit} bytes of changes behind (--watch-buffer-bytes)")

    def _behind(self, why: str) -> bool:
        """Out of the fan-out, its buffer dropped: an in-process watch reads on from the
        ledger; a stream ends with SlowWatcher. Returns False (the hub drops it)."""
        self._live = False
        self._drop_buffer()
        if not self._resume:
            self._failure = SlowWatcher(f"{why}; it was stopped: resume from index {self.cursor} (read faster, or watch a narrower prefix)", self.cursor)
        self._notify()
        return False

    def _drop_buffer(self) -> list[Event]:
        out, self._buf = self._buf, []
        self._hub.buffered -= self._bytes
        self._bytes = 0
        return out

    def _fail(self, failure: KVError) -> None:
        self._live = False
        self._failure = failure
        self._notify()

    def _notify(self) -> None:
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)

    # -- the consumer's side -----------------------------------------------------------------

    async def next_batch(self, timeout: float | None = None) -> tuple[list[Event], int] | None:
        """The next events (whole indexes only) and the index through which every change
        under the prefix has now been handed out; ([], that index) when `timeout` seconds
        passed without a change; None once the watch is closed. Raises WatchCompacted when
        the history it needs is gone, SlowWatcher when it fell too far behind."""
        while not self._closed:
            if self._buf:
                out = self._drop_buffer()
                self.cursor = out[-1].index + 1
                return out, self._hub.applied_index()
            if self._failure is not None:
                raise self._ended()
            if not self._live:
                events = self._hub.catch_up(self)
                if events or not self._live:
                    await asyncio.sleep(0)  # a long catch-up lets the rest of the node run
                    return events, self.cursor - 1
                continue
            loop = asyncio.get_running_loop()
            self._wake = fut = loop.create_future()
            timer = loop.call_later(timeout, self._notify) if timeout is not None else None
            try:
                await fut
            finally:
                self._wake = None
                if timer is not None:
                    timer.cancel()
            if not self._buf and self._failure is None and not self._closed and self._live:
                # (not below where the watch started: one from an index ahead of this node)
                return [], max(self._hub.applied_index(), self.cursor - 1)
        return None

    def _ended(self) -> KVError:
        """A failed watch is over: close it, and hand its failure over. Neither the watch nor
        the raising frame keeps it: raised, its traceback holds that frame, which holds the
        watch, a cycle that kept every watch cut off as a SlowWatcher (and its buffers)
        alive until a full collection, which kv serve's gc thresholds make rare."""
        failure = self._failure
        self.close()
        return failure

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> Event:
        while not self._pending:
            got = await self.next_batch()
            if got is None:
                raise StopAsyncIteration
            self._pending.extend(got[0])
        return self._pending.popleft()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._hub.closed(self)
            self._drop_buffer()
            self._failure = None
            self._pending.clear()
            self._notify()

    async def __aenter__(self) -> Watch:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class WatchHub:
    """The watches of one node and the one fan-out of its applied changes to them.

    What it reads of the node: `applied_index()`; `log_range()`, the (first, last) indexes
    of the committed entries its ledger holds; `history(start, prefix, max_changes)`, the
    recorded changes from a revision on and the revision to go on from (the state
    machine's history_changes), and `history_floor()`, the oldest revision it holds."""

    def __init__(
        self,
        budget: int,
        applied_index: Callable[[], int],
        log_range: Callable[[], tuple[int, int]],
        history: Callable[[int, str, int], tuple[list, int]],
        history_floor: Callable[[], int],
        want_rich: Callable[[bool], None] = lambda on: None,
    ) -> None:
        """`want_rich(on)`: whether the state machine should make rich changes (the key
        before and after each one) for the rich watches open."""
        self.applied_index, self._log_range = applied_index, log_range
        self._want_rich, self._rich_open = want_rich, 0
        self._history, self._history_floor = history, history_floor
        self.budget = budget  # bytes all watches together may hold for their readers (--watch-budget-bytes)
        self.buffered = 0
        self._by_prefix: dict[str, set[Watch]] = {}
        self._lengths: list[int] = []  # the distinct prefix lengths, to probe _by_prefix with
        self._open: weakref.WeakSet[Watch] = weakref.WeakSet()

    def open(self, prefix: str, start_index: int | None, buffer_bytes: int, resume_when_behind: bool, rich: bool = False) -> Watch:
        if start_index is None:
            start_index = self.applied_index() + 1
        self.check_start(start_index, rich)
        w = Watch(self, prefix, start_index, buffer_bytes, resume_when_behind, rich)
        self._open.add(w)
        if rich:
            self._rich_open += 1
            if self._rich_open == 1:
                self._want_rich(True)
        return w

    def floor(self, rich: bool = False) -> int:
        """The first index a watch can start at on this node: as far back as the history
        goes for etcd's watches (rich); no further back than the ledger for ledgerkv's own,
        whose contract says a start below the ledger is compacted (DESIGN.md, Watch)."""
        floor = self._history_floor()
        return floor if rich else max(floor, self._log_range()[0])

    def check_start(self, index: int, rich: bool = False) -> None:
        floor = self.floor(rich)
        if index < floor:
            raise WatchCompacted(
                f"changes before index {floor} are no longer kept on this node (compacted); read the prefix "
                "(scan_page, or GET /v1/kv?prefix=..., answers the index it read at) and watch from that index + 1",
                self._log_range()[0] - 1, floor,
            )

    def catch_up(self, w: Watch) -> list[Event]:
        """One step of reading history for w: the events of the next chunk of it, or, once
        w has caught up, nothing — and w is in the fan-out."""
        self.check_start(w.cursor, w.rich)
        changes, after = self._history(w.cursor, w.prefix, HISTORY_CHUNK_CHANGES)
        # (a start ahead of what is applied stays where it is: the changes before it were
        # asked not to come, and history read through now would have moved it back)
        w.cursor = max(w.cursor, after)
        if not changes and w.cursor > self.applied_index():
            self._add(w)
            return []
        if w.rich:
            return [rich_event(*change) for change in changes]
        return [Event(index, key, value) for index, key, value, _, _ in changes]

    def _add(self, w: Watch) -> None:
        w._live = True
        ws = self._by_prefix.get(w.prefix)
        if ws is None:
            ws = self._by_prefix[w.prefix] = set()
            self._lengths = sorted({len(p) for p in self._by_prefix})
        ws.add(w)

    def closed(self, w: Watch) -> None:
        self.remove(w)
        if w.rich:
            self._rich_open -= 1
            if self._rich_open == 0:
                self._want_rich(False)

    def remove(self, w: Watch) -> None:
        w._live = False
        ws = self._by_prefix.get(w.prefix)
        if ws is not None:
            ws.discard(w)
            if not ws:
                del self._by_prefix[w.prefix]
                self._lengths = sorted({len(p) for p in self._by_prefix})

    def publish(self, changes) -> None:
        """The state machine applied a batch: hand its changes to the matching watches."""
        if not self._by_prefix:
            return
        lengths, by_prefix = self._lengths, self._by_prefix
        behind = []
        for change in changes:
            index, key, value = change[0], change[1], change[2]
            ev = None
            for n in lengths:
                if n > len(key):  # (a longer prefix cannot hold the key: key[:n] would be the key again, matched once more)
                    break
                ws = by_prefix.get(key[:n])
                if not ws:
                    continue
                if ev is None:
                    ev = Event(index, key, value) if len(change) == 3 else rich_event(*change)
                    size = len(key) + (len(value) if value is not None else 0) + EVENT_OVERHEAD
                for w in ws:
                    if not w._push(ev, size):
                        behind.append(w)
        for w in behind:
            self.remove(w)

    def snapshot_loaded(self, index: int) -> None:
        """This node's state was replaced by a snapshot up to index: the changes before it
        never passed through here, so every watch that still needed them reads them from
        the history the snapshot brought (or ends, compacted, if it does not go back that far)."""
        for ws in list(self._by_prefix.values()):
            for w in list(ws):
                if w.cursor <= index:
                    self.remove(w)
                    if w.cursor >= self.floor(w.rich):
                        w._notify()
                    else:
                        w._fail(WatchCompacted(
                            f"this node caught up by installing a snapshot at index {index}; the changes from {w.cursor} "
                            "are not in its log: resume on another node", index,
                        ))

    def close_all(self) -> None:
        for w in list(self._open):
            w.close()

    def reserve(self, n: int) -> bool:
        """Count n bytes a stream is about to send against the budget (release them once
        sent); False, and nothing counted, when they would go over it."""
        if self.buffered + n > self.budget and n:
            return False
        self.buffered += n
        return True

    def hold(self, n: int) -> None:
        """Count n bytes a stream holds whatever the budget (a batch that waited for its
        stream to drain); release them once sent."""
        self.buffered += n

    def release(self, n: int) -> None:
        self.buffered -= n

    def stats(self) -> tuple[int, int]:
        """(open watches, bytes buffered in them)."""
        return len(self._open), self.buffered

    def samples(self) -> list[Sample]:
        watches, buffered = self.stats()
        return [
            gauge("kv_watches", "Open watches on this node (in-process and streams).", watches),
            gauge("kv_watch_buffered_bytes", "Bytes of changes buffered for watches that have not taken them yet.", buffered),
        ]
