"""kv.Node clusters in-process: the store API on every member, under partitions and restarts."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
from inproc import InprocCluster

import kv
from kv import Cond, Get, Put
from kv.bench.harness import poll
from kv.raft.loopback import LoopbackNetwork


@pytest.fixture
def cluster(inproc_cluster):
    return inproc_cluster


async def test_any_member_writes_and_reads_linearizably(cluster):
    lead = await cluster.leader()
    f1, f2 = await cluster.followers()
    w = await f1.put("a", b"from-follower")
    assert w.term == lead.raft.core.term
    # A write acknowledged by the leader is visible to a linearizable read on any follower.
    w2 = await lead.put("b", b"from-leader")
    for n in (f1, f2, lead):
        assert (await n.get("b")).value == b"from-leader"
        assert (await n.get("a")).mod_index == w.index
    assert (await f2.get("b", consistency="stale")) is None or (await f2.get("b", consistency="stale")).mod_index == w2.index
    assert [i.key for i in await f2.scan("")] == ["a", "b"]


async def test_a_followers_reads_behind_a_lost_read_index_request_are_asked_again(cluster):
    """Found by review: when a follower's batched ReadIndex request is lost, its reads (and
    those waiting behind it) are asked of the leader again after an election timeout,
    rather than failing at their deadline."""
    from kv.raft.messages import ReadIndexRequest

    lead = await cluster.leader()
    w = await lead.put("k", b"v")
    f = (await cluster.followers())[0]
    await f.wait_applied(w.index, timeout=5)
    transport, dropped = f.raft.transport, []
    send = transport.send

    def lose_the_first(m):
        if isinstance(m, ReadIndexRequest) and not dropped:
            dropped.append(m)
            return True
        return send(m)

    transport.send = lose_the_first
    try:
        loop = asyncio.get_running_loop()

        async def read(after: float) -> float:
            await asyncio.sleep(after)
            t0 = loop.time()
            assert (await f.get("k", timeout=5)).value == b"v"
            return loop.time() - t0

        took = await asyncio.gather(*(read(a) for a in (0, 0, 0.01, 0.05)))
    finally:
        transport.send = send
    assert dropped and max(took) < 4  # answered after about an election timeout, not at the 5 s deadline


async def test_waiting_for_a_leader_and_for_an_applied_index(cluster):
    lead = await cluster.leader()
    f = (await cluster.followers())[0]
    assert await f.wait_leader(timeout=5) == await lead.wait_leader(timeout=5) == lead.config.id
    w = await lead.put("w", b"1")
    await f.wait_applied(w.index, timeout=5)
    assert (await f.get("w", consistency="stale")).value == b"1"
    with pytest.raises(kv.Timeout, match="did not apply"):
        await f.wait_applied(w.index + 1000, timeout=0.2)
    cluster.net.isolate(f.config.id)
    await cluster.stop(*[n for n in cluster.ids if n != f.config.id])
    await asyncio.wait_for(f.raft.leader_changed.wait(), 5)  # it forgets the leader and campaigns
    with pytest.raises(kv.Timeout, match="knew no leader"):  # alone, it never learns one
        await f.wait_leader(timeout=3)


async def test_waiting_on_a_stopped_raft_node_fails_at_once_instead_of_for_ever(tmp_path):
    """A waiter that arrives while the node stops (after its deadlines were closed, before
    or after its waiters were failed) is refused, not left waiting with no deadline."""
    from kv.raft.node import NodeStopped

    node = kv.Node(id="n1", data_dir=str(tmp_path / "n1"))
    await node.start()
    w = await node.put("k", b"v")
    raft = node.raft
    await node.stop()
    with pytest.raises(NodeStopped):
        await asyncio.wait_for(raft.wait_applied(w.index + 1), 5)


async def test_a_write_forwarded_to_a_leader_that_is_cut_off_goes_to_the_next_one_and_applies_once(tmp_path):
    """The leader gets a follower's write but can no longer reach anyone: when a new leader
    is elected the follower sends the same request (same session, same seq) to it, long
    before the write's deadline, and the write is applied once: the old leader's copy,
    which it could not replicate, is dropped when it rejoins."""
    c = InprocCluster(str(tmp_path), write_timeout_s=60.0)
    await c.start()
    try:
        lead = await c.leader()
        f1, f2 = await c.followers()
        for f in (f1, f2):
            c.net.cut(lead.config.id, f.config.id)  # it hears them; they no longer hear it
        before = f1.counters["writes_resent"]
        w = await asyncio.wait_for(f1.put("once", b"v"), 30)  # far below its 60 s deadline
        assert f1.counters["writes_resent"] > before
        new = await c.leader(exclude=(lead.config.id,))
        assert w.term >= new.raft.term - 1 and (await new.get("once")).mod_index == w.index
        c.net.heal()
        await poll(lambda: lead.raft.leader_id == new.config.id, timeout=10)
        await c.wait_applied(w.index, timeout=10)
        for n in (lead, f1, f2):
            assert (await n.get("once")).mod_index == w.index
            page = await n.scan_page("once")
            history = [e async for e in _events(n.watch("once", start_index=1), page.index)]
            assert [e.index for e in history] == [w.index], n.config.id
    finally:
        await c.stop()


async def _events(w, upto: int):
    """The events of a watch up to index `upto`, then close it."""
    try:
        async for e in w:
            if e.index > upto:
                break
            yield e
            if e.index == upto:
                break
    finally:
        w.close()


async def test_writes_commit_and_replicate_over_a_lossy_slow_network(tmp_path):
    c = InprocCluster(str(tmp_path), net=LoopbackNetwork(drop_rate=0.1, delay=0.005, seed=3))
    await c.start()
    try:
        lead = await c.leader(timeout=30)
        # Through the leader: a forwarded write is not re-sent when its message is lost.
        writes = [await lead.put(f"k{i}", b"v", timeout=30) for i in range(12)]
        await c.wait_applied(max(w.index for w in writes), timeout=30)
        assert [k for k, *_ in c.data("n1")] == sorted(f"k{i}" for i in range(12))
        assert c.data("n1") == c.data("n2") == c.data("n3")
        assert lead.raft.metrics().transport.frames_sent > 0
    finally:
        await c.stop()


async def test_concurrent_cas_never_loses_an_update(cluster):
    nodes = list(cluster.nodes.values())
    await nodes[0].put("counter", b"0")
    wins = 0

    async def bump(node):
        nonlocal wins
        for _ in range(30):
            cur = await node.get("counter")
            try:
                await node.cas("counter", cur.mod_index, str(int(cur.value) + 1).encode())
                wins += 1
            except kv.PreconditionFailed:
                pass

    await asyncio.gather(*(bump(n) for n in nodes for _ in range(3)))
    final = await nodes[1].get("counter")
    assert int(final.value) == wins and wins > 0


async def test_txn_preconditions_hold_under_concurrency(cluster):
    """Each txn moves one unit between two accounts only if the source has it: the total
    stays constant and no account goes negative."""
    nodes = list(cluster.nodes.values())
    await nodes[0].txn(ops=[Put("acct/a", b"50"), Put("acct/b", b"50")])

    async def move(node, src, dst):
        for _ in range(15):
            r = await node.txn(ops=[Get(src), Get(dst)])
            s, d = r.results
            if int(s.value) == 0:
                continue
            await node.txn(
                [Cond(src, "mod", s.mod_index), Cond(dst, "mod", d.mod_index)],
                [Put(src, str(int(s.value) - 1).encode()), Put(dst, str(int(d.value) + 1).encode())],
            )

    await asyncio.gather(*(move(n, "acct/a", "acct/b") for n in nodes), *(move(n, "acct/b", "acct/a") for n in nodes))
    items = {i.key: int(i.value) for i in await nodes[2].scan("acct/")}
    assert sum(items.values()) == 100 and min(items.values()) >= 0


async def test_watch_delivers_every_change_once_in_commit_order(cluster):
    lead = await cluster.leader()
    f = (await cluster.followers())[0]
    w = f.watch("w/")
    writes = [lead.put(f"w/{i % 5}", str(i).encode()) for i in range(40)] + [lead.put("other", b"x")]
    results = await asyncio.gather(*writes)
    await lead.delete("w/0")
    seen = []
    async for ev in w:
        seen.append(ev)
        if ev.type == "delete":
            break
    w.close()
    assert [e.index for e in seen] == sorted(r.index for r in results[:40]) + [seen[-1].index]
    assert all(e.key.startswith("w/") for e in seen) and len({e.index for e in seen}) == len(seen)
    # From an index: the kept history replays what came after it.
    w2 = f.watch("w/", start_index=seen[10].index)
    first = await asyncio.wait_for(w2.__anext__(), 5)
    assert first == seen[10]
    w2.close()


async def test_leadership_transfer(cluster):
    lead = await cluster.leader()
    target = (await cluster.followers())[0]
    assert await lead.transfer_leadership(target.config.id) == target.config.id
    new = await cluster.leader()
    assert new is target
    await lead.put("after", b"transfer")  # the old leader forwards now
    assert (await target.get("after")).value == b"transfer"


async def test_reads_asked_together_share_one_ask_and_a_cancelled_one_takes_no_other_with_it(cluster):
    """Reads asked in one turn of the loop go to the core as one (kv.raft.node.ReadBatch):
    each still gets its answer, a reader cancelled while it waits leaves the others
    waiting, and once every reader has stopped nothing of them is held."""
    lead = await cluster.leader()
    f = (await cluster.followers())[0]
    w = await lead.put("k", b"v")
    for node in (lead, f):
        asked = node.raft.core.read_index
        asks = []
        node.raft.core.read_index = lambda ctx, now, lease=False, _asked=asked: (asks.append(ctx), _asked(ctx, now, lease))
        try:
            reads = [asyncio.ensure_future(node.get("k", timeout=5)) for _ in range(20)]
            await asyncio.sleep(0)  # every read is waiting for the same ask now
            reads[3].cancel()
            got = await asyncio.gather(*reads, return_exceptions=True)
        finally:
            node.raft.core.read_index = asked
        assert isinstance(got[3], asyncio.CancelledError)
        assert [g.value for i, g in enumerate(got) if i != 3] == [b"v"] * 19 and all(g.mod_index == w.index for i, g in enumerate(got) if i != 3)
        assert len(asks) == 1, asks
        assert not node.raft._read_futs and not node.raft._read_batches
        assert (await node.get("k", timeout=float("inf"))).value == b"v"  # (a deadline that is never due)
    # Every reader of an ask cancelled before its answer: the ask is let go of at once.
    f1, f2 = await cluster.followers()
    await cluster.stop(f1.config.id, f2.config.id)  # the leader's round can never be confirmed
    reads = [asyncio.ensure_future(lead.get("k", timeout=5)) for _ in range(3)]
    await asyncio.sleep(0.05)
    assert len(lead.raft._read_futs) == 1
    for r in reads:
        r.cancel()
    await asyncio.gather(*reads, return_exceptions=True)
    assert not lead.raft._read_futs


async def test_a_transfer_to_a_member_that_is_down_says_how_far_behind_it_is(cluster):
    """`kv leader transfer` to a member that is down said only that leadership did not move
    in time (a newcomer's run): it now says how far behind the member is, and to check that
    it runs and is reachable."""
    lead = await cluster.leader()
    down = (await cluster.followers())[0].config.id
    await cluster.stop(down)
    for i in range(5):
        await lead.put(f"k{i}", b"x")
    with pytest.raises(kv.Timeout, match=rf"did not move to {down} in time.*{down} has the log up to \d+ of \d+ \(is it running"):
        await lead.transfer_leadership(down, timeout=1)


async def test_no_quorum_means_errors_not_answers(cluster):
    lead = await cluster.leader()
    await lead.put("k", b"v")
    f1, f2 = await cluster.followers()
    await cluster.stop(f1.config.id, f2.config.id)
    end = lead.raft.metrics().ledger_end_index
    # The leader appended it (and would commit it once a follower is back): unknown.
    with pytest.raises(kv.Timeout, match="may or may not"):
        await lead.put("k", b"lost?", timeout=1.5)
    assert lead.raft.metrics().ledger_end_index == end + 1
    with pytest.raises(kv.NoQuorum):
        await lead.get("k", timeout=1.5)
    assert (await lead.get("k", consistency="stale")).value in (b"v", b"lost?")


async def test_isolated_leader_serves_no_linearizable_read_and_acks_nothing(cluster):
    old = await cluster.leader()
    await old.put("x", b"1")
    cluster.net.isolate(old.config.id)
    new = await cluster.leader(exclude=(old.config.id,))
    await new.put("x", b"2")
    # The old leader may still believe it leads for a moment; it must not answer a
    # linearizable read with the stale value, nor acknowledge a write.
    with pytest.raises((kv.NoQuorum, kv.NotLeader)):
        await old.get("x", timeout=1.0)
    # Either it still led and appended the write (which cannot commit: unknown to it), or
    # it had stepped down and had nobody to send it to (not carried out): the answer says which.
    end = old.raft.metrics().ledger_end_index
    with pytest.raises((kv.Timeout, kv.NotLeader)) as refused:
        await old.put("x", b"from-deposed", timeout=1.0)
    appended = old.raft.metrics().ledger_end_index > end
    assert isinstance(refused.value, kv.Timeout) == appended, (refused.value, appended)
    cluster.net.heal()
    assert await old.wait_leader(timeout=10) != old.config.id
    assert (await old.get("x")).value == b"2"  # its unacknowledged write was discarded


async def test_restart_of_every_node_keeps_every_acknowledged_write(cluster):
    lead = await cluster.leader()
    acked = {}
    for i in range(200):
        r = await lead.put(f"k{i}", b"v%d" % i)
        acked[f"k{i}"] = r.index
    await cluster.stop()
    await cluster.start()
    n = await cluster.leader()
    for k, idx in acked.items():
        assert (await n.get(k)).mod_index == idx


async def test_a_follower_behind_the_compacted_log_catches_up_by_snapshot(tmp_path):
    c = InprocCluster(str(tmp_path), snapshot_threshold=300, snapshot_trailing=20)
    await c.start()
    try:
        lead = await c.leader()
        lagger = (await c.followers())[0]
        lid = lagger.config.id
        await c.stop(lid)
        for i in range(1000):
            await lead.put(f"key{i:04d}", b"x" * 50)
        st = lead.status()
        assert st["ledger_begin_index"] > 0 and st["snapshot_index"] > 0
        await c.start(lid)
        await c.wait_applied(lead.raft.applied_index)
        back = c.nodes[lid]
        assert back.snapshots.stats.installed == 1
        s = back.status()
        assert s["snapshot_index"] >= st["ledger_begin_index"] and s["ledger_begin_index"] >= s["snapshot_index"]
        assert c.data(lid) == c.data(lead.config.id)
        # Restart after install and compaction: replays what follows the snapshot.
        await c.stop(lid)
        await lead.put("late", b"1")
        await c.start(lid)
        await c.wait_applied(lead.raft.applied_index)
        assert c.data(lid) == c.data(lead.config.id)
    finally:
        await c.stop()


async def test_a_snapshot_asked_for_covers_what_was_applied_though_one_was_being_written(tmp_path):
    """POST /v1/snapshot and kv.open().snapshot() mean "now": one asked for while the
    threshold's is being written does not answer with that older one (nor write beside it)."""
    node = kv.Node(kv.NodeConfig(id="n1", data_dir=str(tmp_path / "n1"), snapshot_threshold=10))
    await node.start()
    try:
        await node.wait_leader(timeout=10)
        entered, release = threading.Event(), threading.Event()
        write = node.snapshots.store.write

        def held_write(*args, **kwargs):  # the threshold's snapshot is written slowly
            entered.set()
            release.wait(10)
            return write(*args, **kwargs)

        node.snapshots.store.write = held_write
        for i in range(10):
            await node.put(f"k{i}", b"v")
        assert await asyncio.to_thread(entered.wait, 10)
        for i in range(10, 15):
            await node.put(f"k{i}", b"v")
        wanted = node.raft.applied_index
        asked = asyncio.ensure_future(node.snapshots.take())
        await asyncio.sleep(0.05)
        release.set()
        snap = await asked
        assert snap.index >= wanted
        assert [s.index < wanted for s in node.snapshots.store.list()] == [False, True]  # newest first
    finally:
        await node.stop()


async def test_a_large_snapshot_is_taken_again_once_the_writes_since_add_up_to_half_its_size(tmp_path, monkeypatch):
    """Every --snapshot-threshold entries rewrote the whole state, however large: with 1M
    keys, 3-5 s of CPU on every node at once each 100,000 small writes. Past
    LARGE_SNAPSHOT_BYTES the next one also waits for half its size in entries applied."""
    monkeypatch.setattr(kv.snapshot.manager, "LARGE_SNAPSHOT_BYTES", 16 << 10)
    node = kv.Node(kv.NodeConfig(id="n1", data_dir=str(tmp_path / "n1"), snapshot_threshold=10))
    await node.start()
    try:
        await node.wait_leader(timeout=10)
        value = b"v" * 1000
        for i in range(60):
            await node.put(f"k{i:02d}", value)
        size = os.path.getsize((await node.snapshots.take()).path)
        assert size > 50_000
        taken = node.snapshots.stats.taken
        below = -(-size // 4 // len(value))  # entries of over 1,000 bytes: at least a quarter of its size, under half
        assert below >= 10  # past the threshold
        for i in range(below):
            await node.put(f"k{i % 60:02d}", value)
        await asyncio.sleep(0.3)
        assert node.snapshots.stats.taken == taken
        for i in range(-(-size * 3 // 10 // len(value))):  # over half its size in all
            await node.put(f"k{i % 60:02d}", value)
        await poll(lambda: node.snapshots.stats.taken == taken + 1, timeout=10, error="no snapshot after half its size")
    finally:
        await node.stop()


async def test_a_write_whose_entry_a_snapshot_covers_is_sent_again_and_answered_with_its_result(tmp_path):
    """Found by the soak: leader L appends a conditional write that reaches follower A only;
    L is cut off, A leads and commits the entry, then compacts past it and installs a
    snapshot on L. L cannot tell whether its proposal committed (it did). Re-proposing it
    as a new write answered 412 for a write that happened. Sent again as the same session
    request, it is recognised as a copy: the answer is the first one's success."""
    c = InprocCluster(str(tmp_path), snapshot_threshold=50, snapshot_trailing=0)
    await c.start()
    try:
        lead = await c.leader()
        await lead.put("warm", b"up")  # L opens its session now, while everyone hears it
        lid = lead.config.id
        a, b = [n.config.id for n in await c.followers()]
        for src, dst in ((lid, b), (b, lid), (a, lid)):  # L's entries reach A only; nobody acks
            c.net.cut(src, dst)
        before = lead.raft.metrics().ledger_end_index
        write = asyncio.ensure_future(lead.put("once", b"1", if_absent=True, timeout=30))
        # No event tells that an entry reached a follower's ledger uncommitted: poll it.
        await poll(lambda: c.nodes[a].raft.metrics().ledger_end_index > before, timeout=5, interval=0.01, error="the entry never reached A")
        c.net.isolate(lid)
        new = await c.leader(exclude=(lid,))
        assert (await new.get("once")).value == b"1"  # A's term committed L's entry
        for i in range(120):  # past the snapshot threshold: the ledger is compacted
            await new.put(f"fill{i}", b"x")
        assert new.status()["ledger_begin_index"] > before + 1
        c.net.heal()
        w = await write
        assert c.nodes[lid].snapshots.stats.installed >= 1
        assert lead.counters["writes_resent"] >= 1
        item = await new.get("once")
        assert item.value == b"1" and item.mod_index == before + 1 == w.index
    finally:
        await c.stop()


async def test_a_forward_that_cannot_be_sent_leaves_nothing_behind(cluster, caplog):
    # A follower cut off from the leader retries its forward until the write's deadline;
    # each attempt that could not be sent used to leave a future for the deadline to fail,
    # logged later as "Future exception was never retrieved".
    import gc

    lead = await cluster.leader()
    follower = (await cluster.followers())[0]
    cluster.net.cut(follower.config.id, lead.config.id)
    with pytest.raises(kv.NotLeader, match="not carried out"):  # no attempt could be sent
        await follower.put("cut", b"1", timeout=0.3)
    await asyncio.sleep(0.5)  # past every deadline
    gc.collect()
    await asyncio.sleep(0)  # one turn of the loop: what gc freed reports then
    assert "never retrieved" not in caplog.text


async def test_a_learner_serves_stale_reads_and_never_votes(tmp_path):
    from kv.bench.harness import free_port

    from kv import NodeConfig
    from kv.raft.membership import Membership, new_ledger_id
    from kv.server.join import Joined

    c = InprocCluster(str(tmp_path))
    await c.start()
    learner = None
    try:
        lead = await c.leader()
        await lead.put("before", b"1")
        addr = f"127.0.0.1:{free_port()}"
        members = await lead.add_member("n4", addr)
        assert {m["id"]: m["voter"] for m in members}["n4"] is False
        learner = c.node(
            NodeConfig(id="n4", data_dir=str(tmp_path / "n4"), peers={"n4": addr}, heartbeat_ms=50, election_timeout_ms=500),
            joined=Joined(Membership.decode(lead.raft.core.membership.encode()), 0, new_ledger_id()),
        )
        await learner.start()
        await learner.wait_applied((await lead.put("after", b"2")).index, timeout=10)
        assert (await learner.get("after", consistency="stale")).value == b"2"
        assert (await learner.get("before", consistency="stale")).value == b"1"
        # With two of three voters gone there is no quorum: the learner neither campaigns
        # nor counts, so nobody leads.
        f1, f2 = await c.followers()
        await c.stop(lead.config.id, f1.config.id)
        await asyncio.sleep(2.5)  # several election timeouts (500 ms) in which nothing may happen
        assert learner.raft.role.label == "follower"
        assert f2.raft.role.label != "leader" and learner.raft.core.vote is None
    finally:
        if learner is not None:
            await learner.stop()
        await c.stop()


async def test_one_membership_change_at_a_time(cluster):
    from kv.bench.harness import free_port

    lead = await cluster.leader()
    results = await asyncio.gather(
        lead.add_member("x1", f"127.0.0.1:{free_port()}"),
        lead.add_member("x2", f"127.0.0.1:{free_port()}"),
        return_exceptions=True,
    )
    assert sum(isinstance(r, kv.Conflict) for r in results) == 1  # the second is refused
    assert "still in progress" in str(next(r for r in results if isinstance(r, Exception)))
    with pytest.raises(kv.BadRequest, match="last voter"):
        solo = kv.Node(kv.NodeConfig(id="solo", data_dir=str(cluster.root) + "/solo"))
        await solo.start()
        try:
            await solo.remove_member("solo")
        finally:
            await solo.stop()


async def test_answered_writes_are_let_go_at_once_not_held_until_their_deadline(cluster):
    """The Deadlines held every proposal's waiter until its bucket fell due (the write
    timeout), and with it what the waiter holds (a gRPC call, its stream and request):
    tens of thousands of objects on a busy leader that each young-generation collection
    walked (20-120 ms pauses of its event loop). Once answered, nothing holds them; one
    still unanswered keeps its deadline."""
    import gc
    import weakref

    from kv.raft.messages import EntryKind

    lead = await cluster.leader()
    raft, loop = lead.raft, asyncio.get_running_loop()
    payloads = [(EntryKind.NORMAL, lead.encode_request(lead.put_command(f"held/{i}", b"v"))) for i in range(5)]
    gc.disable()
    try:
        futs = raft.propose_many(payloads[:4], deadline=loop.time() + 60)  # a batch: one AllOf
        futs.append(raft.propose_many(payloads[4:], deadline=loop.time() + 60)[0])  # one waiter alone
        for f in futs:
            await f
        refs = [weakref.ref(f) for f in futs]
        del futs, f
        await asyncio.sleep(0)  # (the loop's handle that woke this task goes)
        assert [r() for r in refs] == [None] * 5
        assert not raft._filed and not any(raft._deadlines._buckets.values())
    finally:
        gc.enable()

    class NotYet:  # a waiter still unanswered when its entry and a later one are applied
        answered = False

        def done(self) -> bool:
            return self.answered

        def set_result(self, _) -> None:
            pass

        def set_exception(self, _) -> None:
            pass

    def filed(w) -> bool:
        return any(w in b for b in raft._deadlines._buckets.values())

    first = NotYet()
    raft.propose_waiters([(EntryKind.NORMAL, payloads[0][1], first)], deadline=loop.time() + 60)
    (later,) = raft.propose_many(payloads[1:2], deadline=loop.time() + 60)
    await later
    assert filed(first) and filed(later)  # (taken out in order: the later one waits for the first)
    first.answered = True
    await raft.propose_many(payloads[2:3], deadline=loop.time() + 60)[0]
    assert not filed(first) and not filed(later) and not raft._filed


async def test_the_state_closes_for_a_snapshot_load_while_a_snapshot_is_asked_for(tmp_path):
    """Before its database closes (a snapshot is loaded into it), a node waits for the
    snapshot being written from it; one asked for in the same turn of the loop (kv snapshot
    save), not yet reading, waits for the state to open again instead. quiesce waited for
    that one, which waited for resume: the state machine hung for good (a review found it)."""
    node = kv.Node(id="n1", data_dir=str(tmp_path / "n1"))
    await node.start()
    try:
        await node.put("k", b"v")
        snapshots = node.snapshots
        taken = asyncio.ensure_future(snapshots.take())
        closing = asyncio.ensure_future(snapshots.quiesce())  # (runs right after take() made its task)
        await asyncio.wait_for(closing, 5)
        await asyncio.sleep(0.2)
        assert not taken.done()  # held at the closed state...
        snapshots.resume()
        snap = await asyncio.wait_for(taken, 10)  # ...and taken once it is open again
        assert snap.index >= 2
    finally:
        await node.stop()


async def test_a_read_while_a_snapshot_is_loaded_is_unavailable_not_an_internal_error(tmp_path):
    """While the state is replaced by a snapshot, a read is refused as kv.Unavailable (503:
    read from another member meanwhile), the public error kv.Node's callers catch, and
    never reaches the closed database."""
    node = kv.Node(id="n1", data_dir=str(tmp_path / "n1"))
    await node.start()
    try:
        await node.put("k", b"v")
        node.sm.close_for_restore()  # (the load's first step; nothing loads it again here)
        with pytest.raises(kv.Unavailable, match="loading a snapshot into its state machine.*another member"):
            await node.get("k", consistency="stale")
    finally:
        await node.stop()


async def test_no_snapshot_is_started_once_the_snapshot_manager_stopped(tmp_path):
    """A node stops its snapshot manager before its Raft driver and FSM caller, which still
    apply entries: a snapshot their threshold started then read the state in a thread while
    the node closed it (closed under a reader, LevelDB crashes the process). None starts
    after the manager stopped, and one asked for is refused as the node stopping."""
    node = kv.Node(id="n1", data_dir=str(tmp_path / "n1"), snapshot_threshold=10)
    await node.start()
    try:
        await node.put("k", b"v")
        await node.snapshots.stop()  # (node.stop()'s first steps)
        for i in range(30):
            await node.put(f"k{i}", b"v")
        await asyncio.sleep(0.5)
        assert node.snapshots.newest_meta() is None and not os.listdir(node.config.snapshot_path)
        with pytest.raises(kv.Unavailable, match="stopping"):
            await node.take_snapshot()
    finally:
        await node.stop()
