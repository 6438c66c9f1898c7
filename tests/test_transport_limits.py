"""Peer transport: what strangers may cost (frame size before authentication, handshaking
and total connections) and mutual TLS between peers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import struct

import pytest
from pki import make_pki
from kv.bench.harness import free_port
from test_transport import wait_for

from kv.raft.messages import HeartbeatRequest
from kv.raft.transport import HELLO, PREAUTH_MAX_FRAME, TcpTransport, hello_frame
from kv.server.tls import peer_tls


async def _transport(node_id: str, addr: str, got: list, **kw) -> TcpTransport:
    """A started transport of node_id that collects what it receives in got."""
    t = TcpTransport(node_id, "g", addr, removed=lambda p, ledger: None if p in ("a", "b") else "removed", **kw)
    await t.start(got.append, lambda peer: None)
    return t


async def _hangs_up(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), 6) == b""
    except ConnectionResetError:
        return True


async def test_a_huge_hello_is_refused_at_its_length_prefix():
    addr = f"127.0.0.1:{free_port()}"
    t = await _transport("b", addr, [])
    try:
        host, port = addr.split(":")
        r, w = await asyncio.open_connection(host, int(port))
        w.write(struct.pack(">IB", 64 << 20, HELLO))  # announces 64 MiB, sends none of it
        await w.drain()
        assert await _hangs_up(r)
        w.close()
        # One byte over the cap is refused too; the cap is far above a real HELLO.
        r, w = await asyncio.open_connection(host, int(port))
        w.write(struct.pack(">IB", PREAUTH_MAX_FRAME + 1, HELLO))
        await w.drain()
        assert await _hangs_up(r)
        w.close()
        assert t.rejected_connections == 2
    finally:
        await t.stop()


async def test_handshaking_strangers_are_limited_and_evicted_oldest_first():
    addrs = {"a": f"127.0.0.1:{free_port()}", "b": f"127.0.0.1:{free_port()}"}
    got: dict[str, list] = {"a": [], "b": []}
    b = await _transport("b", addrs["b"], got["b"], max_unauthenticated=8)
    a = await _transport("a", addrs["a"], got["a"])
    strangers = []
    try:
        host, port = addrs["b"].split(":")
        for _ in range(20):  # they connect and say nothing
            strangers.append(await asyncio.open_connection(host, int(port)))
        await wait_for(lambda: b.handshaking == 8)
        closed = 0
        for r, _w in strangers[:12]:  # the 12 oldest made room for the newer ones
            closed += await _hangs_up(r)
        assert closed == 12
        # A real peer still gets in while strangers hold every handshaking slot.
        a.set_peers(addrs)
        await wait_for(lambda: a.connected("b"))
        assert a.send(HeartbeatRequest("a", "b", 1, 0, 0))
        await wait_for(lambda: len(got["b"]) == 1)
    finally:
        for _r, w in strangers:
            w.close()
        await a.stop()
        await b.stop()


async def test_total_inbound_connections_are_capped():
    addr = f"127.0.0.1:{free_port()}"
    t = await _transport("b", addr, [], max_connections=4)
    conns = []
    try:
        host, port = addr.split(":")
        for _ in range(6):
            conns.append(await asyncio.open_connection(host, int(port)))
        assert await _hangs_up(conns[4][0]) and await _hangs_up(conns[5][0])
        assert t.inbound_connections == 4
    finally:
        for _r, w in conns:
            w.close()
        await t.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"), ["a", "b"], foreign=["mallory"])


@contextlib.asynccontextmanager
async def tls_pair(pki, cert_a: str):
    """Transports a (with the certificate `cert_a`) and b over peer TLS, dialling each other."""
    addrs = {"a": f"127.0.0.1:{free_port()}", "b": f"127.0.0.1:{free_port()}"}
    got: dict[str, list] = {"a": [], "b": []}
    a = await _transport("a", addrs["a"], got["a"], ssl=peer_tls(*pki[cert_a], pki["ca"]))
    b = await _transport("b", addrs["b"], got["b"], ssl=peer_tls(*pki["b"], pki["ca"]))
    try:
        a.set_peers(addrs)
        b.set_peers(addrs)
        yield a, b, got, addrs
    finally:
        await a.stop()
        await b.stop()


async def test_peers_talk_over_mutual_tls_and_refuse_other_certificates(pki):
    async with tls_pair(pki, "a") as (a, b, got, addrs):
        await wait_for(lambda: a.connected("b") and b.connected("a"))
        assert a.send(HeartbeatRequest("a", "b", 1, 0, 0))
        await wait_for(lambda: len(got["b"]) == 1)
        host, port = addrs["b"].split(":")
        # A client certificate from another CA, and none at all: a HELLO that b would
        # welcome over a trusted connection gets no WELCOME.
        hello = hello_frame(b"g", b"a", b"b", b"", os.urandom(16))
        for cert in (pki["mallory"], None):
            ctx = ssl.create_default_context(cafile=pki["ca"])
            ctx.check_hostname = False
            if cert:
                ctx.load_cert_chain(*cert)
            with pytest.raises((ssl.SSLError, ConnectionError)):
                r, w = await asyncio.open_connection(host, int(port), ssl=ctx)
                w.write(hello)
                await w.drain()
                if await r.read() == b"":  # TLS 1.3: the refusal arrives after the handshake
                    raise ConnectionError("closed")
        # Plain TCP to a TLS port gets nowhere either.
        r, w = await asyncio.open_connection(host, int(port))
        w.write(b"\x00\x00\x00\x0a\x64" + b"x" * 9)
        await w.drain()
        assert await _hangs_up(r)
        w.close()
        assert len(got["b"]) == 1


async def test_a_peer_whose_certificate_another_ca_signed_cannot_join(pki):
    async with tls_pair(pki, "mallory") as (a, b, _got, _addrs):
        await asyncio.sleep(1.0)  # time to dial and be refused
        assert not a.connected("b") and not b.connected("a")
        assert not a.send(HeartbeatRequest("a", "b", 1, 0, 0))
