"""Leases on a real cluster: keys kept while kept alive (across a leader kill), expired on
every node within ttl + election timeout + 1 s once the keepalives stop (never before ttl),
revoked, carried by restarts and snapshots; bad requests refused, changing nothing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import orjson
import pytest
from cluster import ProcCluster, wait_until

import kv
from kv.client.recipes import KEEPALIVE_BATCH_S

ELECTION_S = 0.5  # tests/cluster.py FAST


def on_every_node(c: ProcCluster, key: str) -> list[bool]:
    return [c.get(i, key, consistency="stale")[0] == 200 for i in c.ids if c.alive(i)]


@pytest.fixture
def cluster(tmp_path):
    c = ProcCluster(str(tmp_path))
    c.start()
    c.leader()
    yield c
    c.close()


def endpoints(c: ProcCluster) -> str:
    return ",".join(c.url(i) for i in c.ids)


def test_kept_alive_across_a_leader_kill_then_expired_everywhere(cluster):
    c = cluster
    ttl = 3.0
    with kv.Client(endpoints(c)) as client:
        lease = client.lease(ttl)
        client.put("svc/api", b"10.0.0.1:8080", lease=lease)
        client.put("svc/plain", b"stays")
        assert client.lease_info(lease.id).keys == ("svc/api",)
        old = c.leader()
        c.kill(old)
        new = c.leader(among=[i for i in c.ids if i != old])
        time.sleep(ttl * 1.5)  # longer than the ttl: only the keepalives keep it
        assert lease.alive, lease.lost
        assert all(on_every_node(c, "svc/api"))
        c.start(old)
        c.wait_converged()
        # Stop the keepalives (as a dead process would) and time the expiry.
        lease._lease._task.cancel()
        # The last renewal was up to ttl/3 before the cancel: the leader's clock says how
        # long the lease has left, and its keys must stay for (most of) that.
        left = client.lease_info(lease.id).remaining
        asked = time.monotonic()
        assert 0 < left <= ttl
        time.sleep(max(0.0, left * 0.8 - (time.monotonic() - asked)))  # time that must pass with the key still there
        assert all(on_every_node(c, "svc/api")), f"a key went before its lease's {left}s were up"
        wait_until(lambda: not any(on_every_node(c, "svc/api")), left + ELECTION_S + 1 + 3, "the key gone on every node")
        assert not lease.alive, "the holder still believes in a lease whose deadline passed"
        assert all(c.get(i, "svc/plain", consistency="stale")[0] == 200 for i in c.ids)
        with pytest.raises(kv.LeaseNotFound):
            client.lease_keepalive(lease.id)
        assert new in c.ids


def test_revoke_and_bad_requests(cluster):
    c = cluster
    follower = next(i for i in c.ids if i != c.leader())

    def req(method, path, doc=None, node=follower):
        code, _, body = c.request(node, method, path, orjson.dumps(doc) if doc is not None else None, {"Content-Type": "application/json"})
        return code, orjson.loads(body) if body else {}

    code, g = req("POST", "/v1/leases", {"ttl": 60})
    assert code == 200 and g["ttl"] == 60 and g["id"] > 0
    lid = g["id"]
    assert c.request(follower, "PUT", f"/v1/kv/a?lease={lid}", b"1")[0] == 200
    assert c.request(follower, "PUT", f"/v1/kv/b?lease={lid}", b"2")[0] == 200
    code, info = req("GET", f"/v1/leases/{lid}")
    assert code == 200 and info["keys"] == ["a", "b"] and 0 < info["remaining"] <= 60
    assert req("POST", f"/v1/leases/{lid}/keepalive") == (200, {"id": lid, "ttl": 60})
    assert any(x["id"] == lid for x in req("GET", "/v1/leases")[1]["leases"])
    before = c.status(c.leader())["commit_index"]
    for bad in ({"ttl": 0}, {"ttl": -1}, {"ttl": "10"}, {"ttl": True}, {"ttl": 10**9}, {"ttl": 1e308}, {"ttl": None}, {}, {"ttl": 5, "x": 1}):
        code, body = req("POST", "/v1/leases", bad)
        assert code == 400 and body["error"]["code"] == "BAD_REQUEST", (bad, body)
    for path in ("/v1/leases/abc", "/v1/leases/-3", "/v1/leases/99999999999999999999"):
        assert req("GET", path)[0] == 400
    assert req("POST", "/v1/leases/424242/keepalive")[1]["error"]["code"] == "LEASE_NOT_FOUND"
    # Batched keepalives (forwarded by the follower): renewed (each once), or listed as not found.
    assert req("POST", "/v1/leases/keepalive", {"ids": [lid, 424242, lid]}) == (200, {"leases": [{"id": lid, "ttl": 60}], "not_found": [424242]})
    bad_batches = {
        "{}": "as a list", '{"ids": []}': "1 to 10000", f'{{"ids": {lid}}}': "as a list", f'{{"ids": ["{lid}"]}}': f"not '{lid}'",
        '{"ids": [true]}': "not True", '{"ids": [null]}': "not None", '{"ids": [2.5]}': "not 2.5", '{"ids": [0]}': "positive",
        '{"ids": [-1]}': "positive", f'{{"ids": [{2**63}]}}': "positive", f'{{"ids": [{lid}], "x": 1}}': "unknown field(s) ['x']",
        '{"ids": [' + ", ".join(["1"] * 10_001) + "]}": "1 to 10000",
    }
    for bad, says in bad_batches.items():
        code, _, body = c.request(follower, "POST", "/v1/leases/keepalive", bad.encode(), {"Content-Type": "application/json"})
        error = orjson.loads(body)["error"]
        assert code == 400 and error["code"] == "BAD_REQUEST" and says in error["message"], (bad[:80], error)
    assert req("DELETE", "/v1/leases/424242")[0] == 404
    code, _, body = c.request(follower, "PUT", "/v1/kv/c?lease=424242", b"3")
    assert code == 404 and orjson.loads(body)["error"]["code"] == "LEASE_NOT_FOUND"
    assert c.request(follower, "PUT", "/v1/kv/c?lease=x", b"3")[0] == 400
    assert c.get(c.leader(), "c")[0] == 404  # nothing written
    code, r = req("DELETE", f"/v1/leases/{lid}")
    assert code == 200 and r["keys"] == ["a", "b"]
    c.wait_converged()
    for i in c.ids:
        assert c.get(i, "a", consistency="stale")[0] == 404 and c.get(i, "b", consistency="stale")[0] == 404
    assert req("GET", f"/v1/leases/{lid}")[0] == 404
    assert c.status(c.leader())["commit_index"] > before


def test_a_clients_leases_share_their_keepalive_requests(cluster):
    """50 self-renewing leases of one kv.Client stay alive through several ttls, and their
    keepalives reach the leader batched: far fewer requests than renewals, none one by one."""
    c = cluster
    ttl = 1.5

    def keepalive_requests(node: str) -> dict[str, float]:
        text = c.request(node, "GET", "/metrics")[2].decode()
        found = re.findall(r'kv_http_request_duration_seconds_count\{route="(leases_keepalive\w*)",status="200"\} (\S+)', text)
        return {route: float(n) for route, n in found}

    with kv.Client(c.url(c.leader())) as client:
        t0 = time.monotonic()
        leases = [client.lease(ttl) for _ in range(50)]
        time.sleep(ttl * 3)  # three ttls pass: only the batched keepalives keep the leases
        assert all(lease.alive for lease in leases), [lease.lost for lease in leases if not lease.alive]
        assert {x.id for x in client.lease_list()} >= {lease.id for lease in leases}
        seen = keepalive_requests(c.leader())
        elapsed = time.monotonic() - t0
        assert "leases_keepalive" not in seen, seen
        # At most one request per batching window, however loaded the machine; renewals
        # (one per lease every ttl/3) are about five times as many as windows here.
        windows = elapsed / KEEPALIVE_BATCH_S + 2
        renewals = 50 * elapsed / (ttl / 3)
        assert 0 < seen.get("leases_keepalive_many", 0) <= windows < renewals / 3, (seen, windows, renewals)
        for lease in leases:
            lease.revoke()
    assert not [x for x in client_leases(c) if x in {lease.id for lease in leases}]


def client_leases(c: ProcCluster) -> list[int]:
    return [x["id"] for x in orjson.loads(c.request(c.leader(), "GET", "/v1/leases")[2])["leases"]]


def test_leases_survive_a_restart_of_the_whole_cluster_and_a_snapshot_restore(cluster, tmp_path):
    c = cluster
    with kv.Client(endpoints(c)) as client:
        long = client.lease_grant(3600)
        short = client.lease_grant(2)
        client.put("keep/x", b"1", lease=long.id)
        client.put("short/y", b"1", lease=short.id)
        client.lease_keepalive(short.id)
        client.take_snapshot(c.url(c.leader()))
        snap = str(tmp_path / "backup.lkvs")
        client.download_snapshot(snap, endpoint=c.url(c.leader()))
    c.stop()
    c.start()
    c.leader()
    with kv.Client(endpoints(c)) as client:
        assert client.lease_info(long.id).keys == ("keep/x",)
        # Renewed at the new leader's election, then expired without keepalives.
        wait_until(lambda: client.get("short/y") is None, 2 + ELECTION_S + 1 + 5, "short/y expired after the restart")
        assert client.get("keep/x").value == b"1"
    # A new cluster restored from the snapshot has the lease and its key.
    new = ProcCluster(str(tmp_path / "restored"))
    try:
        for i in new.ids:
            r = subprocess.run(
                [sys.executable, "-m", "kv", "snapshot", "restore", snap, "--data-dir", new.data_dir(i), "--id", i, "--peers", new.peers_for(i)],
                capture_output=True, text=True, timeout=60,
            )
            assert r.returncode == 0, r.stderr
        new.start()
        new.leader()
        with kv.Client(endpoints(new)) as client:
            assert client.lease_info(long.id).keys == ("keep/x",)
            assert client.get("keep/x").value == b"1"
            assert [i.key for i in client.scan("")] == ["keep/x", "short/y"]  # reserved records never show
    finally:
        new.close()


def test_lease_cli(cluster):
    c = cluster
    env = {**os.environ, "KV_ENDPOINTS": endpoints(c)}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "kv", "lease", *args], capture_output=True, text=True, timeout=60, env=env)

    r = cli("grant", "30", "-o", "json")
    assert r.returncode == 0, r.stderr
    lid = orjson.loads(r.stdout)["id"]
    assert cli("keepalive", str(lid), "--once").returncode == 0
    assert str(lid) in cli("list").stdout
    assert orjson.loads(cli("info", str(lid), "-o", "json").stdout)["ttl"] == 30
    with kv.Client(endpoints(c)) as client:
        client.put("cli-lease/a", b"1", lease=lid)
    r = cli("revoke", str(lid))
    assert r.returncode == 0 and r.stdout.endswith(" revoked; 1 key deleted with it\n"), r.stdout
    with kv.Client(endpoints(c)) as client:
        assert client.get("cli-lease/a") is None
    for ttl in ("inf", "nan", "1e308", "-3"):  # 1e308 was a 500 (an overflow in the node), inf "not None"
        r = cli("grant", ttl)  # a usage error, refused before anything is sent
        assert r.returncode == 2 and "argument ttl:" in r.stderr and f"not {float(ttl)!r}" in r.stderr, (ttl, r.stderr)
        with kv.Client(endpoints(c)) as client, pytest.raises(kv.BadRequest, match=re.escape(f"not {float(ttl)!r}")):
            client.lease_grant(float(ttl))  # the client checks too (JSON would carry inf and nan as null)
    r = cli("keepalive", str(lid), "--once")
    assert r.returncode != 0 and "does not exist" in r.stderr and "Traceback" not in r.stderr
