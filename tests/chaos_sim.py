"""Randomized fault schedules for the core simulator (used by tests and the long soak)."""

from __future__ import annotations

from sim import Sim


def chaos_run(seed: int, *, n: int = 3, duration: float = 6000.0, snapshots: bool = False, membership: bool = False) -> Sim:
    """One seeded run: load, crashes, partitions and a lossy network, then heal and check
    that the cluster converges, elects a leader and commits again."""
    sim = Sim(
        n,
        seed=seed,
        drop=0.05,
        dup=0.03,
        delay=(0.2, 8.0),
        snapshot_every=40 if snapshots else 0,
        trailing=5,
        spare=2 if membership else 0,
    )
    rng = sim.rng
    end = sim.now + duration
    while sim.now < end:
        r = rng.random()
        if r < 0.03:
            victim = rng.choice(sim.ids)
            sim.crash(victim)
        elif r < 0.06:
            for nid in sim.ids:
                sim.restart(nid)
        elif r < 0.08:
            sim.isolate(rng.choice(sim.ids))
        elif r < 0.10:
            a, b = rng.sample(sim.ids, 2)
            sim.cut.add((a, b))  # one way only
        elif r < 0.14:
            sim.heal()
        elif membership and r < 0.18:
            sim.change_membership()
        else:
            for _ in range(rng.randrange(1, 4)):
                sim.propose()
        sim.run_for(rng.uniform(1.0, 60.0))
    # Heal everything and check the cluster recovers and agrees.
    sim.heal_all()
    sim.run_for(5000)
    lid = sim.leader()
    if lid is None:
        views = {i: (n.core.role.name, n.core.term, n.core.leader_id, sorted(n.core.membership.voters), sorted(n.core.membership.learners), n.core.commit_index, n.core.log.last_index()) for i, n in sim.nodes.items() if n.up}
        raise AssertionError(f"seed {seed}: no leader after healing: {views}")
    before = len(sim.acked)
    assert sim.propose(b"final"), f"seed {seed}: leader refused a write after healing"
    sim.run_for(3000)
    if len(sim.acked) <= before:
        views = {i: (n.core.role.name, n.core.term, n.core.leader_id, sorted(n.core.membership.voters), sorted(n.core.membership.learners), n.core.commit_index, n.core.log.last_index(), {p: (pr.state.value, pr.match, pr.next) for p, pr in n.core.progress.items()}) for i, n in sim.nodes.items() if n.up}
        raise AssertionError(f"seed {seed}: no commit after healing: {views}")
    sim.check_converged()
    sim.check_acked_durable()
    return sim
