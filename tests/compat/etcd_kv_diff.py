"""Seeded sequences of etcd KV calls against etcd 3.4 and ledgerkv side by side, every
answer compared field by field (a differential fuzzer).

    .venv/bin/python tests/compat/etcd_kv_diff.py --seeds 0:200 --ops 30   # needs Debian's etcd-server

Both run as 3-member clusters on loopback; every call goes to a follower. A sequence draws
Range (limits, sorts, revisions, filters, keys_only, count_only, serializable), Put
(prev_kv, ignore_value, ignore_lease, a lease that exists or not), DeleteRange, Txn
(compares on every target and result, ranges, nested transactions, duplicate keys, empty
ops) and Compact over a dozen keys (byte keys included) and every kind of range end.
Answers are compared with revisions mapped: each write's header revision in etcd to the
one in ledgerkv (whose revisions are log indexes, docs/etcd.md). Sequences of one run share
the clusters: each starts by deleting every key.

Left out, as documented differences (docs/etcd.md): keys starting with a NUL byte; a Txn
deleting from a key to the end with a put in that range; a limited sort by another target
than the key without an order (etcd's quirk); a Range at a revision inside a Txn (one that
writes is refused; one of reads is tests/test_v3api.py's); inner response headers; compacting
at 0 or ahead of the store (a second compaction at 0 is an error in etcd alone, and a
future revision maps onto log indexes only approximately).

Prints each difference with its sequence up to it; exit status 1 if there is one.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import grpc  # noqa: E402
from python_etcd3 import EtcdCluster, LedgerkvCluster  # noqa: E402

from kv.bench.harness import free_port  # noqa: E402
from kv.v3api.proto import rpc_pb2, rpc_pb2_grpc  # noqa: E402

KEYS = [b"a", b"a/b", b"a/c", b"b", b"", b"a\x00", b"\xff", b"a\xff", "\U0001F600".encode(), b"\xee\x80\x80", b"c"]
KEY_WEIGHTS = [6, 4, 4, 5, 1, 2, 2, 2, 1, 1, 2]
VALUES = [b"", b"1", b"2", b"10", b"x\x00", b"\xff"]
LEASE, MISSING_LEASE = 7777, 4242
TIMEOUT = 10


def prefix_end(k: bytes) -> bytes:
    s = k.rstrip(b"\xff")
    return s[:-1] + bytes([s[-1] + 1]) if s else b"\x00"


class Gen:
    """One sequence's ops, as plain dicts (revisions in etcd's numbering)."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)
        self.writes = 1  # about etcd's revision (any value makes a valid call)

    def key(self) -> bytes:
        return self.r.choices(KEYS, KEY_WEIGHTS)[0]

    def range_of(self) -> tuple[bytes, bytes]:
        r, k = self.r, self.key()
        c = r.random()
        end = b"" if c < 0.35 else b"\x00" if c < 0.5 else (prefix_end(k) if k else b"\x00") if c < 0.7 else self.key() if c < 0.9 \
            else r.choice([b"\x00\x00", k, k + b"\x00", b"\xff\xff"])
        if r.random() < 0.05:
            k, end = b"\x00", b"\x00"
        return k, end

    def rev(self) -> int:
        c = self.r.random()
        return self.r.randint(1, self.writes) if c < 0.6 else 0 if c < 0.8 else self.writes + self.r.randint(1, 3)

    def range_op(self, in_txn: bool = False) -> dict:
        r = self.r
        k, end = self.range_of()
        d = {"op": "range", "key": k, "range_end": end}
        if r.random() < 0.4:
            d["limit"] = r.choice([1, 2, 3, 5, -1])
        if r.random() < 0.25 and not in_txn:
            d["revision"] = self.rev()
        if r.random() < 0.4:
            d["sort_order"], d["sort_target"] = r.choice([0, 1, 2]), r.choice([0, 1, 2, 3, 4])
            if d.get("limit", 0) > 0 and d["sort_order"] == 0 and d["sort_target"] != 0:
                d["sort_order"] = 1  # (etcd's quirk: it sorts only the first limit + 1 keys)
        for f in ("serializable", "keys_only", "count_only"):
            if r.random() < 0.15:
                d[f] = True
        for f in ("min_mod_revision", "max_mod_revision", "min_create_revision", "max_create_revision"):
            if r.random() < 0.08:
                d[f] = self.rev()
        return d

    def put_op(self) -> dict:
        r = self.r
        d = {"op": "put", "key": self.key(), "value": r.choice(VALUES)}
        if r.random() < 0.3:
            d["prev_kv"] = True
        if r.random() < 0.15:
            d["ignore_value"] = True
            if r.random() < 0.8:
                d["value"] = b""
        if r.random() < 0.15:
            d["ignore_lease"] = True
        if r.random() < 0.25:
            d["lease"] = r.choice([0, LEASE, LEASE, MISSING_LEASE])
            if d.get("ignore_lease") and d["lease"] and r.random() < 0.8:
                d["lease"] = 0
        self.writes += 1
        return d

    def delete_op(self, in_txn: bool = False) -> dict:
        k, end = self.range_of()
        if in_txn and end == b"\x00":
            end = b"\xff\xff"  # (a delete to the end with a put in it: etcd takes the range as empty)
        self.writes += 1
        return {"op": "delete", "key": k, "range_end": end, "prev_kv": self.r.random() < 0.4}

    def compare(self) -> dict:
        r, k = self.r, self.key()
        d = {"key": k, "target": r.choice(range(5)), "result": r.choice(range(4))}
        if r.random() < 0.2:
            d["range_end"] = r.choice([b"\x00", prefix_end(k) if k else b"\x00", self.key()])
        if r.random() < 0.05:
            return d  # no value to compare with
        field = r.choice(range(5)) if r.random() < 0.05 else d["target"]  # sometimes another target's field
        d[("version", "create_revision", "mod_revision", "value", "lease")[field]] = (
            r.randint(0, 3) if field == 0 else r.choice(VALUES) if field == 3 else r.choice([0, LEASE, MISSING_LEASE]) if field == 4 else self.rev()
        )
        return d

    def txn_op(self, depth: int = 0) -> dict:
        r = self.r
        d = {"op": "txn", "compare": [self.compare() for _ in range(r.choice([0, 1, 1, 2, 3]))]}
        for branch in ("success", "failure"):
            ops = []
            for _ in range(r.choice([0, 1, 2, 2, 3, 4])):
                c = r.random()
                ops.append(self.range_op(True) if c < 0.35 else self.put_op() if c < 0.65 else self.delete_op(True) if c < 0.85
                           else self.txn_op(depth + 1) if c < 0.95 and depth < 2 else {"op": "empty"})
            d[branch] = ops
        if depth == 0:
            self.writes += 1
        return d

    def op(self) -> dict:
        c = self.r.random()
        if c < 0.3:
            return self.range_op()
        if c < 0.55:
            return self.put_op()
        if c < 0.65:
            return self.delete_op()
        if c < 0.95:
            return self.txn_op()
        return {"op": "compact", "revision": self.r.randint(1, max(1, self.writes - 2))}


