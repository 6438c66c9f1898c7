"""The FSM caller (DLedger's StateMachineCaller): applies committed entries to the state
machine strictly in index order, in batches, in a task of its own so that replication never
waits for it. It is also the only place a snapshot is loaded into the state machine, so
loads and applies never interleave.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

from ..raft import failpoints
from ..raft.messages import SnapshotMeta
from ..raft.node import RaftNode
from .protocol import StateMachine

log = logging.getLogger("kv.statemachine.caller")


class FSMCaller:
    def __init__(
        self,
        node: RaftNode,
        sm: StateMachine,
        *,
        load_snapshot: Callable[[SnapshotMeta], None] | None = None,
        batch_entries: int = 2048,
        batch_bytes: int = 8 << 20,
    ) -> None:
        self.node = node
        self.sm = sm
        self._load_snapshot = load_snapshot
        self.batch_entries, self.batch_bytes = batch_entries, batch_bytes
        self.applied = sm.applied()[0]
        self._target = self.applied
        self._snapshots: list[SnapshotMeta] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.after_apply: list[Callable[[int], None]] = []  # e.g. the snapshot policy
        self.observe_apply: Callable[[float], None] | None = None  # seconds per applied batch (metrics)
        self.after_load: list[Callable[[int], None]] = []  # a snapshot replaced the state up to this index
        self.failure: BaseException | None = None
        node.on_applicable = self._on_applicable
        node.on_snapshot = self._on_snapshot

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"fsm-{self.node.id}")

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    def _on_applicable(self, index: int) -> None:
        if index > self._target:
            self._target = index
            self._wake.set()

    def _on_snapshot(self, meta: SnapshotMeta) -> None:
        self._snapshots.append(meta)
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self._stopping:
                await self._wake.wait()
                self._wake.clear()
                while self._snapshots and not self._stopping:
                    meta = self._snapshots.pop(0)
                    if meta.index > self.applied:
                        failpoints.hit("install.after_reset")  # the ledger is reset; the state is not loaded
                        log.info("node %s: loading snapshot %d/%d into the state machine", self.node.id, meta.index, meta.term)
                        await loop.run_in_executor(None, self._load_snapshot, meta)
                        self.applied = meta.index
                        self._target = max(self._target, meta.index)
                        self.node.reset_applied(meta.index)
                        for hook in self.after_load:
                            hook(meta.index)
                while self.applied < self._target and not self._stopping and not self._snapshots:
                    hi = min(self._target, self.applied + self.batch_entries)
                    entries = self.node.entries(self.applied + 1, hi + 1, self.batch_bytes)
                    failpoints.raise_at("apply.raise")
                    t0 = time.perf_counter()
                    results = self.sm.apply(entries, self.node.awaited)
                    if self.observe_apply is not None:
                        self.observe_apply(time.perf_counter() - t0)
                    self.applied = entries[-1].index
                    self.node.applied(entries, results)
                    for hook in self.after_apply:
                        hook(self.applied)
                    if self.applied < self._target:
                        await asyncio.sleep(0)  # let replication and requests run between batches
        except Exception as e:
            # The state machine cannot go on (disk full, corrupt state, a bug): stop the node
            # rather than serve from a state that silently stopped moving. One line says
            # where; nothing of the batch was applied (it is one WriteBatch), so a restart
            # retries from the same index.
            first = self.applied + 1
            log.error(
                "node %s: cannot apply committed entry %d (batch up to %d): %s: %s (at %s); stopping the node. "
                "A restart applies again from index %d",
                self.node.id, first, self._target, type(e).__name__, e, _where(e), first,
            )
            log.debug("apply failure", exc_info=True)
            self.failure = ApplyFailed(f"cannot apply committed entry {first}: {type(e).__name__}: {e}")
            self.node.fail(self.failure)


class ApplyFailed(Exception):
    """The state machine failed to apply a committed entry; the node stopped."""


def _where(e: BaseException) -> str:
    """file:line of the innermost frame of e's traceback."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return "?"
    return f"{os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}"
