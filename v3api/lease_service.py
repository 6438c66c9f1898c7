"""etcd's Lease service on kv.Node's leases: grant (with the client's id or a random
one), revoke, time-to-live, the list, and KeepAlive as a stream that renews any number of
leases, each request answered in order."""

from __future__ import annotations

import math

import grpc

from kv import LeaseNotFound

from . import wire
from .access import Access
from .proto import rpc_pb2, rpc_pb2_grpc


class LeaseService(rpc_pb2_grpc.LeaseServicer):
    def __init__(self, node, access: Access) -> None:
        self.node, self.access = node, access
        self.header = wire.Headers(node)

    async def LeaseGrant(self, request, context):
        async with self.access(context, "lease", []):
            if request.TTL <= 0:
                raise wire.Abort(grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: a lease's TTL is at least 1 second")
            got = await self.node.lease_grant(request.TTL, lease=request.ID or None)
            return rpc_pb2.LeaseGrantResponse(header=self.header.now(), ID=got.id, TTL=round(got.ttl))

    async def LeaseRevoke(self, request, context):
        async with self.access(context, "lease", []):
            r = await self.node.lease_revoke(request.ID)
            return rpc_pb2.LeaseRevokeResponse(header=self.header(r.index))

    async def LeaseTimeToLive(self, request, context):
        async with self.access(context, "lease", []):
            try:
                got = await self.node.lease_info(request.ID)
            except LeaseNotFound:  # etcd answers TTL -1 for a lease it does not have
                return rpc_pb2.LeaseTimeToLiveResponse(header=self.header.now(), ID=request.ID, TTL=-1)
            keys = [k.encode() for k in got.keys] if request.keys else []
            return rpc_pb2.LeaseTimeToLiveResponse(
                header=self.header.now(), ID=got.id, TTL=max(0, math.ceil(got.remaining)), grantedTTL=round(got.ttl), keys=keys
            )

    async def LeaseLeases(self, request, context):
        async with self.access(context, "lease", []):
            leases = await self.node.lease_list()
            return rpc_pb2.LeaseLeasesResponse(header=self.header.now(), leases=[rpc_pb2.LeaseStatus(ID=x.id) for x in leases])

    async def LeaseKeepAlive(self, request_iterator, context):
        """One answer per request, in order, until the client half-closes: TTL 0 for a lease
        that does not exist (etcd's answer)."""
        async with self.access(context, "lease", []):
            async for req in request_iterator:
                try:
                    got = await self.node.lease_keepalive(req.ID)
                    ttl = round(got.ttl)
                except LeaseNotFound:
                    ttl = 0
                yield rpc_pb2.LeaseKeepAliveResponse(header=self.header.now(), ID=req.ID, TTL=ttl)
