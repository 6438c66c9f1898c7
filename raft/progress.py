"""The leader's view of one follower: DLedger's EntryDispatcher state, as plain data.

    COMPARE ──match found──► TRUNCATE (follower holds entries past the match) ──► APPEND
       │   └───────────────────────────────(nothing to cut)──────────────────────►  │
       └──prev compacted──► INSTALL_SNAPSHOT ──installed──► APPEND ◄────────────────┘
    APPEND ──conflict──► COMPARE;  APPEND ──gap / timeout──► APPEND from match + 1

COMMIT is not a state of its own here: an idle dispatcher in APPEND sends a COMMIT request
when the follower has not heard of the newest commit index it may know.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field


class DispatcherState(enum.Enum):
    COMPARE = "compare"
    TRUNCATE = "truncate"
    APPEND = "append"
    INSTALL_SNAPSHOT = "install_snapshot"


@dataclass(slots=True)
class Inflight:
    """One APPEND batch sent and not yet acknowledged (DLedger's pendingMap entry)."""

    first: int
    last: int
    sent_at: float
    size: int


@dataclass(slots=True)
class Progress:
    peer: str
    voter: bool
    # Invariant: 0 <= match < next. `match` only grows within a term, unless the follower
    # answers that it lost what it acknowledged (replication.py, LostEntries).
    match: int = 0
    next: int = 1
    state: DispatcherState = DispatcherState.COMPARE
    # Bumped on every reset; answers carrying an older seq are stale and ignored (their
    # SUCCESS still counts: a match index is true whenever it was sent).
    seq: int = 0
    inflight: deque[Inflight] = field(default_factory=deque)
    inflight_bytes: int = 0
    probe_sent_at: float | None = None  # COMPARE / TRUNCATE / INSTALL request outstanding
    # A snapshot stream runs (the shell reports its end): it is not timed out meanwhile,
    # since a large one takes longer than the push timeout to send, verify and install
    # and the stream has its own stall detection.
    streaming: bool = False
    # The snapshot stream ended well: the follower has it. If its answer is lost, the
    # re-push asks where it is (COMPARE) instead of streaming the whole snapshot again.
    delivered: bool = False
    sent_commit: int = 0  # the highest commit index sent to this follower
    commit_due: float | None = None  # when to send a COMMIT if no APPEND carries it first
    hold_due: float | None = None  # when a held-back partial APPEND goes out (Nagle's rule)
    recent_active: bool = False  # heard from within the current check-quorum period
    last_heard: float | None = None  # when it last answered this leader (now, ms)
    read_acked: int = 0  # highest heartbeat round (read_seq) the follower answered
    # Flow-control quota (DLedger's Quota): bytes sent in the current one-second window.
    quota_window: float = 0.0
    quota_used: int = 0
    ledger: str = ""  # the member's ledger (raft/membership.py) this progress is of

    def reset(self, state: DispatcherState, next_index: int) -> None:
        """Start over from next_index in `state`; everything in flight is forgotten."""
        self.state = state
        self.next = max(next_index, self.match + 1)
        self.seq += 1
        self.inflight.clear()
        self.inflight_bytes = 0
        self.hold_due = None
        self.probe_sent_at = None
        self.streaming = False
        self.delivered = False

    def ack(self, index: int) -> bool:
        """The follower holds entries up to index. Returns whether match moved."""
        while self.inflight and self.inflight[0].last <= index:
            self.inflight_bytes -= self.inflight.popleft().size
        if index > self.match:
            self.match = index
            if self.next <= index:
                self.next = index + 1
            return True
        return False

    def sent(self, first: int, last: int, now: float, size: int) -> None:
        self.inflight.append(Inflight(first, last, now, size))
        self.inflight_bytes += size
        self.next = last + 1

    def window_full(self, max_msgs: int, max_bytes: int) -> bool:
        return len(self.inflight) >= max_msgs or self.inflight_bytes >= max_bytes

    def timed_out(self, now: float, timeout: float) -> bool:
        """Whether the oldest batch or probe has waited longer than timeout (re-push)."""
        if self.inflight:
            return now - self.inflight[0].sent_at >= timeout
        return not self.streaming and self.probe_sent_at is not None and now - self.probe_sent_at >= timeout

    def quota_allows(self, now: float, size: int, per_second: int) -> bool:
        """DLedger's push quota: at most per_second bytes in any one-second window."""
        if now - self.quota_window >= 1000.0:
            self.quota_window, self.quota_used = now, 0
        if self.quota_used and self.quota_used + size > per_second:
            return False
        self.quota_used += size
        return True
