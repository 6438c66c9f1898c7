"""Adversarial network tests against real `kv serve` processes: strangers on the peer port,
connection floods and garbage on the HTTP port, running out of descriptors, token roles
and TLS. Every test ends by checking that every node is alive and every earlier write is
still there, on every node."""

from __future__ import annotations

import base64
import json
import os
import resource
import signal
import socket
import ssl
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request

import orjson
import pytest
from cluster import ProcCluster, wait_until
from pki import make_pki
from kv.bench.harness import free_port

import kv
from kv.raft.transport import HELLO, hello_frame

pytestmark = pytest.mark.slow

SECRET = "adversarial-cluster-secret"
TOKEN = "adversarial-admin-token"
IDLE_TIMEOUT_S = 5
MAX_HTTP = 300


class AuthedCluster(ProcCluster):
    """A ProcCluster whose helper requests carry the admin token."""

    token = TOKEN

    def request(self, i, method, path, body=None, headers=None, timeout=5.0):
        headers = {"Authorization": f"Bearer {self.token}", **(headers or {})}
        return super().request(i, method, path, body, headers, timeout)


def proc_status(pid: int, field: str) -> int:
    """A field of /proc/PID/status in kB (VmRSS: now; VmHWM: the peak so far)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def peak_mb(c: ProcCluster, i: str) -> int:
    return proc_status(c.procs[i].pid, "VmHWM") // 1024


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def log_size(c: ProcCluster, i: str) -> int:
    return os.path.getsize(os.path.join(c.root, f"{i}.log"))


def seed(c: ProcCluster, prefix: str, n: int = 20) -> dict[str, bytes]:
    lead = c.leader()
    data = {f"{prefix}/{k}": b"value-%d" % k for k in range(n)}
    for key, value in data.items():
        code, body = c.put(lead, key, value)
        assert code == 200, body
    return data


def assert_intact(c: ProcCluster, *datasets: dict[str, bytes]) -> None:
    """Every node alive, the cluster converged, every seeded key on every node, and a new
    write still commits."""
    for i in c.ids:
        assert c.alive(i), f"{i} died:\n{c.log(i)[-3000:]}"
    assert c.put(c.leader(), "probe/after", b"ok")[0] == 200
    c.wait_converged()
    for i in c.ids:
        held = {k: base64.b64decode(v) for k, v, _ in c.dump(i)}
        for data in datasets:
            for key, value in data.items():
                assert held.get(key) == value, (i, key)


def closed_by_server(s: socket.socket) -> bool | None:
    """True if the server closed (or answered and closed) this idle socket, False if it is
    still open, without blocking."""
    s.setblocking(False)
    try:
        data = s.recv(65536)
    except BlockingIOError:
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True
    if not data:
        return True
    return data.startswith(b"HTTP/1.1 503") or None


def spray(addr: str, payloads: list[bytes], connections: int) -> None:
    """Open `connections` connections, one after another, each sending the next payload."""
    host, port = addr.rsplit(":", 1)
    for k in range(connections):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            try:
                s.sendall(payloads[k % len(payloads)])
                s.recv(1)
            except (ConnectionResetError, BrokenPipeError, socket.timeout):
                pass


def seeded_cluster(root, extra: list[str]):
    """A 3-node cluster with a cluster secret and an admin token, and 20 keys written."""
    c = AuthedCluster(str(root), extra=["--cluster-secret", SECRET, "--token", TOKEN, *extra])
    try:
        c.start()
        c.seeds = seed(c, "seed")
        yield c
    finally:
        c.close()


def stop_process(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    limits = ["--http-idle-timeout-s", str(IDLE_TIMEOUT_S), "--max-http-connections", str(MAX_HTTP)]
    yield from seeded_cluster(tmp_path_factory.mktemp("adversarial"), limits)


# -- the peer port ------------------------------------------------------------------------


def test_huge_hellos_from_strangers_cost_nothing(cluster):
    """16 strangers at a time announce a 64 MiB HELLO and stream it, 5 rounds: each is cut
    off at its length prefix; the node's peak RSS stays far below one such frame."""
    c = cluster
    target = c.leader()
    host, port = c.listen[target].rsplit(":", 1)
    chunk = os.urandom(1 << 20)
    for _round in range(5):
        socks = [socket.create_connection((host, int(port)), timeout=5) for _ in range(16)]
        sent = [0] * len(socks)
        for s in socks:
            s.sendall(struct.pack(">IB", 64 << 20, HELLO))
        for k, s in enumerate(socks):
            try:
                while sent[k] < 64 << 20:
                    s.sendall(chunk)
                    sent[k] += len(chunk)
            except (ConnectionResetError, BrokenPipeError, socket.timeout):
                pass
            s.close()
        # The node hung up long before 64 MiB: what got through fit in the socket buffers.
        assert max(sent) < 16 << 20, sent
    peak = peak_mb(c, target)
    print(f"huge HELLO x16 x5: peak RSS of {target} {peak} MB, sent before hang-up {max(sent) >> 20} MiB")
    assert peak < 200
    assert "peer connection" in c.log(target)
    metrics = c.request(target, "GET", "/metrics")[2].decode()
    assert "kv_peer_connections_rejected_total" in metrics
    assert_intact(c, c.seeds)


