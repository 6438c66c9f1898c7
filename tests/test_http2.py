"""The etcd API's own HTTP/2 and gRPC framing (v3api/hpack.py, http2.py, rpc.py): HPACK
against RFC 7541's examples, and a real `kv serve --grpc` against what a stranger on the
port sends (HTTP/1, which the node's HTTP server answers; not HTTP at all, frames too large, headers that do not decode, unknown methods,
messages over the limit, a stream flood, a client that sends nothing): each gets a GOAWAY or
a gRPC status and its connection closed, and the node goes on serving."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time

import grpc
import pytest
from cluster import ProcCluster

from kv.v3api import hpack, http2
from kv.v3api.proto import rpc_pb2, rpc_pb2_grpc

# -- HPACK (RFC 7541 Appendix C) -------------------------------------------------------------


def test_hpack_decodes_the_rfcs_requests_with_and_without_huffman_and_keeps_its_table():
    plain, huff = hpack.Decoder(), hpack.Decoder()
    c3 = ["828684410f7777772e6578616d706c652e636f6d", "828684be58086e6f2d6361636865", "828785bf400a637573746f6d2d6b65790c637573746f6d2d76616c7565"]
    c4 = ["828684418cf1e3c2e5f23a6ba0ab90f4ff", "828684be5886a8eb10649cbf", "828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf"]
    want = [
        [(":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com")],
        [(":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com"), ("cache-control", "no-cache")],
        [(":method", "GET"), (":scheme", "https"), (":path", "/index.html"), (":authority", "www.example.com"), ("custom-key", "custom-value")],
    ]
    for d, blocks in ((plain, c3), (huff, c4)):
        for block, headers in zip(blocks, want):
            assert list(d.decode(bytes.fromhex(block))) == headers
        assert d.size == 164 and d.table[0] == ("custom-key", "custom-value")  # the RFC's table after the third


def test_hpack_evicts_to_a_size_update_and_refuses_what_does_not_decode():
    d = hpack.Decoder()
    d.decode(bytes.fromhex("828684418cf1e3c2e5f23a6ba0ab90f4ff"))
    d.decode(b"\x20")  # size update to 0 empties the table
    assert d.table == [] and d.size == 0
    for bad in (b"\x3f\xe2\x1f", b"\xff\xff\xff\xff\xff\xff\x7f", b"\xc0", b"\x40\x85\xff\xff\xff\xff\xff\x00", b"\x00\x83ab", b"\x41\x81\xfe"):
        with pytest.raises(hpack.HpackError):
            hpack.Decoder().decode(bad)  # table size over the limit, huge integer, no such index, EOS, short string, bad padding


def test_a_remembered_header_block_means_what_the_table_says_now():
    """The decoder hands a block it has seen back without decoding it while the table is
    as it was: once an entry is added or the table shrinks, the same bytes are decoded
    again (the index points elsewhere, or nowhere)."""
    d = hpack.Decoder()
    newest = b"\xbe"  # indexed field 62: the dynamic table's newest entry
    d.decode(b"\x40\x03x-a\x011")  # adds (x-a, 1)
    assert d.decode(newest) == (("x-a", "1"),) and d.decode(newest) is d.decode(newest)
    d.decode(b"\x00\x03x-c\x013")  # a literal without indexing: the table is as it was
    assert d.decode(newest) == (("x-a", "1"),)
    d.decode(b"\x40\x03x-b\x012")  # adds (x-b, 2): index 62 is that one now
    assert d.decode(newest) == (("x-b", "2"),)
    d.decode(b"\x20")  # a size update to 0 empties the table
    with pytest.raises(hpack.HpackError):
        d.decode(newest)
    d.decode(b"\x3f\xe1\x1f")  # back to 4096
    assert d.decode(b"\x82" * 300) == ((":method", "GET"),) * 300  # (a block over 256 bytes is decoded every time)


# -- a real node's gRPC port against hostile clients ------------------------------------------


UNREAD_LIMIT = 24 << 20  # --http-unread-bytes: answers held for clients that do not read them


def one_node(root: str, **env: str):
    """A node serving the etcd API, with these KV_ settings, running until the end."""
    with ProcCluster(root, 1, proxies=False) as c:
        c.serve_etcd_api()
        c.node_env["n1"].update(env)
        c.start()
        c.leader()
        yield c


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    yield from one_node(str(tmp_path_factory.mktemp("h2")), KV_HTTP_UNREAD_BYTES=str(UNREAD_LIMIT))


def _connect(node) -> socket.socket:
    host, port = node.grpc["n1"].split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def _frames_until_closed(s: socket.socket, timeout: float = 10.0) -> list[tuple[int, int, int, bytes]]:
    """Every frame the server sends until it closes the connection."""
    s.settimeout(timeout)
    data = b""
    while True:
        try:
            got = s.recv(65536)
        except (ConnectionResetError, TimeoutError, socket.timeout):
            break
        if not got:
            break
        data += got
    out, pos = [], 0
    while len(data) - pos >= 9:
        length = int.from_bytes(data[pos : pos + 3], "big")
        out.append((data[pos + 3], data[pos + 4], int.from_bytes(data[pos + 5 : pos + 9], "big"), data[pos + 9 : pos + 9 + length]))
        pos += 9 + length
    return out


def _goaway_code(frames) -> int | None:
    codes = [struct.unpack(">II", p[:8])[1] for kind, _f, _s, p in frames if kind == http2.GOAWAY]
    return codes[-1] if codes else None


def _serves(node) -> None:
    with grpc.insecure_channel(node.grpc["n1"]) as ch:
        kv = rpc_pb2_grpc.KVStub(ch)
        kv.Put(rpc_pb2.PutRequest(key=b"h2/alive", value=b"yes"), timeout=10)
        assert kv.Range(rpc_pb2.RangeRequest(key=b"h2/alive"), timeout=10).kvs[0].value == b"yes"


def test_a_put_answer_written_by_hand_is_the_message_protobuf_writes():
    """wire.Headers.put_response writes a plain put's PutResponse field by field: it must
    parse as the same message protobuf serializes, for ids, terms and revisions at every
    varint length (and a term that changes between answers)."""
    from types import SimpleNamespace

    from kv.v3api import wire

    raft = SimpleNamespace(term=1, applied_index=0)
    node = SimpleNamespace(sm=SimpleNamespace(cluster_id="c1"), raft=raft, ids=lambda: (14841639068965178418, 1))
    h = wire.Headers(node)
    for term in (1, 127, 128, 2**32, 2**64 - 1):
        raft.term = term
        for rev in (1, 127, 128, 300, 16_383, 16_384, 2**35, 2**63 - 1):
            ours = h.put_response(rev)
            want = rpc_pb2.PutResponse(header=h(rev))
            assert rpc_pb2.PutResponse.FromString(ours) == want
            assert ours == want.SerializeToString()
    node.ids = lambda: (0, 2**63)  # (no cluster id yet: proto3 leaves a zero out)
    node.sm.cluster_id = "c2"
    assert h.put_response(5) == rpc_pb2.PutResponse(header=h(5)).SerializeToString()


def test_what_is_not_http2_is_answered_and_closed(node):
    # HTTP/1: served by the node's HTTP server, as etcd's client port serves its JSON
    # gateway (MemberList's client URLs are this port's: Patroni sends its calls there)
    s = _connect(node)
    body = b'{"key": "aDIvYWxpdmU="}'
    s.sendall(b"POST /v3/kv/range HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    s.settimeout(10)
    got = b""
    while chunk := s.recv(4096):
        got += chunk
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and b'"header"' in got, got
    s = _connect(node)
    s.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # a TLS ClientHello on a plain port: GOAWAY
    assert _goaway_code(_frames_until_closed(s)) == http2.PROTOCOL_ERROR
    _serves(node)


def test_broken_frames_and_headers_close_the_connection_with_their_error(node):
    cases = [
        (http2.frame(http2.DATA, 0, 1, b"x" * 20000), http2.FRAME_SIZE_ERROR),  # over the 16 KiB frame size
        (http2.frame(http2.HEADERS, http2.END_HEADERS, 1, b"\xff\xff\xff\xff\xff\x7f"), http2.COMPRESSION_ERROR),
        (http2.frame(http2.HEADERS, http2.END_HEADERS, 2, b"\x83"), http2.PROTOCOL_ERROR),  # an even stream id
        (http2.frame(http2.HEADERS, 0, 1, b"\x83") + http2.frame(http2.DATA, 0, 1, b""), http2.PROTOCOL_ERROR),  # no CONTINUATION
        (http2.frame(http2.PUSH_PROMISE, 0, 1, b"\0\0\0\2"), http2.PROTOCOL_ERROR),
        (http2.frame(http2.WINDOW_UPDATE, 0, 0, b"\0"), http2.FRAME_SIZE_ERROR),
    ]
    for payload, code in cases:
        s = _connect(node)
        s.sendall(http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0) + payload)
        assert _goaway_code(_frames_until_closed(s)) == code, payload[:20]
        s.close()
    _serves(node)


def test_a_client_that_never_sends_the_preface_is_dropped(node):
    s = _connect(node)
    t0 = time.monotonic()
    s.sendall(b"PRI * HTTP/2.0\r\n")  # half a preface, then nothing
    _frames_until_closed(s, timeout=http2.PREFACE_TIMEOUT_S + 10)
    assert time.monotonic() - t0 < http2.PREFACE_TIMEOUT_S + 5
    _serves(node)


def test_grpc_errors_for_unknown_methods_compression_and_messages_over_the_limit(node):
    with grpc.insecure_channel(node.grpc["n1"]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/etcdserverpb.KV/Nope")(b"", timeout=10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "/etcdserverpb.KV/Nope" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # etcdctl defrag: why there is none
            ch.unary_unary("/etcdserverpb.Maintenance/Defragment")(b"", timeout=10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "docs/etcd.md" in e.value.details() and "nothing to defragment" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # etcdctl member add: what to use instead, and only there
            ch.unary_unary("/etcdserverpb.Cluster/MemberAdd")(b"", timeout=10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "kv member" in e.value.details() and "leader transfer" not in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            rpc_pb2_grpc.KVStub(ch).Put(rpc_pb2.PutRequest(key=b"h2/big", value=b"x" * (3 << 20)), timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as e:
            rpc_pb2_grpc.KVStub(ch).Range(rpc_pb2.RangeRequest(key=b"h2/big"), timeout=10, compression=grpc.Compression.Gzip)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/etcdserverpb.KV/Range")(b"\xff\xff", timeout=10)  # not a RangeRequest
        assert e.value.code() == grpc.StatusCode.INTERNAL
        assert rpc_pb2_grpc.KVStub(ch).Range(rpc_pb2.RangeRequest(key=b"h2/big"), timeout=10).count == 0  # nothing written
    _serves(node)


def test_etcds_clients_pointed_at_the_http_port_are_served_there(node):
    """etcd has one client port; a user who points etcdctl at ledgerkv's HTTP port (the
    'client endpoint' kv cluster up prints) is served there too: a connection that opens
    with HTTP/2's preface goes to the gRPC server (it waited 5 s for 'context deadline
    exceeded'). HTTP/1 requests on that port are served as before."""
    import urllib.request

    with grpc.insecure_channel(node.http["n1"]) as ch:
        kv = rpc_pb2_grpc.KVStub(ch)
        kv.Put(rpc_pb2.PutRequest(key=b"h2/via-http-port", value=b"1"), timeout=10)
        assert kv.Range(rpc_pb2.RangeRequest(key=b"h2/via-http-port"), timeout=10).kvs[0].value == b"1"
    with urllib.request.urlopen(f"http://{node.http['n1']}/v1/kv/h2/via-http-port", timeout=10) as r:
        assert r.read() == b"1"


