"""A lean HTTP/1.1 front for the hot routes: a key's GET, PUT and DELETE, and transactions.

A bare aiohttp PUT handler costs about 160 µs of server CPU a request on this project's
2-core machine, more than the Raft work of a batched write. FastProtocol parses a plain,
well-formed request itself (parsing and encoding the answer take under 10 µs of that) and
runs the very same middleware (http.app.handle) and handlers on a FastRequest, the part of
aiohttp's Request that they use, and writes the Answer they return (http/answer.py). So the
auth, the error model, the metrics and the access log are one code, whichever front parsed
the request.

Anything else hands the connection to aiohttp for good: another route, a body that has not
fully arrived or is over 64 KiB, chunked bodies, `Expect`, HTTP/1.0, an upgrade, a head that
is odd in any way (non-ASCII, a repeated header, one longer than aiohttp allows). aiohttp's
protocol gets the connection's bytes from the first byte of that request on, so it answers
exactly as it would have from the start: its limits, timeouts and errors stay the reference.
A client that only reads and writes keys stays on the fast path; one that also watches or
renews leases on the same connection moves to aiohttp at its first such request.
"""

from __future__ import annotations

import asyncio
import logging
import re
import urllib.parse
from collections.abc import Callable
from types import SimpleNamespace

from aiohttp import web

from . import routes_kv
from .context import CONTEXT

log = logging.getLogger("kv.http")

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # how an HTTP/2 client opens (RFC 9113 §3.4)
HEAD_MAX = 8190  # a longer head goes to aiohttp, which refuses it (its line limit)
BODY_MAX = 64 << 10  # a larger body goes to aiohttp, which reads it with a timeout
MAX_HEADERS = 32  # more go to aiohttp, which has its own limit
_HEAD = re.compile(
    rb"(GET|PUT|DELETE|POST) (/[!\x24-\x7e\x22]*) HTTP/1\.1"  # the request line, in origin form, no fragment
    rb"(?:\r\n[!#$%&'*+.^_`|~0-9A-Za-z-]+:[\t -~]*)*"  # header fields, visible ASCII
)
_QUERY = re.compile(r"[A-Za-z0-9_.=&-]*")  # nothing to percent-decode
_PASSED_ON = frozenset({"transfer-encoding", "expect", "upgrade"})  # aiohttp handles these
# The start of a pipelined request the fast path takes (or a prefix of one, still arriving).
_NEXT_REQUEST = re.compile(rb"(?:GET|PUT|DELETE|POST) /|G(?:ET?)?$|P(?:UT?|OST?|OS)?$|D(?:E(?:L(?:E(?:T(?:E)?)?)?)?)?$|(?:GET|PUT|DELETE|POST) ?$")


def _path_safe(path: str) -> str:
    """The path as aiohttp's router matches it: percent-decoded, except %2F and %25 (an
    encoded slash stays inside its segment: /v1%2Fkv/k is no route, /v1/kv/a%2Fb the key a/b)."""
    return urllib.parse.unquote(re.sub("%(2[Ff]|25)", r"%25\1", path))


def _route(name: str):
    handler = next(h for _, _, h, n in routes_kv.ROUTES if n == name)
    return handler, SimpleNamespace(route=SimpleNamespace(name=name))


_KEY_ROUTES = {"GET": _route("kv_get"), "PUT": _route("kv_put"), "DELETE": _route("kv_delete")}
_TXN = _route("txn")


class _Headers(dict):
    """Request headers under lower-case names, looked up in any case (as aiohttp's are)."""

    def get(self, name: str, default=None):
        return dict.get(self, name.lower(), default)

    def __contains__(self, name) -> bool:
        return dict.__contains__(self, name.lower())


