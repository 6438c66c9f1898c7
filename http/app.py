"""The aiohttp application of a node: routes, error model, auth, metrics; and serve()."""

from __future__ import annotations

import logging
import ssl

import aiohttp
from aiohttp import web

from kv import Node, tls
from kv.metrics import Counter, Gauge

from . import routes_admin, routes_kv, routes_leases, routes_members
from .auth import ADMIN, Grant, authorize
from .context import CONTEXT, HttpContext
from .errors import run_handler
from .listener import CappedSite

log = logging.getLogger("kv.http")


@web.middleware
async def middleware(request: web.Request, handler):
    """One layer for every request: the token and role check, the error model and the
    request counter (one middleware instead of three: this runs on every request)."""
    c = request.app[CONTEXT]
    if c.grants:

        async def checked(request: web.Request):
            authorize(request, c.grants)
            return await handler(request)

        resp = await run_handler(request, checked)
    else:
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
    reg.add(Gauge("kv_peer_connections_rejected_total", "Inbound peer connections closed: bad handshake or frame, over a limit.", lambda: [((), float(node.raft.transport.rejected_connections if node.raft.transport else 0))]))
    reg.add(node.commit_latency)
    snap = node.snapshots.stats
    reg.add(Gauge("kv_snapshots_taken_total", "Snapshots taken.", lambda: [((), float(snap.taken))]))
    reg.add(Gauge("kv_snapshot_seconds_total", "Seconds spent writing snapshots.", lambda: [((), snap.take_seconds)]))
    reg.add(Gauge("kv_snapshot_last_seconds", "Duration of the last snapshot.", lambda: [((), snap.last_take_seconds)]))
    reg.add(Gauge("kv_snapshots_sent_total", "Snapshots streamed to followers.", lambda: [((), float(snap.sent))]))
    reg.add(Gauge("kv_snapshots_installed_total", "Snapshots installed from a leader.", lambda: [((), float(snap.installed))]))


def create_app(node: Node, *, token: str | None = None, tokens: dict[str, Grant] | None = None) -> web.Application:
    """`token` is an admin token; `tokens` maps more tokens to their grants (http/auth.py).
    With neither, every request is allowed."""
    grants = dict(tokens or {})
    if token:
        grants[token] = ADMIN
    # A JSON body carries values base64- or JSON-escaped: room for 3x the encoded request.
    c = HttpContext(node=node, grants=grants, max_json_bytes=max(4 << 20, 3 * node.config.max_request_bytes))
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

    async def session_ctx(app: web.Application):
        trust = tls.client_context(node.config.cacert) or True
        c.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), connector=aiohttp.TCPConnector(ssl=trust))
        yield
        await c.session.close()

    app.cleanup_ctx.append(session_ctx)
    return app


async def serve(
    node: Node,
    host: str,
    port: int,
    *,
    token: str | None = None,
    tokens: dict[str, Grant] | None = None,
    ssl_context: ssl.SSLContext | None = None,
    idle_timeout_s: float = 30.0,
    max_connections: int = 10_000,
) -> web.AppRunner:
    """Start the HTTP API of `node`; returns the runner (await runner.cleanup() to stop).

    aiohttp's keep-alive timer starts when a connection opens and again after each
    response, and closes the connection if no whole request head arrived by then: so
    `idle_timeout_s` bounds both an idle connection and a slowly sent request head."""
    app = create_app(node, token=token, tokens=tokens)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, keepalive_timeout=idle_timeout_s)
    await runner.setup()
    site = CappedSite(runner, host, port, max_connections=max_connections, handshake_timeout_s=idle_timeout_s, ssl_context=ssl_context, backlog=1024)
    await site.start()
    app[CONTEXT].registry.add(Gauge("kv_http_connections_refused_total", "Client connections answered 503 beyond --max-http-connections.", lambda: [((), float(site.refused))]))
    return runner