class _Peer:
    """A raw HTTP/2 client: frames sent as given, and read until one is seen."""

    def __init__(self, address: str, settings: bytes = b"") -> None:
        host, port = address.split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.data = b""
        self.sock.sendall(http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0, settings))

    def send(self, *frames: bytes) -> None:
        self.sock.sendall(b"".join(frames))

    def until(self, done) -> list[tuple[int, int, int, bytes]]:
        """Every frame read so far, once one satisfies done(kind, flags, stream, payload)."""
        while True:
            frames, pos, data = [], 0, self.data
            while len(data) - pos >= 9 and len(data) - pos - 9 >= int.from_bytes(data[pos : pos + 3], "big"):
                n = int.from_bytes(data[pos : pos + 3], "big")
                frames.append((data[pos + 3], data[pos + 4], int.from_bytes(data[pos + 5 : pos + 9], "big"), data[pos + 9 : pos + 9 + n]))
                pos += 9 + n
            if any(done(*f) for f in frames):
                return frames
            got = self.sock.recv(65536)
            assert got, f"the server closed the connection: {frames}"
            self.data += got

    def barrier(self) -> list:
        """Every frame the server sent before it took a PING sent now (it takes frames in order)."""
        self.send(http2.frame(http2.PING, 0, 0, b"12345678"))
        return self.until(lambda kind, flags, sid, p: kind == http2.PING and flags & http2.ACK)

    def close(self) -> None:
        self.sock.close()


