"""The aiohttp application of a node: routes, error model, auth, metrics; and serve()."""

from __future__ import annotations

import hmac
import logging
import ssl
import time

import aiohttp
from aiohttp import web

from kv import Node, Unauthorized
from kv.metrics import request_forwarded

from . import routes_admin, routes_kv, routes_leases, routes_members
from .context import CONTEXT, HttpContext
from .errors import error_response, run_handler

log = logging.getLogger("kv.http")
access = logging.getLogger("kv.access")

# Answered without a token: probes cannot send one, and these reveal nothing.
OPEN_PATHS = frozenset({"/healthz", "/readyz"})


def _needs_token(c: HttpContext, path: str) -> bool:
    return bool(c.token) and path not in OPEN_PATHS and not (c.metrics_public and path == "/metrics")


@web.middleware
async def middleware(request: web.Request, handler):
    """One layer for every request: the token check, the error model, the latency
    histogram and the access log (one middleware instead of four: this runs on every
    request)."""
    c = request.app[CONTEXT]
    t0 = time.perf_counter()
    request_forwarded.set(False)  # requests of one keep-alive connection share a task
    given = request.headers.get("Authorization", "")
    if _needs_token(c, request.path) and not hmac.compare_digest(given.encode(), f"Bearer {c.token}".encode()):
        e = Unauthorized("missing or wrong token: send Authorization: Bearer <token> (the node's --token)")
        resp = error_response(e.http_status, e.code, str(e))
    else:
        resp = await run_handler(request, handler)
    elapsed = time.perf_counter() - t0
    route = request.match_info.route.name or "unmatched"
    c.node.metrics.observe_http(route, resp.status, elapsed)
    if c.access_log:
        _log_access(request, route, resp.status, elapsed)
    return resp


def _log_access(request: web.Request, route: str, status: int, elapsed: float) -> None:
    forwarded = request_forwarded.get()
    ms = round(elapsed * 1000, 3)
    fields = {"method": request.method, "path": request.path, "route": route, "status": status, "duration_ms": ms, "forwarded": forwarded, "remote": request.remote}
    access.info(
        "%s %s route=%s status=%d duration_ms=%.3f forwarded=%s remote=%s",
        request.method, request.path, route, status, ms, "yes" if forwarded else "no", request.remote,
        extra={"http": fields},
    )


def create_app(node: Node, *, token: str | None = None, access_log: bool = False) -> web.Application:
    c = HttpContext(node=node, token=token, access_log=access_log, metrics_public=node.config.metrics_public)
    app = web.Application(
        middlewares=[middleware],
        client_max_size=node.config.max_value_bytes + (1 << 20),
    )
    app[CONTEXT] = c
    node.metrics  # noqa: B018  (made now, so that it counts from the first request on)
    routes_kv.add_routes(app)
    routes_admin.add_routes(app)
    routes_members.add_routes(app)
    routes_leases.add_routes(app)

    async def session_ctx(app: web.Application):
        c.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        yield
        await c.session.close()

    app.cleanup_ctx.append(session_ctx)
    return app


async def serve(
    node: Node, host: str, port: int, *, token: str | None = None, ssl_context: ssl.SSLContext | None = None, access_log: bool = False
) -> web.AppRunner:
    """Start the HTTP API of `node`; returns the runner (await runner.cleanup() to stop)."""
    runner = web.AppRunner(create_app(node, token=token, access_log=access_log), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context, reuse_address=True, backlog=1024)
    await site.start()
    return runner
