"""Exactly-once writes: client sessions in the state machine (statemachine/sessions.py), on
the sending side (kv/common/sessions.py and kv/server/writes.py), in kv.Node and over HTTP (X-Kv-Session, X-Kv-Seq)."""

from __future__ import annotations

import asyncio

import pytest
from test_apply_limits import normal
from test_http import make_client

import kv
from kv.raft.messages import Entry, EntryKind
from kv.raft.errors import TransferInProgress
from kv.raft.node import DeadlineExceeded, OutcomeUnknown
from kv.common.sessions import RequestId, SessionPool, Slot
from kv.server.session_sweeper import IdleSessions
from kv.statemachine import commands as c
from kv.statemachine.leveldb import LevelDBStateMachine


@pytest.fixture
def sm(tmp_path):
    s = LevelDBStateMachine(str(tmp_path / "state"))
    yield s
    s.close()


def in_session(index: int, session: int, seq: int, cmd) -> Entry:
    return normal(index, c.InSession(session, seq, cmd))


# -- the state machine ------------------------------------------------------------------------


def test_a_copy_is_answered_with_the_first_result_and_applied_once(sm):
    cas = c.Put("k", b"2", c.Cond("k", "mod", 2))
    res = sm.apply([
        normal(1, c.SessionOpen(7, 100)),
        in_session(2, 7, 1, c.Put("k", b"1")),
        in_session(3, 7, 2, cas),
        in_session(4, 7, 2, cas),  # a copy: its condition no longer holds, and must not be asked again
        in_session(5, 7, 2, cas),
    ])
    assert res == [c.SessionOpened(7), c.PutResult(2), c.PutResult(3), c.PutResult(3), c.PutResult(3)]
    assert sm.get("k") == (3, b"2")
    assert sm.copies == 2


def test_a_different_write_under_a_used_number_is_refused_not_answered_as_the_first(sm):
    sm.apply([normal(1, c.SessionOpen(7, 100)), in_session(2, 7, 1, c.Put("a", b"1")), in_session(3, 7, 2, c.Delete("a"))])
    res = sm.apply([in_session(4, 7, 2, c.Put("other", b"x")), in_session(5, 7, 2, c.Delete("a"))])
    assert res == [c.RequestMismatch(7, 2), c.DeleteApplied(3, True)]
    assert sm.get("other") is None and sm.copies == 1


def test_a_copy_of_a_transaction_keeps_its_branch_and_its_reads(sm):
    txn = c.Txn((c.Cond("n", "mod", 0),), (c.Put("n", b"1"), c.Get("n")), (c.Get("n"),))
    res = sm.apply([normal(1, c.SessionOpen(9, 100)), in_session(2, 9, 1, txn), in_session(3, 9, 1, txn)], answering=set())
    first = c.TxnApplied(2, True, (c.PutResult(2), c.GetResult("n", b"1", 2)))
    assert res[1:] == [first, first]  # read on every replica (answering is empty), kept for the copy


def test_a_request_in_a_closed_session_or_below_the_last_one_applies_nothing(sm):
    res = sm.apply([
        in_session(1, 5, 1, c.Put("a", b"x")),  # never opened
        normal(2, c.SessionOpen(5, 100)),
        in_session(3, 5, 4, c.Put("a", b"1")),  # numbers may skip (requests given up on)
        in_session(4, 5, 3, c.Put("a", b"old")),  # below the last: moved past
        normal(5, c.SessionsExpire(3)),
        in_session(6, 5, 5, c.Put("a", b"late")),
    ])
    assert res == [c.SessionExpired(5), c.SessionOpened(5), c.PutResult(3), c.StaleRequest(5, 3, 4), None, c.SessionExpired(5)]
    assert sm.get("a") == (3, b"1")
    assert len(sm.sessions) == 0


def test_opening_beyond_the_limit_evicts_the_least_recently_used(sm):
    sm.apply([normal(1, c.SessionOpen(1, 2)), normal(2, c.SessionOpen(2, 2)), in_session(3, 1, 1, c.Put("k", b"v"))])
    res = sm.apply([normal(4, c.SessionOpen(3, 2)), normal(5, c.SessionOpen(3, 2))])  # session 2 is the least recently used
    assert res == [c.SessionOpened(3), c.SessionOpened(3)]
    assert list(sm.sessions.last) == [1, 3]
    assert sm.apply([in_session(6, 2, 1, c.Put("k", b"w"))]) == [c.SessionExpired(2)]


