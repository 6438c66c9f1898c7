"""etcd's Cluster, Maintenance and Auth services: the members, a node's status, alarms,
a hash of the state, and the snapshot stream (ledgerkv's own snapshot format)."""

from __future__ import annotations

import os
import zlib

import grpc

from kv.common.etcd_ids import etcd_id

from . import wire
from .access import Access
from .proto import rpc_pb2, rpc_pb2_grpc

SNAPSHOT_CHUNK = 1 << 20


class ClusterService(rpc_pb2_grpc.ClusterServicer):
    def __init__(self, node, access: Access, client_url: str) -> None:
        self.node, self.access, self.client_url = node, access, client_url
        self.header = wire.Headers(node)

    async def MemberList(self, request, context):
        async with self.access(context, "read", []):
            members = []
            for m in self.node.members():
                own = m["id"] == self.node.config.id
                # Only this node's etcd API address is known here; for the others their HTTP one.
                urls = [self.client_url] if own else [m["http"]] if m.get("http") else []
                peer = m["peer"] if "://" in m["peer"] else f"http://{m['peer']}"
                members.append(rpc_pb2.Member(ID=etcd_id(m["id"]), name=m["id"], peerURLs=[peer], clientURLs=urls, isLearner=not m["voter"]))
            return rpc_pb2.MemberListResponse(header=self.header.now(), members=members)


class MaintenanceService(rpc_pb2_grpc.MaintenanceServicer):
    def __init__(self, node, access: Access) -> None:
        self.node, self.access = node, access
        self.header = wire.Headers(node)

    async def Status(self, request, context):
        async with self.access(context, "read", []):
            s = self.node.status()
            leader = s.get("leader")
            return rpc_pb2.StatusResponse(
                header=self.header.now(),
                version=wire.ETCD_VERSION,
                dbSize=_dir_bytes(self.node.config.data_dir),
                dbSizeInUse=_dir_bytes(self.node.config.state_path),
                leader=etcd_id(leader) if leader else 0,
                raftIndex=s.get("commit_index", 0),
                raftTerm=s.get("term", 0),
                raftAppliedIndex=s.get("applied_index", 0),
                errors=[a["message"] for a in s.get("alarms", [])],
                isLearner=s.get("role") == "learner",
            )

    async def Alarm(self, request, context):
        """GET: the alarms raised through the log, and this node's own NOSPACE while its disk
        is below --min-free-bytes; ACTIVATE / DEACTIVATE: through the log (admin)."""
        get = request.action == rpc_pb2.AlarmRequest.GET
        async with self.access(context, "read" if get else "admin", []):
            if get:
                await self.node.read_barrier("linearizable")  # every alarm raised before the call is applied here
                raised = set(self.node.raised_alarms())
                if any(a["alarm"] == "NOSPACE" for a in self.node.status().get("alarms", [])):
                    raised.add((self.node.ids()[1], rpc_pb2.NOSPACE))
                pairs = sorted(p for p in raised if request.alarm in (rpc_pb2.NONE, p[1]))
            else:
                if request.alarm == rpc_pb2.NONE:
                    raise wire.Abort(grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: say which alarm (NOSPACE or CORRUPT)")
                pairs = await self.node.set_alarm(request.memberID, request.alarm, request.action == rpc_pb2.AlarmRequest.ACTIVATE)
            return rpc_pb2.AlarmResponse(header=self.header.now(), alarms=[rpc_pb2.AlarmMember(memberID=m, alarm=a) for m, a in pairs])

    async def Hash(self, request, context):
        async with self.access(context, "read", []):
            h, index = await self._hash()
            return rpc_pb2.HashResponse(header=self.header(index), hash=h)

    async def HashKV(self, request, context):
        async with self.access(context, "read", []):
            h, index = await self._hash()
            if request.revision and request.revision != index:
                raise wire.Abort(grpc.StatusCode.OUT_OF_RANGE, wire.ERR_COMPACTED if request.revision < index else wire.ERR_FUTURE_REV)
            return rpc_pb2.HashKVResponse(header=self.header(index), hash=h)

    async def _hash(self) -> tuple[int, int]:
        """A CRC-32 of every key and value as this node has applied them (equal on every
        node at the same applied index)."""
        h, index, after = 0, None, None
        while True:
            page = await self.node.scan_page("", after=after, limit=1000, consistency="stale" if index else "linearizable")
            index = index or page.index
            for item in page.items:
                h = zlib.crc32(item.value, zlib.crc32(item.key.encode(), h))
            if len(page.items) < 1000:
                return h, index
            after = page.items[-1].key

    async def Snapshot(self, request, context):
        """A fresh snapshot of this node, in ledgerkv's own format (kv snapshot restore
        reads it; etcdctl's snapshot status and restore, which read etcd's, do not)."""
        async with self.access(context, "admin", []):
            snap, index = await self.node.take_snapshot()
            with open(snap.path, "rb") as f:  # (open before the next snapshot may remove it)
                size, sent = os.fstat(f.fileno()).st_size, 0
                while chunk := f.read(SNAPSHOT_CHUNK):
                    sent += len(chunk)
                    yield rpc_pb2.SnapshotResponse(header=self.header(index), remaining_bytes=size - sent, blob=chunk)


class AuthService(rpc_pb2_grpc.AuthServicer):
    async def Authenticate(self, request, context):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "etcdserver: authentication is not enabled (ledgerkv takes bearer tokens: send the token as 'token' metadata)")


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total
