"""Bulk writes of (key, value) rows into a running cluster: what each import task runs.

Rows arrive as Arrow batches sorted by key. For each batch the writer first reads what the
cluster holds over the batch's key range (a linearizable scan, page by page, from each node
in turn; the next batches' reads run meanwhile) and keeps only the rows whose value
differs: re-importing unchanged data proposes nothing and appends nothing to the log. The
rest go out as bulk puts (POST /v1/bulk) of at most `batch_bytes` each, in the columnar
format of kv/statemachine/rows.py, built from the Arrow buffers with numpy: no Python
object per row is made on the way out. Each row is conditional on the mod_index it was
read at (0: absent), so a key another writer changed in between is never overwritten
blindly: the node answers which rows it refused and what their keys hold, and the entry
writes the others. Values travel as they are (no base64, no JSON).

Failures are per row: a request the cluster refuses (400, 413) is split in halves until the
row at fault fails alone; a refused row whose key holds its value already is skipped (or
counted as written, when an earlier attempt of this import wrote it), one another writer
changed fails. A write whose outcome is unknown (504) is sent once more, which the
conditions make safe. When the cluster stops answering, or the deadline passes, the
remaining rows fail at once with the reason instead of being retried batch after batch.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from dataclasses import dataclass, field

from ..client.async_client import AsyncClient
from ..common.wire import key_text
from ..errors import BadRequest, Forbidden, KVError, Timeout, Unauthorized, ValueTooLarge
from ..statemachine.rows import ROW_OVERHEAD
from .progress import Reporter

BATCH_BYTES = 1 << 20  # a bulk put's bytes at most, by default (each one log entry)
CONCURRENCY = 8  # bulk puts in flight per task, by default (4 took 10-25 % longer to import the flights table)
READ_AHEAD = 2  # chunks whose key range is being read while one is compared and sent


@dataclass
class Settings:
    endpoints: list[str]
    token: str | None = None
    batch_rows: int = 0  # rows per request at most (0: as many as batch_bytes holds)
    batch_bytes: int = BATCH_BYTES
    concurrency: int = CONCURRENCY
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
    transactions: int = 0  # bulk puts the cluster took (each one log entry)
    wire_bytes: int = 0

    def add(self, other: Outcome) -> None:
        self.written += other.written
        self.skipped += other.skipped
        self.failed += other.failed
        self.transactions += other.transactions
        self.wire_bytes += other.wire_bytes


def _unknown(e: Exception) -> str:
    """Why a row sent once already, with no answer, is reported failed: it may be written.
    `e` is the last attempt's error, which may say that attempt was not carried out: an
    earlier one may have been."""
    return f"outcome unknown (it was sent, and an attempt may have been written: import again to settle it); the last attempt: {e}"


class _Stop(Exception):
    """The cluster is out of reach or the deadline passed: fail what is left."""


def lower_bound(key: str) -> str | None:
    """A scan `after` bound that every key >= `key` is strictly after (scans are exclusive)."""
    return key[:-1] if len(key) > 1 else None


class ArrowRows:
    """Some rows as Arrow binary columns, with each row's condition (numpy uint64)."""

    def __init__(self, keys, values, conds) -> None:
        self.keys, self.values, self.conds = keys, values, conds

    def __len__(self) -> int:
        return len(self.keys)

    def slice(self, start: int, end: int) -> ArrowRows:
        return ArrowRows(self.keys.slice(start, end - start), self.values.slice(start, end - start), self.conds[start:end])

    def key(self, i: int) -> str:
        return key_text(self.keys[i].as_py())

    def sizes(self):
        """Each row's bytes in a bulk body."""
        import numpy as np

        return _lengths(self.keys).astype(np.int64) + _lengths(self.values) + ROW_OVERHEAD

    def body(self) -> bytes:
        """The rows in kv/statemachine/rows.py's format, from the Arrow buffers."""
        n = len(self.keys)
        return b"".join((
            n.to_bytes(4, "big"),
            _lengths(self.keys).astype(">u2").tobytes(),
            _lengths(self.values).astype(">u4").tobytes(),
            self.conds.astype(">u8").tobytes(),
            _data(self.keys),
            _data(self.values),
        ))


