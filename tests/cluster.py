"""A cluster of real `kv serve` processes on loopback, for tests.

Each node's peer links to the others go through LinkProxy instances (proxies[(i, j)] carries
i's messages to j), so tests can partition the network — one way, both ways, an isolated
leader that clients still reach — without root. Nodes can be killed (-9), paused (SIGSTOP),
resumed and restarted; every process and proxy is stopped by close().
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import orjson
from netproxy import LinkProxy, ProxyLoop

from kv.bench.harness import Procs, free_port, leader_of, wait_until

__all__ = ["FAST", "Proc", "ProcCluster", "wait_until"]

FAST = ["--heartbeat-ms", "50", "--election-timeout-ms", "500"]


class Proc:
    """A child process whose stdout lines can be awaited with a timeout."""

    def __init__(self, args: list[str], env: dict | None = None) -> None:
        self.p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.p.stdout:
            self.lines.put(line.rstrip("\n"))

    def expect(self, want: str, timeout: float) -> float:
        """Wait for a line starting with `want`; returns when it came (time.monotonic())."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {want!r} from {self.p.args} within {timeout}s; stderr: {self.stderr()}") from None
            if line.startswith(want):
                return time.monotonic()

    def quiet(self, seconds: float) -> None:
        time.sleep(seconds)  # a time in which it must print nothing
        assert self.lines.empty(), f"{self.p.args} printed {self.lines.get_nowait()!r}"

    def stderr(self) -> str:
        if self.p.poll() is None:
            return "(still running)"
        return self.p.stderr.read()[-2000:]

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)


