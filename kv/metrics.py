"""A node's metrics, through prometheus_client, in a registry of the node's own.

Several kv.Node may live in one process (the tests, an embedded cluster), so nothing here
touches prometheus_client's global default registry. Events on the hot path (a ledger
write, an applied batch, an HTTP request) observe `Buckets`: plain lists of counts, no lock
(prometheus_client's Histogram takes a mutex per bucket and sum, a few percent of a
leader's CPU per request); everything else (indexes, roles, counters the layers keep as
plain integers) is read when Prometheus scrapes. The names follow what an etcd operator already
graphs (README.md, "Metrics", lists them; docker/ has a dashboard and alert rules).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from bisect import bisect_left

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from .node import request_forwarded  # noqa: F401  (for kv.http: set when a request went to the leader)

# Request latency, 0.5 ms .. 5 s. Disk latency as etcd buckets its WAL fsync: 1 ms doubling.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
DISK_BUCKETS = (0.0001, 0.0005) + tuple(0.001 * 2**i for i in range(14))
CONTENT_TYPE = CONTENT_TYPE_LATEST

_STATUS = {code: str(code) for code in range(100, 600)}

ROLES = ("follower", "pre_candidate", "candidate", "leader")


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except OSError:  # removed while we walked (a compaction, a snapshot rotation)
                pass
    return total


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _by_peer(family: GaugeMetricFamily | CounterMetricFamily, values: Iterable[tuple[str, float]]):
    for peer, v in values:
        family.add_metric([peer], v)
    return family


class _NodeCollector:
    """What a scrape reads from the node: its status, and the counters the layers keep."""

    def __init__(self, node) -> None:
        self.node = node

    def collect(self) -> Iterable[Metric]:
        node = self.node
        raft = node.raft
        if raft is None:
            return
        s = node.status()
        r = raft.metrics()
        yield _gauge("kv_has_leader", "1 if this node knows a leader.", 1.0 if s.get("leader") else 0.0)
        yield _gauge("kv_is_leader", "1 if this node is the leader.", 1.0 if s.get("role") == "leader" else 0.0)
        role = GaugeMetricFamily("kv_role", "1 for this node's current role.", labels=["role"])
        for name in ROLES:
            role.add_metric([name], 1.0 if s.get("role") == name else 0.0)
        yield role
        for f, doc in (
            ("term", "Current term."),
            ("commit_index", "Highest log index known committed."),
            ("applied_index", "Highest log index applied to the state machine."),
            ("ledger_begin_index", "ledgerBeforeBeginIndex: entries up to here are compacted."),
            ("ledger_end_index", "Last index in the ledger."),
            ("snapshot_index", "Index of the newest snapshot."),
        ):
            yield _gauge(f"kv_{f}", doc, float(s.get(f) or 0))
        yield _counter("kv_leader_changes", "Times this node saw a new leader.", r.leader_changes)
        yield _gauge("kv_proposals_pending", "Writes proposed on this node, not yet committed or failed.", r.pending_proposals)
        yield _counter("kv_proposals", "Entries proposed on this node as leader.", r.proposals)
        yield _counter("kv_proposals_failed", "Writes that failed: no leader in time, outcome unknown, node stopping.", node.counters["proposals_failed"])
        yield _counter("kv_ledger_fsyncs", "Group-committed ledger writes (one fsync each).", r.writes)
        yield _counter("kv_ledger_fsynced_entries", "Entries written to the ledger.", r.fsynced_entries)
        yield _counter("kv_raft_ready", "Ready batches the driver handled.", r.ready)
        last = r.ledger_end_index
        lag = GaugeMetricFamily("kv_replication_lag_entries", "Leader only: entries each follower is behind.", labels=["peer"])
        yield _by_peer(lag, ((p, float(last - pr.match)) for p, pr in r.peers.items()))
        cfg = node.config
        yield _gauge("kv_leases", "Live leases.", len(node.sm.leases.ttl_ms))
        yield _gauge("kv_sessions", "Open client sessions (exactly-once writes), in the state machine.", len(node.sm.sessions))
        yield _counter("kv_sessions_evicted", "Client sessions closed to open new ones beyond --max-sessions.", node.sm.sessions.evicted)
        yield _counter("kv_session_copies", "Writes applied here that were copies of one applied before: answered with its result, not applied again.", node.sm.copies)
        yield _counter("kv_writes_resent", "Writes this node sent again, in the same session request, after their outcome was unknown (a leader change).", node.counters["writes_resent"])
        watches, buffered = node.watches.stats()
        yield _gauge("kv_watches", "Open watches on this node (in-process and streams).", watches)
        yield _gauge("kv_watch_buffered_bytes", "Bytes of changes buffered for watches that have not taken them yet.", buffered)
        yield _gauge("kv_state_size_bytes", "Bytes of the state machine (LevelDB) on disk.", _dir_bytes(cfg.state_path))
        disk = node.disk
        yield _gauge("kv_disk_free_bytes", "Free bytes on the disk of the data dir (as last checked, once a second).", float(disk.free or 0))
        yield _gauge("kv_alarm_nospace", "1 while the node refuses writes for lack of disk space (below --min-free-bytes, or full).", 1.0 if disk.why() else 0.0)
        yield _gauge("kv_ledger_size_bytes", "Bytes of the ledger (LMDB) on disk.", _dir_bytes(cfg.ledger_path))
        yield from self._peers(r.transport)
        yield from self._snapshots(node.snapshots.stats)

    @staticmethod
    def _peers(t) -> Iterable[Metric]:
        """Present on a node without peers too (all zero), so that queries find them."""
        yield _by_peer(CounterMetricFamily("kv_peer_sent_bytes", "Bytes of frames sent to each peer.", labels=["peer"]), t.sent_bytes.items())
        yield _by_peer(CounterMetricFamily("kv_peer_received_bytes", "Bytes received from each peer.", labels=["peer"]), t.received_bytes.items())
        yield _counter("kv_peer_frames_sent", "Frames sent to peers.", t.frames_sent)
        yield _counter("kv_peer_frames_dropped", "Frames not sent: no connection, or the peer too slow.", t.frames_dropped)
        yield _counter("kv_peer_connections_rejected", "Peer connections refused (handshake, secret, membership).", t.connections_rejected)

    @staticmethod
    def _snapshots(st) -> Iterable[Metric]:
        yield _counter("kv_snapshot_saves", "Snapshots taken.", st.taken)
        yield _counter("kv_snapshot_save_seconds", "Seconds spent writing snapshots.", st.take_seconds)
        yield _gauge("kv_snapshot_last_save_seconds", "Duration of the last snapshot.", st.last_take_seconds)
        yield _counter("kv_snapshot_sends", "Snapshots streamed to followers.", st.sent)
        yield _counter("kv_snapshot_send_failures", "Snapshot streams to followers that failed.", st.send_failures)
        yield _counter("kv_snapshot_installs", "Snapshots installed from a leader.", st.installed)
        yield _counter("kv_snapshot_install_rejections", "Snapshots from a leader refused (damaged, out of date).", st.install_rejected)
        yield _counter("kv_snapshot_compactions", "Ledger compactions after a snapshot.", st.compactions)


class Buckets:
    """A histogram (with labels, or none) that Prometheus reads as one. observe() is a
    bisect and two increments. Each is written by one thread (the event loop's, or the
    ledger writer's for fsyncs), so no lock: a scrape from another thread may see a sum a
    moment ahead of its count, which the next scrape puts right."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()) -> None:
        self.name, self.doc, self.bounds, self.labels = name, doc, buckets, labels
        self._series: dict[tuple[str, ...], list] = {}  # labels -> [counts per bucket (+Inf last), sum]

    def observe(self, value: float, *labels: str) -> None:
        s = self._series.get(labels)
        if s is None:
            s = self._series[labels] = [[0] * (len(self.bounds) + 1), 0.0]
        s[0][bisect_left(self.bounds, value)] += 1
        s[1] += value

    def collect(self) -> Iterable[Metric]:
        h = HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))
        for labels, (counts, total) in list(self._series.items()):
            cumulative, running = [], 0
            for bound, n in zip((*map(str, self.bounds), "+Inf"), counts):
                running += n
                cumulative.append((bound, running))
            h.add_metric(list(labels), cumulative, total)
        yield h


