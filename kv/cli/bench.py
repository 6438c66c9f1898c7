"""`kv bench`: rerunnable benchmarks. Every cluster runs on loopback with fsync on.

    kv bench commit    replication path: in-process leader + 2 `kv serve` follower
                       processes; concurrent proposers of 100-byte entries
    kv bench store     kv.open (single node, in-process): puts, txn batches, gets;
                       and a 3-node in-process cluster
    kv bench http      a `kv serve` cluster driven over HTTP by closed-loop aiohttp clients
    kv bench failover  kill -9 of the leader to the first commit on a new leader
    kv bench snapshot  snapshot save rate; catch-up of a follower far behind
    kv bench watch     watch streams: one watcher's events/s, commit-to-delivery with 100
                       watchers, 1,000 idle watchers' memory and effect on writes
    kv bench lease     the leader's CPU with 10,000 leases kept alive; lock hand-over time
    kv bench history   what the history costs: versions/s and bytes per kept version, the
                       purge of a million versions after a Compact (its time and memory)

Figures are printed as a table and can be written as JSON (--json FILE). The machine may
be shared and noisy: compare figures taken side by side in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="run a benchmark (see kv bench --help)", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.set_defaults(run=run)
    bs = b.add_subparsers(dest="bench_cmd", metavar="BENCH")

    def common(p):
        p.add_argument("--seconds", type=float, default=5.0, help="measured seconds per cell (default 5)")
        p.add_argument("--json", help="also write the figures to this JSON file")
        p.add_argument("--keep", help="use this directory and keep it (default: a temporary one)")
        return p

    c = common(bs.add_parser("commit", help="replication path: concurrent proposers on a 3-node cluster"))
    c.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    common(bs.add_parser("store", help="kv.open: puts (1 and 64 threads), txn batches, gets; 3-node in-process cluster"))
    f = common(bs.add_parser("failover", help="kill -9 of the leader to the first commit on a new leader"))
    f.add_argument("--runs", type=int, default=5)
    f.add_argument("--heartbeat-ms", type=int, default=100)
    f.add_argument("--election-timeout-ms", type=int, default=1000)
    sn = common(bs.add_parser("snapshot", help="snapshot save rate; a follower a million keys behind catching up"))
    sn.add_argument("--keys", type=int, default=1_000_000)
    sk = common(bs.add_parser("spark", help="Spark import into a 3-node cluster and export from a snapshot (needs the spark extra)"))
    sk.add_argument("--rows", type=int, default=0, help="import the first ROWS flights (default: all 336,776)")
    sk.add_argument("--keys", type=int, default=1_000_000)
    from .spark import spark_options

    spark_options(sk, ship=False)
    h = common(bs.add_parser("http", help="a kv serve cluster over HTTP: PUT, linearizable and stale GET"))
    h.add_argument("--nodes", type=int, default=3)
    h.add_argument("--value-bytes", type=int, default=100)
    h.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[64])
    from ..bench.watch import add_arguments

    add_arguments(common(bs.add_parser("watch", help="watch streams: events/s, delivery latency, idle watchers")))
    from ..bench.lease import add_arguments as lease_arguments

    lease_arguments(common(bs.add_parser("lease", help="leases kept alive: the leader's CPU; lock hand-over latency")))
    from ..bench.history import add_arguments as history_arguments

    history_arguments(common(bs.add_parser("history", help="the history's cost: versions/s, bytes per version, purging a million")))


def run(args) -> int:
    from ..bench.history import bench_history
    from ..bench.lease import bench_lease
    from ..bench.runs import bench_commit, bench_failover, bench_http, bench_snapshot, bench_spark, bench_store
    from ..bench.watch import bench_watch
    from ..server.process import install_uvloop

    install_uvloop()
    fn = {
        "watch": bench_watch,
        "lease": bench_lease,
        "history": bench_history,
        "commit": bench_commit,
        "http": bench_http,
        "store": bench_store,
        "failover": bench_failover,
        "snapshot": bench_snapshot,
        "spark": bench_spark,
    }.get(args.bench_cmd)
    if fn is None:
        print("kv bench: choose a benchmark; see kv bench --help", file=sys.stderr)
        return 2
    from .refusal import debug_wanted

    args.spark_quiet = not debug_wanted(getattr(args, "debug", False))  # kv bench spark: Spark's log with --debug
    rows = asyncio.run(fn(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": args.bench_cmd, "rows": rows, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f, indent=1)
    return 0

