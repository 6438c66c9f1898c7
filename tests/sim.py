"""A deterministic simulator for the pure Raft core.

Several `RaftCore`s talk through a simulated network driven by one seeded RNG and a virtual
clock: messages are delayed, reordered, duplicated and dropped; links are cut (one way or
both); nodes crash, losing whatever they had not fsynced, and restart from what they had.
Persistence is asynchronous like the real driver's: a Ready's writes complete after a random
delay, in order, and only then are its persisted_messages sent.

Every event is followed by the safety checks of the Raft paper (Figure 3):
election safety, log matching (via state machine safety), leader completeness, state
machine safety, and commit indexes that never go back.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field

from kv.raft.core import CoreConfig, RaftCore, Ready
from kv.raft.errors import ConfigChangeRefused, NotLeader, TransferInProgress
from kv.raft.log import MemoryStorage
from kv.raft.membership import Member, Membership
from kv.raft.messages import (
    EntryKind,
    HardState,
    InstallSnapshotRequest,
    Role,
    SnapshotMeta,
    superseded_acks_dropped,
)


class InvariantViolation(AssertionError):
    pass


@dataclass
class Snapshot:
    meta: SnapshotMeta
    applied: list[tuple[int, int, bytes]]  # the state: every applied (index, term, data)


@dataclass
class SimNode:
    id: str
    storage: MemoryStorage = field(default_factory=MemoryStorage)
    hard_state: HardState = HardState(0, None)
    # The state machine: applied entries in order; it is durable (like LevelDB + applied
    # index in one WriteBatch), so it survives crashes.
    applied: list[tuple[int, int, bytes]] = field(default_factory=list)
    applied_index: int = 0
    snapshot: Snapshot | None = None
    core: RaftCore | None = None
    up: bool = True
    incarnation: int = 0
    persist_free_at: float = 0.0  # persistence completes in order
    commit_seen: int = 0  # highest commit index of this incarnation
    tick_at: float = float("inf")  # when the next tick event for this incarnation fires
    pending_snapshot: Snapshot | None = None
    applied_membership: Membership | None = None  # as of the applied index (kept by the state machine)


class Sim:
    def __init__(
        self,
        n: int = 3,
        seed: int = 0,
        *,
        drop: float = 0.0,
        dup: float = 0.0,
        delay: tuple[float, float] = (0.5, 5.0),
        persist_delay: tuple[float, float] = (0.1, 3.0),
        config: dict | None = None,
        snapshot_every: int = 0,
        trailing: int = 5,
        snapshot_ms: tuple[float, float] = (1.5, 15.0),
        spare: int = 0,
    ) -> None:
        self.rng = random.Random(seed)
        # n initial voters, plus `spare` nodes that run but are not members until added.
        self.ids = [f"n{i + 1}" for i in range(n + spare)]
        self.membership = Membership.of(Member(i, f"sim:{i}") for i in self.ids[:n])
        self.drop, self.dup, self.delay, self.persist_delay = drop, dup, delay, persist_delay
        self.config = {"heartbeat_ms": 50.0, "election_timeout_ms": 500.0, **(config or {})}
        # snapshot_ms: how long a snapshot stream takes, from the leader's start to the
        # follower holding the whole file (and the leader hearing so).
        self.snapshot_every, self.trailing, self.snapshot_ms = snapshot_every, trailing, snapshot_ms
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.cut: set[tuple[str, str]] = set()
        self.nodes = {i: SimNode(i, applied_membership=self.membership) for i in self.ids}
        self.on_ready = None  # a test may watch every Ready: on_ready(node_id, ready)
        self.config_changes = 0
        self.leaders_by_term: dict[int, str] = {}
        self.committed: dict[int, tuple[int, bytes]] = {}  # index -> (term, data), cluster-wide
        self.acked: dict[bytes, int] = {}  # proposals whose leader applied them: data -> index
        self.proposed = 0
        self.messages_sent = 0
        self.crashes = 0
        self.snapshots_installed = 0
        for i in self.ids:
            self._boot(self.nodes[i])

    # -- nodes ----------------------------------------------------------------------------

    def _boot(self, node: SimNode) -> None:
        node.incarnation += 1
        node.persist_free_at = self.now
        node.commit_seen = 0
        seed = self.rng.randrange(1 << 30)
        cfg = CoreConfig(node_id=node.id, **self.config)
        node.core = RaftCore(cfg, node.storage, node.hard_state, node.applied_membership, node.applied_index, self.now, seed)
        node.up = True
        node.tick_at = float("inf")
        self._arm(node)

    def crash(self, nid: str) -> None:
        node = self.nodes[nid]
        if node.up:
            self.crashes += 1
        node.up = False
        node.core = None
        node.incarnation += 1  # pending persistence and timers of the old life are lost

    def restart(self, nid: str) -> None:
        node = self.nodes[nid]
        if not node.up:
            self._boot(node)

    def wipe(self, nid: str) -> None:
        """The node's disk is lost: it crashes and starts again empty, as at the cluster's
        bootstrap (what a wiped data dir started with the same --peers does). Raft assumes
        this never happens; the leader must at least not go on counting what it lost."""
        self.crash(nid)
        node = self.nodes[nid]
        node.storage, node.hard_state = MemoryStorage(), HardState(0, None)
        node.applied, node.applied_index, node.snapshot = [], 0, None
        node.applied_membership = self.membership
        self._boot(node)

    def isolate(self, nid: str) -> None:
        for other in self.ids:
            if other != nid:
                self.cut.add((nid, other))
                self.cut.add((other, nid))

    def heal(self) -> None:
        self.cut.clear()

    def heal_all(self) -> None:
        """The end of a fault schedule: every link back, every member up, no message lost or
        repeated from now on (delays stay)."""
        self.heal()
        for nid in self.ids:
            self.restart(nid)
        self.drop = self.dup = 0.0

    def leader(self) -> str | None:
        """The leader with the highest term among live nodes, if any."""
        best = None
        for n in self.nodes.values():
            if n.up and n.core.role == Role.LEADER and (best is None or n.core.term > best.core.term):
                best = n
        return best.id if best else None

    # -- clock and events -----------------------------------------------------------------

    def _schedule(self, at: float, event: tuple) -> None:
        heapq.heappush(self._events, (at, next(self._seq), event))

    def run(self, until: float) -> None:
        while self._events and self._events[0][0] <= until:
            at, _, event = heapq.heappop(self._events)
            self.now = max(self.now, at)
            self._handle(event)
        self.now = max(self.now, until)

    def run_for(self, ms: float) -> None:
        self.run(self.now + ms)

    def _handle(self, event: tuple) -> None:
        kind = event[0]
        if kind == "tick":
            _, nid, inc = event
            node = self.nodes[nid]
            if not node.up or node.incarnation != inc:
                return
            if self.now < node.tick_at:
                return  # superseded by an earlier tick that re-armed
            node.tick_at = float("inf")
            node.core.tick(self.now)
            self._process(node)
        elif kind == "deliver":
            _, msg = event
            node = self.nodes[msg.dst]
            if node.up:
                node.core.step(msg, self.now)
                # Like the real driver, step several arrivals before asking for a Ready:
                # messages for the same node due within a short window go in one batch.
                if self.rng.random() < 0.5:
                    window = self.now + self.rng.uniform(0.0, 3.0)
                    later = []
                    while self._events and self._events[0][0] <= window:
                        at, seq, ev = heapq.heappop(self._events)
                        if ev[0] == "deliver" and ev[1].dst == msg.dst:
                            node.core.step(ev[1], self.now)
                        else:
                            later.append((at, seq, ev))
                    for item in later:
                        heapq.heappush(self._events, item)
                self._process(node)
        elif kind == "persisted":
            _, nid, inc, rd = event
            node = self.nodes[nid]
            if node.up and node.incarnation == inc:
                self._complete_persist(node, rd)
        elif kind == "snapshot_arrives":
            # As the snapshot manager does: the follower verifies the whole file and steps
            # the install into its core, then acks the last chunk; the leader's stream ends.
            _, nid, req, snap, src_inc = event
            node, src = self.nodes[nid], self.nodes[req.src]
            if node.up:
                node.pending_snapshot = snap
                node.core.step(req, self.now)
                self._process(node)
            if src.up and src.incarnation == src_inc:
                src.core.report_snapshot(nid, req.seq, node.up, self.now)
                self._process(src)

    def _send(self, msg) -> None:
        self.messages_sent += 1
        if (msg.src, msg.dst) in self.cut or self.rng.random() < self.drop:
            return
        copies = 2 if self.rng.random() < self.dup else 1
        for _ in range(copies):
            self._schedule(self.now + self.rng.uniform(*self.delay), ("deliver", msg))

    # -- the driver's job, simulated -------------------------------------------------------

    def _process(self, node: SimNode) -> None:
        core = node.core
        spins = 0
        while core.has_ready():
            spins += 1
            if spins > 1000:
                raise InvariantViolation(f"{node.id}: has_ready() stays true (the driver would spin forever)")
            rd = core.ready()
            if self.on_ready is not None:
                self.on_ready(node.id, rd)
            self._check_roles(node)
            for m in rd.messages:
                self._send(m)
            if rd.must_persist or rd.persisted_messages:
                done = max(node.persist_free_at, self.now) + self.rng.uniform(*self.persist_delay)
                node.persist_free_at = done
                self._schedule(done, ("persisted", node.id, node.incarnation, rd))
            if rd.applicable_index is not None:
                self._apply(node, rd.applicable_index)
            for s in rd.snapshot_sends:
                self._send_snapshot(node, s.peer, s.seq)
            for rs in rd.read_states:  # (a follower's may be ahead of its own commit index)
                assert core.role != Role.LEADER or rs.index <= core.commit_index
        self._arm(node)

    def _arm(self, node: SimNode) -> None:
        """Like the driver's timer: tick by the core's next deadline (earlier if it moved)."""
        at = max(node.core.next_deadline(), self.now + 1.0)
        if at < node.tick_at:
            node.tick_at = at
            self._schedule(at, ("tick", node.id, node.incarnation))

    def _complete_persist(self, node: SimNode, rd: Ready) -> None:
        if rd.hard_state is not None:
            node.hard_state = rd.hard_state
        if rd.snapshot is not None:
            snap = node.pending_snapshot
            assert snap.meta == rd.snapshot
            node.storage.reset(snap.meta.index, snap.meta.term)
            node.applied = list(snap.applied)
            node.applied_index = snap.meta.index
            node.applied_membership = Membership.decode(snap.meta.membership)
            node.snapshot = snap
            self.snapshots_installed += 1
        if rd.entries_from:
            node.storage.write(rd.entries_from, rd.entries)
        for m in superseded_acks_dropped(rd.persisted_messages):
            self._send(m)
        node.core.on_persisted(rd)
        self._process(node)

    def _apply(self, node: SimNode, upto: int) -> None:
        core = node.core
        while node.applied_index < upto:
            batch = core.log.entries(node.applied_index + 1, upto + 1, 1 << 30, 1 << 30)
            for e in batch:
                prev = self.committed.get(e.index)
                if prev is None:
                    self.committed[e.index] = (e.term, e.data)
                elif prev != (e.term, e.data):
                    raise InvariantViolation(
                        f"state machine safety: {node.id} applies {e.index}/{e.term} but {prev[0]} was committed there"
                    )
                if e.kind == EntryKind.NORMAL:
                    node.applied.append((e.index, e.term, e.data))
                    if core.role == Role.LEADER and e.term == core.term:
                        self.acked[e.data] = e.index
                elif e.kind == EntryKind.CONFIG:
                    node.applied_membership = Membership.decode(e.data)
                node.applied_index = e.index
        if self.snapshot_every and node.applied_index - (node.snapshot.meta.index if node.snapshot else 0) >= self.snapshot_every:
            self._take_snapshot(node)

    def _take_snapshot(self, node: SimNode) -> None:
        core = node.core
        idx = node.applied_index
        meta = SnapshotMeta(idx, core.log.term(idx), node.applied_membership.encode())
        node.snapshot = Snapshot(meta, list(node.applied))
        upto = idx - self.trailing
        if upto > node.storage.before_begin_index and upto <= node.storage.last_index() and upto <= core.log.durable_index:
            node.storage.compact(upto, node.storage.term(upto))
            core.compacted(upto, node.storage.before_begin_term)

    def _send_snapshot(self, node: SimNode, peer: str, seq: int) -> None:
        snap = node.snapshot
        core = node.core
        if snap is None or (node.id, peer) in self.cut or self.rng.random() < self.drop:
            core.report_snapshot(peer, seq, False, self.now)
            return
        req = InstallSnapshotRequest(node.id, peer, core.term, seq, snap.meta)
        self._schedule(self.now + self.rng.uniform(*self.snapshot_ms), ("snapshot_arrives", peer, req, snap, node.incarnation))

    # -- clients --------------------------------------------------------------------------

    def propose(self, data: bytes | None = None) -> bool:
        lid = self.leader()
        if lid is None:
            return False
        node = self.nodes[lid]
        data = data if data is not None else b"v%d" % self.proposed
        try:
            node.core.propose([(EntryKind.NORMAL, data)], self.now)
        except (NotLeader, TransferInProgress):
            return False
        self.proposed += 1
        if self.rng.random() < 0.5:
            self._process(node)  # else the next event for the node handles it, with other input
        return True

    def stats(self) -> dict:
        return {
            "terms_with_leader": len(self.leaders_by_term),
            "committed": len(self.committed),
            "acked": len(self.acked),
            "crashes": self.crashes,
            "snapshots_installed": self.snapshots_installed,
            "config_changes": self.config_changes,
            "messages": self.messages_sent,
        }

    def change_membership(self) -> bool:
        """Ask the leader for one random change: add a spare (a learner, or one the leader
        promotes once caught up), remove a member, or promote a learner."""
        lid = self.leader()
        if lid is None:
            return False
        core = self.nodes[lid].core
        cur = core.membership
        outside = [i for i in self.ids if i not in cur]
        learners = sorted(cur.learners)
        r = self.rng.random()
        if outside and (r < 0.4 or len(cur.voters) <= 2):
            nid = self.rng.choice(outside)
            new = cur.with_member(Member(nid, f"sim:{nid}", voter=False, promote=self.rng.random() < 0.5))
        elif learners and r < 0.7:
            nid = self.rng.choice(learners)
            new = cur.with_member(Member(nid, f"sim:{nid}", voter=True))
        else:
            nid = self.rng.choice(sorted(cur.ids))
            new = cur.without(nid)
        try:
            core.propose_config(new, self.now)
        except ConfigChangeRefused:
            return False
        self.config_changes += 1
        self._process(self.nodes[lid])
        return True

    # -- invariants -----------------------------------------------------------------------

    def _check_roles(self, node: SimNode) -> None:
        core = node.core
        if core.role == Role.LEADER and self.leaders_by_term.get(core.term) != node.id:
            other = self.leaders_by_term.setdefault(core.term, node.id)
            if other != node.id:
                raise InvariantViolation(f"two leaders in term {core.term}: {other} and {node.id}")
            # Leader completeness: every entry committed before the election is in the new
            # leader's log.
            for idx, (term, _) in self.committed.items():
                if idx > core.log.before_index and core.log.term(idx) != term:
                    raise InvariantViolation(
                        f"leader {node.id} (term {core.term}) lacks committed entry {idx}/{term}"
                    )
        if core.commit_index < node.commit_seen:
            raise InvariantViolation(f"{node.id}: commit index went back from {node.commit_seen} to {core.commit_index}")
        node.commit_seen = core.commit_index

    def check_converged(self) -> None:
        """All live nodes applied the same sequence of entries (state machine safety)."""
        states = {n.id: n.applied for n in self.nodes.values() if n.up}
        ref_id = max(states, key=lambda i: len(states[i]))
        ref = states[ref_id]
        for nid, st in states.items():
            if st != ref[: len(st)]:
                raise InvariantViolation(f"{nid} applied a different sequence than {ref_id}")

    def check_acked_durable(self) -> None:
        """Every write a leader acknowledged is committed at the index it was acked at."""
        for data, idx in self.acked.items():
            got = self.committed.get(idx)
            if got is None or got[1] != data:
                raise InvariantViolation(f"acknowledged write {data!r} at {idx} was lost")
