"""etcd's JSON gateway on the node's HTTP port: `POST /v3/<service>/<method>` with the
request as JSON (proto field names, bytes as base64, 64-bit integers as strings), answered
as etcd 3.4's grpc-gateway answers; streams (watch, lease keepalive) as one JSON object a
line, each `{"result": ...}`; `GET /version`. The same services as the gRPC front
(kv_service and the rest), called with a context that reads the token from the
Authorization header (with or without "Bearer ") and turns an abort into the gateway's
error body `{"error", "code", "message"}` with its HTTP status."""

from __future__ import annotations

import asyncio

import grpc
import orjson
from aiohttp import web
from google.protobuf import json_format

from kv import KVError

from . import wire
from .access import Access, CallCounts
from .cluster_service import AuthService, ClusterService, MaintenanceService
from .kv_service import KVService
from .lease_service import LeaseService
from .proto import rpc_pb2
from .watch_service import WatchService

# grpc-gateway's HTTP status for each gRPC code (runtime.HTTPStatusFromCode, v1)
HTTP_STATUS = {
    grpc.StatusCode.CANCELLED: 408,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 412,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
}
MAX_BODY = 4 << 20  # a request's JSON (its values base64-encoded)


class _Context:
    """What the services use of a gRPC call's context, for an HTTP request."""

    def __init__(self, request: web.Request) -> None:
        self.request = request

    def invocation_metadata(self):
        auth = self.request.headers.get("Authorization")
        return [("authorization", auth)] if auth else []

    async def abort(self, code: grpc.StatusCode, message: str):
        raise wire.Abort(code, message)


def _error(code: grpc.StatusCode, message: str) -> web.Response:
    body = {"error": message, "code": code.value[0], "message": message}
    return web.Response(body=orjson.dumps(body), status=HTTP_STATUS.get(code, 500), content_type="application/json")


def _json(message) -> bytes:
    return orjson.dumps(json_format.MessageToDict(message, preserving_proto_field_name=True))


async def _parse(request: web.Request, cls):
    if request.content_length is not None and request.content_length > MAX_BODY:
        raise wire.Abort(grpc.StatusCode.INVALID_ARGUMENT, wire.ERR_TOO_LARGE)
    body = await request.content.read(MAX_BODY + 1)
    if len(body) > MAX_BODY:
        raise wire.Abort(grpc.StatusCode.INVALID_ARGUMENT, wire.ERR_TOO_LARGE)
    msg = cls()
    try:
        json_format.Parse(body or b"{}", msg, ignore_unknown_fields=True)  # as etcd's gateway
    except (json_format.ParseError, UnicodeDecodeError) as e:
        raise wire.Abort(grpc.StatusCode.INVALID_ARGUMENT, f"the body is not a {cls.__name__} in JSON: {e}") from None
    return msg


def routes(node, grants, counts: CallCounts | None = None) -> list[web.RouteDef]:
    """The gateway's routes for node (grants: the node's tokens, None for none; counts:
    where its calls are counted, shared with the gRPC front)."""
    access = Access(grants, "gateway", counts)
    kv, lease = KVService(node, access), LeaseService(node, access)
    cluster, maintenance, watch = ClusterService(node, access, node.config.grpc and f"http://{node.config.grpc}" or ""), MaintenanceService(node, access), WatchService(node, access)
    unary = {
        "kv/range": (kv.Range, rpc_pb2.RangeRequest),
        "kv/put": (kv.Put, rpc_pb2.PutRequest),
        "kv/deleterange": (kv.DeleteRange, rpc_pb2.DeleteRangeRequest),
        "kv/txn": (kv.Txn, rpc_pb2.TxnRequest),
        "kv/compaction": (kv.Compact, rpc_pb2.CompactionRequest),
        "lease/grant": (lease.LeaseGrant, rpc_pb2.LeaseGrantRequest),
        "lease/revoke": (lease.LeaseRevoke, rpc_pb2.LeaseRevokeRequest),
        "kv/lease/revoke": (lease.LeaseRevoke, rpc_pb2.LeaseRevokeRequest),
        "lease/timetolive": (lease.LeaseTimeToLive, rpc_pb2.LeaseTimeToLiveRequest),
        "kv/lease/timetolive": (lease.LeaseTimeToLive, rpc_pb2.LeaseTimeToLiveRequest),
        "lease/leases": (lease.LeaseLeases, rpc_pb2.LeaseLeasesRequest),
        "kv/lease/leases": (lease.LeaseLeases, rpc_pb2.LeaseLeasesRequest),
        "cluster/member/list": (cluster.MemberList, rpc_pb2.MemberListRequest),
        "maintenance/status": (maintenance.Status, rpc_pb2.StatusRequest),
        "maintenance/alarm": (maintenance.Alarm, rpc_pb2.AlarmRequest),
        "maintenance/hash": (maintenance.HashKV, rpc_pb2.HashKVRequest),
        "auth/authenticate": (AuthService(node, access).Authenticate, rpc_pb2.AuthenticateRequest),
    }
    streams = {
        "watch": (watch.Watch, rpc_pb2.WatchRequest),
        "lease/keepalive": (lease.LeaseKeepAlive, rpc_pb2.LeaseKeepAliveRequest),
    }

    def unary_handler(call, cls):
        async def handler(request: web.Request) -> web.StreamResponse:
            try:
                msg = await _parse(request, cls)
                return web.Response(body=_json(await call(msg, _Context(request))), content_type="application/json")
            except wire.Abort as e:
                return _error(e.code, e.message)

        return handler

    def stream_handler(call, cls):
        async def handler(request: web.Request) -> web.StreamResponse:
            try:
                msg = await _parse(request, cls)
            except wire.Abort as e:
                return _error(e.code, e.message)

            async def one():
                yield msg
                await asyncio.Event().wait()  # the client's side stays open, as a gRPC stream's would

            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            try:
                async for out in call(one(), _Context(request)):
                    if not response.prepared:
                        await response.prepare(request)
                    await response.write(b'{"result":' + _json(out) + b"}\n")
            except wire.Abort as e:
                if not response.prepared:
                    return _error(e.code, e.message)
                await response.write(orjson.dumps({"error": {"grpc_code": e.code.value[0], "http_code": HTTP_STATUS.get(e.code, 500), "message": e.message}}) + b"\n")
            except (ConnectionResetError, KVError):
                pass
            return response

        return handler

    out = [web.get("/version", version)]
    for prefix in ("/v3/", "/v3beta/"):
        out += [web.post(prefix + path, unary_handler(call, cls)) for path, (call, cls) in unary.items()]
        out += [web.post(prefix + path, stream_handler(call, cls)) for path, (call, cls) in streams.items()]
    return out


async def version(request: web.Request) -> web.Response:
    return web.json_response({"etcdserver": wire.ETCD_VERSION, "etcdcluster": wire.ETCD_VERSION.rsplit(".", 1)[0] + ".0"})
