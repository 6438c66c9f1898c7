"""Crash points: a node dies (like kill -9) at each named point in the write, vote,
snapshot and install paths; after a restart the cluster converges and every acknowledged
write is there."""

from __future__ import annotations

import subprocess

import pytest
from cluster import ProcCluster

from kv.bench.harness import wait_until
from kv.raft.failpoints import EXIT_CODE

pytestmark = pytest.mark.slow
SNAP = ["--snapshot-threshold", "150", "--snapshot-trailing", "10"]


def write_some(c: ProcCluster, n: int, prefix: str, via: list[str] | None = None, value: bytes = b"v" * 40) -> dict:
    """Writes through live nodes; returns {key: index} of the acknowledged ones."""
    acked = {}
    for i in range(n):
        nodes = [x for x in (via or c.ids) if c.alive(x)]
        if not nodes:
            break
        try:
            code, body = c.put(nodes[i % len(nodes)], f"{prefix}{i}", value, timeout=3)
        except OSError:
            continue
        if code == 200:
            acked[f"{prefix}{i}"] = body["index"]
    return acked


def wait_exit(c: ProcCluster, nid: str, timeout: float = 20.0) -> int:
    try:
        return c.procs[nid].wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{nid} did not reach its failpoint") from None


def recover_and_check(c: ProcCluster, crashed: str, acked: dict) -> None:
    c.node_env[crashed] = {}
    c.start(crashed)
    c.leader()
    acked.update(write_some(c, 5, "after-"))
    c.wait_converged(timeout=30)
    for nid in c.ids:
        for k, idx in acked.items():
            code, _, etag = c.get(nid, k, consistency="stale")
            assert code == 200 and etag == f'"{idx}"', (nid, k, code, etag)


@pytest.fixture
def make(tmp_path):
    made = []

    def factory(extra=None):
        c = ProcCluster(str(tmp_path / f"c{len(made)}"), extra=extra)
        made.append(c)
        return c

    yield factory
    for c in made:
        c.close()


@pytest.mark.parametrize("point", ["ledger.before_commit@40", "ledger.after_commit@40"])
def test_leader_crashes_around_its_ledger_fsync(make, point):
    c = make()
    c.start()
    lead = c.leader()
    c.stop(lead)
    c.node_env[lead] = {"KV_FAILPOINTS": point}
    c.start(lead)
    # Make the armed node lead again, then write until it dies mid-stream.
    for _ in range(40):
        cur = c.leader()
        if cur == lead:
            break
        c.request(cur, "POST", "/v1/leader/transfer", b'{"to": "%s"}' % lead.encode())
    assert c.leader() == lead
    acked = write_some(c, 200, "k", via=[lead])
    assert wait_exit(c, lead) == EXIT_CODE
    acked.update(write_some(c, 20, "more-"))
    recover_and_check(c, lead, acked)


@pytest.mark.parametrize("point", ["hardstate.before_save", "hardstate.after_save"])
def test_follower_crashes_around_saving_term_and_vote(make, point):
    c = make()
    c.start()
    lead = c.leader()
    acked = write_some(c, 30, "k")
    victim = next(i for i in c.ids if i != lead)
    c.stop(victim)
    c.node_env[victim] = {"KV_FAILPOINTS": point}
    c.start(victim)  # starts as a follower of term T: saves nothing yet
    c.wait_converged()
    c.kill(lead)  # the election makes the victim save a new term and vote
    assert wait_exit(c, victim) == EXIT_CODE
    c.start(lead)
    recover_and_check(c, victim, acked)


@pytest.mark.parametrize("point", ["snapshot.mid_write@2", "snapshot.after_rename"])
def test_crash_while_taking_a_snapshot(make, point):
    c = make(extra=SNAP + ["--snapshot-keep", "2"])
    c.node_env["n1"] = {"KV_FAILPOINTS": point}
    c.start()
    acked = write_some(c, 400, "k", value=b"s" * 8000)  # blocks of 1 MiB: several per snapshot
    assert wait_exit(c, "n1") == EXIT_CODE
    recover_and_check(c, "n1", acked)
    assert not any(n.startswith("tmp-") for n in __import__("os").listdir(c.data_dir("n1") + "/snapshots"))


