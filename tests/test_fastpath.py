"""The fast HTTP path (http/fastpath.py) against aiohttp, over raw sockets.

test_http.py runs the API's tests over both fronts; here: the bytes on the wire are the
same, a connection moves to aiohttp mid-stream without losing its order, what the fast path
does not take is answered as aiohttp answers it, idle connections are closed, and the
connection cap counts the fast path's connections."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from kv import Node, NodeConfig
from served import ServedNode

TOKEN = "s3cret"
AUTH = f"Authorization: Bearer {TOKEN}\r\n"


@contextlib.asynccontextmanager
async def served(tmp_path, name: str, fast_path: bool, max_value_bytes: int = 1000, **options):
    """A single-node store behind its real listener: yields (node, port, runner)."""
    node = Node(NodeConfig(id="n1", data_dir=str(tmp_path / name), max_value_bytes=max_value_bytes))
    await node.start()
    server = ServedNode(node, "fast" if fast_path else "aiohttp", token=TOKEN, **options)
    try:
        await node.wait_leader(timeout=10)
        await server.start_server()
        yield node, server.port, server.runner
    finally:
        if server.runner is not None:
            await server.runner.cleanup()
        await node.stop()


async def read_response(r: asyncio.StreamReader) -> tuple[str, list[tuple[str, str]], bytes]:
    """One response: its status line, its headers (Date left out: it changes) and body."""
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode().split("\r\n")[:-2]
    headers = [tuple(x.split(": ", 1)) for x in lines[1:]]
    length = int(next(v for k, v in headers if k.lower() == "content-length"))
    body = await asyncio.wait_for(r.readexactly(length), 10)
    return lines[0], sorted(h for h in headers if h[0] != "Date"), body


async def exchange(port: int, raw: bytes):
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(raw)
        return await read_response(r)
    finally:
        w.close()


def req(method: str, target: str, body: bytes = b"", headers: str = AUTH) -> bytes:
    length = f"Content-Length: {len(body)}\r\n" if body or method in ("PUT", "POST") else ""
    return f"{method} {target} HTTP/1.1\r\nHost: x\r\n{headers}{length}\r\n".encode() + body


TXN = json.dumps({"compare": [{"key": "a", "exists": True}], "success": [{"op": "get", "key": "a"}, {"op": "put", "key": "t", "value": "v"}]}).encode()
# Each is sent on its own connection to two fresh single-node stores, one behind each front;
# with the same history, every answer must be the same bytes (the Date header aside).
SCRIPT = [
    req("PUT", "/v1/kv/a", b"v1"),
    req("GET", "/v1/kv/a"),
    req("GET", "/v1/kv/a?consistency=stale"),
    req("GET", "/v1/kv/a?consistency=sometimes"),
    req("GET", "/v1/kv/missing"),
    req("GET", "/v1/kv/d%C3%A9j%C3%A0"),
    req("GET", "/v1/kv/%ZZ"),
    req("PUT", "/v1/kv/a", b"v2", AUTH + 'If-Match: "2"\r\n'),
    req("PUT", "/v1/kv/a", b"v3", AUTH + 'If-Match: "999"\r\n'),
    req("PUT", "/v1/kv/a", b"v3", AUTH + "If-Match: nonsense\r\n"),
    req("PUT", "/v1/kv/a", b"v3", AUTH + "If-None-Match: *\r\n"),
    req("PUT", "/v1/kv/b", b"v3", AUTH + 'If-None-Match: "4"\r\n'),
    req("PUT", "/v1/kv/b?lease=abc", b"v"),
    req("PUT", "/v1/kv/b?lease=12345", b"v"),
    req("PUT", "/v1/kv/big", b"x" * 1001),  # over --max-value-bytes
    req("PUT", "/v1/kv/a", b"v"),  # no token
    req("PUT", "/v1/kv/a", b"v", "Authorization: Bearer wrong\r\n"),
    req("POST", "/v1/txn", TXN),
    req("POST", "/v1/txn", b"{not json"),
    req("POST", "/v1/txn?encoding=base64", TXN),
    req("GET", "/v1/kv/b?consistency=stale&"),  # an empty part is no parameter (in both)
    req("GET", "/v1/kv/b?&consistency=stale&&"),
    req("GET", "/v1/kv/b?consistancy=stale"),  # a mistyped one: 400 in both
    req("DELETE", "/v1/kv/a", headers=AUTH + "If-None-Match: *\r\n"),
    req("DELETE", "/v1/kv/a"),
    req("DELETE", "/v1/kv/a"),
    req("GET", "/v1/nope"),  # passed on to aiohttp in both
    req("POST", "/v1/kv/a", b"v"),  # 405, from aiohttp in both
    req("GET", "/v1/kv/a").replace(b"\r\n", b"\n"),  # lines ended by a bare LF: 400 in both
    b"GET /v1/kv/a HTTP/1.1\r\n" + AUTH.encode() + b"\r\n",  # no Host: 400 in both
    req("GET", "/v1/kv/a", headers=AUTH + "".join(f"X-H{i}: v\r\n" for i in range(300))),  # too many headers
    req("PUT", "/v1/kv/a%0Ab", b"v"),  # a newline in the key
    # Bytes after a body: aiohttp's parser refuses the whole buffer, the write included.
    req("PUT", "/v1/kv/j1", b"abc", AUTH + "Connection: close\r\n") + b"JUNK",
    req("PUT", "/v1/kv/j2", b"abc") + b"JUNK",
    req("PUT", "/v1/kv/j3", b"abc") + b"junk\r\n\r\n",
    req("PUT", "/v1/kv/j4", b"abc") + b"GET /v1/kv/j4 HTTP/1.1\r\n",  # a pipelined request on its way: served
    # Where an encoded slash matches: inside a segment, never as a separator.
    req("GET", "/v1%2Fkv/a"),
    req("GET", "/v1/kv%2Fa"),
    req("GET", "/v1/kv/a%2Fb"),
    req("GET", "/%761/kv/a"),
    req("POST", "/v1%2Ftxn", TXN),
    req("GET", "/v1/kv/%25"),
]
# What the script leaves in the store, compared between the two afterwards.
TOUCHED = ["a", "b", "t", "j1", "j2", "j3", "j4", "a/b", "%"]


async def test_both_fronts_answer_every_request_alike(tmp_path):
    async with served(tmp_path, "fast", True) as (_, fast, _), served(tmp_path, "slow", False) as (_, slow, _):
        for raw in SCRIPT:
            assert await exchange(fast, raw) == await exchange(slow, raw), raw
        assert (await exchange(fast, req("GET", "/v1/kv/t")))[0] == "HTTP/1.1 200 OK"  # the transaction wrote
        for key in TOUCHED:  # and the same effect on the data
            raw = req("GET", "/v1/kv/" + key.replace("%", "%25").replace("/", "%2F"))
            assert (await exchange(fast, raw))[0] == (await exchange(slow, raw))[0], key
        assert (await exchange(fast, req("GET", "/v1/kv/j1")))[0] == "HTTP/1.1 404 Not Found"
        assert (await exchange(fast, req("GET", "/v1/kv/j4")))[0] == "HTTP/1.1 200 OK"


async def test_a_connection_moves_to_aiohttp_in_order(tmp_path):
    async with served(tmp_path, "n", True) as (node, port, _):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        # Sent in one write: key routes, then one the fast path does not serve, then keys again.
        w.write(req("PUT", "/v1/kv/k", b"one") + req("GET", "/v1/status") + req("GET", "/v1/kv/k") + req("PUT", "/v1/kv/k", b"two"))
        put, status, get, put2 = [await read_response(r) for _ in range(4)]
        assert put[0] == status[0] == get[0] == put2[0] == "HTTP/1.1 200 OK"
        assert json.loads(status[2])["role"] == "leader"
        assert get[2] == b"one"
        w.write(req("GET", "/v1/kv/k"))  # the connection stays usable, now on aiohttp
        assert (await read_response(r))[2] == b"two"
        w.close()


async def test_what_the_fast_path_passes_on_is_answered_by_aiohttp(tmp_path):
    async with served(tmp_path, "n", True) as (node, port, _):
        chunked = f"PUT /v1/kv/c HTTP/1.1\r\nHost: x\r\n{AUTH}Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n".encode()
        assert (await exchange(port, chunked))[0] == "HTTP/1.1 200 OK"
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(f"PUT /v1/kv/e HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Length: 2\r\nExpect: 100-continue\r\n\r\n".encode())
        assert (await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 100")
        w.write(b"ee")
        assert (await read_response(r))[0] == "HTTP/1.1 200 OK"
        w.close()
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(f"GET /v1/kv/c HTTP/1.0\r\n{AUTH}\r\n".encode())
        out = await asyncio.wait_for(r.read(), 5)  # HTTP/1.0: answered, then closed
        assert out.startswith(b"HTTP/1.0 200") and out.endswith(b"\r\n\r\nabc"), out
        w.close()
        huge = f"GET /v1/kv/c HTTP/1.1\r\nHost: x\r\n{AUTH}X-Pad: {'p' * 9000}\r\n\r\n".encode()
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(huge)
        out = await asyncio.wait_for(r.read(), 5)
        assert out == b"" or out.split(b" ")[1] in (b"400", b"431"), out[:200]
        w.close()
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(req("GET", "/v1/kv/c", headers=AUTH + "Connection: close\r\n"))
        out = await asyncio.wait_for(r.read(), 5)  # served on the fast path, then closed
        assert out.startswith(b"HTTP/1.1 200") and b"Connection: close\r\n" in out and out.endswith(b"abc")
        w.close()
        assert node.sm.get("e")[1] == b"ee"


async def test_idle_and_stalled_connections_are_closed(tmp_path):
    async with served(tmp_path, "n", True, idle_timeout_s=0.5) as (node, port, _):
        idle = await asyncio.open_connection("127.0.0.1", port)
        stalled = await asyncio.open_connection("127.0.0.1", port)
        stalled[1].write(b"GET /v1/kv/a HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
        busy = await asyncio.open_connection("127.0.0.1", port)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for _ in range(8):  # a connection that keeps asking stays open past the timeout
            busy[1].write(req("GET", "/v1/kv/a"))
            assert (await read_response(busy[0]))[0] == "HTTP/1.1 404 Not Found"
            await asyncio.sleep(0.2)  # under the idle timeout between requests
        for r, w in (idle, stalled):
            assert await asyncio.wait_for(r.read(), 5) == b""  # closed by the node
            w.close()
        assert loop.time() - t0 < 5
        busy[1].close()


async def test_the_connection_cap_counts_fast_connections(tmp_path):
    async with served(tmp_path, "n", True, max_connections=2) as (node, port, _):
        kept = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        for r, w in kept:
            w.write(req("GET", "/v1/kv/a"))
            assert (await read_response(r))[0] == "HTTP/1.1 404 Not Found"
        r, w = await asyncio.open_connection("127.0.0.1", port)
        out = await asyncio.wait_for(r.read(), 5)
        assert out.startswith(b"HTTP/1.1 503") and b"TOO_MANY_CONNECTIONS" in out
        w.close()
        for r, w in kept:
            w.close()


@pytest.mark.parametrize("front", ["fast", "aiohttp"])
async def test_pipelined_requests_are_answered_in_order(tmp_path, front):
    """64 GETs in one write, with a PUT in the middle: one answer each, in order."""
    async with served(tmp_path, "n", front == "fast") as (node, port, _):
        await node.put("v", b"x" * 1000)
        r, w = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
        w.write(req("GET", "/v1/kv/v") * 32 + req("PUT", "/v1/kv/v", b"y") + req("GET", "/v1/kv/v") * 32)
        answers = [await read_response(r) for _ in range(65)]
        assert [a[2] for a in answers[:32]] == [b"x" * 1000] * 32
        assert answers[32][0] == "HTTP/1.1 200 OK" and [a[2] for a in answers[33:]] == [b"y"] * 32
        w.close()


async def test_over_tls_a_connection_moves_to_aiohttp_too(tmp_path):
    import ssl

    import trustme

    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    async with served(tmp_path, "n", True, ssl_context=server_ctx) as (node, port, _):
        r, w = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx)
        w.write(req("PUT", "/v1/kv/k", b"one") + req("GET", "/v1/status") + req("GET", "/v1/kv/k"))
        put, status, get = [await read_response(r) for _ in range(3)]
        assert (put[0], json.loads(status[2])["role"], get[2]) == ("HTTP/1.1 200 OK", "leader", b"one")
        w.close()


async def test_a_client_that_does_not_read_is_not_read_from(tmp_path):
    """A client pipelining GETs of a 64 KiB value without reading the answers: once the
    node's send buffer is full it stops reading that connection, so the client's writes
    stall instead of piling up in the node's memory."""
    async with served(tmp_path, "n", True, max_value_bytes=1 << 20) as (node, port, _):
        await node.put("v", b"x" * 65536)
        r, w = await asyncio.open_connection("127.0.0.1", port)
        chunk = req("GET", "/v1/kv/v") * 1000
        sent, stalled = 0, False
        loop = asyncio.get_running_loop()
        until = loop.time() + 5
        while loop.time() < until and sent < 256 << 20:
            w.write(chunk)
            sent += len(chunk)
            try:
                await asyncio.wait_for(w.drain(), 1.0)
            except TimeoutError:
                stalled = True
                break
        assert stalled, f"{sent} bytes of requests accepted without the answers being read"
        assert sent < 32 << 20
        w.transport.abort()


async def test_shutdown_answers_the_requests_in_flight(tmp_path):
    async with served(tmp_path, "n", True) as (node, port, runner):
        put = node.put

        async def slow_put(*args, **kwargs):  # a write still committing when the node stops
            await asyncio.sleep(0.5)
            return await put(*args, **kwargs)

        node.put = slow_put
        r, w = await asyncio.open_connection("127.0.0.1", port)
        idle = await asyncio.open_connection("127.0.0.1", port)
        w.write(req("PUT", "/v1/kv/late", b"v"))
        await asyncio.sleep(0.1)
        stopping = asyncio.ensure_future(runner.cleanup())
        assert await asyncio.wait_for(idle[0].read(), 5) == b""  # idle: closed at once
        status, _, body = await read_response(r)
        assert status == "HTTP/1.1 200 OK", body  # answered, then closed
        assert await asyncio.wait_for(r.read(), 5) == b""
        await stopping
