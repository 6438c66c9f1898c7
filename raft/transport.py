"""Peer transport over TCP (the default `Transport`, see transport_protocol.py): persistent
connections carrying length-prefixed binary frames.

Each node dials every other member once and only *sends* on that connection; it receives
on the connections others dialed to it. So a link i→j carries i's messages to j, and a test
proxy on that link can cut one direction only.

Peers are admitted unless they were removed from the cluster (the caller's `removed`):
a member added while this node lagged behind must still reach it (see RaftCore.known); the
core refuses messages from ids it never knew that do not prove it is behind. A cluster
secret is what keeps out processes that do not belong.

A connection starts with a handshake (frames of their own, before any message):

    dialer   → HELLO      magic, group, from id, to id, from's client URL, nonce_c
    acceptor → WELCOME    nonce_s, proof_s = HMAC(secret, "accept"|group|from|to|nonce_c)
    dialer   → AUTH       proof_c = HMAC(secret, "dial"|group|from|to|nonce_c|nonce_s)

nonce_c is 16 random bytes followed by the dialer's ledger_id (raft/ledger.py; nothing from
a version before them, which an acceptor takes for "not known"): the field where an older
acceptor, which reads it as an opaque nonce, still lets the dialer in. nonce_s, likewise,
is 16 random bytes followed by what the acceptor says of itself, "v=LEVEL;c=CLUSTER_ID"
(nothing from an earlier version, which an earlier dialer MACs as the opaque nonce it
takes it for; fields a dialer does not know it skips):
- c: its cluster's id (the state's ClusterId; absent while it has none): a dialer that
  has one too, another, hangs up before AUTH and says so. Restoring a backup into a new
  cluster gives it an identity of its own (snapshot/restore.py), so a restored node given
  the old cluster's --peers, or a node of any other cluster dialling the wrong address,
  never exchanges a message with it (etcd's cluster ID check);
- v: the level of commands it applies (kv's COMMAND_LEVEL; `peer_level`): a command that
  an earlier version cannot apply is proposed only once every member says it can (etcd's
  cluster version), or the replicas would differ.

The acceptor refuses (and closes) unless the group is its own, `to` is itself, `from` is
not refused as removed and, with a cluster secret, proof_c is right (constant-time compare); the dialer
checks proof_s, so entries never leak to a process that does not know the secret either.
To a peer the caller's `removed(from, its ledger_id)` refuses (a member removed from the
cluster, or the data dir a member had before it was removed and joined again from an empty
one) it says so first: REMOVED, proof_r = HMAC(secret, "removed"|group|from|to|nonce_c),
which the dialer checks before it believes it (the node stops once most of the others, or
its leader, say so: raft/node.py). To a dialer that reached the wrong node (a slip
in --peers) it says which node it is in REFUSED, a line the dialer only logs (nothing proves it), and
the dialer tries the peer's other address: the one dialled is not that peer's.
After that every frame must carry `src` = the authenticated id and `dst` = the acceptor.
Peers are known by id, never by address: the address dialled may be a proxy or a NAT.
A frame that does not parse, is too large or breaks these rules closes that connection and
nothing else.

Strangers cost nothing: before authentication a frame may be at most PREAUTH_MAX_FRAME
bytes (a larger length prefix closes the connection before its body is read), a handshake
must finish within HANDSHAKE_TIMEOUT, at most `max_unauthenticated` connections may be
handshaking at once (a new one evicts the oldest, so a flood of strangers cannot lock real
peers out) and at most `max_connections` inbound connections are open (beyond that a new
one is closed at once). What strangers make it log is rate-limited by the caller (kv
installs kv.server.eventlog.guard on this logger). With peer TLS (`ssl` = server and client contexts) both sides
present a certificate signed by the cluster's CA before the handshake even starts.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
import logging
import os
import ssl
import struct
from collections.abc import Callable

from . import codec
from .backoff import Backoff
from .messages import Message
from .transport_protocol import TransportCounters

log = logging.getLogger("kv.raft.transport")

MAGIC = b"LKV1"
HELLO, WELCOME, AUTH = 100, 101, 102  # the handshake's frame types
REMOVED = 103  # the acceptor's answer to a member removed from the cluster (then it closes)
REFUSED = 104  # the acceptor's answer to a dialer that reached the wrong node: which it is
HANDSHAKE_TIMEOUT = 5.0
NONCE_BYTES = 16  # nonce_c's random part, before the dialer's ledger_id
PREAUTH_MAX_FRAME = 4096  # HELLO and AUTH are a few hundred bytes
# An HTTP request on the peer port: a client given this address instead of the node's
# --http one. It gets a 400 saying so (ledgerkv's error model, so kv.Client reports it as
# such), rather than a bare reset that a writer must take for "outcome unknown".
_HTTP_METHODS = (b"GET ", b"PUT ", b"POST ", b"DELETE ", b"HEAD ", b"PATCH ", b"OPTIONS ")
# A gRPC client's (etcdctl's) HTTP/2 preface: closed at once, and the log says what it was
# (not a frame-length error). Closed, grpcio fails at once with UNAVAILABLE; a GOAWAY with a
# text had it reconnect in a busy loop until its deadline, the text only in its debug log.
_HTTP2_PREFACE = b"PRI * HTTP/2.0"
MAX_UNAUTHENTICATED = 64
MAX_CONNECTIONS = 1024
WRITE_BUFFER_LIMIT = 64 << 20  # beyond this a peer is too slow: drop messages to it


def pack_strs(*items: bytes) -> bytes:
    """A handshake frame's body: each item with a 2-byte length."""
    return b"".join(struct.pack(">H", len(x)) + x for x in items)