def _ended(kind, flags, sid, payload) -> bool:
    return flags & http2.END_STREAM and sid == 1 and kind in (http2.DATA, http2.HEADERS)


@pytest.mark.parametrize("port", ["grpc", "http"])
@pytest.mark.parametrize("how", ["head", "body", "no window"])
def test_an_http2_request_that_is_not_a_grpc_call_is_told_what_to_use(node, port, how):
    """curl over TLS offers h2 and sends etcd's JSON gateway calls over it: 415, with a
    body that says to use HTTP/1.1 (it was an empty 415; then it named the --http port, which
    hands HTTP/2 to the gRPC server too, so there it named itself). A request with a body is
    answered once the body has come: answered while it still sent, curl stopped sending on
    the error and waited for its timeout (a newcomer's run: 3 times in 6, and 3 in 40 here).
    The answer is given once, also when it waits for the client's window."""
    peer = _Peer(getattr(node, port)["n1"], struct.pack(">HI", 4, 0) if how == "no window" else b"")  # INITIAL_WINDOW_SIZE 0
    block = b"\x83\x86" + hpack.literal(":path", "/v3/kv/range") + hpack.literal("content-type", "application/json")
    peer.send(http2.frame(http2.HEADERS, http2.END_HEADERS | (http2.END_STREAM if how != "body" else 0), 1, block))
    if how == "body":
        assert not [f for f in peer.barrier() if f[2] == 1]  # the head alone is not answered
        peer.send(http2.frame(http2.DATA, 0, 1, b'{"key": "Zm9v",') + http2.frame(http2.DATA, http2.END_STREAM, 1, b' "limit": 1}'))
    if how == "no window":
        peer.barrier()
        peer.send(http2.frame(http2.WINDOW_UPDATE, 0, 1, struct.pack(">I", 1 << 16)))
    frames = peer.until(_ended)
    frames = peer.barrier()
    peer.close()
    heads = [p for kind, _, sid, p in frames if kind == http2.HEADERS and sid == 1]
    (answer,) = [p for kind, _, sid, p in frames if kind == http2.DATA and sid == 1]
    assert (":status", "415") in hpack.Decoder().decode(heads[0]) and b"--http1.1" in answer and b"gRPC calls only" in answer
    assert len(heads) == 2  # the answer's head and its (empty) trailers: one answer
    assert not [f for f in frames if f[0] in (http2.RST_STREAM, http2.GOAWAY)], frames  # the stream ended as streams do
    _serves(node)


