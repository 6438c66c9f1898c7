"""Status, health, metrics, snapshots, the committed log, leadership transfer and the
OpenAPI document."""

from __future__ import annotations

import os

import orjson
from aiohttp import web

from kv import BadRequest, Compacted, NotFound, NotLeader
from kv.common import entry_stream
from kv.server.metrics import CONTENT_TYPE

from .answer import Answer
from .context import ctx
from .errors import json_response
from .forward import forward_to_leader
from .keys import key_param
from .params import index_param, json_body, read_timeout, write_timeout

OPENAPI_PATH = os.path.join(os.path.dirname(__file__), "openapi.json")


async def status(request: web.Request) -> Answer:
    """This node's own view; never forwarded."""
    return json_response(ctx(request).node.status())


async def healthz(request: web.Request) -> Answer:
    node = ctx(request).node
    if node.raft is None or node.raft.failure is not None:
        return json_response({"ok": False, "error": str(node.raft.failure) if node.raft else "not started"}, 503)
    return json_response({"ok": True})


async def readyz(request: web.Request) -> Answer:
    """Ready when a leader is known and this node has applied what it knows is committed."""
    node = ctx(request).node
    s = node.status()
    lag = s.get("commit_index", 0) - s.get("applied_index", 0)
    ready = s.get("leader") is not None and lag <= 1000
    body = {"ready": ready, "leader": s.get("leader"), "apply_lag": lag}
    return json_response(body, 200 if ready else 503)


async def metrics(request: web.Request) -> Answer:
    body = ctx(request).node.metrics.render()
    return Answer(body, 200, CONTENT_TYPE, {"X-Content-Type-Options": "nosniff"})


async def take_snapshot(request: web.Request) -> Answer:
    """A snapshot holding every write acknowledged before the request, on any member: the
    node first catches up with the leader's commit index (a follower snapshots only what
    it has applied). `commit_index`: the index the snapshot covers at least."""
    snap, commit = await ctx(request).node.take_snapshot(timeout=read_timeout(request))
    return json_response({"index": snap.index, "term": snap.term, "commit_index": commit})


async def get_snapshot(request: web.Request) -> web.StreamResponse:
    """The newest snapshot, or with `index=N` that one while the node keeps it (so that
    byte ranges read one after another, as Spark's executors read theirs, are of one file)."""
    snaps = ctx(request).node.snapshots
    if "index" in request.query:
        at = index_param(request, "index", 0)
        snap = snaps.file_at(at)
        if snap is None or not os.path.exists(snap.path):
            raise NotFound(f"this node no longer keeps the snapshot at index {at} (newer ones replaced it, --snapshot-keep): take another")
    else:
        snap = snaps.newest_meta()
    if snap is None or not os.path.exists(snap.path):
        raise NotFound("this node has no snapshot yet: POST /v1/snapshot takes one")
    return web.FileResponse(
        snap.path,
        headers={
            "Content-Type": "application/octet-stream",
            "Content-Disposition": f'attachment; filename="{os.path.basename(snap.path)}"',
            "X-Snapshot-Index": str(snap.index),
            "X-Snapshot-Term": str(snap.term),
        },
    )


async def open_export(request: web.Request) -> Answer:
    """A consistent view of every key under ?prefix= as of now, pinned on this node for an
    export (kv.spark's as-of-now export reads it, each executor its key ranges): its name,
    index and term, how many keys it holds (null: not counted), and up to ?parts=N key
    ranges of about equal sizes (hex; an end of null: to the last key). DELETE it when done."""
    try:
        parts = int(request.query.get("parts", "1"))
    except ValueError:
        raise BadRequest(f"parts must be an integer, not {request.query['parts'][:40]!r}") from None
    v = await ctx(request).node.exports.open(key_param(request, "prefix", ""), parts, read_timeout(request))
    ranges = [[lo.hex(), None if hi is None else hi.hex()] for lo, hi in v["ranges"]]
    return json_response({**v, "ranges": ranges})