def hello_frame(group: bytes, src: bytes, dst: bytes, url: bytes, nonce: bytes) -> bytes:
    """The dialer's first frame (see the handshake above)."""
    return codec.frame(HELLO, pack_strs(MAGIC, group, src, dst, url, nonce))


def auth_frame(proof: bytes) -> bytes:
    """The dialer's answer to WELCOME."""
    return codec.frame(AUTH, pack_strs(proof))


def _unpack_strs(body: bytes | memoryview, count: int) -> list[bytes]:
    out, o = [], 0
    for _ in range(count):
        if len(body) < o + 2:
            raise codec.CodecError("handshake frame is truncated")
        (n,) = struct.unpack_from(">H", body, o)
        o += 2
        item = bytes(body[o : o + n])
        if len(item) != n:
            raise codec.CodecError("handshake frame is truncated")
        out.append(item)
        o += n
    if o != len(body):
        raise codec.CodecError("stray bytes in handshake frame")
    return out


def _fields(said: bytes) -> dict[str, str]:
    """What an acceptor says of itself after WELCOME's nonce: "k=v;k=v" (see above)."""
    out = {}
    for part in said.decode(errors="replace").split(";"):
        k, eq, v = part.partition("=")
        if eq:
            out[k] = v
    return out


def _mac(secret: bytes | None, *parts: bytes) -> bytes:
    if not secret:
        return b""
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).digest()


def _host_port(addr: str) -> tuple[str, int]:
    """(host, port) of a peer's HOST:PORT, an IPv6 host given in brackets ([::1]:7001)
    without them (kv.common.addresses splits client addresses alike; raft/ stands alone)."""
    host, _, port = addr.rpartition(":")
    return (host[1:-1] if host.startswith("[") and host.endswith("]") else host), int(port)


class _FrameReader:
    """Splits a byte stream into (type, body) frames of at most `max_frame` bytes; the
    limit is checked on the length prefix, before the body is buffered, and may change
    between frames (it grows once a peer has authenticated)."""

    def __init__(self, max_frame: int = codec.MAX_FRAME) -> None:
        self._buf = bytearray()
        self._o = 0
        self.max_frame = max_frame

    def feed(self, data: bytes) -> None:
        self._buf += data

    def next(self) -> tuple[int, memoryview] | None:
        buf, o, hdr = self._buf, self._o, codec.FRAME_HEADER
        if len(buf) - o < hdr.size:
            self._compact()
            return None
        length, ftype = hdr.unpack_from(buf, o)
        if length < 1 or length > self.max_frame:
            raise codec.CodecError(f"frame length {length} out of bounds (at most {self.max_frame} here)")
        end = o + 4 + length
        if end > len(buf):
            self._compact()
            return None
        self._o = end
        return ftype, memoryview(bytes(buf[o + hdr.size : end]))

    def _compact(self) -> None:
        if self._o:
            del self._buf[: self._o]
            self._o = 0

    def frames(self, data: bytes):
        self.feed(data)
        while (f := self.next()) is not None:
            yield f