@pytest.mark.parametrize("still_sending", [True, False])
def test_a_grpc_call_answered_before_its_request_ended_tells_the_client_to_stop_sending(node, still_sending):
    """An unknown method is answered at once; a client still sending its request is told
    it need not (RST_STREAM NO_ERROR, RFC 9113 8.1), one that had ended it is not."""
    peer = _Peer(node.grpc["n1"])
    block = b"\x83\x86" + hpack.literal(":path", "/etcdserverpb.KV/Nope") + hpack.literal("content-type", "application/grpc") + hpack.literal("te", "trailers")
    peer.send(http2.frame(http2.HEADERS, http2.END_HEADERS | (0 if still_sending else http2.END_STREAM), 1, block))
    peer.until(_ended)
    frames = peer.barrier()
    peer.close()
    (trailers,) = [p for kind, _, sid, p in frames if kind == http2.HEADERS and sid == 1]
    assert ("grpc-status", "12") in hpack.Decoder().decode(trailers)
    resets = [struct.unpack(">I", p)[0] for kind, _, sid, p in frames if kind == http2.RST_STREAM and sid == 1]
    assert resets == ([http2.NO_ERROR] if still_sending else [])


def test_more_streams_than_allowed_are_refused_and_the_rest_answered(node):
    """Streams opened past MAX_STREAMS (their requests never ended) get REFUSED_STREAM."""
    s = _connect(node)
    block = b"\x83\x86" + hpack.literal(":path", "/etcdserverpb.Watch/Watch") + hpack.literal("content-type", "application/grpc")
    frames = [http2.PREFACE, http2.frame(http2.SETTINGS, 0, 0)]
    n = http2.MAX_STREAMS + 5
    frames += [http2.frame(http2.HEADERS, http2.END_HEADERS, 2 * i + 1, block) for i in range(n)]
    s.sendall(b"".join(frames))
    s.settimeout(5)
    data = b""
    deadline = time.monotonic() + 10
    refused = 0
    while time.monotonic() < deadline and refused < 5:
        try:
            data += s.recv(65536)
        except socket.timeout:
            break
        refused, pos = 0, 0
        while len(data) - pos >= 9:
            length = int.from_bytes(data[pos : pos + 3], "big")
            if data[pos + 3] == http2.RST_STREAM and len(data) - pos >= 13 and struct.unpack(">I", data[pos + 9 : pos + 13])[0] == http2.REFUSED_STREAM:
                refused += 1
            pos += 9 + length
    assert refused == 5
    s.close()
    _serves(node)


def _range_request(stream_id: int, key: bytes) -> bytes:
    block = b"\x83\x86" + hpack.literal(":path", "/etcdserverpb.KV/Range") + hpack.literal("content-type", "application/grpc")
    body = rpc_pb2.RangeRequest(key=key, serializable=True).SerializeToString()
    return http2.frame(http2.HEADERS, http2.END_HEADERS, stream_id, block) + http2.frame(http2.DATA, http2.END_STREAM, stream_id, struct.pack(">BI", 0, len(body)) + body)


def test_a_client_that_does_not_read_its_answers_pins_bounded_memory(node):
    """It grants itself all the window there is, asks for a 900 kB value 200 times (180 MB
    of answers) and reads none: the node stops reading its requests once its answers pile
    up, refuses large answers while --http-unread-bytes are held, and serves on."""
    from kv.bench.harness import rss_mb

    with grpc.insecure_channel(node.grpc["n1"]) as ch:
        rpc_pb2_grpc.KVStub(ch).Put(rpc_pb2.PutRequest(key=b"h2/large", value=b"L" * 900_000), timeout=10)
    pid = node.procs["n1"].pid
    before = rss_mb(pid)
    s = _connect(node)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    grant = struct.pack(">HI", http2.S_INITIAL_WINDOW_SIZE, 0x7FFFFFFF)
    s.sendall(http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0, grant) + http2.frame(http2.WINDOW_UPDATE, 0, 0, struct.pack(">I", 0x7FFFFFFF - 65535)))
    s.setblocking(False)
    sent = 0
    for batch in range(20):
        data = b"".join(_range_request(2 * (batch * 10 + i) + 1, b"h2/large") for i in range(10))
        try:
            sent += s.send(data)  # (the node stops reading: this side's send buffer fills, and the rest is dropped)
        except BlockingIOError:
            break
        time.sleep(0.1)
    time.sleep(2)
    grown = rss_mb(pid) - before
    assert sent > 0 and grown < (UNREAD_LIMIT >> 20) + 40, f"the node grew {grown:.0f} MB for a client that reads nothing"
    _serves(node)
    s.close()
    deadline = time.monotonic() + 20
    while True:  # once that client is gone, large answers go out again
        with grpc.insecure_channel(node.grpc["n1"]) as ch:
            try:
                assert len(rpc_pb2_grpc.KVStub(ch).Range(rpc_pb2.RangeRequest(key=b"h2/large"), timeout=10).kvs[0].value) == 900_000
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline, e
                time.sleep(0.5)


