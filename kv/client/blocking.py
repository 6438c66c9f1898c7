"""kv.Client: kv.AsyncClient's methods, blocking, on a loop thread of the client's own."""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import AsyncIterable, Awaitable, Callable, Iterator, Sequence
from typing import Concatenate, ParamSpec, TypeVar

from ..common.loop import LoopThread
from ..common.results import Event
from .async_client import AsyncClient
from .recipes import AsyncElection, AsyncLease, AsyncLock, Election, Lease, Lock


P = ParamSpec("P")
R = TypeVar("R")


def _blocking(fn: Callable[Concatenate[AsyncClient, P], Awaitable[R]]) -> Callable[Concatenate[Client, P], R]:
    """Client.NAME: AsyncClient.NAME run on the client's loop thread, blocking."""

    @functools.wraps(fn)
    def call(self: Client, *args: P.args, **kwargs: P.kwargs) -> R:
        self._after_fork()
        return self._lt.call(fn(self._async, *args, **kwargs))

    call.__qualname__ = f"Client.{fn.__name__}"
    return call


def _blocking_iter(fn: Callable[Concatenate[AsyncClient, P], AsyncIterable[R]]) -> Callable[Concatenate[Client, P], Iterator[R]]:
    """Client.NAME for an AsyncClient method that streams: a plain iterator over it."""

    @functools.wraps(fn)
    def call(self: Client, *args: P.args, **kwargs: P.kwargs) -> Iterator[R]:
        self._after_fork()
        return self._lt.iterate(aiter(fn(self._async, *args, **kwargs)))

    call.__qualname__ = f"Client.{fn.__name__}"
    return call


class Client:
    """The synchronous client: AsyncClient's methods, blocking (its own loop thread).

        with kv.Client("http://127.0.0.1:8001,http://127.0.0.1:8002") as c:
            c.put("a", b"1")
            item = c.get("a")
            c.cas("a", item.mod_index, b"2")

    A client that is never closed is closed when it is garbage-collected or the
    interpreter exits.
    """

    def __init__(self, endpoints: str | Sequence[str] | None = None, **options) -> None:
        self._args = (endpoints, options)
        self._start()

    def _start(self) -> None:
        self._pid = os.getpid()
        self._async = AsyncClient(self._args[0], **self._args[1])
        self._lt = LoopThread("kv-client")
        self._closer = weakref.finalize(self, _close_client, self._lt, self._async)

    def _after_fork(self) -> None:
        """In a child of fork() (multiprocessing, say) the parent's loop thread does not
        exist, and its connections and client sessions are the parent's: the child's calls
        hung for ever. It starts afresh, leaving those to the parent."""
        if os.getpid() != self._pid:
            self._closer.detach()
            self._start()

    @property
    def endpoints(self) -> list[str]:
        return self._async.endpoints

    put = _blocking(AsyncClient.put)
    cas = _blocking(AsyncClient.cas)
    get = _blocking(AsyncClient.get)
    delete = _blocking(AsyncClient.delete)
    delete_prefix = _blocking(AsyncClient.delete_prefix)
    scan = _blocking_iter(AsyncClient.scan)
    txn = _blocking(AsyncClient.txn)
    put_many = _blocking(AsyncClient.put_many)
    bulk_put = _blocking(AsyncClient.bulk_put)
    status = _blocking(AsyncClient.status)
    status_all = _blocking(AsyncClient.status_all)
    transfer_leader = _blocking(AsyncClient.transfer_leader)
    take_snapshot = _blocking(AsyncClient.take_snapshot)
    compact = _blocking(AsyncClient.compact)
    download_snapshot = _blocking(AsyncClient.download_snapshot)
    read_log = _blocking_iter(AsyncClient.read_log)
    scan_page = _blocking(AsyncClient.scan_page)
    def watch(
        self, prefix: str = "", start_index: int | None = None, *, end_index: int | None = None, timeout: float | None = None, idle_timeout: float = 15.0
    ) -> Iterator[Event]:
        """AsyncClient.watch, blocking; like kv.open's, `timeout` ends a wait with no change
        for that many seconds (None: waits)."""
        self._after_fork()
        return self._lt.iterate(aiter(self._async.watch(prefix, start_index, end_index=end_index, idle_timeout=idle_timeout)), timeout)
    members = _blocking(AsyncClient.members)
    lease_grant = _blocking(AsyncClient.lease_grant)
    lease_keepalive = _blocking(AsyncClient.lease_keepalive)
    lease_keepalives = _blocking(AsyncClient.lease_keepalives)
    lease_revoke = _blocking(AsyncClient.lease_revoke)
    lease_info = _blocking(AsyncClient.lease_info)
    lease_list = _blocking(AsyncClient.lease_list)
    add_member = _blocking(AsyncClient.add_member)
    remove_member = _blocking(AsyncClient.remove_member)
    promote_member = _blocking(AsyncClient.promote_member)

    def lease(self, ttl: float, *, on_lost=None) -> Lease:
        """A lease that keeps itself alive (on this client's thread) until revoked; on_lost
        (error) is called, on a thread of its own, if it is lost:

            with client.lease(10) as lease:
                client.put("services/api", b"10.0.0.1:8080", lease=lease)
        """
        self._after_fork()
        return Lease(self._lt.call(AsyncLease(self._async, ttl, on_lost=self._lt.off_loop(on_lost)).grant()), self._lt)

    def lock(self, name: str, *, ttl: float = 10, timeout: float | None = None, on_lost=None) -> Lock:
        """Mutual exclusion across processes, FIFO: `with client.lock("jobs/nightly"):`;
        on_lost(error) is called, on a thread of its own, if the lock is lost while held."""
        self._after_fork()
        return Lock(AsyncLock(self._async, name, ttl=ttl, timeout=timeout, on_lost=self._lt.off_loop(on_lost)), self._lt)

    def election(self, name: str, *, ttl: float = 10, on_lost=None) -> Election:
        """Leader election: campaign(value), leader(), observe(), resign(); on_lost(error)
        is called, on a thread of its own, if a leadership won is lost."""
        self._after_fork()
        return Election(AsyncElection(self._async, name, ttl=ttl, on_lost=self._lt.off_loop(on_lost)), self._lt)

    def close(self) -> None:
        if os.getpid() == self._pid:  # (a child of fork() never started its own: nothing to close)
            self._closer()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _close_client(lt: LoopThread, client: AsyncClient) -> None:
    lt.close(last=client.close)
