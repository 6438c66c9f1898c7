"""User-space TCP proxies for peer links, controlled by the test (no root needed).

A LinkProxy carries one direction of peer traffic, i -> j (node i dials j through it). It
understands ledgerkv's frames (u32 length + type), so besides cutting and delaying the link
it can drop whole message frames while keeping the connection and handshake intact.
Every proxy runs on one background event-loop thread shared by the test.
"""

from __future__ import annotations

import asyncio
import random
import struct
import threading

HANDSHAKE_TYPES = (100, 101, 102)


class ProxyLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="netproxy")
        self.thread.start()

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def run(self, fn, *args):
        async def wrap():
            return fn(*args)

        return self.call(wrap())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class LinkProxy:
    def __init__(self, ploop: ProxyLoop, listen_port: int, target: str, seed: int = 0) -> None:
        self.ploop = ploop
        self.listen_port = listen_port
        self.target = target
        self.mode = "pass"  # pass | cut | hold
        self.delay_ms = 0.0
        self.drop_rate = 0.0
        self.rng = random.Random(seed)
        self.frames = 0
        self.dropped = 0
        self._conns: set[asyncio.StreamWriter] = set()
        self._server = None
        self._released = asyncio.Event()
        ploop.call(self._start())

    async def _start(self) -> None:
        self._released = asyncio.Event()
        self._released.set()
        self._server = await asyncio.start_server(self._on_client, "127.0.0.1", self.listen_port, reuse_address=True)

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "cut":
            writer.close()
            return
        host, port = self.target.rsplit(":", 1)
        try:
            up_r, up_w = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        self._conns |= {writer, up_w}
        down = asyncio.ensure_future(self._pump_raw(up_r, writer))
        try:
            await self._pump_frames(reader, up_w)
        finally:
            down.cancel()
            for w in (writer, up_w):
                self._conns.discard(w)
                w.close()

    async def _pump_raw(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        """The reverse direction carries only the handshake's WELCOME: pass it through."""
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            w.close()

    async def _pump_frames(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await r.readexactly(5)
                length, ftype = struct.unpack(">IB", head)
                body = await r.readexactly(length - 1)
                await self._released.wait()
                if self.mode == "cut":
                    return
                if self.delay_ms:
                    await asyncio.sleep(self.delay_ms / 1000.0)  # the link's latency
                self.frames += 1
                if ftype not in HANDSHAKE_TYPES and self.drop_rate and self.rng.random() < self.drop_rate:
                    self.dropped += 1
                    continue
                w.write(head + body)
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return

    # -- control (from the test thread) ----------------------------------------------------

    def cut(self) -> None:
        """Close the link and refuse new connections until heal()."""

        def do():
            self.mode = "cut"
            self._released.set()
            for w in list(self._conns):
                w.close()

        self.ploop.run(do)

    def hold(self) -> None:
        """Keep the connection but forward nothing until heal() (a stalled network)."""

        def do():
            self.mode = "hold"
            self._released.clear()

        self.ploop.run(do)

    def heal(self) -> None:
        def do():
            self.mode = "pass"
            self.delay_ms = 0.0
            self.drop_rate = 0.0
            self._released.set()

        self.ploop.run(do)

    def set(self, *, delay_ms: float | None = None, drop_rate: float | None = None) -> None:
        def do():
            if delay_ms is not None:
                self.delay_ms = delay_ms
            if drop_rate is not None:
                self.drop_rate = drop_rate

        self.ploop.run(do)

    def close(self) -> None:
        async def do():
            self._server.close()
            for w in list(self._conns):
                w.close()

        self.ploop.call(do())
