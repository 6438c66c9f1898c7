"""etcd's Watch service: many watches on one bidirectional stream, each over a key, a
range or a prefix, from now or from any revision the node's history still holds, with prev_kv
and the NOPUT/NODELETE filters; "created" answers in request order, progress requests
answered with the applied revision (watch_id -1), every event of one transaction in one
response. A watch starts after a linearizable read barrier: "now" (start revision 0) is
the cluster's, not a lagging follower's.

A watch is one of kv.Node's rich watches (kv/server/watch.py) over the longest prefix its
range shares, filtered to the range. Changes read back from the history (a start revision
before now) carry the key before them as live ones do (statemachine/history.py)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging

from kv import KVError, SlowWatcher, WatchCompacted
from kv.statemachine import commands as cmds

from . import wire
from .access import Access
from .proto import kv_pb2, rpc_pb2, rpc_pb2_grpc

log = logging.getLogger("kv.v3api")

PROGRESS_WATCH_ID = -1  # etcd's id of the answer to a progress request
ERR_EMPTY_RANGE = "mvcc: watcher range is empty"  # etcd's texts (not prefixed with etcdserver:)
ERR_DUPLICATE_ID = "mvcc: duplicate watch ID provided on the WatchStream"
# Watches one stream may hold (etcd sets none; each costs the node ~5 KB, and a 2 MB
# request could ask for 100,000): a client that wants more watches a prefix, or opens
# another stream. (Go's clientv3 puts every watch of a context on one stream.)
MAX_WATCHES_PER_STREAM = 10_000
STREAM_BUFFERS = 4  # a stream's answers queue up to this many --watch-buffer-bytes
ANSWER_OVERHEAD = 256  # bytes a queued answer costs beyond its encoding (the message object)
_PUT, _DELETE = kv_pb2.Event.PUT, kv_pb2.Event.DELETE


def watch_prefix(key: bytes, range_end: bytes) -> str:
    """The longest prefix (as a str of whole characters) every key of the range starts with."""
    if not range_end:
        raw = key
    elif range_end == b"\x00":
        raw = b""
    else:
        n = 0
        while n < min(len(key), len(range_end)) and key[n] == range_end[n]:
            n += 1
        raw = key[:n]
    while raw:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raw = raw[:-1]
    return ""


class _Stream:
    """The watches of one client stream and the one queue of its answers.

    The queue is bounded (STREAM_BUFFERS x --watch-buffer-bytes): while it holds more, the
    watches take no more changes from the node (they pile up in each watch's own buffer,
    bounded and counted in --watch-budget-bytes, where a watch that falls too far behind is
    cut off as on /v1/watch) and the client's requests are not read (HTTP/2's flow control
    then stops the client): a client that never reads costs the node a bounded amount,
    whatever it asks for. The changes in the queue count in the node's budget too; a batch
    that does not fit waits for the stream to drain (never refused: a client that reads is
    not cut off for what other clients hold)."""

    def __init__(self, service: WatchService, context) -> None:
        self.service, self.context = service, context
        self.out: collections.deque = collections.deque()
        self.queued = 0  # bytes of the answers in `out` (against `limit`)
        self.limit = STREAM_BUFFERS * service.node.config.watch_buffer_bytes
        self.budgeted = 0  # of `queued`, the bytes of changes, counted in the node's watch budget
        self.closed = False
        self._changed = asyncio.Event()  # `out` got an answer, or gave one up
        # The watches waiting for the stream to drain wait here in turn, one of them on
        # `_changed`: each answer read wakes one, not every watch of the stream (a stream of
        # 5,000 stalled watches cost 6 ms of the node's loop per answer the client read).
        self._turn = asyncio.Lock()
        self.tasks: dict[int, asyncio.Task] = {}
        self.live = 0  # of the tasks, the watches running (_pump)
        self.next_id = 0

    def put(self, msg: rpc_pb2.WatchResponse, budgeted: int = 0) -> None:
        """Queue an answer (`budgeted`: its size, when it is counted in the node's budget)."""
        if self.closed:
            self.service.node.watches.release(budgeted)
            return
        size = (budgeted or msg.ByteSize()) + ANSWER_OVERHEAD
        self.out.append((msg, size, budgeted))
        self.queued += size
        self.budgeted += budgeted
        self._changed.set()

    async def put_changes(self, msg: rpc_pb2.WatchResponse) -> None:
        """Queue an answer of events, counted in the node's watch budget; when the budget
        has no room for it, once this stream has sent everything before it."""
        size = msg.ByteSize()
        hub = self.service.node.watches
        if not hub.reserve(size):
            async with self._turn:
                while not hub.reserve(size):
                    if not self.out:
                        hub.hold(size)  # (one batch past the budget, as a watch's own buffer lets one change past its bound)
                        break
                    self._changed.clear()
                    await self._changed.wait()
        self.put(msg, size)

    async def get(self) -> rpc_pb2.WatchResponse:
        while not self.out:
            self._changed.clear()
            await self._changed.wait()
        msg, size, budgeted = self.out.popleft()
        self.queued -= size
        self.budgeted -= budgeted
        self.service.node.watches.release(budgeted)
        self._changed.set()
        return msg

    async def room(self) -> None:
        """Wait until the queue holds at most its limit (a watch: in turn with the others)."""
        if self.queued <= self.limit and not self._turn.locked():
            return
        async with self._turn:
            await self.below_limit()

    async def below_limit(self) -> None:
        """Wait until the queue holds at most its limit (the stream's request reader: one
        task, which does not queue behind watches waiting for the node's budget)."""
        while self.queued > self.limit:
            self._changed.clear()
            await self._changed.wait()

    def release_all(self) -> None:
        self.closed = True
        self.service.node.watches.release(self.budgeted)
        self.out.clear()
        self.queued = self.budgeted = 0

    def header(self, revision: int | None = None) -> rpc_pb2.ResponseHeader:
        return self.service.header.now() if revision is None else self.service.header(revision)

    def refuse(self, reason: str) -> None:
        """etcd's answer to a watch it does not create: id -1, created and canceled at once."""
        self.put(rpc_pb2.WatchResponse(header=self.header(), watch_id=-1, created=True, canceled=True, cancel_reason=reason))

    async def create(self, req: rpc_pb2.WatchCreateRequest) -> None:
        node = self.service.node
        # etcd's watch takes an empty key as "\0", the smallest key (one no one can put here)
        key = req.key or b"\x00"
        if req.range_end and req.range_end != b"\x00" and req.range_end <= key:
            self.refuse(ERR_EMPTY_RANGE)
            return
        if self.live >= MAX_WATCHES_PER_STREAM:
            self.refuse(f"etcdserver: this stream holds {MAX_WATCHES_PER_STREAM} watches, the most one may: watch a range or prefix, or open another stream")
            return
        wid = req.watch_id
        if wid == 0 or wid in self.tasks:
            if wid and wid in self.tasks:  # etcd: a duplicate id is refused, the stream goes on
                self.refuse(ERR_DUPLICATE_ID)
                return
            while self.next_id in self.tasks:
                self.next_id += 1
            wid = self.next_id
            self.next_id += 1
        try:
            start = b"\x00" if key == b"\x00" and not req.range_end else wire.range_start(key, req.range_end)
            # What was committed when the watch was asked for is applied here first: on a
            # follower too, "now" is the cluster's, and history up to it comes in one answer.
            await node.read_barrier("linearizable")
        except KVError as e:
            self.put(rpc_pb2.WatchResponse(header=self.header(), watch_id=wid, created=True, canceled=True, cancel_reason=wire.status_of(e)[1]))
            return
        try:
            if req.start_revision < 0:  # (before any compaction, as etcd takes it)
                raise WatchCompacted("a negative start revision", 0, node.oldest_revision())
            w = node.watch(watch_prefix(start, req.range_end), req.start_revision or None, resume_when_behind=False, rich=True)
        except WatchCompacted as e:  # etcd: created, then canceled with the oldest revision it still has
            self.put(rpc_pb2.WatchResponse(header=self.header(), watch_id=wid, created=True))
            self.put(_compacted(self.header(0), wid, e.oldest_index))
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            self.tasks[wid] = done  # its id stays taken until the client cancels it, as etcd's
            return
        except KVError as e:
            self.put(rpc_pb2.WatchResponse(header=self.header(), watch_id=wid, created=True, canceled=True, cancel_reason=str(e)))
            return
        self.put(rpc_pb2.WatchResponse(header=self.header(), watch_id=wid, created=True))
        no_put = rpc_pb2.WatchCreateRequest.NOPUT in req.filters
        no_delete = rpc_pb2.WatchCreateRequest.NODELETE in req.filters
        task = self.tasks[wid] = asyncio.ensure_future(self._pump(wid, w, start, req.range_end, req.prev_kv, no_put, no_delete, req.progress_notify))
        self.live += 1
        # (not in the pump's `finally`: a task cancelled before its first step never runs it)
        task.add_done_callback(lambda _t: self._ended(w))

    def _ended(self, w) -> None:
        w.close()
        self.live -= 1

    async def _pump(self, wid: int, w, key: bytes, range_end: bytes, prev_kv: bool, no_put: bool, no_delete: bool, progress: bool) -> None:
        try:
            while True:
                await self.room()  # changes wait in the watch's buffer meanwhile
                got = await w.next_batch(timeout=self.service.progress_s if progress else None)
                if got is None:
                    return
                events, through = got
                out = []
                for ev in events:
                    raw = cmds.key_bytes(ev.key)
                    if not cmds.in_range(raw, key, range_end):
                        continue
                    deleted = ev.value is None
                    if (deleted and no_delete) or (not deleted and no_put):
                        continue
                    out.append(_event(ev, raw, prev_kv))
                if out:
                    await self.put_changes(rpc_pb2.WatchResponse(header=self.header(), watch_id=wid, events=out))
                elif not events and progress:
                    self.put(rpc_pb2.WatchResponse(header=self.header(through), watch_id=wid))
        except WatchCompacted as e:
            self.put(_compacted(self.header(0), wid, e.oldest_index))
        except SlowWatcher as e:
            self.put(rpc_pb2.WatchResponse(header=self.header(), watch_id=wid, canceled=True, cancel_reason=f"etcdserver: {e}"))
        except Exception as e:  # a bug: the client hears of it, the log says where
            log.exception("watch %d failed", wid)
            self.put(rpc_pb2.WatchResponse(header=self.header(), watch_id=wid, canceled=True, cancel_reason=f"etcdserver: {type(e).__name__}: {e}"))

    def cancel(self, wid: int) -> None:
        task = self.tasks.pop(wid, None)
        if task is not None:
            task.cancel()
            self.put(rpc_pb2.WatchResponse(header=self.header(), watch_id=wid, canceled=True))

    async def close(self) -> None:
        tasks = list(self.tasks.values())
        self.tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _compacted(header, wid: int, oldest: int) -> rpc_pb2.WatchResponse:
    """The answer to a watch that starts before what this node's history holds (the last
    Compact): etcd's compact_revision, the oldest revision a watch can start from (and,
    as etcd's, a header of revision 0 and no cancel_reason)."""
    return rpc_pb2.WatchResponse(header=header, watch_id=wid, canceled=True, compact_revision=oldest)


def _event(ev, raw: bytes, prev_kv: bool) -> kv_pb2.Event:
    msg = kv_pb2.KeyValue(key=raw, mod_revision=ev.index) if ev.value is None else wire.kv_message(ev.kv)
    prev = ev.prev if prev_kv else None
    return kv_pb2.Event(type=_DELETE if ev.value is None else _PUT, kv=msg, prev_kv=wire.kv_message(prev) if prev is not None else None)


class WatchService(rpc_pb2_grpc.WatchServicer):
    progress_s = 600.0  # etcd's progress notification interval for watches that ask for one

    def __init__(self, node, access: Access) -> None:
        self.node, self.access = node, access
        self.header = wire.Headers(node)

    async def Watch(self, request_iterator, context):
        stream = _Stream(self, context)

        async def read() -> None:
            async for req in request_iterator:
                await stream.below_limit()  # a client that sends and never reads stops being read
                which = req.WhichOneof("request_union")
                if which == "create_request":
                    c = req.create_request
                    try:
                        self.access.check(context, "read", [(c.key, c.range_end)])
                    except KVError as e:
                        _code, message = wire.status_of(e)
                        stream.put(rpc_pb2.WatchResponse(header=stream.header(), created=True, canceled=True, cancel_reason=message))
                        continue
                    await stream.create(c)
                elif which == "cancel_request":
                    stream.cancel(req.cancel_request.watch_id)
                elif which == "progress_request":
                    stream.put(rpc_pb2.WatchResponse(header=stream.header(), watch_id=PROGRESS_WATCH_ID))

        reader = asyncio.ensure_future(read())
        try:
            async with self.access(context, "read", []):
                while True:
                    get = asyncio.ensure_future(stream.get())
                    try:
                        waits = [get] if reader.done() else [get, reader]
                        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        if not get.done():
                            get.cancel()
                    if get not in done:
                        reader.result()  # raises what broke the reader; after a half-close (as etcd) the watches go on
                        continue
                    yield get.result()
        finally:
            reader.cancel()
            try:
                await stream.close()
            finally:
                stream.release_all()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
