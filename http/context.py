"""What every handler needs, stored on the application under a typed key."""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from kv import Node

from .auth import Grant


@dataclass
class HttpContext:
    node: Node
    grants: dict[str, Grant] = field(default_factory=dict)  # token -> grant; empty: no auth
    max_json_bytes: int = 4 << 20
    access_log: bool = False  # log one line per request (kv serve --access-log)
    metrics_public: bool = False  # /metrics without the token (kv serve --metrics-public)
    session: aiohttp.ClientSession | None = None  # pooled connections to the leader
    watch_streams: set = field(default_factory=set)  # the open GET /v1/watch streams' watches


CONTEXT = web.AppKey("context", HttpContext)


def ctx(request: web.Request) -> HttpContext:
    return request.app[CONTEXT]