def _offsets(a):
    import numpy as np

    return np.frombuffer(a.buffers()[1], dtype=np.int32)[a.offset : a.offset + len(a) + 1]


def _lengths(a):
    import numpy as np

    return np.diff(_offsets(a))


def _data(a) -> memoryview | bytes:
    o = _offsets(a)
    return memoryview(a.buffers()[2])[o[0] : o[-1]] if len(a) else b""


def arrays(body: bytes):
    """A body in kv/statemachine/rows.py's format as Arrow arrays: keys and values (binary)
    and the condition column (uint64; a scan's answer puts each key's mod_index there)."""
    import numpy as np
    import pyarrow as pa

    n = int.from_bytes(body[:4], "big")
    head = 4 + ROW_OVERHEAD * n
    if len(body) < head:
        raise KVError(f"a scan answered {len(body)} bytes that are not rows (an older node that ignores ?format=rows?): upgrade every node")
    key_lens = np.frombuffer(body, ">u2", n, 4)
    value_lens = np.frombuffer(body, ">u4", n, 4 + 2 * n)
    conds = np.frombuffer(body, ">u8", n, 4 + 6 * n).astype(np.uint64)
    key_at, value_at = (np.concatenate(([0], np.cumsum(lens, dtype=np.int64))).astype(np.int32) for lens in (key_lens, value_lens))
    if head + int(key_at[-1]) + int(value_at[-1]) != len(body):
        raise KVError(f"a scan answered {len(body)} bytes whose row lengths do not add up: upgrade every node")
    data = memoryview(body)
    keys = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(key_at), pa.py_buffer(data[head : head + int(key_at[-1])])])
    at = head + int(key_at[-1])
    values = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(value_at), pa.py_buffer(data[at : at + int(value_at[-1])])])
    return keys, values, pa.array(conds, pa.uint64())


def binary(column):
    """An Arrow column (string or binary) as a binary array with 32-bit offsets, no nulls."""
    import pyarrow as pa

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return column if column.type == pa.binary() else column.cast(pa.binary())


async def write_chunks(chunks, s: Settings) -> Outcome:
    """Write an iterable of chunks, each (keys, values) Arrow arrays sorted by key. The
    cluster is read over the next READ_AHEAD chunks' keys while a chunk is compared and sent
    (the chunks' key ranges are disjoint: no read can see another chunk's writes)."""
    out = Outcome()
    reporter = Reporter(s.progress)
    try:
        async with AsyncClient(s.endpoints, token=s.token, timeout=s.request_timeout, connections=s.concurrency + READ_AHEAD + 1) as c:
            c.rotation.prefer(c.endpoints[0])  # the leader (live_endpoints' first): a follower would forward every write to it
            w = _Writer(c, s, out)
            reads: collections.deque = collections.deque()  # (keys, values, the read of their range)
            try:
                for keys, values in chunks:
                    keys, values = binary(keys), binary(values)
                    reads.append((keys, values, w.read_ahead(keys)))
                    if len(reads) > READ_AHEAD:
                        n = await w.chunk(*reads.popleft())
                        reporter.add(n, n)
                while reads:
                    n = await w.chunk(*reads.popleft())
                    reporter.add(n, n)
            finally:
                for _, _, read in reads:  # (the import stopped: reads no one will look at)
                    if read is not None and not read.cancel() and not read.cancelled():
                        read.exception()  # (done already: its error, if any, is seen, not logged as lost)
            await w.drain()
    finally:
        reporter.close()
    return out


