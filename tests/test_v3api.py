"""etcd's v3 API (v3api/) on a cluster of real `kv serve` processes, through grpcio stubs
generated from the protocol files, as etcd's own clients call it, and through Debian's
etcdctl where it is installed. Requests go to a follower unless said otherwise."""

from __future__ import annotations

import base64
import filecmp
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from cluster import Proc, ProcCluster, wait_until

from kv import __version__ as KV_VERSION
from kv.bench.harness import free_port
from kv.v3api.proto import kv_pb2, rpc_pb2, rpc_pb2_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ETCDCTL = shutil.which("etcdctl")


READ_BUDGET = 100_000  # --max-txn-read-bytes: what one range may return


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = ProcCluster(str(tmp_path_factory.mktemp("v3")), 3)
    c.serve_etcd_api()
    for i in c.ids:
        c.node_env[i]["KV_MAX_TXN_READ_BYTES"] = str(READ_BUDGET)
    try:
        c.start(*c.ids)
        c.leader_id = c.leader()
        c.follower = next(i for i in c.ids if i != c.leader_id)
        yield c
    finally:
        c.close()


class Stubs:
    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.kv = rpc_pb2_grpc.KVStub(self.channel)
        self.watch = rpc_pb2_grpc.WatchStub(self.channel)
        self.lease = rpc_pb2_grpc.LeaseStub(self.channel)
        self.cluster = rpc_pb2_grpc.ClusterStub(self.channel)
        self.maintenance = rpc_pb2_grpc.MaintenanceStub(self.channel)


@pytest.fixture(scope="module")
def etcd(cluster):
    s = Stubs(cluster.grpc[cluster.follower])
    yield s
    s.channel.close()


def put(etcd, key: bytes, value: bytes, **kw) -> rpc_pb2.PutResponse:
    return etcd.kv.Put(rpc_pb2.PutRequest(key=key, value=value, **kw), timeout=10)


def get(etcd, key: bytes, metadata=None, **kw) -> rpc_pb2.RangeResponse:
    return etcd.kv.Range(rpc_pb2.RangeRequest(key=key, **kw), metadata=metadata, timeout=10)


def op_put(key: bytes, value: bytes, **kw) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=value, **kw))


def test_the_generated_code_is_what_the_protocol_files_give(tmp_path):
    work = tmp_path / "proto"
    shutil.copytree(os.path.join(ROOT, "v3api", "proto"), work, ignore=shutil.ignore_patterns("*_pb2*", "__pycache__"))
    subprocess.run([sys.executable, str(work / "generate.py")], check=True, capture_output=True)
    made = sorted(p.name for p in work.glob("*_pb2*.py*"))
    assert made == sorted(p for p in os.listdir(os.path.join(ROOT, "v3api", "proto")) if "_pb2" in p)
    for name in made:
        assert filecmp.cmp(work / name, os.path.join(ROOT, "v3api", "proto", name), shallow=False), f"{name} is stale: run v3api/proto/generate.py"


def test_put_and_range_report_etcd_revisions_and_versions(etcd, cluster):
    first = put(etcd, b"v3/a", b"1")
    second = put(etcd, b"v3/a", b"2", prev_kv=True)
    assert second.header.revision > first.header.revision
    assert (second.prev_kv.value, second.prev_kv.version, second.prev_kv.mod_revision) == (b"1", 1, first.header.revision)
    got = get(etcd, b"v3/a")
    (kv,) = got.kvs
    assert (kv.key, kv.value, kv.version, kv.create_revision, kv.mod_revision, got.count) == (b"v3/a", b"2", 2, first.header.revision, second.header.revision, 1)
    assert got.header.revision >= second.header.revision and got.header.raft_term >= 1
    assert got.header.member_id != 0 and got.header.cluster_id != 0
    # the same numbers from the leader and from a serializable read on the third node
    third = next(i for i in cluster.ids if i not in (cluster.leader_id, cluster.follower))
    other = Stubs(cluster.grpc[third])
    try:
        wait_until(lambda: get(other, b"v3/a", serializable=True).kvs[:1] == got.kvs[:1], 10)
        assert get(other, b"v3/a", serializable=True).header.cluster_id == got.header.cluster_id
        assert get(other, b"v3/a", serializable=True).header.member_id != got.header.member_id
    finally:
        other.channel.close()


def test_plain_puts_to_the_leader_at_once_are_each_applied_once_and_counted(cluster):
    """Plain puts on the leader are proposed together without a task each (PutsAtOnce):
    many at once, each is applied once, answered with its own revision, and counted in the
    metrics as any call and write; a put it does not take (one with prev_kv) or refuses (a
    key too long) still gets the handler's answer."""
    def metric(name: str) -> float:
        with urllib.request.urlopen(f"http://{cluster.http[cluster.leader_id]}/metrics", timeout=10) as r:
            found = re.search(rf"^{re.escape(name)} (\S+)$", r.read().decode(), re.M)
        return float(found.group(1)) if found else 0.0  # (a front no call came through yet has no line)

    leader = Stubs(cluster.grpc[cluster.leader_id])
    try:
        calls, commits = metric('kv_etcd_api_calls_total{front="grpc"}'), metric("kv_commit_latency_seconds_count")
        keys = [b"at-once/%03d" % i for i in range(200)]
        pending = [leader.kv.Put.future(rpc_pb2.PutRequest(key=k, value=k), timeout=10) for k in keys]
        revisions = [p.result().header.revision for p in pending]
        assert len(set(revisions)) == len(keys)  # one entry each
        got = leader.kv.Range(rpc_pb2.RangeRequest(key=b"at-once/", range_end=b"at-once0"), timeout=10)
        assert [(kv.key, kv.value, kv.version, kv.mod_revision) for kv in got.kvs] == [(k, k, 1, r) for k, r in zip(keys, revisions)]
        assert metric('kv_etcd_api_calls_total{front="grpc"}') >= calls + 201
        assert metric("kv_commit_latency_seconds_count") >= commits + 200
        again = put(leader, keys[0], b"second", prev_kv=True)
        assert (again.prev_kv.value, again.prev_kv.mod_revision) == (keys[0], revisions[0])
        with pytest.raises(grpc.RpcError) as e:
            put(leader, b"k" * 5000, b"x")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # (the first puts, before the leader had sessions to spare, went the general way:
        # answered right, and without an error in its log)
        assert "etcd API call" not in cluster.log(cluster.leader_id)
    finally:
        leader.channel.close()


def test_range_limits_sorts_counts_and_filters(etcd):
    for i in range(5):
        put(etcd, b"v3r/%d" % i, b"x" * (5 - i))
    every = get(etcd, b"v3r/", range_end=b"v3r0")
    assert [kv.key for kv in every.kvs] == [b"v3r/%d" % i for i in range(5)] and every.count == 5 and not every.more
    page = get(etcd, b"v3r/", range_end=b"v3r0", limit=2)
    assert [kv.key for kv in page.kvs] == [b"v3r/0", b"v3r/1"] and page.more and page.count == 5
    desc = get(etcd, b"v3r/", range_end=b"v3r0", sort_order=rpc_pb2.RangeRequest.DESCEND, sort_target=rpc_pb2.RangeRequest.KEY, limit=2)
    assert [kv.key for kv in desc.kvs] == [b"v3r/4", b"v3r/3"] and desc.more
    by_value = get(etcd, b"v3r/", range_end=b"v3r0", sort_order=rpc_pb2.RangeRequest.ASCEND, sort_target=rpc_pb2.RangeRequest.VALUE)
    assert by_value.kvs[0].key == b"v3r/4"
    keys_only = get(etcd, b"v3r/", range_end=b"v3r0", keys_only=True)
    assert all(kv.value == b"" for kv in keys_only.kvs) and len(keys_only.kvs) == 5
    count_only = get(etcd, b"v3r/", range_end=b"v3r0", count_only=True)
    assert (len(count_only.kvs), count_only.count) == (0, 5)
    newer = get(etcd, b"v3r/", range_end=b"v3r0", min_mod_revision=every.kvs[3].mod_revision)
    assert [kv.key for kv in newer.kvs] == [b"v3r/3", b"v3r/4"]
    from_key = get(etcd, b"v3r/3", range_end=b"\x00")
    assert [kv.key for kv in from_key.kvs][:2] == [b"v3r/3", b"v3r/4"]


def test_a_range_over_the_read_budget_is_refused_not_cut_short(etcd, cluster):
    """etcd answers every key asked for, and etcdctl prints what comes without paging on
    `more`: a range the node would cut short at --max-txn-read-bytes is refused, saying
    what to do; pages within it are answered, and so is a count."""
    value = b"b" * 5000
    etcd.kv.Txn(rpc_pb2.TxnRequest(success=[op_put(b"v3big/%02d" % i, value) for i in range(30)]), timeout=10)  # 150 kB
    for req in (rpc_pb2.RangeRequest(key=b"v3big/", range_end=b"v3big0"),
                rpc_pb2.RangeRequest(key=b"v3big/", range_end=b"v3big0", sort_order=rpc_pb2.RangeRequest.DESCEND, limit=25),  # 25 values: 125 kB
                rpc_pb2.RangeRequest(key=b"v3big/", range_end=b"v3big0", sort_target=rpc_pb2.RangeRequest.VALUE, limit=1)):  # a sort by value reads them all
        with pytest.raises(grpc.RpcError) as e:
            etcd.kv.Range(req, timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-txn-read-bytes" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # a read-only transaction's range alike
        etcd.kv.Txn(rpc_pb2.TxnRequest(success=[rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=b"v3big/", range_end=b"v3big0"))]), timeout=10)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # A few keys by a sort: their revisions are read first, then only their values.
    etcd.kv.Txn(rpc_pb2.TxnRequest(success=[op_put(b"v3big/%02d" % i, value) for i in range(29)]), timeout=10)  # all but 29 change again
    oldest = get(etcd, b"v3big/", range_end=b"v3big0", sort_target=rpc_pb2.RangeRequest.MOD, limit=1)  # no order: ascending, as etcd
    assert [kv.key for kv in oldest.kvs] == [b"v3big/29"] and oldest.kvs[0].value == value and oldest.more and oldest.count == 30
    last = get(etcd, b"v3big/", range_end=b"v3big0", sort_order=rpc_pb2.RangeRequest.DESCEND, limit=3)
    assert [kv.key for kv in last.kvs] == [b"v3big/29", b"v3big/28", b"v3big/27"] and all(kv.value == value for kv in last.kvs)
    before = get(etcd, b"v3big/", range_end=b"v3big0", sort_order=rpc_pb2.RangeRequest.DESCEND, limit=2, revision=oldest.kvs[0].mod_revision)
    assert [kv.mod_revision for kv in before.kvs] == [oldest.kvs[0].mod_revision] * 2  # at a past revision, values and all
    page = get(etcd, b"v3big/", range_end=b"v3big0", limit=10)
    assert len(page.kvs) == 10 and page.more and page.count == 30
    assert get(etcd, b"v3big/", range_end=b"v3big0", keys_only=True).count == 30
    assert (get(etcd, b"v3big/", range_end=b"v3big0", count_only=True).count) == 30
    r = subprocess.run(["etcdctl", "--endpoints", cluster.grpc[cluster.follower], "get", "--prefix", "v3big/"], capture_output=True, text=True,
                       env={**os.environ, "ETCDCTL_API": "3"}, timeout=30) if shutil.which("etcdctl") else None
    if r is not None:
        assert r.returncode != 0 and "--max-txn-read-bytes" in r.stderr and r.stdout == ""


