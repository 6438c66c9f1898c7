"""An in-process network: `Transport`s (see transport_protocol.py) for several nodes in one
event loop, with the faults a test needs.

    net = LoopbackNetwork(seed=7)
    node = kv.Node(config, transport=net.transport("n1"))    # or RaftNode(..., transport=)
    net.isolate("n1"); ...; net.heal()

A message is encoded and decoded as on the wire (its size is counted, nothing is shared
between nodes) and waits in its destination's asyncio queue, in order. Faults: `cut` one
direction of a link, `isolate` a node, `partition` the nodes into groups, `heal` them all;
`drop_rate` loses that fraction of the messages sent (seeded), `delay` holds each message
that many seconds. A message a cut reaches on its way is lost too. Peer addresses are not
used: nodes are known by id.
"""

from __future__ import annotations

import asyncio
import collections
import random
from collections.abc import Callable, Iterable

from . import codec
from .messages import Message
from .transport_protocol import TransportCounters


class LoopbackNetwork:
    def __init__(self, *, drop_rate: float = 0.0, delay: float = 0.0, seed: int | None = None) -> None:
        self.drop_rate = drop_rate
        self.delay = delay
        self._random = random.Random(seed)
        self._cut: set[tuple[str, str]] = set()  # (from, to) directions that lose everything
        self._ids: set[str] = set()  # every node a transport was made for
        self._up: dict[str, LoopbackTransport] = {}  # the started transports

    def transport(self, node_id: str, advertise_url: str = "") -> LoopbackTransport:
        """A transport for node_id (a new one for each start of that node)."""
        self._ids.add(node_id)
        return LoopbackTransport(self, node_id, advertise_url)

    def cut(self, src: str, dst: str) -> None:
        """Lose every message from src to dst (not the other way)."""
        self._cut.add((src, dst))

    def isolate(self, node_id: str) -> None:
        for other in self._ids - {node_id}:
            self._cut |= {(node_id, other), (other, node_id)}

    def partition(self, *groups: Iterable[str]) -> None:
        """Cut every link between nodes of different groups."""
        side = {nid: i for i, group in enumerate(groups) for nid in group}
        self._cut |= {(a, b) for a in side for b in side if side[a] != side[b]}

    def heal(self) -> None:
        self._cut.clear()

    def is_cut(self, src: str, dst: str) -> bool:
        return (src, dst) in self._cut

    def _lost(self) -> bool:
        return self.drop_rate > 0 and self._random.random() < self.drop_rate


class LoopbackTransport:
    def __init__(self, net: LoopbackNetwork, node_id: str, advertise_url: str) -> None:
        self._net, self.node_id, self.advertise_url = net, node_id, advertise_url
        self.level = 0
        self._peers: set[str] = set()
        self._queue: asyncio.Queue[tuple[float, str, bytes]] = asyncio.Queue()
        self._pump: asyncio.Task | None = None
        self._on_message: Callable[[Message], None] = lambda msg: None
        self._on_connected: Callable[[str], None] = lambda peer: None
        self.on_removed: Callable[[str], None] = lambda peer: None  # never called here
        self._sent_bytes: collections.Counter[str] = collections.Counter()
        self._received_bytes: collections.Counter[str] = collections.Counter()
        self._frames_sent = self._frames_dropped = 0

    async def start(self, on_message: Callable[[Message], None], on_connected: Callable[[str], None]) -> None:
        self._on_message, self._on_connected = on_message, on_connected
        self._pump = asyncio.get_running_loop().create_task(self._deliver(), name=f"loopback-{self.node_id}")
        self._net._up[self.node_id] = self
        for other in self._net._up.values():
            if self.node_id in other._peers:
                other._link_up(self.node_id)

    async def stop(self) -> None:
        if self._net._up.get(self.node_id) is self:
            del self._net._up[self.node_id]
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
            self._pump = None

    def refuse_removed(self) -> None:
        pass  # a loopback network has no handshake to tell a removed member so

    def set_peers(self, peers: dict[str, str | tuple[str, ...]]) -> None:
        new = set(peers) - {self.node_id}
        added, self._peers = new - self._peers, new
        for peer in added:
            if peer in self._net._up:
                self._link_up(peer)

    def _link_up(self, peer: str) -> None:
        if self._pump is not None:
            asyncio.get_running_loop().call_soon(self._on_connected, peer)

    def send(self, msg: Message) -> bool:
        dst = self._net._up.get(msg.dst)
        if self._pump is None or dst is None or msg.dst not in self._peers or self._net.is_cut(self.node_id, msg.dst):
            self._frames_dropped += 1
            return False
        frame = codec.encode(msg)
        self._frames_sent += 1
        self._sent_bytes[msg.dst] += len(frame)
        if not self._net._lost():
            dst._queue.put_nowait((asyncio.get_running_loop().time() + self._net.delay, self.node_id, frame))
        return True

    async def _deliver(self) -> None:
        loop, header = asyncio.get_running_loop(), codec.FRAME_HEADER
        while True:
            at, src, frame = await self._queue.get()
            if at > loop.time():
                await asyncio.sleep(at - loop.time())  # the network's delay
            if self._net.is_cut(src, self.node_id):
                continue
            self._received_bytes[src] += len(frame)
            _, ftype = header.unpack_from(frame)
            self._on_message(codec.decode(ftype, memoryview(frame)[header.size :]))

    def peer_url(self, peer: str) -> str:
        other = self._net._up.get(peer)
        return other.advertise_url if other is not None else ""

    def peer_level(self, peer: str) -> int:
        other = self._net._up.get(peer)
        return other.level if other is not None else 0

    def counters(self) -> TransportCounters:
        return TransportCounters(dict(self._sent_bytes), dict(self._received_bytes), self._frames_sent, self._frames_dropped, 0)
