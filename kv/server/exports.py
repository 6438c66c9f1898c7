"""Views of the state pinned for an export: a consistent cut that Spark's executors read by
key ranges (`POST /v1/export`, `GET /v1/export/{view}`), without writing a snapshot file:
each range streams as blocks in the snapshot file's format (snapshot/format.py), made
from the view as they are sent.

A view is a LevelDB snapshot: it costs no copy, but holds on to the files LevelDB would
otherwise delete as it compacts, so a node pins a few at most (MAX_VIEWS) and lets each go
when its export says it is done, or VIEW_TTL_S after it was last read (an export whose
driver died)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from ..errors import BadRequest, NotFound, Unavailable
from ..snapshot.format import BLOCK_BYTES, END_BLOCK, framed_block
from ..statemachine.commands import key_bytes, prefix_end

MAX_VIEWS = 4
VIEW_TTL_S = 120.0
MAX_PARTS = 4096  # key ranges a view is cut into at most


@dataclass
class Pinned:
    view: object  # a LevelDBView
    index: int
    term: int
    expires: float
    readers: int = 0  # ranges being read now: a view is not let go under them
    released: bool = False  # its export is done: let go once the reads end
    busy: set = field(default_factory=set)  # its work running in threads (futures): it is closed after them
    dropped: bool = False  # no longer pinned: closed once `busy` is empty
    handle: asyncio.TimerHandle | None = field(default=None, repr=False)


class PinnedViews:
    """The node's pinned views, by name (random: a name is what lets a reader in, besides
    the admin token the routes ask for). Used on the event loop only. `capture`: a view of
    the state machine as applied; `barrier`: the node's read barrier."""

    def __init__(self, capture: Callable[[], object], barrier: Callable[..., Awaitable[int]], clock: Callable[[], float] = time.monotonic) -> None:
        self._views: dict[str, Pinned] = {}
        self._capture, self._barrier, self._clock = capture, barrier, clock

    async def open(self, prefix: str = "", parts: int = 1, timeout: float | None = None) -> dict:
        """Pin every key under `prefix` as of now (after a linearizable read barrier: the
        view holds every write acknowledged before the call): {"view", "index", "term",
        "keys", "ranges"}, the ranges [lo, hi) (raw keys; hi None: to the end) cutting the
        keys into up to `parts` runs of about equal bytes (LevelDBView.user_key_splits;
        "keys" None: not counted)."""
        if not 1 <= parts <= MAX_PARTS:
            raise BadRequest(f"parts must be from 1 to {MAX_PARTS}, not {parts}")
        await self._barrier("linearizable", timeout)
        view = self._capture()
        lo = key_bytes(prefix)
        end = prefix_end(lo)
        hi = None if end == b"\x00" else end  # (b"\x00": no end)
        name = self.pin(view, view.index, view.term)
        p = self._views[name]
        try:
            keys, cuts = await self._in_thread(p, view.user_key_splits, lo, hi, parts)
        except BaseException:
            self.release(name)
            raise
        if p.released:
            raise Unavailable("the export's view was let go as it was being cut (this node is loading a snapshot): run the export again")
        bounds = [lo, *cuts, hi]
        return {"view": name, "index": view.index, "term": view.term, "keys": keys, "ranges": list(zip(bounds, bounds[1:]))}

    async def frames(self, name: str, lo: bytes, hi: bytes | None) -> AsyncIterator[bytes]:
        """The keys [lo, hi) of a view as framed blocks, then the end block; each block is
        cut and encoded in a thread (the loop serves on meanwhile)."""
        with self.reading(name) as p:
            blocks = p.view.blocks(BLOCK_BYTES, lo, hi)
            try:
                while True:
                    if p.released:  # drained: the answer ends without its end block, and the export fails
                        raise Unavailable("the export's view was let go (this node is loading a snapshot): run the export again")
                    frame = await self._in_thread(p, _next_frame, blocks)
                    if not frame:
                        break
                    yield frame
            finally:
                if p.view is not None:  # (not closed yet: its LevelDB iterator first)
                    await self._in_thread(p, blocks.close)
        yield END_BLOCK

    async def drain(self) -> None:
        """Let every view go before the state machine's database is closed (a snapshot is
        loaded, or it is opened again after a full disk): when this returns, every view is
        closed and no thread works on one; reads of them end."""
        views = list(self._views.items())
        busy = [f for _, p in views for f in p.busy]
        for name, p in views:
            p.released = True
            self._drop(name, p)
        if busy:
            await asyncio.wait(busy)
        for _, p in views:  # (their futures' done callbacks may not have run yet)
            p.busy.clear()
            self._close_if_idle(p)

    def _in_thread(self, p: Pinned, fn, *args) -> Awaitable:
        """fn(*args) in a thread, on view p: p is not closed before it returns, even if the
        caller stops waiting for it (a client gone mid-read)."""
        fut = asyncio.get_running_loop().run_in_executor(None, fn, *args)
        p.busy.add(fut)

        def done(f) -> None:
            p.busy.discard(f)
            self._close_if_idle(p)

        fut.add_done_callback(done)
        return asyncio.shield(fut)

    def __len__(self) -> int:
        return len(self._views)

    def pin(self, view, index: int, term: int) -> str:
        if len(self._views) >= MAX_VIEWS:
            view.release()
            raise Unavailable(f"this node has {MAX_VIEWS} exports open already: retry once one is done (each lets go at most {VIEW_TTL_S:.0f} s after its last read)")
        name = os.urandom(12).hex()
        self._views[name] = p = Pinned(view, index, term, self._clock() + VIEW_TTL_S)
        self._arm(name, p)
        return name

    def get(self, name: str) -> Pinned:
        p = self._views.get(name)
        if p is None or p.released:
            raise NotFound(f"this node holds no export view {name[:40]!r} (it ended, or went {VIEW_TTL_S:.0f} s unread, or the node restarted): run the export again")
        p.expires = self._clock() + VIEW_TTL_S
        return p

    @contextlib.contextmanager
    def reading(self, name: str) -> Iterator[Pinned]:
        """The view, pinned while the caller reads it."""
        p = self.get(name)
        p.readers += 1
        try:
            yield p
        finally:
            p.readers -= 1
            p.expires = self._clock() + VIEW_TTL_S
            if p.released and not p.readers and self._views.get(name) is p:
                self._drop(name, p)

    def release(self, name: str) -> bool:
        p = self._views.get(name)
        if p is None or p.released:
            return False
        p.released = True
        if not p.readers:
            self._drop(name, p)
        return True

    def _drop(self, name: str, p: Pinned) -> None:
        del self._views[name]
        if p.handle is not None:
            p.handle.cancel()
        p.dropped = True
        self._close_if_idle(p)

    @staticmethod
    def _close_if_idle(p: Pinned) -> None:
        if p.dropped and not p.busy and p.view is not None:
            p.view.release()
            p.view = None

    def _arm(self, name: str, p: Pinned) -> None:
        p.handle = asyncio.get_running_loop().call_later(max(p.expires - self._clock(), 0.0) + 0.5, self._expire, name)

    def _expire(self, name: str) -> None:
        p = self._views.get(name)
        if p is None:
            return
        if p.readers or p.expires > self._clock():  # read since: wait on
            p.expires = max(p.expires, self._clock() + 1.0)
            self._arm(name, p)
            return
        self._drop(name, p)


def _next_frame(blocks: Iterator) -> bytes:
    b = next(blocks, None)
    return b"" if b is None else framed_block(*b)
