"""etcd's Lease service on kv.Node's leases: grant (with the client's id or a random
one), revoke, time-to-live, the list, and KeepAlive as a stream that renews any number of
leases, each request answered in order.

Keepalives of every stream of the node go to the leader together: those that arrive within
GATHER_S of the first, or while a batch is on its way, go in one batch (kv.Node.
lease_keepalives, one read barrier on the leader for all of them), so ten thousand leases
cost a few round trips a second, not ten thousand. (50 ms is nothing to a lease: etcd's
clients renew at a third of the TTL, and the shortest TTL is 1.5 election timeouts.)"""

from __future__ import annotations

import asyncio
import math

import grpc

from kv import LeaseNotFound
from kv.statemachine import commands as cmds

from . import wire
from .access import Access
from .proto import rpc_pb2, rpc_pb2_grpc


MAX_BATCH = 10_000  # kv.Node.lease_keepalives' limit
GATHER_S = 0.05  # measured: 10,000 leases cost the leader 3.6 % of a core (20 % batching per loop turn)
MAX_TTL_S = cmds.MAX_TTL_MS // 1000  # ledgerkv's longest lease (etcd's is longer: it answers "too large" above its own)


class KeepAliveBatcher:
    """renew(lease) -> its ttl in seconds (0: no such lease), batched across callers."""

    def __init__(self, node) -> None:
        self.node = node
        self._waiting: dict[int, list[asyncio.Future]] = {}
        self._flushing = False

    async def renew(self, lease: int) -> int:
        fut = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(lease, []).append(fut)
        if not self._flushing:
            self._flushing = True
            asyncio.ensure_future(self._flush())
        return await fut

    async def _flush(self) -> None:
        try:
            while self._waiting:
                await asyncio.sleep(GATHER_S)  # the keepalives that arrive meanwhile join this batch
                ids = list(self._waiting)[:MAX_BATCH]
                batch = {i: self._waiting.pop(i) for i in ids}
                try:
                    got = await self.node.lease_keepalives(ids)
                except Exception as e:  # every caller of the batch gets the error
                    for futs in batch.values():
                        for f in futs:
                            if not f.done():
                                f.set_exception(e)
                    continue
                for i, status in zip(ids, got):
                    ttl = round(status.ttl) if status is not None else 0
                    for f in batch[i]:
                        if not f.done():
                            f.set_result(ttl)
        finally:
            self._flushing = False


def _drain(q: asyncio.Queue) -> list:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


class LeaseService(rpc_pb2_grpc.LeaseServicer):
    def __init__(self, node, access: Access) -> None:
        self.node, self.access = node, access
        self.header = wire.Headers(node)
        self.keepalives = KeepAliveBatcher(node)
        self.min_ttl = math.ceil(1.5 * node.config.election_timeout_ms / 1000)

    async def LeaseGrant(self, request, context):
        async with self.access(context, "lease", []):
            if request.TTL > MAX_TTL_S:
                raise wire.Abort(grpc.StatusCode.OUT_OF_RANGE, "etcdserver: too large lease TTL")
            # etcd grants at least its minimum TTL (1.5 election timeouts), whatever is asked
            got = await self.node.lease_grant(max(request.TTL, self.min_ttl), lease=request.ID or None)
            return rpc_pb2.LeaseGrantResponse(header=self.header.now(), ID=got.id, TTL=round(got.ttl))

    async def LeaseRevoke(self, request, context):
        async with self.access(context, "lease", []):
            if request.ID <= 0:  # (no lease has such an id)
                raise wire.Abort(grpc.StatusCode.NOT_FOUND, wire.ERR_LEASE_NOT_FOUND)
            r = await self.node.lease_revoke(request.ID)
            return rpc_pb2.LeaseRevokeResponse(header=self.header(r.index))

    async def LeaseTimeToLive(self, request, context):
        async with self.access(context, "lease", []):
            try:
                if request.ID <= 0:
                    raise LeaseNotFound(request.ID)
                got = await self.node.lease_info(request.ID)
            except LeaseNotFound:  # etcd answers TTL -1 for a lease it does not have
                return rpc_pb2.LeaseTimeToLiveResponse(header=self.header.now(), ID=request.ID, TTL=-1)
            keys = [cmds.key_bytes(k) for k in got.keys] if request.keys else []
            # (whole seconds left, cut down as etcd's: 9 of 10 a moment after the grant)
            return rpc_pb2.LeaseTimeToLiveResponse(
                header=self.header.now(), ID=got.id, TTL=max(0, int(got.remaining)), grantedTTL=round(got.ttl), keys=keys
            )

    async def LeaseLeases(self, request, context):
        async with self.access(context, "lease", []):
            leases = sorted(await self.node.lease_list(), key=lambda x: x.remaining)  # soonest to expire first, as etcd's
            return rpc_pb2.LeaseLeasesResponse(header=self.header.now(), leases=[rpc_pb2.LeaseStatus(ID=x.id) for x in leases])

    async def LeaseKeepAlive(self, request_iterator, context):
        """One answer per request, in order, until the client half-closes: TTL 0 for a lease
        that does not exist (etcd's answer). Requests are read ahead (up to MAX_BATCH at
        once), so that the keepalives of one stream share batches."""
        async with self.access(context, "lease", []):
            pending: asyncio.Queue = asyncio.Queue(MAX_BATCH)

            async def read() -> None:
                try:
                    async for req in request_iterator:
                        await pending.put((req.ID, asyncio.ensure_future(self.keepalives.renew(req.ID)) if req.ID > 0 else None))
                finally:
                    await pending.put(None)

            reader = asyncio.ensure_future(read())
            try:
                while (item := await pending.get()) is not None:
                    lease, renewal = item
                    ttl = await renewal if renewal is not None else 0
                    yield rpc_pb2.LeaseKeepAliveResponse(header=self.header.now(), ID=lease, TTL=ttl)
                reader.result()  # raises what broke the reader
            finally:
                reader.cancel()
                left = [reader] + [item[1] for item in _drain(pending) if item is not None and item[1] is not None]
                for task in left:
                    task.cancel()
                await asyncio.gather(*left, return_exceptions=True)
