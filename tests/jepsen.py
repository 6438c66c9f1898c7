"""Workloads and a nemesis against a real cluster (ProcCluster), Jepsen style.

- register: clients read (linearizable), write unique values and compare-and-set (If-Match
  on the version they read) a few keys; the history is checked for linearizability.
- set: clients write unique keys; every acknowledged key must be there at the end.

A nemesis injects faults meanwhile; at the end everything is healed and restarted, the
nodes must converge to identical data, and the checks run.

HTTP outcomes: 200 ok; 412 a CAS that did not apply (a definite outcome); 503 nothing was
done (no leader: the write was refused before it reached the log) — dropped from the
history, so a wrong 503 shows up as an anomaly; 504, a timeout or a broken connection:
unknown (the write may or may not have happened).

With `sessions`, every write goes in a client session (X-Kv-Session, X-Kv-Seq) and a write
whose outcome is unknown is sent again, the same request, to any node until it is answered
or its deadline passes: the cluster must apply it once. With `history`, every written value
is unique and the run ends by reading back every change the cluster made (a watch from
index 1; the nodes must not compact): each acknowledged write must be there exactly once, a
refused one (412, 503) never, one of unknown outcome at most once, and no value twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
from cluster import ProcCluster
from linearizability import Op, check

# The register workload uses 4 keys at a time and moves to 4 fresh ones every KEY_SECONDS
# (like Jepsen's independent keys): each key's history stays short, so the checker's search
# stays bounded however long a run lasts. Unknown writes never return, so in one long
# history every one of them stays a candidate at every later point of the search.
KEYS_AT_A_TIME = 4
KEY_SECONDS = 10.0


@dataclass
class Report:
    ops: int = 0  # register and set requests that reached a node: ok (outcome known) + unknown
    ok: int = 0
    unknown: int = 0
    acked_writes: int = 0
    set_acked: int = 0
    set_lost: list = field(default_factory=list)
    faults: Counter = field(default_factory=Counter)
    linearizable: bool = True
    bad_key: str | None = None
    history_path: str = ""  # where the history of bad_key was saved
    explored: int = 0  # states the linearizability search visited
    converged: bool = False
    divergence: str = ""
    # with history: values a watch from index 1 shows twice, acknowledged ones it lacks, refused ones it holds
    applied_twice: list = field(default_factory=list)
    acked_missing: list = field(default_factory=list)
    refused_applied: list = field(default_factory=list)
    resent: int = 0  # writes sent again, in the same session request, after their outcome was unknown

    @property
    def anomalies(self) -> int:
        return (
            (0 if self.linearizable else 1) + len(self.set_lost) + (0 if self.converged else 1)
            + len(self.applied_twice) + len(self.acked_missing) + len(self.refused_applied)
        )

    def summary(self) -> str:
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) or "none"
        return (
            f"operations {self.ops} (outcome known {self.ok}, unknown {self.unknown}); acknowledged writes {self.acked_writes + self.set_acked}; "
            f"faults: {faults}; linearizable: {self.linearizable} ({self.explored} states searched{', history in ' + self.history_path if self.history_path else ''}); lost acknowledged set writes: {len(self.set_lost)}; "
            f"converged: {self.converged}{' (' + self.divergence + ')' if self.divergence else ''}; "
            f"resent {self.resent}; applied twice {len(self.applied_twice)}, acknowledged but missing {len(self.acked_missing)}, "
            f"refused but applied {len(self.refused_applied)}; anomalies: {self.anomalies}"
        )


WRITE_DEADLINE_S = 10.0  # how long a session's write is sent again while its outcome is unknown


class Workload:
    def __init__(self, c: ProcCluster, seed: int, sessions: bool = False) -> None:
        self.c = c
        self.rng = random.Random(seed)
        self.history: list[Op] = []
        self.set_acked: set[str] = set()
        self.counter = 0
        self.stop = False
        self.report = Report()
        self.started = time.monotonic()
        self.sessions = sessions
        self._session: dict[int, tuple[int, int]] = {}  # client -> (session, its last seq)
        self.written: dict[str, str] = {}  # value -> "ok" | "refused" | "unknown"

    def _unique(self, client: int) -> str:
        self.counter += 1
        return f"c{client}-{self.counter}"

    async def _request(self, s: aiohttp.ClientSession, node: str, method: str, path: str, data=None, headers=None):
        """(status, body, etag); status None means the outcome is unknown."""
        try:
            async with s.request(method, self.c.url(node) + path, data=data, headers=headers) as r:
                return r.status, await r.read(), r.headers.get("ETag")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None, b"", None

    async def _write(self, s: aiohttp.ClientSession, client: int, node: str, path: str, value: str, headers=None) -> int | None:
        """PUT a unique value; the status (None: outcome unknown), noted in `written`."""
        status = await self._put(s, client, node, path, value.encode(), headers)
        self.written[value] = "ok" if status == 200 else "unknown" if status in (None, 504) else "refused"
        return status

    async def _put(self, s: aiohttp.ClientSession, client: int, node: str, path: str, data: bytes, headers) -> int | None:
        if not self.sessions:
            return (await self._request(s, node, "PUT", path, data=data, headers=headers))[0]
        deadline = time.monotonic() + WRITE_DEADLINE_S
        reached = False  # whether a copy may have reached a node
        rid = None  # (session, seq): the same on every copy
        while True:
            if rid is None:
                if client not in self._session:
                    status, body, _ = await self._request(s, node, "POST", "/v1/sessions")
                    if status == 200:
                        self._session[client] = (json.loads(body)["id"], 0)
                if client in self._session:
                    session, seq = self._session[client]
                    rid = self._session[client] = (session, seq + 1)
            if rid is not None:
                h = {**(headers or {}), "X-Kv-Session": str(rid[0]), "X-Kv-Seq": str(rid[1])}
                status, body, _ = await self._request(s, node, "PUT", path, data=data, headers=h)
                if status in (200, 412, 404):
                    return status
                if status == 409 and b"SESSION_EXPIRED" in body:
                    self._session.pop(client, None)
                    if reached:
                        return None
                    rid = None
                    continue
                if status is None or status == 504:
                    reached = True
                    self.report.resent += 1
            if time.monotonic() > deadline or self.stop:
                return None if reached else 503
            node = self.rng.choice(self.c.ids)
            await asyncio.sleep(0.05)

    async def register_client(self, client: int) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=4)) as s:
            while not self.stop:
                node = self.rng.choice(self.c.ids)
                generation = int((time.monotonic() - self.started) // KEY_SECONDS)
                key = f"reg{generation}-{self.rng.randrange(KEYS_AT_A_TIME)}"
                dice = self.rng.random()
                t0 = time.monotonic()
                if dice < 0.5 or dice >= 0.8:
                    status, body, etag = await self._request(s, node, "GET", f"/v1/kv/{key}")
                    t1 = time.monotonic()
                    if status in (200, 404):
                        value = body.decode() if status == 200 else None
                        self._record(Op(client, "read", key, t0, t1, None, value))
                        if dice >= 0.8 and status == 200:
                            await self._cas(s, client, node, key, value, etag)
                    continue
                value = self._unique(client)
                status = await self._write(s, client, node, f"/v1/kv/{key}", value)
                t1 = time.monotonic()
                if status == 200:
                    self._record(Op(client, "write", key, t0, t1, value))
                    self.report.acked_writes += 1
                elif status is None or status == 504:
                    self._record(Op(client, "write", key, t0, t1, value, status="unknown"))
                # 503: refused before it reached the log; leave it out

    async def _cas(self, s, client: int, node: str, key: str, expected: str, etag: str) -> None:
        new = self._unique(client)
        t0 = time.monotonic()
        status = await self._write(s, client, node, f"/v1/kv/{key}", new, headers={"If-Match": etag})
        t1 = time.monotonic()
        if status == 200:
            self._record(Op(client, "cas", key, t0, t1, (expected, new), True))
            self.report.acked_writes += 1
        elif status == 412:
            self._record(Op(client, "cas", key, t0, t1, (expected, new), False))
        elif status is None or status == 504:
            self._record(Op(client, "cas", key, t0, t1, (expected, new), None, status="unknown"))

    def _record(self, op: Op) -> None:
        self.history.append(op)
        self.report.ops += 1
        if op.status == "ok":
            self.report.ok += 1
        else:
            self.report.unknown += 1

    async def set_client(self, client: int) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=4)) as s:
            n = 0
            while not self.stop:
                n += 1
                key = f"set/{client}-{n}"
                status = await self._write(s, client, self.rng.choice(self.c.ids), f"/v1/kv/{key}", key)
                if status == 200:
                    self.set_acked.add(key)
                    self.report.set_acked += 1
                    self.report.ok += 1
                elif status is None or status == 504:
                    self.report.unknown += 1
                else:
                    continue  # refused (503) before it reached the log: not an operation
                self.report.ops += 1


class Nemesis:
    def __init__(self, c: ProcCluster, rng: random.Random, report: Report, kinds: list[str], in_order: bool = False) -> None:
        self.c, self.rng, self.report, self.kinds = c, rng, report, kinds
        self.in_order = in_order  # run kinds as listed (cycling): a test that needs certain faults gets them
        self.paused: set[str] = set()

    def leader_or_any(self) -> str:
        try:
            return self.c.leader(timeout=2)
        except AssertionError:
            return self.rng.choice(self.c.ids)

    async def run_one(self, kind: str) -> None:
        c, rng = self.c, self.rng
        self.report.faults[kind] += 1
        loop = asyncio.get_running_loop()
        hold = rng.uniform(1.0, 2.5)  # how long each fault lasts (the sleeps below)
        if kind == "partition":
            victim = rng.choice(c.ids)
            c.isolate(victim)
            await asyncio.sleep(hold)
            c.heal()
        elif kind == "one-way":
            a, b = rng.sample(c.ids, 2)
            c.cut(a, b, both=False)
            await asyncio.sleep(hold)
            c.heal()
        elif kind == "isolate-leader":
            lead = await loop.run_in_executor(None, self.leader_or_any)
            c.isolate(lead)  # clients still talk to it over HTTP
            await asyncio.sleep(hold)
            c.heal()
        elif kind in ("kill-leader", "kill-any"):
            victim = await loop.run_in_executor(None, self.leader_or_any) if kind == "kill-leader" else rng.choice(c.ids)
            await loop.run_in_executor(None, c.kill, victim)
            await asyncio.sleep(hold)
            await loop.run_in_executor(None, c.start, victim)
        elif kind == "pause-leader":
            lead = await loop.run_in_executor(None, self.leader_or_any)
            c.pause(lead)
            await asyncio.sleep(max(hold, 1.2))  # past the election timeout (500 ms here)
            c.resume(lead)
        elif kind == "rolling-restart":
            for nid in c.ids:
                await loop.run_in_executor(None, c.kill, nid)
                await asyncio.sleep(0.2)  # down a moment
                await loop.run_in_executor(None, c.start, nid)
                await asyncio.sleep(0.5)  # up a moment before the next goes down
        elif kind == "hold-back-follower":
            lead = await loop.run_in_executor(None, self.leader_or_any)
            lag = rng.choice([i for i in c.ids if i != lead])
            c.isolate(lag)
            await asyncio.sleep(hold + 2.0)  # writes go on; with a small threshold the leader compacts past it
            c.heal()
        else:
            raise ValueError(kind)

    async def run(self, until: float) -> None:
        turn = 0
        while time.monotonic() < until:
            await asyncio.sleep(self.rng.uniform(0.3, 1.0))  # a pause between faults
            if time.monotonic() < until:
                kind = self.kinds[turn % len(self.kinds)] if self.in_order else self.rng.choice(self.kinds)
                turn += 1
                await self.run_one(kind)


def save_history(c: ProcCluster, ops: list[Op]) -> str:
    path = os.path.join(c.root, "history.json")
    with open(path, "w") as f:
        json.dump([dataclasses.asdict(op) for op in ops], f)
    return path


ALL_FAULTS = ["partition", "one-way", "isolate-leader", "kill-leader", "kill-any", "pause-leader", "rolling-restart", "hold-back-follower"]


async def run(
    c: ProcCluster, seconds: float, seed: int, faults: list[str] = ALL_FAULTS, register_clients: int = 5, set_clients: int = 2,
    sessions: bool = False, history: bool = False, in_order: bool = False,
) -> Report:
    w = Workload(c, seed, sessions)
    nemesis = Nemesis(c, w.rng, w.report, faults, in_order)
    tasks = [asyncio.ensure_future(w.register_client(i)) for i in range(register_clients)]
    tasks += [asyncio.ensure_future(w.set_client(100 + i)) for i in range(set_clients)]
    await nemesis.run(time.monotonic() + seconds)
    # Heal: network, paused and dead nodes.
    c.heal()
    for nid in c.ids:
        c.signal(nid, signal.SIGCONT)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, lambda: c.start(*[i for i in c.ids if not c.alive(i)]) if any(not c.alive(i) for i in c.ids) else None)
    await asyncio.sleep(2.0)  # a quiet moment with clients still running
    w.stop = True
    await asyncio.gather(*tasks)
    r = w.report
    try:
        await loop.run_in_executor(None, lambda: c.wait_converged(timeout=60))
        r.converged = True
    except AssertionError as e:
        r.converged, r.divergence = False, str(e)
    try:
        res = check(w.history)
    except RuntimeError as e:  # the search gave up: keep the history to look at
        raise RuntimeError(f"{e}; the history is in {save_history(c, w.history)}") from e
    if not res.ok:
        r.history_path = save_history(c, [op for op in w.history if op.key == res.key])
    r.linearizable, r.bad_key, r.explored = res.ok, res.key, res.explored
    if r.converged:
        present = {k for k, _, _ in c.dump(c.ids[0]) if k.startswith("set/")}
        r.set_lost = sorted(w.set_acked - present)
        if history:
            await check_applied_once(c, w.written, r)
    return r


async def check_applied_once(c: ProcCluster, written: dict[str, str], r: Report) -> None:
    """Read back every change (a watch from index 1) and hold each written value to its
    outcome: acknowledged exactly once, refused never, unknown at most once."""
    from kv import AsyncClient

    node = c.ids[0]
    st = c.status(node)
    assert st["ledger_begin_index"] == 0, f"{node} compacted its ledger (to {st['ledger_begin_index']}): run without snapshots"
    seen: Counter = Counter()
    async with AsyncClient(c.url(node), timeout=60) as client:
        async for ev in client.watch("", 1, end_index=st["applied_index"]):
            if ev.type == "put":
                seen[ev.value.decode()] += 1
    r.applied_twice = sorted(v for v, n in seen.items() if n > 1)
    r.acked_missing = sorted(v for v, o in written.items() if o == "ok" and seen[v] == 0)
    r.refused_applied = sorted(v for v, o in written.items() if o == "refused" and seen[v] > 0)
