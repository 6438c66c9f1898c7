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
import secrets
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from ..errors import BadRequest
from ..statemachine.commands import MAX_SESSION_ID, CommandError, check_request_id


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


class Slot:
    """One write for kv.Node.propose_now (kv/server/writes.py), the write path without a
    task per write: its command and encoded request. The Raft driver resolves it like a
    future (a kv.raft.node.Waiter); propose_now sets the session request it went as (the
    `lane` of a SessionPool and the `rid`) and the writer that counts it. `resolved()` is
    called once its outcome is in, on the event loop: then kv.Node.settle says what it came to."""

    __slots__ = ("cmd", "payload", "applied", "error", "fallback", "_done", "lane", "rid", "proposed_at", "writer")

    def __init__(self, cmd, payload: bytes) -> None:
        self.cmd, self.payload = cmd, payload
        self.applied = None  # a kv.raft.node.Applied
        self.error: BaseException | None = None
        self.fallback = self._done = False
        self.lane = self.rid = self.writer = None
        self.proposed_at = 0.0

    def done(self) -> bool:
        return self._done

    def set_result(self, applied) -> None:
        self.applied, self._done = applied, True
        self.writer.resolved(self)
        self.resolved()

    def set_exception(self, exc: BaseException) -> None:
        self.error, self._done = exc, True
        self.writer.resolved(self)
        self.resolved()

    def give_up(self) -> None:
        """Nothing was appended: the write goes the general way (Writer.settle)."""
        self.fallback, self._done = True, True
        self.resolved()

    def resolved(self) -> None:
        raise NotImplementedError
