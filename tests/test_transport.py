"""Peer transport: handshake, authentication, identity rules, and garbage on the port."""

from __future__ import annotations

import asyncio
import logging
import contextlib
import os

import pytest
from kv.bench.harness import free_port, poll

from kv.raft import codec
from kv.raft.messages import HeartbeatRequest, VoteRequest
from kv.raft.transport import WELCOME, TcpTransport, auth_frame, hello_frame


async def wait_for(cond, timeout=5.0):
    await poll(cond, timeout=timeout, interval=0.01, error="condition not met in time")


def members(ids):
    """A transport's `removed` hook for a cluster of these ids."""
    return lambda peer, ledger: None if peer in ids else f"{peer!r} was removed from this cluster"


class Pair:
    """Two transports, a and b, that know each other."""

    def __init__(self, secret_a=None, secret_b=None, group_b="g", members_b=("a", "b")):
        self.addr = {"a": f"127.0.0.1:{free_port()}", "b": f"127.0.0.1:{free_port()}"}
        self.got = {"a": [], "b": []}
        self.a = TcpTransport("a", "g", self.addr["a"], removed=members(("a", "b")), secret=secret_a, advertise_url="http://a")
        self.b = TcpTransport("b", group_b, self.addr["b"], removed=members(members_b), secret=secret_b)

    async def __aenter__(self):
        await self.a.start(self.got["a"].append, lambda peer: None)
        await self.b.start(self.got["b"].append, lambda peer: None)
        self.a.set_peers(self.addr)
        self.b.set_peers(self.addr)
        return self

    async def __aexit__(self, *exc):
        await self.a.stop()
        await self.b.stop()


async def test_messages_flow_both_ways_and_urls_are_announced():
    async with Pair() as p:
        await wait_for(lambda: p.a.connected("b") and p.b.connected("a"))
        for i in range(100):
            assert p.a.send(HeartbeatRequest("a", "b", 1, i, 0))
        p.b.send(VoteRequest("b", "a", 2, 0, 0))
        await wait_for(lambda: len(p.got["b"]) == 100 and len(p.got["a"]) == 1)
        assert [m.commit_index for m in p.got["b"]] == list(range(100))  # in order
        assert p.b.peer_url("a") == "http://a"


@pytest.mark.parametrize("secret_a, secret_b", [("wrong", "right"), (None, "right"), ("right", None)])
async def test_cluster_secret_keeps_out_who_does_not_know_it(secret_a, secret_b):
    async with Pair(secret_a=secret_a, secret_b=secret_b) as p:
        await asyncio.sleep(0.5)  # time to dial and handshake, which must not succeed
        assert not p.a.connected("b") and not p.b.connected("a")
        assert not p.a.send(HeartbeatRequest("a", "b", 1, 0, 0))
        assert not p.b.send(HeartbeatRequest("b", "a", 1, 0, 0))
        await asyncio.sleep(0.1)  # time for anything that was sent after all to arrive
        assert p.got["b"] == [] and p.got["a"] == []


async def test_matching_secrets_connect():
    async with Pair(secret_a="same", secret_b="same") as p:
        await wait_for(lambda: p.a.connected("b"))
        p.a.send(HeartbeatRequest("a", "b", 1, 0, 0))
        await wait_for(lambda: len(p.got["b"]) == 1)


async def test_other_group_and_unknown_member_are_refused():
    async with Pair(group_b="other") as p:
        await asyncio.sleep(0.4)  # time to dial and be refused
        assert not p.a.connected("b") and p.b.rejected_connections > 0
    async with Pair(members_b=("b",)) as p:  # b does not count a as a member
        await asyncio.sleep(0.4)  # time to dial and be refused
        assert not p.a.connected("b")


async def test_garbage_closes_only_that_connection():
    async with Pair() as p:
        await wait_for(lambda: p.a.connected("b"))
        host, port = p.addr["b"].split(":")
        for junk in (os.urandom(64), b"\xff\xff\xff\xff\x05" + b"x" * 10, b"GET / HTTP/1.1\r\n\r\n"):
            r, w = await asyncio.open_connection(host, int(port))
            w.write(junk)
            await w.drain()
            said = await asyncio.wait_for(r.read(), 6)  # the node hangs up on it
            if junk.startswith(b"GET "):  # an HTTP client given the peer port is told so first
                assert said.startswith(b"HTTP/1.1 400 Bad Request\r\n") and b"this is node b's peer port" in said, said
            else:
                assert said == b""
            w.close()
        # A forged message from an authenticated peer id must match the link it came on.
        p.a.send(HeartbeatRequest("a", "b", 1, 7, 0))
        await wait_for(lambda: len(p.got["b"]) == 1)
        assert p.a.connected("b")
        assert p.b.rejected_connections >= 3


