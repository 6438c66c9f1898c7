"""Read index on the leader (Raft thesis §6.4; etcd's read_only.go): pure bookkeeping, no
I/O and no clock (the core passes `now` in).

A linearizable read asks the leader for its commit index, and the leader answers once a
heartbeat round sent after the read arrived has been acknowledged by a majority: then no
other leader can have committed anything newer. Every read waiting for the next round
shares it. Until the leader's no-op of its term commits, it does not know the latest
commit index, so reads arriving before that wait for it first.

Rounds that a majority confirmed also give the leader a lease: for an election timeout
(times a safety factor) after such a round was *sent*, no other leader can exist (with
check-quorum), so a lease read is answered at once.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from . import quorum


@dataclass(frozen=True, slots=True)
class ReadState:
    """A read index is known: once the state machine has applied `index`, a read issued
    with `ctx` sees every write acknowledged before it was issued."""

    ctx: int
    index: int


@dataclass(frozen=True, slots=True)
class ReadFailed:
    ctx: int
    leader: str | None  # the leader we know of, if any


@dataclass(slots=True)
class PendingRead:
    ctx: int
    index: int
    origin: str  # the leader's own id, or the follower that asked
    seq: int = 0  # heartbeat round that confirms it (0: not yet assigned)


class ReadIndex:
    """The leader's reads waiting for a heartbeat round, and the lease those rounds give.

    Invariant: every read in `waiting` has the commit index of when it was added, and the
    first round sent after that as `seq` (0 until one is sent)."""

    def __init__(self) -> None:
        self.waiting: list[PendingRead] = []
        self.before_commit: list[PendingRead] = []  # arrived before this term's no-op committed
        self.round_needed = False  # a read waits for a round not sent yet
        self.seq = 0  # the newest round sent
        self._sent_at: dict[int, float] = {}  # round -> when it was sent (for the lease)
        self.lease_start: float | None = None  # when the newest confirmed round was sent

    def add(self, read: PendingRead, commit_index: int | None) -> None:
        """A read on the leader; `commit_index` None while the term's no-op is uncommitted."""
        if commit_index is None:
            self.before_commit.append(read)
            return
        read.index = commit_index
        read.seq = 0
        self.waiting.append(read)
        self.round_needed = True

    def term_committed(self, commit_index: int) -> None:
        """The leader's no-op committed: the reads that waited for it take this index."""
        pending, self.before_commit = self.before_commit, []
        for r in pending:
            self.add(r, commit_index)

    def round_due(self) -> bool:
        """A read waits for a round and none is in flight. Rounds go one at a time (as
        etcd's linearizableReadLoop): reads that arrive meanwhile share the next one,
        instead of each turn of the event loop that saw a read sending its own."""
        return self.round_needed and not self._sent_at

    def new_round(self, now: float) -> int:
        """A heartbeat round goes out now: the reads without one wait for it."""
        self.round_needed = False
        self.seq += 1
        seq = self.seq
        self._sent_at[seq] = now
        for r in self.waiting:
            if r.seq == 0:
                r.seq = seq
        return seq

    def confirm(self, acked: dict[str, int], voters: Collection[str]) -> list[PendingRead]:
        """`acked`: the newest round each member answered (the leader's own: `seq`).
        Moves the lease and returns the reads whose round a majority has answered."""
        confirmed = quorum.committed_index(acked, voters)
        if confirmed <= 0:
            return []
        sent = [s for s in self._sent_at if s <= confirmed]
        if sent:
            self.lease_start = max(self.lease_start or 0.0, self._sent_at[max(sent)])
            for s in sent:
                del self._sent_at[s]
        if not self.waiting:
            return []
        done, keep = [], []
        for r in self.waiting:
            (done if 0 < r.seq <= confirmed else keep).append(r)
        self.waiting = keep
        return done

    def lease_valid(self, now: float, duration_ms: float) -> bool:
        return self.lease_start is not None and now < self.lease_start + duration_ms

    def clear(self) -> list[PendingRead]:
        """Leadership is lost: no lease, no rounds; returns the reads to fail."""
        self.lease_start = None
        self._sent_at.clear()
        self.round_needed = False
        reads = self.waiting + self.before_commit
        self.waiting, self.before_commit = [], []
        return reads


@dataclass(slots=True)
class _Asked:
    ctx: int  # the request's own ctx (its batch number)
    leader: str
    reads: list[int]  # the ctxs of the reads it answers
    sent_at: float


class FollowerReads:
    """A follower's reads, asked of the leader in batches (etcd's linearizableReadLoop):
    one ReadIndex request in flight at a time, for every read that arrived before it was
    sent; reads arriving meanwhile wait for the next. Its answer is good for all of them:
    the leader's commit index when the request reached it is at least that of any write
    acknowledged before they began. (A read arriving after the request was sent could
    have begun after such a write: it must not share the answer.) A message each way per
    batch, not per read: each one cost the leader about as much as serving the read.

    A request that goes unanswered, or went to a leader that is no longer, is sent again
    (its reads in the next batch: they began before it, so its answer is good for them).
    Batches are numbered from a random start: an answer meant for a run of this node
    before a restart must not be taken for one of this run's."""

    def __init__(self, first_batch: int) -> None:
        self.waiting: list[int] = []
        self.asked: _Asked | None = None
        self._batch = first_batch

    def add(self, ctx: int) -> None:
        self.waiting.append(ctx)

    def due(self) -> bool:
        """A read waits and no request is in flight."""
        return self.asked is None and bool(self.waiting)

    def ask(self, leader: str, now: float) -> int | None:
        """The ctx of a request to send to `leader` now, or None (one is in flight, or no
        read waits)."""
        if not self.due():
            return None
        self._batch = (self._batch + 1) % (1 << 64)
        self.asked = _Asked(self._batch, leader, self.waiting, now)
        self.waiting = []
        return self._batch

    def answered(self, ctx: int, src: str) -> list[int] | None:
        """The reads an answer from `src` is for (None: not the request in flight)."""
        a = self.asked
        if a is None or a.ctx != ctx or a.leader != src:
            return None
        self.asked = None
        return a.reads

    def expiry(self, timeout: float) -> float | None:
        """When the request in flight is sent again (None: none is in flight)."""
        return None if self.asked is None else self.asked.sent_at + timeout

    def ask_again(self, leader: str | None = None) -> None:
        """The request in flight will not be answered (it was lost; or it went to another
        leader than `leader`, now known): its reads go in the next batch, first."""
        a = self.asked
        if a is not None and (leader is None or a.leader != leader):
            self.asked = None
            self.waiting = a.reads + self.waiting

    def clear(self) -> list[int]:
        """No leader to ask: every read fails."""
        reads = ([] if self.asked is None else self.asked.reads) + self.waiting
        self.asked, self.waiting = None, []
        return reads
