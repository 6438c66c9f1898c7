"""The Raft core's tunables: timeouts, batching, flow control (plain data, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass


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
    # Nagle's rule for APPENDs: while one is in flight to a follower, a batch that is not
    # full waits for its answer, up to this long after it was sent, and then goes out with
    # everything proposed meanwhile. A follower writes one batch at a time, so what it gets
    # during an fsync waits for the next one anyway; holding it at the leader instead turns
    # many small APPENDs, fsyncs and acks into a few large ones: at 64 clients on 3 nodes
    # sharing 2 cores, about 10 % less cluster CPU per PUT and 7-13 % more PUTs/s
    # (benchmarks/README.md). The bound caps what a write can wait for this on a slow
    # link; full batches (a follower catching up) pipeline up to max_inflight_msgs.
    append_hold_ms: float = 5.0
