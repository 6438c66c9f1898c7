"""`kv spark import|export`: the Spark pipeline from the command line."""

from __future__ import annotations

import argparse
import sys
import time


def add_parser(sub) -> None:
    p = sub.add_parser("spark", help="bulk import and export through Spark (pip install ledgerkv[spark])")
    sp = p.add_subparsers(dest="spark_cmd", metavar="ACTION")
    i = sp.add_parser("import", help="write a Parquet, CSV or JSON dataset of key/value rows into a cluster")
    i.add_argument("source", help="a path Spark can read (a file or a directory)")
    i.add_argument("--endpoints", required=True, help="client URLs of the cluster, comma-separated")
    i.add_argument("--format", choices=["parquet", "csv", "json"], help="default: from the path's extension")
    i.add_argument("--key-col", default="key")
    i.add_argument("--value-col", default="value")
    i.add_argument("--batch", type=int, default=128, help="rows per transaction, at most the cluster's --max-txn-ops (default 128; batches also stop at about 512 KiB)")
    i.add_argument("--concurrency", type=int, default=4, help="batches in flight per partition (default 4)")
    i.add_argument("--token", default=None)
    i.add_argument("--master", default="local[2]")
    e = sp.add_parser("export", help="write a snapshot's records as Parquet (or any Spark format)")
    e.add_argument("out", help="output path")
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--snapshot", help="a snapshot file (kv snapshot save)")
    src.add_argument("--endpoints", help="download the newest snapshot of a node of this cluster")
    e.add_argument("--fresh", action="store_true", help="with --endpoints: have the node take a snapshot first")
    e.add_argument("--prefix", default=None, help="only keys under this prefix")
    e.add_argument("--format", default="parquet", help="a Spark output format (default parquet)")
    e.add_argument("--partitions", type=int, default=None)
    e.add_argument("--token", default=None)
    e.add_argument("--master", default="local[2]")
    g = sp.add_parser("export-log", help="write the committed log range [--from, --to] of a cluster (for audit)")
    g.add_argument("out", help="output path")
    g.add_argument("--endpoints", required=True, help="client URLs of the cluster; the first that answers is read")
    g.add_argument("--from", dest="start", type=int, default=None, help="first index (default: the oldest the node still holds)")
    g.add_argument("--to", dest="end", type=int, default=None, help="last index (default: the node's applied index)")
    g.add_argument("--format", default="parquet", help="a Spark output format (default parquet)")
    g.add_argument("--partitions", type=int, default=None)
    g.add_argument("--token", default=None)
    g.add_argument("--master", default="local[2]")


def run(args: argparse.Namespace) -> int:
    from . import spark as kvspark

    if args.spark_cmd not in ("import", "export", "export-log"):
        print("kv spark: choose import, export or export-log (kv spark --help)", file=sys.stderr)
        return 2
    s = kvspark.session(args.master)
    try:
        if args.spark_cmd == "import":
            df = kvspark.load(s, args.source, args.format)
            report = kvspark.write(df, args.endpoints, key_col=args.key_col, value_col=args.value_col, batch=args.batch, concurrency=args.concurrency, token=args.token)
            print(report.summary())
            for f in report.failures[:20]:
                print(f"  failed: {f}", file=sys.stderr)
            return 1 if report.failures else 0
        t0 = time.monotonic()
        if args.spark_cmd == "export-log":
            df = kvspark.read_log(s, args.endpoints, args.start, args.end, partitions=args.partitions, token=args.token)
            source = f"the log of {args.endpoints}"
        else:
            path = args.snapshot or kvspark.fetch_snapshot(args.endpoints, args.token, fresh=args.fresh)
            df = kvspark.read_snapshot(s, path, prefix=args.prefix, partitions=args.partitions)
            source = path
        df.write.mode("overwrite").format(args.format).save(args.out)
        rows = s.read.format(args.format).load(args.out).count()
        took = time.monotonic() - t0
        print(f"exported {rows} rows from {source} to {args.out} ({args.format}) in {took:.1f}s ({rows / took:,.0f} rows/s)")
        return 0
    finally:
        s.stop()