@pytest.mark.parametrize("point", ["install.mid_receive@2", "install.after_adopt", "install.after_reset"])
def test_crash_while_installing_a_snapshot(make, point):
    c = make(extra=SNAP)
    c.start()
    lead = c.leader()
    lag = next(i for i in c.ids if i != lead)
    c.kill(lag)
    acked = write_some(c, 300, "k", via=[i for i in c.ids if i != lag], value=b"i" * 8000)  # a multi-chunk snapshot
    assert c.status(lead)["ledger_begin_index"] > 0
    c.node_env[lag] = {"KV_FAILPOINTS": point}
    c.start(lag, wait=False)
    assert wait_exit(c, lag, timeout=30) == EXIT_CODE
    recover_and_check(c, lag, acked)
    if point.startswith("install.mid_receive"):
        assert "resuming snapshot" in c.log(lag)  # the partial file was kept and continued


def test_a_partial_snapshot_that_lost_its_tail_in_a_machine_crash_is_sent_again_from_what_it_holds(make):
    """The follower crashes mid-receive, and the machine with it: the partial file's tail,
    flushed but not synced, is gone, below what it had acknowledged. It resumes from what it
    holds, and the leader's next transfer (started when the follower answers again) fills it
    from there. (A review worried that the leader's earlier transfer, which only moves its
    mark forward, would resend from the old mark forever; here a new one takes over.)"""
    import glob
    import os

    from kv.snapshot.manager import CHUNK_BYTES

    c = make(extra=SNAP)
    c.start()
    lead = c.leader()
    lag = next(i for i in c.ids if i != lead)
    c.kill(lag)
    acked = write_some(c, 300, "k", via=[i for i in c.ids if i != lag], value=b"i" * 8000)
    c.node_env[lag] = {"KV_FAILPOINTS": "install.mid_receive@2"}
    c.start(lag, wait=False)
    assert wait_exit(c, lag, timeout=30) == EXIT_CODE
    (part,) = glob.glob(os.path.join(c.data_dir(lag), "snapshots", "recv-*.part"))
    assert os.path.getsize(part) == 2 * CHUNK_BYTES
    os.truncate(part, CHUNK_BYTES // 2)  # (what the page cache held and the disk did not)
    c.node_env[lag] = {}
    recover_and_check(c, lag, acked)
    assert f"at byte {CHUNK_BYTES // 2}" in c.log(lag)


def test_a_follower_installs_a_snapshot_while_it_writes_one_of_its_own(make):
    """A follower that falls behind while writing a snapshot of its own (a worker thread
    reading its database) is sent the leader's and loads it: the load waits for that
    snapshot, and no read of the database runs while it is replaced. The database was
    closed under the writing thread: the node died of SIGSEGV (a fault review: 2-7 times
    in 25 pauses of a follower), or its snapshot failed on a closed database."""
    c = make(extra=SNAP)
    c.start()
    lead = c.leader()
    lag = next(i for i in c.ids if i != lead)
    acked = write_some(c, 140, "a", via=[lead], value=b"a" * 8000)  # two blocks of snapshot
    # It holds them all before it stops: one that lagged would be sent the leader's snapshot
    # when it starts again (the leader takes one at 150 and compacts), and then take none of
    # its own at its threshold (a CI run under load).
    c.wait_converged(timeout=30)
    c.kill(lag)
    c.node_env[lag] = {"KV_FAILPOINTS": "snapshot.mid_write~5"}  # its snapshots hold their view 5 s a block
    c.start(lag)
    acked.update(write_some(c, 20, "b", via=[lead]))  # past its threshold: it starts one
    wait_until(lambda: c.status(lag)["applied_index"] >= 150, 10, "the follower past its snapshot threshold")
    c.isolate(lag)
    acked.update(write_some(c, 320, "c", via=[i for i in c.ids if i != lag], value=b"c" * 2000))
    assert c.status(lead)["ledger_begin_index"] > c.status(lag)["applied_index"]
    assert "loading snapshot" not in c.log(lag)  # (the install below is its first)
    c.heal()
    wait_until(lambda: "loading snapshot" in c.log(lag), 20, "the follower loading the leader's snapshot")
    c.wait_converged(timeout=40)
    assert c.alive(lag), c.log(lag)[-2000:]
    log = c.log(lag)
    assert "never retrieved" not in log and "Traceback" not in log, log[-3000:]
    wait_until(lambda: "snapshot at" in c.log(lag), 20, "the follower's own snapshot written")
    for k, idx in acked.items():
        code, _, etag = c.get(lag, k, consistency="stale")
        assert code == 200 and etag == f'"{idx}"', (k, code, etag)
