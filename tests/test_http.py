"""The HTTP API of one node (aiohttp's test server, a real node underneath)."""

from __future__ import annotations

import asyncio
import contextlib
import base64
import io
import json
import os
import re
import socket
import struct

import aiohttp
from yarl import URL
import pytest
from aiohttp.test_utils import TestClient
from served import FRONTS, ServedNode

import kv
from kv import Cond, Get, Node, NodeConfig, Put
from kv.bench.harness import poll

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def make_client(tmp_path, front: str = "fast", **options):
    """A node behind its real listener: `front` "fast" serves the key routes on the fast
    path (http/fastpath.py), "aiohttp" serves everything through aiohttp."""
    node = Node(NodeConfig(id="n1", data_dir=str(tmp_path / "n1"), max_value_bytes=1000, **options))
    await node.start()
    while node.raft.leader_id is None:
        await node.raft.leader_changed.wait()
    client = TestClient(ServedNode(node, front, token=options.get("token")))
    await client.start_server()
    return node, client


@pytest.fixture(params=FRONTS)
async def api(tmp_path, request):
    node, client = await make_client(tmp_path, request.param)
    yield client
    await client.close()
    await node.stop()


async def raw_request(client: TestClient, data: bytes) -> bytes:
    r, w = await asyncio.open_connection(client.host, client.port)
    w.write(data)
    await w.drain()
    out = await asyncio.wait_for(r.read(65536), 5)
    w.close()
    return out


@pytest.mark.parametrize("front", FRONTS)
async def test_a_503_says_when_to_retry_and_a_405_what_is_allowed(tmp_path, front):
    """No leader (the node's only peer is not running): a write, a linearizable read and the
    readiness probe get 503 with Retry-After (every 503 has it: http/answer.py), on both
    fronts; a method a route does not take gets 405 with Allow."""
    from kv.bench.harness import free_port

    peers = {"n1": f"127.0.0.1:{free_port()}", "n2": f"127.0.0.1:{free_port()}"}
    node = Node(NodeConfig(id="n1", data_dir=str(tmp_path / "n1"), peers=peers, write_timeout_s=0.3, read_timeout_s=0.3))
    await node.start()
    client = TestClient(ServedNode(node, front))
    await client.start_server()
    try:
        for method, path in (("PUT", "/v1/kv/a"), ("GET", "/v1/kv/a"), ("GET", "/readyz")):
            r = await client.request(method, path, data=b"v" if method == "PUT" else None)
            assert r.status == 503 and r.headers.get("Retry-After") == "1", (method, r.status, dict(r.headers))
        r = await client.request("PATCH", "/v1/kv/a")
        assert r.status == 405 and {"GET", "PUT", "DELETE"} <= {m.strip() for m in r.headers.get("Allow", "").split(",")}, dict(r.headers)
    finally:
        await client.close()
        await node.stop()


async def test_put_get_delete_with_etags(api):
    r = await api.put("/v1/kv/dir%2Fsub/key%20x", data=b"\x00binary\xff")
    assert r.status == 200
    body = await r.json()
    assert body["term"] >= 1 and r.headers["ETag"] == f'"{body["index"]}"'
    r = await api.get("/v1/kv/dir/sub/key%20x")  # '/' may be escaped or not
    assert r.status == 200 and await r.read() == b"\x00binary\xff" and r.headers["ETag"] == f'"{body["index"]}"'
    r = await api.get("/v1/kv/dir/sub/key%20x?consistency=stale")
    assert r.status == 200
    r = await api.head("/v1/kv/dir/sub/key%20x")  # (it was 405: HEAD wherever GET)
    assert (r.status, r.headers["ETag"], r.headers["Content-Length"], await r.read()) == (200, f'"{body["index"]}"', "8", b"")
    assert (await api.head("/v1/kv?prefix=dir/")).status == 200
    r = await api.delete("/v1/kv/dir/sub/key%20x")
    assert (await r.json())["deleted"] is True
    r = await api.get("/v1/kv/dir/sub/key%20x")
    assert r.status == 404 and (await r.json())["error"]["code"] == "NOT_FOUND"
    assert (await api.head("/v1/kv/dir/sub/key%20x")).status == 404


async def test_a_query_parameter_no_route_takes_is_refused_and_nothing_is_done(api):
    """A mistyped parameter was ignored: GET /v1/kv?prefx=a/ listed every key, and a put with
    ?leas=N wrote the key without its lease (to live for ever). Each key route and the watch
    take the parameters /v1/openapi.json gives them, and refuse any other."""
    assert (await api.put("/v1/kv/qa/1", data=b"1")).status == 200
    assert (await api.put("/v1/kv/qb/1", data=b"1")).status == 200
    for method, path, typo in (("GET", "/v1/kv?prefx=qa/", "prefx"), ("GET", "/v1/kv/qa/1?consistancy=stale", "consistancy"),
                               ("PUT", "/v1/kv/qa/2?leas=7", "leas"), ("DELETE", "/v1/kv?prefix=qa/&limt=1", "limt"),
                               ("DELETE", "/v1/kv/qa/1?if_match=3", "if_match"), ("GET", "/v1/watch?prefix=qa/&frm=1", "frm")):
        r = await api.request(method, path, data=b"2" if method == "PUT" else None)
        body = await r.json()
        assert r.status == 400 and f"takes no query parameter '{typo}'" in body["error"]["message"], (method, path, body)
    r = await api.get("/v1/kv?prefix=q")
    assert [i["key"] for i in (await r.json())["items"]] == ["qa/1", "qb/1"]  # nothing written or deleted
    assert (await api.get("/v1/kv?prefix=qa/&limit=5&consistency=stale")).status == 200  # the ones it takes
    r = await api.post("/v1/txn?encoding=base64", json={"success": [{"op": "get", "key": "qa/1"}]})
    assert r.status == 200 and (await r.json())["results"][0]["value"] == "MQ==", await r.text()  # ("1")


async def test_conditional_writes(api):
    r = await api.put("/v1/kv/c", data=b"1", headers={"If-None-Match": "*"})
    assert r.status == 200
    idx = (await r.json())["index"]
    r = await api.put("/v1/kv/c", data=b"2", headers={"If-None-Match": "*"})
    assert r.status == 412 and (await r.json())["error"]["code"] == "PRECONDITION_FAILED"
    r = await api.put("/v1/kv/c", data=b"2", headers={"If-Match": f'"{idx + 100}"'})
    assert r.status == 412
    r = await api.put("/v1/kv/c", data=b"2", headers={"If-Match": f'"{idx}"'})
    assert r.status == 200
    r = await api.delete("/v1/kv/c", headers={"If-Match": f'"{idx}"'})
    assert r.status == 412
    assert await (await api.get("/v1/kv/c")).read() == b"2"


