"""etcd 3.4 and ledgerkv side by side over etcd's gRPC API, driven by etcd's own Go client.

    .venv/bin/python benchmarks/etcd_api.py                       # PUT and linearizable range, 64 and 1000 clients
    .venv/bin/python benchmarks/etcd_api.py --clients 64 --rounds 3 --seconds 10

Needs Debian's etcd-server, golang-go and golang-etcd-server-dev (the load tool,
benchmarks/etcdload/main.go, is built from them in GOPATH mode; nothing is downloaded).
Each round starts a fresh 3-node cluster of each system, in alternating order, and runs
the tool against the leader; the medians of the rounds are printed with their ratios to
etcd: operations per second, and the cluster's CPU seconds per operation (all three
members), which holds on a noisy machine where throughput does not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import resource
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from systems import Etcd  # noqa: E402

from kv.bench.harness import ServeCluster  # noqa: E402
from kv.bench.measure import http_session  # noqa: E402

TOOL = os.path.join(tempfile.gettempdir(), "ledgerkv-etcdload")


def build_tool() -> str:
    src = os.path.join(HERE, "etcdload", "main.go")
    if not os.path.exists(TOOL) or os.path.getmtime(TOOL) < os.path.getmtime(src):
        env = {**os.environ, "GO111MODULE": "off", "GOPATH": "/usr/share/gocode", "GOCACHE": os.path.join(tempfile.gettempdir(), "ledgerkv-gocache")}
        subprocess.run(["go", "build", "-o", TOOL, src], check=True, env=env)
    return TOOL


async def ledgerkv_cluster(root: str):
    c = ServeCluster(root, 3, grpc=True)
    c.start()
    async with http_session(4) as s:
        leader = await c.leader(s)
    return c, c.grpc[leader], c.procs


async def etcd_cluster(root: str):
    e = Etcd(root)
    async with http_session(4) as s:
        leader = await e.leader(s)
    return e, f"127.0.0.1:{e.client[leader]}", e.procs


SYSTEMS = {"etcd": etcd_cluster, "ledgerkv": ledgerkv_cluster}


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


async def one_run(system: str, op: str, clients: int, seconds: float) -> dict:
    root = tempfile.mkdtemp(prefix="kv-etcdapi-")
    try:
        handle, endpoint, procs = await SYSTEMS[system](root)
        try:
            if op != "put":  # every key the load reads, outside the measured part
                subprocess.run([TOOL, "-endpoints", endpoint, "-op", "fill", "-clients", "64"], check=True, capture_output=True)
            before = procs.cpu_seconds()
            tool_before = _children_cpu()
            r = subprocess.run([TOOL, "-endpoints", endpoint, "-op", op, "-clients", str(clients), "-conns", str(min(clients, 16)), "-seconds", str(seconds)],
                               check=True, capture_output=True, text=True)
            after = procs.cpu_seconds()
            tool = _children_cpu() - tool_before
        finally:
            procs.stop()
        got = json.loads(r.stdout.strip().splitlines()[-1])
        nodes = sorted((1e6 * (after[i] - before.get(i, 0)) / max(1, got["ops"]) for i in after), reverse=True)
        got["cpu_us_per_op"] = sum(nodes)
        got["nodes_us_per_op"] = nodes  # busiest first: the leader, then the followers
        got["client_us_per_op"] = 1e6 * tool / max(1, got["ops"])  # the load tool's share of the same two cores
        return got
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def main_async(args) -> None:
    build_tool()
    for op in args.ops:
        for clients in args.clients:
            runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
            for r in range(args.rounds):
                order = list(SYSTEMS) if r % 2 == 0 else list(reversed(SYSTEMS))
                for system in order:
                    got = await one_run(system, op, clients, args.seconds)
                    runs[system].append(got)
                    print(f"round {r + 1} {system:9} {op:18} {clients:5} clients  {got['ops_per_s']:9,.0f}/s  cluster {got['cpu_us_per_op']:5.0f} µs/op"
                          f" ({'/'.join(f'{x:.0f}' for x in got['nodes_us_per_op'])})  client {got['client_us_per_op']:4.0f} µs/op  p99 {got['p99_ms']:6.1f} ms  p999 {got['p999_ms']:6.1f} ms  errors {got['errors']}", flush=True)
            base = {k: statistics.median(x[k] for x in runs["etcd"]) for k in ("ops_per_s", "cpu_us_per_op")}
            print(f"\n{op}, {clients} clients, {args.rounds} rounds of {args.seconds:.0f} s; medians, ratios to etcd:")
            for system, rs in runs.items():
                t = statistics.median(x["ops_per_s"] for x in rs)
                cpu = statistics.median(x["cpu_us_per_op"] for x in rs)
                nodes = "/".join(f"{statistics.median(x['nodes_us_per_op'][k] for x in rs):.0f}" for k in range(len(rs[0]["nodes_us_per_op"])))
                print(f"  {system:9} {t:9,.0f}/s ({t / base['ops_per_s']:.2f}x)  cluster {cpu:5.0f} µs/op ({cpu / base['cpu_us_per_op']:.2f}x; leader/followers {nodes})")
            print(flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", nargs="+", default=["put", "range"], choices=["put", "range", "range-serializable"])
    ap.add_argument("--clients", nargs="+", type=int, default=[64, 1000])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=10)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