class _Sender:
    """A raw HTTP/2 client that sends as fast as the node's flow control lets it, and
    reads nothing but the node's window updates and settings (its own windows stay shut)."""

    def __init__(self, node) -> None:
        self.s = _connect(node)
        self.s.sendall(http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0, b""))
        self.conn_window, self.stream_window, self.initial = 65535, {}, 65535
        self.answers: dict[int, int] = {}  # stream -> gRPC messages received on it (within the node's first window)
        self._data: dict[int, bytes] = {}
        self.cv = threading.Condition()
        self.closed = False
        threading.Thread(target=self._read, daemon=True).start()

    def close(self) -> None:
        """Hang up. (A bare close() while the reading thread waits in recv() on the socket
        leaves the connection open until that recv returns: the node saw the client hang up
        only at its next keepalive ping.)"""
        with contextlib.suppress(OSError):
            self.s.shutdown(socket.SHUT_RDWR)
        self.s.close()

    def _read(self) -> None:
        buf = b""
        try:
            while got := self.s.recv(65536):
                buf += got
                while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                    n, kind, flags, sid = int.from_bytes(buf[:3], "big"), buf[3], buf[4], int.from_bytes(buf[5:9], "big")
                    payload, buf = buf[9 : 9 + n], buf[9 + n :]
                    with self.cv:
                        if kind == http2.DATA:
                            data = self._data.get(sid, b"") + payload
                            while len(data) >= 5 and len(data) >= 5 + int.from_bytes(data[1:5], "big"):
                                data = data[5 + int.from_bytes(data[1:5], "big") :]
                                self.answers[sid] = self.answers.get(sid, 0) + 1
                            self._data[sid] = data
                        elif kind == http2.WINDOW_UPDATE:
                            grant = int.from_bytes(payload, "big")
                            if sid == 0:
                                self.conn_window += grant
                            else:
                                self.stream_window[sid] = self.stream_window.get(sid, self.initial) + grant
                        elif kind == http2.SETTINGS and not flags & http2.ACK:
                            for i in range(0, len(payload), 6):
                                key, value = struct.unpack(">HI", payload[i : i + 6])
                                if key == http2.S_INITIAL_WINDOW_SIZE:
                                    for k in self.stream_window:
                                        self.stream_window[k] += value - self.initial
                                    self.initial = value
                            self.s.sendall(http2.frame(http2.SETTINGS, http2.ACK, 0))
                        self.cv.notify_all()
        except OSError:
            pass
        with self.cv:
            self.closed = True
            self.cv.notify_all()

    def call(self, sid: int, path: str) -> None:
        block = b"\x83\x86" + hpack.literal(":path", path) + hpack.literal("content-type", "application/grpc")
        with self.cv:
            self.stream_window.setdefault(sid, self.initial)
        self.s.sendall(http2.frame(http2.HEADERS, http2.END_HEADERS, sid, block))

    def send(self, sid: int, data: bytes, stall_s: float) -> bool:
        """False once the node gives no room for stall_s seconds (or closed the connection)."""
        while data:
            with self.cv:
                if not self.cv.wait_for(lambda: self.closed or min(self.conn_window, self.stream_window[sid]) > 0, stall_s) or self.closed:
                    return False
                n = min(16384, self.conn_window, self.stream_window[sid], len(data))
                self.conn_window -= n
                self.stream_window[sid] -= n
            self.s.sendall(http2.frame(http2.DATA, 0, sid, data[:n]))
            data = data[n:]
        return True


# -- the framing in process, against seeded random input --------------------------------------


