"""An admin request this node cannot serve (a membership change, a leadership transfer, on
a follower) passed to the leader's HTTP API, once."""

from __future__ import annotations

from aiohttp import web

from kv import NotLeader
from kv.server.access import request_forwarded

from .answer import Answer
from .context import ctx

FORWARDED = "X-Kv-Forwarded"  # set on a forwarded request: the leader never forwards it again


async def forward_to_leader(request: web.Request, body: bytes) -> Answer:
    """Pass an admin request to the leader's HTTP API and return its answer."""
    c = ctx(request)
    url = c.node.leader_url()
    if url is None or request.headers.get(FORWARDED):
        raise NotLeader("this node is not the leader and cannot reach it over HTTP; send the request to the leader", c.node.status().get("leader"))
    request_forwarded.set(True)
    headers = {FORWARDED: c.node.config.id, "Content-Type": "application/json"}
    if "Authorization" in request.headers:
        headers["Authorization"] = request.headers["Authorization"]
    try:
        async with c.session.request(request.method, url + request.path_qs, data=body, headers=headers) as resp:
            data = await resp.read()
            return Answer(data, resp.status, resp.content_type)
    except Exception as e:
        raise NotLeader(f"forwarding to the leader at {url} failed: {e}", c.node.status().get("leader")) from e
