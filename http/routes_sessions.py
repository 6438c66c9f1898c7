"""Client sessions over HTTP: exactly-once writes for any client (kv/common/sessions.py and kv/server/writes.py).

    POST /v1/sessions                      -> {"id": 8230472315, "ttl": 600}
    PUT /v1/kv/k  X-Kv-Session: 8230472315  X-Kv-Seq: 1

A write sent with X-Kv-Session and X-Kv-Seq is applied at most once however often it is
sent: send it again, with the same two headers, to any node until it is answered, and every
copy gets the first one's answer. A session carries one request at a time, numbered
upwards (a client with several in flight opens several sessions). Writes without the
headers go in the node's own sessions: safe from the node's retries, not from the client's.
"""

from __future__ import annotations

from aiohttp import web


from .answer import Answer
from .auth import GRANT
from .context import ctx
from .errors import json_response
from .params import write_timeout

async def open_session(request: web.Request) -> Answer:
    c = ctx(request)
    grant = request.get(GRANT)  # (a token that is not admin holds a bounded number: kv.Node.open_session)
    owner = request.headers.get("Authorization") if grant is not None and grant.role != "admin" else None
    session = await c.node.open_session(timeout=write_timeout(request), owner=owner)
    ttl = c.node.config.session_ttl_s
    return json_response({"id": session, "ttl": int(ttl) if ttl == int(ttl) else ttl})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/sessions", open_session, name="sessions_open")
