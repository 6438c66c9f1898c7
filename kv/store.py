"""kv.open(): a durable single-node store in-process — synchronous, no server, no ports.

It is a one-member kv.Node (the same ledger, state machine and snapshots as a cluster
node) run on a private event-loop thread. Writes go through the log: fsynced before they
return, and many threads writing at once share fsyncs (group commit). Reads go straight to
LevelDB from the calling thread: with one member, every acknowledged write is applied
before its call returns, so such a read is linearizable without a round trip.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import weakref
from collections.abc import Iterator, Sequence

from .client.recipes import AsyncElection, AsyncLease, AsyncLock, Election, Lease, Lock
from .common.loop import LoopThread
from .common.results import BulkResult, DeleteResult, Event, Item, LeaseStatus, Page, PrefixDeleteResult, RevokeResult, TxnResult, WriteResult
from .errors import BadRequest, Unavailable
from .node import Node
from .common.sessions import Slot
from .server.answers import bulk_result, delete_result, prefix_delete_result, public_error, txn_result, validate_key, write_result
from .server.config import NodeConfig
from .server.reads import CONSISTENCY
from .statemachine import commands as cmds
from .statemachine.leveldb import StateUnreadable

LOCAL_ID = "local"
EMBEDDED_MAX_REQUEST_BYTES = 256 << 20


class _Slot(Slot):
    """One caller's write, waiting on a plain lock until the event loop resolves it."""

    __slots__ = ("lock",)

    def __init__(self, cmd, payload: bytes) -> None:
        super().__init__(cmd, payload)
        self.lock = threading.Lock()
        self.lock.acquire()

    def resolved(self) -> None:
        self.lock.release()


