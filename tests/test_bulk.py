"""Bulk puts (Node.bulk_put, POST /v1/bulk): many rows in one entry, each with its own
condition; the columnar row format (statemachine/rows.py) and what every replica refuses."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient
from served import FRONTS, ServedNode

import kv
from kv.http.auth import Grant
from kv.raft.messages import Entry, EntryKind
from kv.statemachine import commands as c
from kv.statemachine import rows as R
from kv.statemachine.leveldb import LevelDBStateMachine


def body(*rows) -> bytes:
    return R.pack(sorted(rows))


# -- the format and the state machine (pure) ---------------------------------------------------


def test_the_format_round_trips_and_sorts_by_key():
    data = body((b"b", b"2", R.ANY), (b"a", b"", 0), (b"\xff\x00", b"x" * 300, 7))
    rows = R.Rows(data, c.MAX_KEY_BYTES)
    assert list(rows) == [(b"a", b"", 0), (b"b", b"2", R.ANY), (b"\xff\x00", b"x" * 300, 7)]
    cmd = c.decode(c.encode(c.bulk(data)))
    assert type(cmd) is c.Bulk and cmd.rows.data == data
    in_session = c.decode(c.encode(c.InSession(5, 1, c.bulk(data))))
    assert in_session.cmd.rows.data == data


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "starts with its row count"),
        (b"\x00\x00\x00\x00", "at least one row"),
        (R.pack([(b"a", b"1", 0)])[:-1], "add up to"),
        (R.pack([(b"a", b"1", 0)]) + b"x", "add up to"),
        (b"\x00\x00\x00\x05" + b"\x00" * 20, "cannot hold the 5 rows"),
        (R.pack([(b"\x00lease", b"1", 0)]), "reserved"),
        (R.pack([(b"a" * (c.MAX_KEY_BYTES + 1), b"1", 0)]), "limit is 4096"),
        (R.pack([(b"a", b"1", 1 << 63)]), "a condition is a mod_index"),
    ],
)
def test_what_the_format_refuses(data, message):
    with pytest.raises(c.CommandError, match=message):
        c.bulk(data)
    # A replica given such an entry refuses it, the same on each (it never reaches one:
    # the leader refuses the request).
    with pytest.raises(c.CommandError, match=message):
        c.decode(bytes((c.COMMAND_FORMAT, 19)) + data)


def test_a_body_of_more_rows_than_an_answer_can_list_is_refused(monkeypatch):
    monkeypatch.setattr(R, "MAX_ROWS", 2)
    with pytest.raises(c.CommandError, match="at most 2 rows, not 3: split it"):
        c.bulk(body((b"a", b"", 0), (b"b", b"", 0), (b"c", b"", 0)))


def test_keys_out_of_order_or_twice_are_refused_with_the_row():
    for rows in ([(b"b", b"1", 0), (b"a", b"2", 0)], [(b"a", b"1", 0), (b"a", b"2", 0)]):
        with pytest.raises(c.CommandError, match="row 1: the keys are not in strictly increasing"):
            c.bulk(R.pack(rows))


def normal(index: int, cmd) -> Entry:
    return Entry(index, 1, EntryKind.NORMAL, c.encode(cmd))


def test_each_row_is_written_only_if_its_condition_holds(tmp_path):
    sm = LevelDBStateMachine(str(tmp_path / "sm"))
    sm.apply([normal(1, c.Put("held", b"same")), normal(2, c.Put("other", b"old")), normal(3, c.Put("cas", b"v0"))])
    rows = body(
        (b"cas", b"v1", 3),  # holds: written
        (b"held", b"same", 0),  # must be absent, holds this value already
        (b"new", b"n", 0),  # absent: written
        (b"other", b"new", 0),  # must be absent, holds another value
        (b"plain", b"p", R.ANY),  # no condition
    )
    (res,) = sm.apply([normal(4, c.bulk(rows))])
    assert res == c.BulkApplied(4, (1, 3), (1, 2), (1, 0))
    assert c.decode_result(c.encode_result(res)) == res
    assert sm.get("cas") == (4, b"v1") and sm.get("new") == (4, b"n") and sm.get("plain") == (4, b"p")
    assert sm.get("held") == (1, b"same") and sm.get("other") == (2, b"old")
    # etcd's per-key stamps move on as for any put: versions count, history holds the old value
    kv_cas = sm.range(c.RangeReq(b"cas")).kvs[0]
    assert (kv_cas.create_revision, kv_cas.version, kv_cas.mod_revision) == (3, 2, 4)
    sm.close()


def test_a_raised_nospace_alarm_refuses_a_bulk_put(tmp_path):
    sm = LevelDBStateMachine(str(tmp_path / "sm"))
    sm.apply([normal(1, c.AlarmSet(0, c.ALARM_NOSPACE, True))])
    (res,) = sm.apply([normal(2, c.bulk(body((b"a", b"1", R.ANY))))])
    assert type(res) is c.SpaceExceeded and sm.get("a") is None
    sm.close()


# -- kv.Node on a cluster ----------------------------------------------------------------------


async def test_a_bulk_put_through_a_follower_reaches_every_replica_at_one_index(inproc_cluster):
    f1, _ = await inproc_cluster.followers()
    rows = [(f"k/{i:05d}", b"v%d" % i) for i in range(5000)]  # far over --max-txn-ops (128)
    r = await f1.bulk_put(rows)
    assert r.written == 5000 and r.refused == ()
    await inproc_cluster.wait_applied(r.index)
    for nid in inproc_cluster.nodes:
        page = await inproc_cluster.nodes[nid].scan("k/", consistency="stale")
        assert [(i.key, i.value, i.mod_index) for i in page] == [(k, v, r.index) for k, v in rows]
    # Again with conditions on what was read: nothing changes, every row is named as held.
    again = await f1.bulk_put([(k, v, 0) for k, v in rows[:3]] + [("k/zz", b"new", 0)])
    assert again.written == 1
    assert again.refused == tuple(kv.BulkRefusal(i, rows[i][0], r.index, True) for i in range(3))


async def test_a_watch_sees_every_row_and_limits_name_the_row(inproc_cluster):
    lead = await inproc_cluster.leader()
    w = lead.watch("w/")
    r = await lead.bulk_put([("w/a", b"1"), ("w/b", b"2")])
    events = [await w.__anext__() for _ in range(2)]
    assert [(e.key, e.value, e.index) for e in events] == [("w/a", b"1", r.index), ("w/b", b"2", r.index)]
    w.close()
    with pytest.raises(kv.ValueTooLarge, match="row 1: the value is"):
        await lead.bulk_put([("a", b"x"), ("b", b"x" * (lead.config.max_value_bytes + 1))])
    with pytest.raises(kv.BadRequest, match="rows 0 and 1 have the same key 'a'"):
        await lead.bulk_put([("a", b"x"), ("a", b"y")])
    with pytest.raises(kv.BadRequest, match="reserved"):
        await lead.bulk_put([("\x00x", b"x")])
    with pytest.raises(kv.ValueTooLarge, match="--max-request-bytes"):
        await lead.bulk_put([(f"big/{i}", b"x" * 1000) for i in range(lead.config.max_request_bytes // 1000 + 1)])


# -- POST /v1/bulk and kv.Client ----------------------------------------------------------------


@pytest.fixture(params=FRONTS)
async def http(tmp_path, request):
    node = kv.Node(kv.NodeConfig(id="n1", data_dir=str(tmp_path / "n1"), max_value_bytes=1000))
    await node.start()
    await node.wait_leader(timeout=10)
    grants = {"w": Grant("write", "app/"), "r": Grant("read"), "a": Grant("admin"), "s": Grant("write", "a\udcc3")}
    client = TestClient(ServedNode(node, request.param, tokens=grants))
    await client.start_server()
    yield node, client
    await client.close()
    await node.stop()


async def test_post_bulk_over_http(http):
    node, client = http
    admin, app = {"Authorization": "Bearer a"}, {"Authorization": "Bearer w"}
    old = await node.put("app/b", b"old")
    rows = body((b"app/a", b"1", R.ANY), (b"app/b", b"2", 0), (b"app/\xff", b"3", 0))
    r = await client.post("/v1/bulk", data=rows, headers=app)
    d = await r.json()
    assert r.status == 200, d
    assert d["written"] == 2 and d["refused"] == [{"row": 1, "key": "app/b", "mod_index": old.index, "held": False}]
    item = await node.get("app/\udcff")
    assert item.value == b"3" and item.mod_index == d["index"]
    # A scan in the same format (what an import reads back): each key's mod_index in the
    # condition column; X-Kv-More says whether to read on after the last key.
    r = await client.get("/v1/kv", params={"prefix": "app/", "format": "rows", "limit": "2"}, headers=admin)
    assert r.status == 200 and r.headers["X-Kv-More"] == "true" and int(r.headers["X-Kv-Index"]) >= d["index"]
    assert list(R.Rows(await r.read(), c.MAX_KEY_BYTES)) == [(b"app/a", b"1", d["index"]), (b"app/b", b"old", old.index)]
    r = await client.get("/v1/kv", params={"prefix": "app/", "format": "rows", "after": "app/b"}, headers=admin)
    assert r.headers["X-Kv-More"] == "false" and list(R.Rows(await r.read(), c.MAX_KEY_BYTES)) == [(b"app/\xff", b"3", d["index"])]
    assert (await client.get("/v1/kv", params={"format": "xml"}, headers=admin)).status == 400
    # A token scoped to app/ reaches no key outside it, wherever it is among the rows.
    for outside in ((b"apo", b"x", R.ANY), (b"zzz", b"x", R.ANY)):
        r = await client.post("/v1/bulk", data=body((b"app/c", b"x", R.ANY), outside), headers=app)
        assert r.status == 403, await r.text()
        assert "reaches only keys under 'app/'" in (await r.json())["error"]["message"]
    assert (await client.post("/v1/bulk", data=rows, headers={"Authorization": "Bearer r"})).status == 403
    # A prefix that ends inside a character (the byte C3 alone): "a\xc3\xa9" is the text "aé",
    # which the other routes refuse to this token, though its bytes start with the prefix's.
    odd = {"Authorization": "Bearer s"}
    r = await client.post("/v1/bulk", data=body((b"a\xc3\x01", b"x", R.ANY), (b"a\xc3\xa9", b"x", R.ANY), (b"a\xc3\xff", b"x", R.ANY)), headers=odd)
    assert r.status == 403 and "row 1:" in (await r.json())["error"]["message"]
    assert (await client.post("/v1/bulk", data=body((b"a\xc3\x01", b"x", R.ANY), (b"a\xc3\xff", b"x", R.ANY)), headers=odd)).status == 200
    # What is wrong names the row; nothing is proposed.
    before = node.raft.core.log.last_index()
    for data, status, says in (
        (b"junk", 400, "cannot hold"),
        (body((b"k1", b"x" * 1001, R.ANY)), 413, "row 0: the value is 1001 bytes"),
        (b"\x00" * (2 << 20), 413, "--max-request-bytes"),
    ):
        r = await client.post("/v1/bulk", data=data, headers=admin)
        assert r.status == status and says in (await r.json())["error"]["message"], await r.text()
    assert node.raft.core.log.last_index() == before


def test_kv_client_bulk_put_from_another_process(tmp_path):
    """The CLI's cluster, kv.Client in this process: rows of any bytes, conditions, refusals."""
    from kv.bench.harness import ServeCluster

    with ServeCluster(str(tmp_path / "c"), 1) as c:
        c.start()
        with kv.Client(c.url(c.ids[0]), timeout=10) as cl:
            cl.put("b", b"held")
            r = cl.bulk_put([("c", b"3"), ("a", b"1", 0), ("b", b"held", 0), ("\udcfe", b"4")])
            assert r.written == 3
            assert r.refused == (kv.BulkRefusal(2, "b", cl.get("b").mod_index, True),)
            assert [(i.key, i.value) for i in cl.scan("")] == [("a", b"1"), ("b", b"held"), ("c", b"3"), ("\udcfe", b"4")]
            with pytest.raises(kv.BadRequest, match="rows 0 and 2 have the same key 'a'"):
                cl.bulk_put([("a", b"1"), ("0", b"x"), ("a", b"2")])
            # Rows are numbered as the caller gave them, though they travel sorted by key.
            with pytest.raises(kv.ValueTooLarge, match=": row 0: the value is 1048577 bytes"):
                cl.bulk_put([("zz/b", b"x" * (1 << 20) + b"x"), ("zz/a", b"x")])
            r = cl.bulk_put([("z/3", b"3"), ("z/1", b"1", 12345), ("z/2", b"2"), (b"b/\xff", b"b", 1)])
            assert [(x.row, x.key) for x in r.refused] == [(1, "z/1"), (3, "b/\udcff")]
            for bad, says in (([("k",)], "row 0: a row is"), ([("k", "text")], "row 0: values are bytes"), ([("k", b"v"), (b"", b"v")], "row 1: a key is at least")):
                with pytest.raises(kv.BadRequest, match=says):
                    cl.bulk_put(bad)


