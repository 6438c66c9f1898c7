"""The client side of GET /v1/watch: read the newline-delimited JSON stream, and when it
breaks (the node died, the connection dropped, the node ended it) open it again on another
endpoint from where it stopped — no change missed, none delivered twice.

Where it stopped is precise even inside a transaction: the changes of one index arrive
together and in the same order from every node, so a stream cut after some of them resumes
at that index and skips as many as were already delivered.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import orjson
from yarl import URL

from .. import errors
from ..common.results import Event
from ..common.wire import key_from, value_from
from ..raft.backoff import Backoff
from .endpoints import CLUSTER_HEADER, Rotation, Unreachable, describe, raise_for, unreachable_hint, with_query


class _Position:
    """How far the watcher has got: every change up to `complete` was delivered, and
    `count` changes of index `last` (> complete when that index may be unfinished)."""

    def __init__(self, start_index: int | None) -> None:
        self.complete = start_index - 1 if start_index is not None else None
        self.last, self.count, self.skip = 0, 0, 0

    def resume(self) -> dict:
        if self.complete is None:
            return {}  # nothing seen yet, not even where the stream started: from the next commit
        if self.last > self.complete:
            self.skip = self.count  # already delivered: the node sends them again, first
            return {"from": str(self.last)}
        return {"from": str(self.complete + 1)}

    def accept(self, index: int) -> bool:
        """Whether a change of this index is new (and count it)."""
        if index > self.last:
            if self.last:
                self.complete = max(self.complete or 0, self.last)
            self.last, self.count, self.skip = index, 1, 0
            return True
        if index < self.last:
            return False
        if self.skip:
            self.skip -= 1
            return False
        self.count += 1
        return True

    def progress(self, index: int) -> None:
        self.complete = max(self.complete if self.complete is not None else index, index)


def _event(d: dict) -> Event:
    if d["type"] == "delete":
        return Event(d["index"], key_from(d), None)
    return Event(d["index"], key_from(d), value_from(d))


async def watch(
    rotation: Rotation, session: Callable[[], aiohttp.ClientSession], timeout: float,
    prefix: str, start_index: int | None, idle_timeout: float, end_index: int | None = None, cluster_id: Callable[[], str] = lambda: "",
) -> AsyncIterator[Event]:
    """The changes under prefix from start_index, from whichever of the rotation's endpoints
    serves them; `session()` is the client's HTTP session, `timeout` how long no endpoint
    may serve the watch before it gives up (Unavailable), `cluster_id()` the cluster the
    client reached first, if it knows (a node of another refuses the watch)."""
    pos = _Position(start_index)
    bound = {"to": str(end_index)} if end_index is not None else {}
    eps = rotation.endpoints
    compacted: set[str] = set()
    last_error: Exception | str = ""
    backoff = Backoff(0.05, 1.0)
    failing_since: float | None = None
    unreachable = Unreachable(rotation, timeout)
    stream_timeout = aiohttp.ClientTimeout(total=None, sock_connect=2.0, sock_read=idle_timeout)
    while True:
        ep = rotation.current()
        params = {"prefix": prefix, **pos.resume(), **bound}
        try:
            cluster = cluster_id()
            headers = {CLUSTER_HEADER: cluster} if cluster else None
            async with session().get(URL(with_query(ep + "/v1/watch", params), encoded=True), headers=headers, timeout=stream_timeout) as resp:
                if resp.status == 410:
                    compacted.add(ep)
                    last_error = errors.Compacted(f"{ep}: {(await resp.read())[:500].decode(errors='replace')}")
                elif resp.status not in (200, 503):
                    raise_for(resp.status, await resp.read(), ep)
                elif resp.status == 503:
                    last_error = f"{ep}: 503 {(await resp.read())[:200].decode(errors='replace')}"
                else:
                    failing_since = None
                    backoff.reset()
                    compacted.clear()
                    rest = b""
                    async for chunk in resp.content.iter_any():
                        lines = (rest + chunk).split(b"\n")
                        rest = lines.pop()
                        if not lines:
                            continue
                        for d in orjson.loads(b"[" + b",".join(lines) + b"]"):  # one parse a chunk
                            t = d["type"]
                            if t == "progress":
                                pos.progress(d["index"])
                                if end_index is not None and d["index"] >= end_index:
                                    return  # the bounded range is complete
                            elif t == "error":
                                last_error = f"{ep} ended the stream: {d.get('code')}: {d.get('message')}"
                                if d.get("code") == "COMPACTED":
                                    compacted.add(ep)
                            elif pos.accept(d["index"]):
                                yield _event(d)
                    last_error = last_error or f"{ep} closed the stream"
            unreachable.saw(ep, None, eps)
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
            last_error = f"{ep}: {describe(e)}{unreachable_hint(e, ep)}"
            unreachable.saw(ep, e, eps)
        if len(compacted) >= len(eps):
            raise errors.Compacted(
                f"no endpoint still holds the changes from index {params.get('from')} ({last_error}); read the prefix "
                "(scan_page gives the index it read at) and watch from that index + 1"
            )
        rotation.advance()
        now = time.monotonic()
        failing_since = failing_since or now
        if now - failing_since > timeout:
            raise errors.Unavailable(f"no endpoint served the watch for {timeout:g}s ({', '.join(eps)}): {last_error}")
        if rotation.turn % len(eps) == 0:  # a whole round failed: back off before the next
            await asyncio.sleep(backoff.next())
