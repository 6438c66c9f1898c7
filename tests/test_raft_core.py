"""Scenario tests of the pure core: one claim of the Raft paper or one DLedger behaviour
each. The simulator (tests/sim.py) runs the cores with a deterministic network and clock."""

from __future__ import annotations

import pytest
from sim import Sim

from kv.raft import quorum
from kv.raft.core import CoreConfig, RaftCore
from kv.raft.errors import CommittedEntryConflict, NotLeader, TransferInProgress
from kv.raft.log import MemoryStorage
from kv.raft.membership import Member, Membership
from kv.raft.messages import (
    Entry,
    EntryKind,
    HardState,
    HeartbeatCode,
    HeartbeatRequest,
    HeartbeatResponse,
    InstallSnapshotRequest,
    PushCode,
    PushRequest,
    PushResponse,
    PushType,
    ReadIndexRequest,
    ReadIndexResponse,
    Role,
    SnapshotMeta,
    TimeoutNow,
    VoteRequest,
    VoteResponse,
    VoteResult,
    superseded_acks_dropped,
)

MEMBERS = Membership.of(Member(i, f"sim:{i}") for i in ("n1", "n2", "n3"))


def make_core(node="n1", term=0, vote=None, log_terms=(), now=0.0, **cfg) -> RaftCore:
    """A core whose ledger holds entries with the given terms at indexes 1, 2, ..."""
    storage = MemoryStorage()
    storage.write(1, [Entry(i + 1, t, EntryKind.NORMAL, b"x") for i, t in enumerate(log_terms)])
    return RaftCore(CoreConfig(node_id=node, **cfg), storage, HardState(term, vote), MEMBERS, 0, now, seed=1)


def all_messages(core: RaftCore):
    rd = core.ready()
    return rd, rd.messages + rd.persisted_messages


def vote(core: RaftCore, **kw) -> VoteResponse:
    req = dict(src="n2", dst=core.id, term=1, ledger_end_index=0, ledger_end_term=0)
    req.update(kw)
    core.step(VoteRequest(**req), core._now)
    _, msgs = all_messages(core)
    (resp,) = [m for m in msgs if isinstance(m, VoteResponse)]
    return resp


def elected(sim: Sim, within: float = 5000) -> str:
    sim.run_for(within)
    lid = sim.leader()
    assert lid is not None
    return lid


# --- quorum arithmetic -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "marks, voters, expected",
    [
        ({"a": 5}, "a", 5),
        ({"a": 5, "b": 3, "c": 1}, "abc", 3),  # the median of the watermarks
        ({"a": 5, "b": 5, "c": 1}, "abc", 5),
        ({"a": 9, "b": 7, "c": 2, "d": 1}, "abcd", 2),  # 4 voters need 3
        ({"a": 9, "b": 7, "c": 6, "d": 1, "e": 0}, "abcde", 6),
        ({"a": 9}, "abc", 0),  # b and c never answered
        ({"a": 9, "x": 8, "y": 7}, "abc", 0),  # x and y are learners: they do not count
    ],
)
def test_committed_index_is_the_median_watermark(marks, voters, expected):
    assert quorum.committed_index(marks, frozenset(voters)) == expected


def test_vote_outcome():
    v = frozenset({"a", "b", "c"})
    assert quorum.vote_outcome({"a"}, set(), v) is quorum.VoteOutcome.PENDING
    assert quorum.vote_outcome({"a", "b"}, set(), v) is quorum.VoteOutcome.WON
    assert quorum.vote_outcome({"a"}, {"b", "c"}, v) is quorum.VoteOutcome.LOST
    assert quorum.vote_outcome({"a", "x"}, set(), v) is quorum.VoteOutcome.PENDING  # non-voter


# --- election --------------------------------------------------------------------------------


def test_nodes_start_as_followers_and_elect_one_leader():
    """Reference: section 5.2 — servers start as followers; one leader per term."""
    sim = Sim(3, seed=3)
    assert all(n.core.role == Role.FOLLOWER for n in sim.nodes.values())
    lid = elected(sim)
    others = [n for n in sim.nodes.values() if n.id != lid]
    assert all(n.core.role == Role.FOLLOWER and n.core.leader_id == lid for n in others)


def test_vote_grant_is_persisted_before_it_is_sent():
    """Term and vote reach the disk before the grant leaves (Figure 2, 'Persistent state')."""
    core = make_core()
    core.step(VoteRequest("n2", "n1", 1, 0, 0), 0.0)
    rd = core.ready()
    assert rd.hard_state == HardState(1, "n2")
    assert not rd.messages
    (resp,) = rd.persisted_messages
    assert resp.result == VoteResult.ACCEPT and resp.term == 1


def test_vote_codes():
    # never a member, and no further ahead than we are
    assert vote(make_core(), src="n9").result == VoteResult.REJECT_UNKNOWN_LEADER
    # never seen, but with a longer log: we lag behind the change that added it
    assert vote(make_core(), src="n9", ledger_end_index=5, ledger_end_term=1).result == VoteResult.ACCEPT
    # a request that claims to come from ourselves
    assert vote(make_core(), src="n1").result == VoteResult.REJECT_UNEXPECTED_LEADER
    # older term
    assert vote(make_core(term=5), term=4).result == VoteResult.REJECT_EXPIRED_VOTE_TERM
    # already voted for n3 in this term, no leader known
    assert vote(make_core(term=2, vote="n3"), term=2).result == VoteResult.REJECT_ALREADY_VOTED
    # candidate's last entry has an older term
    assert (
        vote(make_core(term=3, log_terms=(1, 3)), term=4, ledger_end_index=5, ledger_end_term=2).result
        == VoteResult.REJECT_EXPIRED_LEDGER_TERM
    )
    # same last term, shorter log
    assert (
        vote(make_core(term=3, log_terms=(1, 3, 3)), term=4, ledger_end_index=2, ledger_end_term=3).result
        == VoteResult.REJECT_SMALL_LEDGER_END_INDEX
    )
    # a term below our last entry's term: only reachable with a hard state that lags the log
    assert (
        vote(make_core(term=3, log_terms=(5,)), term=4, ledger_end_index=9, ledger_end_term=5).result
        == VoteResult.REJECT_TERM_SMALL_THAN_LEDGER
    )
    assert vote(make_core(term=1), term=2, ledger_end_index=0).result == VoteResult.ACCEPT


