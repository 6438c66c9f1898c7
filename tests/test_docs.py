"""The examples of the README and the docs run as written, every Python block of them is
run by a test here, the docs site builds with --strict, and CI runs the README's test
command."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()


def page(name: str) -> str:
    with open(os.path.join(ROOT, "docs", name)) as f:
        return f.read()


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


BLOCKS = python_blocks(page("metadata-store.md"))  # kv.open in a temporary dir: they run alone
COORDINATION = python_blocks(page("coordination.md"))
SPARK = python_blocks(page("spark.md"))
ETCD = python_blocks(page("etcd.md"))  # python-etcd3, from the venv of tests/compat/python_etcd3.py


def test_every_python_block_of_the_docs_is_run_here():
    pages = ["README.md"] + [os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs"))) if f.endswith(".md")]
    every = [b for p in pages for b in python_blocks(open(os.path.join(ROOT, p)).read())]
    assert sorted(every) == sorted(BLOCKS + COORDINATION + SPARK + ETCD), "a Python block no test runs: add it to a test in this file"
    assert len(BLOCKS) == 2 and len(COORDINATION) == 1 and len(SPARK) == 1 and len(ETCD) == 1


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
    with example_on_a_cluster(tmp_path, SPARK[0]) as (_, r):
        assert "imported 100000 rows" in r.stdout
        assert os.path.isdir(tmp_path / "users.parquet")
        # Nothing was written after the export: the feed from its index on is empty.
        assert re.search(r"changes since the export: (\d+)", r.stdout).group(1) == "0", r.stdout
        counts = dict(re.findall(r"\|\s*(put|delete)\s*\|\s*(\d+)\s*\|", r.stdout))  # the raw log's ops, shown
        assert int(counts["put"]) >= 100_000, r.stdout


@contextlib.contextmanager
def example_on_a_cluster(tmp_path, code: str):
    """Run an example written for `kv cluster up` (nodes on 127.0.0.1:8001-8003) against a
    real three-node cluster on free ports; yields the cluster and the finished run."""
    from cluster import ProcCluster

    c = ProcCluster(str(tmp_path / "cluster"), proxies=False)
    try:
        c.start()
        c.leader()
        ours = code
        for i, nid in enumerate(c.ids, 1):
            ours = ours.replace(f"http://127.0.0.1:800{i}", c.url(nid))
        assert ours != code
        r = run_python(ours, str(tmp_path))
        assert r.returncode == 0, r.stderr[-3000:]
        yield c, r
    finally:
        c.close()


def test_the_etcd_page_example_runs_with_python_etcd3_against_a_follower(tmp_path):
    """docs/etcd.md's python-etcd3 example, as written but for the port (the page's is
    `kv cluster up`'s n2), against a follower of a three-node cluster."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "compat"))
    from cluster import ProcCluster
    from python_etcd3 import suite

    python, _ = suite()
    c = ProcCluster(str(tmp_path / "cluster"), proxies=False)
    grpc = c.serve_etcd_api()
    try:
        c.start()
        follower = next(i for i in c.ids if i != c.leader())
        code = ETCD[0].replace("port=8202", f"port={grpc[follower].rsplit(':', 1)[1]}") + "assert value == b'1' and meta.version == 1\n"
        r = subprocess.run([python, "-c", code], cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
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


def test_coordination_example_runs_against_a_cluster(tmp_path):
    with example_on_a_cluster(tmp_path, COORDINATION[0]) as (c, r):
        lines = r.stdout.splitlines()
        assert lines[0] == "b'host-a'" and re.fullmatch(r"fencing token: \d+", lines[1]), r.stdout
        assert "lost it" not in r.stdout  # a resign is no loss
        with kv_client(c) as client:
            assert client.get("services/api/host-a") is None  # its lease was revoked
            assert list(client.scan("scheduler/")) == [] and list(client.scan("jobs/nightly/")) == []  # resigned, released


def kv_client(c):
    import kv

    return kv.Client(",".join(c.url(i) for i in c.ids))


def test_docs_site_builds_strict(tmp_path):
    """mkdocs build --strict: every page in the nav, every link and anchor resolved, the
    HTTP reference rendered from http/openapi.json, the Python reference from the docstrings."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed")
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    reference = (site / "http-reference" / "index.html").read_text()
    import json

    spec = json.load(open(os.path.join(ROOT, "http", "openapi.json")))
    for path, ops in spec["paths"].items():
        for method in ops:
            if method in ("get", "put", "post", "delete"):
                assert f"{method.upper()} {path}" in reference.replace("&amp;", "&"), (method, path)
    api = (site / "python-api" / "index.html").read_text()
    from test_layout import STORE_API

    faces = ("kv.store.Store", "kv.node.Node", "kv.client.async_client.AsyncClient", "kv.client.blocking.Client")
    missing = [f"{face}.{name}" for face in faces for name in STORE_API if f'id="{face}.{name}"' not in api]
    missing += [f"kv.client.recipes.{m}" for m in ("Lease.alive", "Lease.revoke", "Election.leader", "Election.resign", "Election.is_leader") if f'id="kv.client.recipes.{m}"' not in api]
    assert not missing, f"the Python reference does not show: {missing}"
    assert "PreconditionFailed" in api and "WriteResult" in api
