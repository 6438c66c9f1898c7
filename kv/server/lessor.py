"""The leader's clock for leases (like etcd's lessor).

The state machine knows which leases exist and which keys each holds; only the leader
decides when one expires, on its monotonic clock, and then commits a revoke entry, so every
member deletes the lease's keys at the same index. Keepalives renew a lease on the leader
alone (they are never logged): a follower forwards them. A leader that is new in its term
counts every lease as renewed at that moment, so a failover never expires a lease that
is being kept alive; a keepalive is answered only after a read index confirmed that this
node still leads, so no other leader can have started counting before it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable

from ..common.sessions import RequestId
from ..errors import KVError
from ..raft.errors import NotLeader
from ..statemachine import commands as cmds
from ..statemachine.lease_table import LeaseTable
from .sweep import Sweep

log = logging.getLogger("kv.leases")

SWEEP_S = 0.25  # how often the leader looks for expired leases


class LeaseDeadlines:
    """When each lease expires, on the leader's clock: pure (the caller passes the time and
    the role), so the simulator can drive it through leader changes (tests/test_lease_sim.py).

    `sync` follows the role and the lease table; `expired` says which leases the leader
    should revoke now; `renew` answers a keepalive. A lease past its deadline is treated as
    gone even before its revoke commits: renewing it then would tell its holder it has a
    whole ttl left while the revoke already in flight deletes its keys."""

    def __init__(self) -> None:
        self.at: dict[int, float] = {}  # lease -> when it expires
        self._term = -1  # the term these deadlines were counted in (-1: not leading)
        self._version = -1  # the lease table's version they reflect

    def sync(self, leading: bool, term: int, table, now: float) -> bool:
        """Bring the deadlines up to date; False when this node does not lead."""
        if not leading:
            self._term, self.at = -1, {}
            return False
        if self._term != term:  # newly leading: every lease counts as renewed now
            self._term, self._version = term, table.version
            self.at = {lease: now + ttl / 1000 for lease, ttl in table.ttl_ms.items()}
        elif self._version != table.version:
            self._version = table.version
            self.at = {lease: self.at.get(lease, now + ttl / 1000) for lease, ttl in table.ttl_ms.items()}
        return True

    def expired(self, now: float) -> list[int]:
        return [lease for lease, at in self.at.items() if at <= now]

    def renew(self, lease: int, ttl_ms: int, now: float) -> bool:
        """A keepalive, on the leader after sync: False if the lease has expired."""
        if self.at.get(lease, now) <= now:
            return False
        self.at[lease] = now + ttl_ms / 1000
        return True

    def left_ms(self, lease: int, now: float) -> int:
        return max(0, int((self.at.get(lease, now) - now) * 1000))


class LeaseClock:
    """Runs LeaseDeadlines on a node: sweeps for expired leases and commits their revokes,
    and answers keepalives and queries (for itself, and for followers: serve_local).

    `leading()` is (whether this node leads, its term, the leader it knows);
    `table()` the state machine's lease table; `propose_as_leader(cmd, term)` commits the
    leader's own housekeeping while it still leads in that term (kv/server/writes.py);
    `read_barrier()` returns once this node has confirmed its leadership."""

    def __init__(
        self,
        name: str,
        leading: Callable[[], tuple[bool, int, str | None]],
        table: Callable[[], LeaseTable],
        propose_as_leader: Callable[[cmds.Command, int], Awaitable[object]],
        read_barrier: Callable[[], Awaitable[object]],
    ) -> None:
        self._leading, self._table = leading, table
        self._propose_as_leader, self._read_barrier = propose_as_leader, read_barrier
        self._deadlines = LeaseDeadlines()
        self._revoking: set[int] = set()
        self._sweep = Sweep(SWEEP_S, self._expire, name)
        self.start, self.stop = self._sweep.start, self._sweep.stop

    async def _expire(self, now: float) -> None:
        if not self._sync(now):
            return
        term = self._leading()[1]
        for lease in self._deadlines.expired(now):
            if lease not in self._revoking:
                self._revoking.add(lease)
                asyncio.get_running_loop().create_task(self._revoke(lease, term))

    def _sync(self, now: float) -> bool:
        leading, term, _ = self._leading()
        return self._deadlines.sync(leading, term, self._table(), now)

    async def _revoke(self, lease: int, term: int) -> None:
        """Revoke a lease this node's clock saw expire while it led in `term` (only while
        it still does: propose_as_leader)."""
        try:
            if await self._propose_as_leader(cmds.LeaseRevoke(lease), term) is not None:
                log.info("lease %d expired and was revoked", lease)
        except KVError as e:  # no quorum, lost leadership: the next leader counts anew
            log.info("lease %d expired; its revoke did not commit here (%s)", lease, e)
        finally:
            self._revoking.discard(lease)

    def serve_local(self, payload: bytes) -> Awaitable[bytes] | None:
        """What the leader answers a follower without logging it (the raft driver asks):
        a keepalive or a query, encoded; None for anything else."""
        return self._answer_encoded(payload) if cmds.is_local(payload) else None

    async def _answer_encoded(self, payload: bytes) -> bytes:
        try:
            return cmds.encode_result(await self.answer(cmds.decode(payload)))
        except KVError as e:  # no quorum to confirm the leadership: the follower retries
            raise NotLeader(str(e)) from e

    async def answer(self, cmd: cmds.LocalCommand):
        """A keepalive (of one lease or several) or a query, on the leader (after
        confirming it leads)."""
        await self._read_barrier()
        now = asyncio.get_running_loop().time()
        if not self._sync(now):
            raise NotLeader(leader=self._leading()[2])
        table, d = self._table(), self._deadlines
        if type(cmd) is cmds.LeaseQuery and not cmd.lease:
            return cmds.LeaseList(tuple(cmds.LeaseInfo(lease, ttl, d.left_ms(lease, now)) for lease, ttl in sorted(table.ttl_ms.items())))
        if type(cmd) is cmds.LeaseKeepAlives:
            return cmds.LeaseList(tuple(self._renew(lease, now) for lease in cmd.leases))
        if type(cmd) is cmds.LeaseKeepAlive:
            r = self._renew(cmd.lease, now)
        else:
            ttl = table.ttl_ms.get(cmd.lease)
            r = cmds.NoSuchLease(cmd.lease) if ttl is None else cmds.LeaseInfo(cmd.lease, ttl, d.left_ms(cmd.lease, now))
        return r._replace(keys=tuple(sorted(table.keys[cmd.lease]))) if type(r) is cmds.LeaseInfo else r

    def _renew(self, lease: int, now: float) -> cmds.LeaseInfo | cmds.NoSuchLease:
        """A keepalive of one lease (without its keys)."""
        ttl = self._table().ttl_ms.get(lease)
        if ttl is None or not self._deadlines.renew(lease, ttl, now):
            return cmds.NoSuchLease(lease)  # gone, or expired with its revoke on its way
        return cmds.LeaseInfo(lease, ttl, self._deadlines.left_ms(lease, now))


def granted_id(request_id: RequestId) -> int:
    """The lease id a caller's grant request (session, seq) gets, the same on every node:
    a grant sent again, perhaps through another node, is the very same command, and its
    id is as unguessable as the session's."""
    digest = hashlib.blake2b(b"lease/%d/%d" % tuple(request_id), digest_size=8).digest()
    return int.from_bytes(digest, "big") % cmds.MAX_LEASE_ID + 1
