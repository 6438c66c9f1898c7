"""The leader's replication to its followers (DLedger's EntryDispatcher): pure, no I/O and
no clock (the core passes `now` in).

The core owns the term, the role and the commit index; this module owns the leader's view
of each follower (a `Progress`, see progress.py) and decides per follower what to send
next: a COMPARE or TRUNCATE probe, APPEND batches within an in-flight window and a
flow-control quota, a COMMIT for an idle follower, a snapshot, heartbeats. It reads the
follower's answers back into that view and tells the core when a match index moved (the
core then looks for a new commit index). Messages leave through the `send` callable the
core hands in, snapshot streams through `send_snapshot`.

The follower's side of a push (`match_push`) is here too: where the leader's entries meet
the follower's log, and what the follower cuts and appends.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from . import quorum
from .config import CoreConfig
from .errors import CommittedEntryConflict
from .log import RaftLog, entry_size
from .membership import Membership
from .messages import CoreMessage, Entry, HeartbeatRequest, HeartbeatResponse, PushCode, PushRequest, PushResponse, PushType
from .progress import DispatcherState, Progress
from .ready import LostEntries, SnapshotSend


class Replication:
    def __init__(
        self,
        config: CoreConfig,
        log: RaftLog,
        send: Callable[[CoreMessage], None],
        send_snapshot: Callable[[SnapshotSend], None],
        lost: Callable[[LostEntries], None],
    ) -> None:
        self.cfg = config
        self.id = config.node_id
        self.log = log
        self._send = send
        self._send_snapshot = send_snapshot
        self._lost = lost
        self.term = 0  # the term this node leads in
        self.progress: dict[str, Progress] = {}  # empty unless leading
        self.needed = False  # something may be sent: the next Ready dispatches

    # ======================================================================================
    # The followers

    def start(self, term: int, membership: Membership, last_index: int) -> None:
        """This node leads `term` from now on: every follower starts with a COMPARE."""
        self.term = term
        self.progress = {}
        self.reconfigure(membership, last_index)

    def stop(self) -> None:
        self.progress = {}
        self.needed = False

    def reconfigure(self, membership: Membership, last_index: int) -> None:
        """Follow the members of `membership` (a new one starts with a COMPARE)."""
        for m in membership.members.values():
            if m.id == self.id:
                continue
            pr = self.progress.get(m.id)
            if pr is None or pr.ledger != m.ledger:
                # new, or joined again from another data dir: the old one's match means nothing
                pr = self.progress[m.id] = Progress(m.id, m.voter, next=last_index + 1, ledger=m.ledger)
                pr.reset(DispatcherState.COMPARE, last_index + 1)
            pr.voter = m.voter
        for gone in set(self.progress) - membership.ids:
            del self.progress[gone]

    # ======================================================================================
    # Sending

    def dispatch_all(self, commit_index: int, now: float) -> None:
        self.needed = False
        for pr in self.progress.values():
            self._dispatch(pr, commit_index, now)

    def _dispatch(self, pr: Progress, commit_index: int, now: float) -> None:
        cfg, log = self.cfg, self.log
        st = pr.state
        if st == DispatcherState.APPEND:
            last = log.last_index()
            pr.hold_due = None
            while pr.next <= last and not pr.window_full(cfg.max_inflight_msgs, cfg.max_inflight_bytes):
                if pr.next <= log.before_index:
                    pr.reset(DispatcherState.INSTALL_SNAPSHOT, pr.next)
                    self._dispatch(pr, commit_index, now)
                    return
                if pr.inflight and last - pr.next + 1 < cfg.max_batch_entries:
                    # Nagle's rule: a batch short of max_batch_entries waits for the answer in
                    # flight, for append_hold_ms at most, and goes out with what is proposed
                    # meanwhile as one APPEND. See CoreConfig.append_hold_ms. (Decided before
                    # the entries are read: a dispatch while held costs nothing.)
                    hold_until = pr.inflight[-1].sent_at + cfg.append_hold_ms
                    if now < hold_until:
                        pr.hold_due = hold_until
                        break
                batch = log.entries(pr.next, last + 1, cfg.max_batch_bytes, cfg.max_batch_entries)
                size = sum(map(entry_size, batch))
                if last - pr.next > cfg.quota_lag_entries and not pr.quota_allows(
                    now, size, cfg.quota_bytes_per_second
                ):
                    break  # far behind and over quota: wait for the next window
                prev = pr.next - 1
                commit = min(commit_index, batch[-1].index)
                self._send(
                    PushRequest(self.id, pr.peer, self.term, PushType.APPEND, pr.seq, prev, log.term(prev), batch, commit, last)
                )
                pr.sent_commit = max(pr.sent_commit, commit)
                pr.sent(batch[0].index, batch[-1].index, now, size)
            if pr.inflight:
                pr.commit_due = None
            else:
                commit = min(commit_index, pr.match)
                if commit <= pr.sent_commit:
                    pr.commit_due = None
                elif pr.commit_due is None:
                    pr.commit_due = now + cfg.commit_notify_delay_ms
                elif now >= pr.commit_due:
                    # DLedger's COMMIT request: an idle follower learns the commit index.
                    pr.sent_commit, pr.commit_due = commit, None
                    self._send(PushRequest(self.id, pr.peer, self.term, PushType.COMMIT, pr.seq, 0, 0, (), commit, last))
            return
        if pr.probe_sent_at is not None:
            return  # one COMPARE / TRUNCATE / INSTALL_SNAPSHOT at a time
        if st == DispatcherState.INSTALL_SNAPSHOT:
            pr.probe_sent_at, pr.streaming = now, True
            self._send_snapshot(SnapshotSend(pr.peer, pr.seq))
            return
        prev = pr.next - 1
        prev_term = log.term(prev)
        if prev_term is None:  # compacted away: the follower needs a snapshot
            pr.reset(DispatcherState.INSTALL_SNAPSHOT, pr.next)
            self._dispatch(pr, commit_index, now)
            return
        pr.probe_sent_at = now
        if st == DispatcherState.COMPARE:
            self._send(PushRequest(self.id, pr.peer, self.term, PushType.COMPARE, pr.seq, prev, prev_term, (), 0, log.last_index()))
        else:  # TRUNCATE carries the first batch after the match point
            last = log.last_index()
            batch = log.entries(pr.next, last + 1, cfg.max_batch_bytes, cfg.max_batch_entries)
            commit = min(commit_index, prev + len(batch))
            self._send(
                PushRequest(self.id, pr.peer, self.term, PushType.TRUNCATE, pr.seq, prev, prev_term, batch, commit, last)
            )

    def heartbeats(self, commit_index: int, read_seq: int) -> None:
        for pr in self.progress.values():
            commit = min(commit_index, pr.match)
            self._send(HeartbeatRequest(self.id, pr.peer, self.term, commit, read_seq))

    def tick(self, now: float) -> None:
        """Re-push what waited too long; notice COMMIT requests that have come due."""
        for pr in self.progress.values():
            if pr.timed_out(now, self.cfg.push_timeout_ms):
                self._repush(pr)
            elif (pr.commit_due is not None and now >= pr.commit_due) or (pr.hold_due is not None and now >= pr.hold_due):
                self.needed = True

    def next_deadline(self, deadline: float) -> float:
        """`deadline`, or the earliest COMMIT request or held APPEND due before it."""
        for pr in self.progress.values():
            if pr.commit_due is not None and pr.commit_due < deadline:
                deadline = pr.commit_due
            if pr.hold_due is not None and pr.hold_due < deadline:
                deadline = pr.hold_due
        return deadline

    def _repush(self, pr: Progress) -> None:
        """Nothing came back in time: send again from the follower's match point."""
        if pr.state == DispatcherState.APPEND:
            pr.reset(DispatcherState.APPEND, pr.match + 1)
        elif pr.delivered:
            # The follower got the whole snapshot but its answer was lost (a full link
            # drops it): ask where its log is now. Unless it failed to install it, that is
            # at the snapshot's index, at or past our log's start, and replication goes on
            # from there; else the COMPARE fails and the snapshot is sent again.
            pr.reset(DispatcherState.COMPARE, self.log.before_index + 1)
        else:
            pr.reset(pr.state, pr.next)
        self.needed = True

    def peer_connected(self, peer: str) -> None:
        """Anything sent while the link to peer was down is lost: send it again now."""
        pr = self.progress.get(peer)
        if pr is not None and (pr.inflight or pr.probe_sent_at is not None):
            self._repush(pr)

    def report_snapshot(self, peer: str, seq: int, ok: bool, now: float) -> None:
        pr = self.progress.get(peer)
        if pr is None or pr.seq != seq or pr.state != DispatcherState.INSTALL_SNAPSHOT:
            return
        # Failed: sent again after the push timeout. Succeeded: the follower's core has the
        # snapshot and answers with a PushResponse (after its ledger is reset), which moves
        # us on; if that answer does not come within the push timeout, a COMPARE asks where
        # the follower is (see _repush).
        pr.probe_sent_at, pr.streaming, pr.delivered = now, False, ok

    # ======================================================================================
    # Answers (the core has checked the term and that `m.src` is followed)

    def heartbeat_answered(self, m: HeartbeatResponse, now: float, commit_index: int) -> bool:
        """A successful heartbeat answer. Returns whether it confirmed a newer read round."""
        pr = self.progress[m.src]
        pr.recent_active = True
        pr.last_heard = now
        if pr.match < self.log.last_index() or pr.sent_commit < min(commit_index, pr.match):
            self.needed = True
        if m.read_seq > pr.read_acked:
            pr.read_acked = m.read_seq
            return True
        return False

    def heartbeat_lost(self, peer: str) -> None:
        """The follower answered a heartbeat that its log ends before what it acknowledged.
        Ask where it ends (COMPARE): its answer lowers the match (push_answered). An idle
        leader pushes nothing else, and would not hear of it until the next write."""
        pr = self.progress[peer]
        if pr.state != DispatcherState.COMPARE or pr.probe_sent_at is None:
            pr.reset(DispatcherState.COMPARE, pr.next)
            self.needed = True

    def push_answered(self, m: PushResponse, now: float) -> bool:
        """An answer to a push (not INCONSISTENT_LEADER). Returns whether the follower's
        match index moved."""
        pr = self.progress[m.src]
        pr.recent_active = True
        pr.last_heard = now
        if m.code == PushCode.SUCCESS:
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
            self.needed = True
            return moved
        if m.code != PushCode.INCONSISTENT_STATE or m.seq != pr.seq:
            return False  # an answer to something we no longer wait for
        self.needed = True
        log = self.log
        if m.end_index < pr.match:
            # Entries it acknowledged in this term are gone (a follower's log only loses
            # entries of earlier terms): its disk was wiped or replaced. Its match index
            # no longer holds (counted, a larger cluster could commit on copies that are
            # not there), and keeping it would re-push from match + 1 to a follower that
            # answers with this gap, forever.
            self._lost(LostEntries(m.src, pr.match, m.end_index))
            pr.match = m.end_index
        if m.x_term:
            # Fast backup (xTerm/xIndex): skip the follower's whole conflicting term, or to
            # the end of that term in our log if we have it.
            ours = log.last_index_of_term(m.x_term, m.index)
            nxt = ours + 1 if ours else m.x_index
            pr.reset(DispatcherState.COMPARE, min(nxt, log.last_index() + 1))
        elif pr.state == DispatcherState.COMPARE:
            pr.reset(DispatcherState.COMPARE, min(m.end_index, log.last_index()) + 1)
        else:  # a gap in APPEND: continue from where the follower's ledger ends
            pr.reset(DispatcherState.APPEND, min(m.end_index, log.last_index()) + 1)
        if pr.next - 1 < log.before_index:
            pr.reset(DispatcherState.INSTALL_SNAPSHOT, pr.next)
        return False

    # ======================================================================================
    # Questions

    def quorum_index(self, voters: Collection[str]) -> int:
        """QuorumAckChecker: the median watermark, the leader counting what it has fsynced."""
        match = {p: pr.match for p, pr in self.progress.items()}
        match[self.id] = self.log.durable_index
        return quorum.committed_index(match, voters)

    def quorum_active(self, voters: Collection[str]) -> bool:
        """Whether a majority answered within this check-quorum period; starts the next."""
        active = [p for p, pr in self.progress.items() if pr.recent_active] + [self.id]
        for pr in self.progress.values():
            pr.recent_active = False
        return quorum.has_quorum(active, voters)

    def healthy(self, member: str, now: float) -> bool:
        """A follower heard from within an election timeout and replicated to normally."""
        pr = self.progress.get(member)
        return (
            pr is not None
            and pr.state == DispatcherState.APPEND
            and pr.last_heard is not None
            and now - pr.last_heard <= self.cfg.election_timeout_ms
        )

    def lag(self, member: str) -> tuple[int, bool]:
        """How many entries `member` is behind, and whether it is replicated to normally."""
        pr = self.progress.get(member)
        if pr is None:
            return self.log.last_index(), False
        return self.log.last_index() - pr.match, pr.state == DispatcherState.APPEND

    def status(self) -> dict:
        return {
            p: {"state": pr.state.value, "match": pr.match, "next": pr.next, "inflight": len(pr.inflight), "voter": pr.voter}
            for p, pr in self.progress.items()
        }