class RevMap:
    """etcd's revisions -> ledgerkv's, learned from the header revisions of the same writes."""

    def __init__(self) -> None:
        self.m: dict[int, int] = {}
        self.etcd_now = self.lkv_now = 0

    def observe(self, e: int, lkv: int) -> None:
        if e > self.etcd_now:
            self.m[e], self.etcd_now = lkv, e
        self.lkv_now = max(self.lkv_now, lkv)

    def to_lkv(self, v: int) -> int:
        if v <= 0:
            return v
        if v in self.m:
            return self.m[v]
        if v > self.etcd_now:
            return self.lkv_now + (v - self.etcd_now)
        lower = [e for e in self.m if e < v]
        return self.m[max(lower)] if lower else v

    def to_etcd(self, lkv: int) -> int | str:
        return next((e for e, x in self.m.items() if x == lkv), f"ledgerkv {lkv}")


def _range(d: dict, rev) -> rpc_pb2.RangeRequest:
    req = rpc_pb2.RangeRequest(key=d["key"], range_end=d["range_end"])
    for k in ("limit", "sort_order", "sort_target", "serializable", "keys_only", "count_only"):
        if k in d:
            setattr(req, k, d[k])
    for k in ("revision", "min_mod_revision", "max_mod_revision", "min_create_revision", "max_create_revision"):
        if k in d:
            setattr(req, k, rev(d[k]))
    return req


def _put(d: dict) -> rpc_pb2.PutRequest:
    return rpc_pb2.PutRequest(**{k: v for k, v in d.items() if k != "op"})


def _delete(d: dict) -> rpc_pb2.DeleteRangeRequest:
    return rpc_pb2.DeleteRangeRequest(key=d["key"], range_end=d["range_end"], prev_kv=d["prev_kv"])


def _txn(d: dict, rev) -> rpc_pb2.TxnRequest:
    def compare(c: dict) -> rpc_pb2.Compare:
        return rpc_pb2.Compare(**{k: rev(v) if k in ("create_revision", "mod_revision") else v for k, v in c.items()})

    def op(x: dict) -> rpc_pb2.RequestOp:
        kind = x["op"]
        if kind == "range":
            return rpc_pb2.RequestOp(request_range=_range(x, rev))
        if kind == "put":
            return rpc_pb2.RequestOp(request_put=_put(x))
        if kind == "delete":
            return rpc_pb2.RequestOp(request_delete_range=_delete(x))
        if kind == "txn":
            return rpc_pb2.RequestOp(request_txn=_txn(x, rev))
        return rpc_pb2.RequestOp()

    return rpc_pb2.TxnRequest(compare=[compare(c) for c in d["compare"]], success=[op(x) for x in d["success"]], failure=[op(x) for x in d["failure"]])


