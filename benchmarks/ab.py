"""Two or more `kv serve` settings side by side, in alternating order, on fresh clusters.

    .venv/bin/python benchmarks/ab.py --variant fast= --variant aiohttp=--http-aiohttp-only
    .venv/bin/python benchmarks/ab.py --op "GET linearizable" --rounds 6 --variant a= --variant b=--heartbeat-ms=50
    git worktree add /tmp/before HEAD~3
    .venv/bin/python benchmarks/ab.py --variant before= --variant now= --tree before=/tmp/before
                        # two versions of the code: a variant's nodes run from another checkout

Each round starts a fresh 3-node cluster per variant (preloaded, then one closed-loop run
of --seconds), and every other round reverses the order: a cluster started right after
another runs on its dirty pages and its deleted files, which on this machine biased the
second of a pair by up to 20 %. Prints each run, then the medians and their ratios to the
first variant: throughput, the cluster's CPU per operation and the leader's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile

from kv.bench.loadgen import HttpLoad
from kv.bench.measure import closed_loop, http_ops, http_session, preload
from kv.bench.harness import ServeCluster


async def run_once(flags: list[str], op: str, clients: int, seconds: float, tree: str | None = None) -> tuple[float, float, float, float]:
    root = tempfile.mkdtemp(prefix="kv-ab-")
    # A checkout first on the nodes' path: `python -m kv` imports it (kv/__init__.py maps its folders).
    env = {**os.environ, "PYTHONPATH": tree} if tree else None
    try:
        with ServeCluster(root, 3, flags, env=env) as c:
            c.start()
            async with http_session(8) as s, HttpLoad() as load:
                lead = await c.leader(s)
                ops = dict(await http_ops(load, c.url(lead), b"x" * 256))
                await preload(ops["PUT"])
                r = await closed_loop(ops[op], clients, seconds, cpu=c.procs.cpu_seconds)
                return r["ops_per_s"], r["cpu_us_per_op"], r["cpu_us_per_op_by_node"][lead], r["p99_ms"]
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def main(a) -> None:
    variants = {}
    for v in a.variant:
        name, _, flags = v.partition("=")
        variants[name] = flags.split() if flags else []
    trees = dict(t.partition("=")[::2] for t in a.tree)
    runs: dict[str, list] = {k: [] for k in variants}
    for rnd in range(a.rounds):
        order = list(variants.items())
        for name, flags in order if rnd % 2 == 0 else order[::-1]:
            runs[name].append(await run_once(flags, a.op, a.clients, a.seconds, trees.get(name)))
            ops, cpu, leader, p99 = runs[name][-1]
            print(f"round {rnd + 1} {name:12} {ops:8,.0f}/s  cluster {cpu:5.0f} µs/op  leader {leader:5.0f} µs/op  p99 {p99:6.1f} ms", flush=True)
    base = next(iter(runs))

    def med(name: str, j: int) -> float:
        return statistics.median(r[j] for r in runs[name])

    print(f"\n{a.op}, {a.clients} clients, {a.rounds} rounds of {a.seconds:g} s; medians, ratios to {base}:")
    for name in runs:
        print(
            f"  {name:12} {med(name, 0):8,.0f}/s ({med(name, 0) / med(base, 0):.2f}x)  cluster {med(name, 1):5.0f} µs/op ({med(name, 1) / med(base, 1):.2f}x)"
            f"  leader {med(name, 2):5.0f} µs/op ({med(name, 2) / med(base, 2):.2f}x)  p99 {med(name, 3):6.1f} ms"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", required=True, help="NAME=FLAGS for kv serve (space-separated; may be empty); two or more")
    p.add_argument("--tree", action="append", default=[], help="NAME=DIR: run that variant's nodes from the checkout in DIR (another version)")
    p.add_argument("--op", default="PUT", choices=["PUT", "GET linearizable", "GET stale"])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    if len(args.variant) < 2:
        p.error("give two or more --variant NAME=FLAGS")
    from kv.server.process import install_uvloop

    install_uvloop()
    asyncio.run(main(args))
