"""The aiohttp application of a node: routes, error model, auth, metrics; and serve()."""

from __future__ import annotations

import logging
import ssl
import time
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from kv import Forbidden, Node, WrongCluster
from kv.common.tls import client_context
from kv.server.access import request_forwarded

from . import routes_admin, routes_kv, routes_leases, routes_members, routes_sessions, routes_watch
from .answer import Answer
from .auth import ADMIN, OPEN_PATHS, Grant, authorize
from .cors import Cors, LocalNames
from .context import CONTEXT, LARGE_ANSWER, HttpContext
from .errors import run_handler
from .params import CLUSTER_HEADER
from .query import unknown_query
from .fastpath import FastFront
from .listener import CappedSite

log = logging.getLogger("kv.http")
access = logging.getLogger("kv.access")

@web.middleware
async def middleware(request: web.Request, handler) -> web.StreamResponse:
    """handle(), for a request that aiohttp serves: an Answer becomes aiohttp's Response.
    A large one is written here, counted in the node's unread answers until its client has
    taken it (as the fast path counts its own): the handler's room_for() then refuses the
    next large answer while clients that do not read hold --http-unread-bytes."""
    resp = await handle(request, handler)
    if not isinstance(resp, Answer):
        return resp
    out = resp.to_response()
    size = len(out.body) if isinstance(out.body, bytes | bytearray) else 0
    if size <= LARGE_ANSWER:
        return out
    c = request.app[CONTEXT]
    c.unread += size
    try:
        await out.prepare(request)
        await out.write_eof()  # returns once the socket took most of it (aiohttp drains)
    finally:
        c.unread -= size
    return out


async def handle(request: web.Request, handler) -> Answer | web.StreamResponse:
    """One layer for every request, whichever front parsed it (aiohttp, or the fast path
    for the key routes): the token and role check, the error model, the latency histogram
    and the access log (one layer instead of four: this runs on every request)."""
    c = request.app[CONTEXT]
    t0 = time.perf_counter()
    request_forwarded.set(False)  # requests of one keep-alive connection share a task
    want = request.headers.get(CLUSTER_HEADER)
    origin = request.headers.get("Origin")  # (a web page's script: http/cors.py)
    if request.query and (bad := unknown_query(request.match_info.route.name, request.method, request.path, request.query)) is not None:
        handler = _refuse(bad)  # (in place of the route's: after the checks below, the token's included)
    if origin is not None and not c.cors.allows(origin):
        resp = await run_handler(request, _refuse(Forbidden(c.cors.refusal(origin))))
    elif not c.local_names.allows(host := request.headers.get("Host"), lambda: request.remote):
        resp = await run_handler(request, _refuse(Forbidden(c.local_names.refusal(host))))
    elif origin is not None and request.method == "OPTIONS":  # a listed page's preflight
        resp = Answer(b"", 204, "text/plain", c.cors.preflight(request.headers))
    elif want and c.node.cluster_id and want != c.node.cluster_id:  # (before the token: another cluster's may differ)
        resp = await run_handler(request, _refuse(_wrong_cluster(c.node.cluster_id, want)))
    elif c.grants and request.path not in OPEN_PATHS and not (c.metrics_public and request.path == "/metrics"):

        async def checked(request: web.Request):
            authorize(request, c.grants)
            return await handler(request)

        resp = await run_handler(request, checked)
    else:
        resp = await run_handler(request, handler)
    if want == "" and type(resp) is Answer and c.node.cluster_id:  # asked: which cluster is this?
        resp.headers = {**(resp.headers or {}), CLUSTER_HEADER: c.node.cluster_id}
    if origin is not None and type(resp) is Answer and c.cors.allows(origin):  # (a stream's: _cors_headers)
        resp.headers = {**(resp.headers or {}), **c.cors.headers(origin)}
    elapsed = time.perf_counter() - t0
    route = request.match_info.route.name or "unmatched"
    c.node.metrics.observe_http(route, resp.status, elapsed)
    if c.access_log:
        _log_access(request, route, resp.status, elapsed)
    return resp


def _refuse(error: Exception):
    async def refuse(request: web.Request):
        raise error

    return refuse


