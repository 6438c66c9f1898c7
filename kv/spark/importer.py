"""Import through Spark: read a dataset, shape it into (key, value) rows, check every row
before the first write, then write them from the tasks (kv.spark.bulk does the writing).

    df = kv.spark.load(spark, "flights.csv")
    report = kv.spark.write(df, endpoints, key_expr="concat_ws('/', 'flights', year, month, day, carrier, flight)",
                            value_expr="to_json(struct(*))")

The check is one pass over the data: null keys or values, duplicate keys (refused unless
on_duplicate="last", which keeps the last occurrence in the source's order) and values
above the cluster's limit are reported in a few lines and nothing is written. The rows are
then range-partitioned and sorted by key, so each task reads back one key range of the
cluster and proposes only what differs.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import time
from dataclasses import asdict, dataclass, field

import orjson

from ..errors import BadRequest, Forbidden, Unauthorized, Unavailable
from ..statemachine.commands import MAX_KEY_BYTES
from .bulk import BATCH_BYTES, CONCURRENCY

FORMATS = {"parquet": "parquet", "csv": "csv", "json": "json", "jsonl": "json", "ndjson": "json"}
# RFC 4180, as pandas, Excel and Spark write it: quotes inside a quoted field are doubled,
# and a quoted field may span lines.
# (How an export writes CSV: this reads it back. Spark's CSV writer trims spaces from both
# ends of a value unless told not to; its reader keeps them.)
CSV_WRITTEN = {"header": "true", "quote": '"', "escape": '"', "ignoreLeadingWhiteSpace": "false", "ignoreTrailingWhiteSpace": "false"}
CSV_DEFAULTS = {**CSV_WRITTEN, "multiLine": "true"}
DUPLICATES = ("refuse", "last")
DEFAULT_MAX_VALUE_BYTES = 1 << 20  # the cluster's default --max-value-bytes
CHUNK_ROWS = 10_000  # rows per Arrow batch a task sorts into (Spark's maxRecordsPerBatch)


@dataclass
class ImportReport:
    rows: int = 0
    written: int = 0
    skipped: int = 0  # the cluster already held the value
    failures: list[tuple[str, str]] = field(default_factory=list)  # (key, reason)
    transactions: int = 0  # bulk puts the cluster took: log entries
    wire_bytes: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        rate = self.rows / self.seconds if self.seconds else 0.0
        return (
            f"imported {self.rows} rows: {self.written} written, {self.skipped} skipped (already held, or superseded by a later row of their key), "
            f"{len(self.failures)} failed; {self.transactions} log entries, {self.wire_bytes / 1e6:.1f} MB on the wire, "
            f"{self.seconds:.1f}s ({rate:,.0f} rows/s)"
        )


def spark_error(e: Exception) -> str:
    """The first line of a Spark error, without the JVM stack."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return lines[0][:500] if lines else type(e).__name__


def source_format(path: str, fmt: str | None) -> str:
    """The format to read `path` as; refuses a missing local path or an unknown format
    (checked before Spark starts)."""
    if "://" not in path and not glob.glob(path):
        raise BadRequest(f"{path}: no such file or directory")
    if fmt is None:
        ext = os.path.splitext(path.rstrip("/"))[1].lstrip(".").lower()
        fmt = FORMATS.get(ext) or ("parquet" if not ext else None)
        if fmt is None:
            raise BadRequest(f"cannot tell the format of {path!r} from its extension: give --format parquet, csv or json")
    elif fmt not in FORMATS:
        raise BadRequest(f"unknown format {fmt!r}: choose parquet, csv or json")
    return fmt


def load(spark, path: str, fmt: str | None = None, options: dict[str, str] | None = None):
    """A DataFrame from a Parquet, CSV (header line, RFC 4180 quoting) or JSON-lines path;
    `options` go to Spark's reader and win over the defaults."""
    from pyspark.errors import PySparkException

    fmt = source_format(path, fmt)
    opts = dict(CSV_DEFAULTS) if FORMATS[fmt] == "csv" else {}
    opts.update(options or {})
    try:
        return spark.read.format(FORMATS[fmt]).options(**opts).load(path)
    except PySparkException as e:
        raise BadRequest(f"{path}: {spark_error(e)}") from None


