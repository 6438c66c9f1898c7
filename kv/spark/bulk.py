"""Bulk writes of (key, value) rows into a running cluster: what each import task runs.

Rows arrive sorted by key, in chunks. For each chunk the writer first reads what the
cluster holds over the chunk's key range (a linearizable scan, page by page) and keeps only
the rows whose value differs: re-importing unchanged data proposes nothing and appends
nothing to the log. The rest go out as transactions sized by bytes on the wire, each row
compared on the mod_index it was read at (0: absent), so a key another writer changed in
between is never overwritten blindly. Values travel as base64 (`"value"` with
`"encoding": "base64"`, as POST /v1/txn documents it), so 1 MB of any bytes is about 1.33 MB on the wire; as JSON text,
control bytes would grow six-fold.

Failures are per row: a transaction the cluster refuses (400, 413) is split in halves until
the row at fault fails alone; a comparison that no longer holds (412) is resolved from the
transaction's `failure` branch, which reads every key back (rows that already hold their
value are skipped, rows another writer changed fail, the others are sent again). A write
whose outcome is unknown (504) is sent once more, which the comparisons make safe. When the
cluster stops answering, or the deadline passes, the remaining rows fail at once with the
reason instead of being retried batch after batch.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import orjson

from ..client.async_client import AsyncClient
from ..common.wire import value_fields, value_from
from ..errors import BadRequest, KVError, Timeout, ValueTooLarge
from .progress import Reporter

JSON_OVERHEAD = 112  # bytes per row of the transaction document besides key and value


@dataclass
class Settings:
    endpoints: list[str]
    token: str | None = None
    batch_rows: int = 128  # the cluster's default --max-txn-ops (compares per transaction)
    batch_bytes: int = 1 << 20
    concurrency: int = 4
    deadline: float = 0.0  # time.time() after which nothing more is sent (0: none)
    began: int = 0  # the cluster's commit index when the import began: a row found holding its value since then was written by it
    progress: tuple | None = None  # where the driver's progress line listens (progress.Reporter)
    request_timeout: float = 30.0


@dataclass
class Outcome:
    """What one task did: every row it was given is written, skipped or failed."""

    written: int = 0
    skipped: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)  # (key, reason)
    transactions: int = 0
    wire_bytes: int = 0

    def add(self, other: Outcome) -> None:
        self.written += other.written
        self.skipped += other.skipped
        self.failed += other.failed
        self.transactions += other.transactions
        self.wire_bytes += other.wire_bytes


@dataclass
class _Row:
    key: str
    value: bytes
    mod_index: int  # what the key held when it was read (0: absent)


class _Stop(Exception):
    """The cluster is out of reach or the deadline passed: fail what is left."""


def wire_size(key: str, value: bytes) -> int:
    return 2 * len(key.encode()) + (len(value) + 2) // 3 * 4 + JSON_OVERHEAD


def lower_bound(key: str) -> str | None:
    """A scan `after` bound that every key >= `key` is strictly after (scans are exclusive)."""
    return key[:-1] if len(key) > 1 else None


async def write_chunks(chunks, s: Settings) -> Outcome:
    """Write an iterable of chunks, each a list of (key str, value bytes) sorted by key."""
    out = Outcome()
    reporter = Reporter(s.progress)
    try:
        async with AsyncClient(s.endpoints, token=s.token, timeout=s.request_timeout, connections=s.concurrency + 1) as c:
            c.rotation.prefer(c.endpoints[0])  # the leader (live_endpoints' first): a follower would forward every write to it
            w = _Writer(c, s, out)
            for chunk in chunks:
                await w.chunk(chunk)
                reporter.add(len(chunk), len(chunk))
    finally:
        reporter.close()
    return out


class _Writer:
    def __init__(self, client, s: Settings, out: Outcome) -> None:
        self.c, self.s, self.out = client, s, out
        self.stopped: str | None = None  # why nothing more is sent

    def _held(self, mod_index: int) -> None:
        """A row whose key holds its value already: written by this import (by an attempt
        of this task that failed afterwards, and Spark ran it again) if it changed after
        the import began, else skipped."""
        if self.s.began and mod_index > self.s.began:
            self.out.written += 1
        else:
            self.out.skipped += 1

    def _budget(self) -> None:
        """Each request gets what is left of the overall deadline."""
        if self.stopped:
            raise _Stop(self.stopped)
        if self.s.deadline:
            left = self.s.deadline - time.time()
            if left <= 0:
                self.stopped = "not written: the import's --timeout passed"
                raise _Stop(self.stopped)
            self.c.timeout = min(self.s.request_timeout, left)

    async def chunk(self, items: list[tuple[str, bytes]]) -> None:
        try:
            self._budget()
            held = await self._read(items[0][0], items[-1][0])
        except _Stop as e:
            self.out.failed += [(k, str(e)) for k, _ in items]
            return
        except KVError as e:
            self.stopped = f"not written: the cluster could not be read ({e})"
            self.out.failed += [(k, self.stopped) for k, _ in items]
            return
        todo = []
        for key, value in items:
            cur = held.get(key)
            if cur is not None and cur[0] == value:
                self._held(cur[1])
            else:
                todo.append(_Row(key, value, cur[1] if cur is not None else 0))
        gate = asyncio.Semaphore(self.s.concurrency)

        async def run(batch):
            async with gate:
                await self._send(batch, unknown=False)

        await asyncio.gather(*(run(b) for b in self._batches(todo)))

    async def _read(self, first: str, last: str) -> dict[str, tuple[bytes, int]]:
        held = {}
        async for it in self.c.scan("", after=lower_bound(first), page=5000):
            if it.key > last:
                break
            held[it.key] = (it.value, it.mod_index)
        return held

    def _batches(self, rows: list[_Row]):
        batch, size = [], 0
        for r in rows:
            n = wire_size(r.key, r.value)
            if batch and (len(batch) >= self.s.batch_rows or size + n > self.s.batch_bytes):
                yield batch
                batch, size = [], 0
            batch.append(r)
            size += n
        if batch:
            yield batch

    async def _send(self, rows: list[_Row], unknown: bool) -> None:
        """Propose rows as one transaction; settles every row as written, skipped or failed."""
        while rows:
            try:
                self._budget()
                status, body = await self._txn(rows)
            except _Stop as e:
                self.out.failed += [(r.key, str(e)) for r in rows]
                return
            except (BadRequest, ValueTooLarge) as e:
                if len(rows) == 1:
                    self.out.failed.append((rows[0].key, str(e)))
                    return
                half = len(rows) // 2  # find the row at fault; the others go through
                await self._send(rows[:half], unknown)
                await self._send(rows[half:], unknown)
                return
            except Timeout as e:
                if unknown:  # a second unknown outcome in a row: report it, do not storm
                    self.out.failed += [(r.key, f"outcome unknown: {e}") for r in rows]
                    return
                unknown = True  # sent again below: the comparisons make that safe
                continue
            except KVError as e:
                self.stopped = f"not written: {e}"
                self.out.failed += [(r.key, self.stopped) for r in rows]
                return
            if status == 200:
                self.out.written += len(rows)
                return
            again = self._settle(rows, orjson.loads(body)["results"], unknown)
            if len(again) == len(rows):  # a 412 that no key explains: report, do not loop
                self.out.failed += [(r.key, "the cluster refused the comparison on mod_index (412) though the key was unchanged") for r in rows]
                return
            rows = again

    def _settle(self, rows: list[_Row], results: list[dict], unknown: bool) -> list[_Row]:
        """After a 412: what each key holds now decides its row; returns the rows to resend."""
        again = []
        for r, now in zip(rows, results):
            mod = now["mod_index"] if now.get("found") else 0
            if mod == r.mod_index:
                again.append(r)
                continue
            value = value_from(now) if now.get("found") else None
            if value == r.value:  # holds it already (a previous attempt of ours, or anyone's)
                if unknown:
                    self.out.written += 1
                else:
                    self._held(mod)
            else:
                self.out.failed.append((r.key, f"changed by another writer during the import (mod_index {r.mod_index} -> {mod}); not overwritten"))
        return again

    async def _txn(self, rows: list[_Row]) -> tuple[int, bytes]:
        doc = {
            "compare": [{"key": r.key, "mod_index": r.mod_index} for r in rows],
            "success": [{"op": "put", "key": r.key, **value_fields(r.value, base64_always=True)} for r in rows],
            "failure": [{"op": "get", "key": r.key} for r in rows],  # on a 412: what each key holds
        }
        data = orjson.dumps(doc)
        self.out.transactions += 1
        self.out.wire_bytes += len(data)
        status, _, body = await self.c.request(
            "POST", "/v1/txn", data=data, params={"encoding": "base64"}, headers={"Content-Type": "application/json"}, ok=(200, 412)
        )
        return status, body
