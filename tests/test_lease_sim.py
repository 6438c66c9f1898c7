"""Seeded simulation of lease expiry through leader changes (the pure LeaseDeadlines of
kv/server/lessor.py with the state machine's LeaseTable), thousands of schedules:

- clients grant leases and keep them alive at irregular intervals (some late, some never
  again: dead processes); only the node that leads answers a keepalive (the real one
  confirms it with a read index first);
- the leader sweeps for expired leases and proposes revokes, which commit after a delay
  and only if it still leads then; leaders fail and, after a leaderless gap, another node
  (with its own clock offset) takes over with a higher term.

Checked on every schedule: no lease is revoked earlier than ttl after a keepalive was
acknowledged (a failover included); every lease whose client died is revoked once a leader
stays long enough (leaders that last less than a ttl each keep every lease alive, as in
etcd), no later than
ttl after the later of its last acknowledged keepalive and the last election, plus two
sweeps and a commit delay; a keepalive refused as expired is refused only after the lease's
deadline."""

from __future__ import annotations

import random

import pytest

from kv.server.lessor import SWEEP_S, LeaseDeadlines
from kv.statemachine.lease_table import LeaseTable

NODES = 3
STEP_MS = 5
COMMIT_MS = 40  # longest time a proposed revoke takes to commit
SWEEP_MS = int(SWEEP_S * 1000)


class Sim:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.now = 0  # ms, global time
        self.offset = [self.rng.randrange(0, 10**6) for _ in range(NODES)]  # each node's monotonic clock
        self.deadlines = [LeaseDeadlines() for _ in range(NODES)]
        self.table = LeaseTable()  # the committed state, the same on every node
        self.leader: int | None = 0
        self.term = 1
        self.elected_at = 0
        self.gap_until = 0
        self.next_sweep = SWEEP_MS
        self.pending: list[tuple[int, int, int, int]] = []  # (commit time, lease, proposer, term)
        self.next_id = 1
        self.clients: dict[int, dict] = {}  # lease -> {ttl, next, dies_at, acked}
        self.revoked: dict[int, int] = {}  # lease -> when its revoke committed

    def clock(self, node: int) -> float:
        return (self.now + self.offset[node]) / 1000

    def sync(self, node: int) -> bool:
        return self.deadlines[node].sync(node == self.leader, self.term, self.table, self.clock(node))

    def grant(self) -> None:
        if self.leader is None:
            return
        lease, ttl = self.next_id, self.rng.choice([300, 1000, 2000])
        self.next_id += 1
        self.table.grant(lease, ttl)
        dies = self.now + self.rng.randrange(0, 8000) if self.rng.random() < 0.6 else None
        self.clients[lease] = {"ttl": ttl, "next": self.now + ttl // 3, "dies_at": dies, "acked": self.now, "granted": self.now}

    def keepalive(self, lease: int, c: dict) -> None:
        every = c["ttl"] // 3
        if self.rng.random() < 0.15:  # a slow client: late, possibly past the deadline
            every = self.rng.randrange(c["ttl"] // 2, c["ttl"] * 3 // 2)
        c["next"] = self.now + every
        node = self.leader
        if lease in self.revoked:
            c["dead"] = True  # LEASE_NOT_FOUND: the client learns it lost the lease
            return
        if node is None:
            return
        self.sync(node)
        if self.deadlines[node].renew(lease, c["ttl"], self.clock(node)):
            c["acked"] = self.now
        else:
            deadline = max(c["acked"], self.elected_at) + c["ttl"]
            assert self.now >= deadline, f"lease {lease}: keepalive refused at {self.now} ms, before its deadline {deadline} ms"
            c["dead"] = True  # the client learned it lost the lease; it stops

    def sweep(self) -> None:
        self.next_sweep = self.now + SWEEP_MS
        node = self.leader
        if node is None or not self.sync(node):
            return
        proposed = {p[1] for p in self.pending}
        for lease in self.deadlines[node].expired(self.clock(node)):
            if lease not in proposed:
                self.pending.append((self.now + self.rng.randrange(1, COMMIT_MS + 1), lease, node, self.term))

    def commit(self) -> None:
        due = [p for p in self.pending if p[0] <= self.now]
        self.pending = [p for p in self.pending if p[0] > self.now]
        for _, lease, proposer, term in due:
            if proposer != self.leader or term != self.term or lease not in self.table.ttl_ms:
                continue  # a deposed leader's proposal never commits
            c = self.clients[lease]
            earliest = c["acked"] + c["ttl"]
            assert self.now >= earliest, f"lease {lease} revoked at {self.now} ms, before {earliest} ms (ttl after its last acknowledged keepalive)"
            self.table.revoke(lease)
            self.revoked[lease] = self.now

    def churn(self, calm: bool) -> None:
        if self.leader is not None and not calm and self.rng.random() < 0.002:
            self.leader = None  # crashed or partitioned away
            self.gap_until = self.now + self.rng.randrange(100, 1500)
        elif self.leader is None and self.now >= self.gap_until:
            self.leader = self.rng.randrange(NODES)
            self.term += 1
            self.elected_at = self.now

    def run(self, ms: int) -> None:
        while self.now < ms:
            self.now += STEP_MS
            self.churn(calm=self.now >= ms - 6000)  # a stable leader at the end: liveness
            if self.rng.random() < 0.01 and self.now < ms - 12000:
                self.grant()
            for lease, c in self.clients.items():
                dead = c.get("dead") or (c["dies_at"] is not None and self.now >= c["dies_at"])
                if not dead and self.now >= c["next"]:
                    self.keepalive(lease, c)
            if self.now >= self.next_sweep:
                self.sweep()
            self.commit()

    def check_dead_leases_revoked(self) -> None:
        for lease, c in self.clients.items():
            if c["dies_at"] is not None:
                assert lease in self.revoked, f"lease {lease}: its client died, it was never revoked"


def elections_before(sim_log: list[int], t: int) -> int:
    return max((e for e in sim_log if e <= t), default=0)


@pytest.mark.parametrize("block", range(4))
def test_lease_expiry_through_leader_changes(block):
    for seed in range(block * 250, (block + 1) * 250):
        sim = Sim(seed)
        elections = [0]
        orig = sim.churn

        def churn(calm, sim=sim, orig=orig):
            term = sim.term
            orig(calm)
            if sim.term != term:
                elections.append(sim.now)

        sim.churn = churn
        sim.run(25000)
        sim.check_dead_leases_revoked()
        for lease, at in sim.revoked.items():
            c = sim.clients[lease]
            # Two sweeps: a new lease's deadline starts when the leader's next sweep sees it.
            latest = max(c["acked"], elections_before(elections, at)) + c["ttl"] + 2 * SWEEP_MS + COMMIT_MS + STEP_MS
            assert at <= latest, f"seed {seed}: lease {lease} revoked at {at} ms, later than {latest} ms"
