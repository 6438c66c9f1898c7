"""The benchmarks' HTTP client: keep-alive HTTP/1.1 connections driven by a bare asyncio
Protocol, one request at a time per connection.

Why not aiohttp's client: on a 2-core machine the load generator shares the CPU with the
three nodes it measures, and aiohttp's client spent more CPU per request than a ledgerkv
node does serving it (see the `client µs/op` column of benchmarks/compare.py), so it
measured mostly itself. This one builds each request from bytes and reads the status line,
Content-Length or chunked framing, and the body: what a load generator needs, no more.
It drives every system the same way (benchmarks/systems.py).
"""

from __future__ import annotations

import asyncio
from collections import deque
from urllib.parse import urlsplit


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.fut: asyncio.Future | None = None
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.fut is not None and not self.fut.done():
            self.fut.set_exception(ConnectionError(f"the server closed the connection: {exc}"))

    def data_received(self, data: bytes) -> None:
        fut = self.fut
        if fut is None or fut.done():
            # Bytes nobody asked for (a 408 before an idle close, say) would be taken for the
            # next request's answer: this connection is of no more use.
            self.closed = True
            self.transport.close()
            return
        self.buf += data
        try:
            done = _parse(self.buf)
        except ValueError as e:
            fut.set_exception(e)
            self.closed = True
            self.transport.close()
            return
        if done is not None:
            status, body, used, keep = done
            del self.buf[:used]
            if not keep or self.buf:  # more than the answer came: no telling what it is
                self.closed = True
                self.transport.close()
            fut.set_result((status, body))


def _parse(buf: bytearray) -> tuple[int, bytes, int, bool] | None:
    """(status, body, bytes used, keep-alive) once buf holds a whole response, else None."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = bytes(buf[:end]).lower()
    if not head.startswith(b"http/1.1 "):
        raise ValueError(f"not an HTTP/1.1 response: {bytes(buf[:40])!r}")
    status = int(head[9:12])
    keep = b"\r\nconnection: close" not in head
    start = end + 4
    i = head.find(b"\r\ncontent-length:")
    if i >= 0:
        eol = head.find(b"\r\n", i + 2)
        n = int(head[i + 17 : eol if eol > 0 else None])
        if len(buf) < start + n:
            return None
        return status, bytes(buf[start : start + n]), start + n, keep
    if b"\r\ntransfer-encoding: chunked" in head:
        body, pos = bytearray(), start
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                return None
            size = int(bytes(buf[pos:eol]).split(b";")[0], 16)
            if len(buf) < eol + 2 + size + 2:
                return None
            if size == 0:
                tail = buf.find(b"\r\n\r\n", eol)  # trailers, if any, end with an empty line
                return (status, bytes(body), tail + 4, keep) if tail >= 0 else None
            body += buf[eol + 2 : eol + 2 + size]
            pos = eol + 2 + size + 2
    if status in (204, 304) or 100 <= status < 200:
        return status, b"", start, keep
    raise ValueError("a response without Content-Length or chunked framing")


class HttpLoad:
    """Keep-alive connections to the hosts of the URLs asked for; a connection serves one
    request at a time and goes back to its host's idle list after the answer."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], deque[_Conn]] = {}
        self._all: list[_Conn] = []

    async def send(self, host: str, port: int, request: bytes) -> tuple[int, bytes]:
        """Send one whole request (bytes as they go on the wire) and return (status, body)."""
        idle = self._idle.setdefault((host, port), deque())
        conn = None
        while idle:
            c = idle.pop()
            if not c.closed:
                conn = c
                break
        if conn is None:
            _, conn = await asyncio.get_running_loop().create_connection(_Conn, host, port)
            self._all.append(conn)
        conn.fut = fut = asyncio.get_running_loop().create_future()
        conn.transport.write(request)
        try:
            result = await fut
        except BaseException:
            conn.transport.abort()  # an answer may still come: the connection is of no more use
            raise
        finally:
            conn.fut = None
        if not conn.closed:
            idle.append(conn)
        return result

    def close(self) -> None:
        for c in self._all:
            if c.transport is not None:
                c.transport.close()
        self._all.clear()
        self._idle.clear()

    async def __aenter__(self) -> HttpLoad:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class Target:
    """Requests to one base URL (such as http://127.0.0.1:2379), built as bytes."""

    def __init__(self, load: HttpLoad, url: str) -> None:
        u = urlsplit(url)
        self.load, self.host, self.port = load, u.hostname, u.port or 80
        self._netloc, self._prefix = u.netloc.encode(), u.path.rstrip("/").encode()

    def request(self, method: bytes, path: bytes, body: bytes = b"", headers: bytes = b""):
        """The (status, body) of one request (a coroutine); `headers`: extra lines, each
        ending in CRLF."""
        return self.load.send(self.host, self.port, b"%s %s%s HTTP/1.1\r\nHost: %s\r\n%sContent-Length: %d\r\n\r\n%s" % (
            method, self._prefix, path, self._netloc, headers, len(body), body))


def ok(status: int, body: bytes, expect: int = 200) -> bytes:
    """The body of an answer with the expected status; RuntimeError naming any other."""
    if status != expect:
        raise RuntimeError(f"HTTP {status}: {body[:200]!r}")
    return body