def shape(df, *, key_col: str = "key", value_col: str = "value", key_expr: str | None = None, value_expr: str | None = None):
    """df as two columns: key (string) and value (string or binary). Expressions are Spark
    SQL over df's columns; other atomic types are cast to string; nested ones refused."""
    from pyspark.errors import PySparkException
    from pyspark.sql import functions as F

    cols = []
    for role, col, expr in (("key", key_col, key_expr), ("value", value_col, value_expr)):
        if expr is None and col not in df.columns:
            raise BadRequest(f"the data has no column {col!r} (its columns: {', '.join(df.columns)}); choose one with --{role}-col or build one with --{role}-expr")
        try:
            c = F.expr(expr) if expr is not None else F.col(f"`{col}`")
            kind = df.select(c).dtypes[0][1]
        except PySparkException as e:
            raise BadRequest(f"--{role}-expr {expr!r}: {spark_error(e)}") from None
        if kind.startswith(("struct", "array", "map")):
            hint = f"e.g. --{role}-expr \"to_json({expr or col})\"" if role == "value" else f"build a string with --{role}-expr"
            raise BadRequest(f"the {role} is a {kind.split('<')[0]} ({kind[:80]}): a {role} must be a string ({hint})")
        if kind != "string" and not (role == "value" and kind == "binary"):
            c = c.cast("string")  # numbers, dates, booleans: their text form
        cols.append(c.alias(role))
    return df.select(*cols)


def refuse_unknown_choice(on_duplicate: str) -> None:
    if on_duplicate not in DUPLICATES:
        raise BadRequest(f"--on-duplicate (on_duplicate=) must be one of {', '.join(DUPLICATES)}")


def check(kv, *, max_value_bytes: int, on_duplicate: str = "refuse", partitions: int = 4):
    """One pass over (key, value) rows before anything is written. Returns (rows, the rows
    range-partitioned and sorted by key (duplicates in the source's order), cached: unpersist
    it once written); raises BadRequest listing what is wrong."""
    from pyspark.sql import functions as F

    refuse_unknown_choice(on_duplicate)
    by = ["key"]
    if on_duplicate == "last":  # the last row of a key in the source's order wins: keep that order
        kv, by = kv.withColumn("_order", F.monotonically_increasing_id()), ["key", "_order"]
    ordered = kv.repartitionByRange(partitions, "key").sortWithinPartitions(*by).select("key", "value").persist()
    try:
        st = Checked()
        for r in ordered.mapInArrow(lambda batches: check_task(batches, max_value_bytes), "stats binary").collect():
            st.add(Checked(**orjson.loads(r.stats)))
    except BaseException:
        ordered.unpersist()
        raise
    try:
        st.refuse_if_wrong(max_value_bytes, on_duplicate)
    except BadRequest:
        ordered.unpersist()
        raise
    return st.rows, ordered


