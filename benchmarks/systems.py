"""The systems the comparison drives: how to start a 3-node loopback cluster of each, and
the HTTP operations (put, linearizable get, stale get) against one node of it."""

from __future__ import annotations

import base64
import os
import subprocess
import sys

from kv.bench.loadgen import Target, ok
from kv.bench.measure import http_ops
from kv.bench.harness import Procs, ServeCluster, find_node, free_port

HERE = os.path.dirname(os.path.abspath(__file__))


class System:
    name = "?"
    ids: list[str]

    def url(self, nid: str) -> str: ...

    async def leader(self, session) -> str: ...

    async def ops(self, load, nid: str, value: bytes):
        """(name, op) pairs: PUT, GET linearizable, GET stale, over `load` (kv.bench.loadgen.HttpLoad)."""

    def cpu(self) -> dict[str, float]:
        """CPU seconds used so far by each of the system's processes."""
        return self.procs.cpu_seconds()

    def close(self) -> None: ...


class Ledgerkv(System):
    """`aiohttp_only`: every request through aiohttp (kv serve --http-aiohttp-only), to
    measure what the fast path (http/fastpath.py) buys, side by side."""

    def __init__(self, root: str, aiohttp_only: bool = False) -> None:
        self.name = "ledgerkv (aiohttp only)" if aiohttp_only else "ledgerkv"
        self.c = ServeCluster(root, 3, ["--http-aiohttp-only"] if aiohttp_only else [])
        self.procs = self.c.procs
        self.ids = self.c.ids
        self.c.start()

    def url(self, nid):
        return self.c.url(nid)

    async def leader(self, session):
        return await self.c.leader(session)

    async def ops(self, load, nid, value):
        return await http_ops(load, self.url(nid), value)

    def close(self):
        self.c.procs.stop()


class Etcd(System):
    """etcd 3.4 (Debian's etcd-server) through its JSON gateway; fsync is always on."""

    name = "etcd"

    def __init__(self, root: str) -> None:
        if subprocess.run(["which", "etcd"], capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "install", "-y", "-q", "etcd-server"], check=True, capture_output=True)
        self.ids = ["e1", "e2", "e3"]
        self.client = {i: free_port() for i in self.ids}
        peer = {i: free_port() for i in self.ids}
        cluster = ",".join(f"{i}=http://127.0.0.1:{peer[i]}" for i in self.ids)
        self.procs = Procs()
        for i in self.ids:
            args = [
                "--name", i, "--data-dir", os.path.join(root, i),
                "--listen-client-urls", f"http://127.0.0.1:{self.client[i]}", "--advertise-client-urls", f"http://127.0.0.1:{self.client[i]}",
                "--listen-peer-urls", f"http://127.0.0.1:{peer[i]}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer[i]}",
                "--initial-cluster", cluster, "--initial-cluster-state", "new", "--initial-cluster-token", "bench",
                "--logger", "zap", "--log-level", "error",
            ]
            self.procs.spawn(i, ["etcd", *args], os.path.join(root, f"{i}.log"))

    def url(self, nid):
        return f"http://127.0.0.1:{self.client[nid]}"

    async def leader(self, session):
        async def leads(i):
            async with session.post(self.url(i) + "/v3/maintenance/status", data=b"{}") as r:
                st = await r.json()
            return st.get("leader") and st.get("leader") == st.get("header", {}).get("member_id")

        return await find_node(self.ids, leads, timeout=30, interval=0.1, error="etcd elected no leader")

    async def ops(self, load, nid, value, keys: int = 10_000):
        t = Target(load, self.url(nid))
        b64 = base64.b64encode
        v64 = b64(value).decode()

        async def call(path, body):
            ok(*await t.request(b"POST", path.encode(), body, b"Content-Type: application/json\r\n"))

        async def put(i):
            await call("/v3/kv/put", b'{"key":"%s","value":"%s"}' % (b64(b"bench/%d" % (i % keys)), v64.encode()))

        def get(serializable):
            flag = b"true" if serializable else b"false"

            async def op(i):
                await call("/v3/kv/range", b'{"key":"%s","serializable":%s}' % (b64(b"bench/%d" % (i % keys)), flag))

            return op

        return [("PUT", put), ("GET linearizable", get(False)), ("GET stale", get(True))]

    def close(self):
        self.procs.stop()


class PySyncObj(System):
    """PySyncObj's ReplDict behind a minimal aiohttp server (benchmarks/pysyncobj_server.py).
    PySyncObj 0.3.x writes its journal through mmap and never fsyncs it."""

    def __init__(self, root: str, batch: bool) -> None:
        self.name = f"pysyncobj (batching {'on' if batch else 'off'})"
        self.ids = ["p1", "p2", "p3"]
        raft = {i: f"127.0.0.1:{free_port()}" for i in self.ids}
        self.http = {i: free_port() for i in self.ids}
        self.procs = Procs()
        for i in self.ids:
            partners = ",".join(raft[j] for j in self.ids if j != i)
            cmd = [sys.executable, os.path.join(HERE, "pysyncobj_server.py"), raft[i], partners, str(self.http[i]), os.path.join(root, f"{i}.journal"), "on" if batch else "off"]
            self.procs.spawn(i, cmd, os.path.join(root, f"{i}.log"))

    def url(self, nid):
        return f"http://127.0.0.1:{self.http[nid]}"

    async def leader(self, session):
        async def leads(i):
            async with session.get(self.url(i) + "/status") as r:
                return (await r.json())["leader"]

        return await find_node(self.ids, leads, timeout=30, interval=0.1, error="pysyncobj elected no leader")

    async def ops(self, load, nid, value):
        return await http_ops(load, self.url(nid), value)

    def close(self):
        self.procs.stop()
