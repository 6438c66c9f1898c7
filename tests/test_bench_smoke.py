"""Every `kv bench` runs to the end, with tiny sizes, and reports figures: a benchmark that
rots (a renamed attribute, a limit it now exceeds) fails here, not in front of a user.
The figures themselves are not judged (a shared test machine says nothing about speed)."""

from __future__ import annotations

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