async def test_if_match_star_is_the_key_exists(api):
    r = await api.put("/v1/kv/star", data=b"1", headers={"If-Match": "*"})
    assert r.status == 412 and (await r.json())["error"]["mod_index"] == 0
    assert (await api.get("/v1/kv/star")).status == 404  # not created
    r = await api.delete("/v1/kv/star", headers={"If-Match": " * "})
    assert r.status == 412
    idx = (await (await api.put("/v1/kv/star", data=b"1")).json())["index"]
    r = await api.put("/v1/kv/star", data=b"2", headers={"If-Match": "*"})
    assert r.status == 200 and r.headers["ETag"] == f'"{(await r.json())["index"]}"' != f'"{idx}"'
    assert await (await api.get("/v1/kv/star")).read() == b"2"
    r = await api.put("/v1/kv/star", data=b"3", headers={"If-Match": "*", "If-None-Match": "*"})
    assert r.status == 400 and "cannot both hold" in (await r.json())["error"]["message"]
    r = await api.put("/v1/kv/star", data=b"3", headers={"If-Match": "**"})
    assert r.status == 400 and "(or *: the key exists)" in (await r.json())["error"]["message"]
    r = await api.delete("/v1/kv/star", headers={"If-Match": "*"})
    assert r.status == 200 and (await r.json())["deleted"] is True
    assert (await api.get("/v1/kv/star")).status == 404


async def test_listing_pages(api):
    for i in range(25):
        await api.put(f"/v1/kv/list/{i:02d}", data=b"v%d" % i)
    await api.put("/v1/kv/other", data=b"\xff\xfe")
    seen, after = [], None
    while True:
        q = {"prefix": "list/", "limit": "10"} | ({"after": after} if after else {})
        d = await (await api.get("/v1/kv", params=q)).json()
        seen += d["items"]
        after = d["next"]
        if after is None:
            break
    assert [x["key"] for x in seen] == [f"list/{i:02d}" for i in range(25)]
    assert seen[3]["value"] == "v3" and seen[3]["mod_index"] > 0
    d = await (await api.get("/v1/kv", params={"prefix": "other"})).json()
    assert d["items"][0] == {"key": "other", "value": "//4=", "encoding": "base64", "mod_index": d["items"][0]["mod_index"]}


async def test_txn(api):
    await api.put("/v1/kv/t/a", data=b"1")
    doc = {"compare": [{"key": "t/a", "value": "1"}, {"key": "t/b", "exists": False}], "success": [{"op": "put", "key": "t/b", "value": "2"}, {"op": "get", "key": "t/a"}], "failure": [{"op": "get", "key": "t/b"}]}
    r = await api.post("/v1/txn", json=doc)
    d = await r.json()
    assert r.status == 200 and d["succeeded"] and d["results"][1]["value"] == "1"
    r = await api.post("/v1/txn", json=doc)  # t/b exists now
    d = await r.json()
    assert r.status == 412 and not d["succeeded"] and d["results"][0]["value"] == "2"


@pytest.mark.parametrize("spelling", ["documented", "deprecated"])
async def test_txn_takes_binary_values_in_both_spellings(api, spelling):
    raw = b"\x00bin\xff"
    b64 = base64.b64encode(raw).decode()
    value = {"value": b64, "encoding": "base64"} if spelling == "documented" else {"value_base64": b64}
    doc = {"compare": [{"key": "b", "exists": False}], "success": [{"op": "put", "key": "b", **value}]}
    r = await api.post("/v1/txn", json=doc)
    assert r.status == 200, await r.text()
    assert await (await api.get("/v1/kv/b")).read() == raw
    doc = {"compare": [{"key": "b", **value}], "success": [{"op": "get", "key": "b"}]}
    d = await (await api.post("/v1/txn", json=doc)).json()
    assert d["succeeded"] and (d["results"][0]["value"], d["results"][0]["encoding"]) == (b64, "base64")


async def test_the_client_sends_binary_values_the_server_reads_back(api):
    import kv

    raw = b"\xff\x00bin"
    async with kv.AsyncClient(f"http://{api.host}:{api.port}") as c:
        assert (await c.txn([Cond("cb", "exists", False)], [Put("cb", raw)])).succeeded
        r = await c.txn([Cond("cb", "value", raw)], [Get("cb")])
        assert r.succeeded and r.results[0].value == raw
        assert not (await c.txn([Cond("cb", "value", raw + b"!")], [Put("cb", b"no")])).succeeded
    assert await (await api.get("/v1/kv/cb")).read() == raw


@pytest.mark.parametrize("value", [123, "text", None])
async def test_the_client_refuses_a_value_that_is_not_bytes_and_writes_nothing(api, value):
    """bytes(123) is 123 NUL bytes: the client stored them (a newcomer's run found it), where
    kv.open and kv.Node refuse. Every way the client writes a value refuses it alike."""
    import kv

    async with kv.AsyncClient(f"http://{api.host}:{api.port}") as c:
        writes = [
            lambda: c.put("typed", value),
            lambda: c.cas("typed", 0, value),
            lambda: c.put_many({"typed": value}),
            lambda: c.txn(ops=[Put("typed", value)]),
            lambda: c.txn([Cond("typed", "value", value)], [Put("typed", b"x")]),
        ]
        for write in writes:
            with pytest.raises(kv.BadRequest, match="values are bytes, not"):
                await write()
        assert await c.get("typed") is None


@pytest.mark.parametrize(
    "part, message",
    [
        ({"value": "YQ==", "value_base64": "YQ=="}, "not both"),
        ({"value": "YQ==", "encoding": "base64", "value_base64": "YQ=="}, "not both"),
        ({"encoding": "base64", "value_base64": "YQ=="}, "not both"),
        ({"value": "not base64!", "encoding": "base64"}, "value is not valid base64"),
        ({"value_base64": "not base64!"}, "value_base64 is not valid base64"),
        ({"value": "YQ==", "encoding": "hex"}, '"encoding" must be "base64"'),
        ({"encoding": "base64"}, 'needs "value"'),
    ],
)
async def test_a_bad_binary_value_is_refused_and_nothing_is_written(api, part, message):
    for doc in (
        {"success": [{"op": "put", "key": "ok", "value": "x"}, {"op": "put", "key": "bad", **part}]},
        {"compare": [{"key": "bad", **part}], "success": [{"op": "put", "key": "ok", "value": "x"}]},
    ):
        r = await api.post("/v1/txn", json=doc)
        err = (await r.json())["error"]
        assert r.status == 400 and err["code"] == "BAD_REQUEST" and message in err["message"], err
    assert (await api.get("/v1/kv/ok")).status == 404 and (await api.get("/v1/kv/bad")).status == 404