class _WholeBody:
    """request.content for a body that arrived whole: what http.errors.read_body reads."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def is_eof(self) -> bool:
        return True

    def read_nowait(self) -> bytes:
        return self.data


class FastRequest(dict):
    """What the middleware and the key routes use of aiohttp's web.Request; a dict, as
    web.Request is a mapping for per-request state (the caller's grant)."""

    def __init__(self, app, transport, method: str, target: str, path: str, qs: str, headers: _Headers, body: bytes, match_info) -> None:
        super().__init__()
        self.app = app
        self.method = method
        self.raw_path = target
        self.path = path  # percent-decoded, as aiohttp's
        self.query = _query(qs)
        self.headers = headers
        self.content = _WholeBody(body)
        self.content_length = len(body)
        self.match_info = match_info
        self._transport = transport

    @property
    def remote(self) -> str | None:
        peer = self._transport.get_extra_info("peername")
        return peer[0] if isinstance(peer, (tuple, list)) else peer


def _query(qs: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in filter(None, qs.split("&")):  # (an empty one, "?a=1&", is no parameter: aiohttp's reading)
        name, _, value = part.partition("=")
        out.setdefault(name, value)  # the first of a repeated name, as aiohttp's query.get
    return out


class FastFront:
    """The fast path's share of a listening site: its open connections, the requests in
    flight, and the sweep that closes idle connections (aiohttp's keep-alive rule: a
    connection that has not sent a whole request within the idle timeout of opening, or of
    its last response, is closed)."""

    def __init__(self, app: web.Application, handle, server, idle_timeout_s: float, shutdown_timeout_s: float) -> None:
        self.app = app
        # Counts, in the app's context, the bytes of answers queued for clients that are not
        # reading them (connections whose transport paused writing): a large answer needs
        # room under --http-unread-bytes (http/context.py, room_for).
        self.context = app[CONTEXT]
        self.handle = handle  # http.app.handle: auth, errors, metrics, access log; returns an Answer
        self.server = server  # aiohttp's protocol factory, for the connections handed over
        # Where a connection that opens with HTTP/2's preface goes: the etcd API's gRPC
        # server, when the node serves it (etcd's clients pointed at this port, as at etcd's
        # one client port). None: aiohttp answers it 400.
        self.http2: Callable[[], asyncio.Protocol] | None = None
        self.idle_timeout_s = idle_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s  # how long stop() lets requests in flight finish
        self.connections: set[FastProtocol] = set()
        self.tasks: set[asyncio.Task] = set()
        self.stopping = False
        self._sweeper: asyncio.Task | None = None

    def start(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, self.idle_timeout_s / 4))
            deadline = loop.time() - self.idle_timeout_s
            for conn in [c for c in self.connections if not c.busy and c.since < deadline]:
                conn.close()

    async def stop(self) -> None:
        """Close the idle connections now; let the requests in flight be answered (as
        aiohttp's shutdown waits for its handlers), closing each connection after its
        answer; then close what is left. The listening socket is closed first."""
        self.stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in [c for c in self.connections if not c.busy]:
            conn.close()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=self.shutdown_timeout_s)
        for conn in list(self.connections):
            conn.close()


