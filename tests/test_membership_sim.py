"""Membership changes that cannot lose the quorum, on the pure core through the simulator:
new members join as learners, the leader promotes those that asked once they have caught
up, and a change whose voters would lack a reachable, caught-up majority is refused
(etcd's strict reconfiguration check). The random schedules of test_raft_sim.py run the
same rules under faults."""

from __future__ import annotations

import pytest
from sim import Sim

from kv.raft.errors import ConfigChangeRefused
from kv.raft.membership import Member, id_order


def elected(sim: Sim) -> str:
    sim.run_for(5000)
    lid = sim.leader()
    assert lid is not None
    return lid


def change(sim: Sim, new) -> None:
    """Propose a change on the leader and let it commit."""
    lid = sim.leader()
    sim.nodes[lid].core.propose_config(new, sim.now)
    sim.run_for(1000)


def membership(sim: Sim):
    return sim.nodes[sim.leader()].core.membership


def test_a_new_member_never_joins_as_a_voter():
    sim = Sim(3, seed=1, spare=1)
    lid = elected(sim)
    core = sim.nodes[lid].core
    with pytest.raises(ConfigChangeRefused, match="must join as a learner"):
        core.propose_config(core.membership.with_member(Member("n4", "sim:n4", voter=True)), sim.now)


def test_unreachable_members_asked_as_voters_stay_learners_and_the_cluster_commits():
    # The attack that wedged a cluster: three voters added at addresses nobody answers.
    sim = Sim(3, seed=2, spare=3)
    for nid in ("n4", "n5", "n6"):
        sim.crash(nid)
    elected(sim)
    for nid in ("n4", "n5", "n6"):
        change(sim, membership(sim).with_member(Member(nid, f"sim:{nid}", voter=False, promote=True)))
    sim.run_for(3000)
    m = membership(sim)
    assert m.voters == {"n1", "n2", "n3"} and m.learners == {"n4", "n5", "n6"}
    before = len(sim.acked)
    assert sim.propose(b"still-writable")
    sim.run_for(1000)
    assert len(sim.acked) > before
    # One of them comes up: it catches up and the leader promotes it on its own.
    sim.restart("n4")
    sim.run_for(5000)
    m = membership(sim)
    assert m.voters == {"n1", "n2", "n3", "n4"} and not m.get("n4").promote
    assert m.learners == {"n5", "n6"}
    sim.check_converged()


def test_a_removal_that_leaves_no_reachable_majority_is_refused():
    sim = Sim(3, seed=3)
    lid = elected(sim)
    down, up = [i for i in sim.ids if i != lid]
    sim.crash(down)
    sim.run_for(2000)
    core = sim.nodes[lid].core
    # Voters {lid, down} would need both; only the leader answers.
    with pytest.raises(ConfigChangeRefused, match="only 1 of them"):
        core.propose_config(core.membership.without(up), sim.now)
    # Removing the dead member keeps {lid, up}: both reachable.
    change(sim, core.membership.without(down))
    assert membership(sim).voters == {lid, up}
    assert sim.propose(b"after")


def test_with_a_minority_down_a_caught_up_learner_is_still_promoted_and_dead_voters_removed():
    sim = Sim(5, seed=4, spare=1)
    lid = elected(sim)
    others = [i for i in sim.ids[:5] if i != lid]
    sim.crash(others[0])
    sim.crash(others[1])
    change(sim, membership(sim).with_member(Member("n6", "sim:n6", voter=False, promote=True)))
    sim.run_for(3000)
    # 6 voters need 4: the leader, two live followers and n6 are 4.
    assert "n6" in membership(sim).voters
    for dead in others[:2]:
        change(sim, membership(sim).without(dead))
    assert membership(sim).voters == {lid, others[2], others[3], "n6"}
    assert sim.propose(b"after")
    sim.run_for(1000)
    sim.check_converged()


def test_a_leader_that_steps_down_before_its_own_removal_commits_still_finishes_it():
    """The leader removes itself, the only voter left never gets the entry, and check quorum
    deposes the leader. That voter's log is shorter, so the old leader refuses it its vote:
    only the old leader, a voter of the committed configuration, can finish the change
    (dissertation §4.2.2). It used to stay a follower, and the cluster had no leader ever
    again (found by the membership soak, seed 100905)."""
    sim = Sim(2, seed=5)
    lid = elected(sim)
    other = next(i for i in sim.ids if i != lid)
    sim.cut.add((lid, other))
    sim.nodes[lid].core.propose_config(membership(sim).without(lid), sim.now)
    sim.run_for(3000)
    assert sim.leader() is None
    sim.heal()
    sim.run_for(5000)
    assert sim.leader() == other and membership(sim).voters == {other}
    assert sim.propose(b"after")
    sim.run_for(1000)
    sim.check_converged()


def test_a_member_is_replaced_only_when_it_joined_from_another_data_dir():
    from kv.raft.membership import Membership

    m = Membership.of([Member("n1", "a:1"), Member("n2", "a:2", ledger="11" * 8)])
    assert not m.replaced("n1", "22" * 8) and not m.replaced("n1", "")  # a founding member: any data dir
    assert not m.replaced("n2", "11" * 8)  # the one that joined
    assert m.replaced("n2", "22" * 8)  # its old data dir, or another
    assert m.replaced("n2", "")  # or a version before ledger ids, on whatever data dir
    assert not m.replaced("n9", "22" * 8)  # not a member: is_member's to refuse
    assert Membership.decode(m.encode()) == m  # the record survives the log and the snapshots
    # A voter turns its old data dir away; a learner, catching up from entries older than
    # the peer's latest join perhaps, lets it in (a joining node refused the leader so, for good).
    m = m.with_member(Member("n3", "a:3", voter=False))
    assert m.refuses_as_replaced("n1", "n2", "22" * 8) and not m.refuses_as_replaced("n1", "n2", "11" * 8)
    assert not m.refuses_as_replaced("n3", "n2", "22" * 8)


def test_a_configuration_log_started_from_a_joined_membership_passes_over_older_entries():
    """A node that joined starts from the committed configuration whose entry is at `since`;
    the log it then receives from the start (or from an older snapshot) holds older
    configurations, which must not replace it (they may name its leader's earlier data
    dir, which it then refuses). Entries after `since` do, and can be truncated back."""
    from kv.raft.membership import ConfigLog, Membership

    given = Membership.of([Member("n1", "a", ledger="1" * 16), Member("n2", "b"), Member("n3", "c", voter=False)])
    older = Membership.of([Member("n1", "a", ledger="2" * 16), Member("n2", "b")])
    log = ConfigLog(given, since=9)
    log.append(4, older)
    assert (log.latest, log.index, log.committed_index) == (given, 9, 9)
    assert not log.restore(older, 6)  # a snapshot from before the join
    assert (log.latest, log.committed, log.index) == (given, given, 9)
    newer = given.with_member(Member("n3", "c"))
    log.append(12, newer)
    assert (log.latest, log.index, log.committed) == (newer, 12, given)
    assert log.truncate(12) and (log.latest, log.index) == (given, 9)
    log.append(12, newer)
    assert log.commit(12) and (log.committed, log.committed_index) == (newer, 12)
    assert log.restore(older, 30) and (log.latest, log.index) == (older, 30)


def test_members_are_listed_with_the_numbers_in_their_ids_as_numbers():
    ids = ["n10", "n2", "db-3", "n1", "10", "n2b", "db-12"]
    assert sorted(ids, key=id_order) == ["10", "db-3", "db-12", "n1", "n2", "n2b", "n10"]