def test_past_the_limit_the_owner_holding_the_most_loses_its_least_recently_used(tmp_path, sm):
    """Found by an attacker review: one token opening sessions in a loop evicted every other
    client's (least recently used first, whoever's). Now the owner holding the most loses
    its own first; the owners are kept in records, so a restart and a snapshot keep them."""
    sm.apply([normal(1, c.SessionOpen(1, 6)), normal(2, c.SessionOpen(2, 6, "b"))])
    sm.apply([normal(3 + i, c.SessionOpen(10 + i, 6, "a")) for i in range(4)])  # a: 10..13
    sm.apply([in_session(7, 10, 1, c.Put("k", b"v"))])  # a's 10 used: 11 is its least recently used
    assert sm.apply([normal(8, c.SessionOpen(14, 6, "a"))]) == [c.SessionOpened(14)]
    assert sm.apply([normal(9, c.SessionOpen(3, 6))]) == [c.SessionOpened(3)]  # "" (the admin's, say) evicts a's too
    assert list(sm.sessions.last) == [1, 2, 13, 10, 14, 3] and sm.sessions.evicted == 2
    assert sm.apply([in_session(10, 11, 1, c.Put("k", b"x")), in_session(11, 12, 1, c.Put("k", b"x"))]) == [c.SessionExpired(11), c.SessionExpired(12)]
    # equal counts: the owner whose least recently used is the older
    sm.apply([normal(12, c.SessionOpen(4, 9)), normal(13, c.SessionOpen(5, 9, "b")), normal(14, c.SessionOpen(6, 9, "b"))])  # "" 1,3,4; a 13,10,14; b 2,5,6
    assert sm.apply([normal(15, c.SessionOpen(7, 9, "c"))]) == [c.SessionOpened(7)]
    assert 1 not in sm.sessions.last and {2, 13} <= set(sm.sessions.last)  # "" held session 1, the oldest of the three
    sm.apply([normal(16, c.SessionsExpire(6))])  # closes 2 (b) and 13 (a): their records go
    owners = lambda db: {k for k, _ in db._db.iterator(prefix=b"k\x00sown/")}  # noqa: E731
    assert len(owners(sm)) == 5  # 10, 14 (a); 5, 6 (b); 7 (c)
    view = sm.capture()
    items = list(view.items())
    view.release()
    want = {k: v[4] for k, v in sm.sessions.last.items()}
    sm.close()
    again = LevelDBStateMachine(sm.path)
    other = LevelDBStateMachine(str(tmp_path / "other"))
    other.restore(16, 1, b"", iter(items))
    for m in (again, other):
        assert {k: v[4] for k, v in m.sessions.last.items()} == want and list(m.sessions.last) == list(want)
        assert m.apply([normal(17, c.SessionOpen(8, 8, "c")), normal(18, c.SessionOpen(9, 8, "c"))]) == [c.SessionOpened(8), c.SessionOpened(9)]
        assert set(m.sessions.last) == {3, 4, 5, 6, 7, 8, 9, 14}  # four owners of 2: the oldest, a's 10, went
        assert len(owners(m)) == 6
        m.close()


def test_after_a_crash_the_sessions_are_in_the_order_every_other_replica_has(tmp_path, sm):
    """Found by a review: replaying the plain puts after a crash moved their sessions after
    those whose records were written later, so the restarted replica closed (expiry) or
    evicted other sessions than the rest, and a write applied on some replicas only."""
    import shutil

    opened = [normal(1, c.SessionOpen(1, 100, "t")), normal(2, c.SessionOpen(2, 100, "t")), normal(3, c.SessionOpen(3, 100))]
    sm.apply(opened)
    sm.capture().release()  # the records flushed: sessions_at 3
    later = [in_session(4, 1, 1, c.Put("a", b"1")), in_session(5, 2, 1, c.Put("b", b"1", c.Cond("b", "mod", 0)))]  # a plain put waits; a conditional one is written
    sm.apply(later)
    crashed = str(tmp_path / "crashed")
    shutil.copytree(sm.path, crashed)
    again = LevelDBStateMachine(crashed)
    again.replay_sessions(opened + later)
    for m in (sm, again):
        assert list(m.sessions.last) == [3, 1, 2] and {o: list(x) for o, x in m.sessions.of_owner.items()} == {"": [3], "t": [1, 2]}
    nxt = [normal(6, c.SessionsExpire(4)), in_session(7, 1, 2, c.Put("a", b"2")), in_session(8, 2, 2, c.Put("b", b"2"))]
    assert sm.apply(nxt) == again.apply(nxt) == [None, c.SessionExpired(1), c.PutResult(8)]
    again.close()


