"""Between etcd's messages (proto/) and kv.Node's: keys, key-values, response headers, and
ledgerkv's errors as the gRPC status codes and texts etcd's clients match on."""

from __future__ import annotations

import logging

import grpc

from kv import (
    BadRequest,
    Compacted,
    Forbidden,
    FutureRevision,
    KeyNotFound,
    KVError,
    LeaseExists,
    LeaseNotFound,
    NoQuorum,
    NoSpace,
    NotLeader,
    Timeout,
    Unauthorized,
    Unavailable,
    ValueTooLarge,
)
from kv.statemachine import commands as cmds

from .proto import kv_pb2, rpc_pb2

log = logging.getLogger("kv.v3api")

# etcd's texts (clients compare them: python-etcd3's exceptions, the Go client's rpctypes)
ERR_COMPACTED = "etcdserver: mvcc: required revision has been compacted"
ERR_FUTURE_REV = "etcdserver: mvcc: required revision is a future revision"
ERR_LEASE_NOT_FOUND = "etcdserver: requested lease not found"
ERR_LEASE_EXISTS = "etcdserver: lease already exists"
ERR_KEY_NOT_FOUND = "etcdserver: key not found"
ERR_EMPTY_KEY = "etcdserver: key is not provided"
ERR_DUPLICATE_KEY = "etcdserver: duplicate key given in txn request"
ERR_TOO_MANY_OPS = "etcdserver: too many operations in txn request"
ERR_NO_LEADER = "etcdserver: no leader"
ERR_TOO_LARGE = "etcdserver: request is too large"
ERR_TIMEOUT = "etcdserver: request timed out"
ERR_NO_SPACE = "etcdserver: mvcc: database space exceeded"
ERR_PERMISSION = "etcdserver: permission denied"
ERR_AUTH_NOT_ENABLED = "etcdserver: authentication is not enabled"
ERR_AUTH_FAILED = "etcdserver: authentication failed, invalid user ID or password"
ERR_TOKEN = "etcdserver: invalid auth token"
ERR_NO_TOKEN = "etcdserver: user name is empty"  # (etcd's answer to a call without a token)

ETCD_VERSION = "3.4.0"  # the API level served: clients check the major and minor


class Abort(KVError):
    """A request refused with a gRPC status and etcd's message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def status_of(e: Exception) -> tuple[grpc.StatusCode, str]:
    """The gRPC status for an error of kv.Node's (with etcd's text where it has one)."""
    if isinstance(e, Abort):
        return e.code, e.message
    if isinstance(e, LeaseNotFound):
        return grpc.StatusCode.NOT_FOUND, ERR_LEASE_NOT_FOUND
    if isinstance(e, KeyNotFound):
        return grpc.StatusCode.INVALID_ARGUMENT, ERR_KEY_NOT_FOUND
    if isinstance(e, LeaseExists):
        return grpc.StatusCode.FAILED_PRECONDITION, ERR_LEASE_EXISTS
    if isinstance(e, Compacted):
        return grpc.StatusCode.OUT_OF_RANGE, ERR_COMPACTED
    if isinstance(e, FutureRevision):
        return grpc.StatusCode.OUT_OF_RANGE, ERR_FUTURE_REV
    if isinstance(e, ValueTooLarge):  # (etcd's text, which clients map; the log says which limit)
        return _logged(e, grpc.StatusCode.INVALID_ARGUMENT, ERR_TOO_LARGE)
    # etcd's exact texts: clients compare them (what ledgerkv would add goes to the log)
    if isinstance(e, (NotLeader, NoQuorum)):
        return _logged(e, grpc.StatusCode.UNAVAILABLE, ERR_NO_LEADER)
    if isinstance(e, Timeout):
        return _logged(e, grpc.StatusCode.UNAVAILABLE, ERR_TIMEOUT)
    if isinstance(e, NoSpace):
        return _logged(e, grpc.StatusCode.RESOURCE_EXHAUSTED, ERR_NO_SPACE)
    if isinstance(e, Unauthorized):
        return grpc.StatusCode.UNAUTHENTICATED, ERR_TOKEN
    if isinstance(e, Forbidden):
        return _logged(e, grpc.StatusCode.PERMISSION_DENIED, ERR_PERMISSION)
    if isinstance(e, (BadRequest, cmds.CommandError)):
        return grpc.StatusCode.INVALID_ARGUMENT, f"etcdserver: {e}"
    if isinstance(e, Unavailable):
        return grpc.StatusCode.UNAVAILABLE, f"etcdserver: {e}"
    if isinstance(e, KVError):
        return grpc.StatusCode.UNKNOWN, f"etcdserver: {e}"
    return grpc.StatusCode.INTERNAL, f"etcdserver: {type(e).__name__}: {e}"


def _logged(e: Exception, code: grpc.StatusCode, text: str) -> tuple[grpc.StatusCode, str]:
    log.info("etcd API call answered %s %r: %s", code.name, text, e)
    return code, text


def key_of(raw: bytes) -> str:
    """A key of one key (not a range's start), as kv.Node takes keys (cmds.key_text)."""
    if not raw:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, ERR_EMPTY_KEY)
    return cmds.key_text(raw)