def test_a_transactions_ranges_compares_and_nested_ones_are_weighed_together(etcd):
    """Found by an attacker review with a token scoped to its own prefix: the read budget
    held for each range, not the transaction (a 520-byte request of 20 ranges built a 66 MB
    answer; ranges at a past revision, each read with a budget of its own, too); --max-txn-ops for each nested transaction, not all (32 nested ones of 32 compares
    each); and a compare over a range reads every key of it, on every node as it applies
    (1,025 compares over 20,000 keys stalled the cluster for 45 s)."""
    from kv.v3api.kv_service import MAX_COMPARED_KEYS

    def rng(key: bytes, end: bytes) -> rpc_pb2.RequestOp:
        return rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=key, range_end=end))

    def version_above_0(key: bytes, end: bytes) -> rpc_pb2.Compare:
        return rpc_pb2.Compare(key=key, range_end=end, target=rpc_pb2.Compare.VERSION, result=rpc_pb2.Compare.GREATER, version=0)

    written = etcd.kv.Txn(rpc_pb2.TxnRequest(success=[op_put(b"v3tx/%02d" % i, b"t" * 5000) for i in range(16)]), timeout=10)  # 80 kB
    one = etcd.kv.Txn(rpc_pb2.TxnRequest(success=[rng(b"v3tx/", b"v3tx0")]), timeout=10)
    assert len(one.responses[0].response_range.kvs) == 16
    etcd.kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=b"v3tx/", range_end=b"v3tx0"), timeout=10)  # (now only in the history)
    then = rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=b"v3tx/", range_end=b"v3tx0", revision=written.header.revision))
    assert len(etcd.kv.Txn(rpc_pb2.TxnRequest(success=[then]), timeout=10).responses[0].response_range.kvs) == 16

    def over_budget(ops) -> None:  # 160 kB: over the budget together
        with pytest.raises(grpc.RpcError) as e:
            etcd.kv.Txn(rpc_pb2.TxnRequest(success=ops), timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "ranges together" in e.value.details() and "--max-txn-read-bytes" in e.value.details()

    over_budget([then, then])  # (read at the past revision alone: nothing is there now)
    etcd.kv.Txn(rpc_pb2.TxnRequest(success=[op_put(b"v3tx/%02d" % i, b"t" * 5000) for i in range(16)]), timeout=10)
    nested = rpc_pb2.RequestOp(request_txn=rpc_pb2.TxnRequest(success=[rng(b"v3tx/", b"v3tx0")]))
    for ops in ([rng(b"v3tx/", b"v3tx0")] * 2, [rng(b"v3tx/", b"v3tx0"), nested], [rng(b"v3tx/", b"v3tx0"), then]):
        over_budget(ops)

    inner = rpc_pb2.TxnRequest(compare=[version_above_0(b"v3tx/%02d" % i, b"") for i in range(16)])
    with pytest.raises(grpc.RpcError) as e:  # 9 x 16 compares: each within the limit, 144 > 128 in all
        etcd.kv.Txn(rpc_pb2.TxnRequest(success=[rpc_pb2.RequestOp(request_txn=inner)] * 9), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == "etcdserver: too many operations in txn request"
    assert etcd.kv.Txn(rpc_pb2.TxnRequest(success=[rpc_pb2.RequestOp(request_txn=inner)] * 8), timeout=10).succeeded

    for start in range(0, MAX_COMPARED_KEYS + 1, 128):
        etcd.kv.Txn(rpc_pb2.TxnRequest(success=[op_put(b"v3cmp/%05d" % i, b"") for i in range(start, min(start + 128, MAX_COMPARED_KEYS + 1))]), timeout=10)
    with pytest.raises(grpc.RpcError) as e:
        etcd.kv.Txn(rpc_pb2.TxnRequest(compare=[version_above_0(b"v3cmp/", b"v3cmp0")], success=[op_put(b"v3cmp-done", b"1")]), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"more than {MAX_COMPARED_KEYS} keys" in e.value.details()
    assert not get(etcd, b"v3cmp-done").kvs
    r = etcd.kv.Txn(rpc_pb2.TxnRequest(compare=[version_above_0(b"v3cmp/0", b"v3cmp/1")], success=[op_put(b"v3cmp-done", b"1")]), timeout=10)
    assert r.succeeded and get(etcd, b"v3cmp-done").kvs[0].value == b"1"  # 1,000 keys: within the limit


def test_revisions_outside_what_the_node_holds_get_etcds_errors(etcd):
    now = put(etcd, b"v3rev", b"x").header.revision
    with pytest.raises(grpc.RpcError) as e:
        get(etcd, b"v3rev", revision=now + 1000)
    assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE and e.value.details() == "etcdserver: mvcc: required revision is a future revision"
    assert get(etcd, b"v3rev", revision=now - 1).count == 0  # the history: it was not there yet
    assert get(etcd, b"v3rev", revision=now).kvs[0].value == b"x"
    # (below the compact revision: tested on the single node, whose history this test
    # does not share with the others)


def test_delete_range_counts_and_returns_what_it_deleted(etcd):
    for k in (b"v3d/a", b"v3d/b", b"v3d/c"):
        put(etcd, k, b"v")
    one = etcd.kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=b"v3d/a", prev_kv=True), timeout=10)
    assert one.deleted == 1 and one.prev_kvs[0].value == b"v"
    rest = etcd.kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=b"v3d/", range_end=b"v3d0"), timeout=10)
    assert rest.deleted == 2 and get(etcd, b"v3d/", range_end=b"v3d0").count == 0
    assert etcd.kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=b"v3d/a"), timeout=10).deleted == 0
    assert put(etcd, b"v3d/a", b"again").header.revision > 0
    assert get(etcd, b"v3d/a").kvs[0].version == 1  # a deleted key starts over


def test_a_transaction_that_writes_nothing_is_a_read(etcd, cluster):
    put(etcd, b"v3ro/k", b"v")
    compare = rpc_pb2.Compare
    txn = rpc_pb2.TxnRequest(
        compare=[compare(key=b"v3ro/k", target=compare.VALUE, result=compare.EQUAL, value=b"v")],
        success=[rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=b"v3ro/", range_end=b"v3ro0"))],
        failure=[rpc_pb2.RequestOp(request_txn=rpc_pb2.TxnRequest())],
    )
    before = cluster.status(cluster.leader_id)["ledger_end_index"]
    for _ in range(20):
        r = etcd.kv.Txn(txn, timeout=10)
    # read on the follower, not 20 entries through the log (a lease's expiry may add one)
    assert cluster.status(cluster.leader_id)["ledger_end_index"] - before < 5
    assert r.succeeded and [kv.value for kv in r.responses[0].response_range.kvs] == [b"v"] and r.header.revision >= before
    txn.compare[0].value = b"other"
    r = etcd.kv.Txn(txn, timeout=10)
    assert not r.succeeded and r.responses[0].response_txn.succeeded  # the nested (empty) one ran


def test_txn_compares_every_target_and_runs_one_branch_atomically(etcd):
    created = put(etcd, b"v3t/k", b"one").header.revision
    compare = rpc_pb2.Compare
    cases = [
        (compare(key=b"v3t/k", target=compare.VERSION, result=compare.EQUAL, version=1), True),
        (compare(key=b"v3t/k", target=compare.CREATE, result=compare.EQUAL, create_revision=created), True),
        (compare(key=b"v3t/k", target=compare.MOD, result=compare.LESS, mod_revision=created + 1), True),
        (compare(key=b"v3t/k", target=compare.VALUE, result=compare.NOT_EQUAL, value=b"one"), False),
        (compare(key=b"v3t/k", target=compare.VALUE, result=compare.GREATER, value=b"a"), True),
        (compare(key=b"v3t/k", target=compare.LEASE, result=compare.EQUAL, lease=0), True),
        (compare(key=b"v3t/absent", target=compare.VERSION, result=compare.EQUAL, version=0), True),
        (compare(key=b"v3t/absent", target=compare.VALUE, result=compare.EQUAL, value=b""), False),  # a missing key's value compare fails
        (compare(key=b"v3t/", range_end=b"v3t0", target=compare.VERSION, result=compare.GREATER, version=0), True),
    ]
    for c, holds in cases:
        r = etcd.kv.Txn(rpc_pb2.TxnRequest(compare=[c], success=[rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=b"v3t/k"))]), timeout=10)
        assert r.succeeded is holds, c
    r = etcd.kv.Txn(
        rpc_pb2.TxnRequest(
            compare=[compare(key=b"v3t/k", target=compare.VALUE, result=compare.EQUAL, value=b"one")],
            success=[op_put(b"v3t/k", b"two", prev_kv=True), op_put(b"v3t/other", b"x"), rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=b"v3t/k"))],
            failure=[op_put(b"v3t/failed", b"x")],
        ),
        timeout=10,
    )
    assert r.succeeded and r.responses[0].response_put.prev_kv.value == b"one"
    assert r.responses[2].response_range.kvs[0].value == b"two"  # a range sees the txn's own earlier put
    assert r.responses[2].response_range.kvs[0].mod_revision == r.header.revision == get(etcd, b"v3t/other").kvs[0].mod_revision
    assert get(etcd, b"v3t/failed").count == 0
    nested = etcd.kv.Txn(
        rpc_pb2.TxnRequest(
            compare=[compare(key=b"v3t/k", target=compare.VALUE, result=compare.EQUAL, value=b"nope")],
            failure=[rpc_pb2.RequestOp(request_txn=rpc_pb2.TxnRequest(
                compare=[compare(key=b"v3t/k", target=compare.VERSION, result=compare.EQUAL, version=2)],
                success=[op_put(b"v3t/nested", b"yes")],
            ))],
        ),
        timeout=10,
    )
    assert not nested.succeeded and nested.responses[0].response_txn.succeeded
    assert get(etcd, b"v3t/nested").kvs[0].value == b"yes"


