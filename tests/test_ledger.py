"""The LMDB ledger: entries, hard state, truncation, compaction, group commit, corruption."""

from __future__ import annotations

import os

import lmdb
import pytest

from kv.raft.errors import LedgerError
from kv.raft.ledger import Ledger, LedgerWrite
from kv.raft.membership import is_ledger_id
from kv.raft.messages import Entry, EntryKind, HardState


def entries(start: int, terms: list[int], data=b"v") -> list[Entry]:
    return [Entry(start + i, t, EntryKind.NORMAL, data + b"%d" % (start + i)) for i, t in enumerate(terms)]


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "ledger")


def test_append_read_and_reopen(path):
    led = Ledger(path, "n1")
    led.write([LedgerWrite(HardState(3, "n2"), None, 1, entries(1, [1, 1, 2, 3]))])
    assert led.last_index() == 4 and [led.term(i) for i in range(1, 5)] == [1, 1, 2, 3]
    assert led.entries(2, 4, 1 << 20) == entries(2, [1, 2])
    led.close()
    led = Ledger(path, "n1")
    assert led.hard_state() == HardState(3, "n2")
    assert led.last_index() == 4 and led.term(3) == 2 and led.entries(1, 5, 1 << 20) == entries(1, [1, 1, 2, 3])


def test_group_commit_applies_writes_in_order_in_one_transaction(path):
    led = Ledger(path, "n1")
    led.write(
        [
            LedgerWrite(HardState(1, "n1"), None, 1, entries(1, [1, 1, 1])),
            LedgerWrite(None, None, 4, entries(4, [1])),
            LedgerWrite(HardState(2, None), None, 3, entries(3, [2, 2])),  # cuts 3..4, appends
        ]
    )
    assert led.last_index() == 4 and [led.term(i) for i in range(1, 5)] == [1, 1, 2, 2]
    assert led.hard_state() == HardState(2, None)


def test_truncate_suffix_and_term_runs(path):
    led = Ledger(path, "n1")
    led.write([LedgerWrite(entries_from=1, entries=entries(1, [1, 2, 2, 3, 3]))])
    led.write([LedgerWrite(entries_from=3, entries=[])])  # a bare truncation
    assert led.last_index() == 2 and led.term(2) == 2
    led.write([LedgerWrite(entries_from=3, entries=entries(3, [4]))])
    led.close()
    led = Ledger(path, "n1")
    assert [led.term(i) for i in range(1, 4)] == [1, 2, 4]


def test_compaction_persists_before_begin_index_and_term(path):
    led = Ledger(path, "n1")
    led.write([LedgerWrite(entries_from=1, entries=entries(1, [1, 1, 2, 2, 3]))])
    led.compact(3)
    assert (led.before_begin_index, led.before_begin_term) == (3, 2)
    assert led.term(3) == 2 and led.term(4) == 2 and led.term(5) == 3
    with pytest.raises(IndexError):
        led.term(2)
    led.close()
    led = Ledger(path, "n1")  # DLedger keeps the term in memory only; we persist it
    assert (led.before_begin_index, led.before_begin_term, led.last_index()) == (3, 2, 5)
    assert led.entries(4, 6, 1 << 20) == entries(4, [2, 3])


def test_compacting_every_entry_leaves_an_empty_log_that_grows_again(path):
    # A snapshot with no trailing window compacts up to the last entry.
    led = Ledger(path, "n1")
    led.write([LedgerWrite(entries_from=1, entries=entries(1, [1, 2, 2]))])
    led.compact(3)
    assert (led.before_begin_index, led.before_begin_term, led.last_index()) == (3, 2, 3)
    led.write([LedgerWrite(entries_from=4, entries=entries(4, [3]))])
    led.close()
    led = Ledger(path, "n1")
    assert (led.before_begin_index, led.last_index(), led.term(4)) == (3, 4, 3)
    assert led.entries(4, 5, 1 << 20) == entries(4, [3])


def test_reset_to_a_snapshot(path):
    led = Ledger(path, "n1")
    led.write([LedgerWrite(entries_from=1, entries=entries(1, [1, 1]))])
    led.write([LedgerWrite(HardState(7, None), (100, 6), 101, entries(101, [7]))])
    assert (led.before_begin_index, led.before_begin_term, led.last_index()) == (100, 6, 101)
    assert led.term(100) == 6 and led.term(101) == 7


def test_foreign_data_dir_is_refused(path):
    Ledger(path, "n1", "g1").close()
    with pytest.raises(LedgerError, match="belongs to node 'n1' of group 'g1'"):
        Ledger(path, "n2", "g1")
    with pytest.raises(LedgerError, match="group"):
        Ledger(path, "n1", "g2")


def test_corrupt_entry_is_detected_on_read(path):
    led = Ledger(path, "n1")
    led.write([LedgerWrite(entries_from=1, entries=entries(1, [1, 1, 1]))])
    led.close()
    env = lmdb.open(path, max_dbs=4)
    db = env.open_db(b"entries")
    with env.begin(write=True, db=db) as txn:
        raw = bytearray(txn.get((2).to_bytes(8, "big")))
        raw[-1] ^= 0xFF  # flip a bit of the data
        txn.put((2).to_bytes(8, "big"), bytes(raw))
    env.close()
    led = Ledger(path, "n1")
    with pytest.raises(LedgerError, match="checksum"):
        led.entries(1, 4, 1 << 20)


def test_a_file_that_is_not_lmdb_is_reported(tmp_path):
    p = tmp_path / "ledger"
    p.mkdir()
    (p / "data.mdb").write_bytes(os.urandom(8192))
    with pytest.raises(LedgerError, match="cannot open the ledger"):
        Ledger(str(p), "n1")


def test_map_full_is_a_clear_error_and_changes_nothing(path):
    led = Ledger(path, "n1", map_size=1 << 20)
    led.write([LedgerWrite(entries_from=1, entries=entries(1, [1]))])
    with pytest.raises(LedgerError, match="full"):
        led.write([LedgerWrite(entries_from=2, entries=[Entry(2 + i, 1, 0, b"x" * 4096) for i in range(1000)])])
    assert led.last_index() == 1
    led.write([LedgerWrite(entries_from=2, entries=entries(2, [1]))])
    assert led.last_index() == 2


def test_a_ledger_keeps_its_ledger_id_and_one_from_before_them_gets_one(path):
    led = Ledger(path, "n1", ledger_id="ab" * 8)  # a joining node's: the one it gave the cluster
    assert led.ledger_id == "ab" * 8
    led.close()
    led = Ledger(path, "n1", ledger_id="cd" * 8)  # (only a ledger made now takes it)
    assert led.ledger_id == "ab" * 8
    led.close()
    drawn = set()
    for other in (path + "-x", path + "-y"):
        led = Ledger(other, "n1")
        drawn.add(led.ledger_id)
        led.close()
    assert len(drawn) == 2 and all(is_ledger_id(i) for i in drawn)
    # a ledger written before ledger ids: one is drawn when it opens, and kept
    env = lmdb.open(path, max_dbs=4, subdir=True)
    with env.begin(write=True) as txn:
        txn.put(b"identity", b'{"node_id": "n1", "group": "default"}', db=env.open_db(b"meta", txn=txn))
    env.close()
    led = Ledger(path, "n1")
    first = led.ledger_id
    led.close()
    led = Ledger(path, "n1")
    assert first != "ab" * 8 and led.ledger_id == first
    led.close()