class _Read:
    """A counter or gauge read when scraped."""

    def __init__(self, name: str, doc: str, read: Callable[[], float], kind=_counter) -> None:
        self.name, self.doc, self.read, self.kind = name, doc, read, kind

    def collect(self) -> Iterable[Metric]:
        yield self.kind(self.name, self.doc, self.read())


class NodeMetrics:
    """The metrics of one kv.Node; `render()` is the text GET /metrics serves."""

    def __init__(self, node) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        r.register(_NodeCollector(node))
        self.commit_latency = Buckets("kv_commit_latency_seconds", "Time from proposing a write to its apply on the leader.", LATENCY_BUCKETS)
        self.fsync = Buckets("kv_ledger_fsync_duration_seconds", "Seconds per group-committed ledger write, fsync included.", DISK_BUCKETS)
        self.apply = Buckets("kv_apply_duration_seconds", "Seconds to apply one batch of committed entries to the state machine.", DISK_BUCKETS)
        self._http = Buckets("kv_http_request_duration_seconds", "HTTP requests by route and status.", LATENCY_BUCKETS, ("route", "status"))
        self._rtt = Buckets("kv_peer_round_trip_time_seconds", "Heartbeat round trip to each peer.", LATENCY_BUCKETS, ("peer",))
        for h in (self.commit_latency, self.fsync, self.apply, self._http, self._rtt):
            r.register(h)
        # Connections the HTTP listener refused: kv serve points this at its listener.
        self.http_refused: Callable[[], float] = lambda: 0
        r.register(_Read("kv_http_connections_refused", "Client connections answered 503 beyond --max-http-connections.", lambda: self.http_refused()))
        self.http_unread: Callable[[], float] = lambda: 0
        r.register(_Read("kv_http_unread_bytes", "Bytes of answers queued for clients that are not reading them (--http-unread-bytes).", lambda: self.http_unread(), _gauge))

    def observe_http(self, route: str, status: int, seconds: float) -> None:
        self._http.observe(seconds, route, _STATUS.get(status) or str(status))

    def observe_rtt(self, peer: str, seconds: float) -> None:
        self._rtt.observe(seconds, peer)

    def render(self) -> bytes:
        return generate_latest(self.registry)
