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
from collections.abc import Callable, Container, Sequence
from typing import Any, Protocol

from ..raft import failpoints
from ..raft.errors import KVError
from ..raft.messages import Entry, SnapshotMeta
from .protocol import StateMachine

log = logging.getLogger("kv.statemachine.caller")


class ApplyDriver(Protocol):
    """What the FSM caller needs from the Raft driver (raft/node.py's RaftNode)."""

    id: str

    @property
    def awaited(self) -> Container[int]: ...

    def entries(self, lo: int, hi: int, max_bytes: int = ...) -> list[Entry]: ...

    def applied(self, entries: Sequence[Entry], results: Sequence[Any]) -> None: ...

    def reset_applied(self, index: int) -> None: ...

    def fail(self, e: BaseException) -> None: ...


class FSMCaller:
    """Made before the driver, so that its `on_apply` and `on_snapshot` go to the driver's
    constructor; `start(driver)` then binds the driver it reads entries from."""

    def __init__(
        self,
        sm: StateMachine,
        *,
        load_snapshot: Callable[[SnapshotMeta], None] | None = None,
        after_apply: Sequence[Callable[[int], None]] = (),
        after_load: Sequence[Callable[[int], None]] = (),
        batch_entries: int = 2048,
        batch_bytes: int = 8 << 20,
        observe_apply: Callable[[float], None] | None = None,  # seconds per applied batch (metrics)
    ) -> None:
        self.node: ApplyDriver | None = None
        self.sm = sm
        self._load_snapshot = load_snapshot
        self.batch_entries, self.batch_bytes = batch_entries, batch_bytes
        self.applied = sm.applied()[0]
        self._target = self.applied
        self._snapshots: list[SnapshotMeta] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._after_apply = tuple(after_apply)  # e.g. the snapshot policy
        self._after_load = tuple(after_load)  # a snapshot replaced the state up to this index
        self._observe_apply = observe_apply
        self.failure: BaseException | None = None

    def start(self, node: ApplyDriver) -> None:
        self.node = node
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"fsm-{node.id}")

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    def on_apply(self, index: int) -> None:
        """The driver's hook: entries up to index are committed."""
        if index > self._target:
            self._target = index
            self._wake.set()

    def on_snapshot(self, meta: SnapshotMeta) -> None:
        """The driver's hook: a snapshot from the leader replaced the log."""
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
                        for hook in self._after_load:
                            hook(meta.index)
                while self.applied < self._target and not self._stopping and not self._snapshots:
                    hi = min(self._target, self.applied + self.batch_entries)
                    entries = self.node.entries(self.applied + 1, hi + 1, self.batch_bytes)
                    failpoints.raise_at("apply.raise")
                    t0 = time.perf_counter()
                    results = self.sm.apply(entries, self.node.awaited)
                    if self._observe_apply is not None:
                        self._observe_apply(time.perf_counter() - t0)
                    self.applied = entries[-1].index
                    self.node.applied(entries, results)
                    for hook in self._after_apply:
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
