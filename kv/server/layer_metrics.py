"""The lower layers' figures as metrics samples (kv/server/samples.py): the Raft driver and
its peer transport, the state machine, the snapshot manager and the data dir on disk. Those
layers keep plain integers and know nothing of metrics; the node registers these readers
beside the samples of its own parts."""

from __future__ import annotations

from collections.abc import Iterable

from ..raft.node import RaftMetrics
from ..snapshot.manager import SnapshotStats
from ..statemachine.leveldb import LevelDBStateMachine
from ..common.disk import dir_bytes
from .samples import Sample, counter, gauge, labelled

ROLES = ("follower", "pre_candidate", "candidate", "leader")


def raft_samples(r: RaftMetrics, snapshot_index: int) -> Iterable[Sample]:
    yield gauge("kv_has_leader", "1 if this node knows a leader.", 1.0 if r.leader else 0.0)
    yield gauge("kv_is_leader", "1 if this node is the leader.", 1.0 if r.role.label == "leader" else 0.0)
    yield labelled("gauge", "kv_role", "1 for this node's current role.", "role", ((name, 1.0 if r.role.label == name else 0.0) for name in ROLES))
    yield gauge("kv_term", "Current term.", r.term)
    yield gauge("kv_commit_index", "Highest log index known committed.", r.commit_index)
    yield gauge("kv_applied_index", "Highest log index applied to the state machine.", r.applied_index)
    yield gauge("kv_ledger_begin_index", "ledgerBeforeBeginIndex: entries up to here are compacted.", r.ledger_begin_index)
    yield gauge("kv_ledger_end_index", "Last index in the ledger.", r.ledger_end_index)
    yield gauge("kv_snapshot_index", "Index of the newest snapshot.", snapshot_index)
    yield counter("kv_leader_changes", "Times this node saw a new leader.", r.leader_changes)
    yield counter("kv_followers_lost_entries", "Leader only: times a follower answered that it lost entries it had acknowledged (a wiped or replaced data dir).", r.followers_lost_entries)
    yield gauge("kv_proposals_pending", "Writes proposed on this node, not yet committed or failed.", r.pending_proposals)
    yield counter("kv_proposals", "Entries proposed on this node as leader.", r.proposals)
    yield counter("kv_ledger_fsyncs", "Group-committed ledger writes (one fsync each).", r.writes)
    yield counter("kv_ledger_fsynced_entries", "Entries written to the ledger.", r.fsynced_entries)
    yield counter("kv_raft_ready", "Ready batches the driver handled.", r.ready)
    last = r.ledger_end_index
    yield labelled("gauge", "kv_replication_lag_entries", "Leader only: entries each follower is behind.", "peer", ((p, last - pr.match) for p, pr in r.peers.items()))
    # Present on a node without peers too (all zero), so that queries find them.
    t = r.transport
    yield labelled("counter", "kv_peer_sent_bytes", "Bytes of frames sent to each peer.", "peer", t.sent_bytes.items())
    yield labelled("counter", "kv_peer_received_bytes", "Bytes received from each peer.", "peer", t.received_bytes.items())
    yield counter("kv_peer_frames_sent", "Frames sent to peers.", t.frames_sent)
    yield counter("kv_peer_frames_dropped", "Frames not sent: no connection, or the peer too slow.", t.frames_dropped)
    yield counter("kv_peer_connections_rejected", "Peer connections refused (handshake, secret, membership).", t.connections_rejected)


def state_machine_samples(sm: LevelDBStateMachine) -> Iterable[Sample]:
    yield gauge("kv_leases", "Live leases.", len(sm.leases.ttl_ms))
    yield gauge("kv_sessions", "Open client sessions (exactly-once writes), in the state machine.", len(sm.sessions))
    yield counter("kv_sessions_evicted", "Client sessions closed to open new ones beyond --max-sessions.", sm.sessions.evicted)
    yield counter("kv_session_copies", "Writes applied here that were copies of one applied before: answered with its result, not applied again.", sm.copies)
    yield gauge("kv_compact_revision", "The revision of the last compaction applied here: reads below it and watches from before it are refused.", sm.compact_revision)
    yield gauge("kv_history_oldest_revision", "The oldest revision a read can be at here (the compact revision, or where the history began).", sm.oldest_revision())
    yield counter("kv_history_purged_changes", "Changes whose earlier versions were dropped from the history after a compaction.", sm.purged)
    yield gauge("kv_history_purge_pending", "1 while history below the compact revision is still being dropped (in batches between the node's other work).", int(sm.compact_revision > sm.purged_below))


def snapshot_samples(st: SnapshotStats) -> Iterable[Sample]:
    yield counter("kv_snapshot_saves", "Snapshots taken.", st.taken)
    yield counter("kv_snapshot_save_seconds", "Seconds spent writing snapshots.", st.take_seconds)
    yield gauge("kv_snapshot_last_save_seconds", "Duration of the last snapshot.", st.last_take_seconds)
    yield counter("kv_snapshot_sends", "Snapshots streamed to followers.", st.sent)
    yield counter("kv_snapshot_send_failures", "Snapshot streams to followers that failed.", st.send_failures)
    yield counter("kv_snapshot_installs", "Snapshots installed from a leader.", st.installed)
    yield counter("kv_snapshot_install_rejections", "Snapshots from a leader refused (damaged, out of date).", st.install_rejected)
    yield counter("kv_snapshot_compactions", "Ledger compactions after a snapshot.", st.compactions)


def disk_usage_samples(state_path: str, ledger_path: str) -> Iterable[Sample]:
    yield gauge("kv_state_size_bytes", "Bytes of the state machine (LevelDB) on disk.", dir_bytes(state_path))
    yield gauge("kv_ledger_size_bytes", "Bytes of the ledger (LMDB) on disk.", dir_bytes(ledger_path))