async def read_export(request: web.Request) -> web.StreamResponse:
    """The keys [?from=, ?to=) (hex) of a pinned view, as blocks in the snapshot file's
    format (snapshot/format.py: length, record count, crc32, payload) and its end block."""
    exports = ctx(request).node.exports
    name = request.match_info["view"]
    lo, hi = _hex_param(request, "from") or b"", _hex_param(request, "to")
    pinned = exports.get(name)  # (404 before any byte)
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream", "X-Kv-Index": str(pinned.index)})
    await resp.prepare(request)
    frames = exports.frames(name, lo, hi)
    try:
        async for frame in frames:
            await resp.write(frame)
    finally:
        await frames.aclose()
    await resp.write_eof()
    return resp


async def close_export(request: web.Request) -> Answer:
    if not ctx(request).node.exports.release(request.match_info["view"]):
        raise NotFound("this node holds no such export view (it ended already, or went unread too long)")
    return json_response({"released": True})


def _hex_param(request: web.Request, name: str) -> bytes | None:
    raw = request.query.get(name)
    if raw is None:
        return None
    try:
        return bytes.fromhex(raw)
    except ValueError:
        raise BadRequest(f"{name} must be a key in hex, not {raw[:40]!r}") from None


async def get_log(request: web.Request) -> web.StreamResponse:
    """Stream the committed entries [from, to] this node holds (kv.common.entry_stream's records)."""
    node = ctx(request).node
    first, last = node.log_range()
    lo = index_param(request, "from", first)
    hi = index_param(request, "to", last)
    if hi < lo and "to" in request.query:
        raise BadRequest(f"to ({hi}) is before from ({lo})")
    if hi > last:
        raise BadRequest(f"index {hi} is not applied on this node yet (its applied index is {last}); ask for an earlier end or wait")
    entries = node.log_entries(lo, hi + 1)  # a compacted start raises here: 410 before any byte
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream", "X-Kv-From": str(lo), "X-Kv-To": str(hi)})
    await resp.prepare(request)
    error = None
    while entries:
        await resp.write(entry_stream.encode_entries(entries))
        lo = entries[-1].index + 1
        if lo > hi:
            break
        try:
            entries = node.log_entries(lo, hi + 1)
        except Compacted as e:
            error = str(e)
            break
        if not entries:  # the log was replaced under us (this node installed a snapshot)
            error = f"index {lo} is no longer in this node's log (it installed a snapshot); run again"
    await resp.write(entry_stream.encode_end(error))
    await resp.write_eof()
    return resp


async def leader_transfer(request: web.Request) -> Answer:
    doc = await json_body(request)
    to = doc.get("to")
    if not isinstance(to, str) or not to:
        raise BadRequest('name the new leader: {"to": "n2"}')
    node = ctx(request).node
    try:
        leader = await node.transfer_leadership(to)
    except NotLeader:
        return await forward_to_leader(request, orjson.dumps(doc))
    return json_response({"leader": leader})


async def compact(request: web.Request) -> Answer:
    """POST /v1/compact {"revision": N}: drop the history below N on every node (through the
    log; a follower forwards it). 410 if N is compacted already, 400 if it is ahead of the log."""
    doc = await json_body(request)
    revision = doc.get("revision")
    if type(revision) is not int or revision < 1:
        raise BadRequest('give the revision to compact at: {"revision": 1234} (a log index; reads below it are refused from then on)')
    node = ctx(request).node
    done = await node.compact(revision, timeout=write_timeout(request))
    return json_response({"compact_revision": done})


async def openapi(request: web.Request) -> Answer:
    with open(OPENAPI_PATH, "rb") as f:
        return Answer(f.read())


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/v1/status", status, name="status")
    r.add_get("/healthz", healthz, name="healthz")
    r.add_get("/readyz", readyz, name="readyz")
    r.add_get("/metrics", metrics, name="metrics")
    r.add_post("/v1/snapshot", take_snapshot, name="snapshot_take")
    r.add_get("/v1/snapshot", get_snapshot, name="snapshot_get")
    r.add_post("/v1/export", open_export, name="export_open")
    r.add_get("/v1/export/{view}", read_export, name="export_read")
    r.add_delete("/v1/export/{view}", close_export, name="export_close")
    r.add_get("/v1/log", get_log, name="log")
    r.add_post("/v1/leader/transfer", leader_transfer, name="leader_transfer")
    r.add_post("/v1/compact", compact, name="compact")
    r.add_get("/v1/openapi.json", openapi, name="openapi")

