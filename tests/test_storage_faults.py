"""Damaged files and full disks: detected, recovered from snapshots and the ledger (or from
peers), or refused with a clear message — never wrong data, never a lost acknowledgement."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import struct
import subprocess
import time
import sys

import pytest
from inproc import InprocCluster

import kv
from kv.statemachine.leveldb import StateCorrupt


def flip(path: str, at: float = 0.5) -> None:
    with open(path, "r+b") as f:
        f.seek(0, 2)
        pos = int(f.tell() * at)
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0xFF]))


def truncate(path: str, keep: float = 0.6) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))


async def test_a_damaged_snapshot_is_refused_at_install_and_the_leader_replaces_it(tmp_path):
    c = InprocCluster(str(tmp_path), snapshot_threshold=200, snapshot_trailing=10)
    await c.start()
    try:
        lead = await c.leader()
        lag = (await c.followers())[0].config.id
        await c.stop(lag)
        for i in range(500):
            await lead.put(f"k{i:03d}", b"x" * 3000)  # several 1 MiB blocks
        newest = lead.snapshots.newest_meta()
        flip(newest.path)
        await c.start(lag)
        await c.wait_applied(lead.raft.applied_index, timeout=30)
        follower = c.nodes[lag]
        assert follower.snapshots.stats.install_rejected >= 1  # the damaged one was refused
        assert follower.snapshots.stats.installed == 1  # then a good one came
        assert os.path.exists(newest.path + ".corrupt")  # the leader set its bad file aside
        assert c.data(lag) == c.data(lead.config.id)
    finally:
        await c.stop()


def fill(path: str, n: int, **opts) -> dict:
    acked = {}
    with kv.open(path, **opts) as db:
        for i in range(n):
            acked[f"k{i}"] = db.put(f"k{i}", b"v%d" % i).index
    return acked


def mark_damaged(path: str) -> None:
    with open(os.path.join(path, "state", "DAMAGED"), "w") as f:
        f.write("test\n")


def check_all(path: str, acked: dict) -> None:
    with kv.open(path) as db:
        for k, idx in acked.items():
            item = db.get(k)
            assert item is not None and item.mod_index == idx, k


def test_damaged_state_is_rebuilt_from_snapshot_and_ledger(tmp_path):
    path = str(tmp_path / "db")
    acked = fill(path, 700, snapshot_threshold=200, snapshot_trailing=500)
    mark_damaged(path)
    check_all(path, acked)
    assert glob.glob(os.path.join(path, "state.damaged-*"))


def test_an_unopenable_leveldb_is_rebuilt(tmp_path):
    path = str(tmp_path / "db")
    acked = fill(path, 300, snapshot_threshold=100, snapshot_trailing=50)
    for name in glob.glob(os.path.join(path, "state", "MANIFEST-*")):
        with open(name, "wb") as f:
            f.write(b"garbage")
    check_all(path, acked)


def test_corruption_found_while_reading_is_an_error_then_a_rebuild(tmp_path):
    path = str(tmp_path / "db")
    acked = fill(path, 2000, snapshot_threshold=500, snapshot_trailing=1000)
    with kv.open(path) as db:
        db._node.sm._db.compact_range()  # everything into table files
    tables = sorted(glob.glob(os.path.join(path, "state", "*.ldb")), key=os.path.getsize)
    # Data blocks of user keys. (Blocks the open reads, with the lease and session records,
    # make the open itself rebuild: test_an_unopenable_leveldb_is_rebuilt.)
    for frac in (0.7, 0.8, 0.9):
        flip(tables[-1], frac)
    errors = 0
    with kv.open(path) as db:
        for i in range(2000):
            try:
                item = db.get(f"k{i}")
            except kv.Unavailable as e:
                assert "damaged" in str(e)
                errors += 1
                continue
            assert item is not None and item.value == b"v%d" % i  # never a wrong value
    assert errors > 0
    check_all(path, acked)  # the marker made this start rebuild
    assert glob.glob(os.path.join(path, "state.damaged-*"))


def test_a_truncated_newest_snapshot_falls_back_to_an_older_one(tmp_path):
    path = str(tmp_path / "db")
    acked = fill(path, 700, snapshot_threshold=200, snapshot_trailing=500)
    snaps = sorted(glob.glob(os.path.join(path, "snapshots", "snap-*.lkvs")))
    assert len(snaps) >= 2
    truncate(snaps[-1])
    mark_damaged(path)
    check_all(path, acked)
    assert os.path.exists(snaps[-1] + ".corrupt")


def test_without_a_covering_snapshot_the_node_refuses_with_a_clear_message(tmp_path):
    path = str(tmp_path / "db")
    fill(path, 700, snapshot_threshold=200, snapshot_trailing=10)
    for s in glob.glob(os.path.join(path, "snapshots", "snap-*.lkvs")):
        truncate(s)
    mark_damaged(path)
    with pytest.raises(StateCorrupt, match="cannot be rebuilt here.*kv snapshot save"):
        kv.open(path)


def test_ledger_map_full_stops_the_node_without_losing_acknowledged_writes(tmp_path):
    path = str(tmp_path / "db")
    acked = {}
    # The write whose ledger write failed never reached the only voter's log: it was not
    # carried out (Unavailable), which is true, not "outcome unknown".
    with pytest.raises(kv.Unavailable, match="not carried out"):
        with kv.open(path, ledger_map_size=1 << 20, snapshot_threshold=1 << 30) as db:
            for i in range(100_000):
                acked[f"k{i}"] = db.put(f"k{i}", b"x" * 500).index
    assert len(acked) > 100
    check_all(path, acked)  # reopened with the default map size
    with kv.open(path) as db:
        assert db.get(f"k{len(acked)}") is None


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs here ({r.stderr.decode().strip()}); this test needs root")
    yield mnt
    subprocess.run(["umount", str(mnt)], capture_output=True)


def test_a_disk_below_its_reserve_refuses_writes_serves_reads_and_resumes_by_itself(small_disk):
    """etcd's NOSPACE alarm: a node below --min-free-bytes takes no writes (507 NO_SPACE,
    nothing written), still serves reads, and takes writes again once there is room."""
    path = str(small_disk / "db")
    acked = {}
    with kv.open(path, snapshot_threshold=1 << 30, min_free_bytes=2 << 20) as db:
        with pytest.raises(kv.NoSpace, match="less than the node keeps in reserve .*--min-free-bytes.*resume by themselves"):
            for i in range(100_000):
                acked[f"k{i}"] = db.put(f"k{i}", b"y" * 1000).index  # as fast as it goes: the reserve holds all the same
        assert len(acked) > 100
        assert db.get("k0").value == b"y" * 1000  # reads go on
        assert db.status()["alarms"][0]["alarm"] == "NOSPACE"
        with pytest.raises(kv.NoSpace):
            db.put("refused", b"x")
        subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
        deadline = time.monotonic() + 10
        while True:  # within the guard's next look at the disk
            try:
                acked["after"] = db.put("after", b"room again").index
                break
            except kv.NoSpace:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert db.status()["alarms"] == [] and db.get("refused") is None
    check_all(path, acked)


def test_a_disk_that_fills_mid_write_stalls_the_node_which_goes_on_when_there_is_room(small_disk):
    """Without a reserve the disk fills under LMDB or LevelDB in the middle of a write: the
    node stays up, says so, tries again, and loses nothing acknowledged."""
    path = str(small_disk / "db")
    acked, failed = {}, None
    db = kv.open(path, snapshot_threshold=1 << 30, min_free_bytes=0, write_timeout_s=2)
    try:
        for i in range(100_000):
            try:
                acked[f"k{i}"] = db.put(f"k{i}", b"z" * 1000).index
            except kv.KVError as e:
                failed = (f"k{i}", e)
                break
        assert len(acked) > 100 and isinstance(failed[1], (kv.NoSpace, kv.Timeout)), failed
        assert db.get("k0").value == b"z" * 1000
        assert db.status()["alarms"][0]["alarm"] == "NOSPACE"  # the stalled write says why
        subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
        deadline = time.monotonic() + 15
        while True:
            try:
                acked["after"] = db.put("after", b"room again").index
                break
            except (kv.NoSpace, kv.Timeout):
                assert time.monotonic() < deadline
                time.sleep(0.2)
        # The write in flight when the disk filled: a Timeout (outcome unknown) may have
        # been applied once the write went through; NoSpace never.
        if isinstance(failed[1], kv.NoSpace):
            assert db.get(failed[0]) is None
    finally:
        db.close()
    check_all(path, acked)


def test_a_damaged_ledger_is_reported_at_start(tmp_path):
    path = str(tmp_path / "n1")
    acked = fill(path, 50)
    assert acked
    with open(os.path.join(path, "ledger", "data.mdb"), "r+b") as f:
        for meta_page in (0, 4096):  # both LMDB meta pages
            f.seek(meta_page + 16)
            f.write(os.urandom(64))
    r = subprocess.run(
        [sys.executable, "-m", "kv", "serve", "--id", "local", "--data-dir", path, "--http", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 1
    assert "cannot open the ledger" in r.stderr and "Traceback" not in r.stderr



def test_a_truncated_ledger_is_refused_with_one_line_not_a_sigbus(tmp_path):
    path = str(tmp_path / "n1")
    fill(path, 3000)
    ledger = os.path.join(path, "ledger", "data.mdb")
    size = os.path.getsize(ledger)
    os.truncate(ledger, size // 2)
    r = subprocess.run(
        [sys.executable, "-m", "kv", "serve", "--id", "local", "--data-dir", path, "--http", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 1, (r.returncode, r.stderr)  # not -7 (SIGBUS)
    assert "was cut short" in r.stderr and f"is {size // 2} bytes" in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1


async def test_a_ledger_write_that_finds_the_disk_full_waits_and_goes_through(tmp_path):
    """The write path the reserve guards against, made to happen: the ledger's write fails
    for lack of space three times; the node stays up, refuses other writes meanwhile (507),
    and the write in flight commits once the ledger takes it."""
    from kv.raft.errors import LedgerError

    node = kv.Node(id="n1", data_dir=str(tmp_path / "n1"), min_free_bytes=0)
    await node.start()
    try:
        await node.wait_leader(timeout=10)
        await node.put("before", b"1")
        real, fails = node.ledger.write, [3]

        def full_three_times(writes):
            if fails[0]:
                fails[0] -= 1
                raise LedgerError("writing the ledger failed: mdb_txn_commit: No space left on device")
            return real(writes)

        node.ledger.write = full_three_times
        pending = asyncio.ensure_future(node.put("during", b"2", timeout=20))
        await asyncio.sleep(0.5)
        assert node.status()["alarms"][0]["alarm"] == "NOSPACE" and not pending.done()
        with pytest.raises(kv.NoSpace, match="is full"):
            await node.put("refused", b"3")
        w = await pending
        assert (await node.get("during")).mod_index == w.index and fails == [0]
        assert node.status()["alarms"] == [] and await node.get("refused") is None
    finally:
        await node.stop()


def test_a_full_disk_while_an_upgrade_folds_meta_records_is_no_damage(small_disk, tmp_path):
    """An earlier version's state (a changed key's create_revision and version in a meta
    record of its own) is folded into the keys' records when it opens: a disk that fills
    meanwhile says so (StateUpgradeFailed), the state is not set aside as damaged, and once
    there is room it opens, folds the rest, and reads every key's versions."""
    import shutil

    import plyvel

    from kv.statemachine import commands as c
    from kv.statemachine import leveldb as L
    from kv.raft.messages import Entry, EntryKind

    built = str(tmp_path / "built")
    sm = L.LevelDBStateMachine(built)
    sm.apply([Entry(i, 1, EntryKind.NORMAL, c.encode(c.Put(f"k{i:05d}", b"v" * 500))) for i in range(1, 12_001)])
    sm.close()
    db = plyvel.DB(built)  # as an earlier version left it: every key changed once more, versions beside
    wb = db.write_batch()
    wb.delete(L._STATE_FORMAT)
    for i in range(1, 12_001):
        key = b"k%05d" % i
        wb.put(b"k" + key, struct.pack(">Q", 20_000 + i) + b"w" * 500)
        wb.put(L._META + key, struct.pack(">QQQ", 20_000 + i, i, 2))
    wb.write()
    db.compact_range()
    db.close()
    used = sum(os.path.getsize(p) for p in glob.glob(os.path.join(built, "*")))
    subprocess.run(["mount", "-o", f"remount,size={used + (1 << 20)}", str(small_disk)], check=True)
    state = str(small_disk / "state")
    shutil.copytree(built, state)
    with pytest.raises(L.StateUpgradeFailed, match="free disk space .*start again; nothing is lost"):
        L.LevelDBStateMachine(state)
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    sm = L.LevelDBStateMachine(state)
    try:
        assert not list(sm._db.iterator(prefix=L._META))
        assert sm.range(c.RangeReq(b"k00001")).kvs == (c.KeyValue("k00001", 1, 20_001, 2, b"w" * 500, 0),)
        assert sm.range(c.RangeReq(b"k12000")).kvs == (c.KeyValue("k12000", 12_000, 32_000, 2, b"w" * 500, 0),)
        assert sm.count() == 12_000
    finally:
        sm.close()