class ProcCluster:
    def __init__(self, root: str, n: int = 3, *, extra: list[str] | None = None, env: dict | None = None, proxies: bool = True) -> None:
        self.root = root
        self.ids = [f"n{i}" for i in range(1, n + 1)]
        self.listen = {i: f"127.0.0.1:{free_port()}" for i in self.ids}
        self.http = {i: f"127.0.0.1:{free_port()}" for i in self.ids}
        self.extra = FAST + (extra or [])
        self.env = env or {}
        self.node_env: dict[str, dict] = {i: {} for i in self.ids}
        self.procs = Procs()
        self.scheme, self.ssl_context = "http", None  # set both for nodes serving HTTPS
        self.joining: dict[str, bool] = {}
        self.ploop = ProxyLoop() if proxies else None
        self.proxies: dict[tuple[str, str], LinkProxy] = {}
        if proxies:
            for i in self.ids:
                for j in self.ids:
                    if i != j:
                        self.proxies[(i, j)] = LinkProxy(self.ploop, free_port(), self.listen[j], seed=hash((i, j)) & 0xFFFF)

    # -- processes -------------------------------------------------------------------------

    def peers_for(self, i: str) -> str:
        """What node i is told: its own listen address, and the proxies to the others."""
        parts = []
        for j in self.ids:
            if self.joining.get(j):
                continue
            addr = self.listen[j] if (j == i or (i, j) not in self.proxies) else f"127.0.0.1:{self.proxies[(i, j)].listen_port}"
            parts.append(f"{j}={addr}")
        return ",".join(parts)

    def url(self, i: str) -> str:
        return f"{self.scheme}://{self.http[i]}"

    def endpoints(self) -> str:
        """Every node's client URL, comma-separated (--endpoints, KV_ENDPOINTS)."""
        return ",".join(self.url(i) for i in self.ids)

    def data_dir(self, i: str) -> str:
        return os.path.join(self.root, i)

    def add_node(self, i: str) -> None:
        """A new node (not in the initial --peers) that will join with --join."""
        self.ids.append(i)
        self.listen[i] = f"127.0.0.1:{free_port()}"
        self.http[i] = f"127.0.0.1:{free_port()}"
        self.node_env[i] = {}
        self.joining[i] = True

    def start(self, *ids: str, wait: bool = True, join_via: str | None = None) -> None:
        for i in ids or self.ids:
            if i in self.procs and self.procs[i].poll() is None:
                continue
            os.makedirs(self.data_dir(i), exist_ok=True)
            if self.joining.get(i):
                via = join_via or next(j for j in self.ids if j != i and self.alive(j))
                peers_arg = ["--peers", f"{i}={self.listen[i]}", "--join", self.url(via)]
            else:
                peers_arg = ["--peers", self.peers_for(i)]
            args = ["--id", i, "--data-dir", self.data_dir(i), "--http", self.http[i], *peers_arg, *self.extra]
            self.procs.start(i, args, os.path.join(self.root, f"{i}.log"), env={**os.environ, **self.env, **self.node_env[i]})
        if wait:
            for i in ids or self.ids:
                self.wait_http(i)

    def wait_http(self, i: str, timeout: float = 20.0) -> None:
        def answers() -> bool:
            if self.procs[i].poll() is not None:
                raise AssertionError(f"{i} exited with {self.procs[i].returncode}:\n{self.log(i)[-3000:]}")
            try:
                return bool(self.status(i))
            except OSError:
                return False

        wait_until(answers, timeout, lambda: f"{i} answering:\n{self.log(i)[-3000:]}\n")

    def log(self, i: str) -> str:
        with open(os.path.join(self.root, f"{i}.log"), errors="replace") as f:
            return f.read()

    def signal(self, i: str, sig: int) -> None:
        self.procs.signal(i, sig)

    def kill(self, *ids: str) -> None:
        """kill -9: no chance to flush or say goodbye."""
        self.procs.kill(*ids)

    def pause(self, i: str) -> None:
        self.signal(i, signal.SIGSTOP)

    def resume(self, i: str) -> None:
        self.signal(i, signal.SIGCONT)

    def stop(self, *ids: str) -> None:
        self.procs.stop(*ids)

    def alive(self, i: str) -> bool:
        return self.procs.alive(i)

    def serve_etcd_api(self) -> dict[str, str]:
        """Give every node an etcd API port (--grpc, as KV_GRPC): self.grpc, id -> HOST:PORT."""
        self.grpc = {i: f"127.0.0.1:{free_port()}" for i in self.ids}
        for i in self.ids:
            self.node_env[i]["KV_GRPC"] = self.grpc[i]
        return self.grpc

    def __enter__(self) -> ProcCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.stop()
        if self.ploop is not None:
            for p in self.proxies.values():
                p.close()
            self.ploop.close()
            self.ploop = None

    # -- network ---------------------------------------------------------------------------

    def isolate(self, i: str) -> None:
        for (a, b), p in self.proxies.items():
            if i in (a, b):
                p.cut()

    def cut(self, a: str, b: str, both: bool = True) -> None:
        self.proxies[(a, b)].cut()
        if both:
            self.proxies[(b, a)].cut()

    def heal(self) -> None:
        for p in self.proxies.values():
            p.heal()

    # -- HTTP ------------------------------------------------------------------------------

    def request(self, i: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None, timeout: float = 5.0):
        req = urllib.request.Request(self.url(i) + path, data=body, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self.ssl_context) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def status(self, i: str) -> dict:
        code, _, body = self.request(i, "GET", "/v1/status", timeout=2)
        return orjson.loads(body)

    def leader(self, timeout: float = 15.0, among: list[str] | None = None) -> str:
        """The id of a leader that a majority of its own voters agree on (and that has
        applied its no-op)."""
        among = among or self.ids

        def found() -> str | None:
            views = {}
            for i in self.ids:
                if self.alive(i):
                    try:
                        views[i] = self.status(i)
                    except OSError:
                        pass
            return leader_of(views, among)

        return wait_until(found, timeout, f"a leader among {among}")

    def members(self, i: str) -> list[dict]:
        return orjson.loads(self.request(i, "GET", "/v1/members")[2])["members"]

    def put(self, i: str, key: str, value: bytes, timeout: float = 5.0):
        code, _, body = self.request(i, "PUT", "/v1/kv/" + key, value, timeout=timeout)
        return code, orjson.loads(body) if body else None

    def get(self, i: str, key: str, consistency: str = "linearizable"):
        code, headers, body = self.request(i, "GET", f"/v1/kv/{key}?consistency={consistency}")
        return code, body, headers.get("ETag")

    def dump(self, i: str) -> list:
        """Every key of node i's local state (stale read), paged."""
        items, after = [], None
        while True:
            q = "/v1/kv?consistency=stale&limit=10000&encoding=base64" + (f"&after={urllib.parse.quote(after)}" if after else "")
            code, _, body = self.request(i, "GET", q, timeout=10)
            d = orjson.loads(body)
            items += [(x["key"], x["value"], x["mod_index"]) for x in d["items"]]
            if d["next"] is None:
                return items
            after = d["next"]

    def wait_converged(self, ids: list[str] | None = None, timeout: float = 20.0) -> None:
        """All the given nodes applied the same index and hold the same data."""
        ids = ids or self.ids
        last = None

        def converged() -> bool:
            nonlocal last
            try:
                st = {i: self.status(i) for i in ids}
                applied = {s["applied_index"] for s in st.values()}
                commits = {s["commit_index"] for s in st.values()}
                if len(applied) == 1 and applied == commits:
                    dumps = [self.dump(i) for i in ids]
                    if all(d == dumps[0] for d in dumps):
                        return True
                    last = "data differs"
                else:
                    last = {i: (s["commit_index"], s["applied_index"]) for i, s in st.items()}
            except OSError as e:
                last = e
            return False

        wait_until(converged, timeout, lambda: f"nodes {ids} converged (last seen: {last})", interval=0.1)