@pytest.mark.parametrize(
    "method, path, body, status",
    [
        ("POST", "/v1/txn", b"{not json", 400),
        ("POST", "/v1/txn", b"[1,2]", 400),
        ("POST", "/v1/txn", b'{"success": [{"op": "explode", "key": "a"}]}', 400),
        ("POST", "/v1/txn", b'{"compare": [{"key": "a", "mod_index": -1}]}', 400),
        ("POST", "/v1/txn", b'{"bogus": 1}', 400),
        ("GET", "/v1/kv?limit=0", None, 400),
        ("GET", "/v1/kv?limit=x", None, 400),
        ("GET", "/v1/kv/a?consistency=eventual", None, 400),
        ("PUT", "/v1/kv/a", b"x" * 1001, 413),
        ("PUT", "/v1/kv/" + "k" * 5000, b"x", 400),
        ("PUT", "/v1/kv/a", b"x", 200),
        ("POST", "/v1/kv/a", b"x", 405),
        ("GET", "/v1/nothing", None, 404),
        ("PUT", "/v1/kv/a", b"x", 200),
    ],
)
async def test_bad_input_gets_a_clear_error_and_changes_nothing(api, method, path, body, status):
    before = await (await api.get("/v1/kv", params={"consistency": "stale"})).json()
    r = await api.request(method, path, data=body)
    assert r.status == status, await r.text()
    if status >= 400:
        err = (await r.json())["error"]
        assert err["code"] and err["message"]
        after = await (await api.get("/v1/kv", params={"consistency": "stale"})).json()
        after.pop("index"), before.pop("index")  # the leader's first no-op may land in between
        assert after == before


