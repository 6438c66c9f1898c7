"""Watches in-process: history replayed from the ledger is exactly what live watchers saw
(failed compare-and-sets, untaken transaction branches and deletes of missing keys are no
changes), a watcher that falls behind, a follower that installs a snapshot, kv.open."""

from __future__ import annotations

import asyncio
import random

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer
from inproc import InprocCluster

import kv
import kv.server.watch
from kv import Cond, Delete, Get, Node, NodeConfig, Put
from kv.http.app import create_app


@pytest.fixture
async def node(tmp_path):
    n = Node(NodeConfig(id="n1", data_dir=str(tmp_path / "n1"), snapshot_trailing=10))
    await n.start()
    while n.raft.leader_id is None:
        await n.raft.leader_changed.wait()
    await n.put("ready", b"")  # everything committed so far is applied: a new watch starts live
    yield n
    await n.stop()


async def drain(w: kv.Watch, until_index: int) -> list[kv.Event]:
    """Events of w up to until_index (the applied index after the writes)."""
    out = []
    for _ in range(100_000):
        got = await asyncio.wait_for(w.next_batch(1.0), 10)
        assert got is not None
        events, seen = got
        out += events
        if seen >= until_index:
            return out
    raise AssertionError("the watch did not catch up")


async def mixed_workload(n: Node, rng: random.Random, ops: int) -> None:
    keys = [f"w/{i}" for i in range(6)] + ["other/1"]
    lease = None
    for _ in range(ops):
        if rng.random() < 0.1:  # keys attached to a lease, deleted with its revoke
            if lease is None:
                lease = (await n.lease_grant(60)).id
                for k in rng.sample(keys, 3):
                    await n.put(k, b"leased", lease=lease)
            else:
                await n.lease_revoke(lease)
                lease = None
            with pytest.raises(kv.LeaseNotFound):  # an unknown lease: nothing written
                await n.put(rng.choice(keys), b"no", lease=123456789)
            continue
        k, k2 = rng.choice(keys), rng.choice(keys)
        cur = await n.get(k, consistency="stale")
        roll = rng.random()
        try:
            if roll < 0.3:
                await n.put(k, b"%d" % rng.randrange(100))
            elif roll < 0.45:
                guess = cur.mod_index if cur and rng.random() < 0.5 else rng.randrange(1, 50)
                await n.cas(k, guess, b"cas")
            elif roll < 0.6:
                await n.delete(k)  # sometimes of a missing key
            else:
                conds = [Cond(k, "exists", rng.random() < 0.5)]
                await n.txn(conds, [Put(k2, b"then"), Delete(k), Get(k2)], [Delete(k2), Put(k, b"else"), Delete("w/missing")])
        except kv.PreconditionFailed:
            pass


async def test_history_is_what_live_watchers_saw(node, monkeypatch):
    monkeypatch.setattr(kv.server.watch, "HISTORY_CHUNK_CHANGES", 3)  # history read in many small steps
    live = node.watch("w/")
    assert await live.next_batch(0.01) == ([], node.raft.applied_index)  # in the live fan-out now
    await mixed_workload(node, random.Random(7), 150)
    end = node.raft.applied_index
    seen_live = await drain(live, end)
    replayed = await drain(node.watch("w/", start_index=1), end)
    assert replayed == seen_live and len(seen_live) > 50
    # The changes rebuild the state exactly.
    state = {}
    for ev in seen_live:
        if ev.value is None:
            del state[ev.key]
        else:
            state[ev.key] = (ev.value, ev.mod_index)
    assert state == {i.key: (i.value, i.mod_index) for i in await node.scan("w/")}
    # Compaction of the ledger: a plain watch starts no earlier than the ledger (DESIGN.md);
    # etcd's (rich) ones read on from the history, with the key before each change.
    await node.snapshots.take()
    begin = node.status()["ledger_begin_index"]
    assert begin > 0
    with pytest.raises(kv.WatchCompacted) as e:
        node.watch("w/", start_index=begin)
    assert e.value.ledger_begin_index == begin and "watch from" in str(e.value)
    after = await drain(node.watch("w/", start_index=begin + 1), end)
    assert after == [ev for ev in seen_live if ev.index > begin]
    rich = await drain(node.watch("w/", start_index=1, rich=True), end)
    assert [(ev.index, ev.key, ev.value) for ev in rich] == [(ev.index, ev.key, ev.value) for ev in seen_live]
    last: dict = {}
    for ev in rich:
        assert (ev.prev.value, ev.prev.mod_revision) == last[ev.key] if ev.prev else ev.key not in last
        if ev.value is None:
            del last[ev.key]
        else:
            last[ev.key] = (ev.value, ev.index)


