"""`kv serve`: run one node — peer transport, ledger, state machine and the HTTP API."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import threading
from typing import TYPE_CHECKING

from ..server import tls
from ..server.config import NodeConfig, check_hostport
from ..server.datadir import DataDirLock, holds_a_node
from ..server.eventlog import log_term_from, setup_logging
from ..server.join import forget_join, join_cluster, keep_join, kept_join
from ..server.process import check_can_listen, http_connection_cap, install_uvloop, listen_error, raise_fd_limit, tune_gc
from ..raft.errors import MemberRemoved
from .refusal import EXIT_ERROR, EXIT_REMOVED
from .settings import add_serve_options, serve_settings, unknown_env

if TYPE_CHECKING:
    from ..node import Node


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
    if unknown := unknown_env():
        logging.getLogger("kv.serve").warning("the environment sets %s, which kv serve does not read (its settings: kv serve --help)", ", ".join(unknown))
    install_uvloop()
    return asyncio.run(serve_node(s.node, access_log=s.access_log))


STOP_GRACE_S = 15.0  # how long stopping may take before the process exits regardless


async def serve_node(config: NodeConfig, *, access_log: bool = False) -> int:
    from ..node import Node  # here: the client commands load without the storage engines
    from ..http.app import serve  # aiohttp only when serving
    from ..http.auth import ADMIN, load_tokens

    log = logging.getLogger("kv.serve")
    # Every file a setting names is read before the ports are looked at: a bad file is the
    # error to report, whatever else holds the port (kv.Node loads the peer files again).
    sslctx = tls.server_context(config.tls_cert, config.tls_key)
    tokens = load_tokens(config.tokens) if config.tokens else None
    grants = {**(tokens or {}), **({config.token: ADMIN} if config.token else {})} or None  # for the etcd API's fronts
    tls.peer_tls(config.peer_cert, config.peer_key, config.peer_ca)
    fd_limit = raise_fd_limit()
    max_http = http_connection_cap(config.max_http_connections, fd_limit)
    if max_http < config.max_http_connections:
        log.warning("at most %d client connections (not %d): the descriptor limit is %d", max_http, config.max_http_connections, fd_limit)
    check_can_listen(
        *([(config.peers[config.id], f"--peers {config.id}=")] if config.id in config.peers else []),
        *([(config.http, "--http ")] if config.http else []),
        *([(config.grpc, "--grpc ")] if config.grpc else []),
    )
    lock = DataDirLock.acquire(config.data_dir)  # before anything in it is looked at
    try:
        joined = kept_join(config.data_dir, bool(config.join))  # (a join answered before the node last stopped)
        if joined is not None:
            log.info("resuming the join the cluster answered before this node last stopped (its membership as of index %d)", joined.index)
        elif config.join and not holds_a_node(config.data_dir):
            joined = await join_cluster(config)
            keep_join(config.data_dir, joined)
    except BaseException:
        lock.release()
        raise
    node = Node(config, joined=joined, data_dir_lock=lock)
    await node.start()
    forget_join(config.data_dir)
    log_term_from(lambda: node.raft.term if node.raft else None)
    tune_gc()
    runner = grpc_server = None
    try:
        from ..v3api.access import CallCounts  # etcd's API: its two fronts' calls, counted together

        etcd_calls = CallCounts()
        node.metrics.register(etcd_calls.samples)
        # The etcd API's port first: once the HTTP port answers (what `kv cluster up` and
        # every readiness check waits for), a client may call either.
        if config.grpc:
            from ..v3api.server import serve_grpc  # grpcio only when serving the etcd API

            host, port = check_hostport(config.grpc, "--grpc")
            try:
                tls_files = (config.tls_cert, config.tls_key) if config.tls_cert else None
                grpc_server = await serve_grpc(node, host, port, grants=grants, tls=tls_files, counts=etcd_calls)
            except (OSError, RuntimeError) as e:
                raise listen_error(e if isinstance(e, OSError) else OSError(str(e)), "--grpc ", config.grpc) from e
        if config.http:
            from ..v3api.gateway import routes as gateway_routes  # etcd's JSON gateway, on the same port

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
                    more_routes=gateway_routes(node, grants, etcd_calls),
                )
            except OSError as e:
                raise listen_error(e, "--http ", config.http) from e
            if grpc_server is not None:
                grpc_server.http1 = runner.server  # (the etcd API's port answers HTTP/1 with it)
                if not sslctx:  # and this port gRPC, in plain text (over TLS a gRPC client asks ALPN for h2: the --grpc port's)
                    for site in runner.sites:
                        if getattr(site, "fast", None) is not None:
                            site.fast.http2 = grpc_server.connection
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        scheme = "https" if sslctx else "http"
        log.info(
            "ready: node %s of group %s, http %s://%s, etcd API %s, peers %s, data dir %s, pid %d",
            config.id,
            config.group,
            scheme,
            config.http or "(none)",
            config.grpc or "(none)",
            ",".join(f"{k}={v}" for k, v in config.peers.items()) or "(single node)",
            os.path.abspath(config.data_dir),
            os.getpid(),
        )
        failed = asyncio.ensure_future(_watch_failure(node))
        done, _ = await asyncio.wait([asyncio.ensure_future(stop.wait()), failed], return_when=asyncio.FIRST_COMPLETED)
        code = 0 if failed not in done else EXIT_REMOVED if isinstance(node.raft.failure, MemberRemoved) else EXIT_ERROR
        if code:  # the failure itself was logged where it happened
            log.error("stopping: exit code %d after the error above", code)
        else:
            log.info("stopping on signal")
        _exit_if_stuck(loop, code)
        if not code and (to := await node.hand_over_leadership()) is not None:
            log.info("handed leadership to %s before stopping", to)
        return code
    finally:
        if runner is not None:
            await runner.cleanup()
        if grpc_server is not None:
            await grpc_server.stop(1.0)
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
