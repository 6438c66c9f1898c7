"""Local clusters of `kv serve` processes on loopback: free ports, the processes, the leader.

The one harness for launching clusters, shared by `kv bench` (kv/bench/), `benchmarks/` and
the tests (tests/cluster.py builds its fault-injecting ProcCluster on it). `kv cluster up`
uses its command line and status polling for its fixed-port foreground cluster.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

# -P: not the current directory first on sys.path. `kv cluster up` prints this as the way to
# start a node again; run from a folder that holds another `kv` (an old checkout, say), the
# node would otherwise run that folder's code.
SERVE = [sys.executable, "-P", "-m", "kv", "serve"]


def _port_slice() -> range:
    """The ports this process hands out: below the kernel's ephemeral range, and a slice of
    its own for each pytest-xdist worker. A port from the ephemeral range can be taken between
    free_port's check and the server's bind by any outgoing connection's source port or a JVM's
    listener (CI lost a Spark test cluster so), and two workers drawing from one pool could be
    handed the same port."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            top = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        top = 32768
    bottom = 10000
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    worker = int((os.environ.get("PYTEST_XDIST_WORKER") or "gw0").removeprefix("gw") or 0)
    size = (top - bottom) // max(count, 1)
    return range(bottom + worker * size, bottom + (worker + 1) * size)


_ports = _port_slice()
_next = _ports.start + os.getpid() % len(_ports)


def free_port(offsets: Sequence[int] = (0,)) -> int:
    """A loopback port P from this process's slice (_port_slice) with nothing listening on
    P + each offset (`kv cluster up`'s layout, say), all inside the slice. Ports are taken in
    turn, past the last offset, so that none is handed out again before the whole slice has
    been."""
    global _next
    span = max(offsets)
    for _ in range(len(_ports)):
        port = _next if _next + span < _ports.stop else _ports.start
        _next = port + span + 1 if port + span + 1 < _ports.stop else _ports.start
        try:
            for off in offsets:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + off))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no free loopback ports {list(offsets)} from one in {_ports.start}-{_ports.stop - 1}")


def peer_spec(addrs: dict[str, str]) -> str:
    """--peers: ID=HOST:PORT,..."""
    return ",".join(f"{k}={v}" for k, v in addrs.items())


