"""Data written by an earlier main opens with this code (docs/design.md, Upgrades): a store made
by b06ecfc (before client sessions and random lease ids), with a lease, a transaction, a
snapshot and entries after it, kept as tests/fixtures/store-b06ecfc.tar.gz (its
expected.json: every key's value and mod_index, the lease's id); and one made by 1bfdc6d
(a changed key's create_revision and version in a meta record of its own, not yet in the
key's record), tests/fixtures/store-1bfdc6d.tar.gz (its expected.json: every key's value,
create_revision, mod_revision and version)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tarfile

import kv

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "store-b06ecfc.tar.gz")
WITH_META_RECORDS = os.path.join(os.path.dirname(__file__), "fixtures", "store-1bfdc6d.tar.gz")


def unpack(tmp_path, fixture: str = FIXTURE) -> tuple[str, dict]:
    with tarfile.open(fixture) as t:
        t.extractall(tmp_path, filter="data")
    with open(tmp_path / "expected.json") as f:
        return str(tmp_path / "db"), json.load(f)


def test_a_store_from_before_sessions_opens_reads_and_writes(tmp_path):
    path, want = unpack(tmp_path)
    with kv.open(path) as db:
        assert {it.key: [it.value.decode(), it.mod_index] for it in db.scan("")} == want["keys"]
        lease = db.lease_info(want["lease"])  # its id is the index of its grant, as it was
        assert lease.keys == ("leased/a",)
        w = db.put("new/1", b"after the upgrade")
        db.cas("new/1", w.index, b"again")
        fresh = db.lease_grant(10)
        assert fresh.id > 1 << 20  # new leases get random ids
        db.lease_revoke(want["lease"])
        assert db.get("leased/a") is None
    with kv.open(path) as db:  # and again, with this code's records in it
        assert db.get("new/1").value == b"again" and db.get("k/069").value == b"v69"
        assert db.status()["applied_index"] > want["applied"]


def test_a_snapshot_file_from_before_sessions_restores(tmp_path):
    path, want = unpack(tmp_path)
    (snap,) = sorted(glob.glob(os.path.join(path, "snapshots", "snap-*.lkvs")))[-1:]
    r = subprocess.run(
        [sys.executable, "-m", "kv", "snapshot", "restore", snap, "--data-dir", str(tmp_path / "restored"), "--id", "local", "--peers", "local=127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    with kv.open(str(tmp_path / "restored")) as db:
        got = {it.key: it.value.decode() for it in db.scan("")}
        assert got["leased/a"] == "held" and got["t/1"] == "x" and "k/000" not in got
        assert db.lease_info(want["lease"]).keys == ("leased/a",)


def test_keys_from_before_their_meta_records_report_etcd_versions_and_count_on(tmp_path):
    """A key written before the state kept create_revision and version (its meta record)
    reports its mod_index as its create_revision and version 1, and counts on from there."""
    from kv.raft.messages import Entry, EntryKind
    from kv.statemachine import commands as c
    from kv.statemachine.leveldb import LevelDBStateMachine

    path, want = unpack(tmp_path)
    with kv.open(path):
        pass  # replays the fixture's ledger tail with this code
    sm = LevelDBStateMachine(os.path.join(path, "state"))
    try:
        value, mod = want["keys"]["k/069"]
        (old,) = sm.range(c.RangeReq(b"k/069")).kvs
        assert (old.value.decode(), old.create_revision, old.mod_revision, old.version) == (value, mod, mod, 1)
        index = sm.applied()[0] + 1
        r = sm.apply([Entry(index, 99, EntryKind.NORMAL, c.encode(c.TxnReq((), (c.PutReq(b"k/069", b"new", prev_kv=True),), ())))])[0]
        assert r.responses[0].prev_kv == old
        (now,) = sm.range(c.RangeReq(b"k/069")).kvs
        assert (now.create_revision, now.mod_revision, now.version) == (mod, index, 2)
    finally:
        sm.close()


def _versions(state: str) -> tuple[dict, int]:
    """Every user key of a state dir: [value, create_revision, mod_revision, version]; and
    how many meta records it still holds."""
    from kv.statemachine import commands as c
    from kv.statemachine.leveldb import LevelDBStateMachine

    sm = LevelDBStateMachine(state)
    try:
        got = {kv.key: [kv.value.decode(), kv.create_revision, kv.mod_revision, kv.version] for kv in sm.range(c.RangeReq(b"\x01", b"\x00")).kvs}
        return got, sum(1 for _ in sm._db.iterator(prefix=b"k\x00meta/"))
    finally:
        sm.close()


def test_a_store_with_meta_records_keeps_every_keys_versions_and_counts_on(tmp_path):
    path, want = unpack(tmp_path, WITH_META_RECORDS)
    with kv.open(path) as db:
        assert {it.key: it.value.decode() for it in db.scan("")} == {k: v[0] for k, v in want["keys"].items()}
        w = db.put("k/000", b"after the upgrade")
        assert db.lease_info(want["lease"]).keys == ("leased/a",)
    got, metas = _versions(os.path.join(path, "state"))
    assert metas == 0  # folded into the keys' records
    assert got.pop("k/000") == ["after the upgrade", want["keys"]["k/000"][1], w.index, want["keys"]["k/000"][3] + 1]
    assert got == {k: v for k, v in want["keys"].items() if k != "k/000"}
    assert want["keys"]["k/005"][3] == 3 and want["keys"]["k/090"][1:] == [want["keys"]["k/090"][2]] * 2 + [1]  # (what the fixture holds)


def test_a_snapshot_file_with_meta_records_restores_every_keys_versions(tmp_path):
    path, want = unpack(tmp_path, WITH_META_RECORDS)
    (snap,) = glob.glob(os.path.join(path, "snapshots", "snap-*.lkvs"))
    r = subprocess.run(
        [sys.executable, "-m", "kv", "snapshot", "restore", snap, "--data-dir", str(tmp_path / "restored"), "--id", "local", "--peers", "local=127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    got, metas = _versions(str(tmp_path / "restored" / "state"))
    assert metas == 0
    # as of the snapshot: keys k/010..k/019 changed once more after it
    later = {f"k/{i:03d}" for i in range(10, 20)}
    assert {k: v for k, v in got.items() if k not in later} == {k: v for k, v in want["keys"].items() if k not in later}
    assert got["k/015"] == ["v1-15", want["keys"]["k/015"][1], got["k/015"][2], 2] and got["k/015"][2] < want["keys"]["k/015"][2]
