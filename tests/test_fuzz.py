"""Bad input, at random: every malformed HTTP request gets a clear error (or a closed
connection when it is not HTTP at all); every bad peer frame closes its connection; no node
crashes and no data changes."""

from __future__ import annotations

import json
import os
import random
import socket
import time

import pytest
from cluster import ProcCluster

from kv.raft import codec
from kv.raft.messages import HeartbeatRequest, PushRequest, PushType, VoteRequest
from kv.statemachine import rows
from kv.raft.transport import auth_frame, hello_frame

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = ProcCluster(str(tmp_path_factory.mktemp("fuzz")), extra=["--max-value-bytes", "4096"])
    c.start()
    lead = c.leader()
    for i in range(20):
        assert c.put(lead, f"seed/{i}", b"%d" % i)[0] == 200
    c.wait_converged()
    yield c
    c.close()


def raw_http(addr: str, data: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes; return the first response (or b"" if the server hung up)."""
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        out = b""
        while True:
            head, sep, body = out.partition(b"\r\n\r\n")
            if sep:
                length = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
                if length and len(body) >= length[0]:
                    return out
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                return out
            if not chunk:
                return out
            out += chunk


def bad_request(rng: random.Random) -> tuple[bytes, set[int]]:
    """A request that is wrong in at least one way, and the statuses it may get."""
    key = "".join(rng.choice("abc/%-_~é") for _ in range(rng.randrange(1, 12)))
    kind = rng.randrange(12)
    if kind == 0:  # a broken percent-escape
        path = f"/v1/kv/{key}%{rng.choice(['', 'G', 'Z9', '%'])}"
        return f"PUT {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx".encode(), {400}
    if kind == 1:  # a key in ledgerkv's reserved space (a NUL first)
        return b"PUT /v1/kv/%00a HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx", {400}
    if kind == 2:  # a value over --max-value-bytes
        n = rng.randrange(4097, 100_000)
        return f"PUT /v1/kv/big HTTP/1.1\r\nHost: x\r\nContent-Length: {n}\r\n\r\n".encode() + b"x" * min(n, 5000), {413}
    if kind == 3:  # garbage as a transaction
        body = rng.choice([b"{", b"[]", b'{"compare": 3}', b'{"success": [{"op": "put"}]}', b'{"success": [{"op": "put", "key": "k"}]}',
                           b'{"compare": [{"key": "a", "mod_index": "x"}]}', os.urandom(40), b'{"x": 1}'])
        return b"POST /v1/txn HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body), {400}
    if kind == 4:  # a method the route does not take
        method = rng.choice(["POST", "PATCH", "OPTIONS", "TRACE"])
        return f"{method} /v1/kv/{key.replace('%', 'p')} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode(), {405, 400}
    if kind == 5:  # no such route (/v2/: etcd's v2 API, not served, answered with a v2 error body)
        return f"GET /{rng.choice(['v2', 'v9'])}/{key.replace('%', 'p')} HTTP/1.1\r\nHost: x\r\n\r\n".encode(), {404, 400}
    if kind == 6:  # a conditional header that is not a version
        return b"PUT /v1/kv/seed/1 HTTP/1.1\r\nHost: x\r\nIf-Match: %s\r\nContent-Length: 1\r\n\r\nz" % rng.choice([b"abc", b'"-1"', b'"1x"', b"W/zz"]), {400}
    if kind == 7:  # If-None-Match other than *
        return b"PUT /v1/kv/seed/1 HTTP/1.1\r\nHost: x\r\nIf-None-Match: \"3\"\r\nContent-Length: 1\r\n\r\nz", {400}
    if kind == 8:  # bad query parameters
        q = rng.choice(["limit=0", "limit=-5", "limit=abc", "limit=99999999", "consistency=maybe"])
        return f"GET /v1/kv?{q} HTTP/1.1\r\nHost: x\r\n\r\n".encode(), {400}
    if kind == 9:  # a key too long
        return b"PUT /v1/kv/" + b"k" * 5000 + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx", {400}
    if kind == 10:  # a bulk put that breaks its format: garbage, cut short, out of order, reserved
        good = rows.pack([(b"a", b"1", 0), (b"b", b"2", rows.ANY)])
        body = rng.choice([os.urandom(rng.randrange(0, 60)), good[: rng.randrange(len(good))], good + b"x",
                           good.replace(b"ab12", b"ba12"), rows.pack([(b"\x00x", b"1", 0)]), rows.pack([(b"a", b"1", 1 << 63)])])
        return b"POST /v1/bulk HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body), {400}
    return os.urandom(rng.randrange(1, 200)) + b"\r\n\r\n", {400, 0}  # not HTTP: 400 or hang up


def test_http_fuzz(cluster):
    rng = random.Random(11)
    before = {i: cluster.dump(i) for i in cluster.ids}
    for n in range(600):
        node = cluster.ids[n % 3]
        req, allowed = bad_request(rng)
        out = raw_http(cluster.http[node], req)
        status = int(out[9:12]) if out[:7] in (b"HTTP/1.1", b"HTTP/1.0"[:7]) else 0
        head, _, body = out.partition(b"\r\n\r\n")
        if b"Content-Type: application/json" in head:
            assert status in allowed, (req[:120], out[:300])
            doc = json.loads(body)
            if req.startswith(b"GET /v2/") and status == 404:  # etcd's v2 error: {errorCode, message, cause, index}
                assert doc["errorCode"] == 404 and "ETCDCTL_API=3" in doc["message"], doc
                continue
            err = doc["error"]
            assert err["code"] and err["message"]
        else:
            # Not valid HTTP: aiohttp's parser answers 400 in plain text, or hangs up.
            assert status in (0, 400), (req[:120], out[:300])
    for i in cluster.ids:
        assert cluster.alive(i) and cluster.request(i, "GET", "/healthz")[0] == 200
    cluster.wait_converged()
    assert {i: cluster.dump(i) for i in cluster.ids} == before


def peer_connection(addr: str):
    host, port = addr.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def closed_by_peer(s: socket.socket, timeout: float = 7.0) -> bool:
    s.settimeout(timeout)
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def hello(group: str, src: str, dst: str) -> bytes:
    return hello_frame(group.encode(), src.encode(), dst.encode(), b"", os.urandom(16))


def handshake_as(addr: str, src: str, dst: str) -> socket.socket:
    """Authenticate as member `src` (the cluster has no secret), ready to send frames."""
    s = peer_connection(addr)
    s.sendall(hello("default", src, dst))
    s.recv(4096)  # WELCOME
    s.sendall(auth_frame(b""))  # an empty proof
    return s


def test_peer_port_fuzz(cluster):
    rng = random.Random(12)
    lead = cluster.leader()
    term = cluster.status(lead)["term"]
    target = next(i for i in cluster.ids if i != lead)
    addr = cluster.listen[target]
    before = cluster.dump(target)
    cases = 0
    for _ in range(40):  # random bytes
        s = peer_connection(addr)
        s.sendall(os.urandom(rng.randrange(1, 400)))
        assert closed_by_peer(s)
        cases += 1
    for group, src in (("other", lead), ("default", target)):  # another group; a peer claiming to be us
        s = peer_connection(addr)
        s.sendall(hello(group, src, target))
        assert closed_by_peer(s, timeout=2.0), (group, src)
        cases += 1
    # An id no configuration ever held completes the handshake (only removed members are
    # refused there), but its stale messages are refused by the core and change nothing.
    for f in (
        codec.encode(VoteRequest("mallory", target, term, 0, 0)),
        codec.encode(HeartbeatRequest("mallory", target, term, 10**9, 0)),
        codec.encode(PushRequest("mallory", target, term, PushType.TRUNCATE, 1, 0, 0, [], 10**9, 0)),
    ):
        s = handshake_as(addr, "mallory", target)
        s.sendall(f)
        time.sleep(0.2)  # time for the node to read it before the link closes
        s.close()
        cases += 1
    frames = [
        codec.encode(VoteRequest(lead, target, 1, 0, 0)),  # stale term
        codec.encode(HeartbeatRequest(lead, target, max(term - 1, 0), 10**9, 0)),
        codec.encode(PushRequest(lead, target, max(term - 1, 0), PushType.TRUNCATE, 1, 0, 0, [], 0, 0)),
    ]
    for f in frames:  # valid frames from a member, but stale: answered and ignored
        s = handshake_as(addr, lead, target)
        s.sendall(f)
        time.sleep(0.2)  # time for the node to read it before the link closes
        s.close()
        cases += 1
    for f in frames:  # the same messages cut short inside a well-formed frame: closed
        ftype, body = f[4], f[5:]
        cut = body[: rng.randrange(1, len(body) - 1)]
        s = handshake_as(addr, lead, target)
        s.sendall(codec.FRAME_HEADER.pack(len(cut) + 1, ftype) + cut)
        assert closed_by_peer(s)
        cases += 1
    for f in frames:  # a stream that ends inside a frame: the node just drops the link
        s = handshake_as(addr, lead, target)
        s.sendall(f[: rng.randrange(5, len(f))])
        s.shutdown(socket.SHUT_WR)
        assert closed_by_peer(s)
        cases += 1
    s = handshake_as(addr, lead, target)  # a frame claiming another sender
    s.sendall(codec.encode(HeartbeatRequest("n9", target, term, 0, 0)))
    assert closed_by_peer(s)
    assert cases > 40
    time.sleep(0.5)  # time for a node the frames hurt to die
    for i in cluster.ids:
        assert cluster.alive(i)
    assert cluster.leader() == lead and cluster.status(lead)["term"] == term  # no election was caused
    cluster.wait_converged()
    assert cluster.dump(target) == before
