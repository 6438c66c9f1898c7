"""ledgerkv side by side with etcd and PySyncObj, on this machine, in one run.

    .venv/bin/pip install -e '.[bench]'
    .venv/bin/python benchmarks/compare.py              # the full grid (about 25 minutes)
    .venv/bin/python benchmarks/compare.py --quick      # 64 clients, 256 B, leader only
    .venv/bin/python benchmarks/compare.py --scale      # value size, cluster size, 1M keys

Each system runs as a 3-node cluster on loopback, started fresh, and is driven by the same
closed-loop client (kv/bench/loadgen.py, keep-alive connections): PUT, linearizable GET and stale (serializable) GET; 256 B and
4 KiB values; 1, 64 and 256 clients; requests to the leader and to a follower. Every cell
is measured three times and the medians kept. Results go to benchmarks/results/:
compare.md (table with ratios), compare.json (raw) and compare.png (throughput against
clients). Every process started is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from systems import Etcd, Ledgerkv, PySyncObj  # benchmarks/ is the script's folder, first on sys.path

from kv.bench.loadgen import HttpLoad
from kv.bench.measure import closed_loop, http_ops, http_session, preload
from kv.bench.harness import ServeCluster, rss_mb

HERE = os.path.dirname(os.path.abspath(__file__))

OPS = ("PUT", "GET linearizable", "GET stale")
AIOHTTP_ONLY = "ledgerkv (aiohttp only)"
SYSTEMS = {  # --systems names -> the clusters they start, in order
    "ledgerkv": [Ledgerkv],
    "ledgerkv-aiohttp": [lambda root: Ledgerkv(root, aiohttp_only=True)],
    "etcd": [Etcd],
    "pysyncobj": [lambda root: PySyncObj(root, True), lambda root: PySyncObj(root, False)],
}


async def measure(system_factory, values, targets, concurrency, seconds, repeats) -> list[dict]:
    root = tempfile.mkdtemp(prefix="kvcompare-")
    system = system_factory(root)
    rows = []
    try:
        async with http_session(8) as s, HttpLoad() as load:
            lead = await system.leader(s)
            follower = next(i for i in system.ids if i != lead)
            for vsize in values:
                value = (os.urandom(vsize // 2 + 1).hex().encode())[:vsize]
                await preload((await system.ops(load, lead, value))[0][1])
                for target in targets:
                    nid = lead if target == "leader" else follower
                    ops = dict(await system.ops(load, nid, value))
                    for conc in concurrency:
                        for op in OPS:
                            runs = [await closed_loop(ops[op], conc, seconds, cpu=system.cpu) for _ in range(repeats)]
                            rows.append(
                                {
                                    "system": system.name,
                                    "op": op,
                                    "value": vsize,
                                    "to": target,
                                    "clients": conc,
                                    "ops_per_s": statistics.median(r["ops_per_s"] for r in runs),
                                    "p50_ms": statistics.median(r["p50_ms"] for r in runs),
                                    "p99_ms": statistics.median(r["p99_ms"] for r in runs),
                                    "errors": sum(r["errors"] for r in runs),
                                    "cpu_us_per_op": statistics.median(r.get("cpu_us_per_op", 0.0) for r in runs),
                                    "cpu_us_per_op_by_node": runs[len(runs) // 2].get("cpu_us_per_op_by_node", {}),
                                    "client_cpu_us_per_op": statistics.median(r["client_cpu_us_per_op"] for r in runs),
                                    "runs": [round(r["ops_per_s"]) for r in runs],
                                }
                            )
                            print(f"  {system.name:28} {op:17} {vsize:5} B to {target:8} {conc:3} clients: "
                                  f"{rows[-1]['ops_per_s']:8.0f}/s p50 {rows[-1]['p50_ms']:6.2f} p99 {rows[-1]['p99_ms']:7.2f} ms "
                                  f"cpu {rows[-1]['cpu_us_per_op']:6.0f} us/op (client {rows[-1]['client_cpu_us_per_op']:4.0f})", flush=True)
    finally:
        system.close()
        shutil.rmtree(root, ignore_errors=True)
    return rows


def table(rows: list[dict]) -> str:
    systems = list(dict.fromkeys(r["system"] for r in rows))
    pso = [s for s in systems if s.startswith("pysyncobj")]
    cells = {}
    for r in rows:
        cells[(r["op"], r["value"], r["to"], r["clients"], r["system"])] = r
    keys = sorted({k[:4] for k in cells}, key=lambda k: (OPS.index(k[0]), k[1], k[2] != "leader", k[3]))
    head = (
        ["op", "value", "to", "clients"]
        + [f"{s} ops/s (p50/p99 ms) cpu µs/op [client's]" for s in systems]
        + ["ledgerkv/etcd", "cpu/op ledgerkv/etcd", "ledgerkv/PySyncObj best"]
        + (["fast path: ops/s, cpu/op"] if AIOHTTP_ONLY in systems else [])
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in keys:
        row = [k[0], f"{k[1]} B", k[2], str(k[3])]
        for s in systems:
            c = cells.get(k + (s,))
            row.append(
                f"{c['ops_per_s']:,.0f} ({c['p50_ms']:.1f}/{c['p99_ms']:.1f}) {c.get('cpu_us_per_op', 0):,.0f} [{c.get('client_cpu_us_per_op', 0):,.0f}]"
                + (f" {c['errors']} err" if c["errors"] else "")
                if c
                else "-"
            )
        ours = cells.get(k + ("ledgerkv",))
        etcd = cells.get(k + ("etcd",))
        best = max((cells[k + (s,)]["ops_per_s"] for s in pso if k + (s,) in cells), default=None)
        row.append(f"{ours['ops_per_s'] / etcd['ops_per_s']:.2f}x" if ours and etcd and etcd["ops_per_s"] else "-")
        row.append(f"{ours['cpu_us_per_op'] / etcd['cpu_us_per_op']:.2f}x" if ours and etcd and etcd.get("cpu_us_per_op") else "-")
        row.append(f"{ours['ops_per_s'] / best:.2f}x" if ours and best else "-")
        if AIOHTTP_ONLY in systems:
            slow = cells.get(k + (AIOHTTP_ONLY,))
            row.append(f"{ours['ops_per_s'] / slow['ops_per_s']:.2f}x, {ours['cpu_us_per_op'] / slow['cpu_us_per_op']:.2f}x" if ours and slow else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, op in zip(axes, OPS):
        for system in dict.fromkeys(r["system"] for r in rows):
            pts = sorted((r["clients"], r["ops_per_s"]) for r in rows if r["system"] == system and r["op"] == op and r["to"] == "leader" and r["value"] == min(x["value"] for x in rows))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
        ax.set_title(f"{op}, to the leader")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("operations per second")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("3-node clusters on loopback, one 2-core machine, fsync on (PySyncObj: no fsync)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def scale(seconds: float) -> list[dict]:
    """ledgerkv: value size and cluster size; and a million keys: RSS, disk, restart."""
    rows = []
    for nodes in (3, 5):
        root = tempfile.mkdtemp(prefix="kvscale-")
        with ServeCluster(root, nodes) as c:
            c.start()
            async with http_session(8) as s, HttpLoad() as load:
                lead = await c.leader(s)
                sizes = (256, 4096, 65536) if nodes == 3 else (256,)
                for vsize in sizes:
                    value = os.urandom(vsize)
                    ops = dict(await http_ops(load, c.url(lead), value))
                    await preload(ops["PUT"], keys=2000)
                    for op in ("PUT", "GET linearizable"):
                        r = await closed_loop(ops[op], 64, seconds)
                        rows.append({"what": f"{nodes} nodes, {vsize} B values, 64 clients: {op}", **r})
                        print(f"  {rows[-1]['what']}: {r['ops_per_s']:,.0f}/s p50 {r['p50_ms']:.2f} p99 {r['p99_ms']:.2f}", flush=True)
        shutil.rmtree(root, ignore_errors=True)
    rows += await million_keys()
    return rows


def du(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


async def million_keys(n: int = 1_000_000) -> list[dict]:
    import orjson

    rows = []
    root = tempfile.mkdtemp(prefix="kvmillion-")
    with ServeCluster(root, 3) as c:
        c.start()
        async with http_session(8) as s:
            lead = await c.leader(s)
            batch = 2000
            it = iter(range(n // batch))

            async def loader():
                for b in it:
                    doc = {"success": [{"op": "put", "key": f"key/{b * batch + k:08d}", "value": "v" * 100} for k in range(batch)]}
                    async with s.post(c.url(lead) + "/v1/txn", data=orjson.dumps(doc)) as r:
                        await r.read()

            t0 = time.perf_counter()
            await asyncio.gather(*(loader() for _ in range(4)))
            rows.append({"what": f"load {n:,} keys of 100 B (txn of {batch})", "seconds": time.perf_counter() - t0})
            for i in c.ids:
                async with s.post(c.url(i) + "/v1/snapshot") as r:
                    await r.read()
            await asyncio.sleep(1)
            for i in c.ids:
                rows.append({"what": f"{i}: RSS after {n:,} keys", "MB": rss_mb(c.procs[i].pid)})
                rows.append({"what": f"{i}: disk per key (ledger + state + snapshots)", "bytes": du(os.path.join(root, i)) / n})
            c.procs.stop()
            t0 = time.perf_counter()
            c.start()
            while True:
                try:
                    async with s.get(c.url(lead) + "/v1/kv/key/00000001") as r:
                        if r.status == 200:
                            break
                except Exception:
                    pass
                await asyncio.sleep(0.05)
            rows.append({"what": f"restart all 3 nodes to a linearizable read served ({n:,} keys)", "seconds": time.perf_counter() - t0})
            await asyncio.sleep(1)
            for i in c.ids:
                rows.append({"what": f"{i}: RSS after restart", "MB": rss_mb(c.procs[i].pid)})
    shutil.rmtree(root, ignore_errors=True)
    for r in rows:
        print("  " + ", ".join(f"{k} {v:,.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()), flush=True)
    return rows


async def main(args) -> None:
    os.makedirs(args.out, exist_ok=True)
    if args.scale:
        rows = await scale(args.seconds)
        with open(os.path.join(args.out, "scale.json"), "w") as f:
            json.dump(rows, f, indent=1)
        return
    values, targets, conc = ((256,), ("leader",), (64,)) if args.quick else ((256, 4096), ("leader", "follower"), (1, 64, 256))
    if args.clients:
        conc = tuple(int(x) for x in args.clients.split(","))
    names = args.systems.split(",")
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise SystemExit(f"--systems: unknown {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    rows = []
    for f in (f for name in names for f in SYSTEMS[name]):
        rows += await measure(f, values, targets, conc, args.seconds, args.repeats)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with open(os.path.join(args.out, "compare.json"), "w") as fh:
        json.dump({"when": stamp, "seconds": args.seconds, "repeats": args.repeats, "rows": rows}, fh, indent=1)
    md = [
        f"# ledgerkv, etcd and PySyncObj side by side ({stamp})",
        "",
        f"`python benchmarks/compare.py {' '.join(sys.argv[1:])}` — 3-node clusters on loopback, one 2-core machine; "
        f"closed-loop keep-alive clients (kv/bench/loadgen.py; its own CPU per op in brackets); each cell the median of {args.repeats} runs of {args.seconds:g} s. ledgerkv and etcd fsync "
        "every commit; PySyncObj 0.3 never fsyncs its journal. Linearizable GET on PySyncObj is a replicated no-op first "
        "(it has no read index). Ratios are ledgerkv's throughput over the other's.",
        "",
        table(rows),
        "",
    ]
    with open(os.path.join(args.out, "compare.md"), "w") as fh:
        fh.write("\n".join(md))
    plot(rows, os.path.join(args.out, "compare.png"))
    print("\n".join(md))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--scale", action="store_true")
    p.add_argument("--clients", help="comma-separated client counts, e.g. 64,1000 (default: the grid's)")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--systems", default="ledgerkv,etcd,pysyncobj", help=f"comma-separated, of {', '.join(SYSTEMS)} (default: ledgerkv,etcd,pysyncobj)")
    a = p.parse_args()
    from kv.server.process import install_uvloop

    install_uvloop()
    asyncio.run(main(a))
