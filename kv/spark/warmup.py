"""A head start for a local session's first task: Spark's Python daemon and a worker are
started, and the worker made ready, while the driver is still reading the input's schema
and asking the cluster for its leader.

A local session's first Python task otherwise waits 2-3 s on a 2-core machine before it
sees a row: Spark starts its Python daemon, which forks a worker; the worker imports
PySpark's SQL modules, then ledgerkv's task modules (aiohttp, pyarrow, numpy) as it
unpickles the task; and Arrow's compute kernels run slowly the first time. The warm-up is a
one-row job of the same kind as an import's (mapInArrow): its worker imports all that and
runs the kernels on two rows, and Spark hands the same worker to the next task once it is
free (spark.python.worker.reuse, on by default); a task that comes while it is still busy
gets a new worker forked from the daemon, which is running already.
"""

from __future__ import annotations

import threading


def warm_task(batches):
    """mapInArrow: import what an import's or an export's task imports and run the Arrow
    kernels they run, on two rows; yields one row."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from ..client import async_client, blocking  # noqa: F401  (the writers' and the readers' HTTP clients)
    from ..snapshot import format as snapshot_format  # noqa: F401  (and below, what an export's tasks use: kv.spark.export itself would make an import cycle)
    from . import progress, snapshot_http, views  # noqa: F401
    from .bulk import ArrowRows, binary
    from .importer import check_task

    for _ in batches:
        pass
    table = pa.table({"key": pa.array(["b", "a"]), "value": pa.array(["2", None])})
    table = table.take(pc.sort_indices(table.column("key")))
    next(check_task(table.to_batches(), 1))
    ArrowRows(binary(table.column("key")), binary(table.column("value").fill_null("")), np.zeros(2, np.uint64)).body()
    yield pa.RecordBatch.from_arrays([pa.array([1], pa.int64())], names=["ready"])


def start(spark) -> threading.Thread:
    """Run the warm-up job in the background; returns its thread. Whatever becomes of it
    (the session stopped meanwhile, a worker that cannot start) the session's own jobs are
    unaffected: they meet the same error themselves, with its cause."""

    def run() -> None:
        try:
            spark.range(1).coalesce(1).mapInArrow(warm_task, "ready long").collect()
        except Exception:
            pass

    t = threading.Thread(target=run, name="kv-spark-warm-up", daemon=True)
    t.start()
    return t
