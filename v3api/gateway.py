"""etcd's JSON gateway on the node's HTTP port: `POST /v3/<service>/<method>` with the
request as JSON (proto field names, bytes as base64, 64-bit integers as strings), answered
as etcd 3.4's grpc-gateway answers; streams (watch, lease keepalive) as one JSON object a
line, each `{"result": ...}`; `GET /version`. The same services as the gRPC front
(kv_service and the rest), called with a context that reads the token from the
Authorization header (with or without "Bearer ") and turns an abort into the gateway's
error body `{"error", "code", "message"}` with its HTTP status."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
from http import HTTPStatus

import grpc
import orjson
from aiohttp import web
from google.protobuf import json_format

from kv import KVError
from kv.http.context import ctx

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
GONE_CHECK_S = 1.0  # how often a stream whose answers go on looks whether its client is still there


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


async def _body(request: web.Request) -> bytes:
    """The whole body, up to MAX_BODY (a read of the stream returns what has arrived so far)."""
    if request.content_length is not None and request.content_length > MAX_BODY:
        raise wire.Abort(grpc.StatusCode.INVALID_ARGUMENT, wire.ERR_TOO_LARGE)
    chunks, size = [], 0
    while chunk := await request.content.read(1 << 16):
        size += len(chunk)
        if size > MAX_BODY:
            raise wire.Abort(grpc.StatusCode.INVALID_ARGUMENT, wire.ERR_TOO_LARGE)
        chunks.append(chunk)
    return b"".join(chunks)


def _message(obj, cls, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
    """cls from one decoded JSON value, checked as etcd's gateway checks it: bytes in strict
    base64 (Python's decoder drops what is not base64, which would write another key than
    the one sent), enum values as numbers or their exact names; unknown fields ignored."""
    msg = cls()
    try:
        if obj is not None:  # (etcd's gateway takes a body of null as {})
            if not isinstance(obj, dict):
                raise json_format.ParseError(f"expected an object, not {type(obj).__name__}")
            check_json(obj, msg.DESCRIPTOR)
            json_format.ParseDict(obj, msg, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError) as e:
        raise wire.Abort(code, f"the body is not a {cls.__name__} in JSON: {e}") from None
    return msg


_BASE64 = re.compile(r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")


@functools.cache
def _fields(descriptor) -> dict:
    """A message's fields by the names JSON may give them: the proto name and the camelCase one."""
    return {**descriptor.fields_by_name, **{f.json_name: f for f in descriptor.fields}}


def check_json(obj: dict, descriptor) -> None:
    """What json_format lets through and etcd's gateway refuses: ValueError naming the field."""
    for name, value in obj.items():
        f = _fields(descriptor).get(name)
        if f is None or value is None:
            continue
        for v in value if f.is_repeated and isinstance(value, list) else [value]:
            if f.type == f.TYPE_BYTES and not (isinstance(v, str) and _BASE64.fullmatch(v)):
                raise ValueError(f"{name}: illegal base64 data {v!r:.40}")
            if f.type == f.TYPE_ENUM and not (type(v) is int or (isinstance(v, str) and f.enum_type.values_by_name.get(v) is not None)):
                raise ValueError(f"{name}: unknown value {v!r:.40} for enum {f.enum_type.full_name}")
            if f.type == f.TYPE_MESSAGE:
                if not isinstance(v, dict):  # (json_format reads a string's characters as field names, and ignores them)
                    raise ValueError(f"{name}: expected an object, not {type(v).__name__}")
                check_json(v, f.message_type)


def _values(body: bytes, stream: bool) -> list:
    """The JSON values of a body, one after another ({} for none), as etcd's gateway reads
    them: a stream's requests; a call's is the first (what follows it is not looked at)."""
    text, out, pos, decoder = body.decode("utf-8"), [], 0, json.JSONDecoder()
    while True:
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        if pos == len(text) or (out and not stream):
            return out or [{}]
        value, pos = decoder.raw_decode(text, pos)
        out.append(value)


async def _requests(request: web.Request, cls, stream: bool) -> list:
    """The body's requests (a call's one); a body that is not JSON, or not of cls, is refused
    as etcd's gateway refuses it: InvalidArgument for a call, Unknown for a stream."""
    code = grpc.StatusCode.UNKNOWN if stream else grpc.StatusCode.INVALID_ARGUMENT
    body = await _body(request)
    try:
        values = _values(body, stream)
    except ValueError as e:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise wire.Abort(code, f"the body is not a {cls.__name__} in JSON: {e}") from None
    return [_message(v, cls, code) for v in values]