async def test_a_frame_from_another_src_closes_the_link():
    async with Pair() as p:
        await wait_for(lambda: p.a.connected("b"))
        # A link authenticated as a (there is no secret) that carries mallory's message.
        host, port = p.addr["b"].split(":")
        r, w = await asyncio.open_connection(host, int(port))
        w.write(hello_frame(b"g", b"a", b"b", b"", os.urandom(16)))
        length, ftype = codec.FRAME_HEADER.unpack(await asyncio.wait_for(r.readexactly(codec.FRAME_HEADER.size), 5))
        assert ftype == WELCOME
        await r.readexactly(length - 1)
        w.write(auth_frame(b"") + codec.encode(HeartbeatRequest("mallory", "b", 1, 0, 0)))
        assert await asyncio.wait_for(r.read(), 5) == b""  # b hangs up on it
        w.close()
        assert p.b.rejected_connections == 1 and p.got["b"] == []
        p.a.send(HeartbeatRequest("a", "b", 1, 1, 0))  # a's own link is untouched
        await wait_for(lambda: len(p.got["b"]) == 1)


async def test_a_second_node_dialling_as_a_member_does_not_take_its_client_url(caplog):
    """A stray started with a member's id (a mistyped --data-dir) beside the member: the
    member's client URL, where requests are forwarded (a leader's with the client's token),
    holds while the member is connected; once the stray's connection closes, the member's
    is the URL. The stray's had been taken for good (found by a newcomer run)."""
    addr = {"a": f"127.0.0.1:{free_port()}", "b": f"127.0.0.1:{free_port()}"}
    b = TcpTransport("b", "g", addr["b"], removed=lambda p, led: None)
    await b.start(lambda m: None, lambda peer: None)

    @contextlib.asynccontextmanager
    async def dialer(ledger: str, url: str):
        a = TcpTransport("a", "g", f"127.0.0.1:{free_port()}", removed=members(("b",)), ledger_id=ledger, advertise_url=url)
        await a.start(lambda m: None, lambda peer: None)
        a.set_peers(addr)
        try:
            await wait_for(lambda: a.connected("b"))
            yield a
        finally:
            await a.stop()

    try:
        async with dialer("11" * 8, "http://member"):
            await wait_for(lambda: b.peer_url("a") == "http://member")
            with caplog.at_level(logging.WARNING, logger="kv.raft.transport"):
                async with dialer("22" * 8, "http://stray"):
                    await wait_for(lambda: "a second node dials as 'a'" in caplog.text)
                    assert b.peer_url("a") == "http://member"
                    await asyncio.sleep(0.2)
            assert b.peer_url("a") == "http://member"
            async with dialer("22" * 8, "http://stray"):
                async with dialer("11" * 8, "http://member"):  # the member dials again before its first connection closes
                    await wait_for(lambda: b.inbound_connections == 3)
                await wait_for(lambda: b.inbound_connections == 2)
                assert b.peer_url("a") == "http://member"  # (its other connection is open)
        async with dialer("22" * 8, "http://stray"):  # the member is down: the URL there is
            await wait_for(lambda: b.peer_url("a") == "http://stray")
            async with dialer("11" * 8, "http://member"):
                await asyncio.sleep(0.2)
                assert b.peer_url("a") == "http://stray"  # (the first connected holds; the log says so)
            async with dialer("22" * 8, "http://stray-moved"):  # the same data dir, announcing anew
                await wait_for(lambda: b.peer_url("a") == "http://stray-moved")
    finally:
        await b.stop()


async def test_a_member_known_by_another_ledger_is_refused_as_removed():
    """The dialer says its ledger in the handshake, and the acceptor asks `removed` about
    it: a member joined again from an empty data dir is known by its new ledger, and its
    old data dir, dialling as that id, is told it was removed (so it stops), also over a
    link it had before."""
    addr = {"a": f"127.0.0.1:{free_port()}", "b": f"127.0.0.1:{free_port()}"}
    known = {"a": "11" * 8}  # the ledger b's membership knows a by
    asked = []
    b = TcpTransport("b", "g", addr["b"], removed=lambda p, led: asked.append(led) or (None if led == known[p] else "another data dir"))
    got = []
    await b.start(got.append, lambda peer: None)

    @contextlib.asynccontextmanager
    async def dialer(ledger: str):
        a = TcpTransport("a", "g", addr["a"], removed=members(("b",)), ledger_id=ledger)
        a.removed_by = []
        a.on_removed = a.removed_by.append
        await a.start(lambda m: None, lambda peer: None)
        a.set_peers(addr)
        try:
            yield a
        finally:
            await a.stop()

    try:
        async with dialer("11" * 8) as a:  # the data dir that joined
            await wait_for(lambda: a.connected("b"))
            a.send(HeartbeatRequest("a", "b", 1, 0, 0))
            await wait_for(lambda: len(got) == 1)
            known["a"] = "33" * 8  # it is removed, and joins again from another one
            b.refuse_removed()
            await wait_for(lambda: a.removed_by)
            assert set(a.removed_by) == {"b"} and not a.connected("b")
            assert not a.send(HeartbeatRequest("a", "b", 1, 1, 0))
        async with dialer("22" * 8) as a:  # another data dir
            await wait_for(lambda: a.removed_by)
            assert set(a.removed_by) == {"b"} and not a.connected("b")
            assert not a.send(HeartbeatRequest("a", "b", 1, 2, 0))
        await asyncio.sleep(0.1)
        assert got == [HeartbeatRequest("a", "b", 1, 0, 0)]  # nothing from the refused ones arrived
        assert asked[0] == "11" * 8 and "22" * 8 in asked
    finally:
        await b.stop()