def test_txn_refusals_change_nothing_and_say_what_etcd_says(etcd):
    put(etcd, b"v3x/k", b"v")
    before = get(etcd, b"v3x/k").kvs[0].mod_revision
    refusals = [
        (rpc_pb2.TxnRequest(success=[op_put(b"v3x/k", b"1"), op_put(b"v3x/k", b"2")]), grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: duplicate key given in txn request"),
        (rpc_pb2.TxnRequest(success=[op_put(b"v3x/k", b"1"), rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=b"v3x/", range_end=b"v3x0"))]),
         grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: duplicate key given in txn request"),
        (rpc_pb2.TxnRequest(success=[op_put(b"v3x/%d" % i, b"1") for i in range(200)]), grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: too many operations in txn request"),
        (rpc_pb2.TxnRequest(success=[op_put(b"v3x/k", b"1"), op_put(b"v3x/l", b"1", lease=12345)]), grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found"),
        (rpc_pb2.TxnRequest(success=[op_put(b"v3x/k", b"1"), op_put(b"v3x/absent", b"", ignore_value=True)]), grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: key not found"),
        (rpc_pb2.TxnRequest(success=[op_put(b"", b"1")]), grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: key is not provided"),
    ]
    for req, code, text in refusals:
        with pytest.raises(grpc.RpcError) as e:
            etcd.kv.Txn(req, timeout=10)
        assert (e.value.code(), e.value.details()) == (code, text)
    assert get(etcd, b"v3x/k").kvs[0].mod_revision == before and get(etcd, b"v3x/k").kvs[0].value == b"v"
    kept = put(etcd, b"v3x/k", b"", ignore_value=True, prev_kv=True)
    assert kept.prev_kv.value == b"v" and get(etcd, b"v3x/k").kvs[0].value == b"v"


def test_leases_grant_keep_alive_list_and_revoke(etcd):
    granted = etcd.lease.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=30), timeout=10)
    assert granted.ID > 0 and granted.TTL == 30
    chosen = etcd.lease.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=30, ID=424242), timeout=10)
    assert chosen.ID == 424242
    with pytest.raises(grpc.RpcError) as e:
        etcd.lease.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=30, ID=424242), timeout=10)
    assert (e.value.code(), e.value.details()) == (grpc.StatusCode.FAILED_PRECONDITION, "etcdserver: lease already exists")
    put(etcd, b"v3l/held", b"v", lease=granted.ID)
    assert get(etcd, b"v3l/held").kvs[0].lease == granted.ID
    ttl = etcd.lease.LeaseTimeToLive(rpc_pb2.LeaseTimeToLiveRequest(ID=granted.ID, keys=True), timeout=10)
    assert ttl.grantedTTL == 30 and 0 < ttl.TTL <= 30 and list(ttl.keys) == [b"v3l/held"]
    answers = list(etcd.lease.LeaseKeepAlive(iter([rpc_pb2.LeaseKeepAliveRequest(ID=granted.ID), rpc_pb2.LeaseKeepAliveRequest(ID=99), rpc_pb2.LeaseKeepAliveRequest(ID=chosen.ID)]), timeout=10))
    assert [(a.ID, a.TTL) for a in answers] == [(granted.ID, 30), (99, 0), (chosen.ID, 30)]
    listed = {x.ID for x in etcd.lease.LeaseLeases(rpc_pb2.LeaseLeasesRequest(), timeout=10).leases}
    assert {granted.ID, chosen.ID} <= listed
    etcd.lease.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=granted.ID), timeout=10)
    assert get(etcd, b"v3l/held").count == 0
    assert etcd.lease.LeaseTimeToLive(rpc_pb2.LeaseTimeToLiveRequest(ID=granted.ID), timeout=10).TTL == -1
    with pytest.raises(grpc.RpcError) as e:
        etcd.lease.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=granted.ID), timeout=10)
    assert (e.value.code(), e.value.details()) == (grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found")


class WatchStream:
    """One Watch stream: requests in, responses collected by a thread."""

    def __init__(self, etcd) -> None:
        self.requests: list = []
        self.cond = threading.Condition()
        self.responses: list[rpc_pb2.WatchResponse] = []
        self.call = etcd.watch.Watch(self._requests())
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _requests(self):
        sent = 0
        while True:
            with self.cond:
                self.cond.wait_for(lambda: len(self.requests) > sent)
                req = self.requests[sent]
            sent += 1
            if req is None:
                return
            yield req

    def send(self, req) -> None:
        with self.cond:
            self.requests.append(req)
            self.cond.notify_all()

    def _read(self) -> None:
        try:
            for r in self.call:
                with self.cond:
                    self.responses.append(r)
                    self.cond.notify_all()
        except grpc.RpcError:
            pass

    def wait(self, pred, timeout: float = 10.0):
        with self.cond:
            assert self.cond.wait_for(lambda: pred(self.responses), timeout), self.responses
            return list(self.responses)

    def close(self) -> None:
        self.call.cancel()


def test_watch_many_on_one_stream_with_prev_kv_filters_progress_and_cancel(etcd):
    after = put(etcd, b"v3w/k", b"0").header.revision + 1  # (a follower may not have applied it yet: "now" could be before it)
    s = WatchStream(etcd)
    try:
        s.send(rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=b"v3w/k", prev_kv=True, start_revision=after)))
        s.send(rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=b"v3w/", range_end=b"v3w0", filters=[rpc_pb2.WatchCreateRequest.NOPUT], start_revision=after)))
        created = s.wait(lambda rs: sum(r.created for r in rs) == 2)
        ids = [r.watch_id for r in created if r.created]
        assert len(set(ids)) == 2
        txn = etcd.kv.Txn(rpc_pb2.TxnRequest(success=[op_put(b"v3w/k", b"1"), op_put(b"v3w/j", b"x")]), timeout=10)
        etcd.kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=b"v3w/j"), timeout=10)
        rs = s.wait(lambda rs: any(r.watch_id == ids[1] and r.events for r in rs) and any(r.watch_id == ids[0] and r.events for r in rs))
        (on_key,) = [r for r in rs if r.watch_id == ids[0] and r.events]
        (ev,) = on_key.events
        assert ev.type == kv_pb2.Event.PUT and ev.kv.value == b"1" and ev.kv.version == 2 and ev.kv.mod_revision == txn.header.revision
        assert ev.prev_kv.value == b"0" and ev.prev_kv.version == 1
        (deletes,) = [r for r in rs if r.watch_id == ids[1] and r.events]
        assert [(e.type, e.kv.key) for e in deletes.events] == [(kv_pb2.Event.DELETE, b"v3w/j")]  # NOPUT: the puts are left out
        s.send(rpc_pb2.WatchRequest(progress_request=rpc_pb2.WatchProgressRequest()))
        s.wait(lambda rs: any(r.watch_id == -1 and r.header.revision >= txn.header.revision for r in rs))
        s.send(rpc_pb2.WatchRequest(cancel_request=rpc_pb2.WatchCancelRequest(watch_id=ids[0])))
        s.wait(lambda rs: any(r.canceled and r.watch_id == ids[0] for r in rs))
    finally:
        s.close()


def test_watch_and_lease_answer_as_etcd_34_where_a_differential_run_found_they_did_not(etcd):
    """Found by running the same scenarios against etcd 3.4 and a ledgerkv follower."""
    now = put(etcd, b"v3wf/k", b"0").header.revision
    s = WatchStream(etcd)
    try:
        def create(**kw):
            s.send(rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(**kw)))

        # A start revision ahead of now: the changes before it are not sent (they were)
        create(key=b"v3wf/k", start_revision=now + 3)
        s.wait(lambda rs: any(r.created for r in rs))
        revs = [put(etcd, b"v3wf/k", b"%d" % i).header.revision for i in range(1, 5)]
        rs = s.wait(lambda rs: any(e.kv.mod_revision == revs[-1] for r in rs for e in r.events))
        assert [e.kv.mod_revision for r in rs for e in r.events] == [r for r in revs if r >= now + 3]
        # Refused as etcd refuses them: id -1, created and canceled, etcd's texts
        create(key=b"v3wf/z", range_end=b"v3wf/a")
        create(key=b"v3wf/k", watch_id=100)
        create(key=b"v3wf/k", watch_id=100)
        rs = s.wait(lambda rs: sum(r.watch_id == -1 and r.canceled for r in rs) == 2)
        assert [r.cancel_reason for r in rs if r.watch_id == -1 and r.canceled] == ["mvcc: watcher range is empty", "mvcc: duplicate watch ID provided on the WatchStream"]
        # An empty key is the key "\0": created (it never fires: no one can put it here)
        create(key=b"", watch_id=200)
        rs = s.wait(lambda rs: any(r.watch_id == 200 for r in rs))
        assert [(r.created, r.canceled) for r in rs if r.watch_id == 200] == [(True, False)]
    finally:
        s.close()
    # Leases: ids of 0 and below are no lease's; whole seconds left, cut down; the list by expiry
    assert etcd.lease.LeaseTimeToLive(rpc_pb2.LeaseTimeToLiveRequest(ID=0), timeout=10).TTL == -1
    with pytest.raises(grpc.RpcError) as e:
        etcd.lease.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=-1), timeout=10)
    assert (e.value.code(), e.value.details()) == (grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found")
    late = etcd.lease.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=300), timeout=10).ID
    soon = etcd.lease.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=100), timeout=10).ID
    time.sleep(0.6)  # (the leader's clock counts a lease from its next sweep, a quarter second at most)
    ttl = etcd.lease.LeaseTimeToLive(rpc_pb2.LeaseTimeToLiveRequest(ID=soon), timeout=10)
    assert ttl.grantedTTL == 100 and ttl.TTL == 99
    listed = [x.ID for x in etcd.lease.LeaseLeases(rpc_pb2.LeaseLeasesRequest(), timeout=10).leases]
    assert listed.index(soon) < listed.index(late)
    for lease in (late, soon):
        etcd.lease.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=lease), timeout=10)


