"""Watch over HTTP against real `kv serve` processes: a follower serving a watcher while
writes go elsewhere, the watched node killed mid-stream (the client resumes on another node,
each change exactly once), a start below the compacted ledger (410), a reader that stalls
(its stream ends, the node's buffer stays bounded), many watchers at once, and `kv watch`."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys

import aiohttp
import orjson
import pytest
from cluster import ProcCluster

import kv
from kv.bench.harness import poll

pytestmark = pytest.mark.slow

BUFFER = 200_000  # --watch-buffer-bytes of the shared cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = ProcCluster(str(tmp_path_factory.mktemp("watch")), extra=["--watch-progress-ms", "200", "--watch-buffer-bytes", str(BUFFER)])
    c.start()
    c.leader()
    yield c
    c.close()


def roles(c: ProcCluster) -> tuple[str, list[str]]:
    lead = c.leader()
    return lead, [i for i in c.ids if i != lead and c.alive(i)]


async def collect(watch, n: int, timeout: float = 60.0) -> list[kv.Event]:
    out = []

    async def run():
        async for ev in watch:
            out.append(ev)
            if len(out) == n:
                return

    try:
        await asyncio.wait_for(run(), timeout)
    finally:
        await watch.aclose()
    return out


async def test_a_follower_streams_the_changes_written_through_other_nodes(cluster):
    lead, (f, other) = roles(cluster)
    async with kv.AsyncClient(cluster.url(f)) as wc, kv.AsyncClient([cluster.url(lead), cluster.url(other)]) as writer:
        await writer.put("f/seed", b"0")
        page = await wc.scan_page("f/")  # list, then watch from the index it read at
        assert [i.key for i in page.items] == ["f/seed"]
        watching = asyncio.ensure_future(collect(wc.watch("f/", page.index + 1), 46))
        expected = []
        for i in range(40):
            r = await writer.put(f"f/{i % 7}", b"v%d" % i)
            expected.append((r.index, f"f/{i % 7}", b"v%d" % i))
        with pytest.raises(kv.PreconditionFailed):
            await writer.put("f/0", b"no", if_mod_index=1)  # a failed CAS is no change
        await writer.put("elsewhere", b"x")
        t = await writer.txn([kv.Cond("f/1", "exists", True)], [kv.Put("f/a", b"A"), kv.Delete("f/1"), kv.Delete("f/missing")], [kv.Put("f/no", b"!")])
        expected += [(t.index, "f/a", b"A"), (t.index, "f/1", None)]
        t = await writer.txn(ops=[kv.Put("f/dup", b"one"), kv.Put("f/dup", b"two")])  # one key twice at one index
        expected += [(t.index, "f/dup", b"one"), (t.index, "f/dup", b"two")]
        d = await writer.delete("f/2")
        expected.append((d.index, "f/2", None))
        d2 = await writer.delete("f/never")  # deleting nothing is no change
        assert not d2.deleted
        r = await writer.put("f/last", b"end")
        expected.append((r.index, "f/last", b"end"))
        events = await watching
    assert [(e.index, e.key, e.value) for e in events] == expected
    assert all(e.mod_index == e.index and e.type == ("delete" if e.value is None else "put") for e in events)


async def test_idle_streams_send_progress_and_reads_say_their_index(cluster):
    lead, (f, _) = roles(cluster)
    code, headers, _ = cluster.request(f, "PUT", "/v1/kv/p/x", b"1")
    assert code == 200
    code, headers, body = cluster.request(f, "GET", "/v1/kv/p/x")
    assert code == 200 and int(headers["X-Kv-Index"]) >= 1
    async with aiohttp.ClientSession() as s:
        async with s.get(cluster.url(f) + "/v1/watch", params={"prefix": "p/"}) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("application/x-ndjson")
            first = orjson.loads(await asyncio.wait_for(resp.content.readline(), 10))
            second = orjson.loads(await asyncio.wait_for(resp.content.readline(), 10))  # --watch-progress-ms 200
    assert first["type"] == "progress" and second["type"] == "progress" and second["index"] >= first["index"]
    for bad in ("from=0", "from=x"):
        code, _, body = cluster.request(f, "GET", f"/v1/watch?{bad}")
        assert code == 400 and orjson.loads(body)["error"]["code"] == "BAD_REQUEST"


async def test_the_watched_node_killed_mid_stream_the_client_resumes_elsewhere_exactly_once(cluster):
    lead, (f, other) = roles(cluster)
    urls = [cluster.url(f), cluster.url(other), cluster.url(lead)]
    writes: list[tuple[int, str]] = []
    async with kv.AsyncClient(urls, timeout=20) as wc, kv.AsyncClient(cluster.url(lead)) as writer:
        wc.rotation.start_at(urls[0])  # watch the follower first
        start = (await wc.scan_page("k/", consistency="stale")).index + 1
        events: list[kv.Event] = []
        done, flowing = asyncio.Event(), asyncio.Event()

        async def watch():
            async for ev in wc.watch("k/", start, idle_timeout=2.0):
                events.append(ev)
                if len(events) >= 50:
                    flowing.set()
                if done.is_set() and len(events) >= len(writes):
                    return

        watching = asyncio.ensure_future(watch())
        for i in range(300):
            r = await writer.put(f"k/{i}", b"%d" % i)
            writes.append((r.index, f"k/{i}"))
            if i == 100:
                await asyncio.wait_for(flowing.wait(), 30)  # the stream from the follower is flowing
                cluster.kill(f)
        done.set()
        await asyncio.wait_for(watching, 60)
    cluster.start(f)
    assert [(e.index, e.key) for e in events] == writes


async def test_a_stalled_reader_is_cut_off_and_the_buffer_stays_bounded(cluster):
    lead, (f, _) = roles(cluster)
    applied = cluster.status(f)["applied_index"]
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = cluster.http[f].split(":")
    sock.connect((host, int(port)))
    sock.sendall(f"GET /v1/watch?prefix=big/&from={applied + 1} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    value = b"v" * 100_000
    most = 0
    indexes = []
    for i in range(150):  # 15 MB: more than the socket buffers hold
        code, body = cluster.put(lead, f"big/{i}", value)
        assert code == 200
        indexes.append(body["index"])
        most = max(most, metric(cluster, f, "kv_watch_buffered_bytes"))
    assert most <= BUFFER + len(value) + 200  # the bound, plus the one change that crossed it
    raw = b""
    sock.settimeout(30)
    while chunk := sock.recv(1 << 20):
        raw += chunk
    sock.close()
    lines = [orjson.loads(x) for x in dechunk(raw.split(b"\r\n\r\n", 1)[1]).splitlines()]
    got = [d["index"] for d in lines if d["type"] == "put"]
    assert lines[-1]["type"] == "error" and lines[-1]["code"] == "SLOW_WATCHER", lines[-1]
    assert got == indexes[: len(got)] and len(got) < len(indexes)
    # It resumes from the last index it saw + 1, like any other watcher.
    async with kv.AsyncClient(cluster.url(f)) as wc:
        rest = await collect(wc.watch("big/", (got[-1] if got else applied) + 1), len(indexes) - len(got))
    assert got + [e.index for e in rest] == indexes


async def test_two_hundred_watchers_on_one_node(cluster):
    lead, (f, _) = roles(cluster)
    async with kv.AsyncClient(cluster.url(f), connections=400) as wc, kv.AsyncClient(cluster.url(lead)) as writer:
        start = (await wc.scan_page("m/", consistency="stale")).index + 1
        watchers = [asyncio.ensure_future(collect(wc.watch("m/", start), 20, timeout=120)) for _ in range(200)]
        # Every stream is open before the writes.
        await poll(lambda: metric(cluster, f, "kv_watches") >= 200, timeout=60, error="200 watches not open")
        expected = [(await writer.put(f"m/{i}", b"%d" % i)).index for i in range(20)]
        results = await asyncio.gather(*watchers)
    assert all([e.index for e in r] == expected for r in results)


def test_kv_watch_prints_changes_as_they_come(cluster):
    lead, (f, _) = roles(cluster)
    start = cluster.status(f)["applied_index"] + 1
    cmd = [sys.executable, "-m", "kv", "watch", "cli/", "--from", str(start), "-o", "json", "--endpoints", cluster.url(f)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        puts = [cluster.put(lead, f"cli/{i}", b"\xff" if i == 2 else b"v%d" % i)[1]["index"] for i in range(3)]
        lines = [orjson.loads(p.stdout.readline()) for _ in range(3)]
    finally:
        p.terminate()
        p.wait(10)
    assert [(d["index"], d["key"]) for d in lines] == [(ix, f"cli/{i}") for i, ix in enumerate(puts)]
    assert lines[0]["value"] == "v0" and lines[2] == {"type": "put", "key": "cli/2", "value": "/w==", "encoding": "base64", "mod_index": puts[2], "index": puts[2]}


def test_a_start_below_the_compacted_ledger_is_410(tmp_path):
    c = ProcCluster(str(tmp_path), n=1, extra=["--snapshot-threshold", "30", "--snapshot-trailing", "5"])
    try:
        c.start()
        c.leader()
        for i in range(80):
            assert c.put("n1", f"c/{i}", b"x")[0] == 200
        begin = c.status("n1")["ledger_begin_index"]
        assert begin > 1
        code, _, body = c.request("n1", "GET", "/v1/watch?prefix=c/&from=1")
        err = orjson.loads(body)
        assert code == 410 and err["error"]["code"] == "COMPACTED" and err["error"]["ledger_begin_index"] == begin
        assert "watch from" in err["error"]["message"]

        async def check():
            async with kv.AsyncClient(c.url("n1")) as wc:
                with pytest.raises(kv.Compacted):
                    await collect(wc.watch("c/", 1), 1, timeout=30)
                # From the first index the ledger holds, the history is there.
                first = await collect(wc.watch("c/", begin + 1), 1, timeout=30)
                assert first[0].index >= begin + 1

        asyncio.run(check())
    finally:
        c.close()


def metric(c: ProcCluster, i: str, name: str) -> float:
    _, _, body = c.request(i, "GET", "/metrics")
    m = re.search(rf"^{name} (\S+)$", body.decode(), re.M)
    return float(m.group(1)) if m else 0.0


def dechunk(data: bytes) -> bytes:
    """The body of an HTTP/1.1 chunked response."""
    out, pos = [], 0
    while True:
        eol = data.index(b"\r\n", pos)
        size = int(data[pos:eol].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(data[eol + 2 : eol + 2 + size])
        pos = eol + 2 + size + 2



def test_the_sync_client_lists_then_watches(cluster):
    lead, (f, _) = roles(cluster)
    with kv.Client([cluster.url(f)]) as c:
        c.put("sy/0", b"before")
        page = c.scan_page("sy/")
        assert [i.key for i in page.items] == ["sy/0"] and page.index >= 1
        events = c.watch("sy/", page.index + 1)
        writes = [cluster.put(lead, f"sy/{i}", b"after")[1]["index"] for i in range(1, 4)]
        assert [next(events).index for _ in range(3)] == writes
        events.close()


async def test_a_bounded_range_ends_after_its_last_index(cluster):
    """`to=N`: the changes up to N, a last progress line at N, then the stream ends."""
    lead, (f, _) = roles(cluster)
    async with kv.AsyncClient(cluster.url(lead)) as writer:
        first = (await writer.put("range/a", b"1")).index
        await writer.put("range/b", b"2")
        mid = (await writer.delete("range/a")).index
        await writer.put("range/c", b"3")
    cluster.wait_converged()
    async with aiohttp.ClientSession() as s:
        async with s.get(cluster.url(f) + "/v1/watch", params={"prefix": "range/", "from": str(first), "to": str(mid)}) as r:
            assert r.status == 200
            lines = [orjson.loads(x) for x in (await asyncio.wait_for(r.read(), 10)).splitlines()]
        assert [(d["type"], d.get("key")) for d in lines[1:]] == [("put", "range/a"), ("put", "range/b"), ("delete", "range/a"), ("progress", None)]
        assert lines[-1]["index"] == mid
        async with s.get(cluster.url(f) + "/v1/watch", params={"from": str(mid), "to": str(first)}) as r:
            assert r.status == 400
    async with kv.AsyncClient([cluster.url(i) for i in cluster.ids]) as c:
        got = [ev async for ev in c.watch("range/", first, end_index=mid)]
        assert [(ev.type, ev.key) for ev in got] == [("put", "range/a"), ("put", "range/b"), ("delete", "range/a")]
