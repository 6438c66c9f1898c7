"""Client sessions, on the sending side: exactly-once writes (statemachine/sessions.py has
the state machine's half and the reasons).

Every write goes out as request `seq` of a session, and is sent again, when its outcome is
unknown, as the very same request: the state machine applies it once and answers every
copy with the first one's result. A session carries one request at a time, so a sender
with many writes in flight keeps a pool of sessions (`SessionPool`): kv.Node has one for
the writes it is handed without a session (kv.Node's and kv.open's own calls, HTTP writes
without X-Kv-Session), kv.AsyncClient one for the writes it sends.

A session is opened through the log before it is used; the state machine closes it when
the leader says it has been idle for `--session-ttl-s` (`IdleSessions`, below), or evicts
it as the least recently used beyond `--max-sessions`. A request in a session that is not
open is refused (SessionExpired) and applied nowhere. For a request sent for the first
time that means: open another session and send it there. For a request sent before, whose
first copy may have been applied before its session closed, it means the outcome is
unknown.
"""

from __future__ import annotations

import collections
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from .errors import BadRequest, KVError
from .statemachine.commands import MAX_SESSION_ID, CommandError, check_request_id
from .sweep import Sweep

log = logging.getLogger("kv.sessions")

DEFAULT_SESSION_TTL_S = 600.0
DEFAULT_MAX_SESSIONS = 50_000
SWEEP_S = 1.0  # how often the leader looks for idle sessions (the ttl's resolution)
EVICTIONS_TOLD_EVERY_S = 60.0


class RequestId(NamedTuple):
    """What identifies a write across all its copies: request `seq` of a session."""

    session: int
    seq: int

    @classmethod
    def checked(cls, session: int, seq: int) -> RequestId:
        """The request id, or BadRequest naming what is wrong with it."""
        try:
            check_request_id(session, seq)
        except CommandError as e:
            raise BadRequest(str(e)) from None
        return cls(session, seq)


def new_session_id() -> int:
    """A random session id: nobody can guess another sender's session."""
    return secrets.randbelow(MAX_SESSION_ID) + 1


class Lane:
    """One open session and the number of its last request."""

    __slots__ = ("id", "seq")

    def __init__(self, session: int) -> None:
        self.id, self.seq = session, 0

    def next_seq(self) -> int:
        """The number of the lane's next request."""
        self.seq += 1
        return self.seq


class SessionPool:
    """Open sessions, each used by one request at a time. `open_session(*args)` opens
    one through the log and returns its id (or raises); the pool grows to the most requests
    in flight at once. A session the state machine reports closed is not given back. `take`
    and `release` may be called from any thread (kv.open's callers release theirs)."""

    def __init__(self, open_session: Callable[..., Awaitable[int]]) -> None:
        self._open = open_session
        self._free: collections.deque[Lane] = collections.deque()
        self.opened = 0  # sessions this pool opened (a metric)

    def take(self) -> Lane | None:
        """A free session, or None (then `acquire` opens one)."""
        try:
            return self._free.pop()  # the most recently used: the others may idle out
        except IndexError:
            return None

    async def acquire(self, *args) -> Lane:
        """A free session, or a new one opened with open_session(*args)."""
        lane = self.take()
        if lane is None:
            lane = Lane(await self._open(*args))
            self.opened += 1
        return lane

    def release(self, lane: Lane) -> None:
        """The request on the lane is over (its outcome known, or given up on)."""
        self._free.append(lane)

    def __len__(self) -> int:
        return len(self._free)


class IdleSessions:
    """The log index up to which every session has been idle for `ttl_s` on the leader's
    clock: pure (the caller passes the time, the role and the log's end), as
    kv.leases.LeaseDeadlines is.

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
