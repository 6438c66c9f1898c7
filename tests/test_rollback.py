"""A data dir put back from an older copy, on real processes: what a majority's disks lost
no store can keep, and Raft's assumption (a node keeps what it acknowledged) is broken.
What is asked is that the node still holding the lost writes stops rather than serve them
or take the new history over them (etcd panics alike), and says why."""

from __future__ import annotations

import os
import shutil

import pytest
from cluster import ProcCluster

from kv.bench.harness import wait_until

pytestmark = pytest.mark.slow


def test_the_node_holding_writes_a_rolled_back_majority_lost_stops_at_the_first_push(tmp_path):
    """n-A's data dir is copied; writes are acknowledged by the leader and n-A while n-B is
    down; n-A's old copy is put back and the leader stopped; n-A and n-B, a majority, elect
    a leader without those writes. The old leader, started again, committed them in an
    earlier term beyond where the new leader's log ends, and its own log was compacted past
    that end, so no compare reaches them (a fault review: it answered linearizable reads
    with the lost values). It stops on the new leader's first push, naming the index."""
    c = ProcCluster(str(tmp_path), proxies=False, extra=["--snapshot-threshold", "100", "--snapshot-trailing", "10"])
    try:
        c.start()
        old = c.leader()
        a, b = [i for i in c.ids if i != old]
        assert c.put(old, "before", b"1")[0] == 200
        c.stop(a)
        shutil.copytree(c.data_dir(a), c.data_dir(a) + ".copy")
        c.start(a)
        c.stop(b)
        for i in range(300):
            assert c.put(old, f"lost/{i}", b"x")[0] == 200
        wait_until(lambda: c.status(old)["ledger_begin_index"] > 20, timeout=30, what="the leader compacted its log")
        # (restarted, its commit index is what it applied)
        wait_until(lambda: (s := c.status(old))["applied_index"] == s["commit_index"], timeout=10, what="the leader applied all")
        committed = c.status(old)["applied_index"]
        c.stop(a, old)
        shutil.rmtree(c.data_dir(a))
        os.rename(c.data_dir(a) + ".copy", c.data_dir(a))
        c.start(a, b)
        new = c.leader(among=[a, b])
        for i in range(5):
            assert c.put(new, f"after/{i}", b"y")[0] == 200
        assert c.status(new)["ledger_end_index"] < c.status(a)["ledger_end_index"] + 10 < committed
        c.start(old, wait=False)
        wait_until(lambda: not c.alive(old), timeout=20, what=f"{old} stopping")
        assert c.procs[old].returncode == 1
        said = f"leader {new} (term "
        log = c.log(old)
        assert said in log and f"holds no entry at index {committed}, which this node committed" in log, log[-3000:]
        assert c.get(new, "lost/0")[0] == 404  # (lost with the majority's disks: no store could keep it)
    finally:
        c.close()
