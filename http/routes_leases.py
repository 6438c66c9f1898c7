"""Lease routes. Any node takes them: grants and revokes go through the log (a follower
forwards them like any write); keepalives and queries are answered by the leader from its
clock (a follower forwards those over the peer link)."""

from __future__ import annotations

from aiohttp import web

from kv import BadRequest, LeaseNotFound, LeaseStatus

from .answer import Answer
from .auth import hidden_leases, lease_prefix
from .context import ctx
from .errors import json_response
from .params import json_body, request_id, write_timeout


def lease_path_id(request: web.Request) -> int:
    raw = request.match_info["id"]
    if not raw.isascii() or not raw.isdigit() or len(raw) > 19:
        raise BadRequest(f"a lease id is a positive integer, not {raw!r}")
    return int(raw)


def seconds(x: float) -> int | float:
    return int(x) if x == int(x) else x


def lease_json(s: LeaseStatus, *, remaining: bool = True, keys: bool = True) -> dict:
    out = {"id": s.id, "ttl": seconds(s.ttl)}
    if remaining:
        out["remaining"] = seconds(s.remaining)
    if keys:
        out["keys"] = list(s.keys)
    return out


async def grant(request: web.Request) -> Answer:
    doc = await json_body(request)
    if set(doc) != {"ttl"}:
        raise BadRequest('give the lease\'s time to live in seconds: {"ttl": 10}')
    s = await ctx(request).node.lease_grant(doc["ttl"], owner=lease_prefix(request), timeout=write_timeout(request), request_id=request_id(request))
    return json_response(lease_json(s, remaining=False, keys=False))


async def visible_lease(request: web.Request) -> int:
    """The lease id of the path, if the caller's token may reach it; else LeaseNotFound, as
    for a lease that does not exist (a tenant learns nothing of another's leases)."""
    lease = lease_path_id(request)
    if await hidden_leases(request, ctx(request).node, [lease]):
        raise LeaseNotFound(lease)
    return lease


async def keepalive(request: web.Request) -> Answer:
    s = await ctx(request).node.lease_keepalive(await visible_lease(request), timeout=write_timeout(request))
    return json_response(lease_json(s, remaining=False, keys=False))


async def keepalive_many(request: web.Request) -> Answer:
    doc = await json_body(request)
    example = '{"ids": [7587862104061, 7587862104062]}'
    if set(doc) - {"ids"}:
        raise BadRequest(f"unknown field(s) {sorted(set(doc) - {'ids'})}; the body is {example}")
    ids = doc.get("ids")
    if not isinstance(ids, list):
        raise BadRequest(f"give the lease ids to renew as a list: {example}")
    wrong = [x for x in ids if type(x) is not int]
    if wrong:
        raise BadRequest(f"lease ids are integers, not {wrong[0]!r}: {example}")
    node = ctx(request).node
    hidden = await hidden_leases(request, node, set(ids)) if lease_prefix(request) and ids else set()
    asked = [x for x in ids if x not in hidden]
    renewed = dict.fromkeys(ids)  # each lease once, in order; a hidden one as not found
    if asked or not ids:  # (none at all: the node says how many it takes)
        renewed |= zip(asked, await node.lease_keepalives(asked, timeout=write_timeout(request)))
    return json_response(
        {
            "leases": [lease_json(s, remaining=False, keys=False) for s in renewed.values() if s is not None],
            "not_found": [lease for lease, s in renewed.items() if s is None],
        }
    )


async def info(request: web.Request) -> Answer:
    return json_response(lease_json(await ctx(request).node.lease_info(await visible_lease(request))))


async def list_leases(request: web.Request) -> Answer:
    node = ctx(request).node
    leases = await node.lease_list()
    hidden = await hidden_leases(request, node, [s.id for s in leases])
    leases = [s for s in leases if s.id not in hidden]
    return json_response({"leases": [lease_json(s, keys=False) for s in leases]})


async def revoke(request: web.Request) -> Answer:
    lease = await visible_lease(request)
    r = await ctx(request).node.lease_revoke(lease, timeout=write_timeout(request), request_id=request_id(request))
    return json_response({"id": lease, "index": r.index, "keys": list(r.keys)})


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_post("/v1/leases", grant, name="leases_grant")
    r.add_get("/v1/leases", list_leases, name="leases_list")
    r.add_post("/v1/leases/keepalive", keepalive_many, name="leases_keepalive_many")  # before /v1/leases/{id}
    r.add_post("/v1/leases/{id}/keepalive", keepalive, name="leases_keepalive")
    r.add_get("/v1/leases/{id}", info, name="leases_get")
    r.add_delete("/v1/leases/{id}", revoke, name="leases_revoke")
