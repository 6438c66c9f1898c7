"""What a request carries, read and checked: its body (within a limit, in time), a JSON
object, a log index in the query, the caller's timeout (X-Kv-Timeout) and a write's
session request id (X-Kv-Session, X-Kv-Seq)."""

from __future__ import annotations

import asyncio
import re

import orjson
from aiohttp import web

from kv import BadRequest, RequestId, ValueTooLarge

from .context import CONTEXT, ctx


async def read_body(request: web.Request, limit: int, what: str = "the body", limit_flag: str = "") -> bytes:
    """The whole request body, refusing (413) anything over `limit` — before reading it
    when Content-Length says so, else as soon as more than `limit` bytes arrived — and
    (408) one that has not fully arrived within the idle timeout (--http-idle-timeout-s):
    a slow sender would otherwise hold its connection for ever. `limit_flag` names the
    setting that sets `limit`, for the 413's message."""
    the_limit = f"the limit is {limit} bytes" + (f" ({limit_flag})" if limit_flag else "")
    if request.content_length is not None and request.content_length > limit:
        raise ValueTooLarge(f"{what} is {request.content_length} bytes; {the_limit}")
    content = request.content
    if content.is_eof():  # the usual small body: it came with the headers, no timer needed
        body = content.read_nowait()
        if len(body) > limit:
            raise ValueTooLarge(f"{what} is larger than allowed: {the_limit}")
        return body
    parts, size = [], 0
    idle_s = request.app[CONTEXT].node.config.http_idle_timeout_s
    try:
        async with asyncio.timeout(idle_s):
            while True:
                chunk = await content.readany()
                if not chunk:
                    return b"".join(parts)
                size += len(chunk)
                if size > limit:
                    raise ValueTooLarge(f"{what} is larger than allowed: {the_limit}")
                parts.append(chunk)
    except TimeoutError:
        raise web.HTTPRequestTimeout(text=f"{what} did not arrive within {idle_s:g}s (--http-idle-timeout-s); send it without pauses") from None


TIMEOUT_HEADER = "X-Kv-Timeout"  # kv.Client sends it on every request
# kv.Client sends the cluster id it reached first ("" before it knows it, and the answer
# says it): a node of another cluster refuses the request (421) before doing anything.
CLUSTER_HEADER = "X-Kv-Cluster"
_SECONDS = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,9})?")


def write_timeout(request: web.Request) -> float | None:
    """The seconds a write may wait here: X-Kv-Timeout, at most --write-timeout-s."""
    return _timeout(request, request.app[CONTEXT].node.config.write_timeout_s)


def consistency_param(request: web.Request) -> str:
    """?consistency= of a read: linearizable (the default), lease or stale (kv.Node checks it)."""
    return request.query.get("consistency", "linearizable")


def read_timeout(request: web.Request) -> float | None:
    """The seconds a linearizable read may wait here: X-Kv-Timeout, at most --read-timeout-s."""
    return _timeout(request, request.app[CONTEXT].node.config.read_timeout_s)


def _timeout(request: web.Request, limit_s: float) -> float | None:
    """X-Kv-Timeout: how many seconds the caller waits for this answer. The node answers
    within them, at most within its own limit: with 503 NO_LEADER when no leader took a
    write in time (it was not carried out: retry), or 504 when its outcome is unknown.
    Without it the caller could give up first and could not tell the one from the other.
    None: the node's own limit."""
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return None
    if _SECONDS.fullmatch(value.strip()) is None or float(value) < 0.001:
        raise BadRequest(f"{TIMEOUT_HEADER} must be a number of seconds of at least 0.001, in digits with an optional fraction such as 2.5, not {value!r}")
    return min(float(value), limit_s)


MAX_INDEX = (1 << 63) - 1  # a mod_index is a log index, which fits a signed 64-bit integer


def index_param(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"{name} must be a log index (an integer), not {raw!r}") from None
    if value > MAX_INDEX:
        raise BadRequest(f"{name} must be at most {MAX_INDEX}")
    if value < 1:
        raise BadRequest(f"{name} must be at least 1")
    return value


def revision_param(request: web.Request) -> int | None:
    """?revision=N: read as of that revision (None: now)."""
    return index_param(request, "revision", 0) or None


async def json_body(request: web.Request) -> dict:
    raw = await read_body(request, ctx(request).max_json_bytes, "the JSON document")
    try:
        doc = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise BadRequest("the body must be a JSON object")
    return doc


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
