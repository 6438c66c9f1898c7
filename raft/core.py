"""The Raft core: a deterministic state machine with no I/O, no clock and no threads.

Inputs: `step(msg, now)`, `tick(now)`, `propose(...)`, `read_index(...)`,
`transfer_leadership(...)`, `on_persisted(ready)`, `report_snapshot(...)`.
Output: `ready()` hands out a `Ready`, which the driver handles in this order:

1. persist `hard_state`, then `snapshot` (reset the ledger to it and load the state
   machine from it), then `entries` (drop the ledger from `entries_from`, append) —
   in one fsynced write — and call `on_persisted(ready)`;
2. send `messages` at once (they never depend on unpersisted state of this node);
3. send `persisted_messages` only after step 1 (vote grants, append acks);
4. apply entries up to `applicable_index` to the state machine;
5. answer `read_states` once the state machine has applied their index.

Time (`now`, milliseconds, monotonic) is passed in; randomness comes from a seeded RNG.
The protocol is DLedger's (vote codes, EntryDispatcher, QuorumAckChecker) with Raft's and
etcd's safety measures where DLedger is weaker: pre-vote, check-quorum, a no-op entry per
term, persist-before-ack, read index and leadership transfer with catch-up.

Beside it, as pure as it is: the leader's view of each follower (progress.py), commit and
vote arithmetic (quorum.py), the read-index rounds and lease (readindex.py), the log over
the ledger (log.py) and configurations (membership.py).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from . import quorum
from .errors import ConfigChangeRefused, NotLeader, TransferInProgress
from .log import LogStorage, RaftLog, entry_size
from .membership import Membership
from .messages import (
    CoreMessage,
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
)
from .progress import DispatcherState, Progress
from .readindex import PendingRead, ReadFailed, ReadIndex, ReadState


@dataclass(frozen=True, slots=True)
class CoreConfig:
    node_id: str
    heartbeat_ms: float = 100.0
    election_timeout_ms: float = 1000.0
    # Election timeouts are drawn from [T, T * (1 + jitter)) so that nodes rarely tie.
    election_jitter: float = 0.3
    pre_vote: bool = True
    check_quorum: bool = True
    max_batch_entries: int = 4096
    max_batch_bytes: int = 4 << 20
    max_inflight_msgs: int = 64
    max_inflight_bytes: int = 32 << 20
    push_timeout_ms: float = 1000.0  # re-push a batch unacknowledged this long (DLedger)
    # Flow-control quota for a follower this many entries behind (DLedger's maxPendingSize).
    quota_lag_entries: int = 100_000
    quota_bytes_per_second: int = 64 << 20
    lease_safety: float = 0.9  # lease reads trust a quorum ack for this part of T only
    promote_max_lag: int = 1000  # a learner this many entries behind is not promoted yet
    # An idle follower hears of a new commit index by a COMMIT request this long after it
    # became known, unless an APPEND (which carries it) goes out first: under load the
    # next APPEND follows within a millisecond, and a COMMIT per ack round would double the
    # frames the leader sends.
    commit_notify_delay_ms: float = 2.0


@dataclass(frozen=True, slots=True)
class SnapshotSend:
    """The driver should stream the newest snapshot to `peer`, then `report_snapshot`."""

    peer: str
    seq: int


@dataclass(slots=True)
class Ready:
    hard_state: HardState | None = None
    snapshot: SnapshotMeta | None = None
    entries_from: int = 0  # with entries or a bare truncation: drop the ledger from here
    log_epoch: int = 0
    entries: list[Entry] = field(default_factory=list)
    messages: list[CoreMessage] = field(default_factory=list)
    persisted_messages: list[CoreMessage] = field(default_factory=list)
    # Apply entries up to here: committed, and fsynced on this node (so the state machine
    # never gets ahead of the local ledger).
    applicable_index: int | None = None
    read_states: list[ReadState] = field(default_factory=list)
    read_failures: list[ReadFailed] = field(default_factory=list)
    snapshot_sends: list[SnapshotSend] = field(default_factory=list)
    role_changed: bool = False  # role, term or leader changed since the last Ready
    membership_changed: bool = False  # a configuration was appended, truncated or installed

    @property
    def must_persist(self) -> bool:
        return self.hard_state is not None or self.snapshot is not None or self.entries_from > 0


class RaftCore:
    def __init__(
        self,
        config: CoreConfig,
        storage: LogStorage,
        hard_state: HardState,
        membership: Membership,
        applied_index: int = 0,
        now: float = 0.0,
        seed: int | None = None,
        known: frozenset[str] = frozenset(),
    ) -> None:
        self.cfg = config
        self.id = config.node_id
        self.log = RaftLog(storage)
        self.membership = membership
        self.term = hard_state.term
        self.vote = hard_state.vote
        self.role = Role.FOLLOWER
        self.leader_id: str | None = None
        # Entries up to the applied index were committed; nothing persists commit itself.
        self.commit_index = max(applied_index, self.log.before_index)
        self._rng = random.Random(seed)
        self._now = now
        self._election_deadline = now + self._random_timeout()
        self._heartbeat_deadline = 0.0
        self._check_quorum_deadline = 0.0
        self._last_leader_contact: float | None = None
        self._votes_granted: set[str] = set()
        self._votes_rejected: set[str] = set()
        self._taking_leadership = False  # campaigning because the leader handed over
        self.progress: dict[str, Progress] = {}
        self._dispatch_needed = False
        self.transferee: str | None = None
        self._transfer_deadline = 0.0
        # Read index: reads wait there until a heartbeat round confirms leadership.
        self._reads = ReadIndex()
        self._ready = Ready()
        self._hs_dirty = False
        self._applicable_reported = self.applicable_index()
        # Membership (Raft dissertation §4.1, one server at a time): `membership` is the
        # newest configuration in the log, committed or not. `_configs` lists the CONFIG
        # entries above the commit index, to fall back on if they are truncated away;
        # `_committed_membership` is the newest one at or below it.
        self._committed_membership = membership
        self._configs: list[tuple[int, Membership]] = []
        self._config_index = 0
        # Every id that appeared in a configuration this node has seen. Requests are handled
        # whatever the current configuration says (dissertation §4.2.1): a node that lags
        # behind a change must still hear from the members the change brought. A message
        # from an id never seen is refused (REJECT_UNKNOWN_LEADER / UNKNOWN_MEMBER) unless
        # it shows that we are the one behind: a candidate with a longer log, a leader with
        # a newer term.
        self.known: set[str] = set(known) | membership.ids
        last = self.log.last_index()
        if last > self.commit_index:
            for e in self.log.entries(self.commit_index + 1, last + 1, 1 << 62, 1 << 62):
                if e.kind == EntryKind.CONFIG:
                    self._configs.append((e.index, Membership.decode(e.data)))
            if self._configs:
                self._config_index, self.membership = self._configs[-1]
                for _, m in self._configs:
                    self.known |= m.ids

    # ======================================================================================
    # Inputs

    def tick(self, now: float) -> None:
        """Let time pass: election timeouts, heartbeats, check quorum, re-push."""
        self._now = now
        if self.role == Role.LEADER:
            self._tick_leader(now)
        elif now >= self._election_deadline:
            if self._can_campaign():
                self._start_election(transfer=False)
            else:
                self._election_deadline = now + self._random_timeout()

    def campaign(self, now: float) -> None:
        """Start an election now (used when this node is the only voter)."""
        self._now = now
        if self.role != Role.LEADER and self._can_campaign():
            self._start_election(transfer=False)

    def step(self, msg: CoreMessage, now: float) -> None:
        self._now = now
        if msg.dst != self.id:
            return
        handler = _HANDLERS.get(type(msg))
        if handler is not None:
            handler(self, msg)

    def propose(self, items: Sequence[tuple[int, bytes]], now: float) -> tuple[int, int]:
        """Append (kind, data) entries as leader. Returns (term, index of the first one).

        Raises NotLeader on a follower and TransferInProgress while leadership is being
        handed over (the leader refuses new writes then, as DLedger does). Membership
        changes go through propose_config."""
        self._now = now
        if self.role != Role.LEADER:
            raise NotLeader(leader=self.leader_id)
        if self.transferee is not None:
            raise TransferInProgress(self.transferee)
        if any(kind == EntryKind.CONFIG for kind, _ in items):
            raise ValueError("membership changes go through propose_config()")
        first = self.log.last_index() + 1
        t = self.term
        self.log.append([Entry(first + k, t, kind, data) for k, (kind, data) in enumerate(items)])
        self._dispatch_needed = True
        return t, first

    def propose_config(self, new: Membership, now: float) -> tuple[int, int]:
        """Append a membership change (one member added, removed or changed). It takes
        effect here at once, and on each follower when appended. Returns (term, index).

        Refused (ConfigChangeRefused) while another change is uncommitted, before this
        leader has committed an entry of its own term (the known flaw of single-server
        changes otherwise lets two leaders win one term), when it would remove the last
        voter, or promote a learner that has not caught up."""
        self._now = now
        if self.role != Role.LEADER:
            raise NotLeader(leader=self.leader_id)
        if self.transferee is not None:
            raise TransferInProgress(self.transferee)
        if not self.committed_in_term():
            raise ConfigChangeRefused("this leader has not yet committed an entry of its own term; retry in a moment")
        if self._config_index > self.commit_index:
            raise ConfigChangeRefused(f"a membership change (index {self._config_index}) is still in progress; retry once it has committed")
        self._check_single_change(self.membership, new)
        return self.term, self._append_config(new)

    def _append_config(self, new: Membership) -> int:
        index = self.log.last_index() + 1
        self.log.append([Entry(index, self.term, EntryKind.CONFIG, new.encode())])
        self._config_appended(index, new)
        self._dispatch_needed = True
        return index

    def _check_single_change(self, old: Membership, new: Membership) -> None:
        """One member changes, a new member starts as a learner, a learner is promoted only
        once caught up, and the new voters keep a majority that is reachable and caught up
        now (etcd's strict reconfiguration check): no change can leave the cluster without
        a quorum it could have kept."""
        changed = {i for i in old.ids | new.ids if old.get(i) != new.get(i)}
        if len(changed) != 1:
            raise ConfigChangeRefused(f"change one member at a time (this changes {sorted(changed) or 'nothing'})")
        if not new.voters:
            raise ConfigChangeRefused("the last voter cannot be removed or demoted")
        (who,) = changed
        before, after = old.get(who), new.get(who)
        if before is None and after.voter:
            raise ConfigChangeRefused(f"{who} must join as a learner (promote it, or let it be promoted, once it has caught up)")
        if before is not None and after is not None and after.voter and not before.voter:
            pr = self.progress.get(who)
            behind = self.log.last_index() - (pr.match if pr else 0)
            if pr is None or pr.state != DispatcherState.APPEND or behind > self.cfg.promote_max_lag:
                raise ConfigChangeRefused(f"learner {who} is {behind} entries behind; promote it once it has caught up")
        if new.voters != old.voters:
            healthy = sorted(v for v in new.voters if self._healthy(v))
            need = quorum.majority(len(new.voters))
            if len(healthy) < need:
                raise ConfigChangeRefused(
                    f"refused: the {len(new.voters)} voters after this change need {need} for a majority, but only "
                    f"{len(healthy)} of them ({', '.join(healthy) or 'none'}) are reachable and caught up; "
                    "bring members back first, or remove an unreachable one instead"
                )

    def _healthy(self, member: str) -> bool:
        """This leader, or a member it heard from within an election timeout and is
        replicating to normally."""
        if member == self.id:
            return self.role == Role.LEADER
        pr = self.progress.get(member)
        return (
            pr is not None
            and pr.state == DispatcherState.APPEND
            and pr.last_heard is not None
            and self._now - pr.last_heard <= self.cfg.election_timeout_ms
        )

    def _maybe_promote(self) -> None:
        """Promote the first learner that asked to become a voter once caught up (a member
        added with voter=true), when no other change is in progress."""
        if self._config_index > self.commit_index or self.transferee is not None or not self.committed_in_term():
            return
        cur = self.membership
        for m in sorted(cur.members.values(), key=lambda m: m.id):
            if m.promote and not m.voter:
                new = cur.with_member(replace(m, voter=True, promote=False))
                try:
                    self._check_single_change(cur, new)
                except ConfigChangeRefused:
                    continue  # not caught up yet: asked again at the next tick
                self._append_config(new)
                return

    def _config_appended(self, index: int, new: Membership) -> None:
        self._configs.append((index, new))
        self._set_membership(new, index)

    def _set_membership(self, new: Membership, index: int) -> None:
        self.membership, self._config_index = new, index
        self.known |= new.ids
        self._ready.membership_changed = True
        if self.role == Role.LEADER:
            last = self.log.last_index()
            for m in new.members.values():
                if m.id == self.id:
                    continue
                pr = self.progress.get(m.id)
                if pr is None:
                    pr = self.progress[m.id] = Progress(m.id, m.voter, next=last + 1)
                    pr.reset(DispatcherState.COMPARE, last + 1)
                pr.voter = m.voter
            for gone in set(self.progress) - new.ids:
                del self.progress[gone]

    def _configs_truncated(self, from_index: int) -> None:
        """Entries from from_index on were cut: drop the configurations among them."""
        if self._configs and self._configs[-1][0] >= from_index:
            self._configs = [(i, m) for i, m in self._configs if i < from_index]
            if self._configs:
                self._set_membership(self._configs[-1][1], self._configs[-1][0])
            else:
                self._set_membership(self._committed_membership, 0)

    def _configs_appended(self, entries: Sequence[Entry]) -> None:
        for e in entries:
            if e.kind == EntryKind.CONFIG:
                self._config_appended(e.index, Membership.decode(e.data))

    @property
    def committed_membership(self) -> Membership:
        """The newest configuration known committed (a member removed by a change still in
        progress is in it: it must hear back until its removal commits)."""
        return self._committed_membership

    def _configs_committed(self) -> None:
        c = self.commit_index
        while self._configs and self._configs[0][0] <= c:
            self._committed_membership = self._configs.pop(0)[1]
            self._ready.membership_changed = True
        if self.role == Role.LEADER and self.id not in self.membership.voters and self._config_index <= c:
            # Our own removal (or demotion) has committed: step down (dissertation §4.2.2).
            self._become_follower(self.term, None)

    def read_index(self, ctx: int, now: float, lease: bool = False) -> None:
        """Ask for a read index; the answer comes as a ReadState or ReadFailed in a Ready.

        On the leader it is the commit index, confirmed by a heartbeat round to a majority
        (all reads waiting for the next round share it). With `lease`, a leader whose
        last quorum-confirmed round is younger than the election timeout answers at once.
        A follower asks the leader."""
        self._now = now
        if self.role == Role.LEADER:
            read = PendingRead(ctx, 0, self.id)
            if lease and self._lease_valid(now):
                self._ready.read_states.append(ReadState(ctx, self.commit_index))
            else:
                self._leader_read(read)
        elif self.leader_id is not None and self.role == Role.FOLLOWER:
            self._send(ReadIndexRequest(self.id, self.leader_id, self.term, ctx))
        else:
            self._ready.read_failures.append(ReadFailed(ctx, self.leader_id))

    def transfer_leadership(self, to: str, now: float) -> None:
        """Hand leadership to `to` once it has caught up (Raft thesis §3.10)."""
        self._now = now
        if self.role != Role.LEADER:
            raise NotLeader(leader=self.leader_id)
        if to == self.id:
            return
        if to not in self.membership.voters:
            raise ValueError(f"{to!r} is not a voting member; voters: {sorted(self.membership.voters)}")
        self.transferee = to
        self._transfer_deadline = now + self.cfg.election_timeout_ms
        self._reads.lease_start = None  # the transferee will not honour our lease
        self._maybe_send_timeout_now()
        self._dispatch_needed = True

    def on_persisted(self, ready: Ready) -> None:
        """The driver has fsynced what `ready` asked for."""
        if ready.entries_from or ready.snapshot is not None:
            self.log.persisted(ready.entries, ready.log_epoch)
            if self.role == Role.LEADER:
                self._maybe_commit()

    def report_snapshot(self, peer: str, seq: int, ok: bool, now: float) -> None:
        """The driver finished (ok) or gave up (not ok) streaming a snapshot to peer."""
        self._now = now
        pr = self.progress.get(peer)
        if pr is None or pr.seq != seq or pr.state != DispatcherState.INSTALL_SNAPSHOT:
            return
        if not ok:
            pr.probe_sent_at = now  # retried after the push timeout
        # On success the follower's core answers with a PushResponse, which moves us on.

    def peer_connected(self, peer: str, now: float) -> None:
        """The link to peer (re)connected: anything sent while it was down is lost, so
        send again now rather than after the push timeout."""
        self._now = now
        pr = self.progress.get(peer)
        if pr is not None and (pr.inflight or pr.probe_sent_at is not None):
            self._repush(pr)

    def compacted(self, index: int, term: int) -> None:
        """The driver dropped the ledger prefix up to index (it is in a snapshot)."""
        self.log.compacted(index, term)

    # ======================================================================================
    # Output

    def has_ready(self) -> bool:
        r = self._ready
        leading = self.role == Role.LEADER
        return bool(
            (leading and (self._dispatch_needed or self._reads.round_due()))
            or self._hs_dirty
            or r.messages
            or r.persisted_messages
            or r.read_states
            or r.read_failures
            or r.snapshot_sends
            or r.snapshot is not None
            or r.role_changed
            or r.membership_changed
            or self.applicable_index() != self._applicable_reported
            or self.log.has_unpersisted()
        )

    def ready(self) -> Ready:
        if self.role == Role.LEADER:
            if self._reads.round_due():
                self._broadcast_heartbeats()
            if self._dispatch_needed:
                self._dispatch_all()
        rd = self._ready
        self._ready = Ready()
        if self._hs_dirty:
            rd.hard_state = HardState(self.term, self.vote)
            self._hs_dirty = False
        taken = self.log.take_unpersisted()
        if taken is not None:
            rd.entries_from, rd.entries = taken
        rd.log_epoch = self.log.epoch
        applicable = self.applicable_index()
        if applicable != self._applicable_reported:
            rd.applicable_index = self._applicable_reported = applicable
        return rd

    def applicable_index(self) -> int:
        return min(self.commit_index, self.log.durable_index)

    def next_deadline(self) -> float:
        """The latest time by which tick() must be called again."""
        if self.role == Role.LEADER:
            d = min(self._heartbeat_deadline, self._check_quorum_deadline)
            if self.transferee is not None:
                d = min(d, self._transfer_deadline)
            for pr in self.progress.values():
                if pr.commit_due is not None and pr.commit_due < d:
                    d = pr.commit_due
            return d
        return self._election_deadline

    # ======================================================================================
    # Queries

    def status(self) -> dict:
        return {
            "id": self.id,
            "role": self.role.label,
            "term": self.term,
            "vote": self.vote,
            "leader": self.leader_id,
            "commit_index": self.commit_index,
            "ledger_begin_index": self.log.before_index,
            "ledger_end_index": self.log.last_index(),
            "ledger_end_term": self.log.last_term(),
            "transferee": self.transferee,
            "peers": {
                p: {
                    "state": pr.state.value,
                    "match": pr.match,
                    "next": pr.next,
                    "inflight": len(pr.inflight),
                    "voter": pr.voter,
                }
                for p, pr in self.progress.items()
            },
        }

    def committed_in_term(self) -> bool:
        """Whether this leader has committed an entry of its own term (its no-op)."""
        return self.log.term(self.commit_index) == self.term

    # ======================================================================================
    # Roles

    def _random_timeout(self) -> float:
        t = self.cfg.election_timeout_ms
        return t * (1.0 + self._rng.random() * self.cfg.election_jitter)

    def _can_campaign(self) -> bool:
        return self.id in self.membership.voters

    def _set_term(self, term: int) -> None:
        if term != self.term:
            self.term = term
            self.vote = None
            self._hs_dirty = True

    def _become_follower(self, term: int, leader: str | None) -> None:
        was_leader = self.role == Role.LEADER
        changed = term != self.term or self.role != Role.FOLLOWER or leader != self.leader_id
        self._set_term(term)
        self.role = Role.FOLLOWER
        self.leader_id = leader
        self._taking_leadership = False
        self._election_deadline = self._now + self._random_timeout()
        if leader is not None:
            self._last_leader_contact = self._now
        if was_leader:
            self._abandon_leadership()
        if changed:
            self._ready.role_changed = True

    def _abandon_leadership(self) -> None:
        self.progress = {}
        self._dispatch_needed = False
        self.transferee = None
        for r in self._reads.clear():
            self._fail_read(r)

    def _start_election(self, transfer: bool) -> None:
        """Become pre-candidate (or candidate straight away for a transfer / no pre-vote)."""
        self.leader_id = None
        self._last_leader_contact = None
        if self.cfg.pre_vote and not transfer:
            self._campaign(pre_vote=True, transfer=False)
        else:
            self._campaign(pre_vote=False, transfer=transfer)

    def _campaign(self, pre_vote: bool, transfer: bool) -> None:
        self._election_deadline = self._now + self._random_timeout()
        self._votes_granted, self._votes_rejected = {self.id}, set()
        self._ready.role_changed = True
        if pre_vote:
            self.role = Role.PRE_CANDIDATE
            term = self.term + 1
        else:
            self.role = Role.CANDIDATE
            self._set_term(self.term + 1)
            self.vote = self.id
            self._hs_dirty = True
            self._taking_leadership = transfer
            term = self.term
        if quorum.vote_outcome(self._votes_granted, self._votes_rejected, self.membership.voters) is quorum.VoteOutcome.WON:
            self._election_won(pre_vote)
            return
        last_index, last_term = self.log.last_index(), self.log.last_term()
        for peer in sorted(self.membership.voters - {self.id}):
            req = VoteRequest(self.id, peer, term, last_index, last_term, pre_vote, transfer)
            # A real vote request goes out only once our vote for ourselves is on disk.
            self._send(req, after_persist=not pre_vote)

    def _election_won(self, pre_vote: bool) -> None:
        if pre_vote:
            self._campaign(pre_vote=False, transfer=False)
        else:
            self._become_leader()

    def _become_leader(self) -> None:
        self.role = Role.LEADER
        self.leader_id = self.id
        self._taking_leadership = False
        self._ready.role_changed = True
        now = self._now
        last = self.log.last_index()
        self.progress = {}
        for m in self.membership.members.values():
            if m.id != self.id:
                pr = Progress(m.id, m.voter, next=last + 1)
                pr.reset(DispatcherState.COMPARE, last + 1)
                self.progress[m.id] = pr
        self._heartbeat_deadline = now  # announce ourselves at once
        self._check_quorum_deadline = now + self.cfg.election_timeout_ms
        self._reads.lease_start = None
        # The no-op lets entries of earlier terms commit now (Raft §5.4.2 and §8).
        self.log.append([Entry(last + 1, self.term, EntryKind.NOOP, b"")])
        self._dispatch_needed = True
        self._broadcast_heartbeats()

    # ======================================================================================
    # Leader: time

    def _tick_leader(self, now: float) -> None:
        cfg = self.cfg
        if now >= self._check_quorum_deadline:
            self._check_quorum_deadline = now + cfg.election_timeout_ms
            if cfg.check_quorum and not self._quorum_active():
                # We cannot reach a majority: step down so clients go elsewhere (etcd's
                # CheckQuorum; DLedger's maxHeartBeatLeak).
                self._become_follower(self.term, None)
                return
            for pr in self.progress.values():
                pr.recent_active = False
        if self.transferee is not None and now >= self._transfer_deadline:
            self.transferee = None  # the transfer did not happen in time: abort it
        self._maybe_promote()
        if now >= self._heartbeat_deadline:
            self._broadcast_heartbeats()
        for pr in self.progress.values():
            if pr.timed_out(now, cfg.push_timeout_ms):
                self._repush(pr)
            elif pr.commit_due is not None and now >= pr.commit_due:
                self._dispatch_needed = True

    def _quorum_active(self) -> bool:
        active = [p for p, pr in self.progress.items() if pr.recent_active] + [self.id]
        return quorum.has_quorum(active, self.membership.voters)

    def _repush(self, pr: Progress) -> None:
        """Nothing came back in time: send again from the follower's match point."""
        if pr.state == DispatcherState.APPEND:
            pr.reset(DispatcherState.APPEND, pr.match + 1)
        else:
            pr.reset(pr.state, pr.next)
        self._dispatch_needed = True

    def _broadcast_heartbeats(self) -> None:
        self._heartbeat_deadline = self._now + self.cfg.heartbeat_ms
        seq = self._reads.new_round(self._now)
        for pr in self.progress.values():
            commit = min(self.commit_index, pr.match)
            self._send(HeartbeatRequest(self.id, pr.peer, self.term, commit, seq))
        self._advance_reads()  # a single voter confirms its own rounds

    # ======================================================================================
    # Leader: the EntryDispatcher

    def _dispatch_all(self) -> None:
        self._dispatch_needed = False
        for pr in self.progress.values():
            self._dispatch(pr)

    def _dispatch(self, pr: Progress) -> None:
        cfg, log, now = self.cfg, self.log, self._now
        st = pr.state
        if st == DispatcherState.APPEND:
            last = log.last_index()
            while pr.next <= last and not pr.window_full(cfg.max_inflight_msgs, cfg.max_inflight_bytes):
                if pr.next <= log.before_index:
                    pr.reset(DispatcherState.INSTALL_SNAPSHOT, pr.next)
                    self._dispatch(pr)
                    return
                batch = log.entries(pr.next, last + 1, cfg.max_batch_bytes, cfg.max_batch_entries)
                size = sum(map(entry_size, batch))
                if last - pr.next > cfg.quota_lag_entries and not pr.quota_allows(
                    now, size, cfg.quota_bytes_per_second
                ):
                    break  # far behind and over quota: wait for the next window
                prev = pr.next - 1
                commit = min(self.commit_index, batch[-1].index)
                self._send(
                    PushRequest(self.id, pr.peer, self.term, PushType.APPEND, pr.seq, prev, log.term(prev), batch, commit)
                )
                pr.sent_commit = max(pr.sent_commit, commit)
                pr.sent(batch[0].index, batch[-1].index, now, size)
            if pr.inflight:
                pr.commit_due = None
            else:
                commit = min(self.commit_index, pr.match)
                if commit <= pr.sent_commit:
                    pr.commit_due = None
                elif pr.commit_due is None:
                    pr.commit_due = now + cfg.commit_notify_delay_ms
                elif now >= pr.commit_due:
                    # DLedger's COMMIT request: an idle follower learns the commit index.
                    pr.sent_commit, pr.commit_due = commit, None
                    self._send(PushRequest(self.id, pr.peer, self.term, PushType.COMMIT, pr.seq, 0, 0, (), commit))
            return
        if pr.probe_sent_at is not None:
            return  # one COMPARE / TRUNCATE / INSTALL_SNAPSHOT at a time
        if st == DispatcherState.INSTALL_SNAPSHOT:
            pr.probe_sent_at = now
            self._ready.snapshot_sends.append(SnapshotSend(pr.peer, pr.seq))
            return
        prev = pr.next - 1
        prev_term = log.term(prev)
        if prev_term is None:  # compacted away: the follower needs a snapshot
            pr.reset(DispatcherState.INSTALL_SNAPSHOT, pr.next)
            self._dispatch(pr)
            return
        pr.probe_sent_at = now
        if st == DispatcherState.COMPARE:
            self._send(PushRequest(self.id, pr.peer, self.term, PushType.COMPARE, pr.seq, prev, prev_term))
        else:  # TRUNCATE carries the first batch after the match point
            last = log.last_index()
            batch = log.entries(pr.next, last + 1, cfg.max_batch_bytes, cfg.max_batch_entries)
            commit = min(self.commit_index, prev + len(batch))
            self._send(
                PushRequest(self.id, pr.peer, self.term, PushType.TRUNCATE, pr.seq, prev, prev_term, batch, commit, last)
            )

    def _handle_push_response(self, m: PushResponse) -> None:
        if m.term > self.term:
            self._become_follower(m.term, None)
            return
        if self.role != Role.LEADER or m.term < self.term:
            return
        pr = self.progress.get(m.src)
        if pr is None:
            return
        pr.recent_active = True
        pr.last_heard = self._now
        code = m.code
        if code == PushCode.INCONSISTENT_LEADER:
            # Another leader in our term: a bug elsewhere. Step down rather than go on.
            self._become_follower(self.term, None)
            return
        if code == PushCode.SUCCESS:
            moved = pr.ack(m.index)
            if m.seq == pr.seq and pr.state != DispatcherState.APPEND:
                if m.type == PushType.COMPARE and pr.state == DispatcherState.COMPARE:
                    # Found the point where our logs agree. Entries past it on the follower
                    # must go first (TRUNCATE), unless there are none.
                    nxt = DispatcherState.TRUNCATE if m.end_index > m.index else DispatcherState.APPEND
                    pr.reset(nxt, m.index + 1)
                elif m.type == PushType.TRUNCATE and pr.state == DispatcherState.TRUNCATE:
                    pr.reset(DispatcherState.APPEND, m.index + 1)
                elif m.type == PushType.INSTALL_SNAPSHOT and pr.state == DispatcherState.INSTALL_SNAPSHOT:
                    pr.reset(DispatcherState.APPEND, m.index + 1)
            if moved:
                self._maybe_commit()
                if m.src == self.transferee:
                    self._maybe_send_timeout_now()
            self._dispatch_needed = True
            return
        if code != PushCode.INCONSISTENT_STATE or m.seq != pr.seq:
            return  # an answer to something we no longer wait for
        self._dispatch_needed = True
        if m.x_term:
            # Fast backup (xTerm/xIndex): skip the follower's whole conflicting term, or to
            # the end of that term in our log if we have it.
            ours = self.log.last_index_of_term(m.x_term, m.index)
            nxt = ours + 1 if ours else m.x_index
            pr.reset(DispatcherState.COMPARE, min(nxt, self.log.last_index() + 1))
        elif pr.state == DispatcherState.COMPARE:
            pr.reset(DispatcherState.COMPARE, min(m.end_index, self.log.last_index()) + 1)
        else:  # a gap in APPEND: continue from where the follower's ledger ends
            pr.reset(DispatcherState.APPEND, min(m.end_index, self.log.last_index()) + 1)
        if pr.next - 1 < self.log.before_index:
            pr.reset(DispatcherState.INSTALL_SNAPSHOT, pr.next)

    def _maybe_commit(self) -> bool:
        """QuorumAckChecker: the median watermark, counting only our own term's entries."""
        match = {p: pr.match for p, pr in self.progress.items()}
        match[self.id] = self.log.durable_index  # the leader counts what it has fsynced
        idx = quorum.committed_index(match, self.membership.voters)
        if idx > self.commit_index and self.log.term(idx) == self.term:
            self.commit_index = idx
            self._configs_committed()
            self._dispatch_needed = True  # tell idle followers (COMMIT)
            if self._reads.before_commit:
                self._reads.term_committed(self.commit_index)
            return True
        return False

    def _maybe_send_timeout_now(self) -> None:
        t = self.transferee
        pr = self.progress.get(t) if t else None
        if pr is not None and pr.match >= self.log.last_index():
            self._send(TimeoutNow(self.id, pr.peer, self.term))

    # ======================================================================================
    # Leader: read index

    def _leader_read(self, read: PendingRead) -> None:
        # Until our no-op commits we do not know the latest commit index (Raft §6.4).
        self._reads.add(read, self.commit_index if self.committed_in_term() else None)

    def _advance_reads(self) -> None:
        """Answer the reads whose heartbeat round a majority has answered."""
        acked = {p: pr.read_acked for p, pr in self.progress.items()}
        acked[self.id] = self._reads.seq
        for r in self._reads.confirm(acked, self.membership.voters):
            if r.origin == self.id:
                self._ready.read_states.append(ReadState(r.ctx, r.index))
            else:
                self._send(ReadIndexResponse(self.id, r.origin, self.term, r.ctx, r.index, True))

    def _lease_valid(self, now: float) -> bool:
        return (
            self.cfg.check_quorum
            and self.transferee is None
            and self.committed_in_term()
            and self._reads.lease_valid(now, self.cfg.election_timeout_ms * self.cfg.lease_safety)
        )

    def _fail_read(self, r: PendingRead) -> None:
        if r.origin == self.id:
            self._ready.read_failures.append(ReadFailed(r.ctx, self.leader_id))
        else:
            self._send(ReadIndexResponse(self.id, r.origin, self.term, r.ctx, 0, False))

    # ======================================================================================
    # Message handlers

    def _send(self, msg: CoreMessage, after_persist: bool = False) -> None:
        (self._ready.persisted_messages if after_persist else self._ready.messages).append(msg)

    def _handle_vote_request(self, m: VoteRequest) -> None:
        """DLedger's handleVote, in its order of checks, with Raft's term handling."""
        def answer(result: VoteResult, term: int | None = None) -> None:
            grant = result == VoteResult.ACCEPT
            resp_term = m.term if (m.pre_vote and grant) else (term if term is not None else self.term)
            # A granted vote leaves only once it is on disk; any answer that reveals a term
            # we have not persisted waits too.
            self._send(VoteResponse(self.id, m.src, resp_term, result, m.pre_vote), after_persist=grant or self._hs_dirty)

        if m.src not in self.known and (m.ledger_end_term, m.ledger_end_index) <= (self.log.last_term(), self.log.last_index()):
            return answer(VoteResult.REJECT_UNKNOWN_LEADER)
        if m.src == self.id:
            return answer(VoteResult.REJECT_UNEXPECTED_LEADER)
        if m.term > self.term and not m.transfer and self._in_lease():
            # We hear from a live leader: a node that was cut off must not depose it.
            return answer(VoteResult.REJECT_ALREADY_HAS_LEADER)
        if m.term < self.term:
            return answer(VoteResult.REJECT_EXPIRED_VOTE_TERM)
        last_term, last_index = self.log.last_term(), self.log.last_index()
        if self._taking_leadership and (m.ledger_end_term, m.ledger_end_index) <= (last_term, last_index):
            # We campaign because the leader handed over to us; a rival whose log is no
            # better must not take our term away (and with it the transfer).
            return answer(VoteResult.REJECT_TAKING_LEADERSHIP)
        if m.term > self.term and not m.pre_vote:
            self._become_follower(m.term, None)
        if m.ledger_end_term < last_term:
            return answer(VoteResult.REJECT_EXPIRED_LEDGER_TERM)
        if m.ledger_end_term == last_term and m.ledger_end_index < last_index:
            return answer(VoteResult.REJECT_SMALL_LEDGER_END_INDEX)
        if m.term < last_term:  # cannot happen while term >= last entry's term holds
            return answer(VoteResult.REJECT_TERM_SMALL_THAN_LEDGER)
        if not (m.pre_vote and m.term > self.term) and self.vote not in (None, m.src):
            if self.leader_id is not None:
                return answer(VoteResult.REJECT_ALREADY_HAS_LEADER)
            return answer(VoteResult.REJECT_ALREADY_VOTED)
        if not m.pre_vote:
            self.vote = m.src
            self._hs_dirty = True
            self._election_deadline = self._now + self._random_timeout()
        answer(VoteResult.ACCEPT)

    def _in_lease(self) -> bool:
        """Whether we know a live leader (etcd's inLease): followers that heard from it
        within the election timeout, and the leader itself while it has a quorum."""
        if not self.cfg.check_quorum:
            return False
        if self.role == Role.LEADER:
            return True
        return (
            self.leader_id is not None
            and self._last_leader_contact is not None
            and self._now - self._last_leader_contact < self.cfg.election_timeout_ms
        )

    def _handle_vote_response(self, m: VoteResponse) -> None:
        granted = m.result == VoteResult.ACCEPT
        if m.term > self.term and not (m.pre_vote and granted):
            self._become_follower(m.term, None)  # someone is ahead of us
            return
        if m.pre_vote:
            if self.role != Role.PRE_CANDIDATE or (granted and m.term != self.term + 1):
                return
        elif self.role != Role.CANDIDATE or m.term != self.term:
            return
        (self._votes_granted if granted else self._votes_rejected).add(m.src)
        outcome = quorum.vote_outcome(self._votes_granted, self._votes_rejected, self.membership.voters)
        if outcome is quorum.VoteOutcome.WON:
            self._election_won(m.pre_vote)
        elif outcome is quorum.VoteOutcome.LOST:
            # DLedger waits for the next (randomized) vote interval; so do we.
            self._become_follower(self.term, None)

    def _accept_leader(self, src: str, term: int) -> str | None:
        """Common term checks for a leader's heartbeat / push / install. Returns None if the
        request may be handled, else a reason code name for the caller's reply."""
        if src not in self.known:
            if not (term > self.term or (term == self.term and self.leader_id is None)):
                return "UNKNOWN_MEMBER"
            self.known.add(src)  # a leader of a term we had not reached: we are behind
        if term < self.term:
            return "EXPIRED_TERM"
        if term > self.term or self.role != Role.FOLLOWER or self.leader_id is None:
            if self.role == Role.LEADER and term == self.term:
                return "INCONSISTENT_LEADER"
            self._become_follower(term, src)
        elif self.leader_id != src:
            return "INCONSISTENT_LEADER"
        self._last_leader_contact = self._now
        self._election_deadline = self._now + self._random_timeout()
        return None

    def _handle_heartbeat(self, m: HeartbeatRequest) -> None:
        problem = self._accept_leader(m.src, m.term)
        if problem is not None:
            self._send(HeartbeatResponse(self.id, m.src, self.term, HeartbeatCode[problem], m.read_seq))
            return
        self._follower_commit(m.commit_index)
        self._send(HeartbeatResponse(self.id, m.src, self.term, HeartbeatCode.SUCCESS, m.read_seq), after_persist=self._hs_dirty)

    def _handle_heartbeat_response(self, m: HeartbeatResponse) -> None:
        if m.term > self.term:
            self._become_follower(m.term, None)
            return
        if self.role != Role.LEADER or m.term != self.term:
            return
        pr = self.progress.get(m.src)
        if pr is None:
            return
        if m.code == HeartbeatCode.INCONSISTENT_LEADER:
            self._become_follower(self.term, None)
            return
        if m.code != HeartbeatCode.SUCCESS:
            return
        pr.recent_active = True
        pr.last_heard = self._now
        if m.read_seq > pr.read_acked:
            pr.read_acked = m.read_seq
            self._advance_reads()
        if pr.match < self.log.last_index() or pr.sent_commit < min(self.commit_index, pr.match):
            self._dispatch_needed = True

    def _follower_commit(self, leader_commit: int) -> None:
        # The leader only sends commit indexes we are known to hold matching entries for.
        c = min(leader_commit, self.log.last_index())
        if c > self.commit_index:
            self.commit_index = c
            self._configs_committed()

    def _push_reply(self, m: PushRequest | InstallSnapshotRequest, ptype: PushType, code: PushCode, **kw) -> None:
        resp = PushResponse(self.id, m.src, self.term, ptype, m.seq, code, end_index=self.log.last_index(), **kw)
        self._send(resp, after_persist=True)

    def _handle_push(self, m: PushRequest) -> None:
        problem = self._accept_leader(m.src, m.term)
        if problem is not None:
            self._push_reply(m, m.type, PushCode[problem])
            return
        t = m.type
        if t == PushType.COMMIT:
            self._follower_commit(m.commit_index)
            return
        log = self.log
        prev = m.prev_index
        if prev < log.before_index:
            # The leader's prev is inside our snapshot: those entries are committed and so
            # match; skip the ones we no longer hold.
            entries = [e for e in m.entries if e.index > log.before_index]
            prev, prev_term = log.before_index, log.before_term
        else:
            entries = list(m.entries)
            prev_term = m.prev_term
        if prev > log.last_index():
            # Gap: DLedger's follower appends strictly at ledgerEndIndex + 1.
            self._push_reply(m, t, PushCode.INCONSISTENT_STATE)
            return
        local = log.term(prev)
        if local != prev_term:
            x_index = log.first_index_of_term(local, prev)
            self._push_reply(m, t, PushCode.INCONSISTENT_STATE, index=prev, x_term=local, x_index=x_index)
            return
        if t == PushType.COMPARE:
            self._push_reply(m, t, PushCode.SUCCESS, index=prev)
            return
        # APPEND / TRUNCATE: skip entries we already hold; a conflicting one is cut (TRUNCATE)
        # or reported (APPEND, which never cuts).
        last = log.last_index()
        k = 0
        while k < len(entries) and entries[k].index <= last:
            e = entries[k]
            if log.term(e.index) != e.term:
                if t != PushType.TRUNCATE:
                    self._push_reply(m, t, PushCode.INCONSISTENT_STATE, index=e.index, x_term=log.term(e.index) or 0,
                                     x_index=log.first_index_of_term(log.term(e.index) or 0, e.index))
                    return
                assert e.index > self.commit_index, "a leader asked to overwrite a committed entry"
                log.truncate_and_append(e.index, entries[k:])
                self._configs_truncated(e.index)
                self._configs_appended(entries[k:])
                k = len(entries)
                break
            k += 1
        if k < len(entries):
            log.append(entries[k:])
            self._configs_appended(entries[k:])
        match = entries[-1].index if entries else prev
        if t == PushType.TRUNCATE and match == m.leader_end_index and log.last_index() > match:
            # Entries past the leader's end are from older terms and cannot be committed
            # (the leader would hold them). Cut them only when all are older than this
            # term: then even a late duplicate of this request cannot cut entries this
            # leader has sent since.
            if (log.term(log.last_index()) or 0) < m.term:
                assert match >= self.commit_index
                log.truncate_and_append(match + 1, [])
                self._configs_truncated(match + 1)
        self._follower_commit(min(m.commit_index, match))
        self._push_reply(m, t, PushCode.SUCCESS, index=match)

    def _handle_install_snapshot(self, m: InstallSnapshotRequest) -> None:
        problem = self._accept_leader(m.src, m.term)
        if problem is not None:
            self._push_reply(m, PushType.INSTALL_SNAPSHOT, PushCode[problem])
            return
        snap = m.snapshot
        if snap.index <= self.commit_index:
            # We hold all of it already; what we hold up to our commit index matches.
            self._push_reply(m, PushType.INSTALL_SNAPSHOT, PushCode.SUCCESS, index=self.commit_index)
            return
        if self.log.term(snap.index) == snap.term:
            # Raft Figure 13, step 6: we hold the snapshot's last entry, so our log matches
            # up to it; keep the log (and what follows) and just learn the commit index.
            self.commit_index = snap.index
            self._configs_committed()
            self._push_reply(m, PushType.INSTALL_SNAPSHOT, PushCode.SUCCESS, index=snap.index)
            return
        self.log.restore(snap.index, snap.term)
        self.commit_index = snap.index
        if snap.membership:
            self._configs = []
            self._committed_membership = Membership.decode(snap.membership)
            self._set_membership(self._committed_membership, snap.index)
        self._ready.snapshot = snap
        self._push_reply(m, PushType.INSTALL_SNAPSHOT, PushCode.SUCCESS, index=snap.index)

    def _handle_timeout_now(self, m: TimeoutNow) -> None:
        if m.term != self.term or m.src != self.leader_id or not self._can_campaign():
            return
        self._start_election(transfer=True)

    def _handle_read_index_request(self, m: ReadIndexRequest) -> None:
        if self.role != Role.LEADER or m.term > self.term:
            self._send(ReadIndexResponse(self.id, m.src, self.term, m.ctx, 0, False))
            return
        self._leader_read(PendingRead(m.ctx, 0, m.src))

    def _handle_read_index_response(self, m: ReadIndexResponse) -> None:
        if m.ok and m.term == self.term and m.src == self.leader_id:
            self._ready.read_states.append(ReadState(m.ctx, m.index))
        else:
            self._ready.read_failures.append(ReadFailed(m.ctx, self.leader_id))


_HANDLERS = {
    VoteRequest: RaftCore._handle_vote_request,
    VoteResponse: RaftCore._handle_vote_response,
    HeartbeatRequest: RaftCore._handle_heartbeat,
    HeartbeatResponse: RaftCore._handle_heartbeat_response,
    PushRequest: RaftCore._handle_push,
    PushResponse: RaftCore._handle_push_response,
    InstallSnapshotRequest: RaftCore._handle_install_snapshot,
    TimeoutNow: RaftCore._handle_timeout_now,
    ReadIndexRequest: RaftCore._handle_read_index_request,
    ReadIndexResponse: RaftCore._handle_read_index_response,
}