def range_start(key: bytes, range_end: bytes) -> bytes:
    """etcd's start of a range; "\\0" with range end "\\0" is every key. A range needs a
    key, as etcd's: an empty one with a range end is refused too (it read, and deleted, from
    the first key on)."""
    if not key:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, ERR_EMPTY_KEY)
    if range_end:
        return b"" if key == b"\x00" else key
    key_of(key)
    return key


class Headers:
    """The ResponseHeader of a node: cluster and member id, its term, a revision."""

    def __init__(self, node) -> None:
        self.node = node
        self._ids_of = None  # the state's cluster identity the ids were derived from
        self._fresh()

    def _fresh(self) -> None:
        """The ids anew when the cluster's identity changed (chosen by the first leader, or
        a snapshot installed)."""
        sm = self.node.sm
        self._ids_of = sm.cluster_id if sm is not None else None
        self.cluster_id, self.member_id = self.node.ids()
        self._ids_field = _uint_field(1, self.cluster_id) + _uint_field(2, self.member_id)
        self._term, self._term_field = -1, b""

    def _current(self):
        """The node, its ids made anew first if its cluster's identity changed."""
        node = self.node
        if node.sm is not None and node.sm.cluster_id is not self._ids_of:
            self._fresh()
        return node

    def __call__(self, revision: int) -> rpc_pb2.ResponseHeader:
        node = self._current()
        raft = node.raft
        return rpc_pb2.ResponseHeader(cluster_id=self.cluster_id, member_id=self.member_id, revision=revision, raft_term=raft.term if raft else 0)

    def put_response(self, revision: int) -> bytes:
        """A plain put's PutResponse, serialized: this header and nothing else. Written
        here field by field (the ids and the term as they were last encoded) rather than
        made as a message and serialized, which cost 2-2.5 µs of the leader's loop a put."""
        node = self._current()
        raft = node.raft
        term = raft.term if raft else 0
        if term != self._term:
            self._term, self._term_field = term, _uint_field(4, term)
        header = self._ids_field + _uint_field(3, revision) + self._term_field
        return b"\x0a" + bytes((len(header),)) + header  # PutResponse.header, field 1 (at most 44 bytes: its length is one)

    def without_revision(self) -> rpc_pb2.ResponseHeader:
        """The header of etcd's cluster calls: ids and term, no revision."""
        node = self._current()
        raft = node.raft
        return rpc_pb2.ResponseHeader(cluster_id=self.cluster_id, member_id=self.member_id, raft_term=raft.term if raft else 0)

    def now(self) -> rpc_pb2.ResponseHeader:
        raft = self.node.raft
        return self(raft.applied_index if raft else 0)


def _uint_field(number: int, value: int) -> bytes:
    """A varint field of a protobuf message (proto3: a zero is not written)."""
    if not value:
        return b""
    out = [number << 3]
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def kv_message(kv: cmds.KeyValue, value: bool = True) -> kv_pb2.KeyValue:
    return kv_pb2.KeyValue(
        key=cmds.key_bytes(kv.key), create_revision=kv.create_revision, mod_revision=kv.mod_revision, version=kv.version,
        value=kv.value if value else b"", lease=kv.lease
    )


