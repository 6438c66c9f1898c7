"""The FSM caller (DLedger's StateMachineCaller): applies committed entries to the state
machine strictly in index order, in batches, in a task of its own so that replication never
waits for it. It is also the only place a snapshot is loaded into the state machine, so
loads and applies never interleave. The driver reads the entries and hands them out
(raft/committed.py); what the caller answers goes back through each item's `done`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import operator
import time
from collections.abc import Awaitable, Callable, Sequence

from ..raft import failpoints
from ..raft.committed import CommittedBatch, CommittedFeed, CommittedItem
from ..raft.disk import DISK_RETRY_S, free_bytes, is_disk_full
from ..raft.errors import KVError
from ..raft.messages import SnapshotMeta
from .protocol import StateMachine

_DATA = operator.attrgetter("data")

log = logging.getLogger("kv.statemachine.caller")

ROOM_TO_REOPEN = 4 << 20  # free bytes before LevelDB is opened again after a full disk (it writes a new log and manifest)


class FSMCaller:
    """Takes what `committed` (the driver's raft/committed.py feed) hands out, in order,
    and answers each item through its `done`: the results of a batch, or the failure that
    stops the node."""

    def __init__(
        self,
        sm: StateMachine,
        committed: CommittedFeed,
        node_id: str,
        *,
        load_snapshot: Callable[[SnapshotMeta], None] | None = None,
        after_apply: Sequence[Callable[[int, int], None]] = (),  # (applied index, bytes of the entries applied)
        after_load: Sequence[Callable[[int], None]] = (),
        observe_apply: Callable[[float], None] | None = None,  # seconds per applied batch (metrics)
        after_reopen: Sequence[Callable[[], None]] = (),  # the state machine was opened again from disk
        before_close: Sequence[Callable[[], Awaitable[None]]] = (),  # its database is about to be closed (views of it let go)
    ) -> None:
        self.sm = sm
        self._committed = committed
        self.node_id = node_id
        self._load_snapshot = load_snapshot
        self.applied = sm.applied()[0]
        self._task: asyncio.Task | None = None
        self._waiting = False  # for the next item: stop() may cancel the task there
        self._stopping = False
        self._after_apply = tuple(after_apply)  # e.g. the snapshot policy
        self._after_load = tuple(after_load)  # a snapshot replaced the state up to this index
        self._observe_apply = observe_apply
        self._after_reopen = tuple(after_reopen)
        self._before_close = tuple(before_close)
        self.stalled: Exception | None = None  # the failed apply waiting for disk space

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"fsm-{self.node_id}")

    async def stop(self) -> None:
        """Let the item in hand finish (a snapshot load runs in a thread), then stop."""
        self._stopping = True
        if self._task is not None:
            if self._waiting:
                self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while not self._stopping:
            self._waiting = True
            item = await self._committed.get()
            self._waiting = False
            while True:
                try:
                    if type(item) is CommittedBatch:
                        item.done.set_result(self._apply(item))
                    else:
                        await self._load(item.meta)
                        item.done.set_result(None)
                    break
                except Exception as e:
                    if not is_disk_full(e, self.sm.path):
                        item.done.set_exception(self._failed(e, item))
                        return
                    if not await self._wait_for_space(e):
                        return  # the node stops: a restart applies the batch again
            await asyncio.sleep(0)  # the answer may have queued the next batch: let replication and requests run first

    async def _wait_for_space(self, e: Exception) -> bool:
        """The disk filled under the state machine: nothing of the batch was written (it is
        one WriteBatch). Wait, open the database again (LevelDB refuses every write after a
        failed one until then), and apply the same batch again; the node serves reads
        meanwhile, and kv/server/diskguard.py refuses writes. False: the node stopped first."""
        log.error("node %s: the disk is full (%s); applying waits for space and is tried again every second", self.node_id, e)
        self.stalled = e
        while not self._stopping:
            await asyncio.sleep(DISK_RETRY_S)
            if free_bytes(self.sm.path) < ROOM_TO_REOPEN:
                continue  # the database stays open for reads until there is room to open it again
            try:
                for hook in self._before_close:
                    await hook()
                self.sm.reopen()
            except Exception as again:
                if is_disk_full(again, self.sm.path):
                    continue
                raise
            for hook in self._after_reopen:
                hook()
            self.stalled = None
            log.warning("node %s: the state machine is open again: applying goes on", self.node_id)
            return True
        return False

    def _apply(self, batch: CommittedBatch) -> list:
        entries = batch.entries
        failpoints.raise_at("apply.raise")
        t0 = time.perf_counter()
        results = self.sm.apply(entries, batch.awaited)
        if self._observe_apply is not None:
            self._observe_apply(time.perf_counter() - t0)
        self.applied = entries[-1].index
        if self._after_apply:
            size = sum(map(len, map(_DATA, entries)))
            for hook in self._after_apply:
                hook(self.applied, size)
        return results

    async def _load(self, meta: SnapshotMeta) -> None:
        failpoints.hit("install.after_reset")  # the ledger is reset; the state is not loaded
        log.info("node %s: loading snapshot %d/%d into the state machine", self.node_id, meta.index, meta.term)
        for hook in self._before_close:
            await hook()
        self.sm.close_for_restore()  # (here, not in the worker: no read of it is running now)
        await asyncio.get_running_loop().run_in_executor(None, self._load_snapshot, meta)
        self.applied = meta.index
        for hook in self._after_load:
            hook(meta.index)

    def _failed(self, e: Exception, item: CommittedItem) -> ApplyFailed:
        # The state machine cannot go on (disk full, corrupt state, a bug): the node stops
        # rather than serve from a state that silently stopped moving. One line says where;
        # nothing of the batch was applied (it is one WriteBatch), so a restart retries
        # from the same index.
        first = self.applied + 1
        last = item.entries[-1].index if type(item) is CommittedBatch else item.meta.index
        log.error(
            "node %s: cannot apply committed entry %d (batch up to %d): %s: %s (at %s); stopping the node. "
            "A restart applies again from index %d",
            self.node_id, first, last, type(e).__name__, e, _where(e), first,
        )
        log.debug("apply failure", exc_info=True)
        return ApplyFailed(f"cannot apply committed entry {first}: {type(e).__name__}: {e}")


class ApplyFailed(KVError):
    """The state machine failed to apply a committed entry; the node stopped."""


def _where(e: BaseException) -> str:
    """file:line of the innermost frame of e's traceback."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return "?"
    return f"{os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}"
