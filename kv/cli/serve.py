"""`kv serve`: run one node — peer transport, ledger, state machine and the HTTP API."""

from __future__ import annotations

import argparse
import asyncio
import errno
import gc
import logging
import os
import resource
import signal
import threading
import socket

from .. import tls
from ..config import NodeConfig, check_hostport
from ..datadir import DataDirLock
from ..errors import BadRequest, Conflict, KVError, MemberExists, NotLeader, Timeout, Unauthorized, Unavailable
from ..logs import log_term_from, setup_logging
from ..node import Node
from ..raft.membership import Member, Membership
from .settings import add_serve_options, serve_settings


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="run a node", description="Run a node: peer transport, ledger, state machine, HTTP API.")
    add_serve_options(s)
    s.add_argument(
        "--force-new-cluster",
        action="store_true",
        help="the cluster lost its majority for good: start this member alone, as a one-member cluster with its "
        "data; then add the others back (use once, restart without it)",
    )
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    s = serve_settings(args)
    setup_logging(s.node.id, s.log_level, s.log_format)
    install_uvloop()
    return asyncio.run(serve_node(s.node, access_log=s.access_log))


STOP_GRACE_S = 15.0  # how long stopping may take before the process exits regardless


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
                raise _listen_error(e, what, addr) from None
    finally:
        for s, _, _ in held:
            s.close()


def _listen_error(e: OSError, what: str, addr: str) -> KVError | OSError:
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


async def join_cluster(config: NodeConfig) -> Membership:
    """Ask a member of a running cluster (config.join) to add this new node as a learner;
    returns the membership to start from. Temporary refusals (another membership change in
    progress, no leader, the member not reachable yet) are waited out with backoff until
    --join-timeout; a permanent one (the id is a member with other addresses, a bad token,
    a bad request) ends it at once."""
    from ..client import AsyncClient

    if config.id not in config.peers:
        raise BadRequest(f"with --join, --peers must still give this node's own peer address ({config.id}=HOST:PORT)")
    log = logging.getLogger("kv.serve")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.join_timeout_s
    delay = 0.2
    async with AsyncClient(config.join, token=config.token, timeout=min(10.0, config.join_timeout_s), cacert=config.cacert) as c:
        while True:
            try:
                members = await c.add_member(config.id, config.peers[config.id], config.advertise_url, voter=False)
                return Membership.of(Member(m["id"], m["peer"], m.get("http", ""), m["voter"]) for m in members)
            except (MemberExists, Unauthorized, BadRequest):
                raise
            except (Conflict, NotLeader, Unavailable, Timeout) as e:
                # Adding the same member again is idempotent, so a Timeout (outcome
                # unknown) is retried like the rest.
                if loop.time() + delay > deadline:
                    raise Unavailable(
                        f"--join {config.join}: the cluster did not add {config.id} within {config.join_timeout_s:g}s "
                        f"(last answer: {e}); check that the cluster has a leader (kv status), or raise --join-timeout"
                    ) from e
                log.info("join: not added yet (%s); retrying in %.1fs", e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)


async def promote_when_caught_up(config: NodeConfig, node: Node) -> None:
    """A joined learner asks to become a voter until the leader agrees it has caught up."""
    from ..client import AsyncClient

    log = logging.getLogger("kv.serve")
    async with AsyncClient(config.join, token=config.token, timeout=10, cacert=config.cacert) as c:
        while True:
            me = node.raft.membership.get(config.id) if node.raft else None
            if me is not None and me.voter:
                log.info("joined the cluster as a voter")
                return
            try:
                await c.promote_member(config.id)
            except KVError as e:  # Conflict until caught up; or the cluster is busy
                log.info("not promoted yet (%s); retrying", e)
            await asyncio.sleep(1.0)


async def serve_node(config: NodeConfig, *, access_log: bool = False) -> int:
    from ..http.app import serve  # aiohttp only when serving
    from ..http.auth import load_tokens

    log = logging.getLogger("kv.serve")
    # Every file a setting names is read before the ports are looked at: a bad file is the
    # error to report, whatever else holds the port (kv.Node loads the peer files again).
    sslctx = tls.server_context(config.tls_cert, config.tls_key)
    tokens = load_tokens(config.tokens) if config.tokens else None
    tls.peer_tls(config.peer_cert, config.peer_key, config.peer_ca)
    fd_limit = raise_fd_limit()
    max_http = http_connection_cap(config.max_http_connections, fd_limit)
    if max_http < config.max_http_connections:
        log.warning("at most %d client connections (not %d): the descriptor limit is %d", max_http, config.max_http_connections, fd_limit)
    check_can_listen(
        *([(config.peers[config.id], f"--peers {config.id}=")] if config.id in config.peers else []),
        *([(config.http, "--http ")] if config.http else []),
    )
    lock = DataDirLock.acquire(config.data_dir)  # before anything in it is looked at
    try:
        fresh = not os.path.exists(config.ledger_path)
        initial = await join_cluster(config) if config.join and fresh else None
    except BaseException:
        lock.release()
        raise
    node = Node(config, initial_membership=initial, data_dir_lock=lock)
    await node.start()
    log_term_from(lambda: node.raft.term if node.raft else None)
    tune_gc()
    runner = None
    promoting = asyncio.ensure_future(promote_when_caught_up(config, node)) if config.join else None
    try:
        if config.http:
            host, port = check_hostport(config.http, "--http")
            try:
                runner = await serve(
                    node,
                    host,
                    port,
                    token=config.token,
                    tokens=tokens,
                    ssl_context=sslctx,
                    idle_timeout_s=config.http_idle_timeout_s,
                    max_connections=max_http,
                    access_log=access_log,
                    fast_path=not config.http_aiohttp_only,
                )
            except OSError as e:
                raise _listen_error(e, "--http ", config.http) from e
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        scheme = "https" if sslctx else "http"
        log.info(
            "ready: node %s of group %s, http %s://%s, peers %s, data dir %s, pid %d",
            config.id,
            config.group,
            scheme,
            config.http or "(none)",
            ",".join(f"{k}={v}" for k, v in config.peers.items()) or "(single node)",
            os.path.abspath(config.data_dir),
            os.getpid(),
        )
        failed = asyncio.ensure_future(_watch_failure(node))
        done, _ = await asyncio.wait([asyncio.ensure_future(stop.wait()), failed], return_when=asyncio.FIRST_COMPLETED)
        code = 1 if failed in done else 0
        if code:  # the failure itself was logged where it happened
            log.error("stopping: exit code 1 after the error above")
        else:
            log.info("stopping on signal")
        _exit_if_stuck(loop, code)
        if not code and (to := await node.hand_over_leadership()) is not None:
            log.info("handed leadership to %s before stopping", to)
        return code
    finally:
        if promoting is not None:
            promoting.cancel()
        if runner is not None:
            await runner.cleanup()
        await node.stop()


def _exit_if_stuck(loop: asyncio.AbstractEventLoop, code: int) -> None:
    """Once the node is stopping, a signal, or a clean-up that takes too long (a thread
    stuck after a fatal error), ends the process at once: a node that said it stops never
    lingers with its ports open."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, os._exit, code or 1)
    timer = threading.Timer(STOP_GRACE_S, os._exit, (code or 1,))
    timer.daemon = True
    timer.start()


async def _watch_failure(node: Node) -> None:
    while node.raft.failure is None:
        await node.raft.leader_changed.wait()
