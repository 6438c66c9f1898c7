"""The one path committed entries take to the state machine (etcd's Ready.CommittedEntries
and Advance, with a queue between them). The driver reads committed entries from the log in
bounded batches and queues them in index order, with the snapshots to load between them; the
applier (statemachine/caller.py) takes each item, applies it and answers through the item's
`done` (set_result / set_exception, as on a future): the only way back, etcd's Advance.
The answer is handled at once, in the applier's task, not a turn of the loop later: the
driver's applied index must never trail the state machine's, or a watch changing from
history to the live changes (kv/server/watch.py) would miss the ones published in between, and a
read would be answered with an index older than the state it read.

Backpressure: at most `depth` items are handed out and not done yet, and the next batch is
read from the log only when one is done, so a slow state machine leaves the backlog in the
ledger, not in memory. Compaction cannot overtake the reads: it stays behind what the state
machine applied (snapshot/manager.py), which is behind what was read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from .messages import Entry, SnapshotMeta

log = logging.getLogger("kv.raft.committed")

BATCH_ENTRIES = 2048
BATCH_BYTES = 8 << 20
DEPTH = 2  # one item being applied, one read ahead


@dataclass(slots=True)
class CommittedBatch:
    """Committed entries in index order, right after the previous item's."""

    entries: list[Entry]
    awaited: Container[int]  # indexes of proposals made here whose result someone waits for
    done: Reply  # the applier sets the results (one per entry), or its failure


@dataclass(slots=True)
class SnapshotLoad:
    """A snapshot from the leader replaced the log: load it into the state machine. The next
    batch starts right after it; no entry it covers is handed out before it."""

    meta: SnapshotMeta
    done: Reply  # the applier sets None once the state machine holds it, or its failure


CommittedItem = CommittedBatch | SnapshotLoad


class Reply:
    """The applier's answer to one item, handed to the feed at once."""

    __slots__ = ("_finish",)

    def __init__(self, finish: Callable[[Any, BaseException | None], None]) -> None:
        self._finish = finish

    def set_result(self, result: Any) -> None:
        self._finish(result, None)

    def set_exception(self, exc: BaseException) -> None:
        self._finish(None, exc)


class CommittedFeed:
    """The driver's side: told what is committed and when a snapshot replaces the log; hands
    what comes back to `on_applied(entries, results)`, `on_loaded(index)`, `on_failed(exc)`."""

    def __init__(
        self,
        read: Callable[[int, int, int], list[Entry]],  # (lo, hi, max_bytes) -> entries [lo, hi)
        applied_index: int,
        awaited: Container[int],  # a live view: the driver's waiting proposals
        *,
        on_applied: Callable[[Sequence[Entry], Sequence[Any]], None],
        on_loaded: Callable[[int], None],
        on_failed: Callable[[BaseException], None],
        batch_entries: int = BATCH_ENTRIES,
        batch_bytes: int = BATCH_BYTES,
        depth: int = DEPTH,
    ) -> None:
        self._read = read
        self._awaited = awaited
        self._on_applied, self._on_loaded, self._on_failed = on_applied, on_loaded, on_failed
        self._batch_entries, self._batch_bytes, self._depth = batch_entries, batch_bytes, depth
        self._commit = applied_index  # entries up to here may be applied
        self._read_to = applied_index  # the last index handed out (a restart replays after it)
        self._installing: int | None = None  # the snapshot the log was reset to, not loaded yet
        self._queue: asyncio.Queue[CommittedItem] = asyncio.Queue()
        self._out = 0  # items handed out whose done is not set yet

    async def get(self) -> CommittedItem:
        """The applier's side: the next item, in order."""
        return await self._queue.get()

    def commit(self, index: int) -> None:
        """Entries up to index are committed (and durable here)."""
        if index > self._commit:
            self._commit = index
            self._fill()

    def snapshot_reset(self, index: int) -> None:
        """The core reset the log to a snapshot at index (the write is not done yet). The
        items not taken yet are below it: drop them, so that none of them is ever applied,
        and read nothing until the snapshot is loaded (the log below it is gone)."""
        self._installing = index
        while not self._queue.empty():
            self._queue.get_nowait()
            self._out -= 1

    def snapshot_durable(self, meta: SnapshotMeta) -> None:
        """The ledger holds the reset to meta: hand the snapshot out to be loaded (unless a
        newer one replaced the log meanwhile; that one follows)."""
        if meta.index == self._installing:
            self._hand_out(SnapshotLoad(meta, self._reply(meta)))

    def _fill(self) -> None:
        while self._out < self._depth and self._installing is None and self._read_to < self._commit:
            hi = min(self._commit, self._read_to + self._batch_entries)
            entries = self._read(self._read_to + 1, hi + 1, self._batch_bytes)
            self._read_to = entries[-1].index
            self._hand_out(CommittedBatch(entries, self._awaited, self._reply(entries)))

    def _hand_out(self, item: CommittedItem) -> None:
        self._out += 1
        self._queue.put_nowait(item)

    def _reply(self, handed: list[Entry] | SnapshotMeta) -> Reply:
        return Reply(partial(self._finished, handed))

    def _finished(self, handed: list[Entry] | SnapshotMeta, result: Any, exc: BaseException | None) -> None:
        self._out -= 1
        if exc is not None:
            self._on_failed(exc)  # the applier's own log line said why
            return
        try:
            if type(handed) is list:
                self._on_applied(handed, result)
            else:
                index = handed.index
                self._read_to = index
                if self._installing == index:
                    self._installing = None
                self._on_loaded(index)
            self._fill()
        except Exception as e:  # a failed ledger read, a bug: stop rather than stall here
            log.exception("committed entries after index %d cannot be handed out", self._read_to)
            self._on_failed(e)
