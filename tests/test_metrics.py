"""Metrics through prometheus_client: types, names, a registry per node, who may read them,
and the access log (in-process nodes behind aiohttp's test server)."""

from __future__ import annotations

import json
import logging
import os
import re

import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer
from inproc import InprocCluster
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from kv import Node, NodeConfig
from kv.bench.harness import poll
from kv.http.app import create_app

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TYPES = {
    "kv_has_leader": "gauge",
    "kv_is_leader": "gauge",
    "kv_leader_changes": "counter",
    "kv_followers_lost_entries": "counter",
    "kv_proposals_pending": "gauge",
    "kv_proposals": "counter",
    "kv_proposals_failed": "counter",
    "kv_ledger_fsync_duration_seconds": "histogram",
    "kv_apply_duration_seconds": "histogram",
    "kv_commit_latency_seconds": "histogram",
    "kv_http_request_duration_seconds": "histogram",
    "kv_state_size_bytes": "gauge",
    "kv_ledger_size_bytes": "gauge",
    "kv_snapshot_saves": "counter",
    "kv_snapshot_installs": "counter",
    "kv_snapshot_index": "gauge",
    "kv_peer_sent_bytes": "counter",
    "kv_peer_received_bytes": "counter",
    "kv_peer_round_trip_time_seconds": "histogram",
    "kv_replication_lag_entries": "gauge",
    "kv_term": "gauge",
    "process_cpu_seconds": "counter",
    "process_resident_memory_bytes": "gauge",
    "python_gc_collections": "counter",
    "python_info": "gauge",
}


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(fams: dict, name: str, suffix: str = "", **labels) -> float:
    fam = fams[name]
    return sum(s.value for s in fam.samples if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))


async def start_single(tmp_path, **options):
    node = Node(NodeConfig(id="n1", data_dir=str(tmp_path / "n1"), **options))
    await node.start()
    while node.raft.leader_id is None:
        await node.raft.leader_changed.wait()
    client = TestClient(TestServer(create_app(node, token=options.get("token"), access_log=True)))
    await client.start_server()
    return node, client


async def test_every_metric_has_its_type_and_counts_what_happened(tmp_path):
    node, client = await start_single(tmp_path)
    try:
        for i in range(3):
            assert (await client.put(f"/v1/kv/k{i}", data=b"v")).status == 200
        assert (await client.get("/v1/kv/missing")).status == 404
        r = await client.get("/metrics")
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=")
        fams = families(await r.text())
        for name, typ in TYPES.items():
            assert name in fams, name
            assert fams[name].type == typ, (name, fams[name].type)
        assert sample(fams, "kv_has_leader") == 1 and sample(fams, "kv_is_leader") == 1
        assert sample(fams, "kv_leader_changes", "_total") == 1
        assert sample(fams, "kv_proposals_pending") == 0
        assert sample(fams, "kv_ledger_fsync_duration_seconds", "_count") >= 3
        assert sample(fams, "kv_apply_duration_seconds", "_count") >= 1
        assert sample(fams, "kv_commit_latency_seconds", "_count") == 3
        assert sample(fams, "kv_http_request_duration_seconds", "_count", route="kv_put", status="200") == 3
        assert sample(fams, "kv_http_request_duration_seconds", "_count", route="kv_get", status="404") == 1
        assert sample(fams, "kv_state_size_bytes") > 0
    finally:
        await client.close()
        await node.stop()


async def test_each_node_has_its_own_registry(tmp_path):
    a, ca = await start_single(tmp_path / "a")
    b, cb = await start_single(tmp_path / "b")
    try:
        await ca.put("/v1/kv/x", data=b"1")
        fa = families(await (await ca.get("/metrics")).text())
        fb = families(await (await cb.get("/metrics")).text())
        assert sample(fa, "kv_http_request_duration_seconds", "_count", route="kv_put") == 1
        assert sample(fb, "kv_http_request_duration_seconds", "_count", route="kv_put") == 0
        assert REGISTRY.get_sample_value("kv_has_leader") is None  # nothing in the global registry
    finally:
        for c, n in ((ca, a), (cb, b)):
            await c.close()
            await n.stop()


@pytest.mark.parametrize("public", [False, True])
async def test_probes_never_need_the_token_and_metrics_does_unless_public(tmp_path, public):
    node, client = await start_single(tmp_path, token="s3cret", metrics_public=public)
    try:
        assert (await client.get("/healthz")).status == 200
        assert (await client.get("/readyz")).status == 200
        assert (await client.get("/metrics")).status == (200 if public else 401)
        assert (await client.get("/metrics", headers={"Authorization": "Bearer s3cret"})).status == 200
        assert (await client.get("/v1/status")).status == 401
    finally:
        await client.close()
        await node.stop()


def _rtt_peers(fams: dict) -> set[str]:
    return {s.labels["peer"] for s in fams["kv_peer_round_trip_time_seconds"].samples if s.name.endswith("_count") and s.value > 0}