async def test_bad_percent_encoding_is_400(api):
    for path in (b"/v1/kv/bad%ZZ", b"/v1/kv/%", b"/v1/kv/a%4"):
        out = await raw_request(api, b"PUT " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nConnection: close\r\n\r\nx")
        assert out.startswith(b"HTTP/1.1 400"), out[:200]
        assert b"percent-encoding" in out


async def test_a_key_whose_bytes_are_not_utf8_is_addressed_by_percent_escapes_and_listed_in_base64(api):
    """etcd's clients may write such keys: the HTTP API reads and writes them too."""
    out = await raw_request(api, b"PUT /v1/kv/half%C3 HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nConnection: close\r\n\r\nx")
    assert out.startswith(b"HTTP/1.1 200"), out[:200]
    r = await api.get(URL("/v1/kv/half%C3", encoded=True))
    assert r.status == 200 and await r.read() == b"x"
    spelled = {"key": base64.b64encode(b"half\xc3").decode(), "key_encoding": "base64"}
    for query in ("prefix=half%C3", "prefix=half", "prefix=h&limit=1"):
        d = await (await api.get(URL(f"/v1/kv?{query}", encoded=True))).json()
        assert d["items"] == [{**spelled, "value": "x", "mod_index": d["items"][0]["mod_index"]}], (query, d)
    await api.put("/v1/kv/half2", data=b"y")
    d = await (await api.get(URL("/v1/kv?prefix=half&limit=1", encoded=True))).json()
    assert d["next"] == "half2" and "next_encoding" not in d  # byte order: "2" (0x32) before 0xc3
    d = await (await api.get(URL("/v1/kv?prefix=half&after=half2", encoded=True))).json()
    assert [it["key"] for it in d["items"]] == [spelled["key"]]
    r = await api.post("/v1/txn", json={"compare": [{**spelled, "exists": True}], "success": [{"op": "get", **spelled}]})
    d = await r.json()
    assert r.status == 200 and d["results"][0]["key"] == spelled["key"] and d["results"][0]["key_encoding"] == "base64", d
    r = await api.post("/v1/txn", json={"compare": [{**spelled, "exists": False}], "success": []})
    assert r.status == 412
    r = await api.put(URL("/v1/kv/half%C3", encoded=True), data=b"z", headers={"If-Match": '"999"'})
    err = (await r.json())["error"]
    assert r.status == 412 and {k: err[k] for k in spelled} == spelled, err
    r = await api.post("/v1/txn", json={"compare": [{"key": "k", "key_encoding": "hex", "exists": False}], "success": []})
    assert r.status == 400 and "key_encoding" in (await r.json())["error"]["message"]
    for method, bad in (("GET", "/v1/kv?prefix=a%ZZ"), ("GET", "/v1/kv?limit=5&after=b%Z"), ("DELETE", "/v1/kv?prefix=a%ZZ"), ("GET", "/v1/watch?prefix=a%")):
        r = await api.request(method, URL(bad, encoded=True))
        assert r.status == 400 and "bad percent-encoding in ?" in (await r.json())["error"]["message"], bad
    r = await api.delete(URL("/v1/kv?prefix=half%C3", encoded=True))
    assert r.status == 200 and (await r.json())["deleted"] == 1
    assert (await api.get(URL("/v1/kv/half%C3", encoded=True))).status == 404


def test_the_client_refuses_a_key_whose_surrogates_stand_for_no_byte():
    """kv.Client as kv.open: BadRequest, before anything is sent (U+DC80..U+DCFF are bytes)."""
    from kv.client.async_client import _key_path
    from kv.client.endpoints import with_query
    from kv.common.wire import op_fields

    assert _key_path("a/\udcff é") == "/v1/kv/a/%FF%20%C3%A9"
    assert with_query("http://n/v1/kv", {"prefix": "a\udcff+", "limit": "5"}) == "http://n/v1/kv?prefix=a%FF%2B&limit=5"
    for call in (lambda: _key_path("x\udc01"), lambda: with_query("http://n/v1/kv", {"prefix": "x\ud800"}), lambda: op_fields(kv.Put("x\udc01", b""))):
        with pytest.raises(kv.BadRequest, match="stands for no byte"):
            call()


async def test_oversized_value_is_refused_before_it_is_read(api):
    # Announce 10 MB and send nothing: the answer must come without waiting for the body.
    out = await raw_request(api, b"PUT /v1/kv/big HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\nConnection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 413")
    # A chunked body without a length is cut off at the limit too.
    chunk = b"x" * 600
    req = b"PUT /v1/kv/big HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    req += b"%x\r\n%s\r\n" % (len(chunk), chunk) * 2 + b"0\r\n\r\n"
    assert (await raw_request(api, req)).startswith(b"HTTP/1.1 413")
    assert (await api.get("/v1/kv/big")).status == 404


async def test_status_health_and_metrics(api):
    s = await (await api.get("/v1/status")).json()
    for field in ("id", "role", "term", "leader", "commit_index", "applied_index", "ledger_begin_index", "ledger_end_index", "snapshot_index", "peers"):
        assert field in s
    assert s["role"] == "leader" and s["leader"] == "n1"
    assert (await api.get("/healthz")).status == 200
    assert (await (await api.get("/readyz")).json())["ready"] is True
    await api.put("/v1/kv/m", data=b"1")
    text = await (await api.get("/metrics")).text()
    for metric in ("kv_role{role=\"leader\"} 1", "kv_commit_index", "kv_commit_latency_seconds_count 1.0", 'kv_http_request_duration_seconds_count{route="kv_put",status="200"} 1.0'):
        assert metric in text


async def test_snapshot_routes(api):
    assert (await api.get("/v1/snapshot")).status == 404
    await api.put("/v1/kv/s", data=b"1")
    d = await (await api.post("/v1/snapshot")).json()
    r = await api.get("/v1/snapshot")
    assert r.status == 200 and r.headers["X-Snapshot-Index"] == str(d["index"])
    assert (await r.read()).startswith(b"LKVSNAP1")


def _frames(body: bytes) -> list[tuple[bytes, bytes, int]]:
    """The records of an export range's blocks (snapshot/format.py's framing), checked to
    end with the end block."""
    from kv.snapshot.format import iter_blocks, parse_block

    f = io.BytesIO(body)
    out = [rec for n, payload in iter_blocks(f, None) for rec in zip(*parse_block(payload, n))]
    assert f.read() == b""
    return out


async def test_an_export_view_holds_the_keys_as_of_its_pinning_by_ranges(api):
    """POST /v1/export pins a view after a read barrier and cuts its keys into ranges of
    about equal counts; each range streams as blocks; writes after the pinning are not in
    it; DELETE lets it go (404 afterwards); bad parameters are 400."""
    for i in range(1200):
        await api.put(f"/v1/kv/e/{i:05d}", data=b"v%d" % i)
    await api.put("/v1/kv/f", data=b"out of the prefix")
    r = await api.post("/v1/export?prefix=e/&parts=3")
    assert r.status == 200, await r.text()
    v = await r.json()
    assert v["keys"] == 1200 and len(v["ranges"]) == 3 and v["ranges"][0][0] == b"e/".hex() and v["ranges"][-1][1] == b"e0".hex()
    await api.put("/v1/kv/e/00000", data=b"after")  # not in the view
    await api.put("/v1/kv/e/new", data=b"after")
    rows = []
    for lo, hi in v["ranges"]:
        r = await api.get(f"/v1/export/{v['view']}", params={"from": lo, "to": hi})
        assert r.status == 200 and r.headers["X-Kv-Index"] == str(v["index"])
        part = _frames(await r.read())
        assert 300 <= len(part) <= 500  # about a third each
        rows += part
    assert [(k.decode(), val) for k, val, _ in rows] == [(f"e/{i:05d}", b"v%d" % i) for i in range(1200)]
    assert all(0 < mod <= v["index"] for _, _, mod in rows)
    whole = await api.post("/v1/export")  # every key, one range
    w = await whole.json()
    assert w["keys"] == 1202 and w["ranges"] == [["", None]]
    r = await api.get(f"/v1/export/{w['view']}")
    assert [k for k, _, _ in _frames(await r.read())][-2:] == [b"e/new", b"f"]
    for bad in ("/v1/export?parts=0", "/v1/export?parts=x", "/v1/export?parts=5000"):
        assert (await api.post(bad)).status == 400, bad
    assert (await api.get(f"/v1/export/{v['view']}?from=zz")).status == 400
    assert (await api.delete(f"/v1/export/{v['view']}")).status == 200
    assert (await api.get(f"/v1/export/{v['view']}")).status == 404
    assert (await api.delete(f"/v1/export/{v['view']}")).status == 404
    assert (await api.delete(f"/v1/export/{w['view']}")).status == 200


async def test_a_node_pins_few_export_views_and_lets_unread_ones_go():
    """MAX_VIEWS at most (503 beyond, the view let go at once); a view unread for
    VIEW_TTL_S goes, one being read stays."""
    from kv import Unavailable
    from kv.server import exports

    now = [0.0]
    released = []

    class View:
        index, term = 7, 1

        def release(self):
            released.append(self)

    async def barrier(*a):
        return 7

    views = exports.PinnedViews(View, barrier, clock=lambda: now[0])
    names = [views.pin(View(), 7, 1) for _ in range(exports.MAX_VIEWS)]
    with pytest.raises(Unavailable, match="exports open already"):
        views.pin(View(), 7, 1)
    assert len(released) == 1 and len(views) == exports.MAX_VIEWS
    with views.reading(names[0]):
        now[0] += exports.VIEW_TTL_S + 1
        for name in names:
            views._expire(name)  # (what its timer calls)
        assert len(views) == 1  # the one being read
    now[0] += exports.VIEW_TTL_S + 1
    views._expire(names[0])
    assert len(views) == 0 and len(released) == 1 + exports.MAX_VIEWS
    name = views.pin(View(), 7, 1)
    with views.reading(name):
        assert views.release(name) and len(views) == 1  # let go once the read ends
    assert len(views) == 0
    # A view is not closed while a thread works on it, even when the reader stopped waiting
    # (a client gone mid-block); before the database is closed (a snapshot loaded) drain
    # lets every view go and returns once that work is done and the view closed.
    import threading

    gate = threading.Event()
    name = views.pin(View(), 7, 1)
    try:
        with views.reading(name) as p:
            view = p.view
            cut = asyncio.ensure_future(views._in_thread(p, gate.wait))
            await asyncio.sleep(0.05)
            cut.cancel()  # (the reader is gone; the thread goes on)
            drained = asyncio.ensure_future(views.drain())
            await asyncio.sleep(0.05)
            assert not drained.done() and len(views) == 0 and released[-1] is not view
            gate.set()
            await asyncio.wait_for(drained, 5)
            assert released[-1] is view and p.view is None
    finally:
        gate.set()  # (a failed assertion must not leave the thread waiting)
    with pytest.raises(kv.NotFound):
        views.get(name)


@pytest.mark.parametrize("front", FRONTS)
async def test_token_guards_client_routes_but_not_healthz(tmp_path, front):
    node, client = await make_client(tmp_path, front, token="s3cret")
    try:
        assert (await client.get("/healthz")).status == 200
        # (a parameter no route takes is refused after the token: a stranger learns no route's parameters)
        for method, path in (("GET", "/v1/status"), ("PUT", "/v1/kv/a"), ("GET", "/metrics"), ("GET", "/v1/kv"), ("PUT", "/v1/kv/a?leas=7")):
            r = await client.request(method, path, data=b"x")
            assert r.status == 401 and (await r.json())["error"]["code"] == "UNAUTHORIZED"
        r = await client.put("/v1/kv/a", data=b"x", headers={"Authorization": "Bearer wrong"})
        assert r.status == 401
        r = await client.put("/v1/kv/a?leas=7", data=b"x", headers={"Authorization": "Bearer s3cret"})
        assert r.status == 400
        r = await client.put("/v1/kv/a", data=b"x", headers={"Authorization": "Bearer s3cret"})
        assert r.status == 200
        assert node.sm.get("a") is not None
    finally:
        await client.close()
        await node.stop()


EVIL, UI = "http://evil.example", "http://ui.example:3000"


@pytest.mark.parametrize("front", FRONTS)
async def test_a_web_pages_script_is_refused_unless_cors_lists_its_origin(tmp_path, front):
    """Any web page its user visited could write to a node on localhost without a token: a
    "simple" cross-origin POST (text/plain, no preflight) reached etcd's JSON gateway, which
    takes JSON whatever the content type. A request with an Origin the node does not list
    (--cors) is now refused (403) and changes nothing; a listed page gets etcd's CORS
    headers, on the fast path's answers, aiohttp's and a watch's stream, and its preflight
    an answer; clients that send no Origin are served as before."""
    from kv.v3api.gateway import routes as gateway_routes

    node = Node(NodeConfig(id="n1", data_dir=str(tmp_path / "n1"), cors=f"{UI}/"))
    await node.start()
    while node.raft.leader_id is None:
        await node.raft.leader_changed.wait()
    client = TestClient(ServedNode(node, front, more_routes=gateway_routes(node, None)))
    await client.start_server()
    b64 = lambda raw: base64.b64encode(raw).decode()  # noqa: E731
    put = json.dumps({"key": b64(b"gw/pwned"), "value": b64(b"x")})
    try:
        assert (await client.put("/v1/kv/kept", data=b"1")).status == 200  # (no Origin: served)
        for method, path, body in (("POST", "/v3/kv/put", put), ("POST", "/v3/kv/deleterange", json.dumps({"key": b64(b"\0"), "range_end": b64(b"\0")})),
                                   ("PUT", "/v1/kv/pwned", "x"), ("POST", "/v1/txn", '{"ops": [{"op": "delete", "key": "kept"}]}'), ("GET", "/v1/kv/kept", None)):
            r = await client.request(method, path, data=body, headers={"Origin": EVIL, "Content-Type": "text/plain"})
            assert r.status == 403, (path, r.status)
            err = (await r.json())["error"]
            assert err["code"] == "FORBIDDEN" and EVIL in err["message"] and "--cors" in err["message"]
            assert "ui.example" not in err["message"]  # (the listed origins are not told to a stranger)
            assert "Access-Control-Allow-Origin" not in r.headers
        assert node.sm.get("gw/pwned") is None and node.sm.get("pwned") is None and node.sm.get("kept") is not None
        r = await client.options("/v3/kv/put", headers={"Origin": UI, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
        assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == UI and "POST" in r.headers["Access-Control-Allow-Methods"]
        assert "content-type" in r.headers["Access-Control-Allow-Headers"] and "Access-Control-Allow-Private-Network" not in r.headers
        r = await client.options("/v1/kv/ui", headers={"Origin": UI, "Access-Control-Request-Method": "PUT", "Access-Control-Request-Private-Network": "true"})
        assert r.status == 204 and r.headers["Access-Control-Allow-Private-Network"] == "true"  # (Chrome: a public page, a node on localhost)
        for method, path, body in (("POST", "/v3/kv/put", put), ("PUT", "/v1/kv/ui", "1"), ("GET", "/v1/kv/ui", None)):
            r = await client.request(method, path, data=body, headers={"Origin": UI})
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == UI and "ETag" in r.headers["Access-Control-Expose-Headers"], path
        async with client.get("/v1/watch?prefix=ui", headers={"Origin": UI}) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == UI
        assert node.sm.get("gw/pwned") is not None  # (the listed page's put)
    finally:
        await client.close()
        await node.stop()


@pytest.mark.parametrize("front", FRONTS)
async def test_a_request_from_this_machine_for_a_rebound_name_is_refused(tmp_path, front):
    """DNS rebinding: a page whose name now points to 127.0.0.1 makes same-origin GETs,
    without an Origin, and could read every key of a node without a token. It sends its
    own name in Host, a registered domain; a request from this machine naming one is
    refused, and nothing else a local client sends is."""
    from kv.http.cors import LocalNames

    node, client = await make_client(tmp_path, front)
    try:
        assert (await client.put("/v1/kv/secret", data=b"s")).status == 200
        for host in ("rebind.example.com:8001", "7f000001.rebind.network", "EVIL.COM."):
            r = await client.get("/v1/kv/secret", headers={"Host": host})
            assert r.status == 403, host
            assert "DNS rebinding" in (await r.json())["error"]["message"]
            assert (await client.put("/v1/kv/secret", data=b"changed", headers={"Host": host})).status == 403
        for host in ("localhost:8001", "127.0.0.1", "[::1]:8001", "x", "build-box", "kv.local:8001", "a.localhost", "db.internal"):
            r = await client.get("/v1/kv/secret", headers={"Host": host})
            assert r.status == 200 and await r.read() == b"s", host
    finally:
        await client.close()
        await node.stop()
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n127.0.1.1 box.example.com box  # Debian's own name\n10.0.0.5 db.example.com\n")
    names = LocalNames(("kv.example.com",), str(hosts))
    def at(address):
        return lambda: address

    assert names.allows("kv.example.com:8001", at("127.0.0.1"))  # (the advertised host)
    assert names.allows("box.example.com:8001", at("127.0.1.1")) and not names.allows("db.example.com", at("127.0.0.1"))
    assert names.allows("rebind.example.com", at("10.0.0.5")) and names.allows("rebind.example.com", at(None))  # (not from this machine)
    assert not names.allows("rebind.example.com", at("::ffff:127.0.0.1")) and not names.allows("rebind.example.com", at("::1"))


@pytest.mark.parametrize("spec, refused", [("localhost:3000", "localhost:3000"), ("http://a.example/app", "http://a.example/app"),
                                           ("http://*.example", "http://*.example"), ("http://user@a.example", "http://user@a.example"),
                                           ("http://a.example:web", "http://a.example:web"), ("http://a.example:99999", "http://a.example:99999"),
                                           ("http://bücher.example", "http://bücher.example"), ("null", "null")])
def test_cors_names_what_is_not_an_origin(tmp_path, spec, refused):
    with pytest.raises(kv.BadRequest, match=r"--cors: .* is not an origin") as e:
        NodeConfig(id="n1", data_dir=str(tmp_path), cors=spec)
    assert repr(refused) in str(e.value)
    with pytest.raises(kv.BadRequest, match=r"\* \(every page\) stands alone"):
        NodeConfig(id="n1", data_dir=str(tmp_path), cors="*, http://a.example")


def test_cors_origins_are_matched_as_browsers_send_them():
    from kv.http.cors import Cors

    cors = Cors("HTTP://A.example:80/, https://b.example:443, tauri://localhost, http://[::1]:3000")
    for sent in ("http://a.example", "http://A.EXAMPLE", "https://b.example", "tauri://localhost", "http://[::1]:3000"):
        assert cors.allows(sent), sent
    for sent in ("http://a.example:8080", "https://a.example", "http://b.example", "null", "http://[::1]"):
        assert not cors.allows(sent), sent
    assert Cors("*").allows("null") and not Cors("").allows("http://a.example")


async def test_openapi_document_matches_the_routes(api):
    spec = await (await api.get("/v1/openapi.json")).json()
    documented = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    app = api.server.app
    served = set()
    for route in app.router.routes():
        info = route.resource.get_info()
        path = info.get("path") or info.get("formatter")
        if route.method in ("HEAD", "*"):
            continue
        served.add((route.method, path.replace("{key:.+}", "{key}")))
    assert served == documented
    with open(os.path.join(ROOT, "http", "openapi.json")) as f:
        assert json.load(f) == spec


async def test_a_large_value_arriving_in_pieces_is_stored_whole(tmp_path):
    node = Node(NodeConfig(id="n1", data_dir=str(tmp_path / "n1")))  # the default 1 MiB limit
    await node.start()
    client = TestClient(ServedNode(node))  # too large for the fast path: handed to aiohttp
    await client.start_server()
    try:
        value = os.urandom(900_000)
        r, w = await asyncio.open_connection(client.host, client.port)
        w.write(b"PUT /v1/kv/big HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(value))
        for i in range(0, len(value), 65536):  # in many writes, with pauses between them
            w.write(value[i : i + 65536])
            await w.drain()
            await asyncio.sleep(0.005)  # a slow client: the body arrives in pieces
        out = await asyncio.wait_for(r.read(), 10)
        w.close()
        assert out.startswith(b"HTTP/1.1 200"), out[:300]
        got = await client.get("/v1/kv/big")
        assert await got.read() == value
        doc = {"success": [{"op": "put", "key": f"t{i}", "value": "x" * 5000} for i in range(120)]}
        r2 = await client.post("/v1/txn", json=doc)  # about 600 kB of JSON, within --max-txn-ops
        assert r2.status == 200
    finally:
        await client.close()
        await node.stop()


async def test_log_route_streams_the_committed_entries(tmp_path):
    from kv.common.entry_stream import RecordReader, entry_rows

    node, client = await make_client(tmp_path, snapshot_trailing=0)

    async def log(**q):
        r = await client.get("/v1/log", params=q)
        assert r.status == 200, await r.text()
        reader = RecordReader()
        entries = reader.feed(await r.read())
        reader.finish(entries[-1].index if entries else 0)
        return entries

    try:
        await client.put("/v1/kv/a", data=b"1")
        await client.delete("/v1/kv/a", headers={"If-Match": '"999"'})  # logged; its condition fails when applied
        doc = {"compare": [{"key": "b", "exists": False}], "success": [{"op": "put", "key": "b", "value": "2"}], "failure": []}
        assert (await client.post("/v1/txn", json=doc)).status == 200
        applied = (await (await client.get("/v1/status")).json())["applied_index"]
        entries = await log()
        assert [e.index for e in entries] == list(range(1, applied + 1))
        rows = [row[2:] for e in entries[-3:] for row in entry_rows(e)]
        assert rows == [("put", "a", b"1", False, None), ("delete", "a", None, True, None), ("put", "b", b"2", True, "then")]
        assert [e.index for e in await log(**{"from": str(applied - 1), "to": str(applied - 1)})] == [applied - 1]
        for q in ({"from": "x"}, {"from": "0"}, {"from": "3", "to": "2"}, {"to": str(applied + 5)}):
            r = await client.get("/v1/log", params=q)
            assert r.status == 400 and (await r.json())["error"]["message"], q
        # A snapshot with no trailing window compacts the ledger: older entries are gone.
        assert (await client.post("/v1/snapshot")).status == 200
        await poll(lambda: node.log_range()[0] > applied, timeout=5, error="the ledger was not compacted")
        r = await client.get("/v1/log", params={"from": "1"})
        err = (await r.json())["error"]
        assert r.status == 410 and err["code"] == "COMPACTED" and f"from {applied + 1}" in err["message"]
        assert await log() == []  # nothing left but the end record
        await client.put("/v1/kv/c", data=b"3")
        assert [row[2:4] for e in await log() for row in entry_rows(e)] == [("put", "c")]
    finally:
        await client.close()
        await node.stop()


async def _fake_server(answer, sessions=None):
    """A server on loopback that reads one request head and then calls answer(writer);
    POST /v1/sessions goes to sessions(writer) if given (on a connection of its own)."""

    async def serve(reader, writer):
        with contextlib.suppress(Exception):
            head = await reader.readuntil(b"\r\n\r\n")
            if sessions is not None and head.startswith(b"POST /v1/sessions "):
                await sessions(writer)
                writer.close()
                return
            await answer(writer)

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def _reset(writer):
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
    writer.transport.abort()


async def test_a_write_whose_answer_is_lost_is_sent_again_and_applied_once(api):
    """A newcomer's run: a node killed under a write loop; the client sent the write on to
    the next endpoint, which committed it a second time (or failed its if-absent condition
    with the write's own value). Now the write goes in a client session: the node in front
    here carries it to the live node, then resets the connection before the answer; the
    client sends the same request to the live node, which answers it with the first copy's
    result instead of applying it again."""
    import kv

    live = f"http://{api.host}:{api.port}"
    forwarded = []

    async def deliver_then_reset(reader, writer):
        with contextlib.suppress(Exception):
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, target, _ = lines[0].split(" ")
            headers = dict(line.split(": ", 1) for line in lines[1:] if line)
            body = await reader.readexactly(int(headers.get("Content-Length", 0)))
            async with aiohttp.ClientSession() as s:
                async with s.request(method, live + target, data=body, headers={k: v for k, v in headers.items() if k.lower().startswith(("x-kv", "if-", "content-type"))}) as r:
                    await r.read()
                    forwarded.append((method, target, r.status))
            await _reset(writer)

    fake = await asyncio.start_server(deliver_then_reset, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{fake.sockets[0].getsockname()[1]}"
    try:
        async with kv.AsyncClient([url, live], timeout=5) as c:
            await c.put("warm", b"up")  # the client opens its session
            forwarded.clear()
            c.rotation.start_at(url)  # the fake first (a client starts at a random endpoint; one that failed goes last)
            w = await c.put("once", b"v", if_absent=True)  # not 412 against its own first copy
            assert (await c.get("once")).mod_index == w.index
            c.rotation.start_at(url)  # the fake again (it failed: it would be tried last for a while)
            d = await c.delete("once")
            assert d.deleted and d.index > w.index  # the copy's answer: it found the key
            assert [x[:2] for x in forwarded if x[0] != "POST"] == [("PUT", "/v1/kv/once"), ("DELETE", "/v1/kv/once")]
            assert all(status == 200 for *_, status in forwarded)  # each reached the live node, was applied, and its answer lost
            page = await c.scan_page("once")
            history = [e async for e in c.watch("once", 1, end_index=page.index)]
            assert [(e.type, e.index) for e in history] == [("put", w.index), ("delete", d.index)]  # once each
    finally:
        fake.close()


async def test_a_nodes_504_and_a_silent_node_are_each_told_once_as_timeout():
    """A node's own 504 (a kv.Timeout, which is a TimeoutError) was wrapped in the client's
    "the connection failed" message; a node that never answers gets its own words."""
    import kv

    said = "the leader n3 was replaced while this write waited for its answer; read the key before retrying"

    async def answer_504(writer):
        body = json.dumps({"error": {"code": "TIMEOUT", "message": said}}).encode()
        writer.write(b"HTTP/1.1 504 Gateway Timeout\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()

    async def silent(writer):
        await asyncio.sleep(30)

    async def open_session(writer):
        body = b'{"id": 5, "ttl": 600}'
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()

    for answer, want in ((answer_504, f": {said}$"), (silent, r": no answer in 1s after the write was sent \(TimeoutError; a node answers by then even without a leader: .*outcome is unknown")):
        fake = await _fake_server(answer, sessions=open_session)
        try:
            async with kv.AsyncClient(f"http://127.0.0.1:{fake.sockets[0].getsockname()[1]}", timeout=1) as c:
                with pytest.raises(kv.Timeout, match=want) as got:
                    await c.put("k", b"v")
                assert "connection failed" not in str(got.value)
        finally:
            fake.close()


async def test_the_client_tells_the_node_how_long_it_waits():
    """X-Kv-Timeout: what the client has left less a margin, so that the node's answer
    (a 503 when no leader took the write) arrives before the client gives up."""
    import kv

    heads = []

    async def serve(reader, writer):
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        body = b'{"id": 5, "ttl": 600}' if heads[-1].startswith(b"POST /v1/sessions ") else b'{"index": 1, "term": 1}'
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        async with kv.AsyncClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", timeout=2) as c:
            await c.put("k", b"v")
        [head] = [h for h in heads if h.startswith(b"PUT ")]
        assert b"\r\nX-Kv-Session: 5\r\nX-Kv-Seq: 1\r\n" in head
        sent = float(re.search(rb"\r\nX-Kv-Timeout: ([0-9.]+)\r\n", head).group(1))
        assert 1.7 <= sent <= 1.8, head
    finally:
        server.close()


async def test_a_proxys_503_with_a_body_of_its_own_is_retried_then_told():
    import kv

    async def busy(writer):
        body = b'{"error": "Service Unavailable"}'  # not ledgerkv's error model
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        await writer.drain()
        writer.close()

    fake = await _fake_server(busy)
    try:
        async with kv.AsyncClient(f"http://127.0.0.1:{fake.sockets[0].getsockname()[1]}", timeout=1) as c:
            with pytest.raises(kv.NotLeader, match="HTTP 503"):
                await c.put("k", b"v")
    finally:
        fake.close()


async def test_a_nodes_no_leader_answer_is_told_over_the_other_endpoints_silence():
    """A newcomer's run: two of three nodes down, the third without a leader. The client
    kept only its last error, so a connection refused from a dead endpoint replaced the
    live node's "no leader", and the user was told the cluster was not running."""
    import kv
    from kv.bench.harness import free_port

    said = "no leader could take the request in time (none is known); it was not carried out: retry shortly"

    async def no_leader(writer):
        body = json.dumps({"error": {"code": "NO_LEADER", "message": said}}).encode()
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        await writer.drain()
        writer.close()

    fake = await _fake_server(no_leader)
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    try:
        for start in range(3):  # whichever endpoint the client tries first
            async with kv.AsyncClient([f"http://127.0.0.1:{fake.sockets[0].getsockname()[1]}", *dead], timeout=1) as c:
                c.rotation.start_at(c.endpoints[start])
                for call in (lambda: c.put("k", b"v"), lambda: c.get("k")):
                    with pytest.raises(kv.NotLeader, match=re.escape(said)):
                        await call()
    finally:
        fake.close()


async def test_a_client_says_nothing_listens_once_for_a_loop_of_calls(caplog):
    """A newcomer's loop of puts against a stopped cluster printed the notice once per
    call (131 lines); a client says it once a minute."""
    import kv
    from kv.bench.harness import free_port

    async with kv.AsyncClient(f"http://127.0.0.1:{free_port()}", timeout=4.6) as c:  # the notice comes after 2 s of retries
        for _ in range(2):
            with pytest.raises(kv.Unavailable, match="no endpoint answered"):
                await c.get("k")
    assert [r.getMessage().startswith("nothing listens at") for r in caplog.records if r.name == "kv.client"] == [True]


@pytest.mark.parametrize("timeout", [0, -1, "abc", None, float("inf"), float("nan"), True])
def test_a_clients_timeout_must_be_a_positive_number(timeout):
    import kv

    with pytest.raises(kv.BadRequest, match="timeout is a number of seconds, more than 0"):
        kv.Client("http://127.0.0.1:9", timeout=timeout)


async def test_another_web_server_at_an_endpoint_is_not_taken_for_a_node():
    """Its 404 is not "no such key", and its 200 is not a value."""
    import kv

    async def html(status):
        async def answer(writer):
            body = b"<html><body>\n<h1>Not here</h1>\n</body></html>"
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: text/html\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            await writer.drain()
            writer.close()

        return answer

    for status in ("404 Not Found", "200 OK"):
        fake = await _fake_server(await html(status))
        url = f"http://127.0.0.1:{fake.sockets[0].getsockname()[1]}"
        try:
            async with kv.AsyncClient(url, timeout=2) as c:
                with pytest.raises(kv.Unavailable, match="is it a ledgerkv node's client URL"):
                    await c.get("greeting")
                if status.startswith("404"):
                    with pytest.raises(kv.KVError) as e:
                        await c.put("greeting", b"v")
                    assert "ledgerkv node" in str(e.value) and "\n" not in str(e.value), e.value
        finally:
            fake.close()


async def test_keys_with_dot_segments_and_control_characters_are_the_keys_given(api):
    """dd/x/../y is a key, not the path dd/y: the client used to let its URL library fold
    the dots (a newcomer stored dd/y and deleted pp/b that way), and a key with a newline
    matched no route."""
    import kv

    keys = ["dd/x/../y", "a/./b", "..", ".", "dd/y", "tab\tnl\n/x", "sp ace/%41?#"]
    async with kv.AsyncClient(f"http://{api.host}:{api.port}") as c:
        for i, k in enumerate(keys):
            await c.put(k, str(i).encode())
        assert sorted(it.key for it in await c.scan("")) == sorted(keys)
        assert [(await c.get(k)).value for k in keys] == [str(i).encode() for i in range(len(keys))]
        assert (await c.delete("dd/x/../y")).deleted and (await c.get("dd/y")).value == b"4"


async def test_delete_a_prefix_in_one_entry_with_a_delete_event_per_key(api):
    for k in ("dp/a", "dp/b/c", "dq/x"):
        await api.put(f"/v1/kv/{k}", data=b"v")
    r = await api.delete("/v1/kv")  # no prefix: a slip, refused
    assert r.status == 400 and "?prefix=" in (await r.json())["error"]["message"]
    watch = await api.get("/v1/watch", params={"prefix": "d"})
    r = await api.delete("/v1/kv", params={"prefix": "dp/"})
    d = await r.json()
    assert r.status == 200 and d["deleted"] == 2
    lines = []
    while len(lines) < 3:
        lines.append(json.loads(await watch.content.readline()))
    watch.close()
    assert [(x["type"], x.get("key"), x.get("index")) for x in lines[1:]] == [("delete", "dp/a", d["index"]), ("delete", "dp/b/c", d["index"])]
    assert (await api.get("/v1/kv/dp/a")).status == 404 and (await api.get("/v1/kv/dq/x")).status == 200
    assert (await (await api.delete("/v1/kv", params={"prefix": "dp/"})).json())["deleted"] == 0


async def test_a_page_of_large_values_stops_at_the_read_limit_and_paging_on_loses_nothing(tmp_path):
    """GET /v1/kv?limit=10000 over keys with 1 MiB values built one answer of up to 13 GiB
    in the node's memory. A page now ends once its keys and values reach
    --max-txn-read-bytes (one key at least), and `next` says where to read on."""
    import kv

    node, api = await make_client(tmp_path, max_txn_read_bytes=5000)
    try:
        keys = [f"big/{i:03d}" for i in range(30)] + [f"big/ü{i}" for i in range(5)]  # multi-byte keys count as bytes
        for k in keys:
            assert (await api.put(f"/v1/kv/{k}", data=b"x" * 900)).status == 200
        got, after, pages = [], None, 0
        while True:
            r = await api.get("/v1/kv", params={"prefix": "big/", "limit": "10000", **({"after": after} if after else {})})
            d = await r.json()
            size = sum(len(it["key"].encode()) + len(it["value"]) for it in d["items"])
            assert size < 5000 + 1000, size  # at most one value past the limit
            got += [it["key"] for it in d["items"]]
            pages += 1
            if d["next"] is None:
                break
            after = d["next"]
        assert got == sorted(keys) and pages >= 6  # every key once, in order, over several pages
        async with kv.AsyncClient(f"http://{api.host}:{api.port}") as c:
            assert [it.key for it in await c.scan("big/")] == sorted(keys)
        one = await (await api.get("/v1/kv", params={"prefix": "big/", "limit": "1"})).json()
        assert len(one["items"]) == 1 and one["next"] == one["items"][0]["key"]
    finally:
        await api.close()
        await node.stop()


def test_the_hint_every_endpoint_ends_with_is_said_once():
    """kv spark's 'no endpoint answered' lists each endpoint's failure, and the hint they all
    end with once (it was three times: a 700-character line); differing hints stay each
    with its endpoint."""
    from kv.client.endpoints import HINT, none_answered

    hint = "connection refused: is the cluster running (kv cluster up)?"
    answers = [(f"http://h:{p}", Exception(f"http://h:{p} did not answer (4 tries): refused{HINT}{hint}")) for p in (1, 2)]
    assert none_answered("no endpoint answered", answers) == (
        f"no endpoint answered: http://h:1 did not answer (4 tries): refused; http://h:2 did not answer (4 tries): refused{HINT}{hint}"
    )
    mixed = [("http://h:1", Exception(f"refused{HINT}{hint}")), ("http://h:2", Exception("401 unauthorized"))]
    assert none_answered("no endpoint answered", mixed) == f"no endpoint answered: http://h:1: refused{HINT}{hint}; http://h:2: 401 unauthorized"