class PeerTLS:
    """Mutual TLS between peers: `server` for the connections others dial to us (it
    requires their certificate), `client` for ours (it presents ours and checks theirs)."""

    def __init__(self, server: ssl.SSLContext, client: ssl.SSLContext) -> None:
        self.server, self.client = server, client


class _Inbound(asyncio.Protocol):
    """A connection another node dialed to us: handshake, then receive messages."""

    def __init__(self, t: TcpTransport) -> None:
        self.t = t
        self.reader = _FrameReader(PREAUTH_MAX_FRAME)
        self.peer: str | None = None
        self.nonce_c = b""
        self.nonce_s = b""
        self.ledger = ""  # the dialer's ledger_id ("" if it did not say)
        self._url = ""  # the client URL it announced
        self.authed = False
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.t._admit(self)
        self._timer = asyncio.get_running_loop().call_later(HANDSHAKE_TIMEOUT, self._handshake_timeout)

    def _handshake_timeout(self) -> None:
        if not self.authed:
            self.close("no handshake in time")

    def connection_lost(self, exc) -> None:
        self.t._inbound.discard(self)
        self.t._unauthed.pop(self, None)
        if self.authed:
            self.t._url_gone(self)
        if self._timer:
            self._timer.cancel()

    def _refuse_http(self) -> None:
        message = (
            f"this is node {self.t.node_id}'s peer port, where the members talk Raft, not its client API: "
            "give the node's --http address (kv status lists them; kv cluster up prints them)"
        )
        body = json.dumps({"error": {"code": "BAD_REQUEST", "message": message}}).encode()
        head = b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
        if self.transport and not self.transport.is_closing():
            self.transport.write(head + body)
        self.close("an HTTP request: a client was given the peer port instead of the --http address")

    def close(self, why: str) -> None:
        if self.transport and not self.transport.is_closing():
            log.warning("closing peer connection from %s: %s", self.peer or self._address(), why[:200])
            self.t.rejected_connections += 1
            self.transport.close()
        self.t._unauthed.pop(self, None)

    def _address(self) -> str:
        """Where an unidentified connection came from (HOST:PORT), for the log."""
        addr = self.transport.get_extra_info("peername") if self.transport else None
        if not (isinstance(addr, tuple) and len(addr) >= 2):
            return "an unknown address"
        return f"[{addr[0]}]:{addr[1]}" if ":" in str(addr[0]) else f"{addr[0]}:{addr[1]}"

    def data_received(self, data: bytes) -> None:
        if self.peer is not None:
            self.t.received_bytes[self.peer] += len(data)
        elif data.startswith(_HTTP_METHODS):
            self._refuse_http()
            return
        elif data.startswith(_HTTP2_PREFACE):
            self.close("an HTTP/2 (gRPC) client was given the peer port instead of the node's --grpc address")
            return
        try:
            for ftype, body in self.reader.frames(data):
                if self.transport.is_closing():
                    return
                if self.authed:
                    msg = codec.decode(ftype, body)
                    if msg.src != self.peer or msg.dst != self.t.node_id:
                        raise codec.CodecError(f"message {msg.src}->{msg.dst} on the link from {self.peer}")
                    self.t._on_message(msg)
                else:
                    self._handshake(ftype, body)
        except codec.CodecError as e:
            self.close(str(e))
        except UnicodeDecodeError:  # a handshake name or group that is not UTF-8
            self.close("handshake frame is not UTF-8 where it must be")

    def _handshake(self, ftype: int, body: memoryview) -> None:
        t = self.t
        if ftype == HELLO and self.peer is None:
            magic, group, src, dst, url, nonce_c = _unpack_strs(body, 6)
            if magic != MAGIC:
                raise codec.CodecError("not a ledgerkv peer")
            src_s = src.decode()
            if group.decode() != t.group:
                raise codec.CodecError(f"peer {src_s!r} is in group {group.decode()!r}, we are in {t.group!r}")
            if dst.decode() != t.node_id:
                self._refuse(f"this is node {t.node_id!r}, not {dst.decode()!r}")
                raise codec.CodecError(f"peer {src_s!r} dialled node {dst.decode()!r} but reached {t.node_id!r}")
            if src_s == t.node_id:
                raise codec.CodecError(f"a peer claims to be this node ({src_s!r})")
            ledger = nonce_c[NONCE_BYTES:].decode()
            if (why := t.removed(src_s, ledger)) is not None:
                self.transport.write(codec.frame(REMOVED, pack_strs(_mac(t.secret, b"removed", group, src, dst, nonce_c))))
                raise codec.CodecError(why)
            if (why := t.stranger(src_s)) is not None:
                raise codec.CodecError(why)
            self.peer, self.ledger, self.nonce_c, self.nonce_s = src_s, ledger, nonce_c, os.urandom(NONCE_BYTES) + t.about()
            self._url = url.decode()
            proof = _mac(t.secret, b"accept", group, src, dst, nonce_c)
            self.transport.write(codec.frame(WELCOME, pack_strs(self.nonce_s, proof)))
        elif ftype == AUTH and self.peer is not None:
            (proof,) = _unpack_strs(body, 1)
            expect = _mac(t.secret, b"dial", t.group.encode(), self.peer.encode(), t.node_id.encode(), self.nonce_c, self.nonce_s)
            if not hmac.compare_digest(proof, expect):
                raise codec.CodecError(f"peer {self.peer!r} failed cluster-secret authentication")
            self.authed = True
            self.reader.max_frame = codec.MAX_FRAME
            self.t._unauthed.pop(self, None)
            self._timer.cancel()
            t._announced(self)
        else:
            raise codec.CodecError("unexpected frame during handshake")

    def _refuse(self, why: str) -> None:
        self.transport.write(codec.frame(REFUSED, pack_strs(why.encode())))


