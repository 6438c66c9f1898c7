"""HTTP/2 (RFC 9113) on an asyncio Protocol, the part gRPC uses: the server side of one
connection, its streams and both directions of flow control. What runs on a stream is the
gRPC layer's (v3api/rpc.py): it is told when a stream opens (`open_stream`), gets the
stream's data as it arrives, and answers through `Stream.send_*`.

Why not grpcio's server: grpc.aio costs about 300 µs of a core per unary call on this
machine (its C core hands every completion from a poller thread to the event loop), more
than the rest of a Put's path through Raft; this costs a few tens.

Bounded for a stranger: a connection must open with the client preface within
PREFACE_TIMEOUT_S; at most MAX_STREAMS open streams (more are refused with REFUSED_STREAM);
a header block of at most MAX_HEADER_BLOCK bytes; the peer never has more than its windows
in flight, which this side credits back only as the gRPC layer consumes data; whatever
breaks the protocol gets GOAWAY with its error code and the connection closed; a client
that stops reading its answers is not read from either once WRITE_BUFFER of them wait.
Writes are gathered and sent once per turn of the event loop."""

from __future__ import annotations

import asyncio
import logging
import re
import struct

from kv import KVError

from .hpack import Decoder, HpackError

log = logging.getLogger("kv.v3api")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
PREFACE_TIMEOUT_S = 10.0
MAX_STREAMS = 1000
MAX_HEADER_BLOCK = 64 * 1024
MAX_FRAME = 16384  # the protocol's default, what this side accepts and sends
WINDOW = 1 << 20  # what this side lets a peer send ahead, per stream
CONN_WINDOW = 16 << 20  # and per connection
WRITE_BUFFER = 4 << 20  # answers waiting for a client to read them, beyond which its requests wait
DEFAULT_WINDOW = 65535

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x0, 0x1, 0x3, 0x6, 0x7, 0x8, 0x9
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS, S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = range(1, 7)

_frame_head = struct.Struct(">I B I")  # 24-bit length in the first word, with the type's byte
_HTTP1 = re.compile(rb"[A-Z]{3,7} \S")  # an HTTP/1 request line's start


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _frame_head.pack(len(payload) << 8 | kind, flags, stream_id) + payload


class ProtocolError(KVError):
    """The peer broke the protocol: GOAWAY with this code, then close."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class Stream:
    """One request and its answer. `data_received` (the gRPC layer's) is called with each
    DATA payload, `end_received` when the client has sent all; the answer goes out through
    send_headers / send_data / send_trailers, data within the peer's windows."""

    __slots__ = ("conn", "id", "headers", "send_window", "pending", "trailers", "closed", "remote_done", "outstanding", "owed", "call", "drained")

    def __init__(self, conn: Connection, stream_id: int, headers: list[tuple[str, str]]) -> None:
        self.conn, self.id, self.headers = conn, stream_id, headers
        self.send_window = conn.peer_initial_window
        self.pending = bytearray()  # data not yet within the windows
        self.trailers: bytes | None = None  # sent once pending is
        self.closed = self.remote_done = False
        self.outstanding = self.owed = 0
        self.call = None  # the gRPC layer's object for this stream
        self.drained: asyncio.Future | None = None

    def send_headers(self, block: bytes, end: bool = False) -> None:
        if not self.closed:
            self.conn.write(frame(HEADERS, END_HEADERS | (END_STREAM if end else 0), self.id, block))
            if end:
                self.conn.finished(self)

    def send_data(self, data: bytes) -> None:
        if self.closed:
            return
        self.pending += data
        self.conn.pump(self)

    def send_answer(self, headers: bytes, data: bytes, trailers: bytes) -> None:
        """A whole answer: headers, data, trailers. In one write when the windows take all
        of the data, as a unary call's answer nearly always is."""
        conn, n = self.conn, len(data)
        if self.closed or self.pending or n > self.send_window or n > conn.conn_send_window or n > conn.peer_max_frame:
            self.send_headers(headers)
            self.send_data(data)
            self.send_trailers(trailers)
            return
        self.send_window -= n
        conn.conn_send_window -= n
        sid = self.id
        conn.write(frame(HEADERS, END_HEADERS, sid, headers) + frame(DATA, 0, sid, data) + frame(HEADERS, END_HEADERS | END_STREAM, sid, trailers))
        conn.finished(self)

    def send_trailers(self, block: bytes) -> None:
        """The last frame of the answer, after every byte of data."""
        if self.closed:
            return
        if self.pending:
            self.trailers = block
        else:
            self.send_headers(block, end=True)

    async def writable(self, limit: int = 1 << 20) -> None:
        """Wait while more than `limit` bytes wait for the peer's windows, or while the
        client does not read what was sent (a stream's producer stops there instead of
        buffering without bound)."""
        while (len(self.pending) > limit or self.conn.paused) and not self.closed:
            self.drained = asyncio.get_running_loop().create_future()
            await self.drained

    def consumed(self, n: int) -> None:
        """The gRPC layer has taken n bytes of this stream's data: credit them back."""
        self.conn.consumed(self, n)

    def reset(self, code: int = CANCEL) -> None:
        """RST_STREAM: also after an answer ended the stream while the client still sends."""
        self.conn.write(frame(RST_STREAM, 0, self.id, struct.pack(">I", code)))
        self.conn.finished(self)

    def _wake(self) -> None:
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)