def test_the_raw_log_lists_each_row_of_a_bulk_put():
    from kv.common.entry_stream import entry_rows

    e = normal(9, c.InSession(3, 1, c.bulk(body((b"b", b"2", 5), (b"a\xff", b"1", R.ANY)))))
    assert list(entry_rows(e)) == [(9, 1, "put", "a\udcff", b"1", False, None), (9, 1, "put", "b", b"2", True, None)]


def test_the_import_check_counts_keys_given_twice_across_arrow_batches():
    pa = pytest.importorskip("pyarrow")
    import orjson

    from kv.spark.importer import check_task

    def batch(*keys):
        return pa.RecordBatch.from_arrays([pa.array(keys, pa.string()), pa.array([b"v"] * len(keys), pa.binary())], names=["key", "value"])

    def stats(*batches):
        (out,) = check_task(iter(batches), 100)
        return orjson.loads(out.column(0)[0].as_py())

    clean = stats(batch("a", "b"), batch("c"), batch("d", "e"))
    assert (clean["rows"], clean["dup_keys"], clean["dup_rows"]) == (5, 0, 0)
    # "c" ends one batch and begins the next two; "e" twice inside one; "f" alone.
    st = stats(batch("a", "b", "c"), batch("c"), batch("c", "d", "e", "e"), batch("f"))
    assert (st["rows"], st["dup_keys"], st["dup_rows"], st["dup_examples"]) == (9, 2, 3, [["c", 3], ["e", 2]])


