"""Who may call what on the etcd API: the node's tokens (--token, --tokens), read from the
`token` or `authorization` metadata etcd's clients send, with the same roles and key
prefixes as the HTTP front (http/auth.py). Errors inside a call become its gRPC status."""

from __future__ import annotations

import logging

import grpc

from kv import Forbidden, Unauthorized
from kv.http.auth import Grant, a_role, grant_of
from kv.server.samples import Sample, labelled
from kv.statemachine.commands import prefix_end

from . import wire

log = logging.getLogger("kv.v3api")


class CallCounts:
    """The etcd API's calls on one node, by front (grpc, gateway), and its refusals by gRPC
    code: what /metrics shows of it (kv_etcd_api_*)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.errors: dict[str, int] = {}

    def samples(self) -> list[Sample]:
        return [
            labelled("counter", "kv_etcd_api_calls", "Calls of etcd's v3 API, by front (grpc, gateway).", "front", self.calls.items()),
            labelled("counter", "kv_etcd_api_errors", "Calls of etcd's v3 API answered with an error, by gRPC code.", "code", self.errors.items()),
        ]


class Access:
    """`async with access(context, role, ranges):` checks the caller, counts the call, then
    turns whatever the body raises into the call's status (etcd's code and text)."""

    def __init__(self, grants: dict[str, Grant] | None, front: str = "grpc", counts: CallCounts | None = None) -> None:
        self.grants, self.front = grants, front
        self.counts = counts if counts is not None else CallCounts()

    def __call__(self, context, role: str, ranges: list[tuple[bytes, bytes]]) -> _Guarded:
        self.count()
        return _Guarded(self, context, role, ranges)

    def guarded(self, context, role: str, ranges: list[tuple[bytes, bytes]]) -> _Guarded:
        """The same, for a call counted already."""
        return _Guarded(self, context, role, ranges)

    def count(self) -> None:
        calls = self.counts.calls
        calls[self.front] = calls.get(self.front, 0) + 1

    def status(self, e: Exception) -> tuple[grpc.StatusCode, str]:
        """The status a call ends with for e (etcd's code and text), counted."""
        code, message = wire.status_of(e)
        errors = self.counts.errors
        errors[code.name] = errors.get(code.name, 0) + 1
        if code == grpc.StatusCode.INTERNAL:
            log.exception("etcd API call failed", exc_info=e)
        return code, message

    async def refuse(self, context, e: Exception) -> None:
        """End the call with e's status (context.abort raises)."""
        await context.abort(*self.status(e))

    def check(self, context, role: str, ranges: list[tuple[bytes, bytes]]) -> None:
        """role: read, write, admin, lease (etcd's Lease service: a write token whose
        reach is not limited to a prefix), or anyone (no token needed: MemberList, Status and
        the list of alarms, which etcd answers without one and etcdctl asks without
        credentials).
        ranges: the keys touched, as (key, range_end)."""
        if self.grants is None or role == "anyone":
            return
        md = dict(context.invocation_metadata() or ())
        token = md.get("token") or md.get("authorization", "")
        if token.startswith("Bearer "):
            token = token[7:]
        if not token:
            # As etcd: InvalidArgument, which its clients give up on at once. "invalid auth
            # token" made etcdctl without --user retry 100 times over 2.6 s before failing.
            raise wire.Abort(grpc.StatusCode.INVALID_ARGUMENT, wire.ERR_NO_TOKEN)
        grant = grant_of(self.grants, f"Bearer {token}")
        if grant is None:
            raise Unauthorized("missing or wrong token")
        need = "write" if role == "lease" else role  # leases take a write token, as over HTTP
        if not grant.may(need):
            raise Forbidden(f"{a_role(grant.role)} token may not do this: it needs {a_role(need)} token")
        if grant.prefix:
            if role == "lease":
                raise Forbidden(f"a token scoped to {grant.prefix!r} manages leases over HTTP only")
            p = grant.prefix.encode()
            for key, end in ranges:
                inside = key.startswith(p) and (not end or (end <= prefix_end(p) and end != b"\x00"))
                if not inside:
                    raise Forbidden(f"this token reaches only keys under {grant.prefix!r}")


class _Guarded:
    """The body of one call: what it raises becomes the call's status. A class rather than
    an asynccontextmanager, whose generator and two steps through it cost every call a few
    microseconds (the etcd API's hot paths are a few tens of them)."""

    __slots__ = ("access", "context", "role", "ranges")

    def __init__(self, access: Access, context, role: str, ranges: list[tuple[bytes, bytes]]) -> None:
        self.access, self.context, self.role, self.ranges = access, context, role, ranges

    async def __aenter__(self) -> None:
        try:
            self.access.check(self.context, self.role, self.ranges)
        except Exception as e:
            await self.access.refuse(self.context, e)

    async def __aexit__(self, kind, e, tb) -> bool:
        if e is None or not isinstance(e, Exception):
            return False
        await self.access.refuse(self.context, e)
        return True
