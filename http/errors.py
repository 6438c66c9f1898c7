"""The HTTP error model: {"error": {"code": "...", "message": "..."}} with a fitting status."""

from __future__ import annotations

import asyncio
import logging
import re

import orjson
from aiohttp import web

from kv import BadRequest, KVError, ValueTooLarge

from .answer import Answer
from .context import CONTEXT

log = logging.getLogger("kv.http")


def json_response(data, status: int = 200, headers: dict | None = None) -> Answer:
    return Answer(orjson.dumps(data), status, "application/json", headers)


def error_response(status: int, code: str, message: str, details: dict | None = None) -> Answer:
    return json_response({"error": {"code": code, "message": message, **(details or {})}}, status)


_HTTP_CODES = {400: "BAD_REQUEST", 401: "UNAUTHORIZED", 403: "FORBIDDEN", 404: "NOT_FOUND", 408: "REQUEST_TIMEOUT", 405: "METHOD_NOT_ALLOWED", 413: "VALUE_TOO_LARGE"}


async def run_handler(request: web.Request, handler) -> Answer | web.StreamResponse:
    """Run the handler and turn what it raises into the error model."""
    try:
        return await handler(request)
    except KVError as e:
        return error_response(e.http_status, e.code, str(e), e.details())
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = _HTTP_CODES.get(e.status, "HTTP_ERROR")
        message = e.text if e.text and not e.text.startswith(f"{e.status}:") else e.reason
        if e.status == 404:
            message = f"no route {request.method} {request.path}; see /v1/openapi.json"
        elif e.status == 405:
            message = f"{request.method} is not allowed on {request.path}"
        resp = error_response(e.status, code, message)
        if e.status == 405 and "Allow" in e.headers:
            resp.headers = {"Allow": e.headers["Allow"]}
        elif e.status == 408:
            # The rest of the request is not coming in time: no next request on this
            # connection either (RFC 9110 §15.5.9). aiohttp sends "Connection: close",
            # reads on for its lingering time so that the answer is not lost to a reset,
            # and closes.
            resp.close = True
        return resp
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "INTERNAL", "internal error; see the node's log")


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
_SECONDS = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,9})?")


def write_timeout(request: web.Request) -> float | None:
    """The seconds a write may wait here: X-Kv-Timeout, at most --write-timeout-s."""
    return _timeout(request, request.app[CONTEXT].node.config.write_timeout_s)


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
