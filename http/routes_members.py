"""Membership routes: list, add (learner or voter), remove, promote. Changes are made by
the leader; any other node passes the request on to it."""

from __future__ import annotations

import orjson
from aiohttp import web

from kv import BadRequest, NotLeader

from .answer import Answer
from .context import ctx
from .errors import json_response
from .forward import forward_to_leader
from .params import consistency_param, json_body, read_timeout


async def list_members(request: web.Request) -> Answer:
    # After a read barrier, as a read of a key: a node that lagged (restarted, say) listed
    # the members it knew, without one whose addition had been acknowledged.
    node = ctx(request).node
    await node.read_barrier(consistency_param(request), read_timeout(request))
    return json_response({"members": node.members()})


async def _on_leader(request: web.Request, change, body: dict | None = None) -> Answer:
    try:
        members = await change()
    except NotLeader:
        return await forward_to_leader(request, orjson.dumps(body) if body is not None else b"")
    # (with the log index of the membership listed, the committed one, and the ids removed
    # before: a node that joins starts from them, kv/server/join.py)
    return json_response({"members": members, **ctx(request).node.membership_record()})


async def add_member(request: web.Request) -> Answer:
    doc = await json_body(request)
    mid, peer, http = doc.get("id"), doc.get("peer"), doc.get("http", "")
    voter, replace, ledger = doc.get("voter", False), doc.get("replace", False), doc.get("ledger", "")
    if not isinstance(mid, str) or not isinstance(peer, str):
        raise BadRequest('give the new member as {"id": "n4", "peer": "HOST:PORT", "http": "http://HOST:PORT", "voter": false}')
    if not isinstance(http, str) or not isinstance(ledger, str) or not isinstance(voter, bool) or not isinstance(replace, bool):
        raise BadRequest('"http" is a URL string, "ledger" a ledger id; "voter" and "replace" are true or false')
    node = ctx(request).node
    return await _on_leader(request, lambda: node.add_member(mid, peer, http, voter=voter, replace=replace, ledger=ledger), doc)


async def remove_member(request: web.Request) -> Answer:
    node = ctx(request).node
    mid = request.match_info["id"]
    return await _on_leader(request, lambda: node.remove_member(mid))


async def promote_member(request: web.Request) -> Answer:
    node = ctx(request).node
    mid = request.match_info["id"]
    return await _on_leader(request, lambda: node.promote_member(mid))


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/v1/members", list_members, name="members_list")
    r.add_post("/v1/members", add_member, name="members_add")
    r.add_delete("/v1/members/{id}", remove_member, name="members_remove")
    r.add_post("/v1/members/{id}/promote", promote_member, name="members_promote")
