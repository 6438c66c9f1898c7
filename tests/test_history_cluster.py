"""The history from outside, on a real 3-node cluster: a paged list at one revision while
another process rewrites every key; a follower that installs a snapshot and then serves a
watch from far behind with the right prev_kv (etcd's API); Compact refusing reads below it
on every node. Every client is a separate OS process, as a user's would be.

The default run uses 20,000 keys; the soak run (--soak) the 100,000 of the issue."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import pytest

from cluster import ProcCluster
from kv.common.disk import dir_bytes
from kv.v3api.proto import rpc_pb2, rpc_pb2_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WRITER = """
import sys, kv
endpoints, tag, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
with kv.Client(endpoints.split(",")) as c:
    for lo in range(0, n, 128):
        c.put_many({f"h/{i:06d}": f"{tag}-{i}".encode() for i in range(lo, min(n, lo + 128))})
"""

PAGER = """
import json, sys, kv
endpoint, revision, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
pages, after = [], None
with kv.Client([endpoint]) as c:
    while True:
        page = c.scan_page("h/", after=after, limit=500, revision=revision, consistency="stale")
        if not page.items:
            break
        pages.append([page.index, [[it.key, it.value.decode(), it.mod_index] for it in page.items]])
        after = page.items[-1].key
with open(out, "w") as f:
    json.dump(pages, f)
"""


ERRORS = """
import json, sys, kv
endpoint, head = sys.argv[1], int(sys.argv[2])
out = {}
with kv.Client([endpoint]) as c:
    try:
        c.get("h/000000", revision=head - 1)
    except kv.RevisionCompacted as e:
        out["compacted"] = e.compact_revision
    try:
        c.scan_page("h/", revision=head + 10**9)
    except kv.FutureRevision as e:
        out["future"] = e.code
    items = list(c.scan("h/", revision=head, page=7, limit=20))
    out["scan"] = [[it.key, it.value.decode()] for it in items]
    out["get"] = c.get("h/000003", revision=head).value.decode()