def test_a_flood_of_silent_strangers_does_not_lock_peers_out(cluster):
    """300 connections that never say anything to the leader's peer port: the oldest are
    evicted beyond the handshaking limit, and a restarted follower still gets back in."""
    c = cluster
    lead = c.leader()
    host, port = c.listen[lead].rsplit(":", 1)
    socks = [socket.create_connection((host, int(port)), timeout=5) for _ in range(300)]
    try:
        wait_until(lambda: sum(closed_by_server(s) is True for s in socks) >= 300 - 64, 10, "strangers evicted")
        follower = next(i for i in c.ids if i != lead)
        c.kill(follower)
        more = seed(c, "during-flood", 10)
        c.start(follower)
        assert_intact(c, c.seeds, more)
    finally:
        for s in socks:
            s.close()


def test_garbage_on_the_peer_port_keeps_the_log_small(cluster):
    c = cluster
    target = next(i for i in c.ids if i != c.leader())
    before = log_size(c, target)
    spray(c.listen[target], [b"\x00\x00\x0f\xff\x64" + os.urandom(4090) + os.urandom(60_000), os.urandom(50_000)], 200)
    grew = log_size(c, target) - before
    print(f"200 garbage peer connections: log grew {grew} bytes, peak RSS {peak_mb(c, target)} MB")
    assert grew < 20_000
    assert_intact(c, c.seeds)


# -- the HTTP port ------------------------------------------------------------------------


def test_idle_http_connections_are_capped_and_closed(cluster):
    """2,000 idle connections: at most --max-http-connections stay open (the others get 503
    and are closed), the node's descriptors stay bounded, the idle ones are closed after
    the idle timeout, and then the node answers again."""
    c = cluster
    target = next(i for i in c.ids if i != c.leader())
    pid = c.procs[target].pid
    host, port = c.http[target].rsplit(":", 1)
    before = log_size(c, target)
    socks = []
    try:
        t0 = time.monotonic()
        for _ in range(2000):
            socks.append(socket.create_connection((host, int(port)), timeout=5))
        # At the cap, a newcomer is told so (well within the idle timeout of the first ones).
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.settimeout(5)
            head = s.recv(4096)
        fds = open_fds(pid)
        opened_in = time.monotonic() - t0
        assert head.startswith(b"HTTP/1.1 503") and b"TOO_MANY_CONNECTIONS" in head and b"\r\nRetry-After: 1\r\n" in head, head
        states = [closed_by_server(s) for s in socks]
        still_open = states.count(False)
        print(f"2000 idle HTTP connections in {opened_in:.1f}s: {still_open} held open, {states.count(True)} refused; node fds {fds}, peak RSS {peak_mb(c, target)} MB")
        assert still_open <= MAX_HTTP
        assert states.count(True) >= 2000 - MAX_HTTP
        assert fds < MAX_HTTP + 200
        held = [s for s, st in zip(socks, states) if st is False]
        wait_until(lambda: all(closed_by_server(s) is not False for s in held), 10 * IDLE_TIMEOUT_S + 10, "idle connections closed")
    finally:
        for s in socks:
            s.close()
    code, _, _ = c.request(target, "GET", "/v1/kv/seed/1")
    assert code == 200
    metrics = c.request(target, "GET", "/metrics")[2].decode()
    refused = next(line for line in metrics.splitlines() if line.startswith("kv_http_connections_refused_total"))
    assert float(refused.split()[-1]) >= 2000 - MAX_HTTP
    assert log_size(c, target) - before < 10_000
    assert_intact(c, c.seeds)