def test_sessions_survive_a_restart_and_a_snapshot_in_lru_order(tmp_path, sm):
    sm.apply([normal(1, c.SessionOpen(11, 100)), normal(2, c.SessionOpen(22, 100)), in_session(3, 11, 1, c.Put("k", b"v"))])
    view = sm.capture()
    items = list(view.items())
    view.release()
    sm.close()
    again = LevelDBStateMachine(sm.path)
    assert {k: v[:3] for k, v in again.sessions.last.items()} == {22: [0, 2, True], 11: [1, 3, True]}
    assert again.apply([in_session(4, 11, 1, c.Put("k", b"v"))]) == [c.PutResult(3)]
    again.close()
    other = LevelDBStateMachine(str(tmp_path / "other"))
    other.restore(3, 1, b"", iter(items))
    assert {k: v[:3] for k, v in other.sessions.last.items()} == {22: [0, 2, True], 11: [1, 3, True]}
    assert other.apply([in_session(4, 11, 1, c.Put("k", b"v"))]) == [c.PutResult(3)]  # the copy, after install-snapshot
    assert other.scan("") == [("k", b"v", 3)]  # the session records are not user keys
    other.close()


def test_the_history_holds_a_copy_once(sm):
    entries = [
        normal(1, c.SessionOpen(3, 100)),
        in_session(2, 3, 1, c.Put("w/a", b"1")),
        in_session(3, 3, 1, c.Put("w/a", b"1")),
        in_session(4, 3, 2, c.Txn((), (c.Put("w/b", b"2"), c.Delete("w/a")))),
        in_session(5, 3, 2, c.Txn((), (c.Put("w/b", b"2"), c.Delete("w/a")))),
    ]
    sm.apply(entries)
    events, _ = sm.history_changes(1, "w/", 1000)
    assert [e[:3] for e in events] == [(2, "w/a", b"1"), (4, "w/b", b"2"), (4, "w/a", None)]


def test_malformed_session_entries_are_refused_not_fatal(sm):
    inner = c.encode(c.Put("k", b"v"))
    nested = c.IN_SESSION + c.SESSION_IDS.pack(1, 1) + c.IN_SESSION + c.SESSION_IDS.pack(1, 1) + inner
    seq0 = c.IN_SESSION + c.SESSION_IDS.pack(2, 0) + inner
    short = c.IN_SESSION + b"\x00\x01"
    sm.apply([normal(0, c.SessionOpen(1, 10)), normal(1, c.SessionOpen(2, 10))])
    res = sm.apply([Entry(i, 1, EntryKind.NORMAL, d) for i, d in ((2, nested), (3, seq0), (4, short))])
    assert all(isinstance(r, c.CommandError) for r in res), res
    assert sm.get("k") is None and sm.applied() == (4, 1)


def test_the_codec_carries_sessions_and_refuses_what_cannot_be_one():
    for cmd in (c.SessionOpen(2**53 - 1, 5), c.SessionOpen(7, 5, "ab12"), c.SessionsExpire(9), c.InSession(4, 2**63 - 1, c.Txn((), (c.Put("a", b""),)))):
        assert c.decode(c.encode(cmd)) == cmd
    assert c.encode(c.SessionOpen(7, 5))[1] == 11  # without an owner: the opcode versions before owners read
    with pytest.raises(c.CommandError, match="owner"):
        c.encode(c.SessionOpen(7, 5, "x" * 65))
    for r in (c.SessionOpened(3), c.SessionExpired(4), c.StaleRequest(1, 2, 3)):
        assert c.decode_result(c.encode_result(r)) == r
    for bad in (c.InSession(0, 1, c.Put("a", b"")), c.InSession(1, 0, c.Put("a", b"")), c.InSession(2**53, 1, c.Put("a", b""))):
        with pytest.raises(c.CommandError):
            c.encode(bad)
    with pytest.raises(c.CommandError, match="only puts"):
        c.in_session(1, 1, c.encode(c.LeaseKeepAlive(3)))  # never logged: nothing to apply once


