"""KV commands and the LevelDB state machine."""

from __future__ import annotations

import random
import struct

import pytest

from kv.raft.messages import Entry, EntryKind
from kv.statemachine import commands as c
from kv.statemachine.leveldb import LevelDBStateMachine

CMDS = [
    c.Put("a", b"1"),
    c.Put("ключ/ü", b"\x00\xff" * 100, c.Cond("ключ/ü", "mod", 7)),
    c.Put("k", b"", c.Cond("k", "exists", False)),
    c.Delete("a"),
    c.Delete("a", c.Cond("a", "value", b"x")),
    c.Txn((c.Cond("a", "mod", 0), c.Cond("b", "value", b"v")), (c.Put("a", b"1"), c.Get("b"), c.Delete("c")), (c.Get("a"),)),
    c.Txn(),
]


@pytest.mark.parametrize("cmd", CMDS)
def test_command_round_trip(cmd):
    assert c.decode(c.encode(cmd)) == cmd


def test_bad_commands_are_refused_with_a_reason():
    with pytest.raises(c.CommandError, match="newer"):
        c.decode(b"\x09\x01")
    with pytest.raises(c.CommandError):
        c.decode(b"")
    with pytest.raises(c.CommandError, match="limit"):
        c.encode(c.Put("x" * 5000, b""))
    with pytest.raises(c.CommandError, match="conds"):
        c.encode(c.Txn(ops=(c.Put("a", b"", c.Cond("a", "mod", 1)),)))
    rng = random.Random(1)
    for _ in range(5000):
        blob = bytes([1]) + bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))
        try:
            c.decode(blob)
        except c.CommandError:
            pass


@pytest.mark.parametrize(
    "result",
    [
        c.PutResult(5),
        c.DeleteApplied(6, True),
        c.ConditionFailed("k", 9),
        c.TxnApplied(7, True, (c.PutResult(7), c.GetResult("g", b"v", 3), c.GetResult("h", None, 0), c.DeleteApplied(7, False))),
        c.CommandError("bad"),
        None,
    ],
)
def test_result_round_trip(result):
    got = c.decode_result(c.encode_result(result))
    assert (str(got), type(got)) == (str(result), type(result)) if isinstance(result, c.CommandError) else got == result


def normal(index: int, cmd, term: int = 1) -> Entry:
    return Entry(index, term, EntryKind.NORMAL, c.encode(cmd))


@pytest.fixture
def sm(tmp_path):
    m = LevelDBStateMachine(str(tmp_path / "state"))
    yield m
    m.close()


def test_apply_puts_deletes_and_mod_index(sm):
    res = sm.apply([normal(1, c.Put("a", b"1")), normal(2, c.Put("b", b"2")), Entry(3, 1, EntryKind.NOOP, b""), normal(4, c.Delete("a")), normal(5, c.Delete("zz"))])
    assert res == [c.PutResult(1), c.PutResult(2), None, c.DeleteApplied(4, True), c.DeleteApplied(5, False)]
    assert sm.get("a") is None and sm.get("b") == (2, b"2")
    assert sm.applied() == (5, 1)


def test_conditions_see_earlier_writes_of_the_same_batch(sm):
    res = sm.apply(
        [
            normal(1, c.Put("a", b"1")),
            normal(2, c.Put("a", b"2", c.Cond("a", "mod", 1))),  # holds: a was written at 1
            normal(3, c.Put("a", b"3", c.Cond("a", "mod", 1))),  # fails: now 2
            normal(4, c.Put("n", b"x", c.Cond("n", "mod", 0))),  # create-if-absent
        ]
    )
    assert res[1] == c.PutResult(2) and res[2] == c.ConditionFailed("a", 2) and res[3] == c.PutResult(4)
    assert sm.get("a") == (2, b"2")


def test_txn_is_all_or_nothing_and_reads_its_own_writes(sm):
    sm.apply([normal(1, c.Put("x", b"1"))])
    ok = sm.apply([normal(2, c.Txn((c.Cond("x", "value", b"1"),), (c.Put("y", b"2"), c.Get("y"), c.Delete("x")), (c.Get("x"),)))])[0]
    assert ok.succeeded and ok.results == (c.PutResult(2), c.GetResult("y", b"2", 2), c.DeleteApplied(2, True))
    no = sm.apply([normal(3, c.Txn((c.Cond("x", "exists", True),), (c.Put("z", b"!"),), (c.Get("y"),)))])[0]
    assert not no.succeeded and no.results == (c.GetResult("y", b"2", 2),)
    assert sm.get("z") is None