def test_vote_rejected_while_following_a_live_leader():
    """Leader lease (etcd inLease, thesis §9.6): a follower that heard from its leader within
    the election timeout does not vote for a disruptive candidate, nor adopt its term."""
    core = make_core(term=2)
    core.step(HeartbeatRequest("n2", "n1", 2, 0, 1), 10.0)
    core.ready()
    resp = vote(core, src="n3", term=3, ledger_end_index=0)
    assert resp.result == VoteResult.REJECT_ALREADY_HAS_LEADER
    assert core.term == 2 and core.leader_id == "n2"
    # A vote in the same term from someone else while we follow a leader.
    core2 = make_core(term=2, vote="n2")
    core2.step(HeartbeatRequest("n2", "n1", 2, 0, 1), 10.0)
    core2.ready()
    assert vote(core2, src="n3", term=2).result == VoteResult.REJECT_ALREADY_HAS_LEADER


def test_taking_leadership_rejects_other_candidates():
    """DLedger's REJECT_TAKING_LEADERSHIP: the transferee campaigns and refuses others."""
    core = make_core(term=2, log_terms=(2,))
    core.step(HeartbeatRequest("n2", "n1", 2, 0, 1), 10.0)
    core.ready()
    core.step(TimeoutNow("n2", "n1", 2), 20.0)
    assert core.role == Role.CANDIDATE and core.term == 3
    core.ready()
    # A competing candidate with a higher term but no better log cannot disrupt the transfer.
    resp = vote(core, src="n3", term=4, ledger_end_index=1, ledger_end_term=2)
    assert resp.result == VoteResult.REJECT_TAKING_LEADERSHIP
    assert core.term == 3 and core.role == Role.CANDIDATE
    # One with a longer log may still win: leader completeness comes first.
    assert vote(core, src="n3", term=4, ledger_end_index=2, ledger_end_term=2).result == VoteResult.ACCEPT


def test_heartbeat_codes():
    def beat(core, **kw):
        m = dict(src="n2", dst=core.id, term=2, commit_index=0, read_seq=7)
        m.update(kw)
        core.step(HeartbeatRequest(**m), 5.0)
        _, msgs = all_messages(core)
        (r,) = [x for x in msgs if isinstance(x, HeartbeatResponse)]
        return r

    # An id never seen in any configuration, at a term whose leader we follow: refused.
    follower = make_core(term=2)
    beat(follower)  # follows n2 in term 2
    assert beat(follower, src="n9").code == HeartbeatCode.UNKNOWN_MEMBER
    # ... but a newer term shows that we are behind (a member added while we lagged).
    assert beat(make_core(term=2), src="n9", term=3).code == HeartbeatCode.SUCCESS
    r = beat(make_core(term=3))
    assert r.code == HeartbeatCode.EXPIRED_TERM and r.term == 3
    core = make_core(term=2)
    r = beat(core)
    assert r.code == HeartbeatCode.SUCCESS and r.read_seq == 7 and core.leader_id == "n2"
    # The same term but another leader: must not happen; reported, not followed.
    assert beat(core, src="n3").code == HeartbeatCode.INCONSISTENT_LEADER
    # A higher term is adopted at once (Raft), not answered with TERM_NOT_READY (DLedger).
    core = make_core(term=1)
    assert beat(core, term=4).code == HeartbeatCode.SUCCESS and core.term == 4


def test_prevote_keeps_a_returning_node_from_deposing_the_leader():
    """Thesis §9.6: a node cut off from the cluster times out again and again, but with
    pre-vote its term does not grow, so when it returns the leader stays."""
    sim = Sim(3, seed=5)
    lid = elected(sim)
    term = sim.nodes[lid].core.term
    loner = next(i for i in sim.ids if i != lid)
    sim.isolate(loner)
    sim.run_for(5000)
    assert sim.nodes[loner].core.term == term  # pre-votes failed, no term bump
    sim.heal()
    sim.run_for(2000)
    assert sim.leader() == lid and sim.nodes[lid].core.term == term


def test_check_quorum_makes_an_isolated_leader_step_down():
    """etcd CheckQuorum / DLedger maxHeartBeatLeak: a leader that hears from no majority
    within an election timeout steps down."""
    sim = Sim(3, seed=6)
    lid = elected(sim)
    sim.isolate(lid)
    sim.run_for(sim.config["election_timeout_ms"] * 2.5)
    assert sim.nodes[lid].core.role != Role.LEADER
    assert sim.leader() not in (None, lid)


# --- replication -----------------------------------------------------------------------------


def test_no_commit_without_a_majority():
    """Section 5.3: an entry is committed once stored on a majority, not before."""
    sim = Sim(3, seed=7)
    lid = elected(sim)
    leader = sim.nodes[lid].core
    before = leader.commit_index
    for other in sim.ids:
        if other != lid:
            sim.cut.add((lid, other))
    sim.propose(b"lonely")
    sim.run_for(400)  # less than the check-quorum period
    assert leader.commit_index == before
    assert b"lonely" not in sim.acked


