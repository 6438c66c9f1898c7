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


def test_a_key_of_bytes_that_are_not_utf8_is_a_str_with_lone_surrogates(db):
    """As Python holds undecodable file names (PEP 383); what etcd's clients may write."""
    raw = b"bin/\xff\x00"
    key = raw.decode("utf-8", "surrogateescape")
    w = db.put(key, b"v")
    assert db.get(key) == kv.Item(key, b"v", w.index)
    assert [(i.key, i.key.encode("utf-8", "surrogateescape")) for i in db.scan("bin/")] == [(key, raw)]
    with pytest.raises(kv.BadRequest, match="stands for no byte"):
        db.put("bin/\ud800", b"x")
    with pytest.raises(kv.BadRequest, match="write the key as 'bin/é'"):
        db.put("bin/\udcc3\udca9", b"x")


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


def test_lock_on_lost_runs_off_the_loop_only_for_a_held_lock(db):
    """kv.open's lock(on_lost=): told once the held lock's lease is revoked, on a thread
    where the blocking API works; a waiter whose lease goes is not "lost" a lock it never
    held: its acquire fails at once instead; a normal release tells nothing."""
    import threading

    told: list[tuple[str, str]] = []
    done = threading.Event()

    def on_lost(err):
        db.put("lost-marker", b"written from on_lost")  # a blocking write: on the loop's thread it would hang
        told.append((type(err).__name__, db.get("lost-marker").value.decode()))
        done.set()

    lock = db.lock("jobs", ttl=30, on_lost=on_lost)
    assert not lock.held
    with lock:
        assert lock.held
        waiter = db.lock("jobs", ttl=1.5, timeout=60, on_lost=on_lost)  # its keepalive (every 0.5 s) notices
        failed: list[BaseException] = []

        def wait() -> None:
            try:
                waiter.acquire()
            except BaseException as e:
                failed.append(e)

        t = threading.Thread(target=wait)
        t.start()
        wait_for = time.monotonic() + 10
        while len(list(db.scan("jobs/"))) < 2 and time.monotonic() < wait_for:
            time.sleep(0.01)
        second = max(db.scan("jobs/"), key=lambda it: it.mod_index)
        db.lease_revoke(int(second.key.rsplit("/", 1)[1], 16))
        t.join(10)
        # At its next keepalive, while the lock is still held: not once the holder lets go.
        assert not t.is_alive() and len(failed) == 1 and isinstance(failed[0], kv.LeaseNotFound), failed
        assert told == [] and not waiter.held

        db.lease_revoke(int(lock.key.rsplit("/", 1)[1], 16))
        assert done.wait(10)
        assert told == [("LeaseNotFound", "written from on_lost")] and not lock.held
    assert not lock.held

    again = db.lock("jobs", ttl=30, on_lost=on_lost)
    with again:
        assert again.held
    assert not again.held and len(told) == 1  # released, not lost


def test_a_blocking_call_from_the_stores_own_loop_thread_is_refused(db):
    """Rather than waiting on itself for ever (an on_lost of the async API calling the
    blocking one, say)."""
    got: list[BaseException] = []

    async def calls_back():
        try:
            db.put("x", b"1")
        except RuntimeError as e:
            got.append(e)

    db._lt.call(calls_back())
    assert len(got) == 1 and "wait on itself" in str(got[0])


def test_list_then_watch_on_an_embedded_store(tmp_path):
    with kv.open(str(tmp_path / "db")) as db:
        for i in range(3):
            db.put(f"p/{i}", b"v")
        page = db.scan_page("p/", limit=10)
        assert [it.key for it in page.items] == ["p/0", "p/1", "p/2"] and page.index == db.status()["applied_index"]
        db.put("p/3", b"new")
        events = list(db.watch("p/", page.index + 1, timeout=1))  # positional, as on kv.Client
        assert [(e.key, e.value) for e in events] == [("p/3", b"new")]
        with pytest.raises(kv.BadRequest, match="consistency"):
            db.get("p/0", consistency="sometimes")


def test_a_path_that_is_a_file_is_refused_as_a_data_dir_with_a_kv_error(tmp_path):
    """python-api.md: every error is a kv.KVError (it was a bare FileExistsError)."""
    f = tmp_path / "f"
    f.write_text("not a directory")
    with pytest.raises(kv.BadRequest, match="it is a file"):
        kv.open(str(f))
    with pytest.raises(kv.BadRequest, match="a directory on its path is a file"):
        kv.open(str(f / "sub"))
    assert f.read_text() == "not a directory"


def _stopped_member(data_dir) -> None:
    """Leave a stopped member of a three-node cluster (its ledger written) in data_dir."""
    import asyncio

    from kv import Node, NodeConfig
    from kv.bench.harness import free_port

    async def member() -> None:
        peers = {i: f"127.0.0.1:{free_port()}" for i in ("n1", "n2", "n3")}
        node = Node(NodeConfig(id="n1", data_dir=str(data_dir), peers=peers))
        await node.start()
        await node.stop()

    asyncio.run(member())


def test_a_cluster_members_data_dir_is_refused_at_once(tmp_path):
    """A stopped cluster member's data dir, opened with its id (what the error for the
    wrong id suggests): refused in one line, not a wait for a leader that one member of
    three can never elect (it hung for good)."""
    _stopped_member(tmp_path / "n1")
    with pytest.raises(kv.BadRequest, match=r"member 'n1' of a cluster of 3 \(n1, n2, n3\).*kv serve"):
        kv.open(str(tmp_path / "n1"), id="n1")
    with pytest.raises(kv.KVError, match="belongs to node 'n1'"):
        kv.open(str(tmp_path / "n1"))


