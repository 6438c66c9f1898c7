"""What every handler needs, stored on the application under a typed key."""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from kv import Node
from kv.metrics import Counter, Registry


@dataclass
class HttpContext:
    node: Node
    token: str | None = None
    max_json_bytes: int = 4 << 20
    registry: Registry = field(default_factory=Registry)
    requests: Counter | None = None
    session: aiohttp.ClientSession | None = None  # pooled connections to the leader
    watch_streams: set = field(default_factory=set)  # the open GET /v1/watch streams' watches


CONTEXT = web.AppKey("context", HttpContext)


def ctx(request: web.Request) -> HttpContext:
    return request.app[CONTEXT]