def _trickle(s: socket.socket, byte: bytes) -> bytes | None:
    """Send one byte every 0.25 s (bounded) until the server answers or hangs up; returns
    what it answered (b"" for a hang-up), None if it never did."""
    for _ in range(10 * IDLE_TIMEOUT_S * 4):
        try:
            s.sendall(byte)
        except (BrokenPipeError, ConnectionResetError):
            return b""
        s.setblocking(False)
        try:
            data = s.recv(65536)
            return data
        except BlockingIOError:
            pass
        except ConnectionResetError:
            return b""
        s.setblocking(True)
        time.sleep(0.25)  # the trickle's pace
    return None


def test_slowly_sent_request_heads_and_bodies_are_cut_off(cluster):
    c = cluster
    target = c.ids[-1]
    host, port = c.http[target].rsplit(":", 1)
    auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n")
        assert _trickle(s, b"X") is not None  # a head that never ends: hung up on
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"PUT /v1/kv/slow HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 100000\r\n\r\n")
        answer = _trickle(s, b"v")  # a body that never ends: 408, and the connection ends
        assert answer is not None and (answer == b"" or answer.startswith(b"HTTP/1.1 408")), answer
        if answer:
            assert b"\r\nConnection: close\r\n" in answer, answer
            assert b"--http-idle-timeout-s" in answer and b"--max-value-bytes" not in answer, answer  # the limit it hit
    assert c.get(c.leader(), "slow")[0] == 404  # nothing was written
    assert_intact(c, c.seeds)


def test_garbage_on_the_http_port_keeps_the_log_small(cluster):
    """Before: every bad request was logged with a traceback quoting the whole buffer."""
    c = cluster
    target = c.leader()
    before = log_size(c, target)
    payloads = [
        os.urandom(200_000),
        b"GET / HTTP/1.1\r\nHost: x\r\n" + b"A" * 100_000 + b"\r\n\r\n",
        b"GET /" + b"x" * 100_000 + b" HTTP/1.1\r\n\r\n",
        b"GET / HTTP/1.1\r\nContent-Length: z" + b"9" * 50_000 + b"\r\n\r\n",
    ]
    spray(c.http[target], payloads, 200)
    grew = log_size(c, target) - before
    print(f"200 garbage HTTP requests of up to 200 KB: log grew {grew} bytes, peak RSS {peak_mb(c, target)} MB")
    assert grew < 50_000
    assert_intact(c, c.seeds)


# -- running out of descriptors -----------------------------------------------------------


FD_HARD_LIMIT = 120
# `kv serve` on the plain asyncio event loop instead of uvloop (their accept() differs).
PLAIN_ASYNCIO = "import sys, kv.cli.serve; kv.cli.serve.install_uvloop = lambda: False; from kv.cli import main; sys.exit(main())"


