"""What client sessions cost (exactly-once writes, kv/common/sessions.py and kv/server/writes.py): the session table's size
with many clients, and the bytes and CPU each write adds.

    .venv/bin/python benchmarks/session_table.py --clients 10000

A one-member kv.Node (fsync on) opens `--clients` sessions, as that many clients would
(POST /v1/sessions), and each sends one conditional put and one plain put in its session.
Prints the sessions' records in the state machine (LevelDB) and in a snapshot, the table's
memory in the node (sys.getsizeof of its dict, lists and ints), and the log bytes a session
adds to an entry. Then the
state machine alone applies the same plain puts with and without a session (alternating
runs, CPU seconds per put): the bookkeeping on every replica.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time

import kv
from kv.raft.messages import Entry, EntryKind
from kv.statemachine import commands as cmds
from kv.statemachine.leveldb import LevelDBStateMachine
from kv.statemachine.sessions import SESSION_RECORD


async def table(root: str, clients: int) -> dict:
    node = kv.Node(kv.NodeConfig(id="n1", data_dir=os.path.join(root, "n1"), max_sessions=max(clients, 1)))
    await node.start()
    try:
        await node.wait_leader(timeout=10)
        ids = await _gather(node.open_session() for _ in range(clients))
        await _gather(node.put(f"c/{i}", b"v", if_absent=True, request_id=kv.RequestId(s, 1)) for i, s in enumerate(ids))
        await _gather(node.put(f"c/{i}", b"w", request_id=kv.RequestId(s, 2)) for i, s in enumerate(ids))
        table = node.sm.sessions  # session -> [seq, index, flag, fingerprint, owner], and each owner's order
        last = table.last
        mem = sys.getsizeof(last) + sum(sys.getsizeof(k) + sys.getsizeof(v) + sum(sys.getsizeof(x) for x in v[:2]) for k, v in last.items())
        mem += sum(sys.getsizeof(m) for m in table.of_owner.values())
        snap = await node.snapshots.take()
        records = [(k, v) for k, v in node.sm._db.iterator(prefix=b"k" + SESSION_RECORD)]
        return {
            "sessions": len(node.sm.sessions),
            "record_bytes": sum(len(k) + len(v) for k, v in records),
            "table_memory_bytes": mem,
            "snapshot_bytes": os.path.getsize(snap.path),
        }
    finally:
        await node.stop()


async def _gather(coros, width: int = 256):
    """Run coroutines, `width` at a time (as that many clients in flight)."""
    out, batch = [], []
    for c in coros:
        batch.append(c)
        if len(batch) == width:
            out += await asyncio.gather(*batch)
            batch = []
    return out + list(await asyncio.gather(*batch))


def apply_cpu(root: str, puts: int, sessioned: bool) -> float:
    """CPU seconds per plain put that the state machine spends applying it."""
    sm = LevelDBStateMachine(os.path.join(root, f"sm-{sessioned}-{time.monotonic_ns()}"))
    try:
        lanes = 64
        sm.apply([Entry(i + 1, 1, EntryKind.NORMAL, cmds.encode(cmds.SessionOpen(i + 1, 1000))) for i in range(lanes)])
        value = b"x" * 256
        entries = []
        for i in range(puts):
            payload = cmds.encode(cmds.Put(f"key{i % 1000}", value))
            if sessioned:
                payload = cmds.in_session(i % lanes + 1, i // lanes + 1, payload)
            entries.append(Entry(lanes + 1 + i, 1, EntryKind.NORMAL, payload))
        t0 = time.process_time()
        for j in range(0, puts, 64):
            sm.apply(entries[j : j + 64])
        return (time.process_time() - t0) / puts
    finally:
        sm.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=10_000)
    p.add_argument("--puts", type=int, default=100_000, help="plain puts per apply run")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    root = tempfile.mkdtemp(prefix="kv-sessions-")
    try:
        t = asyncio.run(table(root, a.clients))
        print(
            f"{t['sessions']:,} sessions: {t['record_bytes']:,} bytes of records in LevelDB ({t['record_bytes'] / t['sessions']:.0f} per session), "
            f"{t['table_memory_bytes']:,} bytes of memory ({t['table_memory_bytes'] / t['sessions']:.0f} per session), snapshot {t['snapshot_bytes']:,} bytes"
        )
        plain = cmds.encode(cmds.Put("key1", b"x" * 256))
        print(f"log entry: {len(cmds.in_session(1, 1, plain)) - len(plain)} bytes more per write ({len(plain)} for a 256-byte put)")
        runs = {False: [], True: []}
        for _ in range(a.rounds):
            for sessioned in (False, True):
                runs[sessioned].append(apply_cpu(root, a.puts, sessioned))
        without, within = statistics.median(runs[False]), statistics.median(runs[True])
        print(f"applying a plain put: {without * 1e6:.2f} µs without a session, {within * 1e6:.2f} µs in one ({within / without:.2f}x; medians of {a.rounds})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
