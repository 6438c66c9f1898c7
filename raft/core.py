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

Beside it, as pure as it is: the leader's replication to its followers (replication.py,
over the per-follower view in progress.py), commit and vote arithmetic (quorum.py), the
read-index rounds and lease (readindex.py), the log over the ledger (log.py) and
configurations (membership.py).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

from . import quorum
from .config import CoreConfig
from .errors import CommittedEntryConflict, ConfigChangeRefused, NotLeader, TransferInProgress
from .log import LogStorage, RaftLog
from .membership import ConfigLog, Membership, check_single_change
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
    TimeoutNow,
    VoteRequest,
    VoteResponse,
    VoteResult,
)
from .progress import Progress
from .readindex import FollowerReads, PendingRead, ReadFailed, ReadIndex, ReadState
from .ready import Ready
from .replication import Replication, match_push


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
        membership_index: int = 0,
    ) -> None:
        """`membership_index`: the index of the entry `membership` came from (ConfigLog's
        `since`; a node that joined: the committed one the leader gave it)."""
        self.cfg = config
        self.id = config.node_id
        self.log = RaftLog(storage)
        self.term = hard_state.term
        self.vote = hard_state.vote
        self.role = Role.FOLLOWER
        self.leader_id: str | None = None
        # What the no-op a new leader appends carries: the application's (kv offers the
        # cluster's identity there while the state has none); Raft itself ignores it.
        self.noop_data = b""
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
        # The leader's replication to each follower (idle unless leading).
        self._repl = Replication(
            config, self.log, self._send, lambda s: self._ready.snapshot_sends.append(s), lambda lost: self._ready.lost_entries.append(lost)
        )
        self.transferee: str | None = None
        # The term in which we last sent a TimeoutNow. Its transferee may act on it at any
        # time in that term, long after the transfer was given up (a paused process, a slow
        # link), and its voters then set check-quorum's lease aside: for the rest of that term
        # our lease proves nothing, and lease reads take a heartbeat round.
        self._handed_over_in = -1
        self._transfer_deadline = 0.0
        # Read index: reads wait there until a heartbeat round confirms leadership.
        self._reads = ReadIndex()
        self._follower_reads = FollowerReads(random.Random(seed).getrandbits(64))
        self._ready = Ready()
        self._hs_dirty = False
        self._applicable_reported = self.applicable_index()
        self._configs = ConfigLog(membership, membership_index)
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
                    self._configs.append(e.index, Membership.decode(e.data))
                    self.known |= self._configs.latest.ids

    # ======================================================================================
    # Inputs

    def tick(self, now: float) -> None:
        """Let time pass: election timeouts, heartbeats, check quorum, re-push, a follower's
        read request that went unanswered (sent again)."""
        self._now = now
        if self.role == Role.LEADER:
            self._tick_leader(now)
            return
        expiry = self._follower_reads.expiry(self.cfg.election_timeout_ms)
        if expiry is not None and now >= expiry:
            self._follower_reads.ask_again()
        if now >= self._election_deadline:
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
        self._repl.needed = True
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
        if self._configs.index > self.commit_index:
            raise ConfigChangeRefused(f"a membership change (index {self._configs.index}) is still in progress; retry once it has committed")
        check_single_change(self.membership, new, self._repl.lag, self._healthy, self.cfg.promote_max_lag)
        return self.term, self._append_config(new)

    def _append_config(self, new: Membership) -> int:
        index = self.log.last_index() + 1
        self.log.append([Entry(index, self.term, EntryKind.CONFIG, new.encode())])
        self._config_appended(index, new)
        self._repl.needed = True
        return index

    def _healthy(self, member: str) -> bool:
        """This leader, or a member it heard from within an election timeout and is
        replicating to normally."""
        if member == self.id:
            return self.role == Role.LEADER
        return self._repl.healthy(member, self._now)

    def _maybe_promote(self) -> None:
        """Promote the first learner that asked to become a voter once caught up (a member
        added with voter=true), when no other change is in progress."""
        if self._configs.index > self.commit_index or self.transferee is not None or not self.committed_in_term():
            return
        cur = self.membership
        for m in sorted(cur.members.values(), key=lambda m: m.id):
            if m.promote and not m.voter:
                new = cur.with_member(replace(m, voter=True, promote=False))
                try:
                    check_single_change(cur, new, self._repl.lag, self._healthy, self.cfg.promote_max_lag)
                except ConfigChangeRefused:
                    continue  # not caught up yet: asked again at the next tick
                self._append_config(new)
                return

    @property
    def membership(self) -> Membership:
        """The newest configuration in the log, committed or not: in effect at once."""
        return self._configs.latest

    def _config_appended(self, index: int, new: Membership) -> None:
        self._configs.append(index, new)
        self._membership_changed()

    def _membership_changed(self) -> None:
        new = self._configs.latest
        self.known |= new.ids
        self._ready.membership_changed = True
        if self.role == Role.LEADER:
            self._repl.reconfigure(new, self.log.last_index())

    def _configs_truncated(self, from_index: int) -> None:
        """Entries from from_index on were cut: drop the configurations among them."""
        if self._configs.truncate(from_index):
            self._membership_changed()

    def _configs_appended(self, entries: Sequence[Entry]) -> None:
        for e in entries:
            if e.kind == EntryKind.CONFIG:
                self._config_appended(e.index, Membership.decode(e.data))

    @property
    def committed_membership(self) -> Membership:
        """The newest configuration known committed (a member removed by a change still in
        progress is in it: it must hear back until its removal commits)."""
        return self._configs.committed

    @property
    def committed_membership_index(self) -> int:
        """The index of the committed configuration's entry (what a node that joins is
        given with it: raft/membership.py ConfigLog)."""
        return self._configs.committed_index

    def _configs_committed(self) -> None:
        c = self.commit_index
        if self._configs.commit(c):
            self._ready.membership_changed = True
        if self.role == Role.LEADER and self.id not in self.membership.voters and self._configs.index <= c:
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
            self._follower_reads.add(ctx)  # asked in ready(): with the others of this turn
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
        self._repl.needed = True

    def on_persisted(self, ready: Ready) -> None:
        """The driver has fsynced what `ready` asked for."""
        if ready.entries_from or ready.snapshot is not None:
            self.log.persisted(ready.entries, ready.log_epoch)
            if self.role == Role.LEADER:
                self._maybe_commit()

    def report_snapshot(self, peer: str, seq: int, ok: bool, now: float) -> None:
        """The driver finished (ok) or gave up (not ok) streaming a snapshot to peer."""
        self._now = now
        self._repl.report_snapshot(peer, seq, ok, now)

    def peer_connected(self, peer: str, now: float) -> None:
        """The link to peer (re)connected: anything sent while it was down is lost, so
        send again now rather than after the push timeout."""
        self._now = now
        self._repl.peer_connected(peer)

    def compacted(self, index: int, term: int) -> None:
        """The driver dropped the ledger prefix up to index (it is in a snapshot)."""
        self.log.compacted(index, term)

    # ======================================================================================
    # Output

    def has_ready(self) -> bool:
        r = self._ready
        leading = self.role == Role.LEADER
        return bool(
            (leading and (self._repl.needed or self._reads.round_due()))
            or (self._asks_leader() and self._follower_reads.due())
            or self._hs_dirty
            or r.messages
            or r.persisted_messages
            or r.read_states
            or r.read_failures
            or r.snapshot_sends
            or r.lost_entries
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
            if self._repl.needed:
                self._repl.dispatch_all(self.commit_index, self._now)
        elif self._asks_leader():
            ctx = self._follower_reads.ask(self.leader_id, self._now)
            if ctx is not None:
                self._send(ReadIndexRequest(self.id, self.leader_id, self.term, ctx))
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
            return self._repl.next_deadline(d)
        expiry = self._follower_reads.expiry(self.cfg.election_timeout_ms)
        return self._election_deadline if expiry is None else min(self._election_deadline, expiry)

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
            "peers": self._repl.status(),
        }

    @property
    def progress(self) -> dict[str, Progress]:
        """The leader's view of each follower (empty unless leading)."""
        return self._repl.progress

    def committed_in_term(self) -> bool:
        """Whether this leader has committed an entry of its own term (its no-op)."""
        return self.log.term(self.commit_index) == self.term

    # ======================================================================================
    # Roles

    def _random_timeout(self) -> float:
        t = self.cfg.election_timeout_ms
        return t * (1.0 + self._rng.random() * self.cfg.election_jitter)

    def _can_campaign(self) -> bool:
        """A voter of the latest configuration; or of the committed one while the change that
        removes or demotes us is uncommitted (dissertation §4.2.2: until C_new commits, the
        servers of C_old may still lead). Else a leader that stepped down (check quorum)
        before its own removal committed left no one to finish it: C_new's voters lack the
        entry, so they still count us and need our vote, which their shorter log cannot get."""
        if self.id in self.membership.voters:
            return True
        return self._configs.index > self.commit_index and self.id in self._configs.committed.voters

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
            # a request in flight to another leader goes unanswered: this one is asked
            if leader is None:
                self._fail_follower_reads(self._follower_reads.clear())
            else:
                self._follower_reads.ask_again(leader)

    def _abandon_leadership(self) -> None:
        self._repl.stop()
        self.transferee = None
        for r in self._reads.clear():
            self._fail_read(r)

    def _start_election(self, transfer: bool) -> None:
        """Become pre-candidate (or candidate straight away for a transfer / no pre-vote)."""
        self.leader_id = None
        self._fail_follower_reads(self._follower_reads.clear())
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
        self._repl.start(self.term, self.membership, last)
        self._heartbeat_deadline = now  # announce ourselves at once
        self._check_quorum_deadline = now + self.cfg.election_timeout_ms
        self._reads.lease_start = None
        # The no-op lets entries of earlier terms commit now (Raft §5.4.2 and §8).
        self.log.append([Entry(last + 1, self.term, EntryKind.NOOP, self.noop_data)])
        self._repl.needed = True
        self._broadcast_heartbeats()

    # ======================================================================================
    # Leader: time

    def _tick_leader(self, now: float) -> None:
        cfg = self.cfg
        if now >= self._check_quorum_deadline:
            self._check_quorum_deadline = now + cfg.election_timeout_ms
            if not self._repl.quorum_active(self.membership.voters) and cfg.check_quorum:
                # We cannot reach a majority: step down so clients go elsewhere (etcd's
                # CheckQuorum; DLedger's maxHeartBeatLeak).
                self._become_follower(self.term, None)
                return
        if self.transferee is not None and now >= self._transfer_deadline:
            self.transferee = None  # the transfer did not happen in time: abort it
        self._maybe_promote()
        if now >= self._heartbeat_deadline:
            self._broadcast_heartbeats()
        self._repl.tick(now)

    def _broadcast_heartbeats(self) -> None:
        self._heartbeat_deadline = self._now + self.cfg.heartbeat_ms
        self._repl.heartbeats(self.commit_index, self._reads.new_round(self._now))
        self._advance_reads()  # a single voter confirms its own rounds

    # ======================================================================================
    # Leader: answers to pushes, commit

    def _handle_push_response(self, m: PushResponse) -> None:
        if m.term > self.term:
            self._become_follower(m.term, None)
            return
        if self.role != Role.LEADER or m.term < self.term or m.src not in self._repl.progress:
            return
        if m.code == PushCode.INCONSISTENT_LEADER:
            # Another leader in our term: a bug elsewhere. Step down rather than go on.
            self._become_follower(self.term, None)
            return
        if self._repl.push_answered(m, self._now):
            self._maybe_commit()
            if m.src == self.transferee:
                self._maybe_send_timeout_now()

    def _maybe_commit(self) -> bool:
        """QuorumAckChecker: the median watermark, counting only our own term's entries."""
        idx = self._repl.quorum_index(self.membership.voters)
        if idx > self.commit_index and self.log.term(idx) == self.term:
            self.commit_index = idx
            self._configs_committed()
            self._repl.needed = True  # tell idle followers (COMMIT)
            if self._reads.before_commit:
                self._reads.term_committed(self.commit_index)
            return True
        return False

    def _maybe_send_timeout_now(self) -> None:
        t = self.transferee
        pr = self._repl.progress.get(t) if t else None
        if pr is not None and pr.match >= self.log.last_index():
            self._handed_over_in = self.term
            self._send(TimeoutNow(self.id, pr.peer, self.term))

    # ======================================================================================
    # Leader: read index

    def _leader_read(self, read: PendingRead) -> None:
        # Until our no-op commits we do not know the latest commit index (Raft §6.4).
        self._reads.add(read, self.commit_index if self.committed_in_term() else None)

    def _advance_reads(self) -> None:
        """Answer the reads whose heartbeat round a majority has answered."""
        acked = {p: pr.read_acked for p, pr in self._repl.progress.items()}
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
            and self._handed_over_in != self.term
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
        code = HeartbeatCode.SUCCESS if m.commit_index <= self.log.last_index() else HeartbeatCode.LOST_ENTRIES
        self._send(HeartbeatResponse(self.id, m.src, self.term, code, m.read_seq), after_persist=self._hs_dirty)

    def _handle_heartbeat_response(self, m: HeartbeatResponse) -> None:
        if m.term > self.term:
            self._become_follower(m.term, None)
            return
        if self.role != Role.LEADER or m.term != self.term or m.src not in self._repl.progress:
            return
        if m.code == HeartbeatCode.INCONSISTENT_LEADER:
            self._become_follower(self.term, None)
            return
        if m.code == HeartbeatCode.SUCCESS and self._repl.heartbeat_answered(m, self._now, self.commit_index):
            self._advance_reads()
        elif m.code == HeartbeatCode.LOST_ENTRIES:
            self._repl.heartbeat_lost(m.src)

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
        c = self.commit_index
        if 0 < m.leader_end_index < c and (self.log.term(c) or 0) < m.term:
            # The leader lacks entries this node committed in an earlier term than the
            # leader's, which every leader holds from its election on (Leader Completeness):
            # a majority lost them (data dirs put back from older copies). Caught here before
            # any compare reaches them (the leader's log may end before this one's start),
            # while this node would serve linearizable reads from them.
            raise CommittedEntryConflict(self.id, m.src, m.term, c, self.log.term(c), None)
        t = m.type
        if t == PushType.COMMIT:
            self._follower_commit(m.commit_index)
            return
        code, fields = match_push(self.log, m, self.commit_index, self._configs_truncated, self._configs_appended)
        if code == PushCode.SUCCESS and t != PushType.COMPARE:
            self._follower_commit(min(m.commit_index, fields["index"]))
        self._push_reply(m, t, code, **fields)

    def _handle_install_snapshot(self, m: InstallSnapshotRequest) -> None:
        problem = self._accept_leader(m.src, m.term)
        if problem is not None:
            self._push_reply(m, PushType.INSTALL_SNAPSHOT, PushCode[problem])
            return
        snap = m.snapshot
        if snap.index <= self.commit_index:
            # We hold all of it already, so it must match what we hold (when we still hold
            # its last entry to tell). The answer is the snapshot's index, not our commit
            # index, which a leader short of our committed entries does not hold: the
            # entries it sends next are compared with ours.
            ours = self.log.term(snap.index)
            if ours is not None and ours != snap.term:
                raise CommittedEntryConflict(self.id, m.src, m.term, snap.index, ours, snap.term)
            self._push_reply(m, PushType.INSTALL_SNAPSHOT, PushCode.SUCCESS, index=snap.index)
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
        if snap.membership and self._configs.restore(Membership.decode(snap.membership), snap.index):
            self._membership_changed()
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
        reads = self._follower_reads.answered(m.ctx, m.src)
        if reads is None:
            return
        if m.ok and m.term == self.term and m.src == self.leader_id:
            self._ready.read_states.extend(ReadState(ctx, m.index) for ctx in reads)
        else:
            self._fail_follower_reads(reads)

    # Follower: reads, asked of the leader in batches

    def _asks_leader(self) -> bool:
        return self.role == Role.FOLLOWER and self.leader_id is not None

    def _fail_follower_reads(self, reads: list[int]) -> None:
        self._ready.read_failures.extend(ReadFailed(ctx, self.leader_id) for ctx in reads)


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
