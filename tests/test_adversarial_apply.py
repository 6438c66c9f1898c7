"""Hostile requests against a real 3-node cluster (kv serve processes): none of them may take
a node down. Each attack must get a 4xx (or a closed connection), leave every node alive
and every earlier write intact; the transaction-read attack must also leave memory flat.

Covers: gets that would read hundreds of MB, oversized transactions, malformed conditional
headers and transaction bodies, voters at unreachable addresses, membership changes that
would lose the quorum, a state machine that fails to apply, peer handshakes of any shape,
crafted snapshot files (valid CRC), and recovering from a majority lost for good
(--force-new-cluster)."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib

import orjson
import pytest
from cluster import ProcCluster, wait_until
from kv.bench.harness import free_port

from kv.snapshot import format as fmt

pytestmark = pytest.mark.slow

MB = 1 << 20
RSS_BOUND_MB = 300  # extra resident memory any node may gain from one attack


def proc_status(c: ProcCluster, i: str, field: str) -> int:
    """A /proc/PID/status figure of node i (VmRSS, VmHWM: the peak), in bytes."""
    with open(f"/proc/{c.procs[i].pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {i}")


def post_json(c: ProcCluster, i: str, path: str, doc, timeout: float = 30.0):
    raw = json.dumps(doc).encode()  # the standard library's: it writes integers of any size
    code, _, body = c.request(i, "POST", path, raw, {"Content-Type": "application/json"}, timeout=timeout)
    return code, orjson.loads(body) if body else None


def error_of(body) -> str:
    return body["error"]["code"] + ": " + body["error"]["message"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = ProcCluster(str(tmp_path_factory.mktemp("adversarial")), proxies=False)
    try:
        c.start()
        c.leader()
        yield c
    finally:
        c.close()


@pytest.fixture(autouse=True)
def peak_memory(request):
    """Print how much each node of the shared cluster grew at its peak during the test
    (VmHWM, reset at the start, minus VmRSS before; nodes restarted meanwhile are left
    out)."""
    if "cluster" not in request.fixturenames:
        yield
        return
    c = request.getfixturevalue("cluster")
    before = {}
    for i in c.ids:
        if c.alive(i):
            with open(f"/proc/{c.procs[i].pid}/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS: the peak is this test's
            before[i] = (c.procs[i].pid, proc_status(c, i, "VmRSS"))
    yield
    grown = {
        i: round((proc_status(c, i, "VmHWM") - rss) / MB, 1)
        for i, (pid, rss) in before.items()
        if c.alive(i) and c.procs[i].pid == pid
    }
    print(f"\n[peak RSS growth, MB] {request.node.name}: {grown}")


@pytest.fixture(scope="module")
def seeded(cluster):
    """Data written before the attacks, checked after each one."""
    lead = cluster.leader()
    acked = write_keys(cluster, lead, "seed/", 20)
    code, body = cluster.put(lead, "big", b"B" * MB)  # 1 MiB: the largest value allowed
    assert code == 200, body
    acked["big"] = body["index"]
    return acked


def write_keys(c: ProcCluster, via: str, prefix: str, n: int) -> dict:
    """Write prefix0.. prefix{n-1} (values v0..); returns {key: mod_index} as acknowledged."""
    acked = {}
    for k in range(n):
        code, body = c.put(via, f"{prefix}{k}", b"v%d" % k)
        assert code == 200
        acked[f"{prefix}{k}"] = body["index"]
    return acked


def check_alive_and_intact(c: ProcCluster, acked: dict) -> None:
    for i in c.ids:
        assert c.alive(i), f"{i} died:\n{c.log(i)[-3000:]}"
    c.leader()
    c.wait_converged()
    for i in c.ids:
        data = {k: m for k, _, m in c.dump(i)}
        lost = [k for k, idx in acked.items() if data.get(k) != idx]
        assert not lost, f"{i} lost {lost[:5]}"
        assert "Traceback" not in c.log(i), c.log(i)[-3000:]


# -- transactions -----------------------------------------------------------------------------


def test_gets_of_a_1mib_key_are_refused_before_proposing_and_memory_stays_flat(cluster, seeded):
    c = cluster
    lead = c.leader()
    follower = next(i for i in c.ids if i != lead)
    rss = {i: proc_status(c, i, "VmRSS") for i in c.ids}  # the fixture above reset VmHWM
    commit = c.status(lead)["commit_index"]
    # The original attack: 200 gets (6.6 KB of request, 210 MB of answer) through a follower.
    code, body = post_json(c, follower, "/v1/txn", {"success": [{"op": "get", "key": "big"}] * 200})
    assert code == 400 and "--max-txn-ops" in error_of(body)
    # Within the op limit, the read limit: 100 x 1 MiB.
    for via in (follower, lead):
        code, body = post_json(c, via, "/v1/txn", {"success": [{"op": "get", "key": "big"}] * 100})
        assert code == 413 and "100 gets would read 104857600 bytes" in error_of(body) and "--max-txn-read-bytes" in error_of(body)
    assert c.status(lead)["commit_index"] == commit  # nothing was proposed
    # Written while a follower was paused, asked through that follower the moment it runs
    # again (before it has applied the write): still refused before proposing.
    c.pause(follower)
    try:
        code, body = c.put(lead, "big2", b"C" * MB)
    finally:
        c.resume(follower)
    assert code == 200
    seeded["big2"] = body["index"]
    code, body = post_json(c, follower, "/v1/txn", {"success": [{"op": "get", "key": "big2"}] * 100})
    assert code == 413 and "would read" in error_of(body), body
    assert c.status(lead)["commit_index"] == seeded["big2"]
    # A bounded answer is still given, through the follower too: 3 x 1 MiB.
    code, body = post_json(c, follower, "/v1/txn", {"success": [{"op": "get", "key": "big"}] * 3})
    assert code == 200 and [len(r["value"]) for r in body["results"]] == [MB] * 3
    grown = {i: (proc_status(c, i, "VmHWM") - rss[i]) / MB for i in c.ids}
    print(f"txn-read attack: peak RSS growth per node (MB): {grown}")
    assert max(grown.values()) < RSS_BOUND_MB, grown
    check_alive_and_intact(c, seeded)


def test_oversized_transactions_are_refused_naming_the_limit(cluster, seeded):
    c = cluster
    lead = c.leader()
    code, body = post_json(c, lead, "/v1/txn", {"compare": [{"key": "k", "exists": True}] * 65_536, "success": []})
    assert code == 400 and "65536" in error_of(body) and "--max-txn-ops" in error_of(body)
    code, body = post_json(c, lead, "/v1/txn", {"success": [{"op": "put", "key": f"p{i}", "value": "x"} for i in range(129)]})
    assert code == 400 and "--max-txn-ops" in error_of(body)
    two_mib = {"success": [{"op": "put", "key": "a", "value": "x" * MB}, {"op": "put", "key": "b", "value": "x" * MB}]}
    code, body = post_json(c, lead, "/v1/txn", two_mib)
    assert code == 413 and "--max-request-bytes" in error_of(body)
    assert c.get(lead, "a")[0] == 404 and c.get(lead, "p0")[0] == 404
    check_alive_and_intact(c, seeded)


@pytest.mark.parametrize(
    "header, value",
    [
        ("If-Match", '"18446744073709551616"'),
        ("If-Match", '"9223372036854775808"'),
        ("If-Match", '"\u00b2"'),
        ("If-Match", "5"),
        ("If-Match", '"1", "2"'),
        ("If-Match", '"-1"'),
        ("If-Match", "**"),  # "*" alone is a condition: the key exists
        ("If-None-Match", '"3"'),
    ],
)
def test_malformed_conditional_headers_are_400(cluster, header, value):
    c = cluster
    lead = c.leader()
    for method in ("PUT", "DELETE"):
        code, _, body = c.request(lead, method, "/v1/kv/seed/0", b"changed" if method == "PUT" else None, {header: value.encode("utf-8").decode("latin-1")})
        assert code == 400, (method, value, body)
        assert orjson.loads(body)["error"]["code"] == "BAD_REQUEST"
    assert c.get(lead, "seed/0")[1] == b"v0"


@pytest.mark.parametrize("value", ["0", "0.0001", "-1", "nan", "inf", "1e3", "1_000", "soon", "\u0661"])
def test_a_malformed_timeout_header_is_400_on_every_route_that_takes_it(cluster, value):
    c = cluster
    lead = c.leader()
    header = {"X-Kv-Timeout": value.encode("utf-8").decode("latin-1")}
    for method, path, body in (
        ("PUT", "/v1/kv/seed/0", b"changed"),
        ("DELETE", "/v1/kv/seed/0", None),
        ("GET", "/v1/kv/seed/0", None),
        ("GET", "/v1/kv?prefix=seed/", None),
        ("POST", "/v1/txn", b'{"success": [{"op": "delete", "key": "seed/0"}]}'),
        ("POST", "/v1/leases", b'{"ttl": 30}'),
    ):
        code, _, out = c.request(lead, method, path, body, header)
        assert code == 400 and "X-Kv-Timeout must be a number of seconds" in orjson.loads(out)["error"]["message"], (method, path, value, out)
    assert c.get(lead, "seed/0")[1] == b"v0"
    code, _, out = c.request(lead, "GET", "/v1/leases", None, {})
    assert code == 200 and orjson.loads(out)["leases"] == [], out  # no lease was granted


@pytest.mark.parametrize(
    "doc, says",
    [
        ({"success": [{"op": "put", "key": "t", "value": "x", "mod_index": 1}]}, "mod_index"),
        ({"success": [{"op": "delete", "key": "seed/1", "if": 3}]}, "unknown field"),
        ({"success": [{"op": "get", "key": "t", "value": "x"}]}, "unknown field"),
        ({"compare": [{"key": "t", "mod_index": 1 << 64}]}, "mod_index"),
        ({"compare": [{"key": "t", "mod_index": -1}]}, "mod_index"),
        ({"compare": [{"key": "t", "mod_index": True}]}, "mod_index"),
        ({"compare": [{"key": "t", "mod_index": 1.5}]}, "mod_index"),
        ({"compare": [{"key": "t", "mod_index": 0, "exists": False}]}, "exactly one"),
        ({"compare": [{"key": "t", "mod_index": 0, "value": "a", "value_base64": "YQ=="}]}, "exactly one"),
        ({"compare": [{"key": "t", "value": "a", "value_base64": "YQ=="}]}, "not both"),
        ({"compare": [{"key": "t", "exists": True, "extra": 1}]}, "unknown field"),
        ({"success": [], "else": []}, "unknown fields"),
    ],
)
def test_malformed_transaction_bodies_are_400_and_write_nothing(cluster, seeded, doc, says):
    c = cluster
    lead = c.leader()
    code, body = post_json(c, lead, "/v1/txn", doc)
    assert code == 400 and says in error_of(body), body
    assert c.get(lead, "t")[0] == 404 and c.get(lead, "seed/1")[1] == b"v1"


# -- membership -------------------------------------------------------------------------------


def test_voters_at_unreachable_addresses_stay_learners_and_the_cluster_goes_on(cluster, seeded):
    c = cluster
    lead = c.leader()
    ghosts = [f"ghost{k}" for k in range(3)]
    for g in ghosts:
        code, body = post_json(c, lead, "/v1/members", {"id": g, "peer": f"127.0.0.1:{free_port()}", "voter": True})
        assert code == 200, body
        me = {m["id"]: m for m in body["members"]}[g]
        assert me["voter"] is False and me["promote"] is True
    time.sleep(2)  # several promotion checks go by
    members = {m["id"]: m for m in c.members(c.leader())}
    assert [g for g in ghosts if members[g]["voter"]] == []
    code, body = c.put(c.leader(), "after/ghosts", b"1")
    assert code == 200
    seeded["after/ghosts"] = body["index"]
    for g in ghosts:  # and the way back out works
        code, _, body = c.request(c.leader(), "DELETE", f"/v1/members/{g}")
        assert code == 200, body
    check_alive_and_intact(c, seeded)


def test_a_removal_that_would_lose_the_quorum_is_refused(cluster, seeded):
    c = cluster
    lead = c.leader()
    down, up = [i for i in c.ids if i != lead]
    c.kill(down)
    try:
        time.sleep(1.5)  # the leader notices it is gone (election timeout 500 ms)
        code, _, body = c.request(lead, "DELETE", f"/v1/members/{up}")
        assert code == 409, body
        assert "reachable" in orjson.loads(body)["error"]["message"]
        assert {m["id"] for m in c.members(lead)} == set(c.ids)
    finally:
        c.start(down)
    check_alive_and_intact(c, seeded)


# -- a node whose state machine fails ---------------------------------------------------------


def test_an_apply_failure_stops_the_node_with_one_line_and_a_non_zero_exit(cluster, seeded):
    c = cluster
    victim = next(i for i in c.ids if i != c.leader())
    c.stop(victim)
    c.node_env[victim] = {"KV_FAILPOINTS": "apply.raise"}
    try:
        c.start(victim, wait=False)
        code, body = c.put(c.leader(), "poke", b"1")  # gives the victim something to apply
        assert code == 200
        seeded["poke"] = body["index"]
        wait_until(lambda: not c.alive(victim), what=f"{victim} exiting")
        rc = c.procs[victim].returncode
        log = c.log(victim)
        assert rc == 1, log[-3000:]
        lines = [ln for ln in log.splitlines() if "cannot apply committed entry" in ln]
        assert len(lines) == 1 and "InjectedFailure" in lines[0] and "stopping" in lines[0], log[-3000:]
        assert "Traceback" not in log
    finally:
        c.node_env[victim] = {}
    c.start(victim)  # without the failure: it applies from the same index and catches up
    check_alive_and_intact(c, seeded)


STUCK_STOP = r"""
import asyncio, threading
from kv.cli import serve

