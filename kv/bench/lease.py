"""`kv bench lease`: leases and locks on a 3-node `kv serve` cluster, fsync on, driven
through kv.AsyncClient (the client a user runs):

- the leader's CPU, as a share of one core, with N live leases (default 10,000) each kept
  alive every ttl/3 (open loop, spread evenly: N / (ttl/3) keepalives a second), beside the
  same cluster idle before the leases were granted; keepalive latency and errors; side by
  side, one request per keepalive (lease_keepalive) and keepalives coalesced the way a
  self-renewing lease sends them (kv.client.recipes.KeepAlives: one request per 50 ms);
- lock hand-over: one client holds a lock, another (on another node) waits for it; from
  the holder's release() to the waiter's acquire() returning, p50 and p99.
"""

from __future__ import annotations

import asyncio
import os
import time

from collections.abc import Awaitable, Callable

from ..client.async_client import AsyncClient
from ..client.recipes import KEEPALIVE_BATCH_S, keepalives
from .harness import ServeCluster, cpu_seconds
from .measure import http_session, pct, print_table, workdir


async def _cpu_share(pid: int, seconds: float) -> float:
    c0, t0 = cpu_seconds(pid), time.monotonic()
    await asyncio.sleep(seconds)
    return (cpu_seconds(pid) - c0) / (time.monotonic() - t0)


async def _grant(client: AsyncClient, n: int, ttl: float, concurrency: int = 64) -> list[int]:
    ids: list[int] = []
    it = iter(range(n))

    async def worker():
        for _ in it:
            ids.append((await client.lease_grant(ttl)).id)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ids


async def _keep_alive(renew: Callable[[int], Awaitable], ids: list[int], every: float, seconds: float, pid: int) -> dict:
    """Keep every lease alive once per `every` seconds for `seconds` with renew(id); the
    leader's CPU share meanwhile, and what the keepalives saw."""
    lat: list[float] = []
    errors = 0
    gate = asyncio.Semaphore(256)

    async def one(lease: int):
        nonlocal errors
        async with gate:
            t = time.perf_counter()
            try:
                await renew(lease)
                lat.append((time.perf_counter() - t) * 1000)
            except Exception:
                errors += 1

    tasks = set()
    step = every / len(ids)
    start = time.monotonic()
    c0, p0 = cpu_seconds(pid), time.process_time()
    k = 0
    while (due := start + k * step) < start + seconds:
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.ensure_future(one(ids[k % len(ids)]))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        k += 1
    await asyncio.gather(*tasks)
    wall = time.monotonic() - start
    return {
        "keepalives_per_s": len(lat) / wall,
        "leader_core_share": (cpu_seconds(pid) - c0) / wall,
        "client_core_share": (time.process_time() - p0) / wall,
        "p50_ms": pct(lat, 0.5),
        "p99_ms": pct(lat, 0.99),
        "errors": errors,
    }


async def _handover(a: AsyncClient, b: AsyncClient, rounds: int) -> dict:
    samples, releases = [], []
    for r in range(rounds):
        holder_client, waiter_client = (a, b) if r % 2 == 0 else (b, a)
        holder = await holder_client.lock("bench/lock", ttl=10).acquire()
        got = asyncio.get_running_loop().create_future()

        async def wait(client=waiter_client, got=got):
            lock = await client.lock("bench/lock", ttl=10).acquire()
            got.set_result(time.monotonic())
            return lock

        waiter = asyncio.ensure_future(wait())
        await asyncio.sleep(0.2)  # the waiter has queued and watches the holder's key
        if got.done():
            raise RuntimeError("two holders of one lock")
        t0 = time.monotonic()
        await holder.release()
        releases.append((time.monotonic() - t0) * 1000)
        lock = await waiter
        samples.append((got.result() - t0) * 1000)
        await lock.release()
    return {"rounds": rounds, "p50_ms": pct(samples, 0.5), "p99_ms": pct(samples, 0.99), "release_p50_ms": pct(releases, 0.5)}


async def bench_lease(args) -> list[dict]:
    with workdir(args.keep) as root, ServeCluster(os.path.join(root, "cluster"), 3) as c:
        c.start()
        async with http_session(8) as s:
            lead = await c.leader(s)
        follower = next(i for i in c.ids if i != lead)
        pid = c.procs[lead].pid
        every = args.ttl / 3
        seconds = max(args.seconds, every)  # every lease renewed at least once
        rows = []
        async with AsyncClient(c.url(lead), connections=256) as client:
            idle = await _cpu_share(pid, seconds)
            rows.append({"what": "leader idle, no leases", "leader_core_share": idle})
            t0 = time.perf_counter()
            ids = await _grant(client, args.leases, args.ttl)
            granted = time.perf_counter() - t0
            rows.append({"what": f"grant {len(ids):,} leases (64 clients)", "per_s": len(ids) / granted})
            batched = keepalives(client)
            ways = (
                ("one request per keepalive", client.lease_keepalive),
                (f"coalesced ({KEEPALIVE_BATCH_S * 1000:g} ms, as a kv lease does)", lambda lease: batched.renew(lease, KEEPALIVE_BATCH_S)),
            )
            for way, renew in ways:
                r = await _keep_alive(renew, ids, every, seconds, pid)
                per_s = r.pop("keepalives_per_s")
                rows.append({"what": f"{len(ids):,} leases kept alive every {every:g}s: {way}", **r, "per_s": per_s})
        async with AsyncClient(c.url(lead)) as a, AsyncClient(c.url(follower)) as b:
            h = await _handover(a, b, args.rounds)
        rows.append({"what": f"lock hand-over, lockers on the leader and a follower ({h['rounds']} rounds)", "p50_ms": h["p50_ms"], "p99_ms": h["p99_ms"]})
        rows.append({"what": "  the holder's release() alone (a revoke committed)", "p50_ms": h["release_p50_ms"]})
    print_table(
        "Leases and locks, 3 nodes, fsync on (core share: CPU seconds per second, of one core)",
        rows,
        ["what", "per_s", "leader_core_share", "client_core_share", "p50_ms", "p99_ms", "errors"],
    )
    return rows


def add_arguments(p) -> None:
    p.add_argument("--leases", type=int, default=10_000, help="live leases kept alive (default 10000)")
    p.add_argument("--ttl", type=float, default=30.0, help="their ttl; each is renewed every ttl/3 (default 30)")
    p.add_argument("--rounds", type=int, default=50, help="lock hand-overs timed (default 50)")
