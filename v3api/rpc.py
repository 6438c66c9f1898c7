"""gRPC's HTTP/2 mapping (its PROTOCOL-HTTP2 document) on v3api/http2.py: calls routed by
`:path` to the services' methods (the generated descriptors say which are streams), each
message length-prefixed, the status in trailers, `grpc-timeout` as a deadline, a reset
stream as the call's cancellation. The services see what they saw of grpc.aio: unary
methods `async def M(request, context)`, streaming ones async generators over an async
iterator of requests, and a context with invocation_metadata() and abort()."""

from __future__ import annotations

import asyncio
import logging
import ssl
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import quote

import grpc
from google.protobuf.message import DecodeError

from kv.raft.deadlines import Deadlines

from . import hpack
from .http2 import NO_ERROR, WINDOW, Connection, Stream
from .wire import Abort

log = logging.getLogger("kv.v3api")

MAX_MESSAGE = 2 * 1024 * 1024 + 64 * 1024  # etcd's 1.5 MiB request limit and some room
LARGE_ANSWER = 64 << 10  # an answer this large needs room under --http-unread-bytes (RpcServer.room_for)
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
_NOT_METADATA = frozenset(("content-type", "te", "user-agent", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding", "grpc-message-type"))
_prefix = struct.Struct(">BI")
_OK_TRAILERS = hpack.literal("grpc-status", "0")
_END = object()
_EXPIRED = (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
# A call the node's stop cut short: UNAVAILABLE, as grpc-go's "transport is closing" when etcd
# stops. etcd's Go client ends a watch or a lease's keepalives for good on any other code
# (CANCELLED too), where it takes UNAVAILABLE to another member: a rolling restart must not
# end every watch and lock wait on the node it stops.
_STOPPING = (grpc.StatusCode.UNAVAILABLE, "transport is closing (the node is stopping)")
CACHED_HEADS = 256
# An HTTP/2 request that is not a gRPC call: 415, and what to do instead
_NOT_GRPC_HEADERS = b"\x08\x03415" + hpack.literal("content-type", "text/plain")  # (:status a literal with static name 8)
_NOT_GRPC = (  # (true of both ports that hand HTTP/2 here, the --grpc port and the --http port)
    b"over HTTP/2 this port takes gRPC calls only; send etcd's JSON gateway calls (/v3/...) and "
    b"ledgerkv's HTTP API over HTTP/1.1 (curl --http1.1)\n"
)


class AfterBarrier(Protocol):
    """A unary method's common requests, answered without a task each: every such request
    arriving in one turn of the loop awaits one barrier (asked for once the turn is over),
    then each is answered at once. A servicer lists them by method name in its
    `after_barrier` dict (kv_service.GetsAfterOneBarrier)."""

    def barrier_for(self, request, context) -> str | None:
        """The barrier the request needs, or None: the method's handler serves it."""

    async def barrier(self, kind: str) -> int: ...

    def answer(self, request, state: int):
        """The response, after the barrier returned `state`."""

    def status(self, e: Exception) -> tuple[grpc.StatusCode, str]: ...


class AtOnce(Protocol):
    """A unary method's common requests, served without a task each: a servicer lists
    them by method name in its `at_once` dict (kv_service.PutsAtOnce)."""

    def take(self, call: Call, request) -> bool:
        """Whether it serves the call (and answers it later, with call.answer or
        call.finish, or hands it to RpcServer.run); False: the method's handler serves it."""


@dataclass(frozen=True)
class Method:
    handler: object  # the bound method of a servicer
    request: type  # its request message class
    streaming_request: bool
    streaming_response: bool
    after_barrier: AfterBarrier | None = None
    at_once: AtOnce | None = None


def methods_of(descriptor, servicers: dict[str, object], messages) -> dict[str, Method]:
    """`/package.Service/Method` → Method, for every method of the services a servicer is
    given for (by the service's name); messages: the module of the request classes."""
    out = {}
    for service in descriptor.services_by_name.values():
        servicer = servicers.get(service.name)
        if servicer is None:
            continue
        quick, at_once = getattr(servicer, "after_barrier", {}), getattr(servicer, "at_once", {})
        for m in service.methods:
            out[f"/{service.full_name}/{m.name}"] = Method(
                getattr(servicer, m.name), getattr(messages, m.input_type.name), m.client_streaming, m.server_streaming,
                quick.get(m.name), at_once.get(m.name),
            )
    return out


class CallContext:
    """What a service uses of its call: the client's metadata, and abort."""

    __slots__ = ("metadata",)

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    async def abort(self, code: grpc.StatusCode, message: str):
        raise Abort(code, message)


class Call:
    __slots__ = ("stream", "method", "context", "buf", "request", "queue", "queued", "held", "task", "expired", "answered", "due")

    def __init__(self, stream: Stream, method: Method, context: CallContext) -> None:
        self.stream, self.method, self.context = stream, method, context
        self.buf = bytearray()
        self.request: bytes | object | None = None  # its bytes; the message, once an AfterBarrier has parsed it
        self.queue: asyncio.Queue | None = asyncio.Queue() if method.streaming_request else None
        self.queued = self.held = 0  # bytes of messages the service has not read; bytes not credited for them
        self.task: asyncio.Task | None = None
        self.expired = self.answered = False
        self.due: int | None = None  # its deadline's bucket in the server's Deadlines

    # -- its deadline: the server's Deadlines files a call as it would a future -----------

    def done(self) -> bool:  # (a finished call is no longer filed: finish() takes it out)
        return self.stream.closed

    def set_exception(self, _: object) -> None:
        self.stream.conn.server.expire(self)

    def forget_deadline(self) -> None:
        if self.due is not None:
            self.stream.conn.server.deadlines.discard(self.due, self)
            self.due = None

    # -- answering -------------------------------------------------------------------------

    def send(self, message) -> None:
        body = self._body(message)
        if not self.answered:
            self.answered = True
            self.stream.send_headers(hpack.RESPONSE_HEADERS)
        self.stream.send_data(_prefix.pack(0, len(body)) + body)

    def answer(self, message) -> None:
        """A unary call's answer, and its status OK."""
        self.answer_encoded(self._body(message))

    def answer_encoded(self, body: bytes) -> None:
        """answer() with the message already serialized."""
        self.forget_deadline()
        self.answered = True
        self.stream.send_answer(hpack.RESPONSE_HEADERS, _prefix.pack(0, len(body)) + body, _OK_TRAILERS)

    def _body(self, message) -> bytes:
        body = message.SerializeToString()
        if len(body) > LARGE_ANSWER:
            self.stream.conn.server.room_for(len(body))
        return body

    def finish(self, code: grpc.StatusCode = grpc.StatusCode.OK, message: str = "") -> None:
        self.forget_deadline()
        block = _OK_TRAILERS if code is grpc.StatusCode.OK else status_block(code, message)
        if self.answered:
            self.stream.send_trailers(block)
        else:
            self.answered = True
            _trailers_only(self.stream, block)

    # -- requests --------------------------------------------------------------------------

    def take(self, data: bytes) -> None:
        """The stream's data: whole messages become the request (unary) or queue up for
        the service's request iterator (streams). Data is credited back to the client as it
        arrives (a message is bounded by MAX_MESSAGE), except while more than a window's
        worth of messages waits for the service: then as it reads them."""
        if self.queued > WINDOW:
            self.held += len(data)
        else:
            self.stream.consumed(len(data))
        buf = self.buf
        buf += data
        while len(buf) >= 5:
            compressed, n = _prefix.unpack_from(buf)
            if compressed:
                raise Abort(grpc.StatusCode.UNIMPLEMENTED, "compressed messages are not supported (grpc-encoding identity only)")
            if n > MAX_MESSAGE:
                raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"a request message of {n} bytes (at most {MAX_MESSAGE})")
            if len(buf) < 5 + n:
                return
            msg = bytes(buf[5 : 5 + n])
            del buf[: 5 + n]
            if self.queue is not None:
                self.queued += len(msg)
                self.queue.put_nowait(msg)
            elif self.request is not None:
                raise Abort(grpc.StatusCode.UNIMPLEMENTED, "more than one request message on a unary call")
            else:
                self.request = msg

    async def requests(self):
        cls = self.method.request
        while (msg := await self.queue.get()) is not _END:
            self.queued -= len(msg)
            if self.held and self.queued <= WINDOW // 2:
                self.stream.consumed(self.held)
                self.held = 0
            try:
                yield cls.FromString(msg)
            except DecodeError:
                raise Abort(grpc.StatusCode.INTERNAL, f"grpc: error unmarshalling request: not a {cls.__name__}") from None


def status_block(code: grpc.StatusCode, message: str) -> bytes:
    # grpc-message is percent-encoded UTF-8 (PROTOCOL-HTTP2: printable ASCII but %)
    return hpack.literal("grpc-status", str(code.value[0])) + hpack.literal("grpc-message", quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~"))


def timeout_of(value: str) -> float | None:
    try:
        return int(value[:-1]) * _TIMEOUT_UNITS[value[-1]]
    except (KeyError, ValueError, IndexError):
        return None


class RpcServer:
    """The etcd API's gRPC server: `await RpcServer(methods).start(host, port, tls)`, then
    `await server.stop(grace)`."""

    def __init__(self, methods: dict[str, Method], unread_limit: int = 256 << 20) -> None:
        self.methods, self.unread_limit = methods, unread_limit
        self.connections: set[Connection] = set()
        self.tasks: set[asyncio.Task] = set()
        self.background: set[asyncio.Task] = set()  # keep_running
        self.server: asyncio.Server | None = None
        # grpc-timeout: one timer for every call (a timer of each call's own, pushed on the
        # loop's heap and cancelled, cost 5 % of a leader's CPU serving ranges)
        self.deadlines = Deadlines(lambda: None)
        # What a call's headers say, by header block (hpack.Decoder hands out the same
        # tuple for the same block): a client sends the same few blocks again and again.
        self._heads: dict[tuple, tuple] = {}
        self._barriers: dict[tuple[int, str], list[tuple[Call, object]]] = {}  # (id of the Method, kind): requests waiting for a barrier not yet asked for
        # Where an HTTP/1 connection to this port goes: the node's HTTP server (set once it
        # runs), so that the client URLs MemberList gives serve etcd's JSON gateway, as
        # etcd's do (Patroni takes its endpoints from them). None: told to use --http.
        self.http1: Callable[[], asyncio.BaseProtocol] | None = None

    async def start(self, host: str, port: int, tls: tuple[str, str] | None = None) -> RpcServer:
        ctx = None
        if tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2  # (HTTP/2 asks for 1.2 at least)
            ctx.load_cert_chain(tls[0], tls[1])
            ctx.set_alpn_protocols(["h2", "http/1.1"])
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(self.connection, host, port, ssl=ctx, reuse_address=True, backlog=1024)
        return self

    def keep_running(self, work) -> None:
        """Run a servicer's background work (a coroutine) until the server stops."""
        self.background.add(asyncio.get_running_loop().create_task(work))

    async def stop(self, grace: float) -> None:
        """No new calls; calls running get `grace` seconds to finish, then are cancelled."""
        for t in self.background:
            t.cancel()
        if self.server is not None:
            self.server.close()
        for c in list(self.connections):
            c.goaway(NO_ERROR)
        # Every call open gets the grace: those with a task, and those an AtOnce serves
        # without one (a plain put waiting for its entry), whose connection closes after
        # the GOAWAY once its last stream ends.
        waiting = [*self.tasks, *(c.lost for c in self.connections if c.lost is not None)]
        if waiting:
            await asyncio.wait(waiting, timeout=grace)
        for t in list(self.tasks):
            t.cancel()
        self.deadlines.close()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=1.0)
        for c in list(self.connections):
            if c.transport is not None:
                c.transport.abort()
        if self.server is not None:
            await self.server.wait_closed()

    def connection(self) -> Connection:
        """The protocol of a client connection: one of this port's, or one the node's HTTP
        port hands over (a client that opened it with HTTP/2's preface)."""
        return Connection(self, self.connections)

    def room_for(self, answer_bytes: int) -> None:
        """Refuse a large answer while clients that do not read hold --http-unread-bytes of
        answers (the HTTP front's limit, counted for this port on its own): it would pin as
        much again. (Small answers are bounded by not reading such a client's requests.)"""
        held = sum(c.unread() for c in self.connections)
        if held + answer_bytes > self.unread_limit:
            raise Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this node holds {held >> 20} MiB of answers its clients have not read (--http-unread-bytes): try again later",
            )

    # -- what http2.Connection calls -------------------------------------------------------

    def open_stream(self, s: Stream) -> None:
        head = self._heads.get(s.headers)
        if head is None:
            head = _call_head(s.headers)
            if len(self._heads) >= CACHED_HEADS:
                self._heads.clear()
            self._heads[s.headers] = head
        path, ctype, encoding, deadline, metadata = head
        if ctype is None or not ctype.startswith("application/grpc"):
            # (curl over TLS, say, offered h2, sending etcd's JSON gateway calls here)
            # Answered once the request has ended (end_received, at once for a head that
            # ends it), its body dropped: curl, answered while it still sent, stopped
            # sending on the error and waited out its timeout.
            return
        method = self.methods.get(path)
        if method is None:
            _trailers_only(s, status_block(grpc.StatusCode.UNIMPLEMENTED, unserved(path)))
            _stop_sending(s)
            return
        if encoding not in (None, "identity"):
            _trailers_only(s, status_block(grpc.StatusCode.UNIMPLEMENTED, f"grpc-encoding {encoding} is not supported (identity only)"))
            _stop_sending(s)
            return
        s.call = call = Call(s, method, CallContext(metadata))
        if deadline is not None:
            call.due = self.deadlines.add(s.conn.loop.time() + deadline, call)
        if method.streaming_request:
            self.run(call)

    def data_received(self, s: Stream, data: bytes) -> None:
        call = s.call
        if call is None:
            s.consumed(len(data))
            return
        try:
            call.take(data)
        except Abort as e:
            self._fail(call, e.code, e.message)

    def end_received(self, s: Stream) -> None:
        call = s.call
        if call is None:  # (not a gRPC call, whose body open_stream left to drop)
            _not_grpc(s)
            return
        if call.queue is not None:
            call.queue.put_nowait(_END)
        elif call.buf or call.request is None:
            self._fail(call, grpc.StatusCode.INTERNAL, "grpc: the request ended without a whole message")
        elif call.method.after_barrier is not None or call.method.at_once is not None:
            try:
                call.request = request = call.method.request.FromString(call.request)
            except DecodeError:
                self._fail(call, grpc.StatusCode.INTERNAL, f"grpc: error unmarshalling request: not a {call.method.request.__name__}")
                return
            if call.method.at_once is not None:
                if not call.method.at_once.take(call, request):
                    self.run(call)
                return
            kind = call.method.after_barrier.barrier_for(request, call.context)
            if kind is None:
                self.run(call)
            else:
                self._after(call, request, kind)
        else:
            self.run(call)

    def stream_reset(self, s: Stream) -> None:
        call = s.call
        if call is not None:
            call.forget_deadline()
            if call.task is not None:
                call.task.cancel()

    # -- calls -----------------------------------------------------------------------------

    def run(self, call: Call, answer: Callable[[], Awaitable] | None = None) -> None:
        """Serve the call in a task of its own: with its method's handler, or with
        `await answer()`, its response (an AtOnce's way for a call it took)."""
        task = call.stream.conn.loop.create_task(self._serve(call, answer))
        call.task = task
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        task.add_done_callback(lambda _: self._unanswered(call))

    @staticmethod
    def _unanswered(call: Call) -> None:
        """A call whose task was cancelled before its first step (its deadline, a reset, a
        stop in the same turn of the loop) never ran _serve, which answers every other way."""
        if not call.stream.closed and not call.answered:
            call.finish(*(_EXPIRED if call.expired else _STOPPING))

    def _after(self, call: Call, request, kind: str) -> None:
        key = (id(call.method), kind)
        waiting = self._barriers.get(key)
        if waiting is None:
            self._barriers[key] = waiting = []
            task = call.stream.conn.loop.create_task(self._answer_after(key, call.method.after_barrier, kind, waiting))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        waiting.append((call, request))

    async def _answer_after(self, key: tuple[int, str], quick: AfterBarrier, kind: str, waiting: list[tuple[Call, object]]) -> None:
        """Answer every request of `waiting` after one barrier. The list is closed before the
        barrier is asked for: a request that arrives later waits for the next one (a read
        must not take a read index from before it arrived)."""
        del self._barriers[key]
        try:
            state = await quick.barrier(kind)
        except asyncio.CancelledError:
            for call, _ in waiting:
                if not call.stream.closed:
                    call.finish(*_STOPPING)
            return
        except Exception as e:
            code, message = quick.status(e)
            for call, _ in waiting:
                if not call.stream.closed:
                    call.finish(code, message)
            return
        for call, request in waiting:
            if call.stream.closed:  # expired, or reset by the client
                continue
            try:
                call.answer(quick.answer(request, state))
            except Exception as e:
                call.finish(*quick.status(e))

    def expire(self, call: Call) -> None:
        call.expired = True
        if call.task is not None:
            call.task.cancel()
        else:
            self._fail(call, *_EXPIRED)

    def _fail(self, call: Call, code: grpc.StatusCode, message: str) -> None:
        if call.task is not None:
            call.task.cancel()
        if not call.stream.closed:
            call.finish(code, message)
            _stop_sending(call.stream)

    async def _serve(self, call: Call, answer: Callable[[], Awaitable] | None) -> None:
        m, stream = call.method, call.stream
        try:
            if answer is not None:  # (an AtOnce's, of a unary method)
                result = answer()
            elif m.streaming_request:
                result = m.handler(call.requests(), call.context)
            else:
                try:
                    request = call.request if type(call.request) is not bytes else m.request.FromString(call.request)
                except DecodeError:
                    raise Abort(grpc.StatusCode.INTERNAL, f"grpc: error unmarshalling request: not a {m.request.__name__}") from None
                result = m.handler(request, call.context)
            if m.streaming_response:
                try:
                    async for response in result:
                        call.send(response)
                        await stream.writable()
                        if stream.closed:
                            return
                finally:
                    await result.aclose()  # (at once, whatever ended the stream)
                call.finish()
            else:
                call.answer(await result)
        except Abort as e:
            call.finish(e.code, e.message)
        except asyncio.CancelledError:
            if call.expired:
                call.finish(*_EXPIRED)
            elif not stream.closed:
                call.finish(*_STOPPING)
        except Exception as e:
            log.exception("etcd API call %s failed", m.handler.__qualname__)
            call.finish(grpc.StatusCode.UNKNOWN, f"{type(e).__name__}: {e}")


_INSTEAD = (  # what a caller of an etcd method ledgerkv does not serve can use instead
    ("/etcdserverpb.Cluster/Member", " (membership changes: kv member)"),
    ("/etcdserverpb.Maintenance/MoveLeader", " (moving the leader: kv leader transfer)"),
    ("/etcdserverpb.Auth/", " (users and roles are ledgerkv's tokens: --token, --tokens)"),
    ("/etcdserverpb.Maintenance/Defragment", " (LevelDB compacts its files by itself: there is nothing to defragment)"),
)


def unserved(path: str) -> str:
    """What a call of a method this server does not serve is told."""
    if path.startswith("/etcdserverpb."):
        instead = next((hint for prefix, hint in _INSTEAD if path.startswith(prefix)), "")
        return f"ledgerkv does not serve etcd's {path}: docs/etcd.md lists what it serves{instead}"
    return f"unknown method {path}"


def _call_head(headers: tuple[tuple[str, str], ...]) -> tuple:
    """(path, content type, grpc-encoding, grpc-timeout in seconds, the call's metadata)."""
    path = ctype = encoding = deadline = None
    metadata = []
    for k, v in headers:
        if k == ":path":
            path = v
        elif k == "content-type":
            ctype = v
        elif k == "grpc-encoding":
            encoding = v
        elif k == "grpc-timeout":
            deadline = timeout_of(v)
        elif k[:1] != ":" and k not in _NOT_METADATA:
            metadata.append((k, v))
    return path, ctype, encoding, deadline, tuple(metadata)


def _stop_sending(s: Stream) -> None:
    """After an answer that ended the stream while the client still sends its request: it
    need not send the rest (RST_STREAM NO_ERROR, RFC 9113 8.1). Not while the answer's end
    waits for the client's window: the reset would drop it."""
    if s.closed and not s.remote_done:
        s.reset(NO_ERROR)


def _not_grpc(s: Stream) -> None:
    s.send_answer(_NOT_GRPC_HEADERS, _NOT_GRPC, b"")  # (empty trailers end it)


def _trailers_only(s: Stream, status: bytes) -> None:
    """An answer without messages: one header block, the status in it, ends the stream."""
    s.send_headers(hpack.RESPONSE_HEADERS + status, end=True)