async def main():
    serve._exit_if_stuck(asyncio.get_running_loop(), 1)
    print("stopping", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, threading.Event().wait)  # a clean-up that never ends

asyncio.run(main())
"""


def test_a_stopping_node_exits_on_sigterm_even_when_its_clean_up_hangs():
    p = subprocess.Popen([sys.executable, "-c", STUCK_STOP], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "stopping"
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 1
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


# -- the peer port ----------------------------------------------------------------------------


def _frame(ftype: int, body: bytes) -> bytes:
    return struct.pack(">IB", len(body) + 1, ftype) + body


def _strs(*items: bytes) -> bytes:
    return b"".join(struct.pack(">H", len(x)) + x for x in items)


HELLO, AUTH = 100, 102


@pytest.mark.parametrize(
    "frames",
    [
        [_frame(HELLO, b"\x00")],  # shorter than a length prefix
        [_frame(HELLO, b"")],
        [_frame(HELLO, _strs(b"LKV1", b"default"))],  # fields missing
        [_frame(HELLO, _strs(b"LKV1", b"default", b"\xff\xfe", b"n1", b"", b"nonce"))],  # id not UTF-8
        [_frame(HELLO, _strs(b"LKV1", b"\xc3(", b"n2", b"n1", b"", b"nonce"))],  # group not UTF-8
        [_frame(HELLO, _strs(b"LKV1", b"default", b"n2", b"n1", b"", b"nonce")), _frame(AUTH, b"\x01")],  # short AUTH
    ],
)
def test_malformed_peer_handshakes_close_the_connection_without_a_traceback(cluster, frames):
    c = cluster
    host, port = c.listen["n1"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        for fr in frames:
            s.sendall(fr)
        s.settimeout(10)
        got = b""
        while True:  # a WELCOME may come first; then the node must close the connection
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
            assert len(got) < 4096
    assert c.alive("n1")
    log = c.log("n1")
    assert "Traceback" not in log and "Fatal error" not in log, log[-3000:]


# -- snapshot files ---------------------------------------------------------------------------


def craft_snapshot(path: str, header: bytes, blocks: list[tuple[int, bytes]]) -> None:
    """A snapshot file with any header and blocks (records count, payload), every CRC valid."""
    out = bytearray(fmt.MAGIC + struct.pack(">I", len(header)) + header)
    offsets = []
    for count, payload in blocks:
        offsets.append(len(out))
        out += struct.pack(">III", len(payload), count, zlib.crc32(payload)) + payload
    out += struct.pack(">III", 0, 0, 0)
    index_offset = len(out)
    out += struct.pack(f">{len(offsets)}Q", *offsets)
    crc = zlib.crc32(bytes(out))
    out += struct.pack(">QQQI8s", index_offset, sum(n for n, _ in blocks), len(offsets), crc, fmt.END_MAGIC)
    with open(path, "wb") as f:
        f.write(out)


def good_header(**change) -> bytes:
    d = {"format": 1, "index": 10, "term": 2, "membership": [], "created": 1.0, "group": "default", "node": "n1"}
    d.update(change)
    return json.dumps(d).encode()


def block(keys: list[bytes], mods: list[int] | None = None) -> tuple[int, bytes]:
    (ks, vs, ms), = fmt.blocks_of(zip(keys, [b"v"] * len(keys), mods or [1] * len(keys)))
    return len(keys), fmt.encode_block(ks, vs, ms)


CRAFTED = {
    "empty header": (b"", [block([b"a"])]),
    "header not an object": (b"[]", [block([b"a"])]),
    "format from a newer ledgerkv": (good_header(format=3), [block([b"a"])]),
    "index -5": (good_header(index=-5), [block([b"a"])]),
    "index 2^70": (good_header(index=1 << 70), [block([b"a"])]),
    "index a string": (good_header(index="10"), [block([b"a"])]),
    "term 0 with index": (good_header(term=0), [block([b"a"])]),
    "membership garbage": (good_header(membership=[{"id": 5}]), [block([b"a"])]),
    "bogus block count": (good_header(), [(1_000_000, block([b"a"])[1])]),
    "empty key": (good_header(), [block([b""])]),
    "key too long": (good_header(), [block([b"k" * 5000])]),
    "keys out of order": (good_header(), [block([b"b", b"a"])]),
    "mod_index beyond the snapshot": (good_header(), [block([b"a"], [11])]),
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_snapshot_files_are_refused_by_inspect_and_restore(tmp_path, name):
    header, blocks = CRAFTED[name]
    path = str(tmp_path / "crafted.lkvs")
    craft_snapshot(path, header, blocks)
    data_dir = str(tmp_path / "restored")
    for args in (["inspect", path], ["restore", path, "--data-dir", data_dir, "--id", "n1", "--peers", "n1=127.0.0.1:1"]):
        r = subprocess.run([sys.executable, "-m", "kv", "snapshot", *args], capture_output=True, text=True, timeout=60)
        out = (r.stdout + r.stderr).strip()
        assert r.returncode == 1, out
        assert "Traceback" not in out and len(out.splitlines()) <= 2, out  # restore says "verifying ..." first
        assert not os.path.exists(data_dir)


def test_a_well_formed_crafted_snapshot_is_accepted(tmp_path):
    """The crafting helper itself makes files the checks accept when nothing is wrong."""
    path = str(tmp_path / "ok.lkvs")
    craft_snapshot(path, good_header(), [block([b"a", b"b"], [3, 10]), block([b"c"])])
    r = subprocess.run([sys.executable, "-m", "kv", "snapshot", "inspect", path, "-o", "json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["keys"] == 3, r.stdout + r.stderr
    # As text too, from headers that leave out what may be left out (a member's "voter", the
    # node, the creation time) or whose clock was ahead: it crashed on a missing "voter".
    for change, said in (
        ({"membership": [{"id": "n1", "peer": "127.0.0.1:1"}], "created": 0, "node": ""}, "not recorded, by node (not recorded)"),
        ({"created": time.time() + 7200}, "in the future: a clock is wrong"),
    ):
        craft_snapshot(path, good_header(**change), [block([b"a"])])
        r = subprocess.run([sys.executable, "-m", "kv", "snapshot", "inspect", path], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and said in r.stdout, r.stdout + r.stderr


# -- a majority lost for good -----------------------------------------------------------------


def test_force_new_cluster_recovers_the_data_after_the_majority_is_lost_for_good(tmp_path):
    c = ProcCluster(str(tmp_path), proxies=False)
    try:
        c.start()
        acked = write_keys(c, c.leader(), "keep/", 30)
        c.wait_converged()
        survivor = "n1"
        lost = [i for i in c.ids if i != survivor]
        c.kill(*lost)
        for i in lost:  # the machines are gone, with their disks
            subprocess.run(["rm", "-rf", c.data_dir(i)], check=True)
        code, _ = c.put(survivor, "no/quorum", b"x", timeout=15)
        assert code in (503, 504)
        c.stop(survivor)
        c.extra.append("--force-new-cluster")
        c.start(survivor)
        c.extra.remove("--force-new-cluster")
        c.ids = [survivor]
        assert c.leader() == survivor
        assert {k: m for k, _, m in c.dump(survivor) if k.startswith("keep/")} == acked
        code, _ = c.put(survivor, "after/recovery", b"1")
        assert code == 200
        assert "--force-new-cluster" in c.log(survivor)
        # Restarted without the flag it stays a one-member cluster; then a lost member is
        # added back from an empty data dir.
        c.stop(survivor)
        c.start(survivor)
        c.ids = [survivor, "n2"]
        c.joining["n2"] = True
        c.start("n2", join_via=survivor)
        wait_until(lambda: {m["id"]: m["voter"] for m in c.members(survivor)}.get("n2") is True, 60, "n2 a voter again")
        c.wait_converged()
        assert {k: m for k, _, m in c.dump("n2") if k.startswith("keep/")} == acked
    finally:
        c.close()
