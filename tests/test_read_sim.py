"""Linearizable reads in the seeded simulator: reads issued at random members (the leader's
own, and followers' batched ReadIndex requests) while messages are dropped, duplicated and
delayed, members crash, restart and are cut off. Each answer must be at least the index of
every write acknowledged before its read was issued, come once, at the member that issued
it; once the network heals, every read of a member still up is answered or failed.
(Adapted from a reviewer's harness. The stale read it found — follower batch numbers that
started over at each restart — is pinned down by test_raft_core's
test_an_answer_meant_for_a_run_before_a_restart_answers_no_read_of_this_one; these runs
did not hit it in 300 seeds.)"""

from __future__ import annotations

import itertools
import random

import pytest
from sim import Sim


def read_run(seed: int, delay: tuple[float, float], steps: int = 400) -> tuple[list, dict]:
    sim = Sim(3, seed=seed, drop=0.05, dup=0.05, delay=delay)
    rng = random.Random(seed * 7 + 1)
    ctxs = itertools.count(1)
    pending: dict[int, tuple[str, int, int]] = {}  # ctx -> (member, its incarnation, index it must reach)
    answered: set[int] = set()
    wrong: list = []

    def on_ready(nid, rd):
        for s in rd.read_states:
            if s.ctx in answered:
                wrong.append(("answered twice", s.ctx))
            answered.add(s.ctx)
            issued = pending.pop(s.ctx, None)
            if issued is not None and issued[0] != nid:
                wrong.append(("answered at another member", s.ctx, issued, nid))
            elif issued is not None and s.index < issued[2]:
                wrong.append(("stale", s.ctx, issued, s.index, sim.now))
        for f in rd.read_failures:
            pending.pop(f.ctx, None)
            answered.add(f.ctx)

    sim.on_ready = on_ready
    for _ in range(steps):
        r = rng.random()
        if r < 0.25:
            sim.propose()
        elif r < 0.6:
            nid = rng.choice([n for n in sim.ids if sim.nodes[n].up])
            node = sim.nodes[nid]
            for _ in range(rng.randint(1, 3)):
                ctx = next(ctxs)
                pending[ctx] = (nid, node.incarnation, max(sim.acked.values(), default=0))
                node.core.read_index(ctx, sim.now)
            if rng.random() < 0.5:
                sim._process(node)
        elif r < 0.63:
            nid = rng.choice(sim.ids)
            if all(n.up for n in sim.nodes.values()):
                sim.crash(nid)
        elif r < 0.68:
            for n in sim.ids:
                sim.restart(n)
        elif r < 0.70:
            sim.isolate(rng.choice(sim.ids))
        elif r < 0.75:
            sim.heal()
        sim.run_for(rng.uniform(0, 60))
    sim.heal_all()
    sim.run_for(10_000)
    stuck = {c: p for c, p in pending.items() if sim.nodes[p[0]].up and sim.nodes[p[0]].incarnation == p[1]}
    return wrong, stuck


@pytest.mark.parametrize("delay", [(0.5, 5.0), (200.0, 900.0)], ids=["short-delays", "long-delays"])
def test_reads_are_never_stale_and_always_end(delay):
    for seed in range(40):
        wrong, stuck = read_run(seed, delay)
        assert not wrong, (seed, wrong[:5])
        assert not stuck, (seed, list(stuck.items())[:5])


@pytest.mark.soak
@pytest.mark.timeout(0)
def test_reads_soak():
    for seed in range(1_000, 3_000):
        wrong, stuck = read_run(seed, (200.0, 900.0) if seed % 2 else (0.5, 5.0))
        assert not wrong and not stuck, (seed, wrong[:5], list(stuck.items())[:5])
