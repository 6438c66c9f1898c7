"""The loopback network: delivery in order, connection events, and each fault it offers."""

from __future__ import annotations

import asyncio

import pytest

from kv.raft.loopback import LoopbackNetwork
from kv.raft.messages import HeartbeatRequest


class Peer:
    """A started loopback transport that records what reaches it."""

    def __init__(self, net: LoopbackNetwork, node_id: str) -> None:
        self.t = net.transport(node_id, advertise_url=f"http://{node_id}")
        self.got: list = []
        self.connected: list[str] = []
        self.arrived = asyncio.Event()

    async def start(self, *peers: str) -> Peer:
        def on_message(msg):
            self.got.append(msg)
            self.arrived.set()

        await self.t.start(on_message, self.connected.append)
        self.t.set_peers({p: "" for p in peers})
        return self

    async def wait(self, count: int) -> None:
        while len(self.got) < count:
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), 5)


def hb(src: str, dst: str, i: int) -> HeartbeatRequest:
    return HeartbeatRequest(src, dst, 1, i, 0)


async def pair(net: LoopbackNetwork) -> tuple[Peer, Peer]:
    return await Peer(net, "a").start("b"), await Peer(net, "b").start("a")


async def test_messages_arrive_in_order_decoded_and_counted():
    a, b = await pair(LoopbackNetwork())
    try:
        assert all(a.t.send(hb("a", "b", i)) for i in range(50))
        await b.wait(50)
        assert [m.commit_index for m in b.got] == list(range(50))
        sent, received = a.t.counters(), b.t.counters()
        assert sent.frames_sent == 50 and sent.sent_bytes["b"] == received.received_bytes["a"] > 0
        assert a.t.peer_url("b") == "http://b"
    finally:
        await a.t.stop()
        await b.t.stop()


async def test_a_peer_that_starts_later_is_announced_and_a_stopped_one_is_unreachable():
    net = LoopbackNetwork()
    a = await Peer(net, "a").start("b")
    assert not a.t.send(hb("a", "b", 0))  # b is not up: dropped at once
    b = await Peer(net, "b").start("a")
    await asyncio.sleep(0)  # the connection events are called soon, not inside start
    assert a.connected == ["b"] and b.connected == ["a"]
    await b.t.stop()
    assert not a.t.send(hb("a", "b", 1))
    assert a.t.counters().frames_dropped == 2
    await a.t.stop()


async def test_cut_isolate_partition_and_heal():
    net = LoopbackNetwork()
    a, b = await pair(net)
    c = await Peer(net, "c").start("a", "b")
    a.t.set_peers({"b": "", "c": ""})
    try:
        net.cut("a", "b")
        assert not a.t.send(hb("a", "b", 0))
        assert b.t.send(hb("b", "a", 0))  # the other direction still works
        await a.wait(1)
        net.heal()
        net.partition(["a"], ["b", "c"])
        assert not a.t.send(hb("a", "c", 0)) and not c.t.send(hb("c", "a", 0))
        assert c.t.send(hb("c", "b", 0))
        await b.wait(1)
        net.heal()
        net.isolate("c")
        assert not c.t.send(hb("c", "a", 1)) and not b.t.send(hb("b", "c", 1))
        assert a.t.send(hb("a", "b", 1))
        await b.wait(2)
    finally:
        for p in (a, b, c):
            await p.t.stop()


async def test_a_cut_loses_the_messages_already_on_their_way():
    net = LoopbackNetwork(delay=0.2)
    a, b = await pair(net)
    try:
        assert a.t.send(hb("a", "b", 0))
        net.cut("a", "b")
        await asyncio.sleep(0.4)  # past the delay: the message would have arrived by now
        assert b.got == []
    finally:
        await a.t.stop()
        await b.t.stop()


async def test_delay_holds_each_message():
    a, b = await pair(LoopbackNetwork(delay=0.2))
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        a.t.send(hb("a", "b", 0))
        await b.wait(1)
        assert loop.time() - t0 >= 0.19
    finally:
        await a.t.stop()
        await b.t.stop()


@pytest.mark.parametrize("seed", [1, 2])
async def test_drop_rate_loses_about_that_fraction_repeatably(seed):
    counts = []
    for _ in range(2):
        net = LoopbackNetwork(drop_rate=0.3, seed=seed)
        a, b = await pair(net)
        try:
            for i in range(1000):
                assert a.t.send(hb("a", "b", i))  # lost in flight, not refused
            net.drop_rate = 0.0
            a.t.send(hb("a", "b", 1000))  # in order: once it is in, every other one is
            while not b.got or b.got[-1].commit_index != 1000:
                await b.wait(len(b.got) + 1)
            counts.append([m.commit_index for m in b.got[:-1]])
        finally:
            await a.t.stop()
            await b.t.stop()
    assert counts[0] == counts[1]  # the same seed loses the same messages
    assert 600 < len(counts[0]) < 800
