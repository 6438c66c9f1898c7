"""What a node's process sets up around kv.Node: the event loop, the garbage collector, the
descriptor limit, and a check that its ports are free before anything starts."""

from __future__ import annotations

import asyncio
import errno
import gc
import resource
import socket

from ..errors import KVError
from .config import check_hostport


def install_uvloop() -> bool:
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def tune_gc() -> None:
    """`kv serve` owns its process: keep the objects of start-up out of every collection and
    collect the young generation less often. Requests allocate many short-lived tuples that
    reference counting frees anyway; with the defaults, full collections cost pauses of
    tens of milliseconds on a busy node (measured: kv bench store, txn p99)."""
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)


FD_RESERVE = 1536  # descriptors kept for LevelDB (up to 1000 open files), the ledger, peers


def raise_fd_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to the hard limit; returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # an infinite hard limit may be refused: keep the soft one
            pass
    return soft


def http_connection_cap(wanted: int, fd_limit: int) -> int:
    """--max-http-connections, lowered so that client connections can never take the
    descriptors the node needs for its files and peers."""
    return max(64, min(wanted, fd_limit - FD_RESERVE))


class CannotListen(KVError):
    """A port this node must listen on is taken, not on this machine, or not allowed."""

    code = "CANNOT_LISTEN"


def check_can_listen(*wanted: tuple[str, str]) -> None:
    """Refuse before anything starts when a port is taken (the node binds it moments
    later: a port taken in between still gets the same message from serve_node()).
    `wanted` is (HOST:PORT, what it is) pairs, held all at once: two of them on one port
    (an --http on the node's own peer port) are refused too, as the kernel sees it."""
    held: list[tuple[socket.socket, str, int]] = []
    try:
        for addr, what in wanted:
            host, port = check_hostport(addr, what)
            try:
                family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
                s = socket.socket(family, kind, proto)
                held.append((s, f"{what}{addr}", port))
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(sockaddr)
                s.listen(1)  # two bound but idle SO_REUSEADDR sockets may share a port
            except OSError as e:
                twin = next((name for _, name, p in held[:-1] if p == port), None)
                if twin is not None and e.errno == errno.EADDRINUSE:
                    raise CannotListen(f"{twin} and {what}{addr} are the same port: give each its own") from None
                raise listen_error(e, what, addr) from None
    finally:
        for s, _, _ in held:
            s.close()


def listen_error(e: OSError, what: str, addr: str) -> KVError | OSError:
    port = addr.rpartition(":")[2]
    if e.errno == errno.EADDRINUSE:
        return CannotListen(f"{what}{addr}: port {port} is already in use; find who holds it with `ss -ltnp 'sport = :{port}'`, stop it or choose another port")
    if e.errno == errno.EADDRNOTAVAIL:
        return CannotListen(f"{what}{addr}: that address is not on this machine; use one of its addresses or 0.0.0.0")
    if e.errno == errno.EACCES:
        return CannotListen(f"{what}{addr}: not allowed to listen on port {port} (ports below 1024 need privileges); choose a port above 1024")
    if isinstance(e, socket.gaierror):
        return CannotListen(f"{what}{addr}: cannot resolve the host ({e.strerror}); check the name")
    return e