class FastProtocol(asyncio.Protocol):
    """One client connection, served one request at a time (HTTP/1.1 answers in order)."""

    def __init__(self, front: FastFront) -> None:
        self.front = front
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.busy = False  # a request is being served
        self.eof = False
        self.since = self.loop.time()  # opened, or last answered
        self.write_paused = False
        self.read_paused = False
        self.held = 0  # bytes of answers this connection's client has not read (counted in the context's unread)

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport  # TCP_NODELAY is on already (asyncio's and uvloop's default)
        self.front.connections.add(self)

    def connection_lost(self, exc) -> None:
        self.front.connections.discard(self)
        self._unhold()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf = self.buf + data if self.buf else data
        if not self.busy:
            self._next()
        if self.transport is not None and len(self.buf) > HEAD_MAX + BODY_MAX and not self.read_paused:
            self.read_paused = True  # a client sending ahead of its answers waits
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self.eof = True
        # Keep the transport open for the answer being made (TLS cannot half-close).
        return self.busy and self.transport.get_extra_info("sslcontext") is None

    def pause_writing(self) -> None:
        self.write_paused = True  # the client does not read: serve no more until it does
        if self.transport is not None:
            self.held = self.transport.get_write_buffer_size()
            self.front.context.unread += self.held

    def resume_writing(self) -> None:
        self.write_paused = False
        self._unhold()
        if not self.busy:
            self._next()

    def _unhold(self) -> None:
        self.front.context.unread -= self.held
        self.held = 0

    def close(self) -> None:
        transport = self.transport
        if transport is not None:
            if transport.get_write_buffer_size():
                transport.abort()  # its client does not read: close() would wait for it
            else:
                transport.close()

    # -- requests -----------------------------------------------------------------------------

    def _next(self) -> None:
        if self.write_paused or self.transport is None:
            return  # resume_writing() comes back here
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        if not self.buf:
            return
        if self.front.http2 is not None and self.buf[:3] == b"PRI" and H2_PREFACE.startswith(self.buf[: len(H2_PREFACE)]):
            if len(self.buf) >= len(H2_PREFACE):
                self._hand_off(self.front.http2())
            return
        end = self.buf.find(b"\r\n\r\n", 0, HEAD_MAX + 4)
        if end < 0:
            if len(self.buf) > HEAD_MAX or self.buf.count(b"\n") != self.buf.count(b"\r\n"):
                self._hand_off()  # too long, or lines ended by a bare LF: aiohttp refuses it
            return  # the rest of the head is on its way (the idle sweep bounds the wait)
        request = self._parse(end)
        if request is None:
            self._hand_off()
            return
        request, handler, keep_alive = request
        self.busy = True
        task = self.loop.create_task(self._serve(request, handler, keep_alive))
        self.front.tasks.add(task)
        task.add_done_callback(self.front.tasks.discard)

    def _parse(self, end: int):
        """The request at the start of the buffer, if the fast path serves it whole; else None."""
        buf = self.buf
        if _HEAD.fullmatch(buf, 0, end) is None:
            return None
        lines = buf[:end].decode("ascii").split("\r\n")
        if len(lines) > MAX_HEADERS + 1:
            return None
        method, target, _ = lines[0].split(" ")
        headers = _Headers()
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.lower()] = value.strip(" \t")
        if len(headers) != len(lines) - 1 or not _PASSED_ON.isdisjoint(headers) or "host" not in headers:
            return None  # a repeated header, one aiohttp must handle, or no Host (aiohttp: 400)
        path, _, qs = target.partition("?")
        routed = path
        if "%" in path:
            routed = _path_safe(path)  # what aiohttp's router matches
            path = urllib.parse.unquote(path)  # as aiohttp's request.path
        if method in _KEY_ROUTES and routed.startswith(routes_kv.KV_PREFIX) and len(routed) > len(routes_kv.KV_PREFIX):
            handler, match = _KEY_ROUTES[method]
        elif method == "POST" and routed == "/v1/txn":
            handler, match = _TXN
        else:
            return None
        if qs and _QUERY.fullmatch(qs) is None:
            return None
        length = dict.get(headers, "content-length", "0")  # the names are stored lower-case
        if not (length.isdigit() and len(length) <= 6):
            return None
        start, stop = end + 4, end + 4 + int(length)
        if stop - start > BODY_MAX or stop > len(buf):
            return None  # large, or still arriving: aiohttp reads it with its limit and timeout
        connection = dict.get(headers, "connection")  # HTTP/1.1 clients seldom send it
        keep_alive = connection is None or "close" not in {t.strip() for t in connection.lower().split(",")}
        rest = buf[stop : stop + 8]
        if rest and (not keep_alive or not _NEXT_REQUEST.match(rest)):
            # Bytes after the body that are not the start of a next request the fast path
            # takes (or any after Connection: close): aiohttp's parser refuses the whole
            # buffer, this request included, with 400; so does the fast path, through it.
            return None
        self.buf = buf[stop:]
        request = FastRequest(self.front.app, self.transport, method, target, path, qs, headers, buf[start:stop], match)
        return request, handler, keep_alive

    async def _serve(self, request: FastRequest, handler, keep_alive: bool) -> None:
        try:
            answer = await self.front.handle(request, handler)
            keep_alive = keep_alive and not answer.close
            data = answer.encode(keep_alive)

        except Exception:  # handle() turns handler errors into Answers: this is a bug
            log.exception("the fast path failed on %s %s", request.method, request.path)
            self.close()
            return
        finally:
            self.busy = False
        transport = self.transport
        if transport is None or transport.is_closing():
            return  # the client went away while its request was served
        transport.write(data)
        self.since = self.loop.time()
        if not keep_alive or (self.eof and not self.buf) or self.front.stopping:
            transport.close()
        else:
            self._next()

    def _hand_off(self, proto: asyncio.Protocol | None = None) -> None:
        """Give the connection to aiohttp (or `proto`), from the first byte of the request at hand."""
        transport, data = self.transport, self.buf
        self.front.connections.discard(self)
        self.transport, self.buf = None, b""
        proto = proto or self.front.server()
        transport.set_protocol(proto)
        proto.connection_made(transport)
        if self.read_paused:
            transport.resume_reading()
        proto.data_received(data)
        if self.eof:
            proto.eof_received()
