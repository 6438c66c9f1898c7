"""What a slowly read etcd watch stream costs the node: one stream holding many watches on
one prefix, its answer queue full, then read answer by answer.

    .venv/bin/python benchmarks/watch_stall.py --watches 5000

A one-node `kv serve --grpc` (fsync on). One Watch stream creates `--watches` watches on
the prefix p/; two puts of 4 kB under it give each watch two answers, far more than the
stream's queue holds (4 x --watch-buffer-bytes), so the watches wait for room. Then the
client reads the answers one by one: prints the node's CPU seconds per answer read (each
answer read once woke every watch waiting for room: 6 ms an answer at 5,000 watches).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402

from kv.bench.harness import ServeCluster, cpu_seconds  # noqa: E402
from kv.bench.measure import http_session  # noqa: E402
from kv.v3api.proto import rpc_pb2, rpc_pb2_grpc  # noqa: E402


async def _leader(c: ServeCluster) -> str:
    async with http_session(1) as s:
        return await c.leader(s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--watches", type=int, default=5000)
    ap.add_argument("--seconds", type=float, default=30.0, help="read for at most this long")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="watch-stall-")
    c = ServeCluster(root, 1, grpc=True)
    try:
        c.start()
        asyncio.run(_leader(c))
        pid = c.procs["n1"].pid
        with grpc.insecure_channel(c.grpc["n1"], options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
            done = threading.Event()

            def requests():
                for _ in range(args.watches):
                    yield rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=b"p/", range_end=b"p0"))
                done.wait()

            answers = rpc_pb2_grpc.WatchStub(ch).Watch(requests(), timeout=args.seconds + 600)
            for _ in range(args.watches):
                assert next(answers).created
            kv = rpc_pb2_grpc.KVStub(ch)
            for i in range(2):
                kv.Put(rpc_pb2.PutRequest(key=b"p/%d" % i, value=b"v" * 4000), timeout=60)
            time.sleep(3.0)  # the watches fill the stream's queue and wait for room
            cpu0, t0, read = cpu_seconds(pid), time.monotonic(), 0
            while read < 2 * args.watches and time.monotonic() - t0 < args.seconds:
                next(answers)
                read += 1
            cpu = cpu_seconds(pid) - cpu0
            took = time.monotonic() - t0
            answers.cancel()
            done.set()
        print(f"{args.watches} watches on one stream: read {read} answers in {took:.1f} s; "
              f"the node's CPU {cpu:.2f} s, {1e3 * cpu / max(read, 1):.3f} ms per answer read")
    finally:
        c.procs.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
