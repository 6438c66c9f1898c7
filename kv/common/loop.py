"""A private event loop on a thread, for synchronous facades over async objects
(kv.open's Store and kv.Client)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

from ..errors import Unavailable


T = TypeVar("T")


async def _cancel_all() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class LoopThread:
    def __init__(self, name: str) -> None:
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self.closed = False
        self.closing = False  # set once close() began: no call starts from then on
        # Held across `closing`'s check and the call's scheduling, and across setting it:
        # a call either is on the loop before close() cancels what is there, or is refused
        # (checked, then scheduled after the cancelling, it would wait on a stopped loop).
        self._gate = threading.Lock()

    def call(self, coro: Coroutine) -> Any:
        """Run coro on the loop and wait for its result in the calling thread."""
        self.refuse_own_thread(coro)
        running = threading.Lock()  # held while coro runs (a raw lock: an Event costs 4 µs a call)
        running.acquire()

        async def run():
            try:
                return await coro
            finally:
                running.release()

        with self._gate:
            if self.closing:
                coro.close()
                raise Unavailable("this client (or kv.open store) is closed: make a new one to go on")
            fut = asyncio.run_coroutine_threadsafe(run(), self.loop)
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            if self.closing:  # (not a KVError: `except kv.KVError` let it through)
                raise Unavailable(
                    "the client (or kv.open store) was closed while this call waited for its answer (a write's outcome "
                    "is unknown: read it back, with a new client, before doing it again)"
                ) from None
            raise
        except BaseException:  # KeyboardInterrupt while waiting: stop the coroutine too
            if not fut.done():
                fut.cancel()  # cancels the task on the loop
                # Let it unwind before the caller cleans up after it (closes the client
                # its cleanup talks through: a lock's waiter withdraws from the queue).
                # fut.result() would not wait: a cancelled concurrent future is done at once.
                running.acquire(timeout=5)
            raise

    def refuse_own_thread(self, coro: Coroutine | None = None) -> None:
        """Raise if called on the loop's thread, where a blocking call would wait on itself
        (closing `coro`, which will never run)."""
        if threading.current_thread() is self._thread:
            if coro is not None:
                coro.close()
            raise RuntimeError(
                "a blocking kv call on the client's own event-loop thread would wait on itself for ever; "
                "make it from another thread (set a flag or a threading.Event here)"
            )

    def off_loop(self, callback: Callable[..., None] | None) -> Callable[..., None] | None:
        """`callback` run on a thread of its own, so that it may call the blocking API (an
        on_lost that releases a lock, say); on the loop's thread such a call would wait
        on itself."""
        if callback is None:
            return None

        def start(*args) -> None:
            threading.Thread(target=callback, args=args, name=f"{self._thread.name}-callback", daemon=True).start()

        return start

    def iterate(self, it: AsyncIterator[T], timeout: float | None = None) -> Iterator[T]:
        """A blocking iterator over an async iterator that lives on the loop; it ends when
        no item came for `timeout` seconds (None: waits)."""
        try:
            while True:
                try:
                    yield self.call(asyncio.wait_for(anext(it), timeout))
                except (StopAsyncIteration, asyncio.TimeoutError):
                    return
        finally:
            aclose = getattr(it, "aclose", None)
            if aclose is not None and not self.closing:
                self.call(aclose())

    def close(self, last: Callable[[], Coroutine] | None = None) -> None:
        """Refuse new calls, cancel every task on the loop (a call waiting on one raises
        Unavailable in its thread), run `last()` (closing what those calls used: were it
        closed first, a call starting meanwhile met a closed aiohttp session's RuntimeError),
        then stop the loop."""
        with self._gate:
            if self.closing:
                return
            self.closing = True
        # Background tasks left on the loop (a lease's keepalives, say) end here, instead
        # of being destroyed pending when the loop closes.
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(10)
        if last is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(last(), self.loop).result(10)
        self.closed = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