@dataclass
class Checked:
    """What the check found in some rows (sorted by key)."""

    rows: int = 0
    null_keys: int = 0
    empty_keys: int = 0
    null_values: list = field(default_factory=list)  # keys (every one counted, a few kept)
    null_value_count: int = 0
    dup_keys: int = 0  # keys that occur more than once
    dup_rows: int = 0  # rows beyond the first of their key
    dup_examples: list = field(default_factory=list)  # [key, count]
    big: int = 0
    big_examples: list = field(default_factory=list)  # [key, bytes]
    reserved_keys: int = 0  # starting with a NUL byte: ledgerkv's own records
    long_keys: int = 0  # above MAX_KEY_BYTES

    def add(self, o: Checked) -> None:
        for name in ("rows", "null_keys", "empty_keys", "null_value_count", "dup_keys", "dup_rows", "big", "reserved_keys", "long_keys"):
            setattr(self, name, getattr(self, name) + getattr(o, name))
        self.null_values = (self.null_values + o.null_values)[:3]
        self.dup_examples = (self.dup_examples + o.dup_examples)[:3]
        self.big_examples = (self.big_examples + o.big_examples)[:3]

    def refuse_if_wrong(self, limit: int, on_duplicate: str) -> None:
        """BadRequest listing the problems, if any: nothing may be written then. (A line
        each, ended by ";": the CLI prints the message as one line, where the ";" still
        separates them.)"""
        problems = self.problems(limit, on_duplicate)
        if problems:
            raise BadRequest(f"refused before writing anything ({_count(self.rows, 'row')} checked):\n  " + ";\n  ".join(problems))

    def problems(self, limit: int, on_duplicate: str) -> list[str]:
        def eg(items, lead: str = ", ") -> str:
            items = list(items)
            return f"{lead}e.g. " + ", ".join(items) if items else ""

        out = []
        if self.null_keys:
            out.append(f"{_count(self.null_keys, 'row')} with a null key")
        if self.empty_keys:
            out.append(f"{_count(self.empty_keys, 'row')} with an empty key")
        if self.reserved_keys:
            out.append(f"{_count(self.reserved_keys, 'key')} starting with a NUL character, which is reserved for ledgerkv's own records")
        if self.long_keys:
            out.append(f"{_count(self.long_keys, 'key')} longer than {MAX_KEY_BYTES} bytes (the limit)")
        if self.null_value_count:
            out.append(f"{_count(self.null_value_count, 'row')} with a null value" + (f" ({eg(map(repr, self.null_values), '')})" if self.null_values else ""))
        if self.dup_keys and on_duplicate == "refuse":
            out.append(
                f"{_count(self.dup_keys, 'key')} occurring more than once ({_count(self.dup_rows, 'extra row')}"
                + eg(f"{k!r} ×{n}" for k, n in self.dup_examples)
                + ") — make the keys unique (--key-expr; key_expr= from Python), or keep the last row of each with --on-duplicate last (on_duplicate=\"last\")"
            )
        if self.big:
            out.append(f"{_count(self.big, 'value')} larger than the cluster's limit of {limit} bytes (--max-value-bytes{eg(f'{k!r}: {n} bytes' for k, n in self.big_examples)})")
        return out


def _count(n: int, thing: str) -> str:
    return f"{n:,} {thing}" if n == 1 else f"{n:,} {thing}s"


def check_task(batches, limit: int):
    """mapInArrow: the check over one partition (sorted by key); yields one row of stats."""
    import pyarrow as pa
    import pyarrow.compute as pc

    st, prev, run = Checked(), None, 0

    def close_run():
        if run > 1:
            st.dup_keys += 1
            st.dup_rows += run - 1
            if len(st.dup_examples) < 3:
                st.dup_examples.append([prev, run])

    for b in batches:
        keys, values = b.column(0), b.column(1)
        st.rows += b.num_rows
        st.null_keys += keys.null_count
        if values.null_count:
            st.null_value_count += values.null_count
            st.null_values += pc.filter(keys, pc.is_null(values)).drop_null().slice(0, 3).to_pylist()
        lengths = pc.binary_length(values)
        big = pc.greater(lengths, limit)
        if pc.any(big).as_py():
            st.big += pc.sum(big).as_py()
            st.big_examples += [list(x) for x in zip(pc.filter(keys, big).slice(0, 3).to_pylist(), pc.filter(lengths, big).slice(0, 3).to_pylist())]
        key_lengths = pc.binary_length(keys)
        st.empty_keys += pc.sum(pc.equal(key_lengths, 0)).as_py() or 0
        st.long_keys += pc.sum(pc.greater(key_lengths, MAX_KEY_BYTES)).as_py() or 0
        st.reserved_keys += pc.sum(pc.starts_with(keys, "\x00")).as_py() or 0
        n = len(keys)
        if not n:
            continue
        # Sorted: a key's rows are adjacent. Walk the rows one by one only in a batch that
        # has a key twice (or goes on with the last key of the one before): the rare case.
        twice = n > 1 and pc.any(pc.equal(keys.slice(1), keys.slice(0, n - 1))).as_py()
        first = keys[0].as_py()
        if not twice and (prev is None or first != prev):
            close_run()
            prev, run = keys[n - 1].as_py(), 1
            continue
        for k in keys.to_pylist():
            if k is not None and k == prev:
                run += 1
                continue
            close_run()
            prev, run = k, 1
    close_run()
    st.null_values, st.big_examples = st.null_values[:3], st.big_examples[:3]
    yield pa.RecordBatch.from_arrays([pa.array([orjson.dumps(asdict(st))], pa.binary())], names=["stats"])


SMALL_INPUT_BYTES = 8 << 20


