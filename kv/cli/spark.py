"""`kv spark import|export`: the Spark pipeline from the command line."""

from __future__ import annotations

import argparse
import contextlib
import heapq
import os
import shutil
import signal
import sys
import threading
import time

from ..spark.bulk import BATCH_BYTES, CONCURRENCY


def add_parser(sub) -> None:
    p = sub.add_parser("spark", help="bulk import and export through Spark (pip install ledgerkv[spark])")
    p.set_defaults(run=run)
    sp = p.add_subparsers(dest="spark_cmd", metavar="ACTION")
    i = sp.add_parser("import", help="write a Parquet, CSV or JSON dataset of key/value rows into a cluster")
    i.add_argument("source", help="a path Spark can read (a file, a directory or a glob); one local CSV or Parquet file of up to 64 MiB, of --key-col and --value-col, is imported without Spark (docs/spark.md)")
    i.add_argument("--endpoints", default=os.environ.get("KV_ENDPOINTS"), help="client URLs of the cluster, comma-separated (default $KV_ENDPOINTS, or the local `kv cluster up` nodes)")
    i.add_argument("--format", help="parquet, csv or json (default: from the path's extension)")
    i.add_argument("--option", action="append", default=[], metavar="K=V", help="an option for Spark's reader, e.g. --option sep=';' (repeatable); CSV defaults: header, RFC 4180 quoting, multiLine")
    i.add_argument("--key-col", default="key")
    i.add_argument("--value-col", default="value")
    i.add_argument("--key-expr", help="the key as a Spark SQL expression, e.g. \"concat_ws('/', 'flights', year, month, day, carrier, flight, origin, sched_dep_time)\"")
    i.add_argument("--value-expr", help="the value as a Spark SQL expression, e.g. 'to_json(struct(*))'")
    i.add_argument("--on-duplicate", choices=["refuse", "last"], default="refuse", help="a key that occurs more than once: refuse the import (default) or keep its last row")
    i.add_argument("--max-value-bytes", type=int, default=1 << 20, help="the cluster's --max-value-bytes (default 1048576): larger values are refused before writing")
    i.add_argument("--partitions", type=int, default=None, help="write tasks (default: 2 per core; 1 for an input under 8 MB)")
    i.add_argument("--batch", type=int, default=0, help="rows per bulk put at most (default 0: as many as --batch-bytes holds)")
    i.add_argument("--batch-bytes", type=int, default=BATCH_BYTES, help=f"bytes per bulk put at most, each one log entry: below the cluster's --max-request-bytes (default {BATCH_BYTES >> 20} MiB)")
    i.add_argument("--concurrency", type=int, default=CONCURRENCY, help=f"bulk puts in flight per task (default {CONCURRENCY})")
    i.add_argument("--errors", metavar="PATH", help="write the rows that failed here, one JSON line each: {\"key\", \"error\"}")
    i.add_argument("--timeout", type=float, default=None, help="give up after this many seconds overall; rows not written by then fail")
    i.add_argument("--token", default=os.environ.get("KV_TOKEN"), help="default $KV_TOKEN")
    spark_options(i)
    e = sp.add_parser("export", help="write a cluster's (or a snapshot file's) records as Parquet (or any Spark format)")
    e.add_argument("out", help="output path (refused if it exists, unless --overwrite)")
    src = e.add_mutually_exclusive_group()
    src.add_argument("--snapshot", help="a snapshot file (kv snapshot save)")
    src.add_argument("--endpoints", default=os.environ.get("KV_ENDPOINTS"), help="the cluster as of now: its leader pins a view of every key, which the executors read by key ranges (default $KV_ENDPOINTS, or the local `kv cluster up` nodes)")
    e.add_argument("--prefix", default=None, help="only keys under this prefix")
    e.add_argument("--format", default="parquet", help="a Spark output format (default parquet)")
    e.add_argument("--partitions", type=int, default=None)
    e.add_argument("--overwrite", action="store_true", help="replace what is at the output path")
    e.add_argument("--value-type", choices=["binary", "string"], default=None, help="the value column's type (default binary, and string for CSV, which holds text; string: a value that is not UTF-8 stops the export)")
    e.add_argument("--json-schema", help="explode JSON values into typed columns, a Spark DDL schema, e.g. 'year int, carrier string'")
    e.add_argument("--token", default=os.environ.get("KV_TOKEN"), help="default $KV_TOKEN")
    spark_options(e)
    e.add_argument("--timeout", type=float, default=None, help="give up after this many seconds (the output is then removed)")
    g = sp.add_parser(
        "export-log",
        help="write the changes of the committed range [--from, --to] (what a watch saw; --raw: the log entries as proposed)",
    )
    g.add_argument("out", help="output path")
    g.add_argument("--endpoints", default=os.environ.get("KV_ENDPOINTS"), help="client URLs of the cluster; each range is read from a member that holds it (default $KV_ENDPOINTS, or the local `kv cluster up` nodes)")
    g.add_argument("--from", dest="start", type=int, default=None, help="first index (default: the lowest any member still holds; every endpoint is asked)")
    g.add_argument("--to", dest="end", type=int, default=None, help="last index (default: the highest applied index)")
    g.add_argument("--prefix", default="", help="only changes of keys under this prefix (not with --raw)")
    g.add_argument("--raw", action="store_true", help="the log entries as proposed (term, op, conditional, branch), for audit")
    g.add_argument("--format", default="parquet", help="a Spark output format (default parquet)")
    g.add_argument("--partitions", type=int, default=None)
    g.add_argument("--overwrite", action="store_true", help="replace what is at the output path")
    g.add_argument("--token", default=os.environ.get("KV_TOKEN"), help="default $KV_TOKEN")
    spark_options(g)
    g.add_argument("--timeout", type=float, default=None, help="give up after this many seconds (the output is then removed)")