def test_only_current_term_entries_commit_by_counting():
    """Section 5.4.2 / Figure 8: a replica count alone does not commit an earlier term's
    entry; the leader's own no-op must reach a majority first."""
    storage = MemoryStorage()
    storage.write(1, [Entry(1, 1, EntryKind.NORMAL, b"a"), Entry(2, 1, EntryKind.NORMAL, b"b")])
    core = RaftCore(CoreConfig("n1", pre_vote=False), storage, HardState(1, None), MEMBERS, 0, 0.0, seed=1)
    core.campaign(0.0)
    core.step(VoteResponse("n2", "n1", 2, VoteResult.ACCEPT), 1.0)
    assert core.role == Role.LEADER
    rd = core.ready()
    core.on_persisted(rd)  # the no-op (index 3) is on the leader's disk
    seq = core.progress["n2"].seq
    core.step(PushResponse("n2", "n1", 2, PushType.COMPARE, seq, PushCode.SUCCESS, index=2, end_index=2), 2.0)
    assert core.commit_index == 0  # index 2 (term 1) is on a majority, yet not committed
    seq = core.progress["n2"].seq
    core.step(PushResponse("n2", "n1", 2, PushType.APPEND, seq, PushCode.SUCCESS, index=3, end_index=3), 3.0)
    assert core.commit_index == 3  # the no-op of term 2 commits, and 1..2 with it


def test_a_follower_answers_the_append_frames_of_one_write_with_one_ack():
    """Acks are cumulative: of the APPEND acks a follower persists in one write, only the
    highest to each leader and stream is sent (superseded_acks_dropped), and that one alone
    moves the leader's match and frees its in-flight window for every frame it covers."""
    follower = make_core("n2", term=2, log_terms=(2,))
    e = [Entry(i, 2, EntryKind.NORMAL, b"v%d" % i) for i in (2, 3, 4)]
    follower.step(PushRequest("n1", "n2", 2, PushType.APPEND, 5, 1, 2, e[:1], 1), 1.0)
    follower.step(PushRequest("n1", "n2", 2, PushType.APPEND, 5, 2, 2, e[1:], 1), 1.0)
    rd = follower.ready()
    acks = [m for m in rd.persisted_messages if isinstance(m, PushResponse)]
    assert [a.index for a in acks] == [2, 4]
    assert superseded_acks_dropped(rd.persisted_messages) == acks[1:]
    # Other streams (another seq, a failure, a COMPARE answer) and other messages are kept.
    other = [
        HeartbeatResponse("n2", "n1", 2, HeartbeatCode.SUCCESS, 3),
        PushResponse("n2", "n1", 2, PushType.APPEND, 6, PushCode.SUCCESS, index=3),
        PushResponse("n2", "n1", 2, PushType.APPEND, 5, PushCode.INCONSISTENT_STATE, index=1),
        PushResponse("n2", "n1", 2, PushType.COMPARE, 5, PushCode.SUCCESS, index=1),
    ]
    assert superseded_acks_dropped(acks + other) == acks[1:] + other

    leader = make_core("n1", term=1, log_terms=(1,), pre_vote=False)
    leader.campaign(0.0)
    leader.step(VoteResponse("n2", "n1", 2, VoteResult.ACCEPT), 1.0)
    leader.on_persisted(leader.ready())
    pr = leader.progress["n2"]
    leader.step(PushResponse("n2", "n1", 2, PushType.COMPARE, pr.seq, PushCode.SUCCESS, index=1, end_index=1), 2.0)
    for k in range(3):  # each after the last one's hold (append_hold_ms): one APPEND each
        leader.propose([(EntryKind.NORMAL, b"w%d" % k)], 3.0 + 10 * k)
        leader.on_persisted(leader.ready())
    assert len(pr.inflight) == 3 and leader.commit_index < 5
    leader.step(PushResponse("n2", "n1", 2, PushType.APPEND, pr.seq, PushCode.SUCCESS, index=5, end_index=5), 30.0)
    assert not pr.inflight and pr.match == 5 and leader.commit_index == 5


def _leading_with_n2_in_step(**cfg) -> RaftCore:
    """A leader of term 2 whose follower n2 has matched its log (APPEND state), n3 silent."""
    leader = make_core("n1", term=1, log_terms=(1,), pre_vote=False, **cfg)
    leader.campaign(0.0)
    leader.step(VoteResponse("n2", "n1", 2, VoteResult.ACCEPT), 1.0)
    leader.on_persisted(leader.ready())
    pr = leader.progress["n2"]
    leader.step(PushResponse("n2", "n1", 2, PushType.COMPARE, pr.seq, PushCode.SUCCESS, index=1, end_index=1), 2.0)
    leader.on_persisted(leader.ready())  # the no-op (index 2) goes out to n2
    return leader


def _appends_to_n2(leader: RaftCore) -> list[list[int]]:
    rd = leader.ready()
    leader.on_persisted(rd)
    msgs = rd.messages + rd.persisted_messages
    return [[e.index for e in m.entries] for m in msgs if isinstance(m, PushRequest) and m.dst == "n2" and m.type == PushType.APPEND]