def test_scan_returns_key_order_and_pages(sm):
    keys = [f"p/{i:03d}" for i in range(50)] + ["p", "p0", "q/1", "o/1"]
    random.Random(3).shuffle(keys)
    sm.apply([normal(i + 1, c.Put(k, k.encode())) for i, k in enumerate(keys)])
    got = [k for k, _, _ in sm.scan("p/", limit=1000)]
    assert got == sorted(k for k in keys if k.startswith("p/"))
    page1 = sm.scan("p/", limit=20)
    page2 = sm.scan("p/", after=page1[-1][0], limit=20)
    assert [k for k, *_ in page1 + page2] == got[:40]
    assert [k for k, *_ in sm.scan("", limit=3)] == sorted(keys)[:3]


def test_a_page_in_the_bulk_format_holds_what_scan_does(sm):
    """scan_rows (GET /v1/kv?format=rows, what an import reads back) builds its page from
    the records without scan's tuples: the same rows, limit, byte cap and "more"."""
    from kv.statemachine import rows as R

    rng = random.Random(7)
    keys = sorted({"p/" + "".join(rng.choice("ab\u00e9\udcff/") for _ in range(rng.randint(1, 6))) for _ in range(200)} | {"p", "q/1", "o/1", "p0"})
    sm.apply([normal(i + 1, c.Put(k, b"v" * rng.randint(0, 40))) for i, k in enumerate(keys)])
    sm.apply([normal(len(keys) + 1, c.Put(keys[3], b"again"))])  # a mod_index that is not the key's first
    for prefix, after in (("p/", None), ("p/", keys[10]), ("", None), ("p", "p/b"), ("zz", None)):
        for limit, cap in ((1, 1 << 20), (7, 1 << 20), (1000, 1 << 20), (1000, 50), (5, 1)):
            body, n, size, more = sm.scan_rows(prefix, after, limit, cap)
            every = sm.scan(prefix, after, 10_000)
            want = []
            for k, v, m in every:
                want.append((c.key_bytes(k), v, m))
                if len(want) >= limit or sum(len(a) + len(b) for a, b, _ in want) >= cap:
                    break
            assert body == R.pack(want) and n == len(want), (prefix, after, limit, cap)
            assert size == sum(len(a) + len(b) for a, b, _ in want)
            assert more == (size >= cap or len(every) > len(want)), (prefix, after, limit, cap)


def test_applied_index_moves_with_the_batch_across_reopen(tmp_path):
    path = str(tmp_path / "state")
    sm = LevelDBStateMachine(path)
    sm.apply([normal(1, c.Put("a", b"1")), normal(2, c.Put("b", b"2"), term=2)])
    sm.close()
    sm = LevelDBStateMachine(path)
    assert sm.applied() == (2, 2) and sm.get("b") == (2, b"2")
    sm.close()


def test_capture_is_a_frozen_view_and_restore_replaces_everything(sm, tmp_path):
    sm.apply([normal(i, c.Put(f"k{i}", b"v%d" % i)) for i in range(1, 10)] + [normal(10, c.Put("k3", b"v3 again"))])
    view = sm.capture()
    sm.apply([normal(11, c.Put("k1", b"changed")), normal(12, c.Delete("k2"))])
    items = list(view.items())
    view.release()
    user = [it for it in items if not it[0].startswith(b"\x00")]
    # besides the keys, the history: a change record per put, where it starts, and for k3's
    # update a version record and a meta record (a creation keeps neither)
    assert (view.index, len(user), len(items)) == (10, 9, 22) and (b"k1", b"v1", 1) in items
    other = LevelDBStateMachine(str(tmp_path / "other"))
    other.apply([normal(1, c.Put("junk", b"x"))])
    assert other.restore(10, 1, b"[]", iter(items)) == 9
    assert other.get("junk") is None and other.get("k1") == (1, b"v1") and other.applied() == (10, 1)
    assert other.range(c.RangeReq(b"k1")).kvs == (c.KeyValue("k1", 1, 1, 1, b"v1", 0),)
    assert other.range(c.RangeReq(b"k3")).kvs == (c.KeyValue("k3", 3, 10, 2, b"v3 again", 0),)  # its versions came along
    assert other.get_at("k3", 9) == (3, b"v3") and other.get_at("k9", 8) is None
    assert not other.incomplete and not list(other._db.iterator(prefix=b"k\x00meta/"))  # k3's folded into its record
    other.close()