class _RefusedByPeer(ConnectionError):
    pass


class _RemovedByPeer(_RefusedByPeer):
    """The peer refused this node as a member removed from the cluster (proven with the
    cluster secret)."""


class _OtherCluster(ConnectionError):
    """The peer answered with another cluster's id: this node hung up."""


class _NotThePeer(ConnectionError):
    """What answered at the peer's address says it is another node (REFUSED)."""


class _Outbound(asyncio.Protocol):
    """Our connection to one peer: handshake, then send only."""

    def __init__(self, link: _Link) -> None:
        self.link = link
        self.reader = _FrameReader(PREAUTH_MAX_FRAME)
        self.transport: asyncio.Transport | None = None
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.lost: asyncio.Future = asyncio.get_running_loop().create_future()
        self.nonce_c = os.urandom(NONCE_BYTES) + link.t.ledger_id.encode()

    def connection_made(self, transport) -> None:
        self.transport = transport
        t = self.link.t
        transport.write(hello_frame(t.group.encode(), t.node_id.encode(), self.link.peer.encode(), t.advertise_url.encode(), self.nonce_c))

    def data_received(self, data: bytes) -> None:
        t = self.link.t
        try:
            for ftype, body in self.reader.frames(data):
                g, me, peer = t.group.encode(), t.node_id.encode(), self.link.peer.encode()
                if ftype == REMOVED:
                    if self.ready.done():  # given up on before it came (the node stops, or the handshake timed out)
                        self.transport.close()
                        return
                    (proof,) = _unpack_strs(body, 1)
                    if not hmac.compare_digest(proof, _mac(t.secret, b"removed", g, me, peer, self.nonce_c)):
                        raise codec.CodecError(f"{self.link.peer} says this node was removed, without the cluster secret's proof")
                    self.ready.set_exception(_RemovedByPeer(f"{self.link.peer} refuses this node: it was removed from the cluster"))
                    self.transport.close()
                    return
                if ftype == REFUSED and not self.ready.done():
                    (why,) = _unpack_strs(body, 1)
                    said = "".join(ch if ch.isprintable() else "?" for ch in why.decode(errors="replace")[:100])
                    self.ready.set_exception(_NotThePeer(f"{self.link.peer} at {self.link.addr} answered {said!r}: check its address in --peers"))
                    self.transport.close()
                    return
                if ftype != WELCOME or self.ready.done():
                    raise codec.CodecError("peers send nothing back on this link but the handshake")
                nonce_s, proof = _unpack_strs(body, 2)
                if not hmac.compare_digest(proof, _mac(t.secret, b"accept", g, me, peer, self.nonce_c)):
                    raise codec.CodecError(f"{self.link.peer} failed cluster-secret authentication")
                said = _fields(nonce_s[NONCE_BYTES:])
                theirs, ours = said.get("c", ""), t.cluster_id()
                if theirs and ours and theirs != ours:
                    self.ready.set_exception(
                        _OtherCluster(
                            # (short: the log's rate limit cuts a line at 200 characters)
                            f"{self.link.peer} at {self.link.addr} belongs to another cluster (id {theirs[:16]}, this one's {ours}): not "
                            f"connected. Restored from a backup with the old --peers? Give it addresses of its own"
                        )
                    )
                    self.transport.close()
                    return
                self.transport.write(auth_frame(_mac(t.secret, b"dial", g, me, peer, self.nonce_c, nonce_s)))
                level = said.get("v", "")
                t.peer_levels[self.link.peer] = int(level) if level.isascii() and level.isdigit() and len(level) < 6 else 0
                self.ready.set_result(True)
        except codec.CodecError as e:
            log.warning("dropping connection to %s: %s", self.link.peer, e)
            self.transport.close()

    def connection_lost(self, exc) -> None:
        if not self.ready.done():
            self.ready.set_exception(_RefusedByPeer(f"{self.link.peer} closed the connection during the handshake"))
        if not self.lost.done():
            self.lost.set_result(None)