def test_a_call_past_its_grpc_timeout_is_ended_by_the_server_with_deadline_exceeded():
    """grpc-timeout is the server's to keep too (a client that does not cancel still gets
    its answer): a handler still running at the deadline is cancelled and the call ends
    with DEADLINE_EXCEEDED, within the deadlines' 10 ms buckets of it."""
    import asyncio

    from kv.v3api.rpc import Method, RpcServer

    cancelled = []

    async def slow(request, context):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main() -> tuple[list[tuple[str, str]], float]:
        server = await RpcServer({"/etcdserverpb.KV/Range": Method(slow, rpc_pb2.RangeRequest, False, False)}).start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.server.sockets[0].getsockname()[1])
            block = b"\x83\x86" + hpack.literal(":path", "/etcdserverpb.KV/Range") + hpack.literal("content-type", "application/grpc")
            body = rpc_pb2.RangeRequest(key=b"k").SerializeToString()
            writer.write(
                http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0) + http2.frame(http2.HEADERS, http2.END_HEADERS, 1, block + hpack.literal("grpc-timeout", "300m"))
                + http2.frame(http2.DATA, http2.END_STREAM, 1, struct.pack(">BI", 0, len(body)) + body)
            )
            sent, decoder = time.monotonic(), hpack.Decoder()
            while True:
                head = await asyncio.wait_for(reader.readexactly(9), 10)
                payload = await reader.readexactly(int.from_bytes(head[:3], "big"))
                if head[3] == http2.HEADERS and int.from_bytes(head[5:9], "big") == 1:
                    fields = decoder.decode(payload)
                    if head[4] & http2.END_STREAM:
                        writer.close()
                        return fields, time.monotonic() - sent
        finally:
            await server.stop(1)

    fields, took = asyncio.run(main())
    assert ("grpc-status", str(grpc.StatusCode.DEADLINE_EXCEEDED.value[0])) in fields, fields
    assert 0.3 <= took < 3 and cancelled == [True]


def test_a_call_whose_task_is_cancelled_before_it_runs_is_answered_and_its_cleanup_runs():
    """A call an AtOnce hands to a task of its own (rpc.RpcServer.run), whose deadline ends
    it in the same turn of the loop: the task never runs a step (the servicer's code, which
    answers and cleans up, never starts), yet the client gets DEADLINE_EXCEEDED and the
    task's done callbacks (PutsAtOnce frees the write's session there) run."""
    import asyncio

    from kv.v3api.rpc import Method, RpcServer

    started, cleaned, server = [], [], None

    async def answer():
        started.append(True)
        return rpc_pb2.RangeResponse()

    class HandedOver:
        def take(self, call, request) -> bool:
            server.run(call, answer)
            call.task.add_done_callback(lambda _: cleaned.append(True))
            server.expire(call)  # (its grpc-timeout, in the same turn)
            return True

    async def handler(request, context):
        raise AssertionError("not called")

    async def main() -> list[tuple[str, str]]:
        nonlocal server
        server = await RpcServer({"/etcdserverpb.KV/Range": Method(handler, rpc_pb2.RangeRequest, False, False, None, HandedOver())}).start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.server.sockets[0].getsockname()[1])
            block = b"\x83\x86" + hpack.literal(":path", "/etcdserverpb.KV/Range") + hpack.literal("content-type", "application/grpc")
            body = rpc_pb2.RangeRequest(key=b"k").SerializeToString()
            writer.write(
                http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0) + http2.frame(http2.HEADERS, http2.END_HEADERS, 1, block)
                + http2.frame(http2.DATA, http2.END_STREAM, 1, struct.pack(">BI", 0, len(body)) + body)
            )
            decoder = hpack.Decoder()
            while True:
                head = await asyncio.wait_for(reader.readexactly(9), 5)
                payload = await reader.readexactly(int.from_bytes(head[:3], "big"))
                if head[3] == http2.HEADERS and int.from_bytes(head[5:9], "big") == 1 and head[4] & http2.END_STREAM:
                    writer.close()
                    return decoder.decode(payload)
        finally:
            await server.stop(1)

    fields = asyncio.run(main())
    assert ("grpc-status", str(grpc.StatusCode.DEADLINE_EXCEEDED.value[0])) in fields, fields
    assert started == [] and cleaned == [True]