def test_the_cluster_id_is_set_once_and_kept_by_restarts_and_snapshots(sm, tmp_path):
    assert sm.cluster_id == ""
    assert c.decode(c.encode(c.ClusterId("0123456789abcdef"))) == c.ClusterId("0123456789abcdef")
    for bad in ("0123456789ABCDEF", "0123", "0123456789abcdeg"):
        with pytest.raises(c.CommandError, match="cluster id"):
            c.encode(c.ClusterId(bad))
    def noop(index, data):
        return Entry(index, index, EntryKind.NOOP, data)

    # The no-op of the log's first entry carries it (kv.Node's noop_data): a later no-op's
    # offer (a cluster made by an earlier version, whose members would each take another) is
    # ignored, as is a no-op with anything else; a normal entry holding one is refused.
    sm.apply([noop(1, c.encode(c.ClusterId("aa" * 8)))])
    assert sm.cluster_id == "aa" * 8
    refused, ignored, later = sm.apply([normal(2, c.ClusterId("cc" * 8)), noop(3, b"\x01\x02junk"), noop(4, c.encode(c.ClusterId("bb" * 8)))])
    assert str(refused) == "not a command to apply: ClusterId" and ignored is None and later is None
    assert sm.cluster_id == "aa" * 8
    older = LevelDBStateMachine(str(tmp_path / "older"))
    older.apply([noop(1, b""), noop(2, c.encode(c.ClusterId("bb" * 8)))])
    assert older.cluster_id == ""
    older.close()
    view = sm.capture()
    items = list(view.items())
    view.release()
    sm.close()
    again = LevelDBStateMachine(sm.path)
    other = LevelDBStateMachine(str(tmp_path / "other"))
    other.restore(4, 4, b"[]", iter(items))  # install-snapshot: the leader's cluster
    assert again.cluster_id == other.cluster_id == "aa" * 8 and again.scan("") == []
    other.set_cluster_id("cc" * 8)  # a restore's: another cluster
    other.close()
    reopened = LevelDBStateMachine(str(tmp_path / "other"))
    assert reopened.cluster_id == "cc" * 8
    reopened.close()
    again.close()


def test_a_view_in_blocks_holds_its_records_as_columns_of_about_the_bytes_asked(sm):
    """What the snapshot writer reads: each block's keys, values and mod_indexes (int64 LE,
    from the records' big-endian) are the records' own, in order, cut at block_bytes."""
    sm.apply([normal(i, c.Put(f"k{i:03d}", b"v" * i)) for i in range(1, 201)])
    view = sm.capture()
    try:
        blocks = list(view.blocks(1000))
        items = list(view.items())
    finally:
        view.release()
    assert len(blocks) > 10
    for keys, values, mods in blocks[:-1]:
        assert sum(map(len, keys)) + sum(map(len, values)) + 9 * len(keys) >= 1000 and len(keys) == len(values) == len(mods) // 8
    for keys, values, _ in blocks:  # cut at the record that reaches the bytes asked (not a chunk's end)
        assert sum(map(len, keys[:-1])) + sum(map(len, values[:-1])) + 9 * (len(keys) - 1) < 1000
    flat = [(k, v, m) for keys, values, mods in blocks for k, v, m in zip(keys, values, struct.unpack(f"<{len(keys)}q", mods))]
    assert flat == items and (b"k150", b"v" * 150, 150) in flat
    assert [k for k, _, _ in flat] == sorted(k for k, _, _ in flat)