print(json.dumps(out))
"""


def _python(code: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture
def keys(request) -> int:
    return 100_000 if request.config.getoption("--soak") or os.environ.get("KV_SOAK") else 20_000


def test_a_paged_list_at_one_revision_a_watch_from_far_behind_and_compact(tmp_path, keys):
    c = ProcCluster(str(tmp_path), 3, extra=["--snapshot-threshold", "100", "--snapshot-trailing", "10", "--auto-compaction-retention", "0"], proxies=False)
    grpc_addr = c.serve_etcd_api()
    try:
        c.start()
        leader = c.leader()
        follower = next(i for i in c.ids if i != leader)
        endpoints = ",".join(c.url(i) for i in c.ids)
        r = _python(WRITER, endpoints, "one", str(keys))
        assert r.returncode == 0, r.stderr
        revision = c.status(leader)["applied_index"]

        # Another process rewrites every key while this one pages through them at `revision`.
        rewriter = subprocess.Popen([sys.executable, "-c", WRITER, endpoints, "two", str(keys)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while c.status(leader)["applied_index"] < revision + 5 and time.monotonic() < deadline:
                time.sleep(0.05)  # the rewrite is under way before the paging starts
            # (pages read after the rewrite ends are checked against changed keys all the same:
            # what matters is that it has begun and has not ended when the paging starts)
            assert c.status(leader)["applied_index"] >= revision + 5 and rewriter.poll() is None, "the rewrite is not under way"
            r = _python(PAGER, c.url(follower), str(revision), str(tmp_path / "pages.json"))
            assert r.returncode == 0, r.stderr
            pages = json.loads((tmp_path / "pages.json").read_text())
        finally:
            assert rewriter.wait(timeout=600) == 0, rewriter.stderr.read()
        # a key's GET at the revision (the HTTP fast path's route) and now
        status, headers, body = c.request(follower, "GET", f"/v1/kv/h/000007?revision={revision}&consistency=stale")
        assert (status, body, headers["ETag"]) == (200, b"one-7", f'"{listed_mod(pages, "h/000007")}"')
        status, _, body = c.request(follower, "GET", "/v1/kv/h/000007")
        assert status == 200 and body == b"two-7"
        listed = [item for _, items in pages for item in items]
        assert len(pages) == keys // 500 and all(index == revision for index, _ in pages)
        assert [k for k, _, _ in listed] == [f"h/{i:06d}" for i in range(keys)]
        assert all(v == f"one-{k[2:].lstrip('0') or '0'}" and m <= revision for k, v, m in listed)

        # A follower stopped while the leader moves on (and compacts its ledger) comes back
        # through install-snapshot; it then serves a watch from far behind from the history.
        c.stop(follower)
        r = _python(WRITER, c.url(leader), "three", str(keys // 4))
        assert r.returncode == 0, r.stderr
        c.start(follower)
        head = c.status(leader)["applied_index"]
        deadline = time.monotonic() + 60
        while c.status(follower)["applied_index"] < head and time.monotonic() < deadline:
            time.sleep(0.2)
        status = c.status(follower)
        assert status["applied_index"] >= head and status["ledger_begin_index"] > revision, status  # it installed a snapshot
        channel = grpc.insecure_channel(grpc_addr[follower])
        try:
            watch = rpc_pb2_grpc.WatchStub(channel)
            req = rpc_pb2.WatchCreateRequest(key=b"h/", range_end=b"h0", start_revision=revision + 1, prev_kv=True)
            call = watch.Watch(iter([rpc_pb2.WatchRequest(create_request=req)]), timeout=120)
            assert next(call).created
            events = []
            while len(events) < keys + keys // 4:
                events += next(call).events
            call.cancel()
        finally:
            channel.close()
        assert len(events) == keys + keys // 4
        for n, ev in enumerate(events):
            i = n if n < keys else n - keys
            key, before, after = f"h/{i:06d}", ("one" if n < keys else "two"), ("two" if n < keys else "three")
            assert (ev.kv.key.decode(), ev.kv.value.decode(), ev.prev_kv.value.decode()) == (key, f"{after}-{i}", f"{before}-{i}")
            assert ev.prev_kv.mod_revision <= revision if n < keys else ev.prev_kv.mod_revision > revision
        assert events[0].kv.mod_revision > revision and events[-1].kv.mod_revision <= head

        # Compact at `head`: every node refuses a read below it; the history below is dropped.
        sizes = {i: dir_bytes(os.path.join(c.data_dir(i), "state")) for i in c.ids}
        status, _, body = c.request(follower, "POST", "/v1/compact", json.dumps({"revision": head}).encode(), {"Content-Type": "application/json"})
        assert status == 200 and json.loads(body) == {"compact_revision": head}
        for i in c.ids:
            deadline = time.monotonic() + 20
            while c.status(i)["compact_revision"] < head and time.monotonic() < deadline:
                time.sleep(0.1)
            status, _, body = c.request(i, "GET", f"/v1/kv?prefix=h/&limit=1&consistency=stale&revision={head - 1}")
            assert status == 410 and json.loads(body)["error"]["code"] == "COMPACTED", (i, body)
            status, _, body = c.request(i, "GET", f"/v1/kv?prefix=h/&limit=1&consistency=stale&revision={head}")
            assert status == 200 and json.loads(body)["items"][0]["value"] == "three-0"
        r = _python(ERRORS, c.url(follower), str(head))
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout) == {
            "compacted": head, "future": "FUTURE_REVISION", "get": "three-3",
            "scan": [[f"h/{i:06d}", f"three-{i}"] for i in range(20)],
        }
        time.sleep(3)  # the purge runs in batches, once a second
        after_sizes = {i: dir_bytes(os.path.join(c.data_dir(i), "state")) for i in c.ids}
        print(f"state bytes before compaction {sizes}, after {after_sizes}")
    finally:
        c.close()


def listed_mod(pages: list, key: str) -> int:
    return next(m for _, items in pages for k, _, m in items if k == key)
