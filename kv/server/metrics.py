"""A node's metrics, through prometheus_client, in a registry of the node's own.

Several kv.Node may live in one process (the tests, an embedded cluster), so nothing here
touches prometheus_client's global default registry. Events on the hot path (a ledger
write, an applied batch, an HTTP request) observe `Buckets`: plain lists of counts, no lock
(prometheus_client's Histogram takes a mutex per bucket and sum, a few percent of a
leader's CPU per request); everything else (indexes, roles, counters the layers keep as
plain integers) is read when Prometheus scrapes, from the samples each part of the node
registered (kv/server/samples.py). The names follow what an etcd operator already
graphs (README.md, "Metrics", lists them; docker/ has a dashboard and alert rules).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from .samples import Sample

# Request latency, 0.5 ms .. 5 s. Disk latency as etcd buckets its WAL fsync: 1 ms doubling.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
DISK_BUCKETS = (0.0001, 0.0005) + tuple(0.001 * 2**i for i in range(14))
CONTENT_TYPE = CONTENT_TYPE_LATEST

_STATUS = {code: str(code) for code in range(100, 600)}

Source = Callable[[], Iterable[Sample]]


def _family(s: Sample) -> Metric:
    cls = GaugeMetricFamily if s.kind == "gauge" else CounterMetricFamily
    if not s.label:
        return cls(s.name, s.doc, value=s.value)
    family = cls(s.name, s.doc, labels=[s.label])
    for key, value in s.series:
        family.add_metric([key], value)
    return family


class _Sources:
    """What a scrape reads from the parts that registered (their samples())."""

    def __init__(self) -> None:
        self.sources: list[Source] = []

    def collect(self) -> Iterable[Metric]:
        for source in self.sources:
            for sample in source():
                yield _family(sample)


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


class NodeMetrics:
    """The metrics of one kv.Node; `render()` is the text GET /metrics serves. The parts
    of the node register what they report (`register(part.samples)`); the events on the
    hot path observe the histograms below."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self._sources = _Sources()
        r.register(self._sources)
        self.commit_latency = Buckets("kv_commit_latency_seconds", "Time from proposing a write to its apply on the leader.", LATENCY_BUCKETS)
        self.fsync = Buckets("kv_ledger_fsync_duration_seconds", "Seconds per group-committed ledger write, fsync included.", DISK_BUCKETS)
        self.apply = Buckets("kv_apply_duration_seconds", "Seconds to apply one batch of committed entries to the state machine.", DISK_BUCKETS)
        self._http = Buckets("kv_http_request_duration_seconds", "HTTP requests by route and status.", LATENCY_BUCKETS, ("route", "status"))
        self._rtt = Buckets("kv_peer_round_trip_time_seconds", "Heartbeat round trip to each peer.", LATENCY_BUCKETS, ("peer",))
        for h in (self.commit_latency, self.fsync, self.apply, self._http, self._rtt):
            r.register(h)

    def register(self, source: Source) -> None:
        """Read source() at every scrape: the samples of one part of the node."""
        self._sources.sources.append(source)

    def observe_http(self, route: str, status: int, seconds: float) -> None:
        self._http.observe(seconds, route, _STATUS.get(status) or str(status))

    def observe_rtt(self, peer: str, seconds: float) -> None:
        self._rtt.observe(seconds, peer)

    def render(self) -> bytes:
        return generate_latest(self.registry)
