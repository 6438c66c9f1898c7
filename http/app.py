"""The aiohttp application of a node: routes, error model, auth, metrics; and serve()."""

from __future__ import annotations

import hmac
import logging
import ssl

import aiohttp
from aiohttp import web

from kv import Node, Unauthorized
from kv.metrics import Counter, Gauge

from . import routes_admin, routes_kv, routes_leases, routes_members, routes_watch
from .context import CONTEXT, HttpContext
from .errors import error_response, run_handler

log = logging.getLogger("kv.http")

OPEN_PATHS = frozenset({"/healthz"})  # answered without a token


@web.middleware
async def middleware(request: web.Request, handler):
    """One layer for every request: the token check, the error model and the request
    counter (one middleware instead of three: this runs on every request)."""
    c = request.app[CONTEXT]
    if c.token and request.path not in OPEN_PATHS:
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {c.token}".encode()):
            e = Unauthorized("missing or wrong token: send Authorization: Bearer <token> (the node's --token)")
            resp = error_response(e.http_status, e.code, str(e))
            c.requests.inc(request.match_info.route.name or "unmatched", request.method, resp.status)
            return resp
    resp = await run_handler(request, handler)
    c.requests.inc(request.match_info.route.name or "unmatched", request.method, resp.status)
    return resp


def _register_metrics(c: HttpContext) -> None:
    node, reg = c.node, c.registry
    c.requests = reg.add(Counter("kv_http_requests_total", "HTTP requests by route, method and status.", ("route", "method", "status")))

    def status_gauge(field: str):
        return lambda: [((), float(node.status().get(field) or 0))]

    def role():
        s = node.status()
        return [((r,), 1.0 if s.get("role") == r else 0.0) for r in ("follower", "pre_candidate", "candidate", "leader")]

    reg.add(Gauge("kv_role", "1 for this node's current role.", role, ("role",)))
    for f, h in (
        ("term", "Current term."),
        ("commit_index", "Highest log index known committed."),
        ("applied_index", "Highest log index applied to the state machine."),
        ("ledger_begin_index", "ledgerBeforeBeginIndex: entries up to here are compacted."),
        ("ledger_end_index", "Last index in the ledger."),
        ("snapshot_index", "Index of the newest snapshot."),
    ):
        reg.add(Gauge(f"kv_{f}", h, status_gauge(f)))

    def lag():
        core = node.raft.core
        last = core.log.last_index()
        return [((p,), float(last - pr.match)) for p, pr in core.progress.items()]

    reg.add(Gauge("kv_replication_lag_entries", "Leader only: entries each follower is behind.", lag, ("peer",)))
    reg.add(Gauge("kv_proposals_total", "Entries proposed on this node as leader.", lambda: [((), float(node.raft.stats["proposals"]))]))
    reg.add(Gauge("kv_ledger_fsyncs_total", "Group-committed ledger writes (one fsync each).", lambda: [((), float(node.raft.stats["writes"]))]))
    reg.add(Gauge("kv_ledger_fsynced_entries_total", "Entries written to the ledger.", lambda: [((), float(node.raft.stats["fsynced_entries"]))]))
    reg.add(Gauge("kv_raft_ready_total", "Ready batches the driver handled.", lambda: [((), float(node.raft.stats["ready"]))]))
    reg.add(Gauge("kv_peer_frames_sent_total", "Frames sent to peers.", lambda: [((), float(node.raft.transport.sent_frames if node.raft.transport else 0))]))
    reg.add(node.commit_latency)
    reg.add(Gauge("kv_watches", "Open watches on this node (in-process and streams).", lambda: [((), float(node.watches.stats()[0]))]))
    reg.add(Gauge("kv_watch_buffered_bytes", "Bytes of changes buffered for watches that have not taken them yet.", lambda: [((), float(node.watches.stats()[1]))]))
    snap = node.snapshots.stats
    reg.add(Gauge("kv_snapshots_taken_total", "Snapshots taken.", lambda: [((), float(snap.taken))]))
    reg.add(Gauge("kv_snapshot_seconds_total", "Seconds spent writing snapshots.", lambda: [((), snap.take_seconds)]))
    reg.add(Gauge("kv_snapshot_last_seconds", "Duration of the last snapshot.", lambda: [((), snap.last_take_seconds)]))
    reg.add(Gauge("kv_snapshots_sent_total", "Snapshots streamed to followers.", lambda: [((), float(snap.sent))]))
    reg.add(Gauge("kv_snapshots_installed_total", "Snapshots installed from a leader.", lambda: [((), float(snap.installed))]))


def create_app(node: Node, *, token: str | None = None) -> web.Application:
    c = HttpContext(node=node, token=token)
    app = web.Application(
        middlewares=[middleware],
        client_max_size=node.config.max_value_bytes + (1 << 20),
    )
    app[CONTEXT] = c
    _register_metrics(c)
    routes_kv.add_routes(app)
    routes_admin.add_routes(app)
    routes_members.add_routes(app)
    routes_leases.add_routes(app)
    routes_watch.add_routes(app)

    async def session_ctx(app: web.Application):
        c.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        yield
        await c.session.close()

    app.cleanup_ctx.append(session_ctx)
    return app


async def serve(node: Node, host: str, port: int, *, token: str | None = None, ssl_context: ssl.SSLContext | None = None) -> web.AppRunner:
    """Start the HTTP API of `node`; returns the runner (await runner.cleanup() to stop)."""
    runner = web.AppRunner(create_app(node, token=token), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context, reuse_address=True, backlog=1024)
    await site.start()
    return runner
