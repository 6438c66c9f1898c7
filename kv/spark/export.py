"""Export: snapshots, the committed log and the change feed as Spark DataFrames (the
half of kv.spark that reads; kv/spark/__init__.py has the whole story)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

from ..errors import BadRequest, Forbidden, KVError, Unauthorized
from ..snapshot.format import read_header
from .runtime import session  # noqa: F401  (kv.spark.session; it lived here)
from .snapshot_http import is_url, open_snapshot
from .views import close_view, open_view

VALUE_TYPES = ("binary", "string")
TEXT_FORMATS = ("csv",)  # formats that hold text only: Spark would write a binary value as '[6F 6E ...]'


# -- export -----------------------------------------------------------------------------------


def snapshot_schema():
    from pyspark.sql.types import BinaryType, LongType, StringType, StructField, StructType

    return StructType([StructField("key", StringType(), False), StructField("value", BinaryType(), False), StructField("mod_index", LongType(), False)])


def fetch_snapshot(endpoints: str, token: str | None = None, directory: str | None = None, *, fresh: bool = False) -> str:
    """Download the newest snapshot of a node (with fresh, it takes one first, so the
    export holds everything applied so far); returns the local path."""
    return download_snapshot(endpoints, token, directory, fresh=fresh)["path"]


def download_snapshot(endpoints: str, token: str | None, directory: str | None = None, *, fresh: bool = True) -> dict:
    """Take a snapshot on the leader (or, failing that, the next node that answers) and
    download it: {"path", "index", "term", "endpoint"}. Taken on the leader, it holds every
    write acknowledged before the call."""
    path = os.path.join(directory or tempfile.mkdtemp(prefix="kv-export-"), "snapshot.lkvs")

    def download(c, ep: str) -> dict:
        if fresh:
            c.take_snapshot(ep)
        return {**c.download_snapshot(path, endpoint=ep), "path": path}

    return _first_node(endpoints, token, download)


def pin_view(endpoints: str, token: str | None, prefix: str, parts: int) -> dict:
    """Pin a view of every key under prefix on the leader (or, failing that, the next node
    that answers), cut into `parts` key ranges: views.open_view's answer and its
    "endpoint". It holds every write acknowledged before the call."""
    return _first_node(endpoints, token, lambda c, ep: {**open_view(ep, token, prefix, parts), "endpoint": ep}, "pinned a view to export")


def _first_node(endpoints: str, token: str | None, do, what: str = "gave a snapshot"):
    """do(client, endpoint) on the nodes that answer, leader first, until one succeeds; a
    refusal of the request itself (a bad parameter, the token) is not tried again."""
    from ..client.blocking import Client
    from .importer import live_endpoints

    errors = []
    with Client(endpoints, token=token) as c:
        for ep, _ in live_endpoints(endpoints, token):
            try:
                return do(c, ep)
            except (BadRequest, Unauthorized, Forbidden):
                raise
            except KVError as e:  # the next node, then
                errors.append(f"{ep}: {e}")
    raise KVError(f"no node {what}: " + "; ".join(errors))


def export_snapshot(
    spark,
    out: str,
    *,
    endpoints: str | None = None,
    snapshot: str | None = None,
    token: str | None = None,
    prefix: str | None = None,
    fmt: str = "parquet",
    partitions: int | None = None,
    overwrite: bool = False,
    value_type: str | None = None,
    json_schema: str | None = None,
    progress: bool = False,
) -> dict:
    """Write the keys of a cluster as of now, or the records of a snapshot file, to `out`;
    returns {"rows", "index", "term", "source"}, which also goes to out/_ledgerkv.json.
    `out` must not exist unless overwrite. A cluster's keys are read from a view its leader
    pins (POST /v1/export, after a linearizable read barrier), each executor streaming its
    own key ranges from that node; a snapshot file must be at a path every executor can
    open. `value_type`: the value column's, binary or string (None: string for CSV, else
    binary). `progress`: a progress line on stderr while the records are read and written."""
    from .progress import ProgressLine

    value_type = resolve_value_type(value_type, fmt)
    if os.path.exists(out) and not overwrite:
        raise BadRequest(f"{out} exists: choose another path, or replace it with --overwrite (overwrite=True from Python)")
    if snapshot is None:  # the executors read a view the node pins, by key ranges: nothing written, no shared folder
        view = pin_view(endpoints, token, prefix or "", partitions or spark.sparkContext.defaultParallelism * 2)
        source, index, term = view["endpoint"], view["index"], view["term"]
        try:
            with ProgressLine(spark, 0, "exported") if progress else contextlib.nullcontext() as line:
                rows = save(with_value_type(read_view(spark, view, token=token, progress=line), value_type, json_schema), out, fmt, overwrite)
        finally:
            close_view(source, token, view["view"])
    else:
        with open(snapshot, "rb") as f:
            header, _ = read_header(f)
        source, index, term = snapshot, header.index, header.term
        # (its share is of the snapshot's blocks: with a prefix, most rows may be in a few)
        with ProgressLine(spark, 0, "exported", of=" of the snapshot read") if progress else contextlib.nullcontext() as line:
            df = with_value_type(read_snapshot(spark, snapshot, prefix=prefix, partitions=partitions, token=token, progress=line), value_type, json_schema)
            rows = save(df, out, fmt, overwrite)
    meta = {"rows": rows, "index": index, "term": term, "source": source, "prefix": prefix}
    if os.path.isdir(out):
        with open(os.path.join(out, "_ledgerkv.json"), "w") as f:  # Spark readers skip "_" files
            json.dump(meta, f)
    return meta


def resolve_value_type(value_type: str | None, fmt: str) -> str:
    """The value column's type for an export in `fmt`: string for CSV unless given, binary
    for the rest; binary is refused for CSV, which holds text."""
    if value_type is None:
        return "string" if fmt in TEXT_FORMATS else "binary"
    if value_type not in VALUE_TYPES:
        raise BadRequest(f"--value-type (value_type=) must be one of {', '.join(VALUE_TYPES)}")
    if value_type == "binary" and fmt in TEXT_FORMATS:
        raise BadRequest(f"{fmt.upper()} holds text: binary values would be written as their bytes in hex ('[6F 6E ...]'); export them as text (--value-type string, the default for {fmt.upper()}), or choose --format parquet or json")
    return value_type


def save(df, out: str, fmt: str, overwrite: bool) -> int:
    """Write df to `out`; returns how many rows were written. A write that fails leaves no
    folder behind where there was none (a second try would be refused: `out` exists). In
    a format that holds text only (CSV) a binary value column is written as text, checked."""
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    from .importer import CSV_WRITTEN

    # Counted as the rows go out, by the tasks that succeeded (a retried task once), not by
    # reading the output back: that was a second job, 0.4 s of a 2 s export warm and 2.8 s
    # of a session's first, and a full read for CSV and JSON.
    written = Observation("kv_written")
    existed = os.path.exists(out)
    # CSV as pandas, Excel and `kv spark import` read it: a header line, RFC 4180 quoting
    # (Spark's own default is neither: no header, and a quote escaped with a backslash).
    options = CSV_WRITTEN if fmt == "csv" else {}
    if fmt in TEXT_FORMATS and dict(df.dtypes).get("value") == "binary":  # (the change feed's)
        df = with_value_type(df, "string", None)
    try:
        df.observe(written, F.count(F.lit(1)).alias("rows")).write.mode("overwrite" if overwrite else "errorifexists").format(fmt).options(**options).save(out)
    except BaseException:
        if not existed and "://" not in out:
            shutil.rmtree(out, ignore_errors=True)
        raise
    return written.get["rows"]


def with_value_type(df, value_type: str, json_schema: str | None):
    """The value column as text, or its JSON exploded into typed columns (a Spark DDL schema,
    e.g. "year int, carrier string")."""
    from pyspark.errors import PySparkException
    from pyspark.sql import functions as F

    if json_schema:
        try:
            parsed = df.withColumn("value", F.from_json(F.col("value").cast("string"), json_schema))
            return parsed.select("key", "mod_index", "value.*")
        except PySparkException as e:
            from .importer import spark_error

            raise BadRequest(f"--json-schema {json_schema!r}: {spark_error(e)}") from None
    if value_type != "string":
        return df
    # A value that is not UTF-8 stops the export, named, rather than have Spark put U+FFFD
    # for its bytes without a word.
    text = F.col("value").cast("string")
    refuse = F.raise_error(F.concat(
        F.lit("the value of key "), F.col("key"), F.lit(" is not UTF-8, and text (--value-type string, or CSV) would alter it: export values as binary to parquet or json, or leave that key out with --prefix"),
    ))
    return df.withColumn("value", F.when(F.col("value").isNull() | F.expr("is_valid_utf8(cast(value as string))"), text).otherwise(refuse))


def read_snapshot(spark, path: str, *, prefix: str | None = None, partitions: int | None = None, token: str | None = None, progress=None):
    """A DataFrame (key string, value binary, mod_index long) of a snapshot's records (those
    under `prefix`, if given), split into partitions by byte ranges. `path`: a snapshot file
    every executor can open, or a node's snapshot URL (`.../v1/snapshot?index=N`, read by
    byte ranges; `token` if the node wants one). `progress`: a progress.ProgressLine the
    tasks report their blocks to."""
    from ..snapshot.format import block_offsets, read_header, read_trailer

    with open_snapshot(path, token) as f:
        read_header(f)  # a clear error now if it is not a snapshot
        trailer = read_trailer(f)
        offsets = block_offsets(f, trailer)
    n = max(1, min(len(offsets), partitions or spark.sparkContext.defaultParallelism * 2))
    # Contiguous runs of blocks of about equal bytes: (first block offset, block count).
    ends = offsets[1:] + [trailer.index_offset]
    sizes = [e - o for o, e in zip(offsets, ends)]
    target = sum(sizes) / n if sizes else 0
    tasks, start, acc = [], 0, 0
    for i, size in enumerate(sizes):
        acc += size
        if acc >= target and len(tasks) < n - 1:
            tasks.append((offsets[start], i + 1 - start))
            start, acc = i + 1, 0
    if start < len(offsets):
        tasks.append((offsets[start], len(offsets) - start))
    where = path if is_url(path) else os.path.abspath(path)
    plan = _plan(spark, [(where, o, c, prefix or "") for o, c in tasks], "path string, offset long, blocks long, prefix string")
    if progress is not None:
        progress.total = len(offsets)
    to = progress and progress.address
    return plan.mapInArrow(lambda batches: _read_blocks(batches, token, to), snapshot_schema())


def _read_blocks(batches, token: str | None = None, progress_to: tuple | None = None):
    """mapInArrow: each input row names a run of blocks; yields their records, one Arrow
    batch per block, built straight from the block's columnar buffers (each block done is
    reported to the driver's progress line, if it has one)."""
    from .progress import Reporter

    reporter = Reporter(progress_to)
    try:
        yield from _blocks_of(batches, token, reporter)
    finally:
        reporter.close()


