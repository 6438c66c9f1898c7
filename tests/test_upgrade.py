"""Data written by an earlier main opens with this code (docs/design.md, Upgrades): a store made
by b06ecfc (before client sessions and random lease ids), with a lease, a transaction, a
snapshot and entries after it, kept as tests/fixtures/store-b06ecfc.tar.gz (its
expected.json: every key's value and mod_index, the lease's id)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tarfile

import kv

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "store-b06ecfc.tar.gz")


def unpack(tmp_path) -> tuple[str, dict]:
    with tarfile.open(FIXTURE) as t:
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