def test_a_state_written_by_a_later_version_is_refused_not_rebuilt(tmp_path):
    import plyvel

    from kv.statemachine import leveldb as L

    path = str(tmp_path / "state")
    L.LevelDBStateMachine(path).close()
    db = plyvel.DB(path)
    db.put(L._STATE_FORMAT, b"%d" % (L.STATE_FORMAT + 1))
    db.close()
    with pytest.raises(L.StateTooNew, match="written by a later ledgerkv .*run that version or a later one"):
        L.LevelDBStateMachine(path)
    assert os.path.exists(path) and not issubclass(L.StateTooNew, StateCorrupt)


def test_a_state_that_cannot_be_opened_for_a_full_disk_is_not_taken_for_damaged(small_disk):
    """A node restarted on a full disk: LevelDB cannot write its new log file. That is no
    damage: the state stays where it is (it was moved aside, a copy left on the full disk,
    and the node exited naming the damage), and the error says to free space."""
    from kv.statemachine import commands as c
    from kv.statemachine import leveldb as L
    from kv.raft.messages import Entry, EntryKind

    state = str(small_disk / "state")
    sm = L.LevelDBStateMachine(state)
    sm.apply([Entry(i, 1, EntryKind.NORMAL, c.encode(c.Put(f"k{i}", b"v" * 100))) for i in range(1, 101)])
    sm.close()
    filler = small_disk / "filler"
    with open(filler, "wb") as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
    with pytest.raises(kv.NoSpace, match="its disk is full .*Free space on it and start the node again; nothing is lost"):
        L.LevelDBStateMachine(state)
    filler.unlink()
    sm = L.LevelDBStateMachine(state)
    try:
        assert sm.count() == 100 and sm.get("k100")[1] == b"v" * 100
    finally:
        sm.close()
