"""A committed entry can always be applied: a transaction's gets are read only where the
answer is returned, within a read budget; the request limits refuse what is too big before
it is proposed; the command codec refuses what its format cannot hold."""

from __future__ import annotations

import pytest

import kv
import kv.server.answers
from kv.raft.messages import Entry, EntryKind
from kv.statemachine import commands as c
from kv.statemachine.leveldb import LevelDBStateMachine


def normal(index: int, cmd) -> Entry:
    return Entry(index, 1, EntryKind.NORMAL, c.encode(cmd))


@pytest.fixture
def sm(tmp_path):
    s = LevelDBStateMachine(str(tmp_path / "state"), max_read_bytes=2500)
    s.apply([normal(1, c.Put("big", b"x" * 1000))])
    yield s
    s.close()


def test_gets_are_read_only_for_the_entries_someone_waits_for(sm):
    txn = c.Txn((), (c.Put("a", b"1"), c.Get("big")))
    res = sm.apply([normal(2, txn), normal(3, txn)], answering={3})
    assert res[0] == c.TxnApplied(2, True, (c.PutResult(2), None))  # nobody waits: not read
    assert res[1] == c.TxnApplied(3, True, (c.PutResult(3), c.GetResult("big", b"x" * 1000, 1)))
    assert sm.get("a") == (3, b"1")


def test_reads_over_the_budget_return_no_values_but_the_writes_stay_applied(sm):
    txn = c.Txn((), (c.Get("big"), c.Get("big"), c.Put("w", b"1"), c.Get("big")))
    (res,) = sm.apply([normal(2, txn)], answering={2})
    big = c.GetResult("big", b"x" * 1000, 1)
    assert res == c.TxnApplied(2, True, (big, big, c.PutResult(2), c.GetOmitted("big")))
    assert sm.get("w") == (2, b"1")
    assert c.decode_result(c.encode_result(res)) == res  # it crosses the peer link too
    # Not 413 (a refusal): it says it was applied, where, and which gets it leaves out.
    with pytest.raises(kv.ReadsOmitted, match="applied at index 2 .*gets of 'big' are not returned") as e:
        kv.server.answers.txn_result(kv.raft.node.Applied(2, 1, res))
    assert (e.value.index, e.value.succeeded, e.value.omitted) == (2, True, ["big"])
    assert e.value.results[2] == kv.WriteResult(2, 1) and e.value.results[3] is None


async def test_a_transaction_whose_reads_grew_past_the_limit_is_answered_as_applied_over_http(tmp_path):
    from test_http import make_client

    node, api = await make_client(tmp_path, max_txn_read_bytes=2500)
    try:
        await api.put("/v1/kv/big", data=b"x" * 900)
        # The node estimates the reads before proposing (3 x 900 fits); the value grows in
        # between, as it would under another client's write; then the answer cannot hold them.
        estimate = node._stored_size
        node._stored_size = lambda key: 100
        txn = {"compare": [], "success": [{"op": "get", "key": "big"}, {"op": "put", "key": "w", "value": "1"}, {"op": "get", "key": "big"}, {"op": "get", "key": "big"}]}
        await api.put("/v1/kv/big", data=b"y" * 1000)
        r = await api.post("/v1/txn", json=txn)
        async with kv.AsyncClient(f"http://{api.host}:{api.port}") as client:  # the Python client says so too
            with pytest.raises(kv.ReadsOmitted) as e:
                await client.txn(ops=[kv.Get("big"), kv.Put("w", b"2"), kv.Get("big"), kv.Get("big")])
            assert e.value.omitted == ["big"] and e.value.results[1].index == e.value.index
        node._stored_size = estimate
        d = await r.json()
        assert (await (await api.get("/v1/kv/w")).read()) == b"2"  # both transactions were applied
        assert r.status == 200 and d["reads_omitted"]["code"] == "READS_OMITTED" and "applied at index" in d["reads_omitted"]["message"]
        assert d["results"][1] == {"index": d["index"]} and d["results"][3] == {"omitted": True, "key": "big"}
    finally:
        await api.close()
        await node.stop()


def test_the_codec_refuses_what_its_format_cannot_hold():
    with pytest.raises(c.CommandError, match="at most 65535"):
        c.encode(c.Txn(tuple(c.Cond("k", "exists", True) for _ in range(65_536))))
    for bad in (-1, 1 << 64, True, "7"):
        with pytest.raises(c.CommandError, match="mod_index"):
            c.encode(c.Put("k", b"", c.Cond("k", "mod", bad)))


async def test_a_node_refuses_oversized_transactions_before_proposing(tmp_path):
    async with kv.Node(id="n1", data_dir=str(tmp_path / "n1"), max_txn_ops=4, max_txn_read_bytes=2500) as node:
        await node.put("big", b"x" * 1000)
        before = node.status()["commit_index"]
        with pytest.raises(kv.BadRequest, match=r"5 success operations; the limit is 4 .*--max-txn-ops"):
            await node.txn(ops=[kv.Put(f"k{i}", b"") for i in range(5)])
        with pytest.raises(kv.BadRequest, match="5 compares"):
            await node.txn([kv.Cond("k", "exists", False)] * 5)
        with pytest.raises(kv.ValueTooLarge, match="3 gets would read 3000 bytes; the limit is 2500"):
            await node.txn(ops=[kv.Get("big")] * 3)
        # A get sees the branch's own earlier writes: this one reads 10 bytes, not 1000.
        r = await node.txn(ops=[kv.Put("big", b"y" * 10), kv.Get("big"), kv.Get("big"), kv.Get("big")])
        assert r.results[1].value == b"y" * 10
        with pytest.raises(kv.ValueTooLarge, match="--max-request-bytes"):
            await node.txn(ops=[kv.Put("a", b"x" * 1_000_000), kv.Put("b", b"x" * 1_000_000)])
        assert node.status()["commit_index"] == before + 1  # only the good transaction


@pytest.mark.parametrize(
    "options, says",
    [
        ({"max_request_bytes": 1000}, "--max-request-bytes must leave room"),
        ({"max_txn_ops": 0}, "--max-txn-ops"),
        ({"max_txn_ops": 70_000}, "--max-txn-ops"),
        ({"max_txn_read_bytes": 0}, "--max-txn-read-bytes"),
        ({"force_new_cluster": True, "join": "http://127.0.0.1:1"}, "--force-new-cluster"),
    ],
)
def test_limit_settings_are_checked(tmp_path, options, says):
    with pytest.raises(kv.BadRequest, match=says):
        kv.NodeConfig(id="n1", data_dir=str(tmp_path), **options)


def test_the_request_limit_makes_room_for_the_largest_value(tmp_path):
    assert kv.NodeConfig(id="n1", data_dir=str(tmp_path)).max_request_bytes == 1536 * 1024
    assert kv.NodeConfig(id="n1", data_dir=str(tmp_path), max_value_bytes=8 << 20).max_request_bytes > 8 << 20