def test_keys_of_any_bytes_as_etcd_holds_them(etcd, cluster):
    """Keys that are not UTF-8 (etcdctl check perf writes random bytes): written, compared,
    ranged in byte order, watched, attached to a lease and deleted through the etcd API, and
    read by ledgerkv's own client from another process, which holds them as Python holds
    undecodable file names (lone surrogates)."""
    odd, low = b"v3b/\xff\x00\x01", b"v3b/\x80"
    after = put(etcd, b"v3b/a", b"0").header.revision + 1
    s = WatchStream(etcd)
    try:
        s.send(rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=b"v3b/", range_end=b"v3b0", prev_kv=True, start_revision=after)))
        s.wait(lambda rs: any(r.created for r in rs))
        lease = etcd.lease.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=60), timeout=10).ID
        first = put(etcd, odd, b"1", lease=lease)
        put(etcd, low, b"2")
        txn = etcd.kv.Txn(
            rpc_pb2.TxnRequest(
                compare=[rpc_pb2.Compare(key=odd, target=rpc_pb2.Compare.VERSION, result=rpc_pb2.Compare.EQUAL, version=1)],
                success=[op_put(odd, b"3", prev_kv=True, lease=lease)],
            ),
            timeout=10,
        )
        assert txn.succeeded and txn.responses[0].response_put.prev_kv.key == odd
        got = get(etcd, b"v3b/", range_end=b"v3b0")
        assert [(kv.key, kv.value, kv.version) for kv in got.kvs] == [(b"v3b/a", b"0", 1), (low, b"2", 1), (odd, b"3", 2)]
        assert got.kvs[2].create_revision == first.header.revision
        by_key = get(etcd, b"v3b/", range_end=b"v3b0", sort_target=rpc_pb2.RangeRequest.KEY, sort_order=rpc_pb2.RangeRequest.DESCEND, limit=2)
        assert [kv.key for kv in by_key.kvs] == [odd, low] and by_key.more
        ttl = etcd.lease.LeaseTimeToLive(rpc_pb2.LeaseTimeToLiveRequest(ID=lease, keys=True), timeout=10)
        assert list(ttl.keys) == [odd]
        rs = s.wait(lambda rs: sum(len(r.events) for r in rs) >= 3)
        events = [e for r in rs for e in r.events]
        assert [(e.kv.key, e.kv.value) for e in events] == [(odd, b"1"), (low, b"2"), (odd, b"3")]
        assert events[2].prev_kv.key == odd and events[2].prev_kv.value == b"1"
        script = (
            "import kv, sys\n"
            "with kv.Client(sys.argv[1]) as c:\n"
            "    got = [(it.key, it.value) for it in c.scan('v3b/', page=1)]\n"  # a page a key: after= carries the bytes
            "    assert got == [('v3b/a', b'0'), ('v3b/\\udc80', b'2'), ('v3b/\\udcff\\x00\\x01', b'3')], got\n"
            "    assert c.get('v3b/\\udc80').value == b'2'\n"
            "    c.put('v3b/\\udcfe', b'4')\n"
            "    print('ok')\n"
        )
        r = subprocess.run([sys.executable, "-c", script, cluster.http[cluster.leader_id]], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
        assert get(etcd, b"v3b/\xfe").kvs[0].value == b"4"
        # the CLI: argv's bytes are the key (Python reads argv as it reads file names)
        kv_cli = [sys.executable, "-m", "kv"]
        ep = ["--endpoints", cluster.http[cluster.follower]]
        r = subprocess.run([*kv_cli, "put", b"v3b/\xfd\t", "5", *ep], capture_output=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert get(etcd, b"v3b/\xfd\t").kvs[0].value == b"5"
        r = subprocess.run([*kv_cli, "scan", "v3b/", *ep], capture_output=True, timeout=60)
        assert r.returncode == 0 and b"v3b/\\xfd\\t\t5\t" in r.stdout, (r.stdout, r.stderr)  # escaped, on its line
        r = subprocess.run([*kv_cli, "scan", "v3b/", "-o", "json", *ep], capture_output=True, timeout=60)
        docs = [json.loads(line) for line in r.stdout.splitlines()]
        assert {"key": base64.b64encode(b"v3b/\xfd\t").decode(), "key_encoding": "base64", "value": "5"}.items() <= docs[2].items(), docs
        deleted = etcd.kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=b"v3b/\x80", range_end=b"v3b0", prev_kv=True), timeout=10)
        assert [kv.key for kv in deleted.prev_kvs] == [low, b"v3b/\xfd\t", b"v3b/\xfe", odd]
    finally:
        s.close()


def test_watch_from_a_past_revision_replays_the_transaction_whole(etcd):
    r = etcd.kv.Txn(rpc_pb2.TxnRequest(success=[op_put(b"v3h/a", b"1"), op_put(b"v3h/b", b"2")]), timeout=10)
    put(etcd, b"v3h/a", b"3")
    s = WatchStream(etcd)
    try:
        s.send(rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=b"v3h/", range_end=b"v3h0", start_revision=r.header.revision)))
        rs = s.wait(lambda rs: sum(len(x.events) for x in rs) >= 3)
        events = [e for x in rs for e in x.events]
        assert [(e.kv.key, e.kv.value, e.kv.version) for e in events] == [(b"v3h/a", b"1", 1), (b"v3h/b", b"2", 1), (b"v3h/a", b"3", 2)]
        first = next(x for x in rs if x.events)
        assert len(first.events) >= 2 and first.events[0].kv.mod_revision == first.events[1].kv.mod_revision  # one revision, one response
    finally:
        s.close()


def test_member_list_status_and_alarms(etcd, cluster):
    members = etcd.cluster.MemberList(rpc_pb2.MemberListRequest(), timeout=10).members
    assert sorted(m.name for m in members) == cluster.ids and len({m.ID for m in members}) == 3
    assert {m.name: list(m.clientURLs) for m in members} == {i: [f"http://{cluster.grpc[i]}"] for i in cluster.ids}  # what --cluster dials
    status = etcd.maintenance.Status(rpc_pb2.StatusRequest(), timeout=10)
    assert status.version.startswith("3.4") and status.dbSize > 0 and status.raftTerm >= 1 and status.raftIndex >= 1
    assert status.leader == next(m.ID for m in members if m.name == cluster.leader_id)
    assert list(etcd.maintenance.Alarm(rpc_pb2.AlarmRequest(), timeout=10).alarms) == []
    put(etcd, b"v3m/hashed", b"1")  # (a store with no key hashes to 0)
    assert etcd.maintenance.HashKV(rpc_pb2.HashKVRequest(), timeout=10).hash != 0
    # a learner added and never started has no name, as in etcd: etcdctl says "unstarted"
    doc = json.dumps({"id": "n9", "peer": f"127.0.0.1:{free_port()}", "http": f"http://127.0.0.1:{free_port()}"}).encode()
    assert cluster.request(cluster.leader_id, "POST", "/v1/members", doc, {"Content-Type": "application/json"})[0] == 200
    try:
        named = {m.ID: m.name for m in etcd.cluster.MemberList(rpc_pb2.MemberListRequest(), timeout=10).members}
        assert sorted(named.values()) == ["", *cluster.ids]
        if ETCDCTL:
            out = subprocess.run([ETCDCTL, "--endpoints", cluster.grpc[cluster.follower], "member", "list"], env={**os.environ, "ETCDCTL_API": "3"}, capture_output=True, text=True, timeout=30)
            assert out.stdout.count(", unstarted, ") == 1 and out.stdout.count(", started, ") == 3, out.stdout
    finally:
        assert cluster.request(cluster.leader_id, "DELETE", "/v1/members/n9")[0] == 200


def test_hash_kv_at_a_past_revision_is_every_members_hash_of_the_keys_as_they_were(etcd, cluster):
    """etcdctl endpoint hashkv --rev R: any revision the history holds (it was refused as
    compacted unless it was the newest), the same on every member, one cut however many
    pages; a revision compacted or ahead is refused with etcd's texts."""
    before = put(etcd, b"hk", b"a").header.revision
    after = put(etcd, b"hk", b"b").header.revision
    leader = Stubs(cluster.grpc[cluster.leader_id])
    try:
        hashes = {}
        for name, member in (("follower", etcd), ("leader", leader)):
            hashes[name] = [member.maintenance.HashKV(rpc_pb2.HashKVRequest(revision=r), timeout=10) for r in (before, after)]
        assert [r.hash for r in hashes["follower"]] == [r.hash for r in hashes["leader"]]
        at_before, at_after = hashes["leader"]
        assert at_before.hash != at_after.hash and at_before.header.revision == before
        assert leader.maintenance.HashKV(rpc_pb2.HashKVRequest(), timeout=10).hash != at_before.hash
        with pytest.raises(grpc.RpcError) as e:
            leader.maintenance.HashKV(rpc_pb2.HashKVRequest(revision=after + 1_000_000), timeout=10)
        assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE and e.value.details() == "etcdserver: mvcc: required revision is a future revision"
    finally:
        leader.channel.close()