class _Writer:
    def __init__(self, client, s: Settings, out: Outcome) -> None:
        self.c, self.s, self.out = client, s, out
        self.stopped: str | None = None  # why nothing more is sent (the cause)
        self.gate = asyncio.Semaphore(s.concurrency)
        self.sending: set[asyncio.Task] = set()
        # The nodes the reads go to in turn: a scan costs the node that answers it CPU
        # (on the leader alone, a re-import of unchanged data waited on that one core).
        self.readers = collections.deque(s.endpoints)

    def _held(self, mod_indexes) -> None:
        """Rows whose key holds their value already (at these mod_indexes): written by this
        import (by an attempt of this task that failed afterwards, and Spark ran it again)
        if it changed after the import began, else skipped."""
        import numpy as np

        mods = np.asarray(mod_indexes, dtype=np.uint64)
        newer = int((mods > self.s.began).sum()) if self.s.began else 0
        self.out.written += newer
        self.out.skipped += len(mods) - newer

    def _budget(self) -> None:
        """Each request gets what is left of the overall deadline."""
        if self.stopped:
            raise _Stop(self.stopped)
        if self.s.deadline:
            left = self.s.deadline - time.time()
            if left <= 0:
                self.stopped = "the import's --timeout passed"
                raise _Stop(self.stopped)
            self.c.timeout = min(self.s.request_timeout, left)

    def _fail(self, rows: ArrowRows, reason: str) -> None:
        self.out.failed += [(key_text(k), reason) for k in rows.keys.to_pylist()]

    def read_ahead(self, keys) -> asyncio.Task | None:
        """The read of what the cluster holds over these keys (sorted), started now."""
        if not len(keys):
            return None
        return asyncio.ensure_future(self._read(key_text(keys[0].as_py()), key_text(keys[-1].as_py())))

    async def _read(self, first: str, last: str):
        self._budget()
        return await self._scan(first, last)

    async def chunk(self, keys, values, read: asyncio.Task | None) -> int:
        """Wait for the read of the chunk's keys (read_ahead), then send what differs; the
        sends run on while the next chunks are read (at most `concurrency` at a time).
        Returns the chunk's rows."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        n = len(keys)
        if read is None:
            return n
        try:
            held_keys, held_values, held_mods = await read
            self._budget()
        except _Stop as e:
            self._fail(ArrowRows(keys, values, None), f"not written: {e}")
            return n
        except KVError as e:
            self.stopped = self.stopped or f"the cluster could not be read ({e})"
            self._fail(ArrowRows(keys, values, None), f"not written: {self.stopped}")
            return n
        conds = np.zeros(len(keys), dtype=np.uint64)
        if len(held_keys):
            at = pc.index_in(keys, value_set=held_keys)
            found = at.is_valid()
            same = pc.and_(found, pc.fill_null(pc.equal(values, held_values.take(at)), False))
            mods = pc.fill_null(held_mods.take(at), 0).to_numpy(zero_copy_only=False)
            same_np = same.to_numpy(zero_copy_only=False)
            if same_np.any():
                self._held(mods[same_np])
                keep = pa.array(~same_np)
                keys, values, mods = keys.filter(keep), values.filter(keep), mods[~same_np]
            conds = mods.astype(np.uint64)
        for part in self._parts(ArrowRows(keys, values, conds)):
            await self.gate.acquire()
            t = asyncio.create_task(self._send_released(part))
            self.sending.add(t)
            t.add_done_callback(self.sending.discard)
        return n

    async def drain(self) -> None:
        while self.sending:
            await asyncio.gather(*list(self.sending))

    async def _scan(self, first: str, last: str):
        """(keys, values, mod_indexes) the cluster holds from first to last, as Arrow arrays,
        read in the bulk format (GET /v1/kv?format=rows: no JSON, no base64)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        # Under the keys' common prefix: the scan stops at its end, not at a page of the
        # keys that follow (another task's range, written meanwhile).
        params = {"prefix": os.path.commonprefix([first, last]), "limit": "10000", "format": "rows"}
        after = lower_bound(first)
        end = pa.scalar(last.encode("utf-8", "surrogateescape"), pa.binary())
        parts = []
        while True:
            if after is not None:
                params["after"] = after
            headers, body = await self._page(params)
            page = arrays(body)
            parts.append(page)
            # (a page that ends at the last key holds all there is: no page of the next keys)
            if headers.get("X-Kv-More") != "true" or not len(page[0]) or pc.greater_equal(page[0][-1], end).as_py():
                break
            after = key_text(page[0][-1].as_py())
        keys, values, mods = (pa.concat_arrays([p[i] for p in parts]) for i in range(3))
        within = pc.less_equal(keys, end)
        return keys.filter(within), values.filter(within), mods.filter(within)

    async def _page(self, params: dict) -> tuple:
        """A page of a linearizable scan (as fresh from a follower as from the leader: it
        asks the leader for the read index) from the next node in turn; a node that fails
        to answer it within one attempt's time (the client's attempt_timeout: a node
        stopped, or too busy) is left out of the turns, and the page is read wherever the
        client's failover finds a node."""
        while self.readers:
            ep = self.readers[0]
            self.readers.rotate(-1)
            try:
                _, headers, body = await asyncio.wait_for(self.c.request("GET", "/v1/kv", params=params, endpoint=ep), self.c.attempt_timeout)
                return headers, body
            except (BadRequest, Unauthorized, Forbidden):
                raise  # (the request itself: every node would refuse it)
            except (KVError, asyncio.TimeoutError):
                if ep in self.readers:
                    self.readers.remove(ep)
        _, headers, body = await self.c.request("GET", "/v1/kv", params=params)
        return headers, body

    def _parts(self, rows: ArrowRows):
        """The rows cut into requests of at most batch_bytes (and batch_rows) each."""
        import numpy as np

        if not len(rows):
            return
        ends = np.cumsum(rows.sizes())
        start, base = 0, 0
        while start < len(rows):
            end = int(np.searchsorted(ends, base + self.s.batch_bytes, side="right"))
            end = max(end, start + 1)
            if self.s.batch_rows:
                end = min(end, start + self.s.batch_rows)
            yield rows.slice(start, end)
            base = int(ends[end - 1])
            start = end

    async def _send_released(self, rows: ArrowRows) -> None:
        try:
            await self._send(rows, unknown=False)
        finally:
            self.gate.release()

    async def _send(self, rows: ArrowRows, unknown: bool) -> None:
        """Propose rows as one bulk put; settles every row as written, skipped or failed."""
        while True:
            try:
                self._budget()
                body = rows.body()
                self.out.wire_bytes += len(body)
                r = await self.c.bulk_put(body)
            except _Stop as e:
                return self._fail(rows, _unknown(e) if unknown else f"not written: {e}")
            except (BadRequest, ValueTooLarge) as e:
                if len(rows) == 1:
                    self.out.failed.append((rows.key(0), str(e)))
                    return
                half = len(rows) // 2  # find the row at fault; the others go through
                await self._send(rows.slice(0, half), unknown)
                await self._send(rows.slice(half, len(rows)), unknown)
                return
            except Timeout as e:
                if unknown:  # a second unknown outcome in a row: report it, do not storm
                    return self._fail(rows, _unknown(e))
                unknown = True  # sent again below: the conditions make that safe
                continue
            except KVError as e:
                self.stopped = str(e)
                return self._fail(rows, _unknown(e) if unknown else f"not written: {e}")
            except Exception as e:  # of no kind the client knows (a connection cut mid-answer): it may be written
                return self._fail(rows, _unknown(f"{type(e).__name__}: {e}"))
            self.out.transactions += 1
            self.out.written += r.written
            for x in r.refused:
                if not x.held:
                    was = int(rows.conds[x.row])
                    self.out.failed.append((x.key, f"changed by another writer during the import (mod_index {was} -> {x.mod_index}); not overwritten"))
                elif unknown:  # the first copy wrote it
                    self.out.written += 1
                else:
                    self._held([x.mod_index])
            return
