"""The leader's clock for client sessions: it closes, through the log, the sessions idle
for --session-ttl-s (kv/common/sessions.py has the sending side, statemachine/sessions.py the
state machine's table and the reasons)."""

from __future__ import annotations

import collections
import logging
from collections.abc import Awaitable, Callable

from ..errors import KVError
from .sweep import Sweep

log = logging.getLogger("kv.sessions")

DEFAULT_SESSION_TTL_S = 600.0
DEFAULT_MAX_SESSIONS = 50_000
SWEEP_S = 1.0  # how often the leader looks for idle sessions (the ttl's resolution)
EVICTIONS_TOLD_EVERY_S = 60.0


class IdleSessions:
    """The log index up to which every session has been idle for `ttl_s` on the leader's
    clock: pure (the caller passes the time, the role and the log's end), as
    kv.server.lessor.LeaseDeadlines is.

    Once a second the leader notes (now, the last index of its log): every entry up to that
    index was appended by then. The newest note at least ttl old names an index up to which
    no session has been used for ttl: SessionsExpire(that index) closes them. A new leader
    starts its notes anew, so it counts every session as used at its election."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._notes: collections.deque[tuple[float, int]] = collections.deque()
        self._term = -1

    def note(self, leading: bool, term: int, now: float, last_index: int) -> None:
        if not leading:
            self._notes.clear()
            self._term = -1
            return
        if term != self._term:
            self._notes.clear()
            self._term = term
        self._notes.append((now, last_index))

    def idle_upto(self, now: float) -> int | None:
        """The index up to which every session has been idle for ttl, if any."""
        cutoff = now - self.ttl_s
        notes = self._notes
        while len(notes) > 1 and notes[1][0] <= cutoff:
            notes.popleft()
        if notes and notes[0][0] <= cutoff:
            return notes[0][1]
        return None


class SessionSweeper:
    """Runs IdleSessions on a node: once a second, on the leader, commits SessionsExpire
    for the sessions idle for the ttl. `view()` gives (leading, term, last log index),
    `oldest_use()` the index that used the least recently used session (None: none open),
    `expire(upto, term)` commits the SessionsExpire while this node still leads in term."""

    def __init__(
        self,
        ttl_s: float,
        view: Callable[[], tuple[bool, int, int]],
        oldest_use: Callable[[], int | None],
        expire: Callable[[int, int], Awaitable[object]],
        name: str,
        evicted: Callable[[], int] = lambda: 0,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ) -> None:
        self.idle = IdleSessions(ttl_s)
        self._view, self._oldest_use, self._expire = view, oldest_use, expire
        self._evicted, self._max_sessions = evicted, max_sessions
        self._evicted_told, self._told_at = evicted(), float("-inf")
        self._sweep = Sweep(SWEEP_S, self._step, name)
        self.start, self.stop = self._sweep.start, self._sweep.stop

    async def _step(self, now: float) -> None:
        self._say_evictions(now)
        leading, term, last = self._view()
        self.idle.note(leading, term, now, last)
        upto = self.idle.idle_upto(now) if leading else None
        oldest = self._oldest_use()
        if upto is None or oldest is None or oldest > upto:
            return
        try:
            await self._expire(upto, term)
        except KVError as e:  # lost leadership, no quorum: the next leader counts anew
            log.info("sessions idle up to index %d: their expiry did not commit here (%s)", upto, e)

    def _say_evictions(self, now: float) -> None:
        """Sessions closed to open others mean clients open them again and again (and a
        write resent in one that closed has an unknown outcome): say so, once a minute."""
        evicted = self._evicted()
        if evicted > self._evicted_told and now - self._told_at >= EVICTIONS_TOLD_EVERY_S:
            log.warning(
                "%d client sessions were closed to open new ones (--max-sessions %d reached): their clients open sessions "
                "again, and a write resent in one that closed has an unknown outcome; raise --max-sessions",
                evicted - self._evicted_told, self._max_sessions,
            )
            self._evicted_told, self._told_at = evicted, now
