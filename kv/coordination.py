"""Coordination on top of the store: self-renewing leases (and, built on them, locks and
elections). Written once against the store API that kv.Node, kv.AsyncClient and (through
their loop threads) kv.open and kv.Client share: lease_grant, lease_keepalive,
lease_revoke, put, scan, delete, watch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from ._loop import LoopThread
from .errors import KVError, LeaseNotFound

log = logging.getLogger("kv.coordination")


class AsyncLease:
    """A lease that keeps itself alive — a keepalive every ttl/3 — until it is revoked or
    its owner's context ends. Loss is reported, never hidden: `alive` turns False and
    `lost` holds the reason (the lease expired or was revoked elsewhere, or no keepalive
    got through for a whole ttl), and `on_lost` is called once.

        async with node.lease(10) as lease:      # or: lease = await client.lease(10)
            await node.put("services/api", b"10.0.0.1:8080", lease=lease)
    """

    def __init__(self, store, ttl: float, *, on_lost: Callable[[KVError], None] | None = None) -> None:
        self._store, self.ttl, self._on_lost = store, ttl, on_lost
        self.id: int | None = None
        self.lost: KVError | None = None
        self._task: asyncio.Task | None = None

    @property
    def alive(self) -> bool:
        return self.id is not None and self.lost is None

    async def grant(self) -> AsyncLease:
        if self.id is None:
            status = await self._store.lease_grant(self.ttl)
            self.id = status.id
            self._task = asyncio.get_running_loop().create_task(self._keep_alive(), name=f"lease-{self.id}")
        return self

    def __await__(self):
        return self.grant().__await__()

    async def __aenter__(self) -> AsyncLease:
        return await self.grant()

    async def __aexit__(self, *exc) -> None:
        await self.revoke()

    async def _keep_alive(self) -> None:
        loop = asyncio.get_running_loop()
        good_until = loop.time() + self.ttl
        every = self.ttl / 3
        while True:
            await asyncio.sleep(every)
            try:
                await self._store.lease_keepalive(self.id)
                good_until, every = loop.time() + self.ttl, self.ttl / 3
            except LeaseNotFound as e:
                return self._lose(e)
            except KVError as e:
                if loop.time() >= good_until:
                    return self._lose(KVError(f"lease {self.id}: no keepalive got through for its whole ttl ({e})"))
                every = min(self.ttl / 10, 1.0)  # try again sooner while time is left
                log.info("lease %d: keepalive failed (%s); retrying", self.id, e)

    def _lose(self, e: KVError) -> None:
        self.lost = e
        log.warning("lease %d is lost: %s", self.id, e)
        if self._on_lost is not None:
            self._on_lost(e)

    async def revoke(self) -> None:
        """Revoke the lease now (its keys go with it); a lease already gone is fine."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.id is not None and self.lost is None:
            with contextlib.suppress(LeaseNotFound):
                await self._store.lease_revoke(self.id)
            self.lost = LeaseNotFound(self.id, f"lease {self.id} was revoked")


class Lease:
    """The blocking face of AsyncLease (kv.Client, kv.open): the keepalives run on the
    client's or store's loop thread.

        with client.lease(10) as lease:
            client.put("services/api", b"10.0.0.1:8080", lease=lease)
    """

    def __init__(self, lease: AsyncLease, lt: LoopThread) -> None:
        self._lease, self._lt = lease, lt

    @property
    def id(self) -> int:
        return self._lease.id

    @property
    def ttl(self) -> float:
        return self._lease.ttl

    @property
    def alive(self) -> bool:
        return self._lease.alive

    @property
    def lost(self) -> KVError | None:
        return self._lease.lost

    def revoke(self) -> None:
        if not self._lt.closed:
            self._lt.call(self._lease.revoke())

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.revoke()