class _Link:
    """Keeps one outbound connection alive, reconnecting with backoff. Of the peer's
    addresses, the next is tried when one cannot be reached (nothing listens there, or no
    answer in HANDSHAKE_TIMEOUT); a peer that answers and refuses, or hangs up, is dialled
    at the same address again."""

    def __init__(self, t: TcpTransport, peer: str, addrs: tuple[str, ...]) -> None:
        self.t, self.peer, self.addrs = t, peer, addrs
        self._at = 0  # the address dialled: addrs[_at]
        self._told: set[str] = set()  # the other-cluster warnings logged for this link (each once)
        self.conn: _Outbound | None = None
        self._queued: list[bytes] = []  # frames sent this turn of the loop, written by _flush
        self._queued_bytes = 0
        self._loop = asyncio.get_running_loop()
        self.task = self._loop.create_task(self._run(), name=f"link-{t.node_id}-{peer}")

    async def _run(self) -> None:
        backoff = Backoff(0.02, 1.0)
        loop = asyncio.get_running_loop()
        while True:
            host, port = _host_port(self.addr)
            proto: _Outbound | None = None
            try:
                _, proto = await asyncio.wait_for(
                    loop.create_connection(lambda: _Outbound(self), host, port, **self.t._dial_tls(host)), HANDSHAKE_TIMEOUT
                )
                await asyncio.wait_for(proto.ready, HANDSHAKE_TIMEOUT)
            except (OSError, ConnectionError, asyncio.TimeoutError, ValueError) as e:
                if proto is not None and proto.transport is not None:
                    proto.transport.close()
                if isinstance(e, ssl.SSLError):  # a configuration error, not a network blip
                    log.warning("TLS with %s at %s failed: %s; check --peer-cert/--peer-key/--peer-ca on both", self.peer, self.addr, e)
                elif isinstance(e, _RemovedByPeer):
                    self.t.on_removed(self.peer)
                elif isinstance(e, (_OtherCluster, _NotThePeer)):
                    if str(e) not in self._told:  # (once an address, not at every retry)
                        log.warning("%s", e)
                        if len(self._told) >= 16:  # (what answers at an address may say something new each time)
                            self._told.clear()
                        self._told.add(str(e))
                elif isinstance(e, _RefusedByPeer):
                    # The peer logs why; with TLS 1.3 a peer that does not trust our
                    # certificate hangs up only after the TLS handshake, without a reason.
                    maybe = "; with peer TLS it may not trust our certificate (--peer-cert signed by its --peer-ca?)" if self.t.ssl else ""
                    log.warning("%s: it was stopping, or it refused us (see its log: group, membership, cluster secret)%s", e, maybe)
                else:
                    log.debug("cannot reach %s at %s: %s", self.peer, self.addr, e)
                if not isinstance(e, _RefusedByPeer):  # (another cluster's node is not the peer: its other address may be)
                    self._at = (self._at + 1) % len(self.addrs)
                await asyncio.sleep(backoff.next())
                continue
            backoff.reset()
            self._told.clear()
            self.conn = proto
            self.t._on_connected(self.peer)
            await proto.lost
            self.conn = None

    @property
    def addr(self) -> str:
        return self.addrs[self._at]

    def send(self, frame: bytes) -> bool:
        """Queue a frame; the frames queued in one turn of the event loop go out in one
        socket write (a leader's appends and commits, a follower's acks)."""
        c = self.conn
        if c is None or c.transport.is_closing():
            return False
        if c.transport.get_write_buffer_size() + self._queued_bytes > WRITE_BUFFER_LIMIT:
            return False
        if not self._queued:
            self._loop.call_soon(self._flush)
        self._queued.append(frame)
        self._queued_bytes += len(frame)
        return True

    def _flush(self) -> None:
        frames, self._queued, self._queued_bytes = self._queued, [], 0
        c = self.conn
        if c is not None and not c.transport.is_closing():
            c.transport.write(frames[0] if len(frames) == 1 else b"".join(frames))

    def close(self) -> None:
        self.task.cancel()
        if self.conn is not None:
            self.conn.transport.close()


