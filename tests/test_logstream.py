"""The record format of GET /v1/log and the audit rows entries become (kv.common.entry_stream)."""

from __future__ import annotations

import pytest

from kv.common.entry_stream import LogStreamError, RecordReader, encode_end, encode_entries, entry_rows
from kv.raft.messages import Entry, EntryKind
from kv.statemachine import commands as cmds

ENTRIES = [
    Entry(7, 2, EntryKind.NOOP, b""),
    Entry(8, 2, EntryKind.NORMAL, cmds.encode(cmds.Put("a", b"\x00\xff"))),
    Entry(9, 3, EntryKind.CONFIG, b'[{"id":"n1","peer":"127.0.0.1:1","http":"","voter":true}]'),
    Entry(10, 3, EntryKind.NORMAL, cmds.encode(cmds.Delete("b", cmds.Cond("b", "mod", 4)))),
]


def test_a_stream_fed_in_pieces_of_every_size_gives_back_every_entry():
    stream = encode_entries(ENTRIES) + encode_end()
    for size in range(1, len(stream) + 1):
        reader, got = RecordReader(), []
        for i in range(0, len(stream), size):
            got += reader.feed(stream[i : i + size])
        reader.finish(got[-1].index)
        assert got == ENTRIES, size


def test_a_cut_stream_an_error_end_and_trailing_bytes_are_errors():
    whole = encode_entries(ENTRIES) + encode_end()
    reader = RecordReader()
    got = reader.feed(whole[:-1])  # the end record is incomplete
    assert got == ENTRIES
    with pytest.raises(LogStreamError, match="cut short after index 10"):
        reader.finish(10)
    with pytest.raises(LogStreamError, match="compacted meanwhile"):
        RecordReader().feed(encode_entries(ENTRIES[:1]) + encode_end("compacted meanwhile"))
    with pytest.raises(LogStreamError, match="after the end"):
        RecordReader().feed(whole + b"x")


def test_rows_one_per_mutation_and_one_for_entries_without_any():
    txn = cmds.Txn(
        (cmds.Cond("k", "exists", False),),
        (cmds.Put("k", b"1"), cmds.Get("k"), cmds.Delete("old")),
        (cmds.Put("k.conflict", b"2"),),
    )
    plain_txn = cmds.Txn((), (cmds.Put("x", b"1"), cmds.Put("y", b"2")), ())
    reads = cmds.Txn((), (cmds.Get("x"),), ())
    rows = [r for i, c in enumerate((txn, plain_txn, reads)) for r in entry_rows(Entry(20 + i, 4, EntryKind.NORMAL, cmds.encode(c)))]
    rows += [r for e in ENTRIES for r in entry_rows(e)]
    assert rows == [
        (20, 4, "put", "k", b"1", True, "then"),
        (20, 4, "delete", "old", None, True, "then"),
        (20, 4, "put", "k.conflict", b"2", True, "else"),
        (21, 4, "put", "x", b"1", False, None),
        (21, 4, "put", "y", b"2", False, None),
        (22, 4, "read", None, None, False, None),
        (7, 2, "noop", None, None, False, None),
        (8, 2, "put", "a", b"\x00\xff", False, None),
        (9, 3, "config", None, ENTRIES[2].data, False, None),
        (10, 3, "delete", "b", None, True, None),
    ]


def test_an_entry_this_version_cannot_read_names_its_index():
    with pytest.raises(LogStreamError, match="entry 5 .term 1."):
        list(entry_rows(Entry(5, 1, EntryKind.NORMAL, b"\x09\x01")))


def test_every_logged_command_has_rows_etcds_ones_included():
    """A watch's history and the change feed read every entry of the log: etcd's
    transactions, alarms and compactions too (a watch from an old revision died on them)."""
    txn = cmds.TxnReq(
        (cmds.Compare(cmds.CMP_VERSION, cmds.CMP_EQUAL, b"a", 0),),
        (cmds.PutReq(b"a", b"1"), cmds.DeleteRangeReq(b"b", b"c"), cmds.TxnReq((), (cmds.PutReq(b"n", b"2"),), ())),
        (cmds.RangeReq(b"a"),),
    )
    got = {c: list(entry_rows(Entry(7, 1, EntryKind.NORMAL, cmds.encode(c)))) for c in (txn, cmds.AlarmSet(0, cmds.ALARM_NOSPACE, True), cmds.Compact(3))}
    assert [(r[2], r[3], r[4], r[6]) for r in got[txn]] == [("put", "a", b"1", "then"), ("delete_range", "b", None, "then"), ("put", "n", b"2", "then")]
    assert [r[2] for r in got[cmds.AlarmSet(0, cmds.ALARM_NOSPACE, True)]] == ["alarm"]
    assert [r[2] for r in got[cmds.Compact(3)]] == ["compact"]