def call(kv, d: dict, rev):
    """("ok", response) or ("error", (code, details))."""
    try:
        kind = d["op"]
        if kind == "range":
            return "ok", kv.Range(_range(d, rev), timeout=TIMEOUT)
        if kind == "put":
            return "ok", kv.Put(_put(d), timeout=TIMEOUT)
        if kind == "delete":
            return "ok", kv.DeleteRange(_delete(d), timeout=TIMEOUT)
        if kind == "txn":
            return "ok", kv.Txn(_txn(d, rev), timeout=TIMEOUT)
        return "ok", kv.Compact(rpc_pb2.CompactionRequest(revision=rev(d["revision"])), timeout=TIMEOUT)
    except grpc.RpcError as e:
        return "error", (e.code().name, e.details())


def normal(kind: str, resp, rev) -> dict:
    """What of an answer is compared (revisions through `rev`; headers left out)."""
    def kv(x):
        return (x.key, x.value, x.version, rev(x.create_revision) if x.create_revision else 0, rev(x.mod_revision) if x.mod_revision else 0, x.lease)

    if kind == "range":
        return {"kvs": [kv(x) for x in resp.kvs], "count": resp.count, "more": resp.more}
    if kind == "put":
        return {"prev_kv": kv(resp.prev_kv) if resp.HasField("prev_kv") else None}
    if kind == "delete":
        return {"deleted": resp.deleted, "prev_kvs": [kv(x) for x in resp.prev_kvs]}
    if kind == "txn":
        names = {"response_range": "range", "response_put": "put", "response_delete_range": "delete", "response_txn": "txn"}
        return {"succeeded": resp.succeeded, "responses": [normal(names[r.WhichOneof("response")], getattr(r, r.WhichOneof("response")), rev) for r in resp.responses]}
    return {}


def run_sequence(etcd, lkv, ops: list[dict], revs: RevMap) -> tuple[int, object, object] | None:
    """Run ops on both from an empty keyspace; the first difference (op number, etcd's
    answer, ledgerkv's), or None. `revs`: the run's map of revisions (a sequence reads at
    revisions of the ones before it too)."""
    for kv in (etcd, lkv):
        kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=b"\x00", range_end=b"\x00"), timeout=TIMEOUT)
    revs.observe(*(kv.Range(rpc_pb2.RangeRequest(key=b"probe"), timeout=TIMEOUT).header.revision for kv in (etcd, lkv)))
    for i, d in enumerate(ops):
        kind = d["op"]
        got_e, e = call(etcd, d, lambda v: v)
        got_l, lk = call(lkv, d, revs.to_lkv)
        if kind in ("put", "delete", "txn"):
            if got_e == "ok" and got_l == "ok":
                revs.observe(e.header.revision, lk.header.revision)
            else:  # (a write one refused may still have taken a log entry in ledgerkv)
                revs.lkv_now = max(revs.lkv_now, lkv.Range(rpc_pb2.RangeRequest(key=b"probe", serializable=True), timeout=TIMEOUT).header.revision)
                if got_e == "ok":
                    revs.observe(e.header.revision, revs.lkv_now)
        a = normal(kind, e, lambda v: v) if got_e == "ok" else e
        b = normal(kind, lk, revs.to_etcd) if got_l == "ok" else lk
        if (got_e, a) != (got_l, b):
            return i, (got_e, a), (got_l, b)
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0:100", help="FIRST:END (default 0:100)")
    ap.add_argument("--ops", type=int, default=25, help="calls per sequence (default 25)")
    args = ap.parse_args()
    first, end = map(int, args.seeds.split(":"))
    root = tempfile.mkdtemp(prefix="kv-etcd-diff-")
    clusters = [EtcdCluster(os.path.join(root, "etcd"), free_port()), LedgerkvCluster(os.path.join(root, "ledgerkv"), free_port())]
    channels = []
    try:
        stubs = []
        for c in clusters:
            c.start()
            channels.append(grpc.insecure_channel(c.client["pifpaf0"]))
            stubs.append(rpc_pb2_grpc.KVStub(channels[-1]))
            rpc_pb2_grpc.LeaseStub(channels[-1]).LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=3600, ID=LEASE), timeout=TIMEOUT)
        differ, revs = 0, RevMap()
        for seed in range(first, end):
            gen = Gen(seed)
            ops = [gen.op() for _ in range(args.ops)]
            found = run_sequence(*stubs, ops, revs)
            if found is not None:
                differ += 1
                i, a, b = found
                print(f"seed {seed}, call {i}: {ops[i]!r}\n  etcd:     {a!r}\n  ledgerkv: {b!r}\n  the sequence: {ops[: i + 1]!r}\n", flush=True)
        print(f"{end - first} sequences of {args.ops} calls: {differ} differ")
        return 1 if differ else 0
    finally:
        for ch in channels:
            ch.close()
        for c in clusters:
            c.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
