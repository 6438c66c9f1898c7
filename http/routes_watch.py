"""GET /v1/watch: every committed change under a prefix, as newline-delimited JSON.

    {"type": "put", "key", "value", "mod_index", "index"}     (value as in a scan)
    {"type": "delete", "key", "mod_index", "index"}
    {"type": "progress", "index": N}      every change up to N has been sent (when idle)
    {"type": "error", "code", "message"}  the last line when the node ends the stream

With `to=N` the stream is bounded: it sends the changes of indexes up to N, then
{"type": "progress", "index": N} and ends (a range of the change feed: kv spark export-log).

A start below the node's ledger is refused (410) before the stream begins; a failure later
(the watcher fell too far behind, the node is stopping) can only travel in-band, as the last
line. Either way the client resumes from the last index it saw + 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import orjson
from aiohttp import web

from kv import BadRequest, KVError, SlowWatcher
from kv.common.wire import key_fields, value_fields

from .context import CONTEXT, ctx
from .keys import key_param
from .params import index_param


# After sending a batch a stream waits this long before taking the next, so that the changes
# of many small applied batches go out in one write (one wake-up and one syscall per stream,
# not per batch); a change after a quiet spell still goes out at once.
LINGER_S = 0.01


# Every stream that sends a change sends the same line: the small ones are encoded once.
# At most LINE_CACHE lines of at most LINE_CACHE_BYTES each (emptied when full).
LINE_CACHE, LINE_CACHE_BYTES = 4096, 4096
_lines: dict[tuple, bytes] = {}


def event_line(ev, force_b64: bool) -> bytes:
    k = (ev, force_b64)  # the whole change: one transaction may write a key twice
    line = _lines.get(k)
    if line is not None:
        return line
    if ev.value is None:
        d = {"type": "delete", **key_fields(ev.key), "mod_index": ev.index, "index": ev.index}
    else:
        d = {"type": "put", **key_fields(ev.key), **value_fields(ev.value, force_b64), "mod_index": ev.index, "index": ev.index}
    line = orjson.dumps(d, option=orjson.OPT_APPEND_NEWLINE)
    if len(line) <= LINE_CACHE_BYTES:
        if len(_lines) >= LINE_CACHE:
            _lines.clear()
        _lines[k] = line
    return line


async def watch(request: web.Request) -> web.StreamResponse:
    c = ctx(request)
    node = c.node
    start = index_param(request, "from", 0) or None
    end = index_param(request, "to", 0) or None
    if end is not None and start is not None and end < start - 1:
        raise BadRequest(f"to ({end}) is before from ({start}): the range is empty")
    force_b64 = request.query.get("encoding") == "base64"
    w = node.watch(key_param(request, "prefix", ""), start_index=start, resume_when_behind=False)  # 410 before any byte
    c.watch_streams.add(w)
    progress_s = node.config.watch_progress_ms / 1000
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-store"})
    _small_send_buffer(request)
    try:
        await resp.prepare(request)
        # Where the stream starts, so that a client that has seen nothing yet can resume.
        await resp.write(orjson.dumps({"type": "progress", "index": w.cursor - 1}, option=orjson.OPT_APPEND_NEWLINE))
        while True:
            try:
                got = await w.next_batch(progress_s)
            except KVError as e:  # fell behind, or the history it needed is gone
                await resp.write(_error_line(e))
                break
            if got is None:
                message = f"the node is stopping; resume from index {w.cursor} on another node"
                await resp.write(orjson.dumps({"type": "error", "code": "UNAVAILABLE", "message": message}, option=orjson.OPT_APPEND_NEWLINE))
                break
            events, seen = got
            done = end is not None and (seen >= end or (events and events[-1].index > end))
            if done:
                events = [ev for ev in events if ev.index <= end]
            if events:
                data = b"".join([event_line(ev, force_b64) for ev in events])
                first = events[0].index
                events = got = None  # what the stream holds now is `data`, counted against the node's budget
                if not node.watches.reserve(len(data)):
                    await resp.write(_error_line(SlowWatcher(
                        f"the node's watches hold {node.watches.buffered} bytes of changes their readers have not taken, its "
                        f"limit (--watch-budget-bytes); this stream was stopped: resume from index {first}", first,
                    )))
                    break
                try:
                    await resp.write(data)  # returns once the socket has taken most of it
                finally:
                    node.watches.release(len(data))
                if not done:
                    await asyncio.sleep(LINGER_S)
            elif not done:
                await resp.write(orjson.dumps({"type": "progress", "index": seen}, option=orjson.OPT_APPEND_NEWLINE))
            if done:
                await resp.write(orjson.dumps({"type": "progress", "index": end}, option=orjson.OPT_APPEND_NEWLINE))
                break
        await resp.write_eof()
    except ConnectionError as e:  # the client went away
        # aiohttp keeps this exception (the transport's), and its traceback holds this
        # frame, which holds the watch: let go of the frame, or the cycle keeps the watch
        # and its buffers until a full collection (rare in kv serve).
        e.__traceback__ = None
    finally:
        w.close()
        c.watch_streams.discard(w)
    return resp


# The kernel's send buffer of a watch stream's socket. Left to the kernel it grows to
# megabytes (loopback autotuning): a reader that does not read would have the node encode
# and queue that much history for it before its writes wait.
STREAM_SNDBUF = 64 << 10


def _small_send_buffer(request: web.Request) -> None:
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SNDBUF)


def _error_line(e: KVError) -> bytes:
    return orjson.dumps({"type": "error", "code": e.code, "message": str(e), **e.details()}, option=orjson.OPT_APPEND_NEWLINE)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/watch", watch, name="watch")

    async def end_streams(app: web.Application) -> None:
        # A stream would hold a graceful shutdown up for its whole timeout: end them first,
        # each with its last line saying where to resume.
        for w in list(app[CONTEXT].watch_streams):
            w.close()

    app.on_shutdown.append(end_streams)