async def test_peer_metrics_and_the_access_log_of_a_forwarded_write(tmp_path, caplog):
    cluster = InprocCluster(str(tmp_path))
    await cluster.start()
    client = None
    try:
        leader = await cluster.leader()
        follower = (await cluster.followers())[0]
        client = TestClient(TestServer(create_app(follower, access_log=True)))
        await client.start_server()
        with caplog.at_level(logging.INFO, logger="kv.access"):
            assert (await client.put("/v1/kv/fw", data=b"1")).status == 200
            assert (await client.get("/v1/status")).status == 200
        lines = [r for r in caplog.records if r.name == "kv.access"]
        assert [(r.http["route"], r.http["status"], r.http["forwarded"]) for r in lines] == [("kv_put", 200, True), ("status", 200, False)]
        assert all(r.http["method"] in ("PUT", "GET") and r.http["duration_ms"] >= 0 for r in lines)
        peers = {p for p in cluster.ids if p != leader.config.id}
        def rtt_of_both():  # heartbeats go out every 50 ms; wait until both were answered
            fams = families(leader.metrics.render().decode())
            return fams if _rtt_peers(fams) == peers else None

        fams = await poll(rtt_of_both, timeout=10, error="no round trip to both followers")
        for p in peers:
            assert sample(fams, "kv_peer_sent_bytes", "_total", peer=p) > 0
            assert sample(fams, "kv_peer_received_bytes", "_total", peer=p) > 0
        assert _rtt_peers(fams) == peers
        assert {s.labels["peer"] for s in fams["kv_replication_lag_entries"].samples} == peers
    finally:
        if client is not None:
            await client.close()
        await cluster.stop()


def exposed_names(text: str) -> set[str]:
    """Every series name the exposition can hold, from its # TYPE lines (a histogram with
    no labelled child yet has no samples, but its name is real)."""
    suffixes = {"counter": ("",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, typ = line.split()
            names |= {name + s for s in suffixes.get(typ, ("",))}
    return names


async def names_a_node_exposes(tmp_path) -> set[str]:
    node, client = await start_single(tmp_path)
    try:
        return exposed_names(await (await client.get("/metrics")).text())
    finally:
        await client.close()
        await node.stop()


def query_names(expr: str) -> set[str]:
    return set(re.findall(r"\b((?:kv|process|python)_[a-z0-9_]+)\b", expr))


async def test_dashboard_and_alert_rules_query_metrics_that_exist(tmp_path):
    names = await names_a_node_exposes(tmp_path)
    with open(os.path.join(ROOT, "docker", "grafana", "ledgerkv-dashboard.json")) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    with open(os.path.join(ROOT, "docker", "prometheus", "alerts.yml")) as f:
        rules = [r for g in yaml.safe_load(f)["groups"] for r in g["rules"]]
    alerts = {r["alert"]: r["expr"] for r in rules}
    assert {"KvNoLeader", "KvFrequentLeaderChanges", "KvSlowFsync", "KvFollowerLagging"} <= set(alerts)
    for expr in exprs + list(alerts.values()):
        used = query_names(expr)
        assert used and used <= names, (expr, used - names)
    with open(os.path.join(ROOT, "docker", "prometheus", "prometheus.yml")) as f:
        assert yaml.safe_load(f)["rule_files"] == ["alerts.yml"]


async def test_docs_list_metrics_that_exist(tmp_path):
    names = await names_a_node_exposes(tmp_path)
    with open(os.path.join(ROOT, "docs", "operations.md")) as f:
        readme = f.read()
    section = readme[readme.index("**Metrics.**"):readme.index("`docker/grafana/ledgerkv-dashboard.json`")]
    listed = set(re.findall(r"`(kv_[a-z0-9_]+)", section))
    histograms = {n.removesuffix("_bucket") for n in names if n.endswith("_bucket")}
    series = {n for n in names if not n.endswith(("_bucket", "_count", "_sum", "_created"))} | histograms
    assert len(listed) > 30 and listed <= series, listed - series
    assert {n for n in series if n.startswith("kv_")} <= listed  # every kv_ metric is documented


def test_buckets_render_as_prometheus_client_histogram_does():
    """kv.server.metrics.Buckets (lock-free, on the hot path) reads as prometheus_client's own
    Histogram would for the same observations: bounds, cumulative counts, count, sum."""
    from prometheus_client import CollectorRegistry, Histogram

    from kv.server.metrics import DISK_BUCKETS, Buckets

    ours, theirs = CollectorRegistry(), CollectorRegistry()
    b = Buckets("kv_x_seconds", "doc", DISK_BUCKETS, ("route",))
    ours.register(b)
    h = Histogram("kv_x_seconds", "doc", ["route"], buckets=DISK_BUCKETS, registry=theirs)
    for v in (0.0, 0.0001, 0.00010001, 0.004, 0.0041, 3.0, 8.192, 100.0):
        for route in ("put", "get"):
            b.observe(v, route)
            h.labels(route).observe(v)

    def samples(reg):
        return sorted(
            (s.name, tuple(sorted(s.labels.items())), s.value)
            for m in reg.collect()
            for s in m.samples
            if not s.name.endswith("_created")
        )

    assert samples(ours) == samples(theirs)
    assert ("kv_x_seconds_count", (("route", "put"),), 8.0) in samples(ours)
