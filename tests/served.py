"""The node's real HTTP listener (kv.http.app.serve) behind aiohttp's TestClient, with the
fast path on or off: tests written against TestClient then cover both fronts."""

from __future__ import annotations

from aiohttp.test_utils import BaseTestServer
from yarl import URL

from kv.bench.harness import free_port
from kv.http.app import serve

FRONTS = ("fast", "aiohttp")  # http/fastpath.py first, then aiohttp alone (--http-aiohttp-only)


class ServedNode(BaseTestServer):
    def __init__(self, node, front: str = "fast", **serve_options) -> None:
        super().__init__(scheme="http", host="127.0.0.1")
        self.node, self.front, self.serve_options = node, front, serve_options

    async def _make_runner(self, **kwargs):  # start_server below does not use it
        raise NotImplementedError

    async def start_server(self, loop=None, **kwargs) -> None:
        if self.runner:
            return
        self.port = free_port()
        self.runner = await serve(self.node, self.host, self.port, fast_path=self.front == "fast", **self.serve_options)
        self._root = URL(f"http://{self.host}:{self.port}")

    @property
    def app(self):
        return self.runner.app
