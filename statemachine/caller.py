"""The FSM caller (DLedger's StateMachineCaller): applies committed entries to the state
machine strictly in index order, in batches, in a task of its own so that replication never
waits for it. It is also the only place a snapshot is loaded into the state machine, so
loads and applies never interleave.
"""

from __future__ import annotations

import asyncio
import logging
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
                    results = self.sm.apply(entries)
                    self.applied = entries[-1].index
                    self.node.applied(entries, results)
                    for hook in self.after_apply:
                        hook(self.applied)
                    if self.applied < self._target:
                        await asyncio.sleep(0)  # let replication and requests run between batches
        except Exception as e:
            # The state machine cannot go on (disk full, corrupt state): stop the node rather
            # than serve from a state that silently stopped moving.
            log.exception("node %s: applying failed; stopping the node", self.node.id)
            self.failure = e
            self.node.fail(e)
