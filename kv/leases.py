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
import contextlib
import logging

from .errors import KVError
from .raft.errors import NotLeader
from .raft.messages import Role
from .statemachine import commands as cmds

log = logging.getLogger("kv.leases")

SWEEP_S = 0.25  # how often the leader looks for expired leases


class LeaseClock:
    def __init__(self, node) -> None:
        self._node = node
        self._deadlines: dict[int, float] = {}  # lease -> when it expires, on the leader's clock
        self._term = -1  # the term these deadlines were counted in (-1: not leading)
        self._version = -1  # the lease table's version they reflect
        self._revoking: set[int] = set()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"leases-{self._node.config.id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            for lease in self._expired():
                self._revoking.add(lease)
                asyncio.get_running_loop().create_task(self._revoke(lease))

    def _sync(self, now: float) -> bool:
        """Bring the deadlines up to date with the role and the lease table; False when
        this node does not lead."""
        raft = self._node.raft
        if raft.role != Role.LEADER:
            self._term, self._deadlines = -1, {}
            return False
        table = self._node.sm.leases
        if self._term != raft.term:  # newly leading: every lease counts as renewed now
            self._term, self._version = raft.term, table.version
            self._deadlines = {lease: now + ttl / 1000 for lease, ttl in table.ttl_ms.items()}
        elif self._version != table.version:
            self._version = table.version
            self._deadlines = {lease: self._deadlines.get(lease, now + ttl / 1000) for lease, ttl in table.ttl_ms.items()}
        return True

    def _expired(self) -> list[int]:
        now = asyncio.get_running_loop().time()
        if not self._sync(now):
            return []
        return [lease for lease, at in self._deadlines.items() if at <= now and lease not in self._revoking]

    async def _revoke(self, lease: int) -> None:
        try:
            await self._node.submit(cmds.LeaseRevoke(lease))
            log.info("lease %d expired and was revoked", lease)
        except KVError as e:  # no quorum, lost leadership: the next leader counts anew
            log.info("lease %d expired; its revoke did not commit here (%s)", lease, e)
        finally:
            self._revoking.discard(lease)

    async def answer(self, cmd: cmds.LeaseKeepAlive | cmds.LeaseQuery):
        """A keepalive or a query, on the leader (after confirming it leads)."""
        await self._node.read_barrier("linearizable")
        loop = asyncio.get_running_loop()
        now = loop.time()
        if not self._sync(now):
            raise NotLeader(self._node.raft.leader_id)
        table = self._node.sm.leases
        if type(cmd) is cmds.LeaseQuery and not cmd.lease:
            return cmds.LeaseList(tuple(cmds.LeaseInfo(lease, ttl, self._left(lease, now)) for lease, ttl in sorted(table.ttl_ms.items())))
        ttl = table.ttl_ms.get(cmd.lease)
        if ttl is None:
            return cmds.NoSuchLease(cmd.lease)
        if type(cmd) is cmds.LeaseKeepAlive:
            self._deadlines[cmd.lease] = now + ttl / 1000
        return cmds.LeaseInfo(cmd.lease, ttl, self._left(cmd.lease, now), tuple(sorted(table.keys[cmd.lease])))

    def _left(self, lease: int, now: float) -> int:
        return max(0, int((self._deadlines[lease] - now) * 1000))