def test_a_partial_append_waits_for_the_one_in_flight_and_goes_out_whole():
    """Nagle's rule (CoreConfig.append_hold_ms): while an APPEND is in flight, what is
    proposed meanwhile is held and goes out as one APPEND when the ack comes, or when the
    hold runs out; full batches do not wait."""
    leader = _leading_with_n2_in_step(append_hold_ms=5.0)
    pr = leader.progress["n2"]
    assert [(f.first, f.last) for f in pr.inflight] == [(2, 2)]
    for k in range(3):
        leader.propose([(EntryKind.NORMAL, b"w%d" % k)], 3.0)
        assert _appends_to_n2(leader) == []  # held: the no-op's APPEND is in flight
    assert pr.hold_due == 2.0 + 5.0 and leader.next_deadline() == 2.0 + 5.0  # the node wakes up for the hold's end
    leader.step(PushResponse("n2", "n1", 2, PushType.APPEND, pr.seq, PushCode.SUCCESS, index=2, end_index=2), 4.0)
    assert _appends_to_n2(leader) == [[3, 4, 5]]  # the ack sends the three as one
    assert pr.hold_due is None

    leader.propose([(EntryKind.NORMAL, b"w3")], 5.0)
    assert _appends_to_n2(leader) == []
    leader.tick(8.9)  # the APPEND of 3..5 went out at 4.0: held until 9.0
    assert _appends_to_n2(leader) == []
    leader.tick(9.0)
    assert _appends_to_n2(leader) == [[6]]  # no ack came in time: it goes out anyway
    assert [(f.first, f.last) for f in pr.inflight] == [(3, 5), (6, 6)]


def test_full_append_batches_pipeline_past_the_one_in_flight():
    leader = _leading_with_n2_in_step(append_hold_ms=5.0, max_batch_entries=2)
    leader.propose([(EntryKind.NORMAL, b"w%d" % k) for k in range(5)], 3.0)  # indexes 3..7
    assert _appends_to_n2(leader) == [[3, 4], [5, 6]]  # full ones go; [7] waits
    leader.step(PushResponse("n2", "n1", 2, PushType.APPEND, leader.progress["n2"].seq, PushCode.SUCCESS, index=6, end_index=6), 4.0)
    assert _appends_to_n2(leader) == [[7]]
    leader.propose([(EntryKind.NORMAL, b"w%d" % k) for k in (5, 6)], 4.5)  # exactly full, and the end of the log
    assert _appends_to_n2(leader) == [[8, 9]]


def test_a_held_append_goes_out_after_any_reset_and_not_at_all_with_no_hold():
    leader = _leading_with_n2_in_step(append_hold_ms=0.0)
    leader.propose([(EntryKind.NORMAL, b"w")], 3.0)
    assert _appends_to_n2(leader) == [[3]]  # 0: no hold, as before Nagle's rule
    for reset in ("repush", "reconnect"):
        leader = _leading_with_n2_in_step(append_hold_ms=5.0)
        pr = leader.progress["n2"]
        leader.propose([(EntryKind.NORMAL, b"w")], 3.0)
        assert _appends_to_n2(leader) == [] and pr.hold_due == 7.0
        if reset == "repush":
            leader.tick(2.0 + 1000.0)  # push timeout: send again from the match point
        else:
            leader.peer_connected("n2", 3.5)
        assert _appends_to_n2(leader) == [[2, 3]] and pr.hold_due is None, reset


def test_follower_with_longer_uncommitted_log_is_truncated():
    """Section 5.3 / Figure 7: the leader forces followers' logs to duplicate its own;
    conflicting uncommitted entries are cut (DLedger: COMPARE, then TRUNCATE)."""
    sim = Sim(3, seed=8)
    lid = elected(sim)
    follower = next(i for i in sim.ids if i != lid)
    # The leader writes entries only one follower never sees.
    for other in sim.ids:
        if other not in (lid, follower):
            sim.cut.add((lid, other))
            sim.cut.add((other, lid))
    sim.cut.add((lid, follower))
    for k in range(5):
        sim.propose(b"orphan%d" % k)
    sim.run_for(50)
    assert sim.nodes[lid].core.log.last_index() >= 6
    sim.crash(lid)  # its extra entries were never committed
    sim.heal()
    sim.run_for(3000)
    new = sim.leader()
    assert new not in (None, lid)
    sim.propose(b"after")
    sim.run_for(500)
    sim.restart(lid)
    sim.run_for(3000)
    old_log = sim.nodes[lid].core.log
    new_log = sim.nodes[new].core.log
    assert old_log.last_index() == new_log.last_index()
    for i in range(1, new_log.last_index() + 1):
        assert old_log.term(i) == new_log.term(i)
    assert not any(d.startswith(b"orphan") for _, _, d in sim.nodes[lid].applied)
    sim.check_converged()


def test_lost_pushes_are_pushed_again():
    """DLedger's pendingMap: a batch not acknowledged in time is pushed again."""
    sim = Sim(3, seed=9)
    lid = elected(sim)
    follower = next(i for i in sim.ids if i != lid)
    sim.cut.add((lid, follower))
    for _ in range(20):
        sim.propose()
    sim.run_for(100)
    sim.cut.discard((lid, follower))
    sim.run_for(sim.config["push_timeout_ms"] if "push_timeout_ms" in sim.config else 1500)
    assert sim.nodes[follower].applied_index == sim.nodes[lid].applied_index
    sim.check_converged()


def left_behind(sim: Sim, writes: int) -> tuple[str, str]:
    """Elect a leader, crash a follower, commit `writes` entries without it: (leader, follower)."""
    lid = elected(sim)
    follower = next(i for i in sim.ids if i != lid)
    sim.crash(follower)
    for _ in range(writes):
        sim.propose()
        sim.run_for(2)
    return lid, follower


def test_offline_follower_catches_up():
    sim = Sim(3, seed=10)
    lid, follower = left_behind(sim, 300)
    sim.restart(follower)
    sim.run_for(3000)
    assert sim.nodes[follower].applied_index == sim.nodes[lid].applied_index > 300
    sim.check_converged()