def _wrong_cluster(mine: str, want: str) -> WrongCluster:
    return WrongCluster(
        f"this node belongs to cluster {mine}, not to {want[:64]!r}, the one the client reached first: its endpoints mix "
        "two clusters, or the cluster was made anew or restored since (then make a new client); nothing was done "
        "here; check the endpoints (--endpoints, $KV_ENDPOINTS)"
    )


async def _cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """A listed web page's answers that aiohttp writes, a watch's stream among them."""
    origin = request.headers.get("Origin")
    cors = request.app[CONTEXT].cors
    if origin is not None and cors.allows(origin):
        response.headers.update(cors.headers(origin))


def _log_access(request: web.Request, route: str, status: int, elapsed: float) -> None:
    forwarded = request_forwarded.get()
    ms = round(elapsed * 1000, 3)
    fields = {"method": request.method, "path": request.path, "route": route, "status": status, "duration_ms": ms, "forwarded": forwarded, "remote": request.remote}
    access.info(
        "%s %s route=%s status=%d duration_ms=%.3f forwarded=%s remote=%s",
        request.method, request.path, route, status, ms, "yes" if forwarded else "no", request.remote,
        extra={"http": fields},
    )


def create_app(
    node: Node, *, token: str | None = None, tokens: dict[str, Grant] | None = None, access_log: bool = False, more_routes: list | None = None
) -> web.Application:
    """`token` is an admin token; `tokens` maps more tokens to their grants (http/auth.py).
    With neither, every request is allowed. `more_routes`: another front's routes on the
    same port (etcd's JSON gateway, v3api/gateway.py), which check their callers themselves."""
    grants = dict(tokens or {})
    if token:
        grants[token] = ADMIN
    # A JSON body carries values base64- or JSON-escaped: room for 3x the encoded request.
    c = HttpContext(
        node=node,
        grants=grants,
        max_json_bytes=max(4 << 20, 3 * node.config.max_request_bytes),
        access_log=access_log,
        metrics_public=node.config.metrics_public,
        cors=Cors(node.config.cors),
        local_names=LocalNames((urlsplit(node.config.advertise_url).hostname or "",)),
    )
    app = web.Application(
        middlewares=[middleware],
        client_max_size=node.config.max_value_bytes + (1 << 20),
    )
    app[CONTEXT] = c
    app.on_response_prepare.append(_cors_headers)
    node.metrics.register(c.samples)  # (made now, so that it counts from the first request on)
    routes_kv.add_routes(app)
    routes_admin.add_routes(app)
    routes_members.add_routes(app)
    routes_leases.add_routes(app)
    routes_sessions.add_routes(app)
    routes_watch.add_routes(app)
    if more_routes:
        app.router.add_routes(more_routes)

    async def session_ctx(app: web.Application):
        trust = client_context(node.config.cacert) or True
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
    access_log: bool = False,
    fast_path: bool = True,
    more_routes: list | None = None,
) -> web.AppRunner:
    """Start the HTTP API of `node`; returns the runner (await runner.cleanup() to stop).

    aiohttp's keep-alive timer starts when a connection opens and again after each
    response, and closes the connection if no whole request head arrived by then: so
    `idle_timeout_s` bounds both an idle connection and a slowly sent request head; the
    fast path (http/fastpath.py, on unless `fast_path` is False) keeps the same rule."""
    app = create_app(node, token=token, tokens=tokens, access_log=access_log, more_routes=more_routes)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, keepalive_timeout=idle_timeout_s)
    await runner.setup()
    # A fast-path request is a key's read or write or a transaction: done within the node's timeouts.
    in_flight_s = max(node.config.write_timeout_s, node.config.read_timeout_s) + 1.0
    fast = FastFront(app, handle, runner.server, idle_timeout_s, in_flight_s) if fast_path else None
    site = CappedSite(runner, host, port, max_connections=max_connections, handshake_timeout_s=idle_timeout_s, fast=fast, ssl_context=ssl_context, backlog=1024)
    await site.start()
    app[CONTEXT].refused = lambda: site.refused
    return runner