def test_the_dir_of_kv_cluster_up_is_not_a_members_and_the_other_way_round(tmp_path):
    """kv.open (or kv serve, or a restore) given the parent of stopped members' dirs, kv
    cluster up's --data-dir: refused, naming them; it made an empty store beside them. And
    kv cluster up given a member's own dir: refused, not three members made inside it."""
    import subprocess
    import sys

    from kv.bench.harness import free_port

    _stopped_member(tmp_path / "n1")
    (tmp_path / "n2").mkdir()  # (a dir no node ran in is not named)
    with pytest.raises(kv.BadRequest, match=r"is not a member's data dir: it holds those of n1 \(kv cluster up's layout\)"):
        kv.open(str(tmp_path))
    assert not (tmp_path / "ledger").exists() and not (tmp_path / "state").exists()

    def kv_cli(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kv", *argv], capture_output=True, text=True, timeout=60)

    served = kv_cli("serve", "--id", "n9", "--data-dir", str(tmp_path), "--http", f"127.0.0.1:{free_port()}")
    assert served.returncode != 0 and "it holds those of n1" in served.stderr, served.stderr
    up = kv_cli("cluster", "up", "--data-dir", str(tmp_path / "n1"), "--base-port", str(free_port()))
    assert up.returncode != 0 and "is a member's data dir (it holds a ledger)" in up.stderr, up.stderr
    assert not (tmp_path / "ledger").exists() and not (tmp_path / "n1" / "n1").exists()


def test_a_snapshot_file_of_another_cluster_is_set_aside(tmp_path):
    """A snapshot file copied in by hand from another cluster (a fault review's) was taken
    for the node's newest: its index beyond the node's log, handed out by kv snapshot save
    as a backup, installed on a node that joined, and no snapshot was taken after it. It is
    set aside as *.foreign, named in the log; the node's own files are kept."""
    import shutil

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with kv.open(a) as db:
        for i in range(40):
            db.put(f"a/{i}", b"theirs")
        theirs = db.snapshot()
    with kv.open(b) as db:
        db.put("b", b"ours")
        ours = db.snapshot()
    assert theirs.index > ours.index
    copied = shutil.copy(theirs.path, os.path.join(b, "snapshots"))
    with kv.open(b) as db:
        assert db.status()["snapshot_index"] == ours.index
        assert db.get("b").value == b"ours" and db.get("a/1") is None
        assert db.snapshot().index > ours.index  # (taken anew: none newer in the way)
    assert not os.path.exists(copied) and os.path.exists(copied + ".foreign")
    assert os.path.exists(ours.path)


def test_a_snapshot_carries_the_ids_removed_from_the_cluster(tmp_path):
    """A node whose state is replaced by a snapshot (installed from the leader, or rebuilt
    when damaged) keeps refusing the old data dirs of members removed before it: the
    snapshot's header lists them. Files without the list (before 2026-12-07) read as none,
    and a list that is not one is refused as damage."""
    import io
    import json

    from kv.snapshot.format import SnapshotFormatError, new_header, read_header, write_snapshot

    def written(header) -> io.BytesIO:
        f = io.BytesIO()
        write_snapshot(f, header, [])
        return f

    got, _ = read_header(written(new_header(9, 2, b"[]", "default", "n1", "c" * 16, {"n7", "n4"})))
    assert got.removed == ("n4", "n7")
    got, _ = read_header(written(new_header(9, 2, b"[]", "default", "n1")))
    assert got.removed == () and "removed" not in got.to_json()
    bad = json.dumps({**new_header(9, 2, b"[]", "default", "n1").to_json(), "removed": "n4"}).encode()
    f = io.BytesIO(b"".join([written(new_header(9, 2, b"[]", "default", "n1")).getvalue()[:8], len(bad).to_bytes(4, "big"), bad]))
    with pytest.raises(SnapshotFormatError, match="removed must be a list"):
        read_header(f)


def test_a_join_cut_short_before_its_answer_was_kept_is_not_taken_for_a_new_cluster(tmp_path):
    """kv serve keeps the cluster's answer to a join (joined.json) before the node starts.
    Killed while writing it, the data dir holds only joined.json.tmp, and a start without
    --join would have begun a one-node cluster of its own there (a newcomer's run): it is
    refused, naming what to run; with --join the join is made again. A kept answer is
    read back whole."""
    from kv.raft.membership import Member, Membership
    from kv.server.join import JOINED_FILE, Joined, keep_join, kept_join

    d = str(tmp_path / "n4")
    os.makedirs(d)
    assert kept_join(d, joining=False) is None
    with open(os.path.join(d, JOINED_FILE + ".tmp"), "w") as f:
        f.write('{"members": [')
    with pytest.raises(kv.BadRequest, match="cut short.*run the same command with --join URL again"):
        kept_join(d, joining=False)
    assert kept_join(d, joining=True) is None  # (kv serve --join joins again and keeps the new answer)
    joined = Joined(Membership.of([Member("n1", "h:1", "http://h:2", ledger="ab" * 8), Member("n4", "h:3", voter=False)]), 12, "cd" * 8, frozenset({"n2"}))
    keep_join(d, joined)
    assert kept_join(d, joining=False) == joined