def _blocks_of(batches, token, reporter):
    from ..snapshot.format import iter_blocks

    for plan in batches:
        for path, offset, count, prefix in zip(*(plan.column(i).to_pylist() for i in range(4))):
            with open_snapshot(path, token) as f:
                for n, (records, payload) in enumerate(iter_blocks(f, offset)):
                    if n >= count:
                        break
                    batch = _user_rows(records, payload, prefix)
                    reporter.add(batch.num_rows, 1)
                    if batch.num_rows:
                        yield batch


def _user_rows(records: int, payload: bytes, prefix: str):
    """A block's records as an Arrow batch (key text, value, mod_index) built on the block's
    own buffers, without ledgerkv's own records, and only those under `prefix` if given."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from ..snapshot.format import block_columns

    ko, kb, vo, vb, mb = block_columns(payload, records)
    batch = pa.RecordBatch.from_arrays(
        [
            pa.Array.from_buffers(pa.binary(), records, [None, pa.py_buffer(ko), pa.py_buffer(kb)]),
            pa.Array.from_buffers(pa.binary(), records, [None, pa.py_buffer(vo), pa.py_buffer(vb)]),
            pa.Array.from_buffers(pa.int64(), records, [None, pa.py_buffer(mb)]),
        ],
        names=["key", "value", "mod_index"],
    )
    if kb[:1] == b"\x00":  # ledgerkv's own records (leases, sessions, history: bytes) sort first
        starts = memoryview(ko).cast("i")
        own = next((i for i in range(records) if kb[starts[i] : starts[i] + 1] != b"\x00"), records)
        batch = batch.slice(own)
    if prefix:
        batch = batch.filter(pc.starts_with(batch.column(0), prefix))
    if batch.num_rows:
        batch = batch.set_column(0, "key", _text_keys(batch.column(0)))
    return batch


def read_view(spark, view: dict, *, token: str | None = None, progress=None):
    """A DataFrame (key string, value binary, mod_index long) of a view a node pinned
    (views.open_view's answer, with its "endpoint"): a task per key range, each streaming
    its range from the node. `progress`: a progress.ProgressLine the tasks report rows to."""
    from .views import range_url

    urls = [range_url(view["endpoint"], view["view"], lo, hi) for lo, hi in view["ranges"]]
    plan = _plan(spark, [(u,) for u in urls], "url string")
    by_rows = view["keys"] is not None  # (else the node cut the ranges by its estimate of their bytes)
    if progress is not None:
        progress.total, progress.of = (view["keys"], "") if by_rows else (len(urls), " of the key ranges read")
    to = progress and progress.address
    return plan.mapInArrow(lambda batches: _read_ranges(batches, token, to, by_rows), snapshot_schema())


def _read_ranges(batches, token: str | None, progress_to: tuple | None, by_rows: bool):
    """mapInArrow: each input row is a key range of a view; yields its rows, a batch per
    block, each reported to the driver's progress line (if it has one) in rows, or, when
    by_rows is false, each range as it ends."""
    from .progress import Reporter
    from .views import range_blocks

    reporter = Reporter(progress_to)
    try:
        for plan in batches:
            for url in plan.column(0).to_pylist():
                for records, payload in range_blocks(url, token):
                    batch = _user_rows(records, payload, "")
                    reporter.add(batch.num_rows, batch.num_rows if by_rows else 0)
                    if batch.num_rows:
                        yield batch
                if not by_rows:
                    reporter.add(0, 1)
    finally:
        reporter.close()


def _text_keys(keys):
    """The key column as text: a key that is not UTF-8 (etcd's clients may write one) stops
    the export, named, rather than being altered."""
    import pyarrow as pa

    try:
        return keys.cast(pa.string())
    except pa.ArrowInvalid:
        bad = next(k for k in keys.to_pylist() if not _is_utf8(k))
        raise BadRequest(
            f"key {bad[:80]!r} is not UTF-8 and the export's key column is text: "
            "export a --prefix that leaves it out, or rename the key"
        ) from None


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# -- change feed ------------------------------------------------------------------------------


def log_schema():
    from pyspark.sql.types import BinaryType, BooleanType, LongType, StringType, StructField, StructType

    return StructType(
        [
            StructField("index", LongType(), False),
            StructField("term", LongType(), False),
            StructField("op", StringType(), False),
            StructField("key", StringType(), True),
            StructField("value", BinaryType(), True),
            StructField("conditional", BooleanType(), False),
            StructField("branch", StringType(), True),
        ]
    )


def log_bounds(endpoints: str, token: str | None = None) -> list[tuple[str, int, int]]:
    """(endpoint, first, last) of every node that answers: the committed log range its
    ledger holds (from the oldest entry not compacted into a snapshot to its applied index)."""
    from ..client.blocking import Client
    from ..client.endpoints import none_answered

    with Client(endpoints, token=token) as c:
        answers = c.status_all()
    nodes = [(ep, s["ledger_begin_index"] + 1, s["applied_index"]) for ep, s in answers if isinstance(s, dict)]
    if not nodes:
        raise KVError(none_answered("no node answered", answers))
    return nodes


def log_range(endpoints: str, start: int | None = None, end: int | None = None, token: str | None = None) -> tuple[int, int]:
    """The committed range [start, end] a change feed or log export reads: by default from
    the lowest index any member still holds to the highest applied index (every endpoint is
    asked); refused if no member holds it."""
    start, end, _ = plan_log_ranges(log_bounds(endpoints, token), start, end, 1)
    return start, end


def plan_log_ranges(nodes: list[tuple[str, int, int]], start: int | None, end: int | None, n: int) -> tuple[int, int, list[tuple[list[str], int, int]]]:
    """[start, end] (default: the lowest index any node holds, the highest applied index),
    checked against the nodes (endpoint, first, last), split into about n index ranges, each
    with the endpoints that hold all of it: (start, end, [(holders, lo, hi), ...])."""
    from ..errors import Compacted

    lowest = min(nodes, key=lambda x: x[1])
    highest = max(nodes, key=lambda x: x[2])
    start = lowest[1] if start is None else start
    end = highest[2] if end is None else end
    held = "; ".join(f"{ep} holds [{f}, {last}]" for ep, f, last in nodes)
    if start < 1:
        raise BadRequest("start must be at least 1 (log indexes start at 1)")
    if end < start - 1:
        raise BadRequest(f"the range [{start}, {end}] is backwards ({held})")
    if start < lowest[1]:
        raise Compacted(
            f"no member holds the log before index {lowest[1]} ({held}; earlier entries were compacted into snapshots): "
            f"start at {lowest[1]} or later, or export the snapshot"
        )
    if end > highest[2]:
        raise BadRequest(f"index {end} is not applied on any member yet (the highest applied index is {highest[2]}, on {highest[0]})")
    count = end - start + 1
    if count == 0:  # nothing committed after start - 1 yet: an empty feed, not an error
        return start, end, []
    n = max(1, min(count, n))
    # Cut at the even split and where a node's range begins or ends, so that every piece is
    # held whole by some node; then slivers go back into their neighbour when one node
    # holds both.
    cuts = {start + count * i // n for i in range(n)} | {start, end + 1}
    cuts |= {x for _, f, last in nodes for x in (f, last + 1) if start < x <= end}
    edges = sorted(cuts)
    pieces = []
    for lo, nxt in zip(edges, edges[1:]):
        hi = nxt - 1
        holders = [ep for ep, f, last in nodes if f <= lo and hi <= last]
        if not holders:
            gap_end = min([f - 1 for _, f, _ in nodes if f > lo] + [end])
            raise Compacted(f"no member holds the entries [{lo}, {gap_end}] ({held}): export a snapshot for that state")
        if pieces:
            plo, _, pholders = pieces[-1]
            both = [ep for ep in pholders if ep in holders]
            if both and (hi - lo + 1) * 2 * n < count:
                pieces[-1] = (plo, hi, both)
                continue
        pieces.append((lo, hi, holders))
    return start, end, [(holders, lo, hi) for lo, hi, holders in pieces]


def _ranges(spark, endpoints: str, start: int | None, end: int | None, partitions: int | None, token: str | None):
    """The committed range [start, end] split into index ranges: (holders, lo, hi) each."""
    n = partitions or spark.sparkContext.defaultParallelism * 2
    return plan_log_ranges(log_bounds(endpoints, token), start, end, n)[2]


def _plan(spark, rows: list[tuple], schema: str):
    """A DataFrame of work items, one partition each (mapInArrow then runs one per task).
    parallelize cuts n items into n slices of one; a repartition deals rows round-robin from
    a random start, and left one partition empty and two items in another."""
    return spark.createDataFrame(spark.sparkContext.parallelize(rows, max(len(rows), 1)), schema)


def read_log(spark, endpoints: str, start: int | None = None, end: int | None = None, *, partitions: int | None = None, token: str | None = None):
    """A DataFrame of the committed log entries [start, end] as they were proposed (the raw
    log: index, term, op, key, value, conditional, branch), read in parallel index ranges,
    each from a node that holds it (default: all any member still holds, log_range)."""
    ranges = _ranges(spark, endpoints, start, end, partitions, token)
    plan = _plan(spark, [(holders[0], lo, hi, token or "") for holders, lo, hi in ranges], "endpoint string, lo long, hi long, token string")
    return plan.mapInArrow(_read_log_ranges, log_schema())


def changes_schema():
    from pyspark.sql.types import BinaryType, LongType, StringType, StructField, StructType

    return StructType(
        [
            StructField("index", LongType(), False),
            StructField("type", StringType(), False),
            StructField("key", StringType(), False),
            StructField("value", BinaryType(), True),
            StructField("mod_index", LongType(), False),
        ]
    )


def read_changes(
    spark, endpoints: str, start: int | None = None, end: int | None = None, *, prefix: str = "", partitions: int | None = None, token: str | None = None
):
    """A DataFrame of the effective changes of the committed range [start, end]: what a
    watch would have seen — one row per key a committed entry changed (index, type put or
    delete, key, value, the mod_index it produced), a transaction's branch resolved, writes
    that changed nothing left out. After `export_snapshot` at index N, `read_changes(...,
    start=N + 1)` continues it with no gap and no repeat (a CDC bootstrap)."""
    ranges = _ranges(spark, endpoints, start, end, partitions, token)
    # Each range is watched on a node that holds it, on the others that do if it fails.
    rows = [(",".join(holders), lo, hi, prefix, token or "") for holders, lo, hi in ranges]
    plan = _plan(spark, rows, "endpoints string, lo long, hi long, prefix string, token string")
    return plan.mapInArrow(_read_change_ranges, changes_schema())


def _read_change_ranges(batches):
    """mapInArrow: each input row names an index range; watches it and yields its changes
    as Arrow batches."""
    from ..client.blocking import Client

    for plan in batches:
        for eps, lo, hi, prefix, token in zip(*(plan.column(i).to_pylist() for i in range(5))):
            rows = []
            with Client(eps, token=token or None, timeout=60) as c:
                for ev in c.watch(prefix, lo, end_index=hi):
                    rows.append((ev.index, ev.type, ev.key, ev.value, ev.index))
                    if len(rows) >= 65536:
                        yield _arrow(rows, changes_schema())
                        rows = []
            if rows:
                yield _arrow(rows, changes_schema())


def _read_log_ranges(batches):
    """mapInArrow: each input row names an index range; streams it from the node and
    yields its rows as Arrow batches."""
    for plan in batches:
        for ep, lo, hi, token in zip(*(plan.column(i).to_pylist() for i in range(4))):
            yield from _stream_range(ep, lo, hi, token or None)


def _stream_range(ep: str, lo: int, hi: int, token: str | None):
    from ..client.blocking import Client
    from ..common.entry_stream import LogStreamError, entry_rows

    rows, expected = [], lo
    with Client(ep, token=token, timeout=60) as c:
        try:
            for entries in c.read_log(lo, hi, endpoint=ep):
                for e in entries:
                    if e.index != expected:
                        raise LogStreamError(f"log range [{lo}, {hi}] from {ep}: expected index {expected}, got {e.index}")
                    expected += 1
                    rows.extend(entry_rows(e))
                if len(rows) >= 65536:
                    yield _arrow(rows, log_schema())
                    rows = []
        except LogStreamError:
            raise
        except KVError as e:
            raise LogStreamError(f"log range [{lo}, {hi}] from {ep}: {e}") from e
    if expected != hi + 1:
        raise LogStreamError(f"log range [{lo}, {hi}] from {ep}: the stream ended at index {expected - 1}")
    if rows:
        yield _arrow(rows, log_schema())


def _arrow(rows: list[tuple], schema):
    """Rows (tuples in the schema's column order) as one Arrow record batch."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_schema

    a = to_arrow_schema(schema)
    try:
        return pa.RecordBatch.from_arrays([pa.array(col, f.type) for col, f in zip(zip(*rows), a)], schema=a)
    except UnicodeEncodeError:
        # a key of bytes that are not UTF-8 (cmds.key_text holds them as lone surrogates)
        index, key = next((r[0], r[3]) for r in rows if isinstance(r[3], str) and not _is_utf8(r[3].encode("utf-8", "surrogateescape")))
        raise BadRequest(
            f"entry {index} writes key {key.encode('utf-8', 'surrogateescape')[:80]!r}, which is not UTF-8, "
            "and the change feed's key column is text: export a range of the log without it (start, end)"
        ) from None