def default_partitions(df) -> int:
    """One partition for an input Spark estimates at under SMALL_INPUT_BYTES (range
    partitioning into more samples the input first, a job of its own: 2-3 s of a 20 s
    import of 26,000 rows), else two per core."""
    try:
        size = int(str(df._jdf.queryExecution().optimizedPlan().stats().sizeInBytes()))
    except Exception:  # (no estimate, e.g. Spark Connect: as for a large input)
        size = SMALL_INPUT_BYTES
    return 1 if size < SMALL_INPUT_BYTES else df.sparkSession.sparkContext.defaultParallelism * 2


def live_endpoints(endpoints: str, token: str | None, timeout: float = 3.0) -> list[tuple[str, dict]]:
    """(endpoint, status) of the nodes that answer now, leader first: a dead endpoint is
    left out at once instead of being tried batch after batch."""
    from ..client.blocking import Client
    from ..client.endpoints import none_answered, parse_endpoints

    with Client(parse_endpoints(endpoints), token=token, timeout=timeout) as c:
        answers = c.status_all()
    live = [(ep, s) for ep, s in answers if isinstance(s, dict)]
    if not live:
        refused = [s for _, s in answers if isinstance(s, (Unauthorized, Forbidden))]
        if refused and len(refused) == len(answers):  # every node answered: the token is at fault
            raise refused[0]
        raise Unavailable(none_answered("no endpoint answered", answers))
    return sorted(live, key=lambda a: a[1].get("role") != "leader")


def write(
    df,
    endpoints: str,
    *,
    key_col: str = "key",
    value_col: str = "value",
    key_expr: str | None = None,
    value_expr: str | None = None,
    on_duplicate: str = "refuse",
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
    partitions: int | None = None,
    batch_rows: int = 0,
    batch_bytes: int = BATCH_BYTES,
    concurrency: int = CONCURRENCY,
    token: str | None = None,
    timeout: float | None = None,
    progress: bool = False,
) -> ImportReport:
    """Check, then write df's rows into the cluster; returns the report (every row is
    written, skipped or failed). `progress`: a progress line on stderr while writing."""
    from .progress import ProgressLine

    if partitions is not None and partitions < 1:
        raise BadRequest("partitions must be at least 1")
    t0 = time.monotonic()
    s = cluster_for_import(endpoints, token, batch_rows, batch_bytes, concurrency, timeout, t0)
    kv = shape(df, key_col=key_col, value_col=value_col, key_expr=key_expr, value_expr=value_expr)
    n = partitions or default_partitions(df)
    if n == 1:  # one task checks all the rows, then writes them: one Spark job, no shuffle

        def run(task):
            (r,) = kv.coalesce(1).mapInArrow(task, "stats binary, outcome binary").collect()
            return r.stats, r.outcome

        return one_task_import(run, df.sparkSession, s, max_value_bytes=max_value_bytes, on_duplicate=on_duplicate, t0=t0, progress=progress)
    rows, checked = check(kv, max_value_bytes=max_value_bytes, on_duplicate=on_duplicate, partitions=n)
    report = ImportReport(rows=rows)
    try:
        with ProgressLine(df.sparkSession, rows, "imported") if progress else contextlib.nullcontext() as line:
            s.progress = line and line.address
            last = on_duplicate == "last"
            for r in checked.mapInArrow(lambda batches: write_task(batches, s, last), "outcome binary").collect():
                add_outcome(report, r.outcome)
    finally:
        checked.unpersist()
    report.seconds = time.monotonic() - t0
    return report


def cluster_for_import(endpoints: str, token: str | None, batch_rows: int, batch_bytes: int, concurrency: int, timeout: float | None, t0: float):
    """The writers' bulk.Settings: the nodes that answer (leader first), the deadline of an
    import that began at monotonic t0, and the commit index it began at."""
    from .bulk import Settings

    if batch_rows < 0 or batch_bytes < 1 or concurrency < 1:
        raise BadRequest("batch_bytes and concurrency must be at least 1 (batch_rows at least 0: no limit)")
    answers = live_endpoints(endpoints, token)
    # Rows found holding their value, changed after this index, were put there by this import
    # (an attempt of a task that failed after writing them): they count as written.
    began = max(st.get("commit_index", 0) for _, st in answers)
    deadline = time.time() + timeout - (time.monotonic() - t0) if timeout else 0.0
    return Settings([ep for ep, _ in answers], token, batch_rows, batch_bytes, concurrency, deadline=deadline, began=began)