@pytest.mark.parametrize("snapshots, writes", [(False, 20), (True, 20), (True, 0)])
def test_a_follower_that_lost_its_disk_is_caught_up_and_named(snapshots, writes):
    """A follower whose data dir was wiped and started again (the bring-back command after
    rm -rf) answers with an empty ledger. The leader kept its match index and pushed from
    there forever, never falling back to where the follower's ledger ends, nor to a
    snapshot: the node stayed empty and the leader spun. With no writes, the heartbeats
    tell (their commit index is past the follower's log): an idle leader pushes nothing."""
    sim = Sim(3, seed=21, snapshot_every=50 if snapshots else 0, trailing=5)
    lid = elected(sim)
    follower = next(i for i in sim.ids if i != lid)
    for _ in range(120):
        sim.propose()
        sim.run_for(2)
    sim.run_for(500)
    acknowledged = sim.nodes[lid].core.progress[follower].match
    assert acknowledged > 100
    lost = []
    sim.on_ready = lambda nid, rd: lost.extend(rd.lost_entries)
    sim.wipe(follower)
    for _ in range(writes):
        sim.propose()
        sim.run_for(2)
    sim.run_for(3000)
    assert [(x.peer, x.acknowledged, x.holds) for x in lost] == [(follower, acknowledged, 0)]
    assert sim.nodes[follower].applied_index == sim.nodes[lid].applied_index > 120
    assert sim.snapshots_installed == (1 if snapshots else 0)
    sim.check_converged()


def test_what_a_wiped_follower_acknowledged_no_longer_counts_toward_a_commit():
    """Five voters; n-a acknowledged entries the third copy (n-b) does not hold yet, then
    lost its disk. Counting its old match index, n-b's catching up committed entries held
    by two of five, which the next leader need not have."""
    sim = Sim(5, seed=22)
    lid = elected(sim)
    a, b, c, d = (i for i in sim.ids if i != lid)
    for i in (c, d):
        sim.isolate(i)
    for _ in range(10):
        sim.propose()
        sim.run_for(2)
    sim.run_for(300)
    sim.cut.add((lid, b))  # b stops at what it has
    for _ in range(10):
        sim.propose()
        sim.run_for(2)
    sim.run_for(300)
    leader = sim.nodes[lid].core
    held_by_three, held_by_a = sim.nodes[b].core.log.last_index(), leader.progress[a].match
    assert leader.commit_index == held_by_three < held_by_a
    lost = []

    def noticed(nid, rd):
        if rd.lost_entries:  # from now on a cannot catch up: only the leader and b can hold the rest
            lost.extend(rd.lost_entries)
            sim.cut.add((lid, a))

    sim.on_ready = noticed
    sim.wipe(a)
    sim.propose()  # a push that a answers with its empty ledger
    sim.run_for(300)
    assert [x.peer for x in lost] == [a]
    sim.cut.discard((lid, b))
    sim.run_for(1000)
    assert sim.nodes[b].core.log.last_index() > held_by_a  # b holds them now
    assert leader.commit_index == held_by_three  # two copies of five: not committed


def test_a_snapshot_slower_than_the_push_timeout_is_sent_once():
    """A snapshot stream that takes longer than the push timeout (a large state: sending,
    verifying, installing) is not restarted while it runs: restarting it each timeout
    threw away the follower's answer (it carries the old stream's seq) and, once a stream
    took longer than the timeout every time, the follower never caught up."""
    sim = Sim(3, seed=12, snapshot_every=50, trailing=5, snapshot_ms=(3500, 3500))
    lid, follower = left_behind(sim, 200)
    sends = []
    sim.on_ready = lambda nid, rd: sends.extend(s.peer for s in rd.snapshot_sends if s.peer == follower)
    sim.restart(follower)
    sim.run_for(6000)
    assert sim.config.get("push_timeout_ms", 1000.0) < 3500
    assert sim.snapshots_installed >= 1
    assert sends == [follower]
    assert sim.nodes[follower].applied_index == sim.nodes[lid].applied_index > 200
    sim.check_converged()


def test_a_lost_answer_to_a_delivered_snapshot_is_asked_about_not_sent_again():
    """The follower installed the snapshot but its answer was lost (a full link drops it):
    the leader asks where the follower is (COMPARE) instead of streaming it all again."""
    sim = Sim(3, seed=12, snapshot_every=50, trailing=5)
    lid, follower = left_behind(sim, 200)
    sends, lost = [], []
    sim.on_ready = lambda nid, rd: sends.extend(s.peer for s in rd.snapshot_sends if s.peer == follower)
    send = sim._send

    def lose_the_first_install_answer(msg):
        if isinstance(msg, PushResponse) and msg.type == PushType.INSTALL_SNAPSHOT and msg.src == follower and not lost:
            lost.append(msg)
            return
        send(msg)

    sim._send = lose_the_first_install_answer
    sim.restart(follower)
    sim.run_for(6000)
    assert lost and lost[0].code == PushCode.SUCCESS and sim.snapshots_installed == 1
    assert sends == [follower]
    assert sim.nodes[follower].applied_index == sim.nodes[lid].applied_index > 200
    sim.check_converged()


def test_fast_backup_skips_a_conflicting_term_in_one_step():
    """xTerm/xIndex: the follower names its conflicting term and where it starts."""
    storage = MemoryStorage()
    storage.write(1, [Entry(i, 1 if i <= 2 else 2, EntryKind.NORMAL, b"") for i in range(1, 50)])
    f = RaftCore(CoreConfig("n2"), storage, HardState(3, None), MEMBERS, 0, 0.0, seed=1)
    f.step(PushRequest("n1", "n2", 4, PushType.COMPARE, 1, 40, 3), 1.0)
    (resp,) = f.ready().persisted_messages
    assert resp.code == PushCode.INCONSISTENT_STATE and resp.x_term == 2 and resp.x_index == 3