def wait_until(cond, timeout: float = 30.0, what: str | Callable[[], str] = "condition", interval: float = 0.05):
    """Poll cond (a check of another process's state) until it is truthy; returns it.
    AssertionError after timeout seconds, naming `what` (a callable: what it returns then,
    for a message that shows the last state seen)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(interval)
    raise AssertionError(f"{what() if callable(what) else what} not reached in {timeout}s")


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14 and 15)


def rss_mb(pid: int, peak: bool = False) -> float:
    """Resident memory of a process in MiB (its peak so far with peak=True); NaN once gone."""
    field = "VmHWM:" if peak else "VmRSS:"
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024
    except (OSError, StopIteration):
        return float("nan")


class Procs(dict[str, subprocess.Popen]):
    """Processes by id (`kv serve` ones, or any other), each logging to a file; stop() ends them."""

    def spawn(self, nid: str, argv: list[str], log: str, env: dict | None = None) -> subprocess.Popen:
        os.makedirs(os.path.dirname(log), exist_ok=True)
        with open(log, "ab") as f:
            self[nid] = subprocess.Popen(argv, stdout=f, stderr=f, env=env)
        return self[nid]

    def start(self, nid: str, args: list[str], log: str, env: dict | None = None) -> subprocess.Popen:
        """`kv serve ARGS...`"""
        return self.spawn(nid, [*SERVE, *args], log, env)

    def alive(self, nid: str) -> bool:
        return nid in self and self[nid].poll() is None

    def signal(self, nid: str, sig: int) -> None:
        if self.alive(nid):
            self[nid].send_signal(sig)

    def cpu_seconds(self) -> dict[str, float]:
        """user + system CPU seconds each live process has used so far (/proc/PID/stat)."""
        return {nid: cpu_seconds(p.pid) for nid, p in self.items() if p.poll() is None}

    def kill(self, *ids: str) -> None:
        """kill -9 (all of them without ids): no chance to flush or say goodbye."""
        for nid in ids or list(self):
            self.signal(nid, signal.SIGKILL)
            if nid in self:
                self[nid].wait(10)

    def stop(self, *ids: str, timeout: float = 15.0) -> None:
        """SIGTERM (after SIGCONT, in case one is paused), one at a time; SIGKILL after timeout."""
        for nid in ids or list(self):
            p = self.get(nid)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
                try:
                    p.wait(timeout)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)


def leader_of(views: dict[str, dict], among: list[str] | None = None) -> str | None:
    """From nodes' /v1/status answers: the id of a leader (one of `among`, if given) that has
    applied its no-op and that a majority of its own voters agree on; None if there is none."""
    for i, st in views.items():
        if (among is None or i in among) and st["role"] == "leader" and st["applied_index"] >= 1:
            voters = [i] + [p for p, info in st["peers"].items() if info.get("voter")]
            agree = sum(1 for v in voters if views.get(v, {}).get("leader") == i and views[v]["term"] == st["term"])
            if agree * 2 > len(voters):
                return i
    return None


async def poll(probe, *, timeout: float, interval: float = 0.05, error: str = "condition not reached"):
    """Call probe() (awaiting it if it is a coroutine function) until it returns something
    truthy, and return that; RuntimeError(error) after timeout seconds. For state no event
    tells about (another process's, a metric)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = probe()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        await asyncio.sleep(interval)
    raise RuntimeError(error)


async def find_node(ids: list[str], check, *, timeout: float, interval: float = 0.05, error: str = "no leader") -> str:
    """The first of ids for which `await check(id)` is true (a check that raises is false),
    polled until timeout: how a leader is found in a cluster of anything."""

    async def probe() -> str | None:
        for i in ids:
            try:
                if await check(i):
                    return i
            except Exception:
                pass
        return None

    return await poll(probe, timeout=timeout, interval=interval, error=error)


async def statuses(session, urls: dict[str, str]) -> dict[str, dict]:
    """/v1/status of each node that answers (an aiohttp session; urls by id)."""
    import aiohttp

    seen = {}
    for nid, url in urls.items():
        try:
            async with session.get(url + "/v1/status") as r:
                if r.status == 200:  # (not a refusal's body: a 401 without the token, say)
                    seen[nid] = await r.json()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            pass
    return seen


class ServeCluster:
    """n `kv serve` processes on loopback with free ports, data under root/<id>, logs in
    root/<id>.log; stopped on exit."""

    def __init__(self, root: str, n: int, extra: list[str] | None = None, env: dict | None = None, grpc: bool = False) -> None:
        """`grpc`: each node serves etcd's API too (self.grpc[id])."""
        self.root, self.ids = root, [f"n{i}" for i in range(1, n + 1)]
        self.peer = {i: f"127.0.0.1:{free_port()}" for i in self.ids}
        self.http = {i: f"127.0.0.1:{free_port()}" for i in self.ids}
        self.grpc = {i: f"127.0.0.1:{free_port()}" for i in self.ids} if grpc else {}
        self.extra = extra or []
        self.env = env  # the nodes' environment (None: this process's)
        self.procs = Procs()

    def url(self, i: str) -> str:
        return f"http://{self.http[i]}"

    def start(self, *ids: str) -> None:
        spec = peer_spec(self.peer)
        for i in ids or self.ids:
            args = ["--id", i, "--data-dir", os.path.join(self.root, i), "--http", self.http[i], "--peers", spec, *self.extra]
            if self.grpc:
                args += ["--grpc", self.grpc[i]]
            self.procs.start(i, args, os.path.join(self.root, f"{i}.log"), self.env)

    async def leader(self, session, timeout: float = 20.0, among: list[str] | None = None) -> str:
        async def probe() -> str | None:
            return leader_of(await statuses(session, {i: self.url(i) for i in self.ids}), among)

        return await poll(probe, timeout=timeout, error="no leader")

    def __enter__(self) -> ServeCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.procs.stop()