def test_requests_answered_after_a_shared_barrier_share_it_and_one_that_comes_later_waits_for_the_next():
    """rpc.AfterBarrier (how etcd's gets are served): the requests that arrive in one turn
    share one barrier; one that arrives while it is being waited for is not answered from
    it (a read must not take a read index from before it arrived) but from the next; one
    past its grpc-timeout ends with DEADLINE_EXCEEDED without holding up the others; a
    failed barrier ends each of its requests with the failure's status; a request the
    AfterBarrier declines goes to the method's handler."""
    import asyncio

    from kv.v3api.rpc import Method, RpcServer

    class Quick:
        def __init__(self) -> None:
            self.asked: list[asyncio.Future] = []

        def barrier_for(self, request, context):
            return None if request.key == b"handler" else "linearizable"

        async def barrier(self, kind: str) -> int:
            self.asked.append(asyncio.get_running_loop().create_future())
            return await self.asked[-1]

        def answer(self, request, state: int):
            return rpc_pb2.RangeResponse(count=state)

        def status(self, e: Exception):
            return grpc.StatusCode.UNAVAILABLE, f"no barrier: {e}"

    async def handler(request, context):
        return rpc_pb2.RangeResponse(count=-1)

    quick = Quick()
    block = b"\x83\x86" + hpack.literal(":path", "/etcdserverpb.KV/Range") + hpack.literal("content-type", "application/grpc")

    def call(sid: int, key: bytes, timeout: str | None = None) -> bytes:
        body = rpc_pb2.RangeRequest(key=key).SerializeToString()
        head = block + (hpack.literal("grpc-timeout", timeout) if timeout else b"")
        return http2.frame(http2.HEADERS, http2.END_HEADERS, sid, head) + http2.frame(http2.DATA, http2.END_STREAM, sid, struct.pack(">BI", 0, len(body)) + body)

    async def main() -> dict[int, tuple[int | None, str]]:
        method = Method(handler, rpc_pb2.RangeRequest, False, False, quick)
        server = await RpcServer({"/etcdserverpb.KV/Range": method}).start("127.0.0.1", 0)
        answers: dict[int, tuple[int | None, str]] = {}
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.server.sockets[0].getsockname()[1])
            decoder, counts = hpack.Decoder(), {}

            async def until(n: int) -> None:
                while len(answers) < n:
                    head = await asyncio.wait_for(reader.readexactly(9), 10)
                    payload = await reader.readexactly(int.from_bytes(head[:3], "big"))
                    sid = int.from_bytes(head[5:9], "big")
                    if head[3] == http2.DATA:
                        counts[sid] = rpc_pb2.RangeResponse.FromString(payload[5:]).count
                    elif head[3] == http2.HEADERS:
                        fields = dict(decoder.decode(payload))
                        if head[4] & http2.END_STREAM:
                            answers[sid] = (counts.get(sid), fields["grpc-status"])

            writer.write(http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0) + call(1, b"a") + call(3, b"b") + call(5, b"c", "100m") + call(7, b"handler"))
            await until(1)  # the handler's (it waits for no barrier)
            assert answers == {7: (-1, "0")} and len(quick.asked) == 1  # one barrier for the three
            writer.write(call(9, b"late"))
            while len(quick.asked) < 2:
                await asyncio.sleep(0.01)
            await until(2)  # 5's timeout
            quick.asked[0].set_result(1)
            await until(4)
            assert 9 not in answers  # not answered from the first barrier
            quick.asked[1].set_result(2)
            await until(5)
            writer.write(call(11, b"x") + call(13, b"y"))
            while len(quick.asked) < 3:
                await asyncio.sleep(0.01)
            quick.asked[2].set_exception(RuntimeError("lost"))
            await until(7)
            writer.close()
        finally:
            await server.stop(1)
        return answers

    answers = asyncio.run(main())
    ok, late, unavailable = "0", str(grpc.StatusCode.DEADLINE_EXCEEDED.value[0]), str(grpc.StatusCode.UNAVAILABLE.value[0])
    assert answers == {7: (-1, ok), 5: (None, late), 1: (1, ok), 3: (1, ok), 9: (2, ok), 11: (None, unavailable), 13: (None, unavailable)}, answers


class _Transport:
    """What a Connection uses of its asyncio transport."""

    def __init__(self) -> None:
        self.out, self.closed = bytearray(), False

    def write(self, data: bytes) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True

    abort = close

    def is_closing(self) -> bool:
        return self.closed

    def set_write_buffer_limits(self, high: int) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str):
        return ("fuzz", 0)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _echo(request, context):
    return rpc_pb2.RangeResponse(count=len(request.key))


SEEDS = int(os.environ.get("KV_FUZZ_SEEDS", "2000"))


def test_random_frames_never_break_the_server_only_the_connection():
    """2,000 seeded connections of random frames (random types, flags, stream ids and
    payloads, HPACK blocks of random representations) after a valid preface: each ends in
    a GOAWAY or goes on; no exception escapes the protocol (asyncio would log it and drop
    the connection without a word), and well-formed calls on a clean connection still work."""
    import asyncio
    import random

    from kv.v3api.rpc import Method, RpcServer

    methods = {"/etcdserverpb.KV/Range": Method(_echo, rpc_pb2.RangeRequest, False, False)}

    def random_block(rng: random.Random) -> bytes:
        parts = []
        for _ in range(rng.randrange(6)):
            kind = rng.randrange(5)
            if kind == 0:
                parts.append(bytes([0x80 | rng.randrange(128)]))
            elif kind == 1:
                name = bytes(rng.randrange(256) for _ in range(rng.randrange(4)))
                parts.append(b"\x40" + bytes([len(name)]) + name + b"\x01" + bytes([rng.randrange(256)]))
            elif kind == 2:
                parts.append(hpack.literal(rng.choice([":path", "content-type", "", "grpc-timeout", "te"]), rng.choice(["/etcdserverpb.KV/Range", "application/grpc", "1S", "", "x" * 5])))
            else:
                parts.append(bytes(rng.randrange(256) for _ in range(rng.randrange(8))))
        return b"".join(parts)

    async def main() -> int:
        closed = 0
        for seed in range(SEEDS):
            rng = random.Random(seed)
            server = RpcServer(methods)
            conn = http2.Connection(server, server.connections)
            t = _Transport()
            conn.connection_made(t)
            data = bytearray(http2.PREFACE)
            for _ in range(rng.randrange(1, 8)):
                kind = rng.choice([http2.DATA, http2.HEADERS, http2.HEADERS, http2.SETTINGS, http2.WINDOW_UPDATE, http2.PING, http2.RST_STREAM, http2.GOAWAY, http2.CONTINUATION, 12])
                payload = random_block(rng) if kind in (http2.HEADERS, http2.CONTINUATION) else bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 4, 5, 6, 8, 13])))
                data += http2.frame(kind, rng.randrange(256), rng.choice([0, 1, 2, 3, 5, 0x7FFFFFFF]), payload)
            cut = rng.randrange(len(data) + 1)
            conn.data_received(bytes(data[:cut]))  # (in two reads, cut anywhere)
            conn.data_received(bytes(data[cut:]))
            await asyncio.sleep(0)  # calls started, answers flushed
            for task in list(server.tasks):
                await task
            closed += t.closed
            conn.connection_lost(None)
        # and a clean call still gets its answer
        server = RpcServer(methods)
        conn, t = http2.Connection(server, server.connections), _Transport()
        conn.connection_made(t)
        conn.data_received(http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0) + _range_request(1, b"abc"))
        for task in list(server.tasks):
            await task
        await asyncio.sleep(0)
        assert b"grpc-status" in bytes(t.out) and rpc_pb2.RangeResponse(count=3).SerializeToString() in bytes(t.out)
        return closed

    closed = asyncio.run(main())
    assert 100 < closed < SEEDS  # most random input is refused, some is harmless


