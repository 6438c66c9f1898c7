"""What keeping many leases alive over etcd's KeepAlive streams costs the leader.

    .venv/bin/python benchmarks/etcd_leases.py --leases 10000 --ttl 10 --streams 10 --seconds 30

A 3-node ledgerkv cluster with etcd's API; the leases are granted through a follower, then
kept alive as etcd's Go client keeps them (each lease renewed every ttl/3, over a few
long-lived KeepAlive streams, all through the follower). Prints the renewals per second and
the CPU seconds per second (share of a core) the leader and the follower spent meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time

import grpc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kv.bench.harness import ServeCluster, cpu_seconds  # noqa: E402
from kv.bench.measure import http_session  # noqa: E402
from kv.v3api.proto import rpc_pb2, rpc_pb2_grpc  # noqa: E402


async def run(leases: int, ttl: int, streams: int, seconds: float) -> None:
    root = tempfile.mkdtemp(prefix="kv-leases-")
    try:
        with ServeCluster(root, 3, grpc=True) as c:
            c.start()
            async with http_session(4) as s:
                leader = await c.leader(s)
            follower = next(i for i in c.ids if i != leader)
            async with grpc.aio.insecure_channel(c.grpc[follower]) as ch:
                stub = rpc_pb2_grpc.LeaseStub(ch)
                sem = asyncio.Semaphore(64)

                async def grant() -> int:
                    async with sem:
                        return (await stub.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=ttl), timeout=30)).ID

                t0 = time.monotonic()
                ids = await asyncio.gather(*(grant() for _ in range(leases)))
                print(f"granted {leases} leases in {time.monotonic() - t0:.1f} s")
                renewed = [0]
                lost = [0]
                stop = time.monotonic() + seconds

                async def keep(mine: list[int]) -> None:
                    queue: asyncio.Queue = asyncio.Queue()

                    async def requests():
                        while True:
                            item = await queue.get()
                            if item is None:
                                return
                            yield rpc_pb2.LeaseKeepAliveRequest(ID=item)

                    call = stub.LeaseKeepAlive(requests())

                    async def answers():
                        async for r in call:
                            renewed[0] += 1
                            lost[0] += r.TTL == 0

                    reader = asyncio.ensure_future(answers())
                    gap = ttl / 3 / max(1, len(mine))
                    while time.monotonic() < stop:
                        for lease in mine:  # spread over ttl/3, as the Go client's timers fall
                            queue.put_nowait(lease)
                            await asyncio.sleep(gap)
                    queue.put_nowait(None)
                    await asyncio.wait_for(reader, 30)

                pids = {i: c.procs[i].pid for i in (leader, follower)}
                before = {i: cpu_seconds(p) for i, p in pids.items()}
                t0 = time.monotonic()
                await asyncio.gather(*(keep(ids[k::streams]) for k in range(streams)))
                took = time.monotonic() - t0
                used = {i: cpu_seconds(p) - before[i] for i, p in pids.items()}
        print(f"{leases} leases, ttl {ttl} s, {streams} KeepAlive streams, {took:.0f} s: {renewed[0] / took:,.0f} renewals/s ({lost[0]} answered TTL 0)")
        print(f"  leader   {used[leader] / took:.1%} of a core")
        print(f"  follower {used[follower] / took:.1%} of a core (the streams' end)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--leases", type=int, default=10_000)
    ap.add_argument("--ttl", type=int, default=10)
    ap.add_argument("--streams", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=30)
    a = ap.parse_args()
    asyncio.run(run(a.leases, a.ttl, a.streams, a.seconds))


if __name__ == "__main__":
    main()
