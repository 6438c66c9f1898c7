"""The HTTP error model: {"error": {"code": "...", "message": "..."}} with a fitting status."""

from __future__ import annotations

import logging

import orjson
from aiohttp import web

from kv import KVError
from kv.common.wire import key_fields

from .answer import Answer

log = logging.getLogger("kv.http")


def json_response(data, status: int = 200, headers: dict | None = None) -> Answer:
    return Answer(orjson.dumps(data), status, "application/json", headers)


def error_response(status: int, code: str, message: str, details: dict | None = None) -> Answer:
    details = details or {}
    if "key" in details:  # (412's) spelled as answers spell keys: base64 when not UTF-8
        details = {**details, **key_fields(details["key"])}
    return json_response({"error": {"code": code, "message": message, **details}}, status)


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