def test_an_answered_call_and_its_stream_are_freed_without_the_garbage_collector():
    """A finished stream lets go of its call (they pointed at each other): every answered
    put's stream, call, request and context had waited for a collection, tens of thousands
    on a busy leader, and each young-generation collection walked them (20-120 ms pauses of
    the event loop, a put's p999 over 100 ms)."""
    import asyncio
    import gc

    from kv.v3api import rpc

    async def handler(request, context):
        return rpc_pb2.RangeResponse(count=1)

    async def main() -> tuple[int, int]:
        server = await rpc.RpcServer({"/etcdserverpb.KV/Range": rpc.Method(handler, rpc_pb2.RangeRequest, False, False)}).start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.server.sockets[0].getsockname()[1])
            block = b"\x83\x86" + hpack.literal(":path", "/etcdserverpb.KV/Range") + hpack.literal("content-type", "application/grpc")
            body = rpc_pb2.RangeRequest(key=b"k").SerializeToString()
            calls = range(1, 41, 2)
            writer.write(http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0) + b"".join(
                http2.frame(http2.HEADERS, http2.END_HEADERS, sid, block) + http2.frame(http2.DATA, http2.END_STREAM, sid, struct.pack(">BI", 0, len(body)) + body)
                for sid in calls
            ))
            ended = set()
            while len(ended) < len(calls):
                head = await asyncio.wait_for(reader.readexactly(9), 10)
                await reader.readexactly(int.from_bytes(head[:3], "big"))
                if head[3] == http2.HEADERS and head[4] & http2.END_STREAM:
                    ended.add(int.from_bytes(head[5:9], "big"))
            await asyncio.sleep(0.05)  # (the answers' tasks finish)
            alive = sum(1 for o in gc.get_objects() if type(o) in (rpc.Call, http2.Stream))
            writer.close()
            return len(ended), alive
        finally:
            await server.stop(1)

    gc.collect()
    gc.disable()
    try:
        answered, alive = asyncio.run(main())
    finally:
        gc.enable()
    assert answered == 20 and alive == 0, alive


@pytest.mark.parametrize("how", ["reset", "disconnect"])
def test_a_call_its_client_resets_or_drops_is_cancelled(how):
    """A stream the client resets (RST_STREAM), or whose connection it closes, cancels the
    call's handler: a watch or lease keep-alive must not run on for a client that is gone.
    (Found by review: the stream let go of its call before the reset could reach it.)"""
    import asyncio

    from kv.v3api import rpc

    started, cancelled = asyncio.Event(), []

    async def handler(requests, context):
        started.set()
        try:
            async for _ in requests:
                pass
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        yield rpc_pb2.WatchResponse()

    async def main() -> int:
        server = await rpc.RpcServer({"/etcdserverpb.Watch/Watch": rpc.Method(handler, rpc_pb2.WatchRequest, True, True)}).start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.server.sockets[0].getsockname()[1])
            block = b"\x83\x86" + hpack.literal(":path", "/etcdserverpb.Watch/Watch") + hpack.literal("content-type", "application/grpc")
            writer.write(http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0) + http2.frame(http2.HEADERS, http2.END_HEADERS, 1, block))
            await asyncio.wait_for(started.wait(), 10)
            if how == "reset":
                writer.write(http2.frame(http2.RST_STREAM, 0, 1, struct.pack(">I", 8)))  # CANCEL
            else:
                writer.close()
            for _ in range(200):
                if cancelled:
                    break
                await asyncio.sleep(0.01)
            return len(server.tasks)
        finally:
            await server.stop(1)

    left = asyncio.run(main())
    assert cancelled == [True] and left == 0