# -- the sending side ------------------------------------------------------------------------


def test_idle_sessions_are_counted_from_the_leaders_notes_and_from_its_election():
    idle = IdleSessions(10.0)
    idle.note(True, 5, 100.0, 40)
    idle.note(True, 5, 105.0, 60)
    assert idle.idle_upto(109.9) is None  # nothing is 10 s old yet
    assert idle.idle_upto(110.0) == 40
    idle.note(True, 5, 111.0, 70)
    assert idle.idle_upto(115.0) == 60  # the newest note at least 10 s old
    idle.note(True, 6, 116.0, 80)  # a new term: everything counts as used at the election
    assert idle.idle_upto(125.0) is None and idle.idle_upto(126.0) == 80
    idle.note(False, 6, 127.0, 80)
    assert idle.idle_upto(1000.0) is None


async def test_a_pool_opens_a_session_per_request_in_flight_and_reuses_them():
    opened = []

    async def open_session() -> int:
        opened.append(len(opened) + 1)
        return opened[-1]

    pool = SessionPool(open_session)
    a, b = await pool.acquire(), await pool.acquire()
    assert ((a.id, a.next_seq()), (b.id, b.next_seq())) == ((1, 1), (2, 1))
    pool.release(a)
    again = await pool.acquire()
    assert again is a and again.next_seq() == 2 and opened == [1, 2]


# -- a node -----------------------------------------------------------------------------------


async def test_a_nodes_own_session_that_expired_is_replaced_and_a_callers_is_refused(tmp_path):
    node = kv.Node(kv.NodeConfig(id="n1", data_dir=str(tmp_path / "n1"), session_ttl_s=1.0))
    await node.start()
    try:
        await node.wait_leader(timeout=10)
        mine = await node.open_session()
        assert (await node.put("a", b"1", request_id=RequestId(mine, 1))).index == (await node.put("a", b"1", request_id=RequestId(mine, 1))).index
        await node.put("b", b"1")  # in the node's own session
        await asyncio.sleep(3.5)  # both idle past the ttl: the leader commits their expiry
        assert len(node.sm.sessions) == 0
        with pytest.raises(kv.SessionExpired):
            await node.put("a", b"2", request_id=RequestId(mine, 2))
        with pytest.raises(kv.Timeout, match="may or may not"):  # sent before: it may have applied before the session closed
            await node.submit(kv.Put("a", b"2"), request_id=RequestId(mine, 2), resent=True)
        opened = node.sessions.opened
        w = await node.put("b", b"2")  # the node opens another session for its own writes
        assert node.sessions.opened == opened + 1 and (await node.get("b")).mod_index == w.index
        assert (await node.get("a")).value == b"1"
    finally:
        await node.stop()


class _Waiting(Slot):
    """A write for propose_now whose resolution a test awaits."""

    __slots__ = ("fut",)

    def __init__(self, node, cmd) -> None:
        super().__init__(cmd, node.encode_request(cmd))
        self.fut = asyncio.get_running_loop().create_future()

    def resolved(self) -> None:
        self.fut.set_result(None)


