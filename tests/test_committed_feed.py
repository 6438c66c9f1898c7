"""raft/committed.py: committed entries reach the applier in bounded batches, in order, and
what it answers comes back only through each item's reply, at once."""

from __future__ import annotations

import asyncio

from kv.raft.committed import CommittedBatch, CommittedFeed, SnapshotLoad
from kv.raft.messages import Entry, SnapshotMeta


class Driver:
    """The driver's side of a feed over a log of entries 1..100, recording what comes back."""

    def __init__(self, applied_index: int = 0) -> None:
        self.reads: list[tuple[int, int]] = []
        self.applied: list[int] = []
        self.loaded: list[int] = []
        self.failed: list[BaseException] = []
        self.read_error: BaseException | None = None
        self.feed = CommittedFeed(
            self.read,
            applied_index,
            set(),
            on_applied=lambda entries, results: self.applied.extend(e.index for e in entries),
            on_loaded=self.loaded.append,
            on_failed=self.failed.append,
            batch_entries=10,
            batch_bytes=1 << 20,
            depth=2,
        )

    def read(self, lo: int, hi: int, max_bytes: int) -> list[Entry]:
        if self.read_error is not None:
            raise self.read_error
        self.reads.append((lo, hi))
        return [Entry(i, 1, 0, b"x") for i in range(lo, hi)]


async def take(feed: CommittedFeed):
    return await asyncio.wait_for(feed.get(), 1)


def answer(batch: CommittedBatch) -> None:
    batch.done.set_result([None] * len(batch.entries))


async def test_a_slow_applier_leaves_the_backlog_in_the_log():
    d = Driver(applied_index=5)
    d.feed.commit(100)
    assert d.reads == [(6, 16), (16, 26)]  # two batches out, the rest not read
    first = await take(d.feed)
    assert d.reads == [(6, 16), (16, 26)]  # taking is not finishing
    answer(first)
    assert d.applied == list(range(6, 16)) and d.reads[-1] == (26, 36)
    for _ in range(9):
        answer(await take(d.feed))
    assert d.applied == list(range(6, 101)) and d.reads[-1] == (96, 101)


async def test_a_snapshot_drops_what_was_not_taken_and_the_next_batch_follows_it():
    d = Driver()
    d.feed.commit(30)
    taken = await take(d.feed)  # being applied when the snapshot arrives
    d.feed.snapshot_reset(50)
    d.feed.commit(60)
    answer(taken)
    assert d.reads == [(1, 11), (11, 21)]  # nothing read below the snapshot after the reset
    d.feed.snapshot_durable(SnapshotMeta(50, 2, b""))
    load = await take(d.feed)
    assert type(load) is SnapshotLoad and load.meta.index == 50  # entries 11-20 were dropped
    load.done.set_result(None)
    assert d.loaded == [50] and d.applied == list(range(1, 11))
    assert (await take(d.feed)).entries[0].index == 51


async def test_only_the_newest_of_two_snapshots_is_loaded():
    d = Driver()
    d.feed.snapshot_reset(10)
    d.feed.snapshot_reset(20)
    d.feed.snapshot_durable(SnapshotMeta(10, 1, b""))
    d.feed.snapshot_durable(SnapshotMeta(20, 1, b""))
    assert (await take(d.feed)).meta.index == 20


async def test_a_failure_comes_back_and_nothing_more_is_read():
    d = Driver()
    d.feed.commit(100)
    boom = RuntimeError("disk full")
    (await take(d.feed)).done.set_exception(boom)
    assert d.failed == [boom] and d.applied == [] and len(d.reads) == 2


async def test_a_failed_read_stops_the_node_instead_of_stalling():
    d = Driver()
    d.feed.commit(100)
    d.read_error = boom = OSError("ledger read failed")
    answer(await take(d.feed))
    assert d.failed == [boom]