class Store:
    """Use kv.open(path) to get one.

        with kv.open("/var/lib/myapp/meta") as db:
            db.put("users/42", b'{"name": "Ada"}')
            db.get("users/42").value
            for item in db.scan("users/"):
                ...
    """

    def __init__(self, path: str, **options) -> None:
        options.setdefault("id", LOCAL_ID)
        # The embedded store's only client is its own process: large batches (put_many) are
        # fine, so the request limits of a server default to what the formats allow.
        options.setdefault("max_txn_ops", cmds.MAX_CONDS)
        options.setdefault("max_request_bytes", EMBEDDED_MAX_REQUEST_BYTES)
        self.config = NodeConfig(data_dir=path, **options)
        if self.config.peers:
            raise BadRequest("kv.open() is a single-node store; use kv.Node for a cluster member")
        self._pid = os.getpid()
        self._lt = LoopThread(f"kv-store-{path}")
        self._loop = self._lt.loop
        self._node = Node(self.config)
        # A store a script never closes is closed when it is collected, or at interpreter
        # exit while the loop thread and the executors still run: threading's exit hooks
        # run (latest first) before concurrent.futures refuses new work and before plain
        # atexit hooks; a __del__ at finalization would wait on a frozen thread forever.
        self._closer = weakref.finalize(self, _close_store, self._lt, self._node)
        self._closer.atexit = False
        threading._register_atexit(self._closer)
        self._queue: collections.deque[_Slot] = collections.deque()
        self._drain_scheduled = False
        try:
            self._call(self._node.start())
            voters = self._node.raft.membership.voters
            if voters != {self.config.id}:  # it could never elect a leader alone
                raise BadRequest(
                    f"{path} holds member {self.config.id!r} of a cluster of {len(voters)} ({', '.join(sorted(voters))}): "
                    "kv.open() opens single-node stores only; run it with kv serve (or kv.Node in-process) beside the others"
                )
            self._call(self._caught_up())
        except BaseException:
            self.close()
            raise

    async def _caught_up(self) -> None:
        """Reads below skip the event loop, which is right only once everything committed
        before this start (a replay of the ledger, say) is applied: wait for that."""
        while self._node.raft.leader_id is None:
            await self._node.raft.leader_changed.wait()
        await self._node.read_barrier("linearizable", timeout=max(60.0, self.config.write_timeout_s))

    @property
    def _closed(self) -> bool:
        if os.getpid() != self._pid:  # a child of fork(): the loop thread and the data dir are the parent's
            raise Unavailable(
                f"this store was opened in process {self._pid}; a child of fork() cannot use it: open the data dir in one "
                "process at a time (the parent closes it first), or use kv.Client with a kv serve"
            )
        return self._lt.closed

    def _call(self, coro):
        if self._closed:
            coro.close()
            raise Unavailable("the store is closed")
        return self._lt.call(coro)

    # -- writes ----------------------------------------------------------------------------
    #
    # A write does not go through run_coroutine_threadsafe: the calling thread encodes its
    # command (kv.Node.encode_request: the same checks as every write) and queues it, and
    # blocks on a lock; the loop hands everything queued to kv.Node.propose_now (one
    # Ready, one fsync), which releases each lock when that command is applied. Anything
    # out of the ordinary (no leader yet, no free session, a leader change) goes the
    # general way, kv.Node.submit, with its retries: as the same session request.

    def put(self, key: str, value: bytes, *, if_mod_index: int | None = None, if_absent: bool = False, lease: int | None = None) -> WriteResult:
        """Write durably. With if_mod_index / if_absent it is conditional (PreconditionFailed);
        with lease=ID the key goes when the lease does (LeaseNotFound if there is none)."""
        return write_result(self._submit(self._node.put_command(key, value, if_mod_index, if_absent, lease)))

    def cas(self, key: str, expected_mod_index: int, value: bytes) -> WriteResult:
        return self.put(key, value, if_mod_index=expected_mod_index)

    def delete(self, key: str, *, if_mod_index: int | None = None) -> DeleteResult:
        cond = cmds.Cond(key, "mod", if_mod_index) if if_mod_index is not None else None
        return delete_result(self._submit(cmds.Delete(key, cond)))

    def delete_prefix(self, prefix: str) -> PrefixDeleteResult:
        """Delete every key under `prefix` ("": every key) at once; `deleted`: how many."""
        if not isinstance(prefix, str):
            raise BadRequest(f"a prefix is a string, not {type(prefix).__name__}")
        return prefix_delete_result(self._submit(cmds.DeletePrefix(prefix)))

    def txn(self, conds: Sequence[cmds.Cond] = (), ops: Sequence = (), else_ops: Sequence = ()) -> TxnResult:
        """Atomic multi-op: kv.Cond conditions; kv.Put / kv.Delete / kv.Get operations."""
        return txn_result(self._submit(self._node.txn_command(conds, ops, else_ops)))

    def _submit(self, cmd):
        if self._closed:
            raise Unavailable("the store is closed")
        self._lt.refuse_own_thread()
        slot = _Slot(cmd, self._node.encode_request(cmd))
        self._queue.append(slot)
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self._loop.call_soon_threadsafe(self._drain)
        slot.lock.acquire()
        applied = self._node.settle(slot)
        if applied is not None:
            return applied
        return self._call(self._node.resubmit(slot))

    def _drain(self) -> None:
        self._drain_scheduled = False  # first: a write queued from now on schedules again
        slots = []
        while self._queue:
            slots.append(self._queue.popleft())
        if slots:
            self._node.propose_now(slots)

    def put_many(self, items: dict[str, bytes] | Sequence[tuple[str, bytes]]) -> TxnResult:
        """Write many keys in one atomic, fsynced transaction."""
        pairs = items.items() if isinstance(items, dict) else items
        return self.txn(ops=[cmds.Put(k, v) for k, v in pairs])

    def bulk_put(self, rows) -> BulkResult:
        """Many keys in one fsynced entry, each row (key, value) or (key, value,
        if_mod_index) with its own condition: see kv.Node.bulk_put."""
        body, cmd = self._node.bulk_command(rows)
        return body.result(bulk_result(self._submit(cmd), cmd))

    # -- leases (kv.Node's, blocking) --------------------------------------------------------

    def lease(self, ttl: float, *, on_lost=None) -> Lease:
        """A lease that keeps itself alive until revoked (a context manager)."""
        return Lease(self._call(AsyncLease(self._node, ttl, on_lost=self._lt.off_loop(on_lost)).grant()), self._lt)

    def lock(self, name: str, *, ttl: float = 10, timeout: float | None = None, on_lost=None) -> Lock:
        """Mutual exclusion between threads of this process: `with db.lock("jobs"):`;
        on_lost(error) is called, on a thread of its own, if the lock is lost while held."""
        return Lock(AsyncLock(self._node, name, ttl=ttl, timeout=timeout, on_lost=self._lt.off_loop(on_lost)), self._lt)

    def election(self, name: str, *, ttl: float = 10, on_lost=None) -> Election:
        return Election(AsyncElection(self._node, name, ttl=ttl, on_lost=self._lt.off_loop(on_lost)), self._lt)

    def lease_grant(self, ttl: float) -> LeaseStatus:
        return self._call(self._node.lease_grant(ttl))

    def lease_keepalive(self, lease: int) -> LeaseStatus:
        return self._call(self._node.lease_keepalive(lease))

    def lease_keepalives(self, leases: Sequence[int]) -> list[LeaseStatus | None]:
        return self._call(self._node.lease_keepalives(leases))

    def lease_revoke(self, lease: int) -> RevokeResult:
        return self._call(self._node.lease_revoke(lease))

    def lease_info(self, lease: int) -> LeaseStatus:
        return self._call(self._node.lease_info(lease))

    def lease_list(self) -> list[LeaseStatus]:
        return self._call(self._node.lease_list())

    # -- reads -----------------------------------------------------------------------------

    def _sm(self):
        if self._closed:
            raise Unavailable("the store is closed")
        return self._node.sm

    def get(self, key: str, *, consistency: str = "linearizable", revision: int | None = None) -> Item | None:
        """The key's Item, or None. (Every consistency is linearizable in a one-member
        store: each write is applied before its call returns.) revision: as it was then."""
        if revision is not None:
            return self._call(self._node.get(key, consistency="stale", revision=revision))
        validate_key(key)
        _check_consistency(consistency)
        try:
            got = self._sm().get(key)
        except StateUnreadable as e:
            raise public_error(e, fix="close and reopen the store to rebuild it") from e
        return Item(key, got[1], got[0]) if got else None

    def scan(
        self, prefix: str = "", *, after: str | None = None, limit: int | None = None, consistency: str = "linearizable", page: int = 1000,
        revision: int | None = None,
    ) -> Iterator[Item]:
        """Keys under prefix in key order, read `page` keys at a time (`limit` caps the
        total); `revision`: every page as the keys were then (one consistent cut)."""
        _check_consistency(consistency)
        if revision is not None:
            yield from self._scan_at(prefix, after, limit, page, revision)
            return
        sm = self._sm()
        left = limit if limit is not None else float("inf")
        while left > 0:
            try:
                rows = sm.scan(prefix, after, int(min(left, page)))
            except StateUnreadable as e:
                raise public_error(e, fix="close and reopen the store to rebuild it") from e
            if not rows:
                return
            for k, v, m in rows:
                yield Item(k, v, m)
            left -= len(rows)
            after = rows[-1][0]

    def _scan_at(self, prefix: str, after: str | None, limit: int | None, page: int, revision: int) -> Iterator[Item]:
        left = limit if limit is not None else float("inf")
        while left > 0:
            items = self.scan_page(prefix, after=after, limit=int(min(left, page)), revision=revision).items
            if not items:
                return
            yield from items
            left -= len(items)
            after = items[-1].key

    def scan_page(
        self, prefix: str = "", *, after: str | None = None, limit: int = 1000, consistency: str = "linearizable", revision: int | None = None
    ) -> Page:
        """One page of keys under prefix and the applied index it was read at (one
        consistent cut): watch from index + 1 to see every later change, none twice.
        revision: the keys as they were then (the first page's index: every page at one cut)."""
        _check_consistency(consistency)
        return self._call(self._node.scan_page(prefix, after=after, limit=limit, consistency="stale", revision=revision))

    def compact(self, revision: int) -> int:
        """Drop the history below `revision` (reads below it are refused from then on);
        returns the compact revision."""
        return self._call(self._node.compact(revision))

    def watch(self, prefix: str = "", start_index: int | None = None, *, timeout: float | None = None) -> Iterator[Event]:
        """Yield changes under prefix as they commit (blocks; `timeout` ends a quiet wait)."""
        events: queue.Queue = queue.Queue()
        w = self._call(self._open_watch(prefix, start_index, events))
        try:
            while True:
                try:
                    ev = events.get(timeout=timeout)
                except queue.Empty:
                    return
                if ev is None:
                    return
                yield ev
        finally:
            if not self._closed:
                self._loop.call_soon_threadsafe(w.close)

    async def _open_watch(self, prefix: str, start_index: int | None, events: queue.Queue):
        w = self._node.watch(prefix, start_index=start_index)

        async def pump() -> None:
            async for ev in w:
                events.put(ev)
            events.put(None)

        self._loop.create_task(pump())
        return w

    # -- maintenance -----------------------------------------------------------------------

    def snapshot(self):
        """Take a snapshot now (and compact the log behind it); returns its file info."""
        return self._call(self._node.take_snapshot())[0]

    def status(self) -> dict:
        return self._call(_status(self._node))

    def close(self) -> None:
        self._closer()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_consistency(consistency: str) -> None:
    if consistency not in CONSISTENCY:
        raise BadRequest(f"consistency must be one of {', '.join(CONSISTENCY)}, not {consistency!r}")


def _close_store(lt: LoopThread, node: Node) -> None:
    if lt.closed:
        return
    try:
        lt.call(node.stop())
    finally:
        lt.close()


async def _status(node: Node) -> dict:
    return node.status()


def open(path: str, **options) -> Store:  # noqa: A001 - the public name is kv.open
    """Open (creating if needed) a durable single-node store at `path`.

    Options are NodeConfig fields, e.g. snapshot_threshold=100_000, max_value_bytes=...
    Every write is fsynced before it returns; reads are linearizable."""
    return Store(path, **options)