@pytest.mark.skipif(ETCDCTL is None, reason="etcdctl is not installed (Debian's etcd-client; .ci/run installs it)")
def test_etcdctl_against_a_follower(cluster):
    env = {**os.environ, "ETCDCTL_API": "3"}
    ep = ["--endpoints", cluster.grpc[cluster.follower]]

    def ctl(*args: str, stdin: str | None = None) -> str:
        r = subprocess.run([ETCDCTL, *ep, *args], capture_output=True, text=True, env=env, input=stdin, timeout=30)
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert ctl("put", "ctl/a", "1").strip() == "OK"
    assert ctl("get", "ctl/a").split() == ["ctl/a", "1"]
    assert ctl("put", "ctl/b", "2").strip() == "OK"
    assert ctl("get", "ctl/", "--prefix", "--keys-only").split() == ["ctl/a", "ctl/b"]
    assert ctl("txn", stdin='value("ctl/a") = "1"\n\nput ctl/c 3\n\nput ctl/c no\n\n').split()[0] == "SUCCESS"
    assert ctl("get", "ctl/c").split() == ["ctl/c", "3"]
    assert ctl("del", "ctl/", "--prefix").strip() == "3"
    lease = ctl("lease", "grant", "30").split()[1]
    ctl("put", "ctl/l", "v", f"--lease={lease}")
    assert "attached keys([ctl/l])" in ctl("lease", "timetolive", lease, "--keys")
    ctl("lease", "revoke", lease)
    assert ctl("get", "ctl/l") == ""
    assert len(ctl("member", "list").strip().splitlines()) == 3
    assert "is healthy" in subprocess.run([ETCDCTL, *ep, "endpoint", "health"], capture_output=True, text=True, env=env, timeout=30).stderr
    health = subprocess.run([ETCDCTL, *ep, "endpoint", "health", "--cluster"], capture_output=True, text=True, env=env, timeout=30)
    assert health.returncode == 0 and health.stderr.count("is healthy") == 3, health.stderr  # every member, found through MemberList
    # etcd's minimum TTL, 1.5 election timeouts: 1 s with these nodes' 500 ms (2 s with the default 1 s, as etcd's)
    assert ctl("lease", "grant", "0").split()[4] == "TTL(1s)"
    # etcdctl of the v2 API (ETCDCTL_API=2) is told what to use instead, on either port
    for v2_ep in ("http://" + cluster.grpc[cluster.follower], cluster.url(cluster.follower)):
        v2 = subprocess.run([ETCDCTL, "--endpoints", v2_ep, "get", "ctl/a"], capture_output=True, text=True, env={**env, "ETCDCTL_API": "2"}, timeout=30)
        assert v2.returncode != 0 and "use ETCDCTL_API=3" in v2.stderr, v2.stderr


@pytest.mark.skipif(ETCDCTL is None, reason="etcdctl is not installed (Debian's etcd-client; .ci/run installs it)")
def test_etcdctl_lock_is_handed_over_when_the_holder_is_killed(cluster):
    env = {**os.environ, "ETCDCTL_API": "3"}
    holder = subprocess.Popen([ETCDCTL, "--endpoints", cluster.grpc[cluster.follower], "lock", "--ttl=3", "ctl-lock"], stdout=subprocess.PIPE, text=True, env=env)
    waiter = None
    try:
        assert holder.stdout.readline().startswith("ctl-lock/")
        other = next(i for i in cluster.ids if i != cluster.follower)
        waiter = subprocess.Popen([ETCDCTL, "--endpoints", cluster.grpc[other], "lock", "ctl-lock"], stdout=subprocess.PIPE, text=True, env=env)
        time.sleep(1.0)
        assert waiter.poll() is None  # still waiting while the holder lives
        holder.kill()  # its session's lease expires (3 s) and takes the lock key with it
        t0 = time.monotonic()
        line = waiter.stdout.readline()
        assert line.startswith("ctl-lock/") and time.monotonic() - t0 < 15
    finally:
        for p in (holder, waiter):
            if p is not None:
                p.kill()
                p.wait()


@pytest.mark.skipif(ETCDCTL is None, reason="etcdctl is not installed (Debian's etcd-client; .ci/run installs it)")
def test_a_node_stopped_for_a_restart_keeps_the_watches_and_lock_waits_of_etcds_clients(tmp_path):
    """A stop (SIGTERM) ended the calls open on the node with CANCELLED, on which etcd's Go
    client gives a watch or a lease's keepalives up for good: a rolling restart ended every
    `etcdctl watch` and `etcdctl lock` waiting there. With UNAVAILABLE, as etcd's "transport
    is closing", they wait for the node and carry on."""
    c = ProcCluster(str(tmp_path), 3)
    c.serve_etcd_api()
    env = {**os.environ, "ETCDCTL_API": "3"}
    procs: list[Proc] = []
    ended_test = threading.Event()

    def etcdctl(node: str, *args: str) -> Proc:
        procs.append(Proc([ETCDCTL, "--endpoints", c.grpc[node], *args], env=env))
        return procs[-1]

    try:
        c.start(*c.ids)
        other = c.leader()
        node = next(i for i in c.ids if i != other)  # a follower, and the only endpoint its clients know
        holder = etcdctl(other, "lock", "--ttl=3", "restart-lock")
        holder.expect("restart-lock/", 30)
        watcher = etcdctl(node, "watch", "--prefix", "restart/")
        waiter = etcdctl(node, "lock", "--ttl=10", "restart-lock")
        wait_until(  # (the waiter watches the holder's key)
            lambda: _open_watches(c, node) >= 2, 20,
            lambda: f"the watch and the lock wait on the node (kv_watches {_open_watches(c, node)}; etcdctl watch said {watcher.stderr()[-300:]!r}, "
            f"etcdctl lock {waiter.stderr()[-300:]!r}; the node's log ends {c.log(node)[-1500:]!r})",
        )
        stubs = Stubs(c.grpc[node])

        def requests():
            yield rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=b"restart/raw"))
            ended_test.wait(60)  # (the stream stays open from this side)

        raw = stubs.watch.Watch(requests(), timeout=60)
        assert next(raw).created
        c.stop(node)  # SIGTERM
        with pytest.raises(grpc.RpcError) as ended:
            next(raw)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE, ended.value
        stubs.channel.close()
        time.sleep(2.0)
        assert watcher.p.poll() is None and waiter.p.poll() is None, (watcher.stderr(), waiter.stderr())
        c.start(node)
        put(Stubs(c.grpc[other]), b"restart/k", b"after")
        # (the client comes back after its reconnect backoff: seconds)
        for line in ("PUT", "restart/k", "after"):
            watcher.expect(line, 90)
        holder.stop()  # its session's lease expires and the waiter, back on its node, takes the lock
        waiter.expect("restart-lock/", 90)
    finally:
        ended_test.set()
        for p in procs:
            p.stop()
        c.close()


# -- the JSON gateway (etcd 3.4's grpc-gateway, on the node's HTTP port) ----------------------

def b64(s: bytes) -> str:
    return base64.b64encode(s).decode()