def test_kv_open_bulk_put(tmp_path):
    with kv.open(str(tmp_path / "db")) as db:
        r = db.bulk_put([(f"k/{i:04d}", b"v") for i in range(3000)])
        assert r.written == 3000 and db.get("k/2999").mod_index == r.index
        again = db.bulk_put([("k/0000", b"w", r.index), ("k/0001", b"w", 1)])
        assert again.written == 1 and again.refused == (kv.BulkRefusal(1, "k/0001", r.index, False),)
        assert db.get("k/0000").value == b"w" and db.get("k/0001").value == b"v"


def test_the_import_check_refuses_keys_no_node_would_take():
    pa = pytest.importorskip("pyarrow")
    import orjson

    from kv.spark.importer import Checked, check_task

    keys = ["\x00lease", "a" * 5000, "fine"]
    b = pa.RecordBatch.from_arrays([pa.array(keys, pa.string()), pa.array([b"v"] * 3, pa.binary())], names=["key", "value"])
    (out,) = check_task(iter([b]), 100)
    st = Checked(**orjson.loads(out.column(0)[0].as_py()))
    assert (st.reserved_keys, st.long_keys) == (1, 1)
    problems = st.problems(100, "refuse")
    assert any("starting with a NUL character" in p for p in problems) and any("longer than 4096 bytes" in p for p in problems)


