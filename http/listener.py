"""The HTTP listening socket, with a cap on open connections.

aiohttp's own sites accept every connection; a client that opens thousands of idle ones
would use up the node's file descriptors. CappedSite answers a connection beyond the cap
with a 503 and closes it, before aiohttp parses anything, so a connection flood costs
one short-lived descriptor per attempt and the node keeps answering the connections it has.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from .errors import error_response
from .fastpath import FastFront, FastProtocol

log = logging.getLogger("kv.http")

TOO_MANY = "this node has as many client connections open as it allows (--max-http-connections); retry later or reuse a connection"


class _Busy(asyncio.Protocol):
    """A connection beyond the cap: 503, then closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(error_response(503, "TOO_MANY_CONNECTIONS", TOO_MANY).encode(keep_alive=False))
        transport.close()


class CappedSite(web.BaseSite):
    """A TCP site that lets at most `max_connections` client connections be open."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, max_connections: int, handshake_timeout_s: float, fast: FastFront | None = None, **kwargs) -> None:
        super().__init__(runner, **kwargs)
        self.fast = fast  # serves the hot routes on its own connections (http/fastpath.py)
        self._host, self._port = host, port
        self.max_connections = max_connections
        self.handshake_timeout_s = handshake_timeout_s  # TLS handshakes are not counted yet: keep them short
        self.refused = 0
        self._last_warning = 0.0

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host}:{self._port}"

    def _protocol(self) -> asyncio.Protocol:
        server = self._runner.server
        fast = self.fast
        if len(server.connections) + (len(fast.connections) if fast else 0) < self.max_connections:
            return FastProtocol(fast) if fast else server()
        self.refused += 1
        now = time.monotonic()
        if now - self._last_warning >= 10.0:
            log.warning("%d client connections are open (--max-http-connections): refusing new ones with 503 (%d so far)", self.max_connections, self.refused)
            self._last_warning = now
        return _Busy()

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        tls = {"ssl": self._ssl_context, "ssl_handshake_timeout": self.handshake_timeout_s} if self._ssl_context else {}
        self._server = await loop.create_server(self._protocol, self._host, self._port, backlog=self._backlog, reuse_address=True, **tls)
        if self.fast:
            self.fast.start()

    async def stop(self) -> None:
        await super().stop()  # no new connections
        if self.fast:
            await self.fast.stop()