def gw(cluster, path: str, body: dict, node: str | None = None, token: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{cluster.http[node or cluster.follower]}{path}", data=json.dumps(body).encode(), method="POST")
    if token is not None:
        req.add_header("Authorization", token)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_json_gateway_speaks_etcd_34s_json(cluster):
    status, put_r = gw(cluster, "/v3/kv/put", {"key": b64(b"gw/a"), "value": b64(b"1")})
    assert status == 200 and int(put_r["header"]["revision"]) > 0 and isinstance(put_r["header"]["revision"], str)
    status, got = gw(cluster, "/v3/kv/range", {"key": b64(b"gw/"), "range_end": b64(b"gw0")})
    assert status == 200 and got["count"] == "1"
    (kv,) = got["kvs"]
    assert (base64.b64decode(kv["key"]), base64.b64decode(kv["value"]), kv["version"], kv["create_revision"]) == (b"gw/a", b"1", "1", put_r["header"]["revision"])
    # Patroni's leader update: compares on CREATE/MOD/VALUE, a nested txn in failure
    status, txn = gw(cluster, "/v3/kv/txn", {
        "compare": [{"key": b64(b"gw/a"), "target": "MOD", "result": "EQUAL", "mod_revision": kv["mod_revision"]},
                    {"key": b64(b"gw/a"), "target": "VALUE", "result": "EQUAL", "value": b64(b"1")}],
        "success": [{"request_put": {"key": b64(b"gw/a"), "value": b64(b"2")}}],
        "failure": [{"request_txn": {"compare": [{"key": b64(b"gw/a"), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
                                     "success": [{"request_put": {"key": b64(b"gw/a"), "value": b64(b"new")}}]}}],
    })
    assert status == 200 and txn["succeeded"] is True and "response_put" in txn["responses"][0]
    status, err = gw(cluster, "/v3/kv/range", {"key": b64(b"gw/a"), "revision": str(int(txn["header"]["revision"]) + 10_000)})
    assert status == 400 and err["code"] == grpc.StatusCode.OUT_OF_RANGE.value[0] and err["error"] == "etcdserver: mvcc: required revision is a future revision"
    status, err = gw(cluster, "/v3/kv/range", {"key": "not base64!"})
    assert status == 400 and "RangeRequest" in err["message"]
    status, lease = gw(cluster, "/v3/lease/grant", {"TTL": "20"})
    assert status == 200 and int(lease["ID"]) > 0 and lease["TTL"] == "20"
    status, ttl = gw(cluster, "/v3/kv/lease/timetolive", {"ID": lease["ID"]})
    assert status == 200 and int(ttl["grantedTTL"]) == 20
    status, members = gw(cluster, "/v3/cluster/member/list", {})
    assert status == 200 and sorted(m["name"] for m in members["members"]) == cluster.ids
    status, st = gw(cluster, "/v3/maintenance/status", {})
    assert status == 200 and st["version"].startswith("3.4")
    with urllib.request.urlopen(f"http://{cluster.http[cluster.follower]}/version", timeout=10) as r:
        said = json.loads(r.read())
        assert said["etcdserver"].startswith("3.4") and said["ledgerkv"] == KV_VERSION
    with urllib.request.urlopen(f"http://{cluster.http[cluster.follower]}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    counted = dict(re.findall(r'^kv_etcd_api_(calls_total\{front="\w+"\}|errors_total\{code="\w+"\}) (\S+)$', metrics, re.M))
    assert float(counted['calls_total{front="grpc"}']) > 10 and float(counted['calls_total{front="gateway"}']) >= 8, counted
    assert float(counted['errors_total{code="OUT_OF_RANGE"}']) >= 1 and float(counted['errors_total{code="INVALID_ARGUMENT"}']) >= 1, counted


def test_the_gateways_watch_and_keepalive_stream_json_lines(cluster):
    req = urllib.request.Request(
        f"http://{cluster.http[cluster.follower]}/v3/watch",
        data=json.dumps({"create_request": {"key": b64(b"gww/"), "range_end": b64(b"gww0"), "prev_kv": True}}).encode(), method="POST",
    )
    with urllib.request.urlopen(req, timeout=10) as stream:
        created = json.loads(stream.readline())["result"]
        assert created["created"] is True
        gw(cluster, "/v3/kv/put", {"key": b64(b"gww/x"), "value": b64(b"v")})
        event = json.loads(stream.readline())["result"]["events"][0]
        assert base64.b64decode(event["kv"]["key"]) == b"gww/x" and event["kv"]["version"] == "1"
    status, lease = gw(cluster, "/v3/lease/grant", {"TTL": "20"})
    req = urllib.request.Request(f"http://{cluster.http[cluster.follower]}/v3/lease/keepalive", data=json.dumps({"ID": lease["ID"]}).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=10) as stream:
        assert json.loads(stream.readline())["result"]["TTL"] == "20"


def _open_watches(cluster, node: str) -> float:
    with urllib.request.urlopen(f"http://{cluster.http[node]}/metrics", timeout=10) as r:
        return next(float(line.split()[-1]) for line in r.read().decode().splitlines() if line.startswith("kv_watches "))


def test_a_gateway_watch_ends_when_its_client_goes_though_its_key_never_changes(cluster):
    """etcd drops a gateway watch as its client closes the connection; ledgerkv kept it
    until the next change under it (aiohttp tells a handler of a closed connection only
    when it writes): 500 clients that came and went on a quiet key left 500 watches."""
    node = cluster.follower
    before = _open_watches(cluster, node)
    body = json.dumps({"create_request": {"key": b64(b"gw-gone/quiet")}}).encode()
    host, port = cluster.http[node].split(":")
    socks = []
    for _ in range(5):
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(b"POST /v3/watch HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while b'"created":true' not in got:
            got += s.recv(4096)
        socks.append(s)
    assert _open_watches(cluster, node) >= before + 5
    for s in socks:
        s.close()
    deadline = time.monotonic() + 10
    while _open_watches(cluster, node) > before:
        assert time.monotonic() < deadline, "the watches of clients that went are still there"
        time.sleep(0.2)


def test_a_gateway_watch_ends_whole_with_etcds_last_line_when_the_node_stops(tmp_path):
    """etcd ends a gateway watch, as it stops, with an error line (UNAVAILABLE, "transport
    is closing") and the chunked answer's last chunk; ledgerkv dropped the connection
    mid-answer (curl: 'transfer closed with outstanding read data remaining')."""
    c = ProcCluster(str(tmp_path / "c"), 1, proxies=False)
    c.serve_etcd_api()
    with c:
        c.start()
        c.leader()
        host, port = c.http["n1"].split(":")
        body = json.dumps({"create_request": {"key": b64(b"stop/k")}}).encode()
        s = socket.create_connection((host, int(port)), timeout=20)
        s.sendall(b"POST /v3/watch HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while b'"created":true' not in got:
            got += s.recv(4096)
        c.stop("n1")  # SIGTERM, then waits for the process
        while chunk := s.recv(4096):
            got += chunk
        s.close()
    assert b'"message":"transport is closing"' in got and b'"grpc_code":14' in got and b'"http_status":"Service Unavailable"' in got, got
    assert got.endswith(b"\r\n0\r\n\r\n"), got[-80:]  # the chunked answer ends whole


def test_the_gateway_answers_as_etcd_34s_where_a_differential_run_found_it_did_not(cluster):
    """Found by sending the same requests to etcd 3.4's gateway and a ledgerkv follower."""
    follower = cluster.http[cluster.follower]

    def raw(path: str, body: bytes, host: str = follower) -> tuple[int, bytes]:
        req = urllib.request.Request(f"http://{host}{path}", data=body, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    # /v3/maintenance/hash is etcd's Hash there (it answered HashKV's compact_revision too); a revision is ignored
    status, h = gw(cluster, "/v3/maintenance/hash", {"revision": "1"})
    assert status == 200 and set(h) == {"header", "hash"}, h
    # A request's message given as something else than an object: refused (a watch of the key "\0" was created)
    status, body = raw("/v3/watch", b'{"create_request":"abc"}')
    assert status == 500 and json.loads(body)["code"] == grpc.StatusCode.UNKNOWN.value[0], (status, body)
    assert gw(cluster, "/v3/kv/txn", {"compare": ["abc"]})[0] == 400
    # A call ledgerkv does not serve: etcd's error body, UNIMPLEMENTED (was a 404 of ledgerkv's own shape)
    status, body = raw("/v3/maintenance/defragment", b"{}")
    err = json.loads(body)
    assert status == 501 and err["code"] == grpc.StatusCode.UNIMPLEMENTED.value[0] and "docs/etcd.md" in err["error"] == err["message"], (status, body)
    # A body of 500 KB is read whole (only what had arrived was read: a valid put refused)
    big = b"x" * 500_000
    assert gw(cluster, "/v3/kv/put", {"key": b64(b"gwd/big"), "value": b64(big)})[0] == 200
    assert base64.b64decode(gw(cluster, "/v3/kv/range", {"key": b64(b"gwd/big")})[1]["kvs"][0]["value"]) == big
    # A keepalive's answer ends with its requests (Patroni reads it whole); each JSON value of a body is a request
    lease = gw(cluster, "/v3/lease/grant", {"TTL": "20"})[1]["ID"]
    status, body = raw("/v3/lease/keepalive", json.dumps({"ID": lease}).encode() * 2)
    assert status == 200 and [json.loads(line)["result"]["ID"] for line in body.splitlines()] == [lease, lease]
    # Base64 that is not strictly base64, an enum name that is not one: refused, as etcd does
    # (Python's decoder drops what is not base64: "Z3dk L3g=" put the key gwd/x)
    for bad in ({"key": "Z3dk L3g=", "value": b64(b"1")}, {"key": "Z3dkL3g", "value": b64(b"1")}, {"key": "Z3dk_3g=", "value": b64(b"1")}):
        assert gw(cluster, "/v3/kv/put", bad)[0] == 400, bad
    assert gw(cluster, "/v3/kv/range", {"key": b64(b"gwd/"), "range_end": b64(b"gwd0"), "keys_only": True})[1]["count"] == "1"  # (only big)
    for field, value in (("sort_order", "BOGUS"), ("sort_order", "descend"), ("sort_order", "2"), ("sort_target", 9)):
        assert gw(cluster, "/v3/kv/range", {"key": b64(b"gwd/"), "range_end": b64(b"gwd0"), field: value})[0] == 400, (field, value)
    assert gw(cluster, "/v3/kv/range", {"key": b64(b"gwd/"), "range_end": b64(b"gwd0"), "sort_order": "DESCEND"})[0] == 200
    # The client URLs MemberList gives (the gRPC ports) serve the gateway too, as etcd's
    urls = [u for m in gw(cluster, "/v3/cluster/member/list", {})[1]["members"] for u in m["clientURLs"]]
    assert urls and all(raw("/v3/kv/range", json.dumps({"key": b64(b"gwd/big")}).encode(), u.split("//", 1)[1])[0] == 200 for u in urls)
    # etcd's /health
    with urllib.request.urlopen(f"http://{follower}/health", timeout=10) as r:
        assert json.loads(r.read()) == {"health": "true"}


def test_a_nospace_alarm_raised_through_the_api_refuses_writes_that_add_data_until_cleared(etcd, cluster):
    put(etcd, b"v3alarm/k", b"v")
    raised = etcd.maintenance.Alarm(rpc_pb2.AlarmRequest(action=rpc_pb2.AlarmRequest.ACTIVATE, alarm=rpc_pb2.NOSPACE), timeout=10)
    try:
        assert [(a.memberID, a.alarm) for a in raised.alarms] == [(0, rpc_pb2.NOSPACE)]
        other = Stubs(cluster.grpc[cluster.leader_id])
        try:
            assert [(a.memberID, a.alarm) for a in other.maintenance.Alarm(rpc_pb2.AlarmRequest(), timeout=10).alarms] == [(0, rpc_pb2.NOSPACE)]
            with pytest.raises(grpc.RpcError) as e:
                put(other, b"v3alarm/new", b"x")
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.details().startswith("etcdserver: mvcc: database space exceeded")
        finally:
            other.channel.close()
        assert etcd.kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=b"v3alarm/k"), timeout=10).deleted == 1  # deletes go through
    finally:
        cleared = etcd.maintenance.Alarm(rpc_pb2.AlarmRequest(action=rpc_pb2.AlarmRequest.DEACTIVATE, alarm=rpc_pb2.NOSPACE), timeout=10)
    assert [(a.memberID, a.alarm) for a in cleared.alarms] == [(0, rpc_pb2.NOSPACE)]
    assert list(etcd.maintenance.Alarm(rpc_pb2.AlarmRequest(), timeout=10).alarms) == []
    wait_until(lambda: _put_ok(etcd), 10)


def _put_ok(etcd) -> bool:
    try:
        put(etcd, b"v3alarm/after", b"x")
        return True
    except grpc.RpcError:
        return False


@pytest.mark.skipif(ETCDCTL is None or shutil.which("etcd") is None, reason="etcd and etcdctl are not installed (Debian's etcd-server and etcd-client; .ci/run installs them)")
def test_etcdctl_make_mirror_moves_a_live_etcd_into_ledgerkv(cluster, tmp_path):
    """The way over from etcd: make-mirror copies every key, then follows the changes."""
    env = {**os.environ, "ETCDCTL_API": "3"}
    client, peer = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    etcd = subprocess.Popen(
        ["etcd", "--name", "src", "--data-dir", str(tmp_path / "etcd"), "--listen-client-urls", f"http://{client}", "--advertise-client-urls", f"http://{client}",
         "--listen-peer-urls", f"http://{peer}", "--initial-advertise-peer-urls", f"http://{peer}", "--initial-cluster", f"src=http://{peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    mirror = None
    try:
        def src(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([ETCDCTL, "--endpoints", client, *args], capture_output=True, text=True, env=env, timeout=30)

        wait_until(lambda: src("put", "mm/0", "v0").returncode == 0, 20)
        for i in range(1, 40):
            assert src("put", f"mm/{i}", f"v{i}").returncode == 0
        mirror = subprocess.Popen([ETCDCTL, "--endpoints", client, "make-mirror", cluster.grpc[cluster.follower]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        dest = Stubs(cluster.grpc[cluster.leader_id])
        try:
            wait_until(lambda: get(dest, b"mm/", range_end=b"mm0").count == 40, 20)
            src("put", "mm/live", "after")
            src("del", "mm/0")
            wait_until(lambda: get(dest, b"mm/live").count == 1 and get(dest, b"mm/0").count == 0, 20)
            assert {kv.key: kv.value for kv in get(dest, b"mm/", range_end=b"mm0").kvs}[b"mm/39"] == b"v39"
        finally:
            dest.channel.close()
    finally:
        for p in (mirror, etcd):
            if p is not None:
                p.kill()
                p.wait()



def test_kv_answers_as_etcd_34_where_a_differential_fuzzer_found_it_did_not(etcd):
    """Found by running seeded sequences against etcd 3.4 and ledgerkv side by side."""
    invalid = grpc.StatusCode.INVALID_ARGUMENT

    def refused(call, req, code, text):
        with pytest.raises(grpc.RpcError) as e:
            call(req, timeout=10)
        assert (e.value.code(), e.value.details()) == (code, text)

    def rng(key, end=b"", **kw):
        return rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=key, range_end=end, **kw))

    first = put(etcd, b"v3f/a", b"2").header.revision
    put(etcd, b"v3f/b", b"1")
    put(etcd, b"v3f/a", b"3")
    # An empty key with a range end: refused, as etcd does (it read, and deleted, from the first key)
    refused(etcd.kv.Range, rpc_pb2.RangeRequest(key=b"", range_end=b"\x00"), invalid, "etcdserver: key is not provided")
    refused(etcd.kv.DeleteRange, rpc_pb2.DeleteRangeRequest(key=b"", range_end=b"v3f0"), invalid, "etcdserver: key is not provided")
    assert get(etcd, b"v3f/", range_end=b"v3f0").count == 2
    # A Range at a past revision inside a Txn of reads reads at it (it read the current value)
    r = etcd.kv.Txn(rpc_pb2.TxnRequest(success=[rng(b"v3f/a", revision=first), rng(b"v3f/a")]), timeout=10)
    assert [x.response_range.kvs[0].value for x in r.responses] == [b"2", b"3"]
    nested = etcd.kv.Txn(rpc_pb2.TxnRequest(success=[rpc_pb2.RequestOp(request_txn=rpc_pb2.TxnRequest(success=[rng(b"v3f/a", revision=first)]))]), timeout=10)
    assert nested.responses[0].response_txn.responses[0].response_range.kvs[0].value == b"2"
    refused(etcd.kv.Txn, rpc_pb2.TxnRequest(success=[rng(b"v3f/a", revision=r.header.revision + 1000)]), grpc.StatusCode.OUT_OF_RANGE,
            "etcdserver: mvcc: required revision is a future revision")
    with pytest.raises(grpc.RpcError) as e:  # (in a transaction that writes: refused, not read as of now)
        etcd.kv.Txn(rpc_pb2.TxnRequest(success=[rng(b"v3f/a", revision=first), op_put(b"v3f/c", b"1")]), timeout=10)
    assert e.value.code() == invalid and "past revision" in e.value.details()
    # keys_only sorted by value: sorted by the values, then without them
    got = get(etcd, b"v3f/", range_end=b"v3f0", keys_only=True, sort_target=rpc_pb2.RangeRequest.VALUE, sort_order=rpc_pb2.RangeRequest.ASCEND)
    assert [(kv.key, kv.value) for kv in got.kvs] == [(b"v3f/b", b""), (b"v3f/a", b"")]
    # A negative limit is none
    assert len(get(etcd, b"v3f/", range_end=b"v3f0", limit=-1).kvs) == 2
    # A compare given another target's field compares with 0 (or ""), as etcd's do
    value_vs_version = rpc_pb2.Compare(key=b"v3f/a", target=rpc_pb2.Compare.VALUE, result=rpc_pb2.Compare.EQUAL, version=1)
    create_vs_mod = rpc_pb2.Compare(key=b"v3f/a", target=rpc_pb2.Compare.CREATE, result=rpc_pb2.Compare.LESS, mod_revision=first + 100)
    for c in (value_vs_version, create_vs_mod):
        assert not etcd.kv.Txn(rpc_pb2.TxnRequest(compare=[c], success=[rng(b"v3f/a")]), timeout=10).succeeded
    bad_target = rpc_pb2.Compare(key=b"v3f/a", target=9, result=rpc_pb2.Compare.EQUAL, version=1)
    with pytest.raises(grpc.RpcError) as e:
        etcd.kv.Txn(rpc_pb2.TxnRequest(compare=[bad_target], success=[rng(b"v3f/a")]), timeout=10)
    assert e.value.code() == invalid
    # etcd's checks, in etcd's order: a nested transaction has what its parent leaves of
    # the op limit; an empty op is "key not found"; each op is checked before duplicates;
    # a put's key before its lease
    inner = rpc_pb2.RequestOp(request_txn=rpc_pb2.TxnRequest(success=[rng(b"v3f/a")] * 50))
    refused(etcd.kv.Txn, rpc_pb2.TxnRequest(success=[rng(b"v3f/a")] * 100 + [inner]), invalid, "etcdserver: too many operations in txn request")
    refused(etcd.kv.Txn, rpc_pb2.TxnRequest(success=[rpc_pb2.RequestOp()]), invalid, "etcdserver: key not found")
    refused(etcd.kv.Txn, rpc_pb2.TxnRequest(success=[op_put(b"v3f/a", b"1"), op_put(b"v3f/a", b"1", ignore_value=True)]), invalid, "etcdserver: value is provided")
    refused(etcd.kv.Txn, rpc_pb2.TxnRequest(success=[op_put(b"v3f/absent", b"", ignore_value=True, lease=4242)]), invalid, "etcdserver: key not found")
    refused(etcd.kv.Put, rpc_pb2.PutRequest(key=b"v3f/absent", ignore_value=True, lease=4242), grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found")
    # Compacting at 0 before any compaction does nothing, and is no error
    etcd.kv.Compact(rpc_pb2.CompactionRequest(revision=0), timeout=10)
    after = get(etcd, b"v3f/", range_end=b"v3f0")
    assert [(kv.key, kv.value) for kv in after.kvs] == [(b"v3f/a", b"3"), (b"v3f/b", b"1")]  # nothing refused was written


def test_compact_through_the_log_refuses_reads_and_watches_below_it(etcd, cluster):
    now = put(etcd, b"v3c/k", b"v").header.revision
    etcd.kv.Compact(rpc_pb2.CompactionRequest(revision=2), timeout=10)
    for rev, text in ((2, "etcdserver: mvcc: required revision has been compacted"), (now + 10_000, "etcdserver: mvcc: required revision is a future revision")):
        with pytest.raises(grpc.RpcError) as e:
            etcd.kv.Compact(rpc_pb2.CompactionRequest(revision=rev), timeout=10)
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.OUT_OF_RANGE, text)
    leader = Stubs(cluster.grpc[cluster.leader_id])
    try:
        assert leader.maintenance.HashKV(rpc_pb2.HashKVRequest(), timeout=10).compact_revision == 2  # every member applied it
        call = leader.watch.Watch(iter([rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=b"v3c/k", start_revision=1))]), timeout=10)
        created, canceled = next(call), next(call)
        call.cancel()
        assert created.created and canceled.canceled and canceled.compact_revision == 2
    finally:
        leader.channel.close()

@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One node with a token and a short ledger (snapshots every 50 entries, 10 kept)."""
    c = ProcCluster(str(tmp_path_factory.mktemp("v3one")), 1, extra=["--snapshot-threshold", "50", "--snapshot-trailing", "10"], proxies=False)
    c.serve_etcd_api()
    c.token = "t-0123456789abcdef"
    c.node_env["n1"]["KV_TOKEN"] = c.token
    try:
        c.start()  # (its status needs the token: the first write waits for its leadership)
        yield c
    finally:
        c.close()


def test_tokens_through_etcds_authenticate_and_a_watch_older_than_the_log(single, tmp_path):
    env = {**os.environ, "ETCDCTL_API": "3"}
    s = Stubs(single.grpc["n1"])
    meta = [("token", single.token)]
    try:
        with pytest.raises(grpc.RpcError) as e:
            put(s, b"one/k", b"v")  # no token: etcd's answer, which its clients do not retry
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: user name is empty")
        with pytest.raises(grpc.RpcError) as e:
            s.kv.Put(rpc_pb2.PutRequest(key=b"one/k", value=b"v"), metadata=[("token", "not-" + single.token)], timeout=10)
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, "etcdserver: invalid auth token")
        auth = rpc_pb2_grpc.AuthStub(s.channel)
        assert auth.Authenticate(rpc_pb2.AuthenticateRequest(name="any", password=single.token), timeout=10).token == single.token
        with pytest.raises(grpc.RpcError) as e:
            auth.Authenticate(rpc_pb2.AuthenticateRequest(name="any", password="wrong"), timeout=10)
        assert e.value.details() == "etcdserver: authentication failed, invalid user ID or password"
        for i in range(120):
            s.kv.Put(rpc_pb2.PutRequest(key=b"one/%d" % i, value=b"v"), metadata=meta, timeout=10)
        with pytest.raises(grpc.RpcError) as e:
            s.kv.Put(rpc_pb2.PutRequest(key=b"one/big", value=b"x" * (1 << 20 | 1)), metadata=meta, timeout=10)
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: request is too large")  # --max-value-bytes
        # The ledger holds 10 entries behind its snapshot; the history holds every revision.
        first = get(s, b"one/0", metadata=meta).kvs[0].mod_revision
        req = rpc_pb2.WatchCreateRequest(key=b"one/", range_end=b"one0", start_revision=first, prev_kv=True)
        call = s.watch.Watch(iter([rpc_pb2.WatchRequest(create_request=req)]), metadata=meta, timeout=10)
        assert next(call).created
        events = []
        while len(events) < 120:
            events += next(call).events
        call.cancel()
        assert [ev.kv.key for ev in events] == [b"one/%d" % i for i in range(120)] and events[0].kv.mod_revision == first
        old = get(s, b"one/", range_end=b"one0", revision=first + 59, metadata=meta)
        assert old.count == 60 and old.header.revision >= first + 119  # as it was then, read now
        compact_at = first + 60
        s.kv.Compact(rpc_pb2.CompactionRequest(revision=compact_at), metadata=meta, timeout=10)
        with pytest.raises(grpc.RpcError) as e:
            get(s, b"one/", range_end=b"one0", revision=compact_at - 1, metadata=meta)
        assert e.value.details() == "etcdserver: mvcc: required revision has been compacted"
        assert get(s, b"one/", range_end=b"one0", revision=compact_at, metadata=meta).count == 61
        call = s.watch.Watch(iter([rpc_pb2.WatchRequest(create_request=req)]), metadata=meta, timeout=10)
        created, canceled = next(call), next(call)
        call.cancel()
        assert created.created and canceled.canceled and canceled.cancel_reason == "" and canceled.header.revision == 0  # (as etcd's)
        assert canceled.compact_revision == compact_at  # the oldest revision a watch can start from here
    finally:
        s.channel.close()
    if ETCDCTL is None:
        return
    ctl = [ETCDCTL, "--endpoints", single.grpc["n1"], "--user", f"root:{single.token}"]
    r = subprocess.run([*ctl, "get", "one/7"], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 0 and r.stdout.split() == ["one/7", "v"], r.stderr
    saved = tmp_path / "backup.db"
    r = subprocess.run([*ctl, "snapshot", "save", str(saved)], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "kv", "snapshot", "restore", str(saved), "--data-dir", str(tmp_path / "restored"), "--id", "local", "--peers", "local=127.0.0.1:1"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    import kv

    with kv.open(str(tmp_path / "restored")) as db:
        assert db.get("one/119").value == b"v"


def test_a_tokens_role_and_prefix_hold_on_the_etcd_api(tmp_path):
    """--tokens over gRPC: a prefix-limited writer reaches its prefix and nothing else
    (puts, ranges and deletes that leave it, a Txn whose compare looks outside it, leases,
    a watch beyond it), a read token writes nothing and holds no lease; each refusal is
    etcd's permission denied, and none of them changed anything. Write and admin tokens
    manage leases (they were answered INTERNAL: the Lease service's role was unknown)."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('"w-app" = { role = "write", prefix = "app/" }\n"w-all" = "write"\n"r-all" = "read"\n')
    c = ProcCluster(str(tmp_path / "c"), 1, extra=["--tokens", str(tokens)], proxies=False)
    c.serve_etcd_api()
    c.token = "a-admin-0123456789"
    c.node_env["n1"]["KV_TOKEN"] = c.token
    with c:
        c.start()
        s = Stubs(c.grpc["n1"])
        app, writer, reader, admin = [("token", "w-app")], [("token", "w-all")], [("token", "r-all")], [("token", c.token)]
        # etcdctl of the v2 API (it sends no token ledgerkv knows) is still told to use v3: the
        # answer needs no token and reveals nothing (it got the 401 body, printed as "0: ()")
        with pytest.raises(urllib.error.HTTPError) as v2:
            urllib.request.urlopen(f"http://{c.grpc['n1']}/v2/keys/app/a", timeout=10)
        assert v2.value.code == 404 and "use ETCDCTL_API=3" in json.loads(v2.value.read())["message"]
        denied = (grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied")

        def refused(call, *args, metadata):
            with pytest.raises(grpc.RpcError) as e:
                call(*args, metadata=metadata, timeout=10)
            assert (e.value.code(), e.value.details()) == denied

        try:
            s.kv.Put(rpc_pb2.PutRequest(key=b"app/a", value=b"1"), metadata=app, timeout=10)
            assert s.kv.Range(rpc_pb2.RangeRequest(key=b"app/", range_end=b"app0"), metadata=app, timeout=10).count == 1
            refused(s.kv.Put, rpc_pb2.PutRequest(key=b"other/a", value=b"1"), metadata=app)
            refused(s.kv.Range, rpc_pb2.RangeRequest(key=b"app/", range_end=b"\x00"), metadata=app)  # from app/ to the end
            refused(s.kv.DeleteRange, rpc_pb2.DeleteRangeRequest(key=b"app/", range_end=b"b"), metadata=app)
            outside = rpc_pb2.Compare(key=b"other/a", target=rpc_pb2.Compare.VERSION, result=rpc_pb2.Compare.EQUAL, version=0)
            refused(s.kv.Txn, rpc_pb2.TxnRequest(compare=[outside], success=[op_put(b"app/b", b"2")]), metadata=app)
            refused(s.lease.LeaseGrant, rpc_pb2.LeaseGrantRequest(TTL=60), metadata=app)
            refused(s.kv.Put, rpc_pb2.PutRequest(key=b"app/r", value=b"1"), metadata=reader)
            refused(s.lease.LeaseGrant, rpc_pb2.LeaseGrantRequest(TTL=60), metadata=reader)
            granted = [s.lease.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=60), metadata=m, timeout=10).ID for m in (writer, admin)]
            refused(s.lease.LeaseTimeToLive, rpc_pb2.LeaseTimeToLiveRequest(ID=granted[0]), metadata=reader)
            assert s.lease.LeaseTimeToLive(rpc_pb2.LeaseTimeToLiveRequest(ID=granted[0]), metadata=writer, timeout=10).TTL > 0
            renewed = s.lease.LeaseKeepAlive(iter([rpc_pb2.LeaseKeepAliveRequest(ID=granted[1])]), metadata=writer, timeout=10)
            assert next(renewed).TTL > 0
            renewed.cancel()
            # The scoped token's keys on a lease it cannot see; compacting every member's history
            refused(s.kv.Put, rpc_pb2.PutRequest(key=b"app/hijack", value=b"1", lease=granted[0]), metadata=app)
            refused(s.kv.Txn, rpc_pb2.TxnRequest(success=[op_put(b"app/hijack", b"1", lease=granted[0])]), metadata=app)
            for m in (app, writer):
                refused(s.kv.Compact, rpc_pb2.CompactionRequest(revision=1), metadata=m)
            # A hash of every key tells a scoped token when anything outside its prefix changes
            for m in (app, reader, writer):
                refused(s.maintenance.HashKV, rpc_pb2.HashKVRequest(), metadata=m)
                refused(s.maintenance.Hash, rpc_pb2.HashRequest(), metadata=m)
            assert s.maintenance.HashKV(rpc_pb2.HashKVRequest(), metadata=admin, timeout=10).hash != 0
            # MemberList needs no token, as etcd's (etcdctl --cluster asks it without one)
            assert [m.name for m in s.cluster.MemberList(rpc_pb2.MemberListRequest(), timeout=10).members] == ["n1"]
            # and so do Status and the list of alarms (etcdctl endpoint status, alarm list); raising one takes an admin
            assert s.maintenance.Status(rpc_pb2.StatusRequest(), timeout=10).raftIndex > 0
            assert list(s.maintenance.Alarm(rpc_pb2.AlarmRequest(), timeout=10).alarms) == []
            raise_one = rpc_pb2.AlarmRequest(action=rpc_pb2.AlarmRequest.ACTIVATE, alarm=rpc_pb2.NOSPACE)
            for m in (reader, writer):
                refused(s.maintenance.Alarm, raise_one, metadata=m)
            with pytest.raises(grpc.RpcError) as e:
                s.maintenance.Alarm(raise_one, timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            status, body = gw(c, "/v3/lease/grant", {"TTL": 60}, node="n1", token="w-all")  # the JSON gateway: the same checks
            assert status == 200 and int(body["ID"]) > 0, body
            granted.append(int(body["ID"]))
            assert gw(c, "/v3/lease/grant", {"TTL": 60}, node="n1", token="w-app") == (403, {"error": denied[1], "code": 7, "message": denied[1]})
            no_user = "etcdserver: user name is empty"  # etcd 3.4's answers, to no token and to a wrong one
            assert gw(c, "/v3/kv/put", {"key": b64(b"app/gw"), "value": b64(b"1")}, node="n1") == (400, {"error": no_user, "code": 3, "message": no_user})
            assert gw(c, "/v3/kv/put", {"key": b64(b"app/gw"), "value": b64(b"1")}, node="n1", token="nonsense")[0] == 401
            # The gRPC port answers the gateway over HTTP/1.1 too, with the same checks
            via_grpc_port = urllib.request.Request(f"http://{c.grpc['n1']}/v3/kv/range", data=json.dumps({"key": b64(b"app/a")}).encode(), method="POST")
            with pytest.raises(urllib.error.HTTPError) as refused_there:
                urllib.request.urlopen(via_grpc_port, timeout=10)
            assert refused_there.value.code == 400 and json.loads(refused_there.value.read())["error"] == no_user
            via_grpc_port.add_header("Authorization", "w-app")
            with urllib.request.urlopen(via_grpc_port, timeout=10) as r:
                assert json.loads(r.read())["count"] == "1"
            assert s.kv.Range(rpc_pb2.RangeRequest(key=b"app/a"), metadata=reader, timeout=10).count == 1
            call = s.watch.Watch(iter([rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=b"other/"))]), metadata=app, timeout=10)
            got = next(call)
            call.cancel()
            assert got.canceled and got.cancel_reason == "etcdserver: permission denied"
            everything = s.kv.Range(rpc_pb2.RangeRequest(key=b"\x00", range_end=b"\x00"), metadata=admin, timeout=10)
            assert [kv.key for kv in everything.kvs] == [b"app/a"]  # nothing refused was written
            assert sorted(x.ID for x in s.lease.LeaseLeases(rpc_pb2.LeaseLeasesRequest(), metadata=admin, timeout=10).leases) == sorted(granted)
        finally:
            s.channel.close()


def test_member_list_keeps_a_member_that_went_down_with_its_url(tmp_path):
    """etcd's members publish their client URLs: a member that is down is still listed with
    its URL, and `etcdctl endpoint health --cluster` reports it unhealthy (exit 1). Each node
    asks the others for theirs from the start, not when first asked for the list."""
    c = ProcCluster(str(tmp_path), 3)
    c.serve_etcd_api()
    try:
        c.start(*c.ids)
        leader = c.leader()
        down, asked = [i for i in c.ids if i != leader][:2]
        time.sleep(5)  # (the nodes learn each other's URLs within seconds of starting)
        c.kill(down)
        s = Stubs(c.grpc[asked])  # never asked for the list before
        try:
            members = s.cluster.MemberList(rpc_pb2.MemberListRequest(), timeout=10).members
        finally:
            s.channel.close()
        assert {m.name: list(m.clientURLs) for m in members} == {i: [f"http://{c.grpc[i]}"] for i in c.ids}
        if ETCDCTL is not None:
            r = subprocess.run([ETCDCTL, "--endpoints", c.grpc[asked], "endpoint", "health", "--cluster", "--command-timeout", "3s"],
                               env={**os.environ, "ETCDCTL_API": "3"}, capture_output=True, text=True, timeout=60)
            assert r.returncode == 1 and f"http://{c.grpc[down]} is unhealthy" in r.stdout + r.stderr, (r.stdout, r.stderr)
        if leader != asked:  # and with no quorum left, Status says why, as etcd's does
            c.kill(leader)
        else:
            c.kill(next(i for i in c.ids if i not in (down, asked)))
        s = Stubs(c.grpc[asked])
        try:
            status = wait_until(lambda: (lambda st: st if not st.leader else None)(s.maintenance.Status(rpc_pb2.StatusRequest(), timeout=10)), timeout=20)
        finally:
            s.channel.close()
        assert list(status.errors) == ["etcdserver: no leader"]
    finally:
        c.close()
