"""Every `kv bench` runs to the end, with tiny sizes, and reports figures: a benchmark that
rots (a renamed attribute, a limit it now exceeds) fails here, not in front of a user.
The figures themselves are not judged (a shared test machine says nothing about speed)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

RUNS = {
    "commit": ["--seconds", "0.5", "--concurrency", "4"],
    "http": ["--seconds", "0.5", "--concurrency", "4"],
    "failover": ["--runs", "1"],
    "snapshot": ["--keys", "2000", "--seconds", "0.5"],
    "watch": ["--events", "300", "--watchers", "3", "--rate", "50", "--idle", "5", "--seconds", "1"],
    "lease": ["--leases", "30", "--ttl", "3", "--seconds", "1", "--rounds", "2"],
    "history": ["--versions", "3000", "--keys", "100"],
}


@pytest.mark.parametrize("bench", sorted(RUNS))
def test_bench_runs_and_reports(bench, tmp_path):
    out = tmp_path / "figures.json"
    r = subprocess.run([sys.executable, "-m", "kv", "bench", bench, *RUNS[bench], "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    rows = [row for part in doc.values() if isinstance(part, list) for row in part]
    assert rows, doc
    for row in rows:
        assert not row.get("errors") and not row.get("put_errors"), row
    numbers = [v for row in rows for v in row.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    assert any(v > 0 for v in numbers), rows


def test_ab_runs_and_reports(tmp_path):
    """benchmarks/ab.py, the A/B of kv serve settings, with one tiny round."""
    import os
    import re

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "ab.py")
    argv = [sys.executable, script, "--variant", "fast=", "--variant", "aiohttp=--http-aiohttp-only", "--seconds", "0.5", "--rounds", "1"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    medians = re.findall(r"^  (fast|aiohttp) +([0-9,]+)/s", r.stdout, re.M)
    assert [name for name, _ in medians] == ["fast", "aiohttp"], r.stdout
    assert all(int(ops.replace(",", "")) > 0 for _, ops in medians), r.stdout


def test_load_generator_reads_each_framing_and_refuses_what_it_cannot_frame():
    """kv/bench/loadgen.py, the benchmarks' HTTP client: a response split anywhere, chunked
    with a trailer, Connection: close, and garbage."""
    from kv.bench.loadgen import _parse

    whole = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"index\":1}HTTP/1.1 404"
    for cut in range(len(whole) - len(b"HTTP/1.1 404")):
        assert _parse(bytearray(whole[:cut])) is None
    assert _parse(bytearray(whole)) == (200, b'{"index":1}', len(whole) - len(b"HTTP/1.1 404"), True)
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nab\r\n\r\n3;x=1\r\ncde\r\n0\r\nX-T: 1\r\n\r\n"
    for cut in range(len(chunked)):
        assert _parse(bytearray(chunked[:cut])) is None
    assert _parse(bytearray(chunked)) == (200, b"ab\r\ncde", len(chunked), True)
    assert _parse(bytearray(b"HTTP/1.1 503 x\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"))[::3] == (503, False)
    with pytest.raises(ValueError):
        _parse(bytearray(b"SSH-2.0-OpenSSH\r\n\r\n"))
    with pytest.raises(ValueError):
        _parse(bytearray(b"HTTP/1.1 200 OK\r\n\r\nno framing"))


async def test_load_generator_against_a_real_node(tmp_path):
    """The ops the benchmarks drive, against one real `kv serve`: writes land, reads see
    them, a refused request raises with its status, and a closed connection is replaced."""
    from kv.bench.loadgen import HttpLoad, Target, ok
    from kv.bench.measure import http_ops, http_session
    from kv.bench.harness import ServeCluster

    with ServeCluster(str(tmp_path), 1) as c:
        c.start()
        async with http_session(4) as s, HttpLoad() as load:
            lead = await c.leader(s)
            ops = dict(await http_ops(load, c.url(lead), b"v" * 300, keys=5))
            for i in range(5):
                await ops["PUT"](i)
            for op in ("GET linearizable", "GET stale"):
                for i in range(5):
                    await ops[op](i)
            async with s.get(c.url(lead) + "/v1/kv/bench/3") as r:
                assert await r.read() == b"v" * 300
            t = Target(load, c.url(lead))
            with pytest.raises(RuntimeError, match="HTTP 404"):
                ok(*await t.request(b"GET", b"/v1/kv/no-such-key"))
            for conn in list(load._all):
                conn.transport.close()
            await asyncio.sleep(0.05)
            assert (await t.request(b"GET", b"/v1/kv/bench/1"))[0] == 200
