"""The README's examples run as written, and CI runs the README's test command."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def run_python(code: str, cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("n", [0, 1])
def test_embedded_examples_run(n, tmp_path):
    r = run_python(BLOCKS[n], str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]


def test_metadata_store_example_does_what_it_says(tmp_path):
    out = run_python(BLOCKS[0], str(tmp_path)).stdout
    assert "refused:" in out and "delete hosts/7" in out


def test_metadata_store_example_runs_unchanged_against_a_cluster_and_again(tmp_path):
    """As the README says: kv.Client in place of kv.open, from another process; and a
    second run against the same data (a user runs an example more than once)."""
    from cluster import ProcCluster

    c = ProcCluster(str(tmp_path / "cluster"), n=1, proxies=False)
    try:
        c.start()
        c.leader()
        code = BLOCKS[0].replace("kv.open(tempfile.mkdtemp())", f"kv.Client({c.url(c.ids[0])!r})")
        assert code != BLOCKS[0]
        outs = []
        for _ in range(2):
            r = run_python(code, str(tmp_path))
            assert r.returncode == 0, r.stderr[-3000:]
            outs.append(r.stdout)
        assert "created services/db" in outs[0] and "services/db was there already" in outs[1]
        assert all("refused:" in out and "delete hosts/7" in out for out in outs)
    finally:
        c.close()


@pytest.mark.slow
@pytest.mark.spark
def test_spark_example_runs_against_a_real_cluster(tmp_path):
    pytest.importorskip("pyspark", reason="the spark extra is not installed")
    from cluster import ProcCluster

    c = ProcCluster(str(tmp_path / "cluster"), proxies=False)
    try:
        c.start()
        c.leader()
        code = next(b for b in BLOCKS if "import kv.spark" in b)  # not by position: other examples come first
        for i, nid in enumerate(c.ids, 1):
            code = code.replace(f"http://127.0.0.1:800{i}", c.url(nid))
        r = run_python(code, str(tmp_path))
        assert r.returncode == 0, r.stderr[-3000:]
        assert "imported 100000 rows" in r.stdout
        assert os.path.isdir(tmp_path / "users.parquet")
        # Nothing was written after the export: the feed from its index on is empty.
        assert re.search(r"changes since the export: (\d+)", r.stdout).group(1) == "0", r.stdout
        counts = dict(re.findall(r"\|\s*(put|delete)\s*\|\s*(\d+)\s*\|", r.stdout))  # the raw log's ops, shown
        assert int(counts["put"]) >= 100_000, r.stdout
    finally:
        c.close()


def test_ci_runs_the_readme_test_command():
    command = ".venv/bin/python -m pytest"
    assert f"pip install -e '.[test]' && {command}" in README
    assert command in open(os.path.join(ROOT, ".ci", "run")).read()
    assert ".venv/bin/kv cluster up" in README


def test_metadata_store_example_runs_unchanged_against_a_cluster_with_kv_client(tmp_path):
    """The same example with `kv.open(...)` swapped for `kv.Client(endpoints)`: one API."""
    from cluster import ProcCluster

    assert "kv.open(tempfile.mkdtemp())" in BLOCKS[0]
    c = ProcCluster(str(tmp_path / "cluster"), proxies=False)
    try:
        c.start()
        c.leader()
        code = BLOCKS[0].replace("kv.open(tempfile.mkdtemp())", f"kv.Client({','.join(c.url(i) for i in c.ids)!r})")
        r = run_python(code, str(tmp_path))
        assert r.returncode == 0, r.stderr[-3000:]
        assert "refused:" in r.stdout and "delete hosts/7" in r.stdout, r.stdout
    finally:
        c.close()