async def test_a_write_proposed_without_a_task_goes_again_as_the_same_request_when_its_outcome_is_unknown(tmp_path):
    """The write path without a task per write (kv.open's; the etcd API's plain puts on
    the leader): a write it cannot send (no free session yet) goes the general way; one it
    sent whose outcome became unknown (its leader replaced, say) goes again as the same
    session request, and is applied once."""
    node = kv.Node(kv.NodeConfig(id="n1", data_dir=str(tmp_path / "n1")))
    await node.start()
    try:
        await node.wait_leader(timeout=10)
        first = _Waiting(node, node.put_command("a", b"1"))
        node.propose_now([first])  # the pool has no session yet: given up, nothing appended
        assert first.done() and first.fallback and first.rid is None and node.settle(first) is None
        w1 = node.put_result(await node.resubmit(first))  # the general way opens a session, and gives it back
        assert len(node.sessions) == 1
        second = _Waiting(node, node.put_command("b", b"1"))
        node.propose_now([second])
        await second.fut
        w2 = node.put_result(node.settle(second))
        assert second.rid is not None and w2.index > w1.index and len(node.sessions) == 1
        # Its answer lost (say its leader was replaced as it applied): sent again, the same
        # request is answered with the first result, not applied a second time.
        again = _Waiting(node, second.cmd)
        again.lane, again.rid, again.writer = node.sessions.take(), second.rid, second.writer  # (as propose_now had set them)
        again.set_exception(OutcomeUnknown("the leader it went to was replaced"))
        assert node.settle(again) is None
        assert node.put_result(await node.resubmit(again)).index == w2.index and len(node.sessions) == 1
        b = node.etcd_key(b"b")
        assert (b.mod_revision, b.version) == (w2.index, 1)
        assert node.counters["writes"] == 2  # each write once, however it went
        # Refused as the leadership was being handed over (the driver fails the proposals
        # it had queued): not appended, so it goes the general way, which waits for the
        # next leader (it was answered UNKNOWN with the transfer's message).
        third = _Waiting(node, node.put_command("c", b"1"))
        lane = node.sessions.take()
        third.lane, third.rid, third.writer = lane, RequestId(lane.id, lane.next_seq()), second.writer
        third.set_exception(TransferInProgress("n2"))
        assert node.settle(third) is None
        w3 = node.put_result(await node.resubmit(third))
        assert node.etcd_key(b"c").mod_revision == w3.index and len(node.sessions) == 1
        # Past its deadline (DeadlineExceeded is an OutcomeUnknown too) it is not sent again:
        # its outcome is unknown, and the caller is told so (a resend found the disk full and
        # answered NoSpace for a write that was applied once there was room).
        late = _Waiting(node, node.put_command("d", b"1"))
        lane = node.sessions.take()
        late.lane, late.rid, late.writer = lane, RequestId(lane.id, lane.next_seq()), second.writer
        late.set_exception(DeadlineExceeded("not answered in time"))
        with pytest.raises(kv.Timeout, match="may or may not"):
            node.settle(late)
        assert len(node.sessions) == 1  # its session free again
        # Its outcome unknown (a snapshot from the next leader covered it), and its copy
        # refused (a NOSPACE alarm raised meanwhile): the caller is told the outcome is
        # unknown, not that the write was refused (it may be in that snapshot).
        await node.set_alarm(0, 1, True)
        assert node.sm.nospace
        unsure = _Waiting(node, node.put_command("e", b"1"))
        lane = node.sessions.take()
        unsure.lane, unsure.rid, unsure.writer = lane, RequestId(lane.id, lane.next_seq()), second.writer
        unsure.set_exception(OutcomeUnknown("a snapshot covered it"))
        assert node.settle(unsure) is None
        with pytest.raises(kv.Timeout, match="a snapshot covered it: read the key"):
            await node.resubmit(unsure)
        assert len(node.sessions) == 1 and unsure.lane is None  # given back once
    finally:
        await node.stop()


async def test_kv_open_checks_the_request_size_as_every_face_does(tmp_path):
    db = await asyncio.to_thread(kv.open, str(tmp_path / "db"), max_value_bytes=1000, max_request_bytes=6000)
    try:
        with pytest.raises(kv.ValueTooLarge, match="--max-request-bytes"):
            await asyncio.to_thread(db.put_many, {f"k{i}": b"x" * 100 for i in range(70)})
        assert await asyncio.to_thread(db.get, "k0") is None
        await asyncio.to_thread(db.put, "small", b"v")
        assert len(db._node.sm.sessions) == 1  # kv.open writes in a session too
    finally:
        await asyncio.to_thread(db.close)


# -- HTTP -------------------------------------------------------------------------------------