def _low_fd_limit():
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, FD_HARD_LIMIT))


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_running_out_of_descriptors_is_survived_quietly(tmp_path, loop):
    """A node whose hard descriptor limit is 120 (soft 64, raised to 120 at start): floods
    of HTTP and peer connections use up its descriptors; the log stays small (asyncio used
    to log a traceback per failed accept(), about a thousand a second) and the node
    answers again once the connections are gone."""
    http, peer = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    log_path = tmp_path / "node.log"
    kvcmd = [sys.executable, "-m", "kv"] if loop == "uvloop" else [sys.executable, "-c", PLAIN_ASYNCIO]
    cmd = [*kvcmd, "serve", "--id", "n1", "--data-dir", str(tmp_path / "d"), "--http", http, "--peers", f"n1={peer}", "--cluster-secret", SECRET]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, preexec_fn=_low_fd_limit)
    socks = []
    try:
        base = f"http://{http}"

        def get(path):
            try:
                with urllib.request.urlopen(base + path, timeout=3) as r:
                    return r.status, r.read()
            except urllib.error.HTTPError as e:
                return e.code, e.read()

        def answers():
            try:
                return get("/v1/kv/seed")[0] == 200
            except OSError:
                return False

        def put_seed():
            try:
                req = urllib.request.Request(base + "/v1/kv/seed", data=b"before", method="PUT")
                with urllib.request.urlopen(req, timeout=3) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_until(put_seed, 20, "the node takes a write")
        with open(f"/proc/{proc.pid}/limits") as f:
            line = next(x for x in f if x.startswith("Max open files"))
        assert line.split()[3:5] == [str(FD_HARD_LIMIT)] * 2, line  # soft raised to the hard limit
        for addr in (http, peer) * 2:
            host, port = addr.rsplit(":", 1)
            for _ in range(150):
                try:
                    socks.append(socket.create_connection((host, int(port)), timeout=2))
                except OSError:
                    break
        time.sleep(2.0)  # the connections are held open a while
        for s in socks:
            s.close()
        socks.clear()
        wait_until(answers, 30, "the node answers after the flood")
        assert get("/v1/kv/seed") == (200, b"before")
        assert proc.poll() is None
        size = os.path.getsize(log_path)
        text = log_path.read_text(errors="replace")
        print(f"descriptor flood ({loop}): peak RSS {proc_status(proc.pid, 'VmHWM') // 1024} MB, log {size} bytes, {text.count('out of system resource')} 'out of system resource' lines")
        assert size < 30_000, text[-3000:]
    finally:
        for s in socks:
            s.close()
        stop_process(proc)


# -- roles ----------------------------------------------------------------------------------

ROLE_TOKENS = {"reader-token": "read", "writer-token": "write", "app-token": {"role": "write", "prefix": "app/"}, "root-token": "admin"}


@pytest.fixture(scope="module")
def role_cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("roles")
    tokens = root / "tokens.json"
    tokens.write_text(json.dumps(ROLE_TOKENS))
    yield from seeded_cluster(root, ["--tokens", str(tokens)])