MASTER_HELP = (
    "Spark's master URL (default: Spark's own configuration — PYSPARK_SUBMIT_ARGS, spark-defaults.conf, "
    "$MASTER — and local[2] if it has none)"
)


def spark_options(p, ship: bool = True) -> None:
    """--master, --conf (and --ship-package): how Spark is started, on every command that starts it."""
    p.add_argument("--master", default=None, help=MASTER_HELP)
    p.add_argument(
        "--conf", action="append", default=[], metavar="K=V",
        help="a Spark setting, e.g. --conf spark.executor.memory=4g (repeatable; as spark-submit's --conf)",
    )
    if ship:
        p.add_argument(
            "--ship-package", action="store_true",
            help="add this ledgerkv to the executors' Python path (a zip of the installed package), for workers that do not have it installed",
        )


def _options(pairs: list[str]) -> dict[str, str]:
    from ..errors import BadRequest

    out = {}
    for p in pairs:
        k, eq, v = p.partition("=")
        if not eq or not k:
            raise BadRequest(f"--option {p!r}: give KEY=VALUE, e.g. --option sep=;")
        out[k.strip()] = v
    return out


def run(args: argparse.Namespace) -> int:
    """Errors (ours and Spark's) end as one line on stderr and a non-zero exit."""
    from pyspark.errors import PySparkException
    from py4j.protocol import Py4JError

    from ..spark.runtime import root_cause
    from .refusal import debug_wanted

    if args.spark_cmd not in ("import", "export", "export-log"):
        print("kv spark: choose import, export or export-log (kv spark --help)", file=sys.stderr)
        return 2
    try:
        return _run(args)
    except (PySparkException, Py4JError) as e:
        if debug_wanted(args.debug):
            raise
        print(f"kv spark {args.spark_cmd}: {root_cause(e)}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    from .. import spark as kvspark
    from ..client.endpoints import DEFAULT_ENDPOINTS
    from ..errors import BadRequest
    from ..spark.importer import source_format
    from ..spark.runtime import parse_conf
    from .refusal import debug_wanted

    if not args.endpoints and not getattr(args, "snapshot", None):
        args.endpoints = ",".join(DEFAULT_ENDPOINTS)  # the local `kv cluster up` nodes, as every client command
    conf = parse_conf(args.conf)
    most = 4096 if args.spark_cmd == "export" else None  # (the key ranges a node cuts a view into at most)
    if args.partitions is not None and not (1 <= args.partitions and (most is None or args.partitions <= most)):
        raise BadRequest(f"--partitions must be at least 1{f' and at most {most}' if most else ''}, not {args.partitions}")
    if args.spark_cmd == "import":
        source_format(args.source, args.format)  # a missing path fails before Spark starts
        options = _options(args.option)
        report = _import_without_spark(args, options, conf)
        if report is not None:
            return _report(report, args)
    if args.spark_cmd != "import" and os.path.exists(args.out) and not args.overwrite:
        raise BadRequest(f"{args.out} exists: choose another path, or replace it with --overwrite")
    if args.spark_cmd != "export-log":  # their own progress line (rows, rows/s, time left) instead of Spark's stages
        conf.setdefault("spark.ui.showConsoleProgress", "false")
    s = kvspark.session(args.master, conf=conf, quiet=not debug_wanted(args.debug), ship_package=args.ship_package)
    try:
        with _interruptible(s, args):
            if args.spark_cmd == "import":
                return _import(s, args, options)
            with _deadline(s, args):
                return _export(kvspark, s, args)
    finally:
        s.stop()


@contextlib.contextmanager
def _interruptible(s, args: argparse.Namespace):
    """Ctrl-C while Spark works: its jobs are cancelled from a thread of their own and the
    command ends with one line saying what is left (exit status 130); a second Ctrl-C stops
    at once. (PySpark's own handler cancels from inside the signal, in the middle of the
    main thread's call to the JVM: 48 lines of py4j errors, then the traceback.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    interrupted, done = threading.Event(), threading.Event()

    def on_sigint(signum, frame) -> None:
        if interrupted.is_set():
            raise KeyboardInterrupt
        interrupted.set()
        threading.Thread(target=_cancel_jobs_until, args=(s, done), name="kv-spark-interrupt", daemon=True).start()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    except Exception:
        if not interrupted.is_set():
            raise
        if args.spark_cmd == "import":
            left = "the rows written so far stay written; run the same import again to finish it (the rows the cluster holds already are skipped)"
        else:
            left = f"nothing was left at {args.out}" if not os.path.exists(args.out) else f"{args.out} may be incomplete"
        print(f"{args.prog_name}: interrupted (Ctrl-C): {left}", file=sys.stderr)
        raise KeyboardInterrupt from None
    finally:
        done.set()
        signal.signal(signal.SIGINT, previous)


def _cancel_jobs_until(s, done: threading.Event) -> None:
    """Cancel the session's jobs until `done`, from a thread of its own: a job submitted
    after the first cancel (a download or planning that took that long) is cancelled too."""
    while not done.is_set():
        with contextlib.suppress(Exception):  # (a session stopping meanwhile)
            s.sparkContext.cancelAllJobs()
        done.wait(0.2)


@contextlib.contextmanager
def _deadline(s, args: argparse.Namespace):
    """--timeout for an export: cancel Spark's jobs when it passes, remove what was written."""
    from ..errors import Timeout

    if not args.timeout:
        yield
        return
    passed, done = threading.Event(), threading.Event()

    def give_up():
        if done.wait(args.timeout):
            return
        passed.set()
        _cancel_jobs_until(s, done)

    threading.Thread(target=give_up, name="kv-spark-deadline", daemon=True).start()
    try:
        yield
    except Exception as e:
        if not passed.is_set():
            raise
        shutil.rmtree(args.out, ignore_errors=True)
        raise Timeout(f"gave up after {args.timeout:g}s (--timeout); nothing was left at {args.out}") from e
    finally:
        done.set()


def _export(kvspark, s, args: argparse.Namespace) -> int:
    from ..errors import BadRequest
    from ..spark.export import save

    t0 = time.monotonic()
    if args.spark_cmd == "export":
        meta = kvspark.export_snapshot(
            s, args.out, endpoints=args.endpoints, snapshot=args.snapshot, token=args.token, prefix=args.prefix, fmt=args.format,
            partitions=args.partitions, overwrite=args.overwrite, value_type=args.value_type, json_schema=args.json_schema,
            progress=sys.stderr.isatty(),
        )
        rows, source = meta["rows"], f"{meta['source']} as of index {meta['index']} (term {meta['term']})"
    else:
        if args.raw and args.prefix:
            raise BadRequest("--prefix selects changes; the raw log (--raw) is exported whole")
        # Every member is asked: by default the range starts at the lowest index any holds.
        start, end = kvspark.log_range(args.endpoints, args.start, args.end, args.token)
        if args.raw:
            df = kvspark.read_log(s, args.endpoints, start, end, partitions=args.partitions, token=args.token)
        else:
            df = kvspark.read_changes(s, args.endpoints, start, end, prefix=args.prefix, partitions=args.partitions, token=args.token)
        whence = [] if args.start is not None else ["from the oldest entry any member holds"]
        whence += [] if args.end is not None else ["to the highest applied index"]
        source = f"the {'log' if args.raw else 'changes'} [{start}, {end}]" + (f" ({', '.join(whence)})" if whence else "") + f" of {args.endpoints}"
        rows = save(df, args.out, args.format, args.overwrite)
    took = time.monotonic() - t0
    print(f"exported {rows} rows from {source} to {args.out} ({args.format}) in {took:.1f}s ({rows / took:,.0f} rows/s)")
    return 0


def _import_without_spark(args: argparse.Namespace, options: dict[str, str], conf: dict[str, str]):
    """The report of a small import run here without Spark (kv/spark/local.py), or None
    when it must go through Spark (with --debug, stderr says why)."""
    from ..spark import local
    from ..spark.runtime import resolve_master
    from .refusal import debug_wanted

    why = local.spark_needed(
        args.source, args.format, master_from=resolve_master(args.master, conf)[1], conf=conf, options=options,
        key_expr=args.key_expr, value_expr=args.value_expr, partitions=args.partitions, ship_package=args.ship_package,
    )
    table = local.read(args.source, args.format, args.key_col, args.value_col) if why is None else why
    if debug_wanted(args.debug):
        print(f"kv spark import: through Spark: {table}" if isinstance(table, str) else "kv spark import: without Spark (a small local file)", file=sys.stderr)
    elif why is None and isinstance(table, str):  # the file's content, not the user, chose Spark: say why it is slow
        print(f"kv spark import: reading the file with Spark, which takes longer: {table}", file=sys.stderr)
    if isinstance(table, str):
        return None
    return local.import_file(
        table, args.endpoints, on_duplicate=args.on_duplicate, max_value_bytes=args.max_value_bytes, batch_rows=args.batch,
        batch_bytes=args.batch_bytes, concurrency=args.concurrency, token=args.token, timeout=args.timeout, progress=sys.stderr.isatty(),
    )


def _import(s, args: argparse.Namespace, options: dict[str, str]) -> int:
    from .. import spark as kvspark

    df = kvspark.load(s, args.source, args.format, options)
    report = kvspark.write(
        df, args.endpoints, key_col=args.key_col, value_col=args.value_col, key_expr=args.key_expr, value_expr=args.value_expr,
        on_duplicate=args.on_duplicate, max_value_bytes=args.max_value_bytes, partitions=args.partitions, batch_rows=args.batch,
        batch_bytes=args.batch_bytes, concurrency=args.concurrency, token=args.token, timeout=args.timeout,
        progress=sys.stderr.isatty(),
    )
    return _report(report, args)


def _report(report, args: argparse.Namespace) -> int:
    """The summary on stdout, the failures on stderr (and in --errors PATH); 1 if any failed."""
    print(report.summary())
    if args.errors:
        import orjson

        with open(args.errors, "wb") as f:
            for key, error in report.failures:
                f.write(orjson.dumps({"key": key, "error": error}) + b"\n")
    # Rows that failed alike (a cluster that stopped answering fails thousands with one
    # reason) are one line: how many, the reason, the first few of their keys (in key order:
    # Spark's tasks report in any order, and a second run should say the same).
    alike: dict[str, list[str]] = {}
    for key, error in report.failures:
        alike.setdefault(error, []).append(key)
    groups = sorted(alike.items(), key=lambda g: (-len(g[1]), g[0]))
    for error, keys in groups[:10]:
        if len(keys) == 1:
            print(f"  failed: {keys[0]!r}: {error}", file=sys.stderr)
        else:
            print(f"  {len(keys):,} rows failed: {error} (e.g. {', '.join(map(repr, heapq.nsmallest(3, keys)))})", file=sys.stderr)
    if len(groups) > 10:
        rest = sum(len(keys) for _, keys in groups[10:])
        print(f"  ... and {rest:,} more" + (f" (all in {args.errors})" if args.errors else " (--errors PATH lists them all)"), file=sys.stderr)
    return 1 if report.failures else 0