async def test_http_writes_with_a_session_apply_once_and_repeat_their_answer(tmp_path):
    node, api = await make_client(tmp_path)
    try:
        await api.put("/v1/kv/warm", data=b"1")  # in one of the node's own sessions: never handed out
        r = await api.post("/v1/sessions")
        assert r.status == 200
        d = await r.json()
        assert d["ttl"] == 600 and 0 < d["id"] < 2**53
        h = {"X-Kv-Session": str(d["id"]), "X-Kv-Seq": "1"}
        first = await (await api.put("/v1/kv/c", data=b"1", headers={**h, "If-None-Match": "*"})).json()
        again = await api.put("/v1/kv/c", data=b"1", headers={**h, "If-None-Match": "*"})
        assert again.status == 200 and await again.json() == first  # not 412: the same request, answered again
        h2 = {**h, "X-Kv-Seq": "2"}
        txn = b'{"compare": [{"key": "c", "mod_index": %d}], "success": [{"op": "put", "key": "c", "value": "2"}]}' % first["index"]
        t1 = await (await api.post("/v1/txn", data=txn, headers=h2)).json()
        t2 = await api.post("/v1/txn", data=txn, headers=h2)
        assert t2.status == 200 and await t2.json() == t1 and t1["succeeded"]
        stale = await api.put("/v1/kv/c", data=b"old", headers=h)
        assert stale.status == 409 and "below its last one" in (await stale.json())["error"]["message"]
        other = await api.put("/v1/kv/elsewhere", data=b"x", headers=h2)  # a new write under a used number
        assert other.status == 409 and "was a different write" in (await other.json())["error"]["message"]
        assert (await api.get("/v1/kv/elsewhere")).status == 404
        h3 = {**h, "X-Kv-Seq": "3"}
        g1 = await (await api.post("/v1/leases", json={"ttl": 60}, headers=h3)).json()
        g2 = await (await api.post("/v1/leases", json={"ttl": 60}, headers=h3)).json()
        assert g1 == g2 and g1["id"] > 1 << 20  # one lease, whichever node the copy went to
        unknown = await api.put("/v1/kv/c", data=b"x", headers={"X-Kv-Session": "12345", "X-Kv-Seq": "1"})
        body = await unknown.json()
        assert unknown.status == 409 and body["error"]["code"] == "SESSION_EXPIRED" and body["error"]["session"] == 12345
        assert (await (await api.get("/v1/kv/c")).read()) == b"2"
        for bad in ({"X-Kv-Session": "1"}, {"X-Kv-Seq": "1"}, {"X-Kv-Session": "0", "X-Kv-Seq": "1"}, {"X-Kv-Session": "x", "X-Kv-Seq": "1"},
                    {"X-Kv-Session": str(2**53), "X-Kv-Seq": "1"}, {"X-Kv-Session": "1", "X-Kv-Seq": "-1"}):
            resp = await api.put("/v1/kv/c", data=b"bad", headers=bad)
            assert resp.status == 400, (bad, await resp.text())
        assert (await (await api.get("/v1/kv/c")).read()) == b"2"
    finally:
        await api.close()
        await node.stop()


