"""Answer: a whole response, status, headers and body, as the API's handlers build it.

The key routes run for every read and write, and aiohttp's web.Response costs about 3 µs
to build and the fast path as much again to take apart into bytes (a tenth of a stale
GET's server CPU). A handler returns an Answer instead: the fast path writes it as bytes
in one step (`encode`), and the middleware makes it an aiohttp Response only for a request
aiohttp itself serves (`to_response`). Handlers that stream (watch, snapshot, log) return
aiohttp's StreamResponse as before.
"""

from __future__ import annotations

import email.utils
import http
import time

from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE

_REASONS = {s.value: s.phrase for s in http.HTTPStatus}
RETRY_AFTER_S = "1"  # every 503 (no leader, no quorum, too many connections, not ready) says when to retry


class Answer:
    __slots__ = ("status", "body", "content_type", "headers", "close")

    def __init__(self, body: bytes, status: int = 200, content_type: str = "application/json", headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type
        if status == 503 and not (headers and "Retry-After" in headers):
            headers = {**(headers or {}), "Retry-After": RETRY_AFTER_S}
        self.headers = headers  # more headers, or None
        self.close = False  # no next request on this connection (Connection: close)

    def to_response(self) -> web.Response:
        headers = {"Content-Type": self.content_type, **self.headers} if self.headers else {"Content-Type": self.content_type}
        resp = web.Response(body=self.body, status=self.status, headers=headers)
        if self.close:
            resp.force_close()
        return resp

    def encode(self, keep_alive: bool) -> bytes:
        """The response as HTTP/1.1 bytes, with the headers aiohttp would send."""
        extra = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items()) if self.headers else ""
        close = "Connection: close\r\n" if self.close or not keep_alive else ""
        return (
            f"HTTP/1.1 {self.status} {_REASONS.get(self.status, '')}\r\nContent-Type: {self.content_type}\r\n{extra}"
            f"Content-Length: {len(self.body)}\r\nDate: {_Date.now()}\r\nServer: {SERVER_SOFTWARE}\r\n{close}\r\n"
        ).encode() + self.body


class _Date:
    """The Date header, formatted once a second."""

    second, text = 0, ""

    @classmethod
    def now(cls) -> str:
        t = int(time.time())
        if t != cls.second:
            cls.second, cls.text = t, email.utils.formatdate(t, usegmt=True)
        return cls.text
