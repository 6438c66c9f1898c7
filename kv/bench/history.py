"""`kv bench history`: what the history costs (statemachine/history.py), on kv.open with
fsync on, side by side in one run:

- rewrites of the same keys in batches of 1,000 puts (--versions in all, over --keys keys)
  into a store that keeps every version (--auto-compaction-retention 0) and one whose
  leader compacts as it goes (--auto-compaction-retention 1: a revision is a batch here): versions written per
  second and CPU seconds per version in each, and the state's size on disk, so the bytes
  each kept version costs;
- then a Compact of the store that kept everything, at its head: how long the purge of every
  version takes in the compactor's batches (run here on the closed store's state), and the
  most the process's resident memory grew meanwhile (bounded, whatever the number of
  versions)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

from ..common.disk import dir_bytes
from .harness import rss_mb
from .measure import print_table, workdir


def add_arguments(p) -> None:
    p.add_argument("--versions", type=int, default=1_000_000, help="versions written into each store (default 1,000,000)")
    p.add_argument("--keys", type=int, default=10_000, help="keys they are spread over (default 10,000)")
    p.add_argument("--value-bytes", type=int, default=100)


def _compacted_size(path: str) -> int:
    """The state's size on disk once LevelDB has compacted it (what it keeps, not the
    write-ahead log and the deleted records it has not yet dropped)."""
    import plyvel

    db = plyvel.DB(os.path.join(path, "state"))
    try:
        db.compact_range(start=b"\x00", stop=b"\xff" * 8)  # (without bounds plyvel's leaves most of it)
    finally:
        db.close()
    return dir_bytes(os.path.join(path, "state"))


def _write(db, versions: int, keys: int, values: list[bytes]) -> tuple[float, float]:
    """(seconds, CPU seconds) to write `versions` puts over `keys` keys, 1,000 a batch."""
    t0, c0 = time.perf_counter(), time.process_time()
    done = 0
    while done < versions:
        n = min(1000, versions - done)
        db.put_many([(f"hist/{(done + i) % keys:08d}", values[(done + i) % len(values)]) for i in range(n)])
        done += n
    return time.perf_counter() - t0, time.process_time() - c0


def _purge_all(path: str) -> tuple[float, float]:
    """Purge every history record below the compact revision of the state at `path` (the
    store closed), in the compactor's batches: (seconds, peak RSS growth in MiB)."""
    from ..server.compactor import PURGE_BATCH
    from ..statemachine.leveldb import LevelDBStateMachine

    sm = LevelDBStateMachine(os.path.join(path, "state"))
    me = os.getpid()
    peak, base, stop = [0.0], rss_mb(me), threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mb(me) - base)
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    try:
        while sm.purge_history(PURGE_BATCH):
            pass
        first = sm.history_changes(1, "", 1)[0]
        left = first and first[0][0] < sm.compact_revision  # (the compact revision's own changes stay)
    finally:
        seconds = time.perf_counter() - t0
        stop.set()
        sampler.join()
        sm.close()
    assert not left, "the purge left history records below the compact revision"
    return seconds, peak[0]


async def bench_history(args) -> list[dict]:
    import kv

    values = [os.urandom(args.value_bytes) for _ in range(1009)]  # random: LevelDB's compression shrinks nothing
    rows = []
    with workdir(args.keep) as root:
        def run() -> None:
            for label, retention in (("every version kept (retention 0)", "0"), ("compacted as it goes (retention 1)", "1")):
                path = os.path.join(root, retention)
                with kv.open(path, auto_compaction_retention=retention) as db:
                    seconds, cpu = _write(db, args.versions, args.keys, values)
                    time.sleep(2)  # the compactor's last step
                row = {
                    "what": label, "versions": args.versions, "versions_per_s": round(args.versions / seconds),
                    "cpu_us_per_version": round(cpu / args.versions * 1e6, 1), "state_mib": round(_compacted_size(path) / 2**20, 1),
                }
                if retention == "0":
                    with kv.open(path, auto_compaction_retention=retention) as db:
                        db.compact(db.scan_page("hist/", limit=1).index)
                    purge_s, grew = _purge_all(path)
                    row.update(purge_s=round(purge_s, 1), purge_rss_mib=round(grew, 1))
                rows.append(row)
            kept, compacted = rows[0]["state_mib"], rows[1]["state_mib"]
            rows.append({"what": "bytes per kept version", "versions": args.versions, "bytes": round((kept - compacted) * 2**20 / args.versions)})

        await asyncio.get_running_loop().run_in_executor(None, run)
    print_table("kv bench history: kv.open, fsync on, batches of 1,000 puts", rows, ["what", "versions", "versions_per_s", "cpu_us_per_version", "state_mib", "purge_s", "purge_rss_mib", "bytes"])
    return rows