def test_a_new_leader_commits_earlier_entries_without_new_writes():
    """The no-op on election (Raft §8): entries of an earlier term commit although no
    client writes after the leader change."""
    sim = Sim(3, seed=11)
    lid = elected(sim)
    for _ in range(5):
        sim.propose()
    sim.run_for(3)  # replicated perhaps, not yet committed everywhere
    sim.crash(lid)
    sim.run_for(4000)
    new = sim.leader()
    assert new is not None and new != lid
    core = sim.nodes[new].core
    assert core.commit_index == core.log.last_index()
    assert sim.nodes[new].applied_index == core.commit_index


# --- leadership transfer and reads -----------------------------------------------------------


def test_leadership_transfer_catches_up_then_hands_over():
    sim = Sim(3, seed=12)
    lid = elected(sim)
    target = next(i for i in sim.ids if i != lid)
    for _ in range(10):
        sim.propose()
    leader = sim.nodes[lid].core
    leader.transfer_leadership(target, sim.now)
    with pytest.raises(TransferInProgress):
        leader.propose([(EntryKind.NORMAL, b"refused")], sim.now)
    sim._process(sim.nodes[lid])
    sim.run_for(500)
    assert sim.leader() == target
    assert sim.nodes[target].core.term == leader.term
    with pytest.raises(NotLeader):
        leader.propose([(EntryKind.NORMAL, b"x")], sim.now)


def test_read_index_is_confirmed_by_a_heartbeat_round():
    """Thesis §6.4: the leader records its commit index, confirms it still leads with a
    round of heartbeats, then the read may proceed at that index."""
    sim = Sim(3, seed=13)
    lid = elected(sim)
    sim.propose()
    sim.run_for(200)
    leader = sim.nodes[lid].core
    leader.read_index(42, sim.now)
    rd = leader.ready()
    assert not rd.read_states
    hb = [m for m in rd.messages if isinstance(m, HeartbeatRequest)]
    assert len(hb) == 2
    answers = 0
    for m in hb:
        follower = sim.nodes[m.dst].core
        follower.step(m, sim.now)
        for r in follower.ready().messages:
            leader.step(r, sim.now)
            answers += 1
        if answers == 1:
            (rs,) = leader.ready().read_states  # one follower plus us is a majority
            assert rs.ctx == 42 and rs.index == leader.commit_index


def test_reads_arriving_during_a_round_share_the_next_one():
    """One read round in flight at a time: reads that arrive while it is out wait for the
    round after it (never for the one already sent: it may predate a newer leader), and
    share that round instead of sending one each."""
    sim = Sim(3, seed=16)
    lid = elected(sim)
    sim.propose()
    sim.run_for(200)
    leader = sim.nodes[lid].core

    def heartbeats(rd):
        return [m for m in rd.messages if isinstance(m, HeartbeatRequest)]

    leader.read_index(1, sim.now)
    first = heartbeats(leader.ready())
    assert len(first) == 2
    for ctx in (2, 3, 4):  # three more reads, each in its own turn, while round one is out
        leader.read_index(ctx, sim.now)
        assert not leader.has_ready() and not heartbeats(leader.ready())
    f = sim.nodes[first[0].dst].core
    f.step(first[0], sim.now)
    for r in f.ready().messages:
        leader.step(r, sim.now)
    rd = leader.ready()
    assert [s.ctx for s in rd.read_states] == [1]  # round one answers the read it was sent for
    second = heartbeats(rd)
    assert len(second) == 2 and second[0].read_seq > first[0].read_seq  # one round for the three
    f.step(second[0], sim.now)
    for r in f.ready().messages:
        leader.step(r, sim.now)
    assert sorted(s.ctx for s in leader.ready().read_states) == [2, 3, 4]


def reads_answered_at(sim: Sim, nid: str) -> tuple[list, list]:
    """The read states and read failures member nid's Readies give from now on."""
    served, failed = [], []

    def watch(at, rd):
        if at == nid:
            served.extend(rd.read_states)
            failed.extend(rd.read_failures)

    sim.on_ready = watch
    return served, failed


def test_an_isolated_leader_never_serves_a_linearizable_read():
    sim = Sim(3, seed=14)
    lid = elected(sim)
    served, failed = reads_answered_at(sim, lid)
    sim.isolate(lid)
    sim.nodes[lid].core.read_index(7, sim.now)
    sim._process(sim.nodes[lid])
    sim.run_for(3000)
    assert not any(r.ctx == 7 for r in served)
    assert any(f.ctx == 7 for f in failed)  # failed when it stepped down (check quorum)


def test_a_transfer_given_up_leaves_no_lease_to_read_by():
    """A leadership transfer whose TimeoutNow reaches the transferee only after the leader
    gave it up (the transferee paused, a slow link): the transferee then campaigns with the
    transfer's right to set the voters' leases aside and wins, while the old leader, cut off,
    still holds the lease its last heartbeat round earned. A lease read there would be
    stale (found from outside: an acknowledged write, then the old value from the old
    leader with consistency=lease). After a TimeoutNow, the leader's lease is gone for the
    rest of its term."""
    sim, lid, tid = settled_with_a_follower(seed=21)
    leader = sim.nodes[lid].core
    sim.cut.add((lid, tid))  # the TimeoutNow does not arrive (yet)
    leader.transfer_leadership(tid, sim.now)
    sim._process(sim.nodes[lid])
    sim.run_for(leader.cfg.election_timeout_ms + 100)  # past the transfer's deadline: given up
    assert leader.transferee is None and sim.leader() == lid
    sim.cut.clear()
    sim.run_for(200)  # heartbeat rounds confirmed: without the fix, a lease again
    term = leader.term
    sim.isolate(lid)  # the old leader hears nothing from here on
    sim.nodes[tid].core.step(TimeoutNow(lid, tid, term), sim.now)  # the late TimeoutNow
    sim._process(sim.nodes[tid])
    sim.run_for(100)
    new = sim.nodes[tid].core
    assert new.role == Role.LEADER and new.term == term + 1
    new.propose([(EntryKind.NORMAL, b"after")], sim.now)
    sim._process(sim.nodes[tid])
    sim.run_for(50)
    assert new.commit_index > leader.commit_index  # a write the old leader never saw, committed
    served, _ = reads_answered_at(sim, lid)
    leader.read_index(99, sim.now, lease=True)
    sim._process(sim.nodes[lid])
    assert leader.role == Role.LEADER and leader.term == term  # it has not heard yet
    assert not any(r.ctx == 99 for r in served), "a lease read on a leader that handed over"


