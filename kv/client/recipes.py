"""Coordination on top of the store: self-renewing leases (and, built on them, locks and
elections). Written once against the store API that kv.Node, kv.AsyncClient and (through
their loop threads) kv.open and kv.Client share: lease_grant, lease_keepalives,
lease_revoke, put, scan, delete, watch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable

from ..common.loop import LoopThread
from ..errors import BadRequest, Compacted, KVError, LeaseNotFound, Timeout

log = logging.getLogger("kv.coordination")

KEEPALIVE_BATCH_S = 0.05  # how long a lease's keepalive may wait for others to share its request
MAX_BATCH = 10_000  # leases one lease_keepalives call renews (the server's limit)


class KeepAlives:
    """The keepalives of one store's self-renewing leases, coalesced: those due within
    KEEPALIVE_BATCH_S of each other go in one lease_keepalives call — one request and one
    read barrier on the leader instead of one each (etcd's client does the same over its
    keepalive stream). A lease is no less safe for the wait: AsyncLease counts its ttl from
    before the wait."""

    def __init__(self, store) -> None:
        self._store = store
        self._waiting: dict[int, list[asyncio.Future]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task] = set()

    async def renew(self, lease: int, within: float) -> None:
        """Renew `lease`, sent at most `within` seconds from now; LeaseNotFound if it is gone."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiting.setdefault(lease, []).append(fut)
        at = loop.time() + within
        if self._timer is None or at < self._timer.when():
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(at, self._flush)
        await fut

    def _flush(self) -> None:
        waiting, self._waiting, self._timer = self._waiting, {}, None
        ids = list(waiting)
        for i in range(0, len(ids), MAX_BATCH):
            task = asyncio.get_running_loop().create_task(self._send(ids[i : i + MAX_BATCH], waiting))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, ids: list[int], waiting: dict[int, list[asyncio.Future]]) -> None:
        try:
            renewed = await self._store.lease_keepalives(ids)
        except Exception as e:  # no leader, no quorum, the network: each lease retries
            for lease in ids:
                for f in waiting[lease]:
                    if not f.done():
                        f.set_exception(e)
            return
        for lease, status in zip(ids, renewed):
            for f in waiting[lease]:
                if f.done():
                    pass  # its lease stopped waiting (timed out, revoked)
                elif status is None:
                    f.set_exception(LeaseNotFound(lease))
                else:
                    f.set_result(None)


_keepalives: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def keepalives(store) -> KeepAlives:
    """The store's KeepAlives (one per store, on the store's loop)."""
    k = _keepalives.get(store)
    if k is None:
        k = _keepalives[store] = KeepAlives(store)
    return k