def test_a_view_is_cut_into_key_ranges_of_about_equal_bytes(tmp_path):
    """An export's ranges (LevelDBView.user_key_splits): counted key by key while the data is
    small (in LevelDB's memtable); by LevelDB's estimate of its files once it is not, found
    by bisection without reading the keys. Either way the cuts are in order, within the
    range asked, and each range holds about its share; the blocks of [lo, hi) are its keys."""
    import os

    from kv.statemachine import rows

    def shares(view, lo, hi, cuts):
        bounds = [lo, *cuts, hi]
        return [sum(len(k) for keys, _, _ in view.blocks(1 << 20, a, b) for k in keys) for a, b in zip(bounds, bounds[1:])]

    sm = LevelDBStateMachine(str(tmp_path / "state"))
    sm.apply([normal(1, c.Put("own", b"x"))] + [normal(2 + i, c.Put(f"s/{i:04d}", b"v")) for i in range(1000)])
    view = sm.capture()
    try:
        n, cuts = view.user_key_splits(b"s/", b"s0", 4)
        assert n == 1000 and len(cuts) == 3 and cuts == sorted(cuts) and all(b"s/" < k < b"s0" for k in cuts)
        assert [s // len(b"s/0000") for s in shares(view, b"s/", b"s0", cuts)] == [250, 250, 250, 250]
        assert view.user_key_splits(b"", None, 1) == (1001, [])
    finally:
        view.release()
    # 40 MB of values that do not compress, written in bulk. The estimate sees LevelDB's
    # files only, not what is still in its memtables (16 MiB each: the newest writes, which
    # then fall to the last range): opened again, LevelDB has written everything to files.
    index = 2000
    for chunk in range(16):
        body = rows.pack([(b"big/%02d/%05d" % (chunk, i), os.urandom(1000), rows.ANY) for i in range(2500)])
        index += 1
        sm.apply([normal(index, c.bulk(body))])
    sm.close()
    sm = LevelDBStateMachine(str(tmp_path / "state"))
    view = sm.capture()
    try:
        n, cuts = view.user_key_splits(b"", None, 4)
        assert n is None and len(cuts) == 3 and cuts == sorted(cuts)
        counts = [sum(len(keys) for keys, _, _ in view.blocks(1 << 20, a, b)) for a, b in zip([b"", *cuts], [*cuts, None])]
        assert sum(counts) == 41_001 and all(8_500 <= n <= 12_000 for n in counts), counts
    finally:
        view.release()
        sm.close()


def test_keys_that_are_not_utf8_are_stored_as_their_bytes(sm, tmp_path):
    """etcd's clients may write any bytes as a key: held as lone surrogates (key_text), stored,
    ranged, ordered, watched and carried by a snapshot as the bytes they are."""
    odd = b"\xff\xfe"
    hot = bytes((c.COMMAND_FORMAT, 1, 0, 2)) + odd + b"\x00" + b"value"  # the apply hot path
    txn = c.TxnReq(success=(c.PutReq(b"k\x80", b"t"), c.PutReq("é".encode(), b"e")))
    res = sm.apply([Entry(1, 1, EntryKind.NORMAL, hot), normal(2, c.Put("ok", b"1")), normal(3, txn)])
    assert res[0] == c.PutResult(1) and res[1] == c.PutResult(2)
    key = c.key_text(odd)
    assert key == "\udcff\udcfe" and sm.get(key) == (1, b"value")
    assert sm.range(c.RangeReq(odd)).kvs == (c.KeyValue(key, 1, 1, 1, b"value", 0),)
    # in the order of their bytes: "k\x80" sorts before "ok", "é" (c3 a9) before \xff
    assert [k for k, _, _ in sm.scan("")] == ["k\udc80", "ok", "é", key]
    assert [k for k, _, _ in sm.scan("", after="é")] == [key]
    assert c.decode(c.encode(c.Put(key, b"v"))) == c.Put(key, b"v")
    view = sm.capture()
    items = list(view.items())
    view.release()
    other = LevelDBStateMachine(str(tmp_path / "other"))
    assert other.restore(view.index, 1, b"[]", iter(items)) == 4  # the keys
    assert other.get(key) == (1, b"value") and other.get("k\udc80") == (3, b"t")
    other.close()


def test_a_key_of_lone_surrogates_that_stand_for_no_bytes_or_for_text_is_refused():
    with pytest.raises(c.CommandError, match="stands for no byte"):
        c.encode(c.Put("a\ud800", b""))
    with pytest.raises(c.CommandError, match="write the key as 'é'"):
        c.encode(c.Put("\udcc3\udca9", b""))  # the bytes of "é": it would read back as "é"
    with pytest.raises(c.CommandError, match="write the key as"):
        c.encode(c.Txn(ops=(c.Put("\udcc3\udca9", b""),)))


def test_the_leveldb_machine_implements_the_protocol_as_written(tmp_path):
    """statemachine/protocol.py says what the log's driver, the snapshot layer and the
    watch hub use; the LevelDB machine has each member, with the same parameters."""
    import inspect

    from kv.statemachine import protocol

    sm = LevelDBStateMachine(str(tmp_path / "s"))
    view = sm.capture()
    try:
        for proto, obj in ((protocol.StateMachine, sm), (protocol.SnapshotView, view)):
            impl = type(obj)
            members = [n for n, v in vars(proto).items() if not n.startswith("_") and callable(v)]
            assert members, proto
            for name in members:
                want = list(inspect.signature(getattr(proto, name)).parameters)
                assert list(inspect.signature(getattr(impl, name)).parameters) == want, (impl.__name__, name)
            for name in proto.__annotations__:
                assert hasattr(obj, name), (impl.__name__, name)
    finally:
        view.release()
        sm.close()


# The log's format, pinned: these bytes are what every ledgerkv so far wrote for these
# commands (and answered with these results). A change to the codec that changes one of
# them would make committed entries read differently: a new format version instead.
PINNED_COMMANDS = [
    (c.Put("k", b"v"), "010100016b0076"),
    (c.Put("k", b"v", c.Cond("k", "mod", 7), 9), "010500016b0100016b0000000000000007000000000000000976"),
    (c.Delete("k", c.Cond("k", "exists", True)), "010200016b0300016b01"),
    (c.DeletePrefix("a/"), "010f0002612f"),
    (c.Txn((c.Cond("a", "value", b"x"),), (c.Put("a", b"1"), c.Get("b")), (c.Delete("a"),)), "01030001020001610000000178000000020100016100000001310004000162000000010200016100"),
    (c.LeaseGrant(5000), "01060000000000001388"),
    (c.LeaseGrant(5000, 12345, "app/"), "010e0000000000003039000000000000138800046170702f"),
    (c.LeaseRevoke(12345), "01070000000000003039"),
    (c.LeaseKeepAlive(12345), "01080000000000003039"),
    (c.LeaseKeepAlives((1, 2)), "010a0000000200000000000000010000000000000002"),
    (c.LeaseQuery(0), "01090000000000000000"),
    (c.SessionOpen(77, 1000), "010b000000000000004d000003e8"),
    (c.SessionsExpire(42), "010d000000000000002a"),
    (c.InSession(77, 3, c.Delete("k")), "010c000000000000004d0000000000000003010200016b00"),
]
PINNED_RESULTS = [
    (c.TxnApplied(7, True, (c.PutResult(7), c.GetResult("b", None, 0), c.GetOmitted("z"), None)), "5400000000000000070100000004500000000000000007470001620000000000000000006700017a4e"),
    (c.LeaseList((c.LeaseInfo(1, 2000, 1500, ("k",)), c.NoSuchLease(5))), "530000000249000000000000000100000000000007d000000000000005dc0000000100016b580000000000000005"),
    (c.StaleRequest(1, 2, 3), "51000000000000000100000000000000020000000000000003"),
]


@pytest.mark.parametrize("cmd, pinned", PINNED_COMMANDS)
def test_command_encodings_are_those_of_the_log_so_far(cmd, pinned):
    assert c.encode(cmd).hex() == pinned
    assert c.decode(bytes.fromhex(pinned)) == cmd


@pytest.mark.parametrize("result, pinned", PINNED_RESULTS)
def test_result_encodings_are_those_of_the_wire_so_far(result, pinned):
    assert c.encode_result(result).hex() == pinned
    assert c.decode_result(bytes.fromhex(pinned)) == result


def test_a_raised_nospace_alarm_refuses_what_adds_data_on_every_replica_and_survives_a_restart(tmp_path):
    sm = LevelDBStateMachine(str(tmp_path / "state"))
    assert sm.apply([normal(1, c.Put("a", b"1")), normal(2, c.AlarmSet(0, c.ALARM_NOSPACE, True))]) == [c.PutResult(1), c.Alarms((0,), (c.ALARM_NOSPACE,))]
    put_txn = c.TxnReq((), (c.PutReq(b"b", b"2"),), ())
    got = sm.apply([normal(3, c.Put("b", b"2")), normal(4, put_txn), normal(5, c.LeaseGrant(1000, 77)), normal(6, c.Delete("a")),
                    normal(7, c.TxnReq((), (c.DeleteRangeReq(b"a", b"\x00"),), ()))])
    assert got[:3] == [c.SpaceExceeded()] * 3 and got[3] == c.DeleteApplied(6, True) and got[4].succeeded
    assert sm.get("b") is None and 77 not in sm.leases.ttl_ms
    sm.close()
    again = LevelDBStateMachine(str(tmp_path / "state"))
    try:
        assert again.alarms == {(0, c.ALARM_NOSPACE)} and again.apply([normal(8, c.Put("b", b"2"))]) == [c.SpaceExceeded()]
        assert again.apply([normal(9, c.AlarmSet(0, c.ALARM_NOSPACE, False)), normal(10, c.Put("b", b"2"))]) == [c.Alarms((0,), (c.ALARM_NOSPACE,)), c.PutResult(10)]
    finally:
        again.close()


def test_compact_moves_the_compact_revision_once_and_keeps_it_across_a_restart(tmp_path):
    sm = LevelDBStateMachine(str(tmp_path / "state"))
    assert sm.apply([normal(1, c.Put("a", b"1")), normal(2, c.Compact(1)), normal(3, c.Compact(1)), normal(4, c.Compact(9))]) == [
        c.PutResult(1), c.CompactAnswer(1, ""), c.CompactAnswer(1, "compacted"), c.CompactAnswer(1, "future")]
    sm.close()
    again = LevelDBStateMachine(str(tmp_path / "state"))
    try:
        assert again.compact_revision == 1
    finally:
        again.close()


def test_a_txn_that_keeps_the_value_of_a_key_it_deleted_is_refused_whole(sm):
    """PutReq(ignore_value/ignore_lease) needs the key to exist when the put runs: after a
    DeleteRangeReq of the same transaction it does not, and the transaction is refused
    before any op runs (KeyNotFound, as etcd answers), instead of failing half-applied;
    after the transaction's own put it does. Found by a differential fuzzer: apply raised."""
    sm.apply([normal(1, c.Put("a", b"1")), normal(2, c.Put("b", b"2"))])
    keep = c.PutReq(b"a", b"", 0, False, True, False)  # ignore_value
    keep_lease = c.PutReq(b"a", b"x", 0, False, False, True)  # ignore_lease
    for n, ops in enumerate((
        (c.DeleteRangeReq(b"a"), keep),
        (c.DeleteRangeReq(b"a", b"b"), keep_lease),
        (c.PutReq(b"b", b"changed"), c.DeleteRangeReq(b"\x00", b"\x00"), c.TxnReq((), (keep,), ())),  # nested, after deleting every key
    ), start=3):
        assert sm.apply([normal(n, c.TxnReq((), ops, ()))]) == [c.KeyNotFound("a")]
        assert sm.get("a") == (1, b"1") and sm.get("b") == (2, b"2")  # nothing of it ran
    r = sm.apply([normal(6, c.TxnReq((), (c.DeleteRangeReq(b"a"), c.PutReq(b"a", b"again"), keep), ()))])[0]
    assert r.succeeded and sm.get("a") == (6, b"again")
    assert sm.apply([normal(7, c.Put("c", b"3"))]) == [c.PutResult(7)]


def test_a_changed_key_keeps_its_version_in_its_record_and_every_reader_sees_only_its_value(sm):
    """An update writes the key's create_revision and version into its own record (one get
    reads both); a key's first version is written without them. Whatever reads the records
    (get, scan, the bulk page, ranges, a view's blocks and items) hands out the value alone,
    and the view carries the versions as meta records, the layout every version reads."""
    from kv.statemachine import leveldb as L
    from kv.statemachine import rows as R

    sm.apply([normal(1, c.Put("a", b"first")), normal(2, c.Put("b", b"only")), normal(3, c.Put("a", b"second")), normal(4, c.Put("a", b"third"))])
    raw_a, raw_b = sm._db.get(b"ka"), sm._db.get(b"kb")
    assert raw_a == struct.pack(">QQQ", 4 | L.STAMPED, 1, 3) + b"third" and raw_b == struct.pack(">Q", 2) + b"only"
    assert not list(sm._db.iterator(prefix=L._META))  # no meta records
    assert sm.get("a") == (4, b"third") and sm.scan("") == [("a", b"third", 4), ("b", b"only", 2)]
    body, n, size, more = sm.scan_rows("", None, 10, 1 << 20)
    assert body == R.pack([(b"a", b"third", 4), (b"b", b"only", 2)]) and (n, size, more) == (2, 11, False)
    assert sm.range(c.RangeReq(b"a", b"c")).kvs == (c.KeyValue("a", 1, 4, 3, b"third", 0), c.KeyValue("b", 2, 2, 1, b"only", 0))
    assert sm.get_at("a", 3) == (3, b"second")
    view = sm.capture()
    try:
        items = list(view.items())
        user = [(k, v, m) for keys, values, mods in view.blocks(1 << 20, b"", None) for k, v, m in zip(keys, values, struct.unpack(f"<{len(keys)}q", mods))]
    finally:
        view.release()
    assert (b"a", b"third", 4) in items and (b"b", b"only", 2) in items and user == [(b"a", b"third", 4), (b"b", b"only", 2)]
    assert (b"\x00meta/a", struct.pack(">QQ", 1, 3), 4) in items and not any(k == b"\x00meta/b" for k, _, _ in items)
    assert [k for k, _, _ in items] == sorted(k for k, _, _ in items)
    sm.apply([normal(5, c.Delete("a")), normal(6, c.Put("a", b"again"))])
    assert sm._db.get(b"ka") == struct.pack(">Q", 6) + b"again"
    assert sm.range(c.RangeReq(b"a")).kvs == (c.KeyValue("a", 6, 6, 1, b"again", 0),)


def test_a_state_with_meta_records_folds_them_into_the_keys_records_when_it_opens(tmp_path):
    """The layout before: a changed key's create_revision and version in a meta record of
    their own, as earlier versions wrote it and as snapshots still carry it. Opening the
    state (or restoring a snapshot) moves them into the keys' records, in batches; a crash
    between two batches leaves the rest for the next open."""
    import plyvel

    from kv.statemachine import leveldb as L

    path = str(tmp_path / "state")
    sm = LevelDBStateMachine(path)
    sm.apply([normal(i, c.Put(f"k{i:05d}", b"v%d" % i)) for i in range(1, 25_002)])
    sm.close()
    db = plyvel.DB(path)  # the earlier layout: keys 1..25000 changed once more (at 30000 + i), versions aside
    wb = db.write_batch()
    wb.delete(L._STATE_FORMAT)  # (which it did not note)
    for i in range(1, 25_001):
        key = b"k%05d" % i
        wb.put(b"k" + key, struct.pack(">Q", 30_000 + i) + b"w%d" % i)
        wb.put(L._META + key, struct.pack(">QQQ", 30_000 + i, i, 2))
    wb.write()
    db.close()
    db = plyvel.DB(path)  # as a crash after the first batch of a fold (its batches are _FOLD_BATCH) leaves it
    wb = db.write_batch()
    with db.iterator(start=L._META, stop=L._META_END) as it:
        for n, (mk, _) in enumerate(it):
            if n == L._FOLD_BATCH:
                break
            k = b"k" + mk[len(L._META) :]
            wb.put(k, struct.pack(">QQQ", struct.unpack(">Q", db.get(k)[:8])[0] | L.STAMPED, n + 1, 2) + db.get(k)[8:])
            wb.delete(mk)
    wb.write()
    db.close()
    sm = LevelDBStateMachine(path)  # folds the other 15,000, in two batches
    try:
        assert not list(sm._db.iterator(prefix=L._META))
        assert sm.range(c.RangeReq(b"k00007")).kvs == (c.KeyValue("k00007", 7, 30_007, 2, b"w7", 0),)
        assert sm.range(c.RangeReq(b"k20000")).kvs == (c.KeyValue("k20000", 20_000, 50_000, 2, b"w20000", 0),)
        assert sm.range(c.RangeReq(b"k25001")).kvs == (c.KeyValue("k25001", 25_001, 25_001, 1, b"v25001", 0),)
        assert sm.get("k00007") == (30_007, b"w7")
        sm.apply([normal(60_000, c.Put("k00007", b"x"))])
        assert sm.range(c.RangeReq(b"k00007")).kvs == (c.KeyValue("k00007", 7, 60_000, 3, b"x", 0),)
    finally:
        sm.close()


def test_the_records_kept_in_memory_are_always_leveldbs(sm, tmp_path, monkeypatch):
    """A put reads the key's record from the records the last batches wrote, kept in memory
    (LevelDBStateMachine._remember): after every batch (puts, deletes, prefix deletes,
    transactions, leases and their revocation, writes in a session and their copies), one
    that failed to be written, a restore and the generations' turnover, each of them is what
    LevelDB holds; only user records are kept, and a prefix delete of many keys does not
    keep them all."""
    import plyvel

    from kv.statemachine import leveldb

    monkeypatch.setattr(leveldb, "RECENT_BYTES", 4000)  # a few dozen records a generation
    rnd = random.Random(7)
    keys = [f"k{i}" for i in range(40)]
    index = 0
    sm.apply([normal(1, c.SessionOpen(5, 10))])
    seq = 0

    def batch() -> list[Entry]:
        nonlocal index, seq
        out = []
        for _ in range(rnd.randint(1, 12)):
            index += 1
            key, value, lease = rnd.choice(keys), b"v%d" % index * rnd.randint(1, 20), rnd.randint(1, 3)
            cmd = rnd.choice([
                c.Put(key, value), c.Put(key, value), c.Delete(key), c.DeletePrefix(key[:2]),
                c.Txn((c.Cond(key, "exists", True),), (c.Put(key, value), c.Delete(rnd.choice(keys))), (c.Put(rnd.choice(keys), value),)),
                c.LeaseGrant(60_000, lease), c.Put(key, value, lease=lease), c.LeaseRevoke(lease), "session",
            ])
            if cmd == "session":  # a put or a delete in a session, or a copy of the last one
                seq += rnd.random() < 0.7
                cmd = c.Put(keys[seq % len(keys)], b"s%d" % seq) if seq % 2 else c.Delete(keys[seq % len(keys)])
                out.append(Entry(index + 1, 1, EntryKind.NORMAL, c.in_session(5, seq, c.encode(cmd))))
            else:
                out.append(normal(index + 1, cmd))
        return out

    def same_as_leveldb(m) -> None:
        for key in keys:
            k = b"k" + key.encode()
            raw = m._db.get(k)
            assert m._current(k, {}) == (None if raw is None else leveldb._record(raw)), key
        assert all(k >= leveldb._USER_DATA for k in [*m._recent, *m._recent_old])

    turned = 0
    for n in range(300):
        if n % 25 == 24:  # a batch that never reaches the disk (a full disk, say)
            failing = batch()
            sm._db = _FailingWrites(sm._db)
            with pytest.raises(plyvel.IOError):
                sm.apply(failing)
            sm._db = sm._db.db
            same_as_leveldb(sm)
            sm.reopen()  # as the FSM caller does, then the same batch again
            sm.apply(failing)
        else:
            before = sm._recent_old
            sm.apply(batch())
            turned += sm._recent_old is not before
        same_as_leveldb(sm)
    assert turned >= 5  # the generations did turn over

    sm.apply([normal(index + 1 + i, c.Put(f"many/{i:05}", b"x")) for i in range(2000)])
    sm.apply([normal(index + 2001, c.DeletePrefix("many/"))])
    index += 2001
    assert len(sm._recent) + len(sm._recent_old) < 100 and sm.get("many/00001") is None

    view = sm.capture()
    items = list(view.items())
    view.release()
    other = LevelDBStateMachine(str(tmp_path / "other"))
    for i in range(1, 30):  # its own records, kept in memory, then replaced by the snapshot's
        other.apply([normal(i, c.Put(rnd.choice(keys), b"mine"))])
    other.restore(index, 1, b"[]", iter(items))
    same_as_leveldb(other)
    other.close()


class _FailingWrites:
    """A LevelDB whose batches fail to be written."""

    def __init__(self, db):
        self.db = db

    def __getattr__(self, name):
        return getattr(self.db, name)

    def write_batch(self, **kw):
        return _FailingBatch(self.db.write_batch(**kw))


class _FailingBatch:
    def __init__(self, wb):
        self.wb = wb

    def __getattr__(self, name):
        return getattr(self.wb, name)

    def write(self):
        import plyvel

        raise plyvel.IOError("No space left on device")


def test_a_joined_node_passes_over_membership_entries_older_than_its_join(tmp_path):
    """A node that joined starts from the committed membership the leader gave it (at the
    index of its entry), then applies the log from its start or from an older snapshot:
    the membership entries and snapshots there are older and leave it as it is, across a
    restart too. Newer ones replace it (raft/membership.py ConfigLog, on the Raft side)."""
    def config(*ids: str, index: int) -> Entry:
        return Entry(index, 1, EntryKind.CONFIG, ("[" + ",".join(f'{{"id":"{i}","peer":"h:{n}"}}' for n, i in enumerate(ids)) + "]").encode())

    given = config("n1", "n2", "n3", index=0).data
    path = str(tmp_path / "state")
    sm = LevelDBStateMachine(path)
    sm.set_membership(given, 7, ["n0"])  # (removed before the join: the cluster says)
    sm.apply([config("n1", "n2", index=2), normal(3, c.Put("a", b"1")), config("n1", index=5)])
    assert (sm.membership(), sm.membership_index, sm.removed()) == (given, 7, {"n0"})
    sm.restore(4, 1, config("n9", index=0).data, iter([]), ["n8", "n3"])  # a snapshot from before the join
    assert (sm.membership(), sm.membership_index, sm.removed()) == (given, 7, {"n0", "n8"})
    sm.close()
    sm = LevelDBStateMachine(path)
    assert (sm.membership(), sm.membership_index, sm.removed()) == (given, 7, {"n0", "n8"})
    newer = config("n1", "n3", index=8)
    sm.apply([config("n2", index=6), Entry(7, 1, EntryKind.NOOP, b""), newer])
    assert (sm.membership(), sm.membership_index) == (newer.data, 8)
    assert sm.removed() == {"n0", "n8", "n2"}
    sm.restore(20, 1, b"[]", iter([]), ["n5"])
    assert (sm.membership(), sm.membership_index, sm.removed()) == (b"[]", 20, {"n5"})
    sm.close()


def test_a_snapshot_load_cut_short_keeps_the_membership_a_joined_node_holds(tmp_path):
    """A node that joined at index 30 loads an older snapshot (index 12) and dies in the
    middle: at the next start the load is made again, and the membership it joined with,
    its index and the removed ids must still be there to keep (a review: they were written
    only once the load was whole, and the node took the snapshot's older membership)."""
    from kv.server.config import NodeConfig
    from kv.server.snapshot_host import SnapshotHost

    given = b'[{"id":"n1","peer":"h:1"},{"id":"n4","peer":"h:4","voter":false}]'
    path = str(tmp_path / "state")
    sm = LevelDBStateMachine(path)
    sm.set_membership(given, 30, ["n2"])
    # while it catches up, its membership is newer than what it applied: no snapshot of it
    host = SnapshotHost(NodeConfig(id="n4", data_dir=str(tmp_path)), lambda: sm)
    assert "joined the cluster at index 30 and has applied up to 0" in host.not_capturable()

    def records():
        yield (b"\x01a", b"1", 3)
        raise OSError("killed")

    with pytest.raises(OSError):
        sm.restore(12, 1, b'[{"id":"n1","peer":"h:1"},{"id":"n2","peer":"h:2"}]', records(), [])
    sm = LevelDBStateMachine(path)
    assert sm.incomplete and (sm.membership(), sm.membership_index, sm.removed()) == (given, 30, {"n2"})
    sm.restore(12, 1, b'[{"id":"n1","peer":"h:1"},{"id":"n2","peer":"h:2"}]', iter([]), [])
    assert not sm.incomplete and (sm.membership(), sm.membership_index, sm.removed()) == (given, 30, {"n2"})
    sm.apply([Entry(i, 1, EntryKind.NOOP, b"") for i in range(13, 31)])
    assert host.not_capturable() is None
    sm.close()