@pytest.mark.parametrize("snapshot", [True, False])
def test_after_a_crash_the_plain_puts_session_state_is_replayed_from_the_ledger(tmp_path, sm, snapshot):
    import shutil

    opened = [normal(1, c.SessionOpen(1, 100)), normal(2, c.SessionOpen(2, 100))]
    sm.apply(opened)
    if snapshot:
        sm.capture().release()  # every record up to date as of index 2
    later = [
        in_session(3, 1, 1, c.Put("a", b"1")),  # plain puts: their records wait
        in_session(4, 2, 1, c.Put("b", b"1", c.Cond("b", "mod", 0))),  # conditional: written at once
        in_session(5, 2, 2, c.Put("b", b"2")),
        in_session(6, 1, 1, c.Put("a", b"1")),  # a copy
        in_session(7, 9, 1, c.Put("a", b"x")),  # no such session
    ]
    sm.apply(later)
    want = {k: [v[0], v[1], v[3]] for k, v in sm.sessions.last.items()}
    assert {k: v[:2] for k, v in want.items()} == {1: [1, 3], 2: [2, 5]} and list(sm.sessions.last) == [1, 2]
    crashed = str(tmp_path / "crashed")
    shutil.copytree(sm.path, crashed)  # as a kill -9 leaves it: no flush at close
    again = LevelDBStateMachine(crashed)
    try:
        assert again.sessions_at == (2 if snapshot else 0) and again.applied()[0] == 7  # (0: as new, nothing flushed)
        again.replay_sessions(opened + later)
        assert {k: [v[0], v[1], v[3]] for k, v in again.sessions.last.items()} == want and list(again.sessions.last) == [1, 2]
        # a copy of the plain put after the restart is still recognised, with its answer
        assert again.apply([in_session(8, 1, 1, c.Put("a", b"1")), in_session(9, 2, 2, c.Put("b", b"2"))]) == [c.PutResult(3), c.PutResult(5)]
        assert again.get("a") == (3, b"1") and again.get("b") == (5, b"2")
    finally:
        again.close()


async def test_a_grant_sent_again_through_another_node_is_the_same_lease(tmp_path):
    from inproc import InprocCluster

    c = InprocCluster(str(tmp_path))
    await c.start()
    try:
        f1, f2 = await c.followers()
        rid = RequestId(await f1.open_session(), 1)
        a = await f1.lease_grant(30, request_id=rid)
        b = await f2.lease_grant(30, request_id=rid)  # a copy, through another node
        assert a.id == b.id and [x.id for x in await f1.lease_list()] == [a.id]
    finally:
        await c.stop()


def test_a_prefix_delete_and_its_copy_in_the_history(sm):
    sm.apply([normal(1, c.SessionOpen(3, 100)), normal(2, c.Put("r/a", b"1")), normal(3, c.Put("r/b", b"2")), normal(4, c.Put("s", b"3"))])
    dp = c.DeletePrefix("r/")
    entries = [in_session(5, 3, 1, c.Txn((), (c.Put("r/c", b"4"),))), in_session(6, 3, 2, dp), in_session(7, 3, 2, dp)]
    res = sm.apply(entries)
    assert res[1] == res[2] == c.PrefixDeleted(6, ("r/a", "r/b", "r/c"))  # the copy answered, not applied again
    assert sm.scan("") == [("s", b"3", 4)]
    events, _ = sm.history_changes(5, "r/", 1000)
    assert [e[:3] for e in events] == [(5, "r/c", b"4"), (6, "r/a", None), (6, "r/b", None), (6, "r/c", None)]


async def test_a_token_opens_a_bounded_number_of_sessions_and_cannot_evict_everyone_elses(tmp_path, monkeypatch):
    """Found by an attacker review: a token scoped to a prefix opened 51,000 sessions through
    POST /v1/sessions, evicting every other client's (the admin's retried write was then
    answered SESSION_EXPIRED). A token that is not admin holds at most SESSIONS_PER_OWNER
    of the sessions opened through a node that are still open, those being opened
    included; once they close (here: evicted past --max-sessions), it opens more."""
    from aiohttp.test_utils import TestClient
    from served import ServedNode

    import kv.node
    from kv.http.auth import Grant

    monkeypatch.setattr(kv.node, "SESSIONS_PER_OWNER", 5)
    node = kv.Node(kv.NodeConfig(id="n1", data_dir=str(tmp_path / "n1"), max_sessions=12))
    await node.start()
    await node.wait_leader(timeout=10)
    client = TestClient(ServedNode(node, "fast", tokens={"t": Grant("write", "app/"), "t2": Grant("write", "app/"), "u": Grant("write", "other/"), "a": Grant("admin")}))
    await client.start_server()
    try:
        tenant, same_grant, other, admin = ({"Authorization": f"Bearer {t}"} for t in ("t", "t2", "u", "a"))
        got = await asyncio.gather(*(client.post("/v1/sessions", headers=tenant) for _ in range(8)))  # at once: 5 pass
        assert sorted(r.status for r in got) == [200] * 5 + [503] * 3
        r = await client.post("/v1/sessions", headers=tenant)
        assert r.status == 503 and "reuse a kv.Client" in (await r.json())["error"]["message"]
        for h in (same_grant, other):  # another token's count is its own, with the same grant too
            assert (await client.post("/v1/sessions", headers=h)).status == 200
        for _ in range(12):  # the admin is not counted: its sessions evict the oldest, the tenant's
            assert (await client.post("/v1/sessions", headers=admin)).status == 200
        assert (await client.post("/v1/sessions", headers=tenant)).status == 200
    finally:
        await client.close()
        await node.stop()


