"""kv.open(): the embedded single-node store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import kv


@pytest.fixture
def db(tmp_path):
    with kv.open(str(tmp_path / "db")) as s:
        yield s


def test_store_api(db):
    w = db.put("users/1", b"ada")
    assert db.get("users/1") == kv.Item("users/1", b"ada", w.index)
    assert db.get("nope") is None
    w2 = db.cas("users/1", w.index, b"ada lovelace")
    with pytest.raises(kv.PreconditionFailed):
        db.cas("users/1", w.index, b"stale write")
    with pytest.raises(kv.PreconditionFailed):
        db.put("users/1", b"x", if_absent=True)
    assert db.get("users/1").value == b"ada lovelace"
    assert db.delete("users/1", if_mod_index=w2.index).deleted
    r = db.txn([kv.Cond("users/2", "exists", False)], [kv.Put("users/2", b"bob"), kv.Put("users/3", b"cy")])
    assert r.succeeded and [i.key for i in db.scan("users/")] == ["users/2", "users/3"]
    r = db.put_many({f"bulk/{i:04d}": b"%d" % i for i in range(1000)})
    assert len(list(db.scan("bulk/"))) == 1000 and len(list(db.scan("bulk/", limit=10))) == 10


def test_bad_input_is_refused(db):
    with pytest.raises(kv.BadRequest):
        db.put("", b"x")
    with pytest.raises(kv.BadRequest):
        db.put("k", "not bytes")
    with pytest.raises(kv.ValueTooLarge):
        db.put("k", b"x" * (2 << 20))
    assert db.get("k") is None


def test_concurrent_writers_share_fsyncs(db):
    before = db._node.raft.stats["writes"]

    def writer(t):
        for j in range(50):
            db.put(f"t{t}/{j}", b"v")

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(16)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    fsyncs = db._node.raft.stats["writes"] - before
    assert len(list(db.scan("t"))) == 800
    assert fsyncs < 800  # group commit: many writes per fsync


def test_watch(db):
    db.put("cfg/a", b"1")
    start = db.status()["applied_index"]
    threading.Timer(0.2, lambda: (db.put("cfg/b", b"2"), db.put("zzz", b"x"), db.delete("cfg/a"))).start()
    events = []
    for ev in db.watch("cfg/", timeout=2.0):
        events.append(ev)
        if len(events) == 2:
            break
    assert [(e.type, e.key) for e in events] == [("put", "cfg/b"), ("delete", "cfg/a")]
    assert events[0].index > start


def test_reopen_keeps_everything_and_snapshots_compact(tmp_path):
    path = str(tmp_path / "db")
    with kv.open(path, snapshot_threshold=500, snapshot_trailing=50) as s:
        for i in range(1200):
            s.put(f"k{i}", b"v%d" % i)
        st = s.status()
        assert st["snapshot_index"] > 0 and st["ledger_begin_index"] > 0
    with kv.open(path) as s:
        assert s.get("k1199").value == b"v1199" and len(list(s.scan("k"))) == 1200


def test_a_cluster_data_dir_is_not_silently_reused(tmp_path):
    path = str(tmp_path / "db")
    kv.open(path).close()
    with pytest.raises(kv.raft.errors.LedgerError, match="belongs to node"):
        kv.open(path, id="someone-else")


WRITER = r"""
import sys, kv
db = kv.open(sys.argv[1])
i = 0
while True:
    db.put(f"k{i}", b"v%d" % i)
    print(i, flush=True)   # acknowledged: put() returned
    i += 1
"""


def test_every_acknowledged_write_survives_kill9(tmp_path):
    path = str(tmp_path / "db")
    for round_ in range(3):
        p = subprocess.Popen([sys.executable, "-c", WRITER, path], stdout=subprocess.PIPE, text=True)
        acked = -1
        # Kill it mid-stream after some acknowledged writes (counted, not timed: a loaded
        # machine may take seconds just to start the interpreter).
        deadline = time.monotonic() + 60
        while acked < 20 + round_ * 50 and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            acked = int(line)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        for line in p.stdout:  # acknowledged before the kill, still in the pipe
            acked = int(line)
        assert acked > 10
        with kv.open(path) as s:
            missing = [i for i in range(acked + 1) if s.get(f"k{i}") is None]
            assert missing == []
