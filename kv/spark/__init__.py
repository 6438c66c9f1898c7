"""The data pipeline on Spark (pip install ledgerkv[spark]).

Import — write a DataFrame of key and value columns (kv.spark.load reads one from a
Parquet, CSV or JSON path) into a running cluster (kv.spark.importer: every row is checked
before the first write; kv.spark.bulk: each task reads its key range back and proposes only
what differs, compared on mod_index):

    report = kv.spark.write(kv.spark.load(spark, "users.csv"), "http://127.0.0.1:8001,http://127.0.0.1:8002")

`kv spark import` reads one small local CSV or Parquet file without Spark when nothing asks
for it (kv.spark.local: the same check and writes, in the calling process).

Export — read a snapshot file (or the newest snapshot of a node) as a DataFrame of
(key, value, mod_index):

    df = kv.spark.read_snapshot(spark, "backup.lkvs", prefix="users/")
    df.write.parquet("users.parquet")

The file is split into partitions by its block index (byte ranges), and each task turns
its blocks into Arrow record batches, so large snapshots are read in parallel rather than
through one Python iterator. Every block's checksum is verified as it is read.

A running cluster as of now (kv spark export --endpoints):

    kv.spark.export_snapshot(spark, "users.parquet", endpoints="http://127.0.0.1:8001", prefix="users/")

The leader pins a view of the keys (no snapshot is written), cut into key ranges that the
tasks stream from it in the same block format (kv.spark.views).

Change feed — the committed log range [start, end] of a running cluster, for audit, as a
DataFrame of (index, term, op, key, value, conditional, branch), one row per mutation
(kv.common.entry_stream says what each column means):

    df = kv.spark.read_log(spark, "http://127.0.0.1:8001", start=1000, end=2000)

The range is split into index ranges, and each task streams its own from the node
(GET /v1/log). Entries a node has compacted into a snapshot are gone from its log: export
the snapshot for the state before them.
"""

from .export import download_snapshot, export_snapshot, fetch_snapshot, log_range, read_changes, read_log, read_snapshot
from .runtime import package_zip, root_cause, session
from .importer import ImportReport, load, write

__all__ = [
    "ImportReport",
    "download_snapshot",
    "export_snapshot",
    "fetch_snapshot",
    "load",
    "log_range",
    "package_zip",
    "read_changes",
    "read_log",
    "read_snapshot",
    "root_cause",
    "session",
    "write",
]