async def test_a_tenant_opening_sessions_in_a_loop_evicts_its_own_not_other_clients(tmp_path):
    """Past --max-sessions, the sessions of the token holding the most go first: the admin's
    and another tenant's writes, sent again after the flood, are still known as applied
    (answered as the first time, not SESSION_EXPIRED)."""
    from aiohttp.test_utils import TestClient
    from served import ServedNode

    from kv.http.auth import Grant

    node = kv.Node(kv.NodeConfig(id="n1", data_dir=str(tmp_path / "n1"), max_sessions=12))
    await node.start()
    await node.wait_leader(timeout=10)
    client = TestClient(ServedNode(node, "fast", tokens={"t": Grant("write", "app/"), "u": Grant("write", "other/"), "a": Grant("admin")}))
    await client.start_server()
    try:
        flood, tenant, admin = ({"Authorization": f"Bearer {t}"} for t in ("t", "u", "a"))
        firsts = []
        for h, key in ((admin, "cfg"), (tenant, "other/x")):
            session = (await (await client.post("/v1/sessions", headers=h)).json())["id"]
            h = {**h, "X-Kv-Session": str(session), "X-Kv-Seq": "1", "If-None-Match": "*"}
            r = await client.put(f"/v1/kv/{key}", data=b"1", headers=h)
            assert r.status == 200
            firsts.append((h, key, await r.json()))
        # plain writes at once grow the node's own pool of sessions (found by a review: those
        # were everyone's, so a tenant made "everyone" the largest owner, then evicted it)
        burst = await asyncio.gather(*(client.put(f"/v1/kv/app/{i}", data=b"x", headers=flood) for i in range(10)))
        assert [r.status for r in burst] == [200] * 10 and len(node.sm.sessions.of_owner["node:n1"]) > 2
        for _ in range(40):
            assert (await client.post("/v1/sessions", headers=flood)).status == 200
        assert len(node.sm.sessions) == 12 and node.sm.sessions.evicted > 0
        for h, key, first in firsts:
            again = await client.put(f"/v1/kv/{key}", data=b"1", headers=h)
            assert again.status == 200 and await again.json() == first, await again.text()  # not 412, not SESSION_EXPIRED
    finally:
        await client.close()
        await node.stop()


async def test_owners_are_recorded_only_once_every_member_says_it_applies_them(tmp_path, monkeypatch):
    """A session opened with an owner is a command (opcode 20) a version before owners
    cannot apply: such a replica would not open it and would refuse every write in it that
    the others apply. Until every member says (in the peer handshake) that it applies
    them, sessions are opened without an owner (found by a review)."""
    from inproc import InprocCluster

    cluster = InprocCluster(str(tmp_path))
    await cluster.start()
    try:
        lead = await cluster.leader()
        f1, f2 = await cluster.followers()
        s1 = await f1.open_session(owner="Bearer t")
        assert lead.sm.sessions.last[s1][4].startswith("t:")
        f2.raft.transport.level = 0  # as an earlier version says
        s2 = await f1.open_session(owner="Bearer t")
        await lead.put("k", b"v")  # (a write through the pool)
        assert lead.sm.sessions.last[s2][4] == "" and f1.raft.peers_apply(c.OWNED_SESSIONS) is False
        assert all(s[4] == "" for sid, s in lead.sm.sessions.last.items() if sid != s1)
        import kv.node

        monkeypatch.setattr(kv.node, "SESSIONS_PER_OWNER", 3)  # the per-node cap holds all the same (found by a review)
        await f1.open_session(owner="Bearer t")
        with pytest.raises(kv.Unavailable, match="reuse a kv.Client"):
            await f1.open_session(owner="Bearer t")
    finally:
        await cluster.stop()