async def test_a_watcher_that_falls_behind_reads_on_from_the_ledger(node):
    w = node.watch("s/", buffer_bytes=2000)
    stream = node.watch("s/", buffer_bytes=2000, resume_when_behind=False)
    for x in (w, stream):
        await x.next_batch(0.01)
    writes = [(await node.put(f"s/{i}", b"x" * 100)).index for i in range(100)]
    assert node.watches.stats()[1] == 0  # both overflowed: nothing is held for them
    assert [e.index for e in await drain(w, writes[-1])] == writes
    with pytest.raises(kv.SlowWatcher) as e:
        await stream.next_batch(1.0)
    assert e.value.resume_index == writes[0]
    assert [e.index for e in await drain(node.watch("s/", start_index=e.value.resume_index), writes[-1])] == writes


async def test_a_change_reaches_a_watch_once_whatever_longer_prefixes_are_watched(node):
    """Found by a differential run against etcd's gateway: a watch of "k" got a put of "k"
    once for every longer prefix some other watch had ("k"[:n] is "k" again for every
    n over 1), over gRPC too (etcdctl watch k showed it twice)."""
    for rich in (False, True):
        w = node.watch("k", rich=rich)
        others = [node.watch("k" + "x" * n, rich=rich) for n in range(1, 4)]
        for o in (w, *others):
            assert (await o.next_batch(0.01))[0] == []  # each is live now: the put reaches it from the fan-out
        index = (await node.put("k", b"1")).index
        got = await drain(w, index)
        assert [(e.key, e.index) for e in got] == [("k", index)], got
        for o in (w, *others):
            o.close()


async def test_a_watch_from_an_index_ahead_of_now_starts_there(node):
    """It started from now: the changes before the index asked for came too."""
    for rich in (False, True):
        ahead = node.raft.applied_index + 3
        w = node.watch("f/", start_index=ahead, rich=rich)
        # (read while the index is still ahead) Its progress never goes back before where it
        # starts: a client resuming from the last progress seen would get changes again.
        assert await w.next_batch(0.01) == ([], ahead - 1)
        writes = [(await node.put(f"f/{i}", b"x")).index for i in range(5)]
        got = [e.index for e in await drain(w, writes[-1])]
        assert got == [i for i in writes if i >= ahead] and len(got) < len(writes)
        w.close()


async def test_a_follower_that_installs_a_snapshot_ends_its_watches(tmp_path):
    c = InprocCluster(str(tmp_path), snapshot_threshold=100, snapshot_trailing=5)
    await c.start()
    try:
        lead = await c.leader()
        f = (await c.followers())[0]
        w = f.watch("")
        await w.next_batch(0.01)
        c.net.isolate(f.config.id)
        for i in range(300):
            await lead.put(f"k{i}", b"x")
        c.net.heal()
        await c.wait_applied(lead.raft.applied_index)
        assert f.snapshots.stats.installed >= 1
        with pytest.raises(kv.WatchCompacted, match="installing a snapshot"):
            for _ in range(10):
                await w.next_batch(1.0)
    finally:
        await c.stop()


def test_kv_open_watches_from_further_back_than_memory(tmp_path):
    with kv.open(str(tmp_path / "db")) as db:
        first = None
        for b in range(12):  # 12,000 changes: more than the old 10,000-change window held
            r = db.put_many({f"h/{b}/{i}": b"%d" % i for i in range(1000)})
            first = first or r.index
        events = db.watch("h/", start_index=1, timeout=2)
        got = [next(events) for _ in range(12_000)]
        events.close()
    assert got[0].key == "h/0/0" and got[0].index == first and got[-1].key == "h/11/999"


async def test_a_stream_needs_the_token_and_ends_with_a_line_when_the_node_stops(tmp_path):
    n = Node(NodeConfig(id="n1", data_dir=str(tmp_path / "n1"), token="s3cret"))
    await n.start()
    client = TestClient(TestServer(create_app(n, token="s3cret")))
    await client.start_server()
    try:
        r = await client.get("/v1/watch")
        assert r.status == 401 and (await r.json())["error"]["code"] == "UNAUTHORIZED"
        r = await client.get("/v1/watch", params={"prefix": "t/"}, headers={"Authorization": "Bearer s3cret"})
        assert r.status == 200 and orjson.loads(await r.content.readline())["type"] == "progress"
        await client.server.runner.shutdown()  # what kv serve does on SIGTERM, before it stops the node
        last = orjson.loads(await asyncio.wait_for(r.content.readline(), 10))
        assert last["type"] == "error" and last["code"] == "UNAVAILABLE" and "resume from index" in last["message"]
    finally:
        await client.close()
        await n.stop()