def test_an_import_reports_rows_sent_without_an_answer_as_unknown_not_unwritten():
    """A batch whose first send got no answer may be written: when the import stops before
    it could be sent again (the cluster lost its majority), its rows fail as 'outcome
    unknown', not 'not written' (a newcomer's run found 10,000 such rows written)."""
    pa = pytest.importorskip("pyarrow")
    import asyncio

    import numpy as np

    from kv.spark import bulk

    def rows():
        return bulk.ArrowRows(pa.array([b"u/1", b"u/2"]), pa.array([b"1", b"2"]), np.zeros(2, np.uint64))

    for unknown, says in ((True, "outcome unknown (it was sent, and an attempt may have been written"), (False, "not written: the cluster could not be read")):
        out = bulk.Outcome()
        w = bulk._Writer(None, bulk.Settings(["http://127.0.0.1:1"]), out)
        w.stopped = "the cluster could not be read (no leader)"  # another batch's read found no leader
        asyncio.run(w._send(rows(), unknown=unknown))
        assert [k for k, _ in out.failed] == ["u/1", "u/2"] and all(r.startswith(says) for _, r in out.failed), out.failed
    # An error of no kind the client knows, raised while sending (here: no client at all),
    # settles the rows as unknown too: no row goes missing from the report.
    out = bulk.Outcome()
    asyncio.run(bulk._Writer(None, bulk.Settings(["http://127.0.0.1:1"]), out)._send(rows(), unknown=False))
    assert len(out.failed) == 2 and out.failed[0][1].startswith("outcome unknown") and "AttributeError" in out.failed[0][1]