def settled_with_a_follower(seed: int) -> tuple[Sim, str, str]:
    """A 3-node sim with a leader that has committed an entry, and one of its followers."""
    sim = Sim(3, seed=seed)
    lid = elected(sim)
    sim.propose()
    sim.run_for(200)
    return sim, lid, next(i for i in sim.ids if i != lid)


def test_follower_read_index_asks_the_leader():
    sim, lid, fid = settled_with_a_follower(seed=15)
    states, _ = reads_answered_at(sim, fid)
    sim.nodes[fid].core.read_index(5, sim.now)
    sim._process(sim.nodes[fid])
    sim.run_for(100)
    assert [s.ctx for s in states] == [5]
    assert states[0].index == sim.nodes[lid].core.commit_index


def test_a_followers_reads_ask_the_leader_in_batches():
    """etcd's linearizableReadLoop: one ReadIndex request in flight per follower, for all
    reads that arrived before it went; reads arriving meanwhile wait for the next (the
    answer to the one in flight may predate a write acknowledged before they began)."""
    sim, lid, fid = settled_with_a_follower(seed=17)
    f, leader = sim.nodes[fid].core, sim.nodes[lid].core

    def asks(rd):
        return [m for m in rd.messages if isinstance(m, ReadIndexRequest)]

    for ctx in (1, 2, 3):
        f.read_index(ctx, sim.now)
    (first,) = asks(f.ready())  # one request for the three
    for ctx in (4, 5):  # while it is out
        f.read_index(ctx, sim.now)
        assert not asks(f.ready())
    leader.step(first, sim.now)
    sim._process(sim.nodes[lid])  # the heartbeat round confirming it is answered (the sim delivers it)
    got, _ = reads_answered_at(sim, fid)
    sim.run_for(100)
    assert sorted(s.ctx for s in got) == [1, 2, 3, 4, 5]
    (one,) = {s.index for s in got if s.ctx <= 3}  # the batch's answer is each of its reads'
    assert one == leader.commit_index and all(s.index >= one for s in got)


def test_a_followers_read_request_that_goes_unanswered_is_sent_again():
    """etcd re-sends its ReadIndex on a timer: the reads of a lost request began before
    the next one is sent, so its answer is good for them."""
    sim, lid, fid = settled_with_a_follower(seed=18)
    f = sim.nodes[fid].core
    served, failed = reads_answered_at(sim, fid)
    f.read_index(1, sim.now)
    lost = [m for m in f.ready().messages if isinstance(m, ReadIndexRequest)]
    assert len(lost) == 1  # taken out of the sim: never delivered
    f.read_index(2, sim.now)  # waits behind it
    sim._process(sim.nodes[fid])
    assert f.next_deadline() <= sim.now + f.cfg.election_timeout_ms  # the driver ticks in time to send it again
    sim.run_for(f.cfg.election_timeout_ms + 100)
    assert not failed and sorted(s.ctx for s in served) == [1, 2]


def test_an_answer_meant_for_a_run_before_a_restart_answers_no_read_of_this_one():
    """Found by review: batch numbers that start over at each run let a late answer to the
    crashed run's batch (an older commit index) answer a read of the new run issued after
    a write was acknowledged. They start at random now."""
    sim, lid, fid = settled_with_a_follower(seed=17)
    gid = next(i for i in sim.ids if i not in (lid, fid))
    leader = sim.nodes[lid].core
    sim.isolate(gid)
    held, deliver = [], sim._send

    def send(m):
        if isinstance(m, ReadIndexResponse) and m.dst == fid:
            held.append(m)  # delayed in the network
            return
        deliver(m)

    sim._send = send
    f = sim.nodes[fid].core
    f.read_index(101, sim.now)
    (req,) = [m for m in f.ready().messages if isinstance(m, ReadIndexRequest)]
    before = leader.commit_index
    leader.step(req, sim.now)
    sim.crash(fid)
    sim._process(sim.nodes[lid])
    sim.restart(fid)
    sim.run_for(200)
    (stale,) = held
    assert stale.index == before
    sim.propose(b"W")
    sim.run_for(300)
    written = sim.acked[b"W"]
    assert written > before
    got, _ = reads_answered_at(sim, fid)
    f = sim.nodes[fid].core
    f.read_index(202, sim.now)  # issued after W was acknowledged
    sim._process(sim.nodes[fid])
    f.step(stale, sim.now)
    sim._process(sim.nodes[fid])
    sim._send = deliver
    sim.run_for(300)
    assert [s.ctx for s in got] == [202] and got[0].index >= written


def test_a_followers_reads_fail_when_its_leader_is_gone():
    sim, lid, fid = settled_with_a_follower(seed=19)
    f = sim.nodes[fid].core
    _, failed = reads_answered_at(sim, fid)
    sim.isolate(lid)
    f.read_index(1, sim.now)
    sim._process(sim.nodes[fid])
    f.read_index(2, sim.now)
    sim._process(sim.nodes[fid])
    sim.run_for(5000)  # an election without the old leader
    assert sorted(r.ctx for r in failed) == [1, 2]


