"""`kv bench watch`: watch streams of a 3-node `kv serve` cluster, fsync on, measured
through kv.AsyncClient.watch (the client a user runs), all in one run:

- one watcher's events/s: replaying history from the ledger, and following live writes
  (transactions of 100 puts, so that the writers are not the limit);
- commit-to-delivery latency with 100 watchers on one follower while 1,000 puts/s go to the
  leader (open loop): from the put's acknowledgement (and from its sending) to each watcher;
- 1,000 idle watchers on the leader: its extra RSS, and put throughput without, with, and
  without them again (the last shows how far the shared machine drifted meanwhile).
"""

from __future__ import annotations

import asyncio
import os
import re
import time

from .harness import ServeCluster, rss_mb
from .loadgen import HttpLoad
from .measure import closed_loop, http_ops, http_session, pct, print_table, workdir
from ..client.async_client import AsyncClient
from ..statemachine.commands import Put


async def _metric(s, url: str, name: str) -> float:
    async with s.get(url + "/metrics") as r:
        m = re.search(rf"^{name} (\S+)$", await r.text(), re.M)
    return float(m.group(1)) if m else 0.0


async def _until_watches(s, url: str, n: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while await _metric(s, url, "kv_watches") < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{n} watch streams did not open in {timeout:.0f}s")
        await asyncio.sleep(0.1)


async def _write_batches(writer: AsyncClient, prefix: str, batches: int, size: int, concurrency: int = 4) -> None:
    it = iter(range(batches))

    async def worker():
        for b in it:
            await writer.txn(ops=[Put(f"{prefix}{b}/{i}", b"v" * 100) for i in range(size)])

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _replay(writer: AsyncClient, wc: AsyncClient, events: int) -> dict:
    start = (await wc.scan_page("r/", limit=1)).index + 1
    batches = max(1, events // 100)  # txns of 100 puts (a cluster takes at most 128 ops per txn)
    await _write_batches(writer, "r/", batches, 100)
    n, t0 = 0, time.perf_counter()
    async for _ in wc.watch("r/", start):
        n += 1
        if n == batches * 100:
            break
    took = time.perf_counter() - t0
    return {"what": "1 watcher, replaying history from the ledger", "events": n, "events_per_s": n / took}


async def _live(writer: AsyncClient, wc: AsyncClient, seconds: float) -> dict:
    start = (await wc.scan_page("l/", limit=1)).index + 1
    stamps: list[float] = []

    async def watch():
        async for _ in wc.watch("l/", start):
            stamps.append(time.perf_counter())

    total = 0
    watching = asyncio.ensure_future(watch())
    stop_at = time.perf_counter() + seconds
    batch = 0

    async def worker():
        nonlocal batch, total
        while time.perf_counter() < stop_at:
            b, batch = batch, batch + 1
            await writer.txn(ops=[Put(f"l/{b}/{i}", b"v" * 100) for i in range(100)])
            total += 100

    await asyncio.gather(*(worker() for _ in range(4)))
    deadline = time.perf_counter() + 60
    while len(stamps) < total and time.perf_counter() < deadline:
        await asyncio.sleep(0.01)
    watching.cancel()
    # The rate while events flowed, from the first to the last (the writers ran meanwhile).
    return {"what": "1 watcher, following live writes (txns of 100 puts)", "events": len(stamps), "events_per_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])}


async def _latency(s, lead_url: str, wc: AsyncClient, url: str, where: str, watchers: int, rate: int, seconds: float) -> dict:
    start = (await wc.scan_page("lat/", limit=1)).index + 1
    n = int(rate * seconds)
    sent: list[float] = [0.0] * n
    acked: list[float] = [0.0] * n
    delivered: list[list[tuple[int, float]]] = [[] for _ in range(watchers)]

    async def watch(k: int):
        got = delivered[k]
        async for ev in wc.watch("lat/", start):
            got.append((int(ev.value), time.perf_counter()))

    tasks = [asyncio.ensure_future(watch(k)) for k in range(watchers)]
    await _until_watches(s, url, watchers)

    errors = 0

    async def put(i: int):
        nonlocal errors
        sent[i] = time.perf_counter()
        try:  # a bare aiohttp PUT: the writer should cost this process little
            async with s.put(f"{lead_url}/v1/kv/lat/{i % 1000}", data=b"%d" % i) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(r.status)
        except Exception:  # overloaded: counted, and left out of the latencies
            errors += 1
            return
        acked[i] = time.perf_counter()

    t0 = time.perf_counter()
    puts = []
    for i in range(n):  # open loop: a put every 1/rate s, whether or not the last one returned
        await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
        puts.append(asyncio.ensure_future(put(i)))
    await asyncio.gather(*puts)
    took = time.perf_counter() - t0
    deadline = time.perf_counter() + 60
    while any(len(got) < n - errors for got in delivered) and time.perf_counter() < deadline:
        await asyncio.sleep(0.05)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    from_ack = [max(0.0, t - acked[i]) for got in delivered for i, t in got if acked[i]]
    from_send = [t - sent[i] for got in delivered for i, t in got if acked[i]]
    return {
        "what": f"{watchers} watchers on the {where}, {rate} puts/s to the leader",
        "events": len(from_ack),
        "put_errors": errors,
        "puts_per_s": (n - errors) / took,
        "ack_p50_ms": pct(from_ack, 0.5) * 1000,
        "ack_p99_ms": pct(from_ack, 0.99) * 1000,
        "send_p50_ms": pct(from_send, 0.5) * 1000,
        "send_p99_ms": pct(from_send, 0.99) * 1000,
    }


async def _idle(s, c: ServeCluster, lead: str, watchers: int, seconds: float) -> list[dict]:
    url = c.url(lead)
    pid = c.procs[lead].pid
    load = HttpLoad()
    put = (await http_ops(load, url, b"v" * 100))[0][1]
    before = await closed_loop(put, 16, seconds)
    rss0 = rss_mb(pid)
    async with AsyncClient(url, connections=watchers + 16) as ic:

        async def idle(k: int):
            async for _ in ic.watch(f"idle/{k}/"):
                pass

        tasks = [asyncio.ensure_future(idle(k)) for k in range(watchers)]
        await _until_watches(s, url, watchers)
        await asyncio.sleep(1.0)
        rss1 = rss_mb(pid)
        during = await closed_loop(put, 16, seconds)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(1.0)
    after = await closed_loop(put, 16, seconds)  # A-B-A: the machine's drift shows here
    load.close()
    return [
        {"what": "puts/s to the leader, no watchers", "puts_per_s": before["ops_per_s"], "p99_ms": before["p99_ms"], "rss_mb": rss0},
        {"what": f"puts/s to the leader, {watchers} idle watchers on it", "puts_per_s": during["ops_per_s"], "p99_ms": during["p99_ms"], "rss_mb": rss1, "extra_rss_mb": rss1 - rss0},
        {"what": "puts/s to the leader, watchers closed again", "puts_per_s": after["ops_per_s"], "p99_ms": after["p99_ms"]},
    ]


async def bench_watch(args) -> list[dict]:
    from ..server.process import tune_gc

    tune_gc()  # as the README advises a busy client: the latency run keeps 100,000s of samples
    with workdir(args.keep) as root, ServeCluster(os.path.join(root, "cluster"), 3) as c:
        c.start()
        async with http_session(256) as s:
            lead = await c.leader(s)
            follower = next(i for i in c.ids if i != lead) if args.on == "follower" else lead
            async with AsyncClient(c.url(lead), connections=64) as writer, AsyncClient(c.url(follower), connections=args.watchers + 16) as wc:
                rate = [await _replay(writer, wc, args.events), await _live(writer, wc, args.seconds)]
                lat = [await _latency(s, c.url(lead), wc, c.url(follower), args.on, args.watchers, args.rate, args.seconds)]
            idle = await _idle(s, c, lead, args.idle, args.seconds)
    print_table(f"One watcher (kv.AsyncClient.watch on the {args.on})", rate, ["what", "events", "events_per_s"])
    print_table("Commit-to-delivery (ms): from the put's acknowledgement / from its sending", lat, ["what", "events", "put_errors", "puts_per_s", "ack_p50_ms", "ack_p99_ms", "send_p50_ms", "send_p99_ms"])
    print_table("Idle watchers, side by side (closed loop, 16 writers)", idle, ["what", "puts_per_s", "p99_ms", "rss_mb", "extra_rss_mb"])
    return rate + lat + idle


def add_arguments(p) -> None:
    p.add_argument("--events", type=int, default=200_000, help="changes replayed by one watcher (default 200000)")
    p.add_argument("--watchers", type=int, default=100, help="watchers in the latency run (default 100)")
    p.add_argument("--on", choices=["follower", "leader"], default="follower", help="the node the watchers watch (default: a follower)")
    p.add_argument("--rate", type=int, default=1000, help="puts/s in the latency run (default 1000)")
    p.add_argument("--idle", type=int, default=1000, help="idle watchers on the leader (default 1000)")
