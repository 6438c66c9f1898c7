"""Client sessions over HTTP: exactly-once writes for any client (kv/sessions.py).

    POST /v1/sessions                      -> {"id": 8230472315, "ttl": 600}
    PUT /v1/kv/k  X-Kv-Session: 8230472315  X-Kv-Seq: 1

A write sent with X-Kv-Session and X-Kv-Seq is applied at most once however often it is
sent: send it again, with the same two headers, to any node until it is answered, and every
copy gets the first one's answer. A session carries one request at a time, numbered
upwards (a client with several in flight opens several sessions). Writes without the
headers go in the node's own sessions: safe from the node's retries, not from the client's.
"""

from __future__ import annotations

import re

from aiohttp import web

from kv import BadRequest, RequestId

from .answer import Answer
from .context import ctx
from .errors import json_response, write_timeout

SESSION_HEADER, SEQ_HEADER = "X-Kv-Session", "X-Kv-Seq"
_DIGITS = re.compile(r"[0-9]{1,19}")


def request_id(request: web.Request) -> RequestId | None:
    """The write's (session, seq) from X-Kv-Session and X-Kv-Seq, or None without them."""
    session, seq = request.headers.get(SESSION_HEADER), request.headers.get(SEQ_HEADER)
    if session is None and seq is None:
        return None
    if session is None or seq is None:
        raise BadRequest(f"send {SESSION_HEADER} and {SEQ_HEADER} together (a session from POST /v1/sessions, and this request's number in it)")
    return RequestId.checked(_number(SESSION_HEADER, session), _number(SEQ_HEADER, seq))


def _number(name: str, raw: str) -> int:
    raw = raw.strip()
    if _DIGITS.fullmatch(raw) is None:
        raise BadRequest(f"{name} must be a positive integer in digits, not {raw[:40]!r}")
    return int(raw)


async def open_session(request: web.Request) -> Answer:
    c = ctx(request)
    session = await c.node.open_session(timeout=write_timeout(request))
    ttl = c.node.config.session_ttl_s
    return json_response({"id": session, "ttl": int(ttl) if ttl == int(ttl) else ttl})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/sessions", open_session, name="sessions_open")