def whole_task(batches, limit: int, on_duplicate: str, s):
    """mapInArrow over the one partition of an import (and kv/spark/local.py's import, in
    its own process): all the rows, sorted by key (stably: a key's rows keep the source's
    order), checked as a whole, then written — unless the check found a problem. Yields
    one row: the check's stats, and the outcome of the writes (empty: none was made)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from .progress import Reporter

    batches = list(batches)
    ordered = []
    if batches:
        table = pa.Table.from_batches(batches)
        del batches
        # (the key column's stable sort order, then one take: a fifth of Table.sort_by's time,
        # which sorts each record batch and merges them: 0.07 + 0.07 s instead of 0.35-0.6 for
        # the flights' 336,776 rows)
        table = table.take(pc.sort_indices(table.column("key")))
        ordered = table.to_batches(max_chunksize=CHUNK_ROWS)
        reporter = Reporter(s.progress)
        reporter.add(0, 0, total=table.num_rows)
        reporter.close()
    stats = next(check_task(ordered, limit)).column(0)[0].as_py()
    outcome = b""
    if not Checked(**orjson.loads(stats)).problems(limit, on_duplicate):
        outcome = next(write_task(iter(ordered), s, on_duplicate == "last")).column(0)[0].as_py()
    yield pa.RecordBatch.from_arrays([pa.array([stats], pa.binary()), pa.array([outcome], pa.binary())], names=["stats", "outcome"])


def one_task_import(run, spark, s, *, max_value_bytes: int, on_duplicate: str, t0: float, progress: bool) -> ImportReport:
    """An import whose rows one task checks, then writes (whole_task): `run(task)` runs it
    over the rows (a Spark job, or in this process: kv/spark/local.py) and returns its
    (stats, outcome). BadRequest if the check refused the rows (then none was written).
    `spark`: the session whose driver the progress line is on (None: this process)."""
    from .progress import ProgressLine

    refuse_unknown_choice(on_duplicate)
    with ProgressLine(spark, 0, "imported") if progress else contextlib.nullcontext() as line:
        s.progress = line and line.address
        stats, outcome = run(lambda batches: whole_task(batches, max_value_bytes, on_duplicate, s))
    st = Checked(**orjson.loads(stats))
    st.refuse_if_wrong(max_value_bytes, on_duplicate)
    report = ImportReport(rows=st.rows)
    add_outcome(report, outcome)
    report.seconds = time.monotonic() - t0
    return report


def add_outcome(report: ImportReport, blob: bytes) -> None:
    o = orjson.loads(blob)
    report.written += o["written"]
    report.skipped += o["skipped"]
    report.failures += [tuple(f) for f in o["failed"]]
    report.transactions += o["transactions"]
    report.wire_bytes += o["wire_bytes"]


def write_task(batches, s, last: bool):
    """mapInArrow: write this partition's rows (sorted by key); yields one row, the outcome.
    With `last`, a key's rows are adjacent in the source's order and the last one wins."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from .bulk import binary, write_chunks

    superseded = 0

    def chunks():
        nonlocal superseded
        pending = None  # with `last`: the batch before, whose last row this one may supersede
        for b in batches:
            keys, values = binary(b.column(0)), binary(b.column(1))
            n = len(keys)
            if not n:
                continue
            if not last:
                yield keys, values
                continue
            keep = np.append(pc.not_equal(keys.slice(1), keys.slice(0, n - 1)).to_numpy(zero_copy_only=False), True)
            superseded += n - int(keep.sum())
            mask = pa.array(keep)
            keys, values = keys.filter(mask), values.filter(mask)
            if pending is not None:
                held_keys, held_values = pending
                if held_keys[len(held_keys) - 1].as_py() == keys[0].as_py():
                    held_keys, held_values = held_keys.slice(0, len(held_keys) - 1), held_values.slice(0, len(held_values) - 1)
                    superseded += 1
                if len(held_keys):
                    yield held_keys, held_values
            pending = keys, values
        if pending is not None:  # (each batch is sent whole: no request of one row at the end)
            yield pending

    out = asyncio.run(write_chunks(chunks(), s))
    out.skipped += superseded
    yield pa.RecordBatch.from_arrays([pa.array([orjson.dumps(asdict(out))], pa.binary())], names=["outcome"])
