"""What every handler needs, stored on the application under a typed key."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from kv import Node, Unavailable
from kv.server.samples import Sample, counter, gauge

from .auth import Grant
from .cors import Cors, LocalNames


@dataclass
class HttpContext:
    node: Node
    grants: dict[str, Grant] = field(default_factory=dict)  # token -> grant; empty: no auth
    max_json_bytes: int = 4 << 20
    access_log: bool = False  # log one line per request (kv serve --access-log)
    metrics_public: bool = False  # /metrics without the token (kv serve --metrics-public)
    cors: Cors = field(default_factory=lambda: Cors(""))  # the web pages whose scripts may call (kv serve --cors)
    local_names: LocalNames = field(default_factory=LocalNames)  # the Host a request from this machine may name
    session: aiohttp.ClientSession | None = None  # pooled connections to the leader
    watch_streams: set = field(default_factory=set)  # the open watch streams (GET /v1/watch's watches, the etcd gateway's): closed as the server stops
    unread: int = 0  # bytes of answers queued for clients not reading them (http/fastpath.py counts them)
    refused: Callable[[], int] = lambda: 0  # connections refused beyond --max-http-connections (the listener's count)

    def samples(self) -> tuple[Sample, ...]:
        return (
            counter("kv_http_connections_refused", "Client connections answered 503 beyond --max-http-connections.", self.refused()),
            gauge("kv_http_unread_bytes", "Bytes of answers queued for clients that are not reading them (--http-unread-bytes).", self.unread),
        )

    def room_for(self, answer_bytes: int) -> None:
        """Refuse (503) a large answer when clients that do not read already hold what the
        node allows (--http-unread-bytes): it would pin as much again."""
        if answer_bytes > LARGE_ANSWER and self.unread + answer_bytes > self.node.config.http_unread_bytes:
            raise Unavailable(
                f"this node holds {self.unread >> 20} MiB of answers its clients have not read (--http-unread-bytes); "
                "retry shortly, or on another node"
            )


LARGE_ANSWER = 64 << 10  # an answer this large needs room in the node's unread budget
CONTEXT = web.AppKey("context", HttpContext)


def ctx(request: web.Request) -> HttpContext:
    return request.app[CONTEXT]
