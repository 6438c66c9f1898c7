"""etcd's Cluster, Maintenance and Auth services: the members, a node's status, alarms,
a hash of the state, and the snapshot stream (ledgerkv's own snapshot format)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import ssl
import time
import zlib

import aiohttp
import grpc

from kv.common.etcd_ids import etcd_id
from kv.http.auth import grant_of
from kv.common.disk import dir_bytes
from kv.snapshot.format import ETCD_SUFFIX_ALIGN, ETCD_SUFFIX_HASH
from kv.statemachine import commands as cmds

from . import wire
from .access import Access
from .proto import rpc_pb2, rpc_pb2_grpc

SNAPSHOT_CHUNK = 1 << 20
PEER_URL_TTL_S = 60.0


class ClusterService(rpc_pb2_grpc.ClusterServicer):
    """MemberList, with each member's etcd API URL as its client URL (what etcdctl's
    --cluster and the Go client's member sync dial): this node's own, and the others' as
    their /v1/status says (asked over HTTP from the start, learn_urls, and again once
    PEER_URL_TTL_S old)."""

    def __init__(self, node, access: Access, client_url: str) -> None:
        self.node, self.access, self.client_url = node, access, client_url
        self.header = wire.Headers(node)
        self._urls: dict[str, tuple[float, str]] = {}  # member id -> (when asked, its etcd API URL)

    async def MemberList(self, request, context):
        async with self.access(context, "anyone", []):
            listed = self.node.members()
            others = [m for m in listed if m["id"] != self.node.config.id and m.get("http")]
            await asyncio.gather(*(self._learn(m["id"], m["http"]) for m in others))
            members = []
            for m in listed:
                if m["id"] == self.node.config.id:
                    urls = [self.client_url]
                else:
                    url = self._urls.get(m["id"], (0.0, ""))[1]
                    urls = [url] if url else []
                peer = m["peer"] if "://" in m["peer"] else f"http://{m['peer']}"
                # A member that has neither dialled this node nor answered it (added, not
                # started) has no name, as in etcd: etcdctl member list says "unstarted".
                started = m["id"] == self.node.config.id or m["id"] in self._urls or self.node.raft.peer_url(m["id"])
                name = m["id"] if started else ""
                members.append(rpc_pb2.Member(ID=etcd_id(m["id"]), name=name, peerURLs=[peer], clientURLs=urls, isLearner=not m["voter"]))
            return rpc_pb2.MemberListResponse(header=self.header.without_revision(), members=members)

    async def learn_urls(self) -> None:
        """Keep the other members' client URLs known from the start, as etcd's members
        publish theirs: MemberList then lists a member that went down with its URL (a URL
        learned is kept while the member does not answer), and etcdctl's --cluster reports
        it unhealthy instead of leaving it out. Asks every 2 s until each member answered
        once, then as the URLs age (PEER_URL_TTL_S); runs until the server stops."""
        while True:
            others = [m for m in self.node.members() if m["id"] != self.node.config.id]
            await asyncio.gather(*(self._learn(m["id"], m["http"]) for m in others if m.get("http")))
            await asyncio.sleep(PEER_URL_TTL_S if all(m["id"] in self._urls for m in others) else 2.0)

    async def _learn(self, member: str, http_url: str) -> None:
        now = time.monotonic()
        if now - self._urls.get(member, (-PEER_URL_TTL_S, ""))[0] < PEER_URL_TTL_S:
            return
        grants = self.access.grants
        token = next(iter(grants), None) if grants else None
        ssl_ctx = ssl.create_default_context(cafile=self.node.config.cacert) if http_url.startswith("https") else None
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as s:
                async with s.get(http_url + "/v1/status", headers={"Authorization": f"Bearer {token}"} if token else {}, ssl=ssl_ctx) as r:
                    url = (await r.json()).get("grpc", "") if r.status == 200 else ""
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError):
            return  # (asked again on the next call)
        self._urls[member] = (now, url)


class MaintenanceService(rpc_pb2_grpc.MaintenanceServicer):
    def __init__(self, node, access: Access) -> None:
        self.node, self.access = node, access
        self.header = wire.Headers(node)

    # Status and the list of alarms answer without a token, as etcd's do with auth on
    # (`etcdctl endpoint status`, `alarm list` and monitoring ask them without credentials):
    # they tell what any client of the port can see, nothing of the keys.
    async def Status(self, request, context):
        async with self.access(context, "anyone", []):
            s = self.node.status()
            leader = s.get("leader")
            return rpc_pb2.StatusResponse(
                header=self.header.now(),
                version=wire.ETCD_VERSION,
                dbSize=dir_bytes(self.node.config.data_dir),
                dbSizeInUse=dir_bytes(self.node.config.state_path),
                leader=etcd_id(leader) if leader else 0,
                raftIndex=s.get("commit_index", 0),
                raftTerm=s.get("term", 0),
                raftAppliedIndex=s.get("applied_index", 0),
                errors=([] if leader else [wire.ERR_NO_LEADER])  # (etcd's, which etcdctl endpoint status shows)
                + [a["message"] for a in s.get("alarms", [])]
                + [f"memberID:{m} alarm:{rpc_pb2.AlarmType.Name(kind)} " for m, kind in self.node.raised_alarms()],
                isLearner=s.get("role") == "learner",
            )

    async def Alarm(self, request, context):
        """GET: the alarms raised through the log, and this node's own NOSPACE while its disk
        is below --min-free-bytes; ACTIVATE / DEACTIVATE: through the log (admin)."""
        get = request.action == rpc_pb2.AlarmRequest.GET
        async with self.access(context, "anyone" if get else "admin", []):
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
            # (etcd answers a GET with the alarms alone, no header)
            header = None if get else self.header.now()
            return rpc_pb2.AlarmResponse(header=header, alarms=[rpc_pb2.AlarmMember(memberID=m, alarm=a) for m, a in pairs])

    # Hash and HashKV take an admin token, as etcd's take root: a hash of every key and
    # value tells a token scoped to a prefix when anything outside it changes, and confirms
    # guesses of what it holds.
    async def Hash(self, request, context):
        async with self.access(context, "admin", []):
            h, index = await self._hash(None)
            return rpc_pb2.HashResponse(header=self.header(index), hash=h)

    async def HashKV(self, request, context):
        async with self.access(context, "admin", []):
            h, index = await self._hash(request.revision or None)
            return rpc_pb2.HashKVResponse(header=self.header(index), hash=h, compact_revision=self.node.compact_revision())

    async def _hash(self, revision: int | None) -> tuple[int, int]:
        """A CRC-32 of every key and value as of `revision` (None: as applied here now, after
        a read barrier), every page read at that one revision: equal on every node for the
        same revision, while writes go on. (etcd's HashKV covers its history too; this one
        the keys as they were.) Returns it and the revision."""
        h, after, at = 0, None, revision
        while True:
            page = await self.node.scan_page("", after=after, limit=1000, consistency="linearizable" if after is None else "stale", revision=at)
            at = page.index
            for item in page.items:
                h = zlib.crc32(item.value, zlib.crc32(cmds.key_bytes(item.key), h))
            if len(page.items) < 1000:
                return h, at
            after = page.items[-1].key

    async def Snapshot(self, request, context):
        """A fresh snapshot of this node, in ledgerkv's own format (kv snapshot restore
        reads it, as `etcdctl snapshot save` stores it; etcdctl's snapshot status and
        restore, which read etcd's, do not)."""
        async with self.access(context, "admin", []):
            snap, index = await self.node.take_snapshot()
            with open(snap.path, "rb") as f:  # (open before the next snapshot may remove it)
                size = os.fstat(f.fileno()).st_size
                # etcd's client checks that the stream ends in a sha256 of what came before,
                # after zeros to a multiple of 512 bytes; ledgerkv's reader skips both.
                padding = b"\0" * (-size % ETCD_SUFFIX_ALIGN)
                total, sent, digest = size + len(padding) + ETCD_SUFFIX_HASH, 0, hashlib.sha256()
                while chunk := f.read(SNAPSHOT_CHUNK):
                    sent += len(chunk)
                    digest.update(chunk)
                    yield rpc_pb2.SnapshotResponse(header=self.header(index), remaining_bytes=total - sent, blob=chunk)
            digest.update(padding)
            yield rpc_pb2.SnapshotResponse(header=self.header(index), remaining_bytes=0, blob=padding + digest.digest())


class AuthService(rpc_pb2_grpc.AuthServicer):
    """ledgerkv's tokens through etcd's Authenticate: the password is a token of the node's
    (`etcdctl --user any:<token>`), and the token etcd's client then sends with every call
    is that token. Without tokens: "authentication is not enabled", which etcd's clients
    take as leave to go on without."""

    def __init__(self, node, access: Access) -> None:
        self.access = access
        self.header = wire.Headers(node)

    async def Authenticate(self, request, context):
        if self.access.grants is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, wire.ERR_AUTH_NOT_ENABLED)
        if grant_of(self.access.grants, f"Bearer {request.password}") is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, wire.ERR_AUTH_FAILED)
        return rpc_pb2.AuthenticateResponse(header=self.header.now(), token=request.password)