def limit_of(r: rpc_pb2.RangeRequest) -> int:
    """A range's limit; 0 and below: none (etcd reads a negative limit as none)."""
    return r.limit if r.limit > 0 else 0


def range_req(r: rpc_pb2.RangeRequest) -> cmds.RangeReq:
    """The state machine's part of a Range (sorting, revision filters and the limit after
    a sort are the front's: see select). Sorted by value, the values are read even with
    keys_only (finish_range drops them after the sort)."""
    if not (0 <= r.sort_target <= rpc_pb2.RangeRequest.VALUE and 0 <= r.sort_order <= rpc_pb2.RangeRequest.DESCEND):
        # (etcd 3.4 stops on a sort target it does not know)
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"etcdserver: a range's sort_target is 0-4 and sort_order 0-2, not {r.sort_target} and {r.sort_order}")
    keys_only = r.keys_only and r.sort_target != rpc_pb2.RangeRequest.VALUE
    return cmds.RangeReq(range_start(r.key, r.range_end), r.range_end, 0 if reads_whole(r) else limit_of(r), keys_only, r.count_only)


def _order(r: rpc_pb2.RangeRequest) -> int:
    if r.sort_order == rpc_pb2.RangeRequest.NONE and r.sort_target != rpc_pb2.RangeRequest.KEY:
        return rpc_pb2.RangeRequest.ASCEND  # etcd: a target without an order sorts ascending
    return r.sort_order


def reads_whole(r: rpc_pb2.RangeRequest) -> bool:
    """Whether the limit applies only after every key of the range is read: a sort other
    than by key ascending, or revision filters."""
    order = _order(r)
    sorted_ = order != rpc_pb2.RangeRequest.NONE and not (r.sort_target == rpc_pb2.RangeRequest.KEY and order == rpc_pb2.RangeRequest.ASCEND)
    return bool(sorted_ or r.min_mod_revision or r.max_mod_revision or r.min_create_revision or r.max_create_revision)


def select(r: rpc_pb2.RangeRequest, kvs, more: bool) -> tuple[list[cmds.KeyValue], bool]:
    """The front's part of a Range: revision filters, then the sort, then the limit."""
    kvs = list(kvs)
    if r.min_mod_revision or r.max_mod_revision or r.min_create_revision or r.max_create_revision:
        kvs = [
            kv for kv in kvs
            if (not r.min_mod_revision or kv.mod_revision >= r.min_mod_revision)
            and (not r.max_mod_revision or kv.mod_revision <= r.max_mod_revision)
            and (not r.min_create_revision or kv.create_revision >= r.min_create_revision)
            and (not r.max_create_revision or kv.create_revision <= r.max_create_revision)
        ]
    order = _order(r)
    if order != rpc_pb2.RangeRequest.NONE:
        field = {
            rpc_pb2.RangeRequest.KEY: lambda kv: cmds.key_bytes(kv.key),
            rpc_pb2.RangeRequest.VERSION: lambda kv: kv.version,
            rpc_pb2.RangeRequest.CREATE: lambda kv: kv.create_revision,
            rpc_pb2.RangeRequest.MOD: lambda kv: kv.mod_revision,
            rpc_pb2.RangeRequest.VALUE: lambda kv: kv.value,
        }[r.sort_target]
        kvs.sort(key=field, reverse=order == rpc_pb2.RangeRequest.DESCEND)
    limit = limit_of(r)
    if limit and len(kvs) > limit:
        kvs, more = kvs[:limit], True
    return kvs, more


def finish_range(r: rpc_pb2.RangeRequest, got: cmds.RangeResp, header) -> rpc_pb2.RangeResponse:
    """etcd's RangeResponse from the state machine's answer (see select)."""
    kvs, more = select(r, got.kvs, got.more)
    values = not r.keys_only
    return rpc_pb2.RangeResponse(header=header, kvs=[kv_message(kv, values) for kv in kvs], more=more, count=got.count)