def match_push(
    log: RaftLog,
    m: PushRequest,
    commit_index: int,
    truncated: Callable[[int], None],
    appended: Callable[[Sequence[Entry]], None],
) -> tuple[PushCode, dict[str, int]]:
    """A follower takes a COMPARE, TRUNCATE or APPEND push into its log. Returns the answer's
    code and fields (`index`: the match point on SUCCESS). `truncated(index)` and
    `appended(entries)` hear of what was cut from and added to the log."""
    t = m.type
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
        return PushCode.INCONSISTENT_STATE, {}
    local = log.term(prev)
    if local != prev_term:
        if prev <= commit_index:
            raise CommittedEntryConflict(m.dst, m.src, m.term, prev, local, prev_term)
        return PushCode.INCONSISTENT_STATE, {"index": prev, "x_term": local, "x_index": log.first_index_of_term(local, prev)}
    if t == PushType.COMPARE:
        return PushCode.SUCCESS, {"index": prev}
    # APPEND / TRUNCATE: skip entries we already hold; a conflicting one is cut (TRUNCATE)
    # or reported (APPEND, which never cuts).
    last = log.last_index()
    k = 0
    while k < len(entries) and entries[k].index <= last:
        e = entries[k]
        if log.term(e.index) != e.term:
            if e.index <= commit_index:
                raise CommittedEntryConflict(m.dst, m.src, m.term, e.index, log.term(e.index), e.term)
            if t != PushType.TRUNCATE:
                x_term = log.term(e.index) or 0
                return PushCode.INCONSISTENT_STATE, {"index": e.index, "x_term": x_term, "x_index": log.first_index_of_term(x_term, e.index)}
            log.truncate_and_append(e.index, entries[k:])
            truncated(e.index)
            appended(entries[k:])
            k = len(entries)
            break
        k += 1
    if k < len(entries):
        log.append(entries[k:])
        appended(entries[k:])
    match = entries[-1].index if entries else prev
    if t == PushType.TRUNCATE and match == m.leader_end_index and log.last_index() > match:
        # Entries past the leader's end are from older terms and cannot be committed
        # (the leader would hold them). Cut them only when all are older than this
        # term: then even a late duplicate of this request cannot cut entries this
        # leader has sent since.
        if (log.term(log.last_index()) or 0) < m.term:
            assert match >= commit_index
            log.truncate_and_append(match + 1, [])
            truncated(match + 1)
    return PushCode.SUCCESS, {"index": match}
