"""The disk under a node's data dir (etcd's NOSPACE alarm): a reserve of free space, checked
once a second and whenever the writes proposed since the last look could have used a quarter
of it, below which the node takes no writes, and says so, until there is room again.

With the reserve, LMDB and LevelDB do not run into a full disk in the middle of a write; if
they do all the same (a reserve of 0, the disk filled by something else at once), the ledger
write waits and is tried again (raft/node.py), and so is the state machine's batch
(statemachine/caller.py): the node stays up, serving reads, and goes on by itself."""

from __future__ import annotations

import logging

from ..raft.disk import free_bytes
from .samples import Sample, gauge
from .sweep import Sweep

log = logging.getLogger("kv.diskguard")

CHECK_S = 1.0
# Disk bytes a proposed byte can take before the ledger compacts: the ledger's copy,
# LevelDB's log and its table (with headers and indexes on each).
AMPLIFICATION = 4


class DiskGuard:
    def __init__(self, path: str, min_free_bytes: int, node_id: str, stalled=lambda: None) -> None:
        """`stalled()`: a write that found the disk full and waits to be tried again, if any."""
        self.path, self.min_free_bytes, self._stalled = path, min_free_bytes, stalled
        self.free: int | None = None
        self.low = False
        self._proposed = 0  # bytes proposed since the last look at the disk
        self._sweep = Sweep(CHECK_S, self._check, f"disk-{node_id}")
        self.start, self.stop = self._sweep.start, self._sweep.stop

    async def _check(self, now: float = 0.0) -> None:
        self.check()

    def admit(self, nbytes: int) -> str | None:
        """Why a proposal of nbytes is refused now, or None. A fast writer can fill a
        reserve within the second between two timed looks: it makes its own."""
        self._proposed += nbytes
        if self.min_free_bytes and self._proposed * AMPLIFICATION * 4 >= self.min_free_bytes:
            self.check()
        return self.why()

    def check(self) -> None:
        self._proposed = 0
        try:
            self.free = free_bytes(self.path)
        except OSError as e:
            log.warning("cannot read the free space of %s: %s", self.path, e)
            return
        low = self.free < self.min_free_bytes
        if low != self.low:
            if low:
                log.error("NOSPACE: %s; writes are refused until there is room again (reads go on)", self._low_why())
            else:
                log.warning("NOSPACE cleared: %d MiB free on the disk of %s; writes go on", self.free >> 20, self.path)
        self.low = low

    def _low_why(self) -> str:
        return (
            f"the disk of {self.path} has {self.free >> 20} MiB free, less than the node keeps in reserve "
            f"({self.min_free_bytes >> 20} MiB, --min-free-bytes): free some space (or grow the disk); writes resume by themselves"
        )

    def why(self) -> str | None:
        """Why writes are refused now, or None."""
        if self.low:
            return self._low_why()
        stalled = self._stalled()
        if stalled is not None:
            return f"the disk of {self.path} is full ({stalled}): free some space; writes resume by themselves"
        return None

    def alarms(self) -> list[dict]:
        why = self.why()
        return [{"alarm": "NOSPACE", "message": why}] if why else []

    def samples(self) -> list[Sample]:
        return [
            gauge("kv_disk_free_bytes", "Free bytes on the disk of the data dir (as last checked, once a second).", self.free or 0),
            gauge("kv_alarm_nospace", "1 while the node refuses writes for lack of disk space (below --min-free-bytes, or full).", 1.0 if self.why() else 0.0),
        ]