def test_single_voter_commits_alone():
    storage = MemoryStorage()
    one = Membership.of([Member("n1", "x")])
    core = RaftCore(CoreConfig("n1"), storage, HardState(0, None), one, 0, 0.0, seed=1)
    core.campaign(0.0)
    assert core.role == Role.LEADER
    core.propose([(EntryKind.NORMAL, b"v")], 1.0)
    rd = core.ready()
    assert rd.applicable_index is None  # nothing is durable yet
    storage.write(rd.entries_from, rd.entries)
    core.on_persisted(rd)
    assert core.ready().applicable_index == 2  # the no-op and the write


def test_the_entry_cache_is_bounded_in_bytes():
    from kv.raft.log import RaftLog

    storage = MemoryStorage()
    log = RaftLog(storage, cache_entries=10_000, cache_bytes=1 << 20)
    for i in range(1, 201):
        e = Entry(i, 1, EntryKind.NORMAL, b"x" * 100_000)  # 20 MB in all
        log.append([e])
        frm, ents = log.take_unpersisted()
        storage.write(frm, ents)
        log.persisted(ents, log.epoch)
    assert log._cache_bytes <= 1 << 20 and log._cache_bytes == sum(len(e.data) for e in log._cache)
    assert log.entries(1, 201, 1 << 40, 1 << 30)[-1].index == 200  # older ones come from storage
    assert [e.index for e in log.entries(1, 3, 1 << 40, 10)] == [1, 2]


def test_a_leader_whose_log_differs_at_a_committed_entry_stops_the_follower():
    """A node whose data dir was put back from an older copy can lead a majority that lacks
    entries another node committed and applied (a fault review lost 150 acknowledged writes
    that way, and the node holding them took the new leader's entries over its own, or
    answered reads from them). Its pushes and snapshots are refused by stopping that node,
    as etcd panics: never overwrite, and never go on serving, what was applied."""

    def applied_four() -> RaftCore:
        storage = MemoryStorage()
        storage.write(1, [Entry(i, 1 if i <= 2 else 2, EntryKind.NORMAL, b"") for i in range(1, 5)])
        return RaftCore(CoreConfig("n2"), storage, HardState(2, None), MEMBERS, 4, 0.0, seed=1)

    # the leader's entry 3 is of term 3, where this node applied one of term 2
    with pytest.raises(CommittedEntryConflict, match=r"node n2: leader n1 \(term 3\) holds an entry of term 3 at index 3, which this node committed and applied with term 2"):
        applied_four().step(PushRequest("n1", "n2", 3, PushType.COMPARE, 1, 3, 3), 1.0)
    with pytest.raises(CommittedEntryConflict, match="at index 4"):
        applied_four().step(PushRequest("n1", "n2", 3, PushType.TRUNCATE, 1, 3, 2, [Entry(4, 3, EntryKind.NORMAL, b"")], 4, 4), 1.0)
    with pytest.raises(CommittedEntryConflict, match="at index 3"):
        applied_four().step(InstallSnapshotRequest("n1", "n2", 3, 1, SnapshotMeta(3, 3, b"")), 1.0)
    # Beyond what it committed, a conflict is Raft's usual one: reported, then cut.
    f = applied_four()
    f.step(PushRequest("n1", "n2", 3, PushType.TRUNCATE, 1, 4, 2, [Entry(5, 3, EntryKind.NORMAL, b"")], 4, 5), 1.0)
    assert f.log.last_index() == 5 and f.commit_index == 4
    # A snapshot it holds, that matches: answered with the snapshot's index, which the
    # leader holds, not this node's commit index
    f = applied_four()
    f.step(InstallSnapshotRequest("n1", "n2", 3, 1, SnapshotMeta(2, 1, b"")), 1.0)
    _, msgs = all_messages(f)
    (resp,) = [m for m in msgs if isinstance(m, PushResponse)]
    assert resp.code == PushCode.SUCCESS and resp.index == 2


def test_a_leader_that_lacks_entries_committed_before_its_term_stops_the_follower():
    """Every leader holds what was committed before its term (Leader Completeness), so a
    leader whose log ends before entries this node committed in an earlier term lost them
    with a majority (a data dir put back). A fault review saw such a node serve
    linearizable reads from them for as long as the leader's log ended before this one's
    start, where no compare reaches. Each push says where the leader's log ends; from a
    version that does not say (0), or past entries of the leader's own term, nothing."""

    def applied_four() -> RaftCore:
        storage = MemoryStorage()
        storage.write(1, [Entry(i, 1 if i <= 2 else 2, EntryKind.NORMAL, b"") for i in range(1, 5)])
        return RaftCore(CoreConfig("n2"), storage, HardState(2, None), MEMBERS, 4, 0.0, seed=1)

    for push in (
        PushRequest("n1", "n2", 3, PushType.COMPARE, 1, 2, 1, (), 0, 2),
        PushRequest("n1", "n2", 3, PushType.APPEND, 1, 2, 1, [Entry(3, 3, EntryKind.NORMAL, b"")], 3, 3),
        PushRequest("n1", "n2", 3, PushType.COMMIT, 1, 0, 0, (), 2, 3),
    ):
        with pytest.raises(CommittedEntryConflict, match=r"leader n1 \(term 3\) holds no entry at index 4, which this node committed"):
            applied_four().step(push, 1.0)
    f = applied_four()  # (a leader that does not say)
    f.step(PushRequest("n1", "n2", 3, PushType.COMPARE, 1, 2, 1), 1.0)
    f = applied_four()  # entries of the leader's term, which a message sent earlier may not cover
    f.step(PushRequest("n1", "n2", 2, PushType.COMPARE, 1, 2, 1, (), 0, 3), 1.0)
    assert f.log.last_index() == 4 and f.commit_index == 4
