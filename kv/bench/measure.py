"""Measuring: closed-loop drivers, percentiles, tables, and the HTTP operations the
benchmarks (and benchmarks/compare.py) drive a node with."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import contextmanager

from ..common.text import columns


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * p))]


@contextmanager
def workdir(keep: str | None):
    path = keep or tempfile.mkdtemp(prefix="kvbench-")
    os.makedirs(path, exist_ok=True)
    try:
        yield path
    finally:
        if keep is None:
            shutil.rmtree(path, ignore_errors=True)


async def closed_loop(
    op: Callable[[int], Awaitable[None]],
    concurrency: int,
    seconds: float,
    warmup: float = 0.5,
    cpu: Callable[[], dict[str, float]] | None = None,
) -> dict:
    """Run op in `concurrency` loops for `seconds` (after a warm-up); latencies and errors.
    With `cpu` (a callable giving CPU seconds per server process), also the servers' CPU
    microseconds per completed operation, in total and per process: on a shared 2-core
    machine that is the figure that holds when throughput wobbles."""
    lat: list[float] = []
    errors = 0
    stop_at = 0.0
    measuring = False
    counter = iter(range(1 << 62))

    async def worker() -> None:
        nonlocal errors
        while True:
            i = next(counter)
            t0 = time.perf_counter()
            try:
                await op(i)
                t1 = time.perf_counter()
                if measuring:
                    lat.append(t1 - t0)
            except Exception:
                if measuring:
                    errors += 1
                await asyncio.sleep(0.01)
                t1 = time.perf_counter()
            if stop_at and t1 >= stop_at:
                return

    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(worker()) for _ in range(concurrency)]
    await asyncio.sleep(warmup)
    measuring = True
    cpu0 = cpu() if cpu is not None else {}
    own0 = time.process_time()
    t_start = time.perf_counter()
    stop_at = t_start + seconds
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t_start
    own = time.process_time() - own0
    out = {
        "ops_per_s": len(lat) / elapsed,
        "p50_ms": pct(lat, 0.5) * 1000,
        "p99_ms": pct(lat, 0.99) * 1000,
        "ops": len(lat),
        "errors": errors,
        # What this process (the load generator) spent per operation: on a shared machine
        # it is CPU the servers did not get.
        "client_cpu_us_per_op": own / len(lat) * 1e6 if lat else float("nan"),
    }
    if cpu is not None and lat:
        used = {k: v - cpu0.get(k, 0.0) for k, v in cpu().items()}
        out["cpu_us_per_op"] = sum(used.values()) / len(lat) * 1e6
        out["cpu_us_per_op_by_node"] = {k: round(v / len(lat) * 1e6, 1) for k, v in sorted(used.items())}
    return out


def print_table(title: str, rows: list[dict], cols: list[str]) -> None:
    print(f"\n{title}")
    print("\n".join(columns([cols, *([_fmt(r.get(c)) for c in cols] for r in rows)])))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.0f}" if v >= 100 else f"{v:.2f}"
    return "" if v is None else str(v)


def http_session(connections: int):
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections, limit_per_host=connections), timeout=aiohttp.ClientTimeout(total=10))


BENCH_KEYS = 10_000


async def preload(put, concurrency: int = 64, keys: int = BENCH_KEYS, retry_s: float = 30.0) -> None:
    """Write every benchmark key once, so that reads find them. A failed write (a 503
    while the cluster still elects, say) is retried for up to retry_s."""
    it = iter(range(keys))

    async def worker():
        for i in it:
            give_up = time.monotonic() + retry_s
            while True:
                try:
                    await put(i)
                    break
                except Exception:
                    if time.monotonic() > give_up:
                        raise
                    await asyncio.sleep(0.05)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def http_ops(load, url: str, value: bytes, keys: int = BENCH_KEYS):
    """The three HTTP operations the benchmarks drive, over `load` (a loadgen.HttpLoad):
    (name, op) pairs."""
    from .loadgen import Target, ok

    t = Target(load, url)

    async def put(i):
        ok(*await t.request(b"PUT", b"/v1/kv/bench/%d" % (i % keys), value))

    def get(consistency):
        query = b"?consistency=" + consistency

        async def op(i):
            ok(*await t.request(b"GET", b"/v1/kv/bench/%d%s" % (i % keys, query)))

        return op

    return [("PUT", put), ("GET linearizable", get(b"linearizable")), ("GET stale", get(b"stale"))]