def routes(node, grants, counts: CallCounts | None = None) -> list[web.RouteDef]:
    """The gateway's routes for node (grants: the node's tokens, None for none; counts:
    where its calls are counted, shared with the gRPC front)."""
    access = Access(grants, "gateway", counts)
    kv, lease = KVService(node, access), LeaseService(node, access)
    cluster, maintenance, watch = ClusterService(node, access, node.config.grpc_url), MaintenanceService(node, access), WatchService(node, access)
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
        "maintenance/hash": (maintenance.Hash, rpc_pb2.HashRequest),  # (etcd 3.4's gateway: Hash, though HashKV names the same path)
        "auth/authenticate": (AuthService(node, access).Authenticate, rpc_pb2.AuthenticateRequest),
    }
    streams = {  # (whether the answers go on after the requests: a watch's do, keepalives' do not)
        "watch": (watch.Watch, rpc_pb2.WatchRequest, True),
        "lease/keepalive": (lease.LeaseKeepAlive, rpc_pb2.LeaseKeepAliveRequest, False),
    }

    def unary_handler(call, cls):
        async def handler(request: web.Request) -> web.StreamResponse:
            try:
                msg = (await _requests(request, cls, stream=False))[0]
                return web.Response(body=_json(await call(msg, _Context(request))), content_type="application/json")
            except wire.Abort as e:
                return _error(e.code, e.message)

        return handler

    def stream_handler(call, cls, goes_on: bool):
        async def handler(request: web.Request) -> web.StreamResponse:
            try:
                msgs = await _requests(request, cls, stream=True)
            except wire.Abort as e:
                return _error(e.code, e.message)

            closing = _Closing()  # the node's HTTP server is stopping (it closes the open watch streams)

            async def requests():
                for m in msgs:
                    yield m
                if goes_on:
                    # The client's side stays open, as a gRPC stream's would, until the client
                    # goes: aiohttp tells a handler so only when it writes, and a watch of a
                    # quiet key may not write for hours (its watches stayed until then).
                    while not _gone(request) and not closing.is_set():
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(GONE_CHECK_S):
                                await closing.wait()  # (the stop ends it at once)
                    if closing.is_set():  # (etcd's last line then; the stream ends whole)
                        raise wire.Abort(grpc.StatusCode.UNAVAILABLE, "transport is closing")
                    raise wire.Abort(grpc.StatusCode.CANCELLED, "the client closed the connection")

            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            streams = ctx(request).watch_streams
            streams.add(closing)
            try:
                async for out in call(requests(), _Context(request)):
                    if not response.prepared:
                        await response.prepare(request)
                    await response.write(b'{"result":' + _json(out) + b"}\n")
            except wire.Abort as e:
                if _gone(request):
                    return response
                if not response.prepared:
                    return _error(e.code, e.message)
                http_code = HTTP_STATUS.get(e.code, 500)
                line = {"error": {"grpc_code": e.code.value[0], "http_code": http_code, "message": e.message, "http_status": HTTPStatus(http_code).phrase}}
                with contextlib.suppress(ConnectionError):  # (gone as it was told)
                    await response.write(orjson.dumps(line) + b"\n")
            except (ConnectionError, KVError):  # the client went away (aiohttp's "Connection lost" too)
                pass
            finally:
                streams.discard(closing)
            return response

        return handler

    async def health(request: web.Request) -> web.Response:
        """etcd's /health: true while a leader is known and no alarm is raised (no token)."""
        s = node.status()
        ok = s.get("leader") is not None and not s.get("alarms") and not node.raised_alarms()
        return web.json_response({"health": "true" if ok else "false"}, status=200 if ok else 503)

    out = [web.get("/version", version), web.get("/health", health), web.route("*", "/v2/{path:.*}", etcd_v2)]
    for prefix in ("/v3/", "/v3beta/"):
        out += [web.post(prefix + path, unary_handler(call, cls)) for path, (call, cls) in unary.items()]
        out += [web.post(prefix + path, stream_handler(call, cls, goes_on)) for path, (call, cls, goes_on) in streams.items()]
        out.append(web.post(prefix + "{call:.+}", unserved))  # (after the routes above: they match first)
    return out


async def unserved(request: web.Request) -> web.Response:
    """A gateway call ledgerkv does not serve (defragment, users and roles...): etcd's error
    body, UNIMPLEMENTED, as its gRPC port answers the same call."""
    return _error(grpc.StatusCode.UNIMPLEMENTED, f"ledgerkv does not serve etcd's {request.match_info['call']}: docs/etcd.md lists what it serves")


async def etcd_v2(request: web.Request) -> web.Response:
    """etcd's v2 API (ETCDCTL_API=2, v2 clients): not served. The answer is a v2 error, which
    etcdctl prints as "Error:  404: <message> (<path>) [0]" (etcd 3.4, whose v2 API is off
    by default, answers "404 page not found", which etcdctl reports as invalid JSON)."""
    return web.json_response(
        {
            "errorCode": 404,
            "message": "ledgerkv serves etcd's v3 API, not v2: use ETCDCTL_API=3 (etcdctl 3.4's default) with this node's --grpc address",
            "cause": request.path,
            "index": 0,
        },
        status=404,
    )


class _Closing(asyncio.Event):
    """A gateway stream in the node's set of open watch streams, closed (set) when its HTTP
    server stops."""

    def close(self) -> None:
        self.set()


def _gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


async def version(request: web.Request) -> web.Response:
    """The etcd API level (what clients check) and, for whoever asks which build a node
    runs, ledgerkv's own version (etcd's clients ignore a field they do not know)."""
    import kv

    return web.json_response(
        {"etcdserver": wire.ETCD_VERSION, "etcdcluster": wire.ETCD_VERSION.rsplit(".", 1)[0] + ".0", "ledgerkv": kv.__version__}
    )