async def test_a_node_of_another_cluster_is_not_connected_and_the_dialer_says_why(caplog):
    """The acceptor says its cluster's id in WELCOME: a dialer of another cluster (a node
    restored from a backup given the old cluster's --peers) hangs up before AUTH, logs why
    once, and no message passes. A side without an id yet (a new cluster before its first
    leader chose one, an earlier version) connects as before. The acceptor says the level
    of commands it applies there too."""
    addr = {"a": f"127.0.0.1:{free_port()}", "b": f"127.0.0.1:{free_port()}"}
    ids = {"a": "aa" * 8, "b": "bb" * 8}
    got = []
    b = TcpTransport("b", "g", addr["b"], removed=members(("a",)), cluster_id=lambda: ids["b"])
    a = TcpTransport("a", "g", addr["a"], removed=members(("b",)), cluster_id=lambda: ids["a"])
    b.level = 7  # what it says it applies (kv's COMMAND_LEVEL)
    await b.start(got.append, lambda peer: None)
    await a.start(lambda m: None, lambda peer: None)
    try:
        with caplog.at_level(logging.WARNING, logger="kv.raft.transport"):
            a.set_peers(addr)
            await wait_for(lambda: "belongs to another cluster" in caplog.text)
            await asyncio.sleep(1.5)  # (it dials again meanwhile)
        line = next(r.getMessage() for r in caplog.records if "another cluster" in r.getMessage())
        assert line.startswith(f"b at {addr['b']} belongs to another cluster (id {ids['b']}, this one's {ids['a']})") and "--peers" in line
        assert sum("another cluster" in r.getMessage() for r in caplog.records) == 1  # once, not at every retry
        assert not a.connected("b") and not a.send(HeartbeatRequest("a", "b", 1, 0, 0)) and b.peer_url("a") == ""
        assert a.peer_level("b") == 0  # (not known: never connected)
        ids["a"] = ""  # no id yet: let in
        await wait_for(lambda: a.connected("b"))
        assert a.peer_level("b") == 7 and b.peer_level("a") == 0  # (b never dialled a)
        assert a.send(HeartbeatRequest("a", "b", 1, 0, 0))
        await wait_for(lambda: len(got) == 1)
    finally:
        await a.stop()
        await b.stop()


async def test_a_peer_address_that_reaches_another_node_is_named_and_the_next_one_tried(caplog):
    """A slip in --peers: c dials b at a's address. a says who it is before it hangs up, c
    logs it once ("check its address in --peers"; it used to log at every retry that b
    'closed the connection during the handshake ... see its log', and only a's log said
    why), and tries b's other address (the membership's), where b answers."""
    addr = {i: f"127.0.0.1:{free_port()}" for i in "abc"}
    got = []
    a = TcpTransport("a", "g", addr["a"], removed=members(("b", "c")))
    b = TcpTransport("b", "g", addr["b"], removed=members(("a", "c")))
    c = TcpTransport("c", "g", addr["c"], removed=members(("a", "b")))
    await a.start(lambda m: None, lambda peer: None)
    await b.start(got.append, lambda peer: None)
    await c.start(lambda m: None, lambda peer: None)
    try:
        with caplog.at_level(logging.WARNING, logger="kv.raft.transport"):
            c.set_peers({"b": (addr["a"], addr["b"])})
            await wait_for(lambda: c.connected("b"))
            assert c.send(HeartbeatRequest("c", "b", 1, 0, 0))
            await wait_for(lambda: len(got) == 1)
        said = [r.getMessage() for r in caplog.records if r.name == "kv.raft.transport" and "answered" in r.getMessage()]
        assert said == [f"b at {addr['a']} answered \"this is node 'a', not 'b'\": check its address in --peers"]
    finally:
        for t in (a, b, c):
            await t.stop()


async def test_an_acceptor_of_an_earlier_version_says_nothing_after_the_nonce_and_is_connected():
    """An earlier version's WELCOME has the 16-byte nonce alone: a dialer with a cluster id
    connects (no id to compare), and takes the peer for one that applies no command level."""
    addr = {"a": f"127.0.0.1:{free_port()}", "b": f"127.0.0.1:{free_port()}"}
    b = TcpTransport("b", "g", addr["b"], removed=members(("a",)))
    b.about = lambda: b""  # what an earlier version sends
    a = TcpTransport("a", "g", addr["a"], removed=members(("b",)), cluster_id=lambda: "aa" * 8)
    await b.start(lambda m: None, lambda peer: None)
    await a.start(lambda m: None, lambda peer: None)
    try:
        a.set_peers(addr)
        await wait_for(lambda: a.connected("b"))
        assert a.peer_level("b") == 0
    finally:
        await a.stop()
        await b.stop()