class TcpTransport:
    """Listens on `listen` for the links peers dial to this node and dials one link to each
    peer (see the module's docstring)."""

    def __init__(
        self,
        node_id: str,
        group: str,
        listen: str,
        *,
        removed: Callable[[str, str], str | None],
        stranger: Callable[[str], str | None] = lambda peer: None,
        ledger_id: str = "",
        cluster_id: Callable[[], str] = lambda: "",
        secret: str | None = None,
        advertise_url: str = "",
        ssl: PeerTLS | None = None,
        max_unauthenticated: int = MAX_UNAUTHENTICATED,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.node_id, self.group, self.listen = node_id, group, listen
        self._on_message: Callable[[Message], None] = lambda msg: None
        self._on_connected: Callable[[str], None] = lambda peer: None
        self.on_removed: Callable[[str], None] = lambda peer: None  # a peer refused us as a removed member
        self.removed = removed  # why a peer (dialling with this ledger_id) is refused as removed, or None
        self.stranger = stranger  # why a peer that was never removed is still not let in, or None
        self.ledger_id = ledger_id  # this node's, said in the handshakes it dials
        self.cluster_id = cluster_id  # this node's cluster's ("": none yet), said in the handshakes it accepts
        self.level = 0  # the level of commands this node applies, said there too (set by the driver)
        self.peer_levels: dict[str, int] = {}  # what peers said of theirs when this node last dialled them
        self.secret = secret.encode() if secret else None
        self.advertise_url = advertise_url
        self._links: dict[str, _Link] = {}
        self._inbound: set[_Inbound] = set()
        self._unauthed: dict[_Inbound, None] = {}  # handshaking, oldest first
        self.ssl = ssl
        self.max_unauthenticated, self.max_connections = max_unauthenticated, max_connections
        self._server: asyncio.base_events.Server | None = None
        self.peer_urls: dict[str, str] = {}  # client URLs peers announced in their HELLO
        self.rejected_connections = 0
        self.sent_frames = 0
        self.dropped_frames = 0
        self.sent_bytes: collections.Counter[str] = collections.Counter()  # peer -> bytes of frames sent
        self.received_bytes: collections.Counter[str] = collections.Counter()  # peer -> bytes received

    async def start(self, on_message: Callable[[Message], None], on_connected: Callable[[str], None]) -> None:
        self._on_message, self._on_connected = on_message, on_connected
        host, port = _host_port(self.listen)
        loop = asyncio.get_running_loop()
        tls = {"ssl": self.ssl.server, "ssl_handshake_timeout": HANDSHAKE_TIMEOUT} if self.ssl else {}
        self._server = await loop.create_server(lambda: _Inbound(self), host or "127.0.0.1", port, reuse_address=True, **tls)

    def _dial_tls(self, host: str) -> dict:
        if self.ssl is None:
            return {}
        # Peers are known by id, not address (a proxy, a NAT): the certificate must be
        # signed by the cluster's CA, its host name is not checked.
        return {"ssl": self.ssl.client, "server_hostname": host or "127.0.0.1", "ssl_handshake_timeout": HANDSHAKE_TIMEOUT}

    def _admit(self, conn: _Inbound) -> None:
        """A new inbound connection: within the limits, or closed (the oldest handshaking
        one makes room when too many are handshaking)."""
        if len(self._inbound) >= self.max_connections:
            log.warning("refusing a peer connection: %d are open (the limit)", len(self._inbound))
            self.rejected_connections += 1
            conn.transport.close()
            return
        if len(self._unauthed) >= self.max_unauthenticated:
            oldest = next(iter(self._unauthed))
            log.warning("%d peer connections are handshaking at once (the limit): closing the oldest", len(self._unauthed))
            self._unauthed.pop(oldest)
            self.rejected_connections += 1
            oldest.transport.close()
        self._inbound.add(conn)
        self._unauthed[conn] = None

    def refuse_removed(self) -> None:
        """Close the connections of peers that are no longer members, or are known by
        another ledger now (a membership change was applied): they dial again, and the
        handshake tells them they were removed."""
        for conn in list(self._inbound):
            if conn.peer is not None and (why := self.removed(conn.peer, conn.ledger)) is not None:
                conn.close(why)

    def set_peers(self, peers: dict[str, str | tuple[str, ...]]) -> None:
        """Dial these peers (id -> its address, or addresses to try in turn); stop
        dialling those no longer listed."""
        addrs = {pid: (a,) if isinstance(a, str) else a for pid, a in peers.items()}
        for pid in list(self._links):
            if pid not in addrs or addrs[pid] != self._links[pid].addrs:
                self._links.pop(pid).close()
        for pid in list(self.peer_levels):
            if pid not in addrs:  # (removed: an id added again says anew)
                del self.peer_levels[pid]
        for pid, a in addrs.items():
            if pid != self.node_id and pid not in self._links:
                self._links[pid] = _Link(self, pid, a)

    def send(self, msg: Message) -> bool:
        """Queue a message for its destination; False if it was dropped (no connection,
        or the peer is too slow). Raft copes with lost messages: re-push and heartbeats."""
        link = self._links.get(msg.dst)
        if link is not None:
            frame = codec.encode(msg)
            if link.send(frame):
                self.sent_frames += 1
                self.sent_bytes[msg.dst] += len(frame)
                return True
        self.dropped_frames += 1
        return False

    def connected(self, peer: str) -> bool:
        link = self._links.get(peer)
        return link is not None and link.conn is not None

    @property
    def inbound_connections(self) -> int:
        """Connections peers (or strangers) dialed to this node that are open."""
        return len(self._inbound)

    @property
    def handshaking(self) -> int:
        """Inbound connections that have not authenticated yet."""
        return len(self._unauthed)

    def peer_url(self, peer: str) -> str:
        return self.peer_urls.get(peer, "")

    def peer_level(self, peer: str) -> int:
        return self.peer_levels.get(peer, 0)

    def about(self) -> bytes:
        """What this node says of itself in a WELCOME, after the nonce (see above)."""
        cid = self.cluster_id()
        return b"v=%d" % self.level + (b";c=" + cid.encode() if cid else b"")

    # A peer's client URL is the one it announced in its handshake (requests are forwarded
    # there, a leader's with the client's token). Two nodes may dial as one member: a stray
    # started with a member's id (a mistyped --data-dir, a restore given the wrong --peers)
    # beside the member. The URL of the data dir (ledger) that was connected first holds
    # while it stays connected, and is taken back when the stray's connection closes: the
    # stray's URL, taken for good, sent the leader's forwarded requests to it.

    def _others(self, conn: _Inbound) -> list[_Inbound]:
        """The open, authenticated connections of conn's peer from another data dir."""
        return [c for c in self._inbound if c.authed and c.peer == conn.peer and c.ledger != conn.ledger and c is not conn]

    def _announced(self, conn: _Inbound) -> None:
        if not conn._url:
            return
        cur = self.peer_urls.get(conn.peer, "")
        others = self._others(conn)
        if others and cur and cur != conn._url:
            log.warning(
                "a second node dials as %r (ledger %s, URL %s; %r is ledger %s): its URL is not used. A mistyped --data-dir?",
                conn.peer, conn.ledger or "not said", conn._url, conn.peer, others[0].ledger or "not said",
            )
            return
        self.peer_urls[conn.peer] = conn._url

    def _url_gone(self, conn: _Inbound) -> None:
        if not conn._url or self.peer_urls.get(conn.peer) != conn._url:
            return
        if any(c.authed and c.peer == conn.peer and c.ledger == conn.ledger for c in self._inbound):
            return  # (the same data dir dialled again before this connection closed)
        back = next((c._url for c in self._others(conn) if c._url), None)
        if back is not None:
            self.peer_urls[conn.peer] = back

    def counters(self) -> TransportCounters:
        return TransportCounters(dict(self.sent_bytes), dict(self.received_bytes), self.sent_frames, self.dropped_frames, self.rejected_connections)

    async def stop(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
        if self._server is not None:
            self._server.close()
        for conn in list(self._inbound):
            if conn.transport is not None:
                conn.transport.close()
        if self._server is not None:
            await self._server.wait_closed()