def test_an_import_reads_ahead_and_each_chunk_is_compared_with_its_own_range(tmp_path, caplog):
    """write_chunks reads the cluster over the next chunks' keys while a chunk is sent: each
    chunk still skips exactly the rows its own range holds, writes the others conditionally
    on what its read saw, and an import stopped with reads in flight leaves no error unseen."""
    pa = pytest.importorskip("pyarrow")
    import asyncio
    import gc
    import time

    from kv.bench.harness import ServeCluster, free_port
    from kv.spark import bulk

    def chunk(lo, hi, value=b"new"):
        return pa.array([b"k/%04d" % i for i in range(lo, hi)]), pa.array([value + b"%d" % i for i in range(lo, hi)])

    with ServeCluster(str(tmp_path / "c"), 1) as c:
        c.start()
        url = c.url(c.ids[0])
        with kv.Client(url, timeout=10) as cl:
            cl.bulk_put([("k/%04d" % i, b"new%d" % i) for i in range(100, 150)])  # the second chunk's first half: held already
            cl.bulk_put([("k/%04d" % i, b"old%d" % i) for i in range(300, 320)])  # some of the fourth: another value
            chunks = [chunk(i * 100, i * 100 + 100) for i in range(6)]
            # The reads take turns among the endpoints: one that does not answer (nothing
            # listens there) is left out, and its reads are made elsewhere.
            w = bulk.Settings([url, f"http://127.0.0.1:{free_port()}"], batch_bytes=2000)
            out = asyncio.run(bulk.write_chunks(iter(chunks), w))
            assert (out.written, out.skipped, out.failed) == (550, 50, []), out
            assert [(i.key, i.value) for i in cl.scan("k/")] == [("k/%04d" % i, b"new%d" % i) for i in range(600)]
            # The deadline passes: every row fails, named, and the reads started are let go.
            late = bulk.Settings([url], deadline=time.time() - 1)
            out = asyncio.run(bulk.write_chunks(iter([chunk(i * 100, i * 100 + 100, b"late") for i in range(6)]), late))
            assert out.written == 0 and len(out.failed) == 600
            assert all(r == "not written: the import's --timeout passed" for _, r in out.failed), out.failed[:3]
            assert cl.get("k/0000").value == b"new0"
    gc.collect()  # (asyncio logs a task's error that nobody looked at when the task is collected)
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def test_rows_that_failed_alike_are_one_line_on_stderr(capsys, tmp_path):
    """A cluster that stops answering fails thousands of rows with one reason: the command
    prints that as one line (how many, the reason, a few keys), not ten lines of it; every
    row is still in --errors."""
    import argparse
    import json

    from kv.cli.spark import _report
    from kv.spark.importer import ImportReport

    down = "outcome unknown (...); the last attempt: no endpoint answered"
    failures = [(f"k/{i:05d}", down) for i in range(5000)] + [("big", "value too large")] + [(f"m/{i}", "not written: x") for i in range(3)]
    errors = str(tmp_path / "errors.jsonl")
    code = _report(ImportReport(rows=6000, written=996, failures=failures, seconds=1.0), argparse.Namespace(errors=errors))
    out, err = capsys.readouterr()
    assert code == 1 and out.startswith("imported 6000 rows")
    assert err.splitlines() == [
        f"  5,000 rows failed: {down} (e.g. 'k/00000', 'k/00001', 'k/00002')",
        "  3 rows failed: not written: x (e.g. 'm/0', 'm/1', 'm/2')",
        "  failed: 'big': value too large",
    ]
    with open(errors) as f:
        assert [json.loads(line)["key"] for line in f] == [k for k, _ in failures]