class AsyncLease:
    """A lease that keeps itself alive — a keepalive every ttl/3 — until it is revoked or
    its owner's context ends. Loss is reported, never hidden: `alive` turns False and
    `lost` holds the reason (the lease expired or was revoked elsewhere, or no keepalive
    got through for a whole ttl), and `on_lost` is called once.

        async with node.lease(10) as lease:      # or: lease = await client.lease(10)
            await node.put("services/api", b"10.0.0.1:8080", lease=lease)
    """

    def __init__(self, store, ttl: float, *, on_lost: Callable[[KVError], None] | None = None) -> None:
        self._store, self.ttl, self._on_lost = store, ttl, on_lost
        self.id: int | None = None
        self.lost: KVError | None = None
        self._task: asyncio.Task | None = None
        self._good_until = 0.0  # monotonic: the lease lives at least until then

    @property
    def alive(self) -> bool:
        """False once the lease is lost — or may be: past the deadline its last answered
        keepalive gave, even before the keepalive loop (paused, say) has noticed."""
        return self.id is not None and self.lost is None and time.monotonic() < self._good_until

    async def grant(self) -> AsyncLease:
        if self.id is None:
            sent = time.monotonic()
            status = await self._store.lease_grant(self.ttl)
            self.id, self._good_until = status.id, sent + self.ttl
            self._task = asyncio.get_running_loop().create_task(self._keep_alive(), name=f"lease-{self.id}")
        return self

    def __await__(self):
        return self.grant().__await__()

    async def __aenter__(self) -> AsyncLease:
        return await self.grant()

    async def __aexit__(self, *exc) -> None:
        await self.revoke()

    async def _keep_alive(self) -> None:
        # _good_until: the send time of the last keepalive that got an answer, plus ttl. The
        # leader renewed it on receipt, later, so the lease lives at least that long; past
        # it, the lease may be gone and the holder must hear so at once, not a retry later.
        every = self.ttl / 3
        while True:
            await asyncio.sleep(max(0.0, min(every, self._good_until - time.monotonic())))
            sent = time.monotonic()
            if sent >= self._good_until:
                return self._lose(KVError(f"lease {self.id}: no keepalive got through for its whole ttl ({self.ttl:g}s)"))
            try:
                # Not wait_for: on 3.11 it swallows a cancel that comes as the renewal ends,
                # and revoke() then waited for ever on a keepalive loop that went on.
                async with asyncio.timeout(self._good_until - sent):
                    await keepalives(self._store).renew(self.id, min(KEEPALIVE_BATCH_S, self.ttl / 30))
                self._good_until, every = sent + self.ttl, self.ttl / 3
            except LeaseNotFound as e:
                return self._lose(e)
            except (KVError, asyncio.TimeoutError) as e:
                every = min(self.ttl / 10, 1.0)  # try again sooner while time is left
                log.info("lease %d: keepalive failed (%s); retrying", self.id, e or "no answer in time")

    def _lose(self, e: KVError) -> None:
        if self.lost is not None:
            return  # told once (a lock's key watch may have told already)
        self.lost = e
        # A caller with an on_lost hears of it there; without one, this is all it hears.
        log.log(logging.INFO if self._on_lost else logging.WARNING, "lease %d is lost: %s", self.id, e)
        if self._on_lost is not None:
            try:
                self._on_lost(e)
            except Exception:  # the caller's bug: it must not stop the keepalive's or a release's clean-up
                log.exception("lease %d: on_lost raised", self.id)

    async def revoke(self) -> None:
        """Revoke the lease now (its keys go with it); a lease already gone is fine."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.id is not None and self.lost is None:
            with contextlib.suppress(LeaseNotFound):
                await self._store.lease_revoke(self.id)
            self.lost = LeaseNotFound(self.id, f"lease {self.id} was revoked")


class Lease:
    """The blocking face of AsyncLease (kv.Client, kv.open): the keepalives run on the
    client's or store's loop thread.

        with client.lease(10) as lease:
            client.put("services/api", b"10.0.0.1:8080", lease=lease)
    """

    def __init__(self, lease: AsyncLease, lt: LoopThread) -> None:
        self._lease, self._lt = lease, lt

    def __repr__(self) -> str:
        return f"Lease(id={self.id}, ttl={self._lease.ttl:g}, alive={self._lease.alive})"

    @property
    def id(self) -> int:
        return self._lease.id

    @property
    def ttl(self) -> float:
        return self._lease.ttl

    @property
    def alive(self) -> bool:
        return self._lease.alive

    @property
    def lost(self) -> KVError | None:
        return self._lease.lost

    def revoke(self) -> None:
        if not self._lt.closing:
            self._lt.call(self._lease.revoke())

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.revoke()


# -- locks and elections ---------------------------------------------------------------------
#
# Both are queues of keys under a prefix, one per contender, each attached to that
# contender's lease, in the order they were created (their mod_index): the first key holds
# the lock or leads. A waiter watches only the key just ahead of it (no thundering herd).
# Its deletion — released, resigned, or its lease expired — has an index above the read that
# saw it, and that read came after the waiter's own key was written: so watching from the
# index the waiter last knew about, never from "now", misses nothing.


async def _wait_until_first(store, prefix: str, my_key: str, since: int) -> None:
    """Return once `my_key` is the oldest key under prefix. `since`: an index at or
    before which my_key was written (every deletion that matters comes after it)."""
    while True:
        items = await store.scan(prefix)
        mine = next((it for it in items if it.key == my_key), None)
        if mine is None:
            raise LeaseNotFound(0, f"{my_key} is gone (its lease expired or was revoked) while waiting")
        ahead = [it for it in items if it.mod_index < mine.mod_index]
        if not ahead:
            return
        pred = max(ahead, key=lambda it: it.mod_index)
        since = max(since, pred.mod_index + 1)
        try:
            watch = store.watch(pred.key, start_index=since)
            try:
                async for ev in watch:
                    since = max(since, ev.index + 1)
                    if ev.key == pred.key and ev.type == "delete":
                        break
            finally:
                await _close_watch(watch)
        except Compacted:  # waited so long that the history is gone: look again from now
            since = await _applied_index(store)


async def _applied_index(store) -> int:
    """An index taken before a read that follows: changes after that read come after it."""
    barrier = getattr(store, "read_barrier", None)  # kv.Node
    if barrier is not None:
        return await barrier("stale") + 1
    return (await store.status())["applied_index"] + 1  # kv.AsyncClient


async def _close_watch(watch) -> None:
    close = getattr(watch, "aclose", None) or getattr(watch, "close", None)
    if close is not None:
        r = close()
        if asyncio.iscoroutine(r):
            await r


class AsyncLock:
    """Mutual exclusion across processes, fair in arrival order (etcd's concurrency.Mutex):

        async with client.lock("jobs/nightly", ttl=10):
            ...   # no other holder of "jobs/nightly" anywhere until this block ends

    A holder that dies frees the lock once its lease expires (ttl, plus at most the
    election timeout and a second). `timeout` bounds the wait (kv.Timeout)."""

    def __init__(
        self, store, name: str, *, ttl: float = 10, timeout: float | None = None,
        on_lost: Callable[[KVError], None] | None = None, value: bytes = b"",
    ) -> None:
        if not name or not isinstance(name, str):
            raise BadRequest("a lock needs a name, e.g. 'jobs/nightly'")
        self._store, self.name, self.ttl, self.timeout, self._on_lost = store, name, ttl, timeout, on_lost
        self.value = value  # the key's value (an election's candidate says who it is)
        self.lease: AsyncLease | None = None
        self.key: str | None = None
        # The fencing token: the log index that wrote this holder's key. Every later holder's
        # is higher, so a resource that remembers the highest token it has seen refuses a
        # holder that lost the lock without noticing yet (a paused process).
        self.revision: int | None = None
        self._guard: asyncio.Task | None = None  # set while held
        self._lost_waiting: asyncio.Future | None = None  # set while waiting

    async def acquire(self) -> AsyncLock:
        self.lease = await AsyncLease(self._store, self.ttl, on_lost=self._lease_lost).grant()
        try:
            self.key = f"{self.name}/{self.lease.id:016x}"
            w = await self._store.put(self.key, self.value, if_absent=True, lease=self.lease.id)
            self.revision = w.index
            await self._wait_for_turn(w.index)
        except BaseException:
            await self.release()
            raise
        self._guard = asyncio.get_running_loop().create_task(self._watch_own_key(w.index + 1), name=f"lock-{self.key}")
        return self

    async def _wait_for_turn(self, since: int) -> None:
        """Until the lock's key is the oldest; a lease lost meanwhile ends the wait at once
        (its key is gone from the queue) with the lease's error, and the timeout with Timeout."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_task(_wait_until_first(self._store, self.name + "/", self.key, since))
        lost = self._lost_waiting = loop.create_future()
        try:
            await asyncio.wait((waiter, lost), timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._lost_waiting = None
            if not waiter.done():
                waiter.cancel()
                await asyncio.wait((waiter,))
        if lost.done():
            raise lost.result()
        if not waiter.cancelled():
            return waiter.result()  # raises if the key was gone when looked at
        raise Timeout(f"lock {self.name!r} not acquired within {self.timeout:g}s")

    def _lease_lost(self, e: KVError) -> None:
        if self._guard is not None:  # held: the holder is told
            if self._on_lost is not None:
                self._on_lost(e)
        elif self._lost_waiting is not None and not self._lost_waiting.done():
            self._lost_waiting.set_result(e)  # never held: acquire raises it

    async def _watch_own_key(self, since: int) -> None:
        """Lose the lease the moment the lock's key is deleted (the lease revoked from
        elsewhere, or expired): the next waiter holds the lock from then on. Its keepalive
        would notice only at its next renewal, up to a third of the ttl later, and the
        holder (kv lock's command) would run on beside the next one meanwhile."""
        lease = self.lease
        try:
            watch = self._store.watch(self.key, start_index=since)
            try:
                async for ev in watch:
                    if ev.key == self.key and ev.type == "delete":
                        lease._lose(LeaseNotFound(lease.id, f"its key {self.key} was deleted: its lease {lease.id} was revoked or expired"))
                        return
            finally:
                await _close_watch(watch)
        except KVError as e:  # the keepalive still notices a loss, later
            log.info("lock %s: cannot watch its key (%s); a lost lease is noticed at its next keepalive", self.name, e)

    @property
    def held(self) -> bool:
        """True from acquire until release, while the lock's lease lives (False once lost)."""
        lease = self.lease  # once: release() on the loop may clear it while another thread reads
        return self._guard is not None and lease is not None and lease.alive

    async def release(self) -> None:
        if self._guard is not None:
            self._guard.cancel()  # before the revoke, whose delete is no loss
            with contextlib.suppress(asyncio.CancelledError):
                await self._guard
            self._guard = None
        if self.lease is not None:
            await self.lease.revoke()  # deletes the key with it
            self.lease = None

    async def __aenter__(self) -> AsyncLock:
        return await self.acquire()

    async def __aexit__(self, *exc) -> None:
        await self.release()


class AsyncElection:
    """Leader election among processes (etcd's concurrency.Election): the oldest live
    candidate leads; its value says who it is.

        e = client.election("scheduler")
        await e.campaign(b"host-a:9000")     # returns once elected
        ...
        await e.resign()
    """

    def __init__(self, store, name: str, *, ttl: float = 10, on_lost: Callable[[KVError], None] | None = None) -> None:
        if not name or not isinstance(name, str):
            raise BadRequest("an election needs a name, e.g. 'scheduler'")
        self._store, self.name, self.ttl, self._on_lost = store, name, ttl, on_lost
        self._lock: AsyncLock | None = None

    @property
    def lease(self) -> AsyncLease | None:
        return self._lock.lease if self._lock is not None else None

    @property
    def key(self) -> str | None:
        """The key this candidate leads with (None before campaign)."""
        return self._lock.key if self._lock is not None else None

    @property
    def revision(self) -> int | None:
        """The fencing token of this leadership: the index that wrote its key, higher for
        every later leader. Pass it with each action on what the leader guards, and have that
        refuse tokens lower than the highest it has seen (a leader paused past its lease's
        ttl wakes up still believing it leads)."""
        return self._lock.revision if self._lock is not None else None

    @property
    def is_leader(self) -> bool:
        """True from campaign's return until resign or the leadership is lost (its lease
        revoked or expired, or no keepalive got through for a whole ttl)."""
        return self._lock is not None and self._lock.held

    async def campaign(self, value: bytes, *, timeout: float | None = None) -> None:
        """Return once elected. Leading is holding the election's lock with `value` as the
        key's value; `on_lost` is called if the leadership is lost (its lease revoked or
        expired, or no keepalive got through)."""
        lock = AsyncLock(self._store, self.name, ttl=self.ttl, timeout=timeout, on_lost=self._on_lost, value=bytes(value))
        try:
            await lock.acquire()
        except Timeout:
            raise Timeout(f"not elected in {self.name!r} within {timeout:g}s") from None
        self._lock = lock

    async def leader(self) -> bytes | None:
        """The current leader's value, or None when nobody leads."""
        items = await self._store.scan(self.name + "/")
        return min(items, key=lambda it: it.mod_index).value if items else None

    async def observe(self) -> AsyncIterator[bytes | None]:
        """The leader's value now, then each time it changes."""
        since = await _applied_index(self._store)
        items = await self._store.scan(self.name + "/")
        last = object()
        while True:
            now = min(items, key=lambda it: it.mod_index).value if items else None
            if now != last:
                yield now
                last = now
            try:
                watch = self._store.watch(self.name + "/", start_index=since)
                try:
                    async for ev in watch:
                        since = ev.index + 1
                        break
                finally:
                    await _close_watch(watch)
            except Compacted:
                since = await _applied_index(self._store)
            items = await self._store.scan(self.name + "/")

    async def resign(self) -> None:
        if self._lock is not None:
            await self._lock.release()
            self._lock = None


class Lock:
    """The blocking face of AsyncLock (kv.Client, kv.open): `with client.lock("jobs"):`."""

    def __init__(self, lock: AsyncLock, lt: LoopThread) -> None:
        self._lock, self._lt = lock, lt

    @property
    def key(self) -> str | None:
        return self._lock.key

    @property
    def revision(self) -> int | None:
        """The fencing token: the index that wrote this holder's key (AsyncLock.revision)."""
        return self._lock.revision

    @property
    def held(self) -> bool:
        """True from acquire until release, while the lock's lease lives (False once lost)."""
        return self._lock.held

    def acquire(self) -> Lock:
        self._lt.call(self._lock.acquire())
        return self

    def release(self) -> None:
        if not self._lt.closing:
            self._lt.call(self._lock.release())

    def __enter__(self) -> Lock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class Election:
    """The blocking face of AsyncElection (kv.Client, kv.open)."""

    def __init__(self, election: AsyncElection, lt: LoopThread) -> None:
        self._e, self._lt = election, lt

    @property
    def name(self) -> str:
        return self._e.name

    @property
    def key(self) -> str | None:
        return self._e.key

    @property
    def revision(self) -> int | None:
        """The fencing token of this leadership (AsyncElection.revision)."""
        return self._e.revision

    @property
    def is_leader(self) -> bool:
        return self._e.is_leader

    def campaign(self, value: bytes, *, timeout: float | None = None) -> None:
        """Block until elected (kv.Timeout after `timeout` seconds)."""
        self._lt.call(self._e.campaign(value, timeout=timeout))

    def leader(self) -> bytes | None:
        return self._lt.call(self._e.leader())

    def observe(self):
        """The leader's value now, then each time it changes (blocking iterator)."""
        return self._lt.iterate(self._e.observe())

    def resign(self) -> None:
        if not self._lt.closing:
            self._lt.call(self._e.resign())


class AsyncRecipes:
    """The coordination recipes of an async face of the store API (kv.AsyncClient and
    kv.Node inherit them): each works through the face's own lease_* and store methods."""

    def lease(self, ttl: float, *, on_lost=None) -> AsyncLease:
        """A lease that keeps itself alive until revoked: `async with s.lease(10) as l`, or
        `l = await s.lease(10)`; see AsyncLease."""
        return AsyncLease(self, ttl, on_lost=on_lost)

    def lock(self, name: str, *, ttl: float = 10, timeout: float | None = None, on_lost=None) -> AsyncLock:
        """Mutual exclusion across processes, FIFO: `async with s.lock("jobs"):`;
        on_lost(error) is called if the lock is lost while held."""
        return AsyncLock(self, name, ttl=ttl, timeout=timeout, on_lost=on_lost)

    def election(self, name: str, *, ttl: float = 10, on_lost=None) -> AsyncElection:
        """Leader election: campaign(value), leader(), observe(), resign(); on_lost(error)
        is called if a leadership won is lost."""
        return AsyncElection(self, name, ttl=ttl, on_lost=on_lost)