def _as(c: ProcCluster, token: str | None, i: str, method: str, path: str, body: bytes | None = None):
    """A request with this token (none: no Authorization header); a 503 (no leader for a
    moment: nothing was done) is retried a few times."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    for _ in range(20):
        code, _, data = ProcCluster.request(c, i, method, path, body, headers, timeout=10)
        if code != 503:
            break
        time.sleep(0.25)  # a pause before the retry
    return code, data


def test_roles_decide_what_a_token_may_do(role_cluster):
    c = role_cluster
    lead = c.leader()
    follower = next(i for i in c.ids if i != lead)
    for node in (lead, follower):  # a follower checks before it forwards
        assert _as(c, "reader-token", node, "GET", "/v1/kv/seed/1")[0] == 200
        assert _as(c, "reader-token", node, "GET", "/v1/kv?prefix=seed/")[0] == 200
        assert _as(c, "reader-token", node, "GET", "/v1/status")[0] == 200
        code, body = _as(c, "reader-token", node, "PUT", "/v1/kv/seed/1", b"no")
        assert code == 403 and orjson.loads(body)["error"]["code"] == "FORBIDDEN"
        assert _as(c, "reader-token", node, "DELETE", "/v1/kv/seed/1")[0] == 403
        assert _as(c, "reader-token", node, "POST", "/v1/txn", b'{"success": [{"op": "get", "key": "seed/1"}]}')[0] == 403
        assert _as(c, "writer-token", node, "PUT", f"/v1/kv/w/{node}", b"yes")[0] == 200
        assert _as(c, "writer-token", node, "POST", "/v1/txn", b'{"success": [{"op": "put", "key": "w/txn", "value": "1"}]}')[0] == 200
        assert _as(c, "reader-token", node, "POST", "/v1/leases", b'{"ttl": 10}')[0] == 403
        assert _as(c, "reader-token", node, "GET", "/v1/leases")[0] == 403
        assert _as(c, "writer-token", node, "POST", "/v1/leases", b'{"ttl": 10}')[0] == 200
        for method, path, body in (
            ("POST", "/v1/leader/transfer", orjson.dumps({"to": follower})),
            ("POST", "/v1/members", orjson.dumps({"id": "n9", "peer": "127.0.0.1:1"})),
            ("DELETE", "/v1/members/n3", None),
            ("GET", "/v1/members", None),
            ("POST", "/v1/snapshot", None),
            ("POST", "/v1/export", None),
            ("GET", "/v1/export/0123", None),
            ("DELETE", "/v1/export/0123", None),
            ("GET", "/v1/log", None),
            ("GET", "/metrics", None),
        ):
            assert _as(c, "writer-token", node, method, path, body)[0] == 403, (method, path)
        assert _as(c, "root-token", node, "GET", "/metrics")[0] == 200
        assert _as(c, "root-token", node, "GET", "/v1/members")[0] == 200
        assert _as(c, None, node, "GET", "/v1/kv/seed/1")[0] == 401
        assert _as(c, "nobody", node, "GET", "/v1/kv/seed/1")[0] == 401
        assert _as(c, None, node, "GET", "/healthz")[0] == 200
    # An admin request through a follower is forwarded with the caller's token: the leader
    # checks it again and agrees.
    code, body = _as(c, "root-token", follower, "POST", "/v1/leader/transfer", orjson.dumps({"to": follower}))
    assert code == 200, body
    assert_intact(c, c.seeds)


def test_a_prefix_token_reaches_only_its_keys(role_cluster):
    c = role_cluster
    follower = next(i for i in c.ids if i != c.leader())
    assert _as(c, "app-token", follower, "PUT", "/v1/kv/app/x", b"1")[0] == 200
    assert _as(c, "app-token", follower, "GET", "/v1/kv/app/x")[0] == 200
    assert _as(c, "app-token", follower, "PUT", "/v1/kv/seed/1", b"stolen")[0] == 403
    assert _as(c, "app-token", follower, "GET", "/v1/kv/seed/1")[0] == 403
    assert _as(c, "app-token", follower, "DELETE", "/v1/kv/seed%2F1")[0] == 403  # percent-encoded: the same key
    assert _as(c, "app-token", follower, "GET", "/v1/kv?prefix=app/")[0] == 200
    assert _as(c, "app-token", follower, "GET", "/v1/kv?prefix=")[0] == 403
    assert _as(c, "app-token", follower, "GET", "/v1/kv")[0] == 403
    assert _as(c, "app-token", follower, "GET", "/v1/kv?prefix=ap")[0] == 403
    assert _as(c, "app-token", follower, "DELETE", "/v1/kv?prefix=")[0] == 403  # a prefix delete, outside it
    assert _as(c, "app-token", follower, "DELETE", "/v1/kv?prefix=seed/")[0] == 403
    assert _as(c, "reader-token", follower, "DELETE", "/v1/kv?prefix=app/")[0] == 403  # a write
    # Every key of a transaction counts: compares, success and failure.
    for doc in (
        {"compare": [{"key": "seed/1", "exists": True}], "success": [{"op": "put", "key": "app/y", "value": "1"}]},
        {"success": [{"op": "put", "key": "app/y", "value": "1"}, {"op": "get", "key": "seed/2"}]},
        {"compare": [{"key": "app/x", "exists": False}], "failure": [{"op": "delete", "key": "seed/3"}]},
    ):
        code, body = _as(c, "app-token", follower, "POST", "/v1/txn", orjson.dumps(doc))
        assert code == 403, body
    assert c.get(c.leader(), "app/y")[0] == 404  # nothing of a refused transaction happened
    # The Python client says so with a typed error.
    with kv.Client(c.url(follower), token="app-token") as client:
        client.put("app/z", b"ok")
        with pytest.raises(kv.Forbidden):
            client.put("seed/1", b"stolen")
    assert_intact(c, c.seeds)


def test_a_prefix_token_reaches_only_its_own_leases(role_cluster):
    """Leases were a way around the prefix: listing them all, reading another tenant's keys
    through a lease, keeping its lock alive or revoking it (deleting its keys). Ids were
    small sequential indexes; now they are random."""
    c = role_cluster
    follower = next(i for i in c.ids if i != c.leader())

    def grant(token: str) -> int:
        code, body = _as(c, token, follower, "POST", "/v1/leases", b'{"ttl": 60}')
        assert code == 200, body
        return orjson.loads(body)["id"]

    theirs = grant("writer-token")
    assert _as(c, "writer-token", follower, "PUT", f"/v1/kv/other/leased?lease={theirs}", b"x")[0] == 200
    mine, empty = grant("app-token"), grant("app-token")
    assert _as(c, "app-token", follower, "PUT", f"/v1/kv/app/leased?lease={mine}", b"y")[0] == 200
    ids = sorted([theirs, mine, empty])
    assert ids[0] > 1 << 20 and ids[2] - ids[0] > 1000, ids  # not guessable from one another
    listed = {x["id"] for x in orjson.loads(_as(c, "app-token", follower, "GET", "/v1/leases")[1])["leases"]}
    assert listed == {mine, empty}
    assert {x["id"] for x in orjson.loads(_as(c, "writer-token", follower, "GET", "/v1/leases")[1])["leases"]} >= {theirs, mine, empty}
    for method, path in (("GET", f"/v1/leases/{theirs}"), ("POST", f"/v1/leases/{theirs}/keepalive"), ("DELETE", f"/v1/leases/{theirs}")):
        code, body = _as(c, "app-token", follower, method, path)
        assert code == 404 and orjson.loads(body)["error"]["code"] == "LEASE_NOT_FOUND", (method, path, body)
        assert b"other/" not in body
    code, body = _as(c, "app-token", follower, "POST", "/v1/leases/keepalive", orjson.dumps({"ids": [theirs, mine]}))
    assert code == 200 and orjson.loads(body)["not_found"] == [theirs] and [x["id"] for x in orjson.loads(body)["leases"]] == [mine]
    code, _ = _as(c, "app-token", follower, "PUT", f"/v1/kv/app/hijack?lease={theirs}", b"z")
    assert code == 404 and c.get(c.leader(), "app/hijack")[0] == 404  # nothing written
    assert orjson.loads(_as(c, "app-token", follower, "GET", f"/v1/leases/{mine}")[1])["keys"] == ["app/leased"]
    # A key outside the prefix on its lease (an admin's doing) takes it out of the tenant's reach.
    assert _as(c, "writer-token", follower, "PUT", f"/v1/kv/other/more?lease={mine}", b"w")[0] == 200
    assert _as(c, "app-token", follower, "GET", f"/v1/leases/{mine}")[0] == 404
    assert c.get(c.leader(), "other/leased")[0] == 200  # the other tenant's lease and key are intact
    assert _as(c, "app-token", follower, "DELETE", f"/v1/leases/{empty}")[0] == 200
    assert _as(c, "writer-token", follower, "DELETE", f"/v1/leases/{theirs}")[0] == 200
    assert_intact(c, c.seeds)


# -- TLS ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"), ["n1", "n2", "n3", "http"], foreign=["mallory"])


def _peer_env(pki, name: str) -> dict:
    """The peer TLS settings of a node, from KV_* variables (like every other flag)."""
    return {"KV_PEER_CERT": pki[name][0], "KV_PEER_KEY": pki[name][1], "KV_PEER_CA": pki["ca"]}


def test_peers_over_mutual_tls_commit_and_refuse_a_foreign_certificate(tmp_path, pki):
    """Peers over mutual TLS, clients over HTTPS: writes commit; a node whose certificate
    another CA signed is left out until it has the right one; a follower forwards an admin
    request to the leader over HTTPS (trusting --cacert)."""
    https = ["--tls-cert", pki["http"][0], "--tls-key", pki["http"][1], "--cacert", pki["ca"]]
    c = AuthedCluster(str(tmp_path), extra=["--token", TOKEN, *https], proxies=False)  # the proxies parse frames: not TLS
    c.scheme, c.ssl_context = "https", ssl.create_default_context(cafile=pki["ca"])
    try:
        for i in c.ids:
            c.node_env[i] = _peer_env(pki, i)
        c.start()
        seeds = seed(c, "tls", 30)
        c.wait_converged()
        # n3 comes back with a certificate another CA signed: no peer talks to it.
        c.stop("n3")
        c.node_env["n3"] = _peer_env(pki, "mallory")
        c.start("n3")
        more = seed(c, "while-n3-is-foreign", 10)
        assert c.status("n3")["applied_index"] < c.status(c.leader())["applied_index"]
        wait_until(lambda: "may not trust our certificate" in c.log("n3"), 10, "n3 says why")
        # A stranger without any certificate gets no WELCOME for a HELLO that n1 would
        # welcome over a trusted connection (this cluster has no secret).
        host, port = c.listen["n1"].rsplit(":", 1)
        ctx = ssl.create_default_context(cafile=pki["ca"])
        ctx.check_hostname = False
        hello = hello_frame(b"default", b"n2", b"n1", b"", os.urandom(16))
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            with pytest.raises((ssl.SSLError, ConnectionError)):
                with ctx.wrap_socket(raw) as s:
                    s.sendall(hello)
                    if s.recv(1) == b"":
                        raise ConnectionError("closed")
        # With the right certificate again, n3 catches up.
        c.stop("n3")
        c.node_env["n3"] = _peer_env(pki, "n3")
        c.start("n3")
        assert_intact(c, seeds, more)
        lead = c.leader()
        follower = next(i for i in c.ids if i != lead)
        code, _, body = c.request(follower, "POST", "/v1/leader/transfer", orjson.dumps({"to": follower}))
        assert code == 200, body
        assert_intact(c, seeds, more)
    finally:
        c.close()


def test_clients_verify_the_https_server_with_cacert(tmp_path, pki):
    http = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "kv", "serve", "--id", "n1", "--data-dir", str(tmp_path / "d"), "--http", http, "--tls-cert", pki["http"][0], "--tls-key", pki["http"][1]]
    with open(tmp_path / "node.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log)
    url = f"https://{http}"
    try:
        with kv.Client(url, cacert=pki["ca"], timeout=20) as client:
            client.put("secure/a", b"1")
            assert client.get("secure/a").value == b"1"
        env = {**os.environ, "KV_ENDPOINTS": url}
        kvcli = [sys.executable, "-m", "kv"]
        out = subprocess.run([*kvcli, "get", "secure/a", "--cacert", pki["ca"]], env=env, capture_output=True, timeout=60)
        assert out.returncode == 0 and out.stdout == b"1", out.stderr
        out = subprocess.run([*kvcli, "get", "secure/a"], env=env, capture_output=True, timeout=60)
        assert out.returncode == 1
        err = out.stderr.decode()
        assert "certificate is not trusted" in err and "--cacert" in err and "Traceback" not in err, err
        with kv.Client(url, timeout=5) as client:
            with pytest.raises(kv.Unavailable, match="cacert"):
                client.get("secure/a")
        assert proc.poll() is None
        with kv.Client(url, cacert=pki["ca"]) as client:
            assert client.get("secure/a").value == b"1"
    finally:
        stop_process(proc)