class Connection(asyncio.Protocol):
    """The server side of one HTTP/2 connection. `server` (the gRPC layer) provides
    open_stream(stream), data_received(stream, data), end_received(stream) and
    stream_reset(stream)."""

    def __init__(self, server, connections: set) -> None:
        self.server, self.connections = server, connections
        self.transport: asyncio.Transport | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # (connection_made)
        self.buf = bytearray()
        self.preface = False
        self.decoder = Decoder()
        self.streams: dict[int, Stream] = {}
        self.last_stream = 0
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = MAX_FRAME
        self.conn_send_window = DEFAULT_WINDOW
        self.conn_outstanding = self.conn_owed = 0  # received and not credited back; taken and not credited
        self.blocked: dict[int, Stream] = {}  # streams with data waiting for a window
        self.headers_in: tuple[int, int, bytearray] | None = None  # (stream, flags, block) until END_HEADERS
        self.out: list[bytes] = []
        self.flush_scheduled = False
        self.closing = self.paused = False
        self.preface_timer: asyncio.TimerHandle | None = None
        self.lost: asyncio.Future | None = None  # done when the connection is gone (a server's stop waits on it)

    # -- the transport's side ---------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_BUFFER)
        self.connections.add(self)
        # (kept: asyncio.get_running_loop() is a getpid() each time in Python 3.11, and a
        # write asks for the loop on every answer)
        self.loop = asyncio.get_running_loop()
        self.lost = self.loop.create_future()
        self.preface_timer = self.loop.call_later(PREFACE_TIMEOUT_S, self._no_preface)

    def _settings_out(self) -> None:
        """This side's preface, once the client's has come (so that an HTTP/1 request can
        still be answered in HTTP/1)."""
        settings = struct.pack(
            ">HIHIHIHI",
            S_MAX_CONCURRENT_STREAMS, MAX_STREAMS,
            S_INITIAL_WINDOW_SIZE, WINDOW,
            S_MAX_HEADER_LIST_SIZE, MAX_HEADER_BLOCK,
            S_ENABLE_PUSH, 0,
        )
        self.write(frame(SETTINGS, 0, 0, settings) + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", CONN_WINDOW - DEFAULT_WINDOW)))

    def _no_preface(self) -> None:
        if not self.preface and self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc) -> None:
        self.connections.discard(self)
        if self.preface_timer is not None:
            self.preface_timer.cancel()
        for s in list(self.streams.values()):
            self.server.stream_reset(s)  # (first: finished() lets go of the stream's call)
            self.finished(s)
        self.transport = None
        if self.lost is not None and not self.lost.done():
            self.lost.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        try:
            if not self.preface:
                head = bytes(self.buf[: len(PREFACE)])
                if not PREFACE.startswith(head):
                    if _HTTP1.match(head):
                        if self.server.http1 is not None:
                            self._hand_over(self.server.http1())
                        else:
                            self._answer_http1()
                        return
                    raise ProtocolError(PROTOCOL_ERROR, "not HTTP/2 (gRPC needs the HTTP/2 client preface)")
                if len(head) < len(PREFACE):
                    return
                del self.buf[: len(PREFACE)]
                self.preface = True
                self.preface_timer.cancel()
                self._settings_out()
            buf, pos = self.buf, 0
            while len(buf) - pos >= 9:
                word, flags, sid = _frame_head.unpack_from(buf, pos)
                length, kind = word >> 8, word & 0xFF
                if length > MAX_FRAME:
                    raise ProtocolError(FRAME_SIZE_ERROR, f"a frame of {length} bytes (at most {MAX_FRAME})")
                if len(buf) - pos - 9 < length:
                    break
                payload = bytes(buf[pos + 9 : pos + 9 + length])
                pos += 9 + length
                self._frame(kind, flags, sid & 0x7FFFFFFF, payload)
                if self.transport is None:
                    return
            del buf[:pos]
        except ProtocolError as e:
            self.goaway(e.code, str(e))
        except HpackError as e:
            self.goaway(COMPRESSION_ERROR, str(e))

    def _hand_over(self, protocol: asyncio.BaseProtocol) -> None:
        """An HTTP/1 client: the connection goes to `protocol` (the node's HTTP server), with
        what it has sent so far, as etcd's client port serves its JSON gateway too."""
        transport, data = self.transport, bytes(self.buf)
        self.connections.discard(self)
        self.preface_timer.cancel()
        self.transport = None
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        protocol.data_received(data)

    def _answer_http1(self) -> None:
        body = (b"this port speaks gRPC (HTTP/2): etcd's clients (etcdctl, python-etcd3, clientv3) use it. "
                b"ledgerkv's HTTP API and etcd's JSON gateway (/v3/...) are on the node's --http port.\n")
        self.transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()

    def pause_writing(self) -> None:
        # The client is not reading what it is sent: take no more of its requests until it
        # does, or answers would pile up here without bound (the windows it grants are its own).
        self.paused = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
        for s in list(self.streams.values()):
            s._wake()

    def unread(self) -> int:
        """Bytes sent to this client and not read by it yet (as far as this side holds them)."""
        return self.transport.get_write_buffer_size() if self.transport is not None else 0

    # -- frames ----------------------------------------------------------------------------

    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if self.headers_in is not None and kind != CONTINUATION:
            raise ProtocolError(PROTOCOL_ERROR, "a frame inside a header block")
        if kind == DATA:
            self._data(flags, sid, payload)
        elif kind == HEADERS:
            if sid == 0 or sid % 2 == 0:
                raise ProtocolError(PROTOCOL_ERROR, "HEADERS on a stream a client cannot open")
            payload = _unpad(flags, payload)
            if flags & PRIORITY_FLAG:
                payload = payload[5:]
            self.headers_in = (sid, flags, bytearray(payload))
            self._headers_more(flags)
        elif kind == CONTINUATION:
            if self.headers_in is None or self.headers_in[0] != sid:
                raise ProtocolError(PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
            self.headers_in[2].extend(payload)
            self._headers_more(flags)
        elif kind == SETTINGS:
            self._settings(flags, sid, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif kind == PING:
            if len(payload) != 8 or sid:
                raise ProtocolError(FRAME_SIZE_ERROR, "a PING of the wrong size or on a stream")
            if not flags & ACK:
                self.write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            s = self.streams.get(sid)
            if s is not None:
                self.server.stream_reset(s)  # (first: finished() lets go of the stream's call)
                self.finished(s)
        elif kind == GOAWAY:
            self.closing = True
            if not self.streams:
                self.close()
        elif kind == PUSH_PROMISE:
            raise ProtocolError(PROTOCOL_ERROR, "a client may not push")
        # PRIORITY and unknown frame types are ignored, as the protocol says

    def _headers_more(self, flags: int) -> None:
        sid, first_flags, block = self.headers_in
        if len(block) > MAX_HEADER_BLOCK:
            raise ProtocolError(PROTOCOL_ERROR, f"a header block over {MAX_HEADER_BLOCK} bytes")
        if not flags & END_HEADERS:
            return
        self.headers_in = None
        headers = self.decoder.decode(bytes(block))  # (always: it keeps the table in step)
        end = bool(first_flags & END_STREAM)
        s = self.streams.get(sid)
        if s is not None:  # trailers from the client
            if not end:
                raise ProtocolError(PROTOCOL_ERROR, "a second header block that does not end the stream")
            self._end(s)
            return
        if sid <= self.last_stream:
            return  # a stream already closed: nothing to do (its frames may still arrive)
        self.last_stream = sid
        if self.closing:
            return
        if len(self.streams) >= MAX_STREAMS:
            self.write(frame(RST_STREAM, 0, sid, struct.pack(">I", REFUSED_STREAM)))
            return
        s = Stream(self, sid, headers)
        s.remote_done = end  # (before the server sees it: an answer given at once knows whether more comes)
        self.streams[sid] = s
        self.server.open_stream(s)
        if end and not s.closed:
            self._end(s)

    def _data(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise ProtocolError(PROTOCOL_ERROR, "DATA on stream 0")
        self.conn_outstanding += len(payload)
        if self.conn_outstanding > CONN_WINDOW:
            raise ProtocolError(FLOW_CONTROL_ERROR, "more data than the connection's window")
        s = self.streams.get(sid)
        if s is None or s.remote_done:
            self.consumed(None, len(payload))  # a stream already answered: credit, drop
            return
        s.outstanding += len(payload)
        if s.outstanding > WINDOW:
            raise ProtocolError(FLOW_CONTROL_ERROR, "more data than the stream's window")
        data = _unpad(flags, payload)
        if len(data) < len(payload):
            self.consumed(s, len(payload) - len(data))
        if data:
            self.server.data_received(s, data)
        if flags & END_STREAM and not s.closed:
            self._end(s)

    def _end(self, s: Stream) -> None:
        s.remote_done = True
        self.server.end_received(s)

    def _settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid:
            raise ProtocolError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        if len(payload) % 6:
            raise ProtocolError(FRAME_SIZE_ERROR, "a SETTINGS frame of the wrong size")
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == S_INITIAL_WINDOW_SIZE:
                if value > 0x7FFFFFFF:
                    raise ProtocolError(FLOW_CONTROL_ERROR, "an initial window over 2^31-1")
                delta, self.peer_initial_window = value - self.peer_initial_window, value
                for s in self.streams.values():
                    s.send_window += delta
            elif key == S_MAX_FRAME_SIZE:
                if not 16384 <= value <= 16777215:
                    raise ProtocolError(PROTOCOL_ERROR, "a max frame size out of range")
                self.peer_max_frame = value
        self.write(frame(SETTINGS, ACK, 0))
        self._pump_blocked()

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolError(FRAME_SIZE_ERROR, "a WINDOW_UPDATE of the wrong size")
        inc = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
        if sid == 0:
            self.conn_send_window += inc
            self._pump_blocked()
        elif (s := self.streams.get(sid)) is not None:
            s.send_window += inc
            self.pump(s)

    # -- sending ---------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        self.out.append(data)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_scheduled = False
        out, self.out = self.out, []
        if self.transport is not None and out:
            self.transport.write(b"".join(out))

    def pump(self, s: Stream) -> None:
        """Send what of s's data the windows allow; the trailers once all of it is out."""
        while s.pending:
            n = min(len(s.pending), s.send_window, self.conn_send_window, self.peer_max_frame)
            if n <= 0:
                self.blocked[s.id] = s
                return
            chunk = bytes(s.pending[:n])
            del s.pending[:n]
            s.send_window -= n
            self.conn_send_window -= n
            self.write(frame(DATA, 0, s.id, chunk))
        self.blocked.pop(s.id, None)
        s._wake()
        if s.trailers is not None:
            block, s.trailers = s.trailers, None
            s.send_headers(block, end=True)

    def _pump_blocked(self) -> None:
        for s in list(self.blocked.values()):
            if self.conn_send_window <= 0:
                return
            self.pump(s)

    def consumed(self, s: Stream | None, n: int) -> None:
        """Credit n bytes taken by the gRPC layer back to the peer (the connection's window,
        and the stream's while the client may still send on it), gathered until half a
        window is owed: a WINDOW_UPDATE for every message would double the frames."""
        self.conn_owed += n
        if self.conn_owed >= CONN_WINDOW // 2:
            self.write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.conn_owed)))
            self.conn_outstanding -= self.conn_owed
            self.conn_owed = 0
        if s is not None and not s.closed and not s.remote_done:
            s.owed += n
            if s.owed >= WINDOW // 2:
                self.write(frame(WINDOW_UPDATE, 0, s.id, struct.pack(">I", s.owed)))
                s.outstanding -= s.owed
                s.owed = 0

    def finished(self, s: Stream) -> None:
        if s.closed:
            return
        s.closed = True
        s._wake()
        s.call = None  # (the call keeps its stream: without this cycle both go as soon as the call does)
        self.streams.pop(s.id, None)
        self.blocked.pop(s.id, None)
        if self.closing and not self.streams:
            self.close()

    def goaway(self, code: int, message: str = "") -> None:
        """Say no more streams will be served (after the last one opened) and, on an error, close."""
        if self.transport is None:
            return
        if code != NO_ERROR:
            log.info("etcd API connection from %s closed: %s", self.transport.get_extra_info("peername"), message)
        self.write(frame(GOAWAY, 0, 0, struct.pack(">II", self.last_stream, code) + message.encode()[:256]))
        self.closing = True
        if code != NO_ERROR or not self.streams:
            self.close()

    def close(self) -> None:
        if self.transport is not None:
            self._flush()
            self.transport.close()


def _unpad(flags: int, payload: bytes) -> bytes:
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise ProtocolError(PROTOCOL_ERROR, "padding longer than its frame")
    return payload[1 : len(payload) - payload[0]]
