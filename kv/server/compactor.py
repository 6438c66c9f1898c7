"""The history's keeper (statemachine/history.py): auto-compaction on the leader
(--auto-compaction-retention, through the log, so that every node compacts at the same
revision), and, on every node, the purge of the history records a Compact made unreachable,
in bounded batches on the node's loop.

A retention is a number of revisions ("100000": keep the last 100,000 revisions) or a time
("30m", "1h", "90s": keep what changed in that long; etcd's periodic mode); "0" keeps every
revision until an explicit Compact (etcd's default)."""

from __future__ import annotations

import asyncio
import collections
import logging
import re
from collections.abc import Awaitable, Callable

from ..errors import BadRequest, KVError
from .sweep import Sweep

log = logging.getLogger("kv.compactor")

DEFAULT_RETENTION = "100000"
STEP_S = 1.0
PURGE_BATCH = 1_000  # changes' records dropped per write (a few ms of the loop)
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_retention(text: str) -> tuple[str, float]:
    """("revisions", n), ("time", seconds) or ("off", 0) for a --auto-compaction-retention."""
    s = str(text).strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", s)
    if m is None:
        raise BadRequest(
            f"--auto-compaction-retention {text!r}: give a number of revisions (e.g. 100000), a time with its unit "
            "(e.g. 30m, 1h, 90s), or 0 to keep every revision until a Compact"
        )
    number, unit = float(m.group(1)), m.group(2)
    if number == 0:
        return "off", 0.0
    if unit:
        return "time", number * _UNITS[unit]
    if number != int(number):
        raise BadRequest(f"--auto-compaction-retention {text!r}: a number of revisions is a whole number")
    return "revisions", number


class Retention:
    """The revision to compact at, if any: pure (the caller passes the time, the role and
    the applied index), as kv.server.session_sweeper.IdleSessions is. By revisions: once the
    history holds a tenth more than it keeps, compact to leave it the retention. By time: the
    leader notes (now, applied index) at each step; the newest note at least the retention
    old is the revision to compact at (a new leader starts its notes anew)."""

    def __init__(self, retention: str) -> None:
        self.mode, self.amount = parse_retention(retention)
        self._notes: collections.deque[tuple[float, int]] = collections.deque()
        self._term = -1

    def target(self, leading: bool, term: int, now: float, applied: int, compacted: int, compacted_at: int = 0) -> int | None:
        """`compacted`: the compact revision; `compacted_at`: the index of the Compact entry
        that set it (by time, a node with no other writes must not go on compacting its own
        compactions)."""
        if not leading or self.mode == "off":
            self._notes.clear()
            self._term = -1
            return None
        if self.mode == "revisions":
            keep = int(self.amount)
            target = applied - keep
            return target if target >= compacted + max(keep // 10, 1) else None
        if term != self._term:
            self._notes.clear()
            self._term = term
        notes = self._notes
        notes.append((now, applied))
        cutoff = now - self.amount
        while len(notes) > 1 and notes[1][0] <= cutoff:
            notes.popleft()
        if notes[0][0] <= cutoff and notes[0][1] > max(compacted, compacted_at):
            return notes[0][1]
        return None


class Compactor:
    """Runs on every node: `view()` gives (leading, term, applied index), `state()` the state
    machine (its compact_revision, purge_history), `compact(revision, term)` commits a Compact while
    this node still leads in term."""

    def __init__(
        self, retention: str, view: Callable[[], tuple[bool, int, int]], state: Callable[[], object],
        compact: Callable[[int, int], Awaitable[object]], name: str,
    ) -> None:
        self.retention = Retention(retention)
        self._view, self._state, self._compact = view, state, compact
        self._sweep = Sweep(STEP_S, self._step, name)
        self.start, self.stop = self._sweep.start, self._sweep.stop

    async def _step(self, now: float) -> None:
        sm = self._state()
        if sm is None or getattr(sm, "incomplete", False):
            return
        try:
            await self._purge(sm)
        except Exception as e:  # the state replaced under it (install-snapshot): the next step goes on
            log.debug("history purge interrupted (%s: %s); trying again", type(e).__name__, e)
            return
        leading, term, applied = self._view()
        target = self.retention.target(leading, term, now, applied, sm.compact_revision, sm.compacted_at)
        if target is None:
            return
        try:
            await self._compact(target, term)
        except KVError as e:  # lost leadership, no quorum: the next step (or leader) tries again
            log.info("auto-compaction at revision %d did not commit here (%s)", target, e)

    async def _purge(self, sm) -> None:
        below = sm.compact_revision
        if below <= sm.purged_below:
            return
        # (LevelDB drops the purged records' tombstones in its own compactions; until then
        # reads at a revision over keys with many purged versions step over them.)
        while sm.purge_history(PURGE_BATCH) >= PURGE_BATCH:  # a few ms: each batch goes on where the last stopped
            await asyncio.sleep(0)  # the node's other work goes on between batches
            if self._state() is not sm or sm.compact_revision != below:
                return
