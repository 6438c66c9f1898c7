"""The Spark pipeline on a standalone Spark cluster started by the test (a master and one
worker of one core, as `spark-class ...deploy.master.Master` / `...deploy.worker.Worker`
start them), not local mode: `kv spark import --master spark://...` with the worker
killed -9 mid-import and a new one started, then `kv spark export` of the cluster, whose executors read
their key ranges of a view the leader pinned, over HTTP (no folder shared with the driver).
Every row arrives once with its exact value, the summary counts every row as written (the
retried tasks' rows too), and the export matches the source."""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from cluster import ProcCluster

pyspark = pytest.importorskip("pyspark", reason="the spark extra is not installed (pip install -e '.[spark]')")

import kv  # noqa: E402
from kv.bench.harness import free_port, wait_until  # noqa: E402

# A soak run (--soak or KV_SOAK=1): its four JVMs on a 2-core machine weigh on the timed
# tests beside it, and it takes 80-90 s of the default run's 15 minutes.
pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.soak]

ROWS = 40_000


class Standalone:
    """A master and its workers, each in a process group of its own (a worker's executors
    are its children): kill_worker takes the executor down with it."""

    def __init__(self, root: str) -> None:
        self.root = root
        home = os.path.dirname(pyspark.__file__)
        self.spark_class = os.path.join(home, "bin", "spark-class")
        self.env = {**os.environ, "SPARK_HOME": home, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable, "SPARK_NO_DAEMONIZE": "1"}
        self.port = free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []

    def _start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(os.path.join(self.root, f"{name}.log"), "ab")
        p = subprocess.Popen([self.spark_class, *args], stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.procs.append(p)
        return p

    def start_master(self) -> None:
        self._start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(self.port), "--webui-port", str(free_port()))

    def start_worker(self, name: str) -> subprocess.Popen:
        work = os.path.join(self.root, f"work-{name}")
        os.makedirs(work, exist_ok=True)
        return self._start(name, "org.apache.spark.deploy.worker.Worker", self.url, "--host", "127.0.0.1", "--cores", "1", "--memory", "1g",
                           "--webui-port", str(free_port()), "--work-dir", work)

    def kill(self, p: subprocess.Popen) -> None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=30)

    def stop(self) -> None:
        for p in reversed(self.procs):
            self.kill(p)


@pytest.fixture
def standalone(tmp_path):
    s = Standalone(str(tmp_path))
    try:
        s.start_master()
        yield s
    finally:
        s.stop()


def test_import_survives_a_killed_worker_and_exports_match_on_a_standalone_cluster(standalone, tmp_path):
    source = tmp_path / "rows.csv"
    with open(source, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["key", "value"])
        for i in range(ROWS):
            w.writerow([f"sa/{i:06d}", f"value {i} " + "x" * (i % 200)])
    c = ProcCluster(str(tmp_path / "kv"), proxies=False)
    try:
        c.start()
        c.leader()
        eps = ",".join(c.url(i) for i in c.ids)
        first = standalone.start_worker("worker1")
        env = {**standalone.env, "KV_ENDPOINTS": eps}
        imp = subprocess.Popen([sys.executable, "-m", "kv", "spark", "import", str(source), "--master", standalone.url, "--partitions", "4", "--concurrency", "2"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        with kv.Client(eps) as client:
            def some_written() -> bool:
                return imp.poll() is not None or sum(1 for _ in client.scan("sa/", limit=2_000)) >= 2_000

            wait_until(some_written, 240, "the import writing its first rows")
            assert imp.poll() is None, "the import ended before the worker could be killed: raise ROWS"
            standalone.kill(first)  # the worker and its executor, mid-import
            time.sleep(2)
            standalone.start_worker("worker2")
            out, err = imp.communicate(timeout=600)
            assert imp.returncode == 0, err[-3000:]
            assert f"{ROWS} written, 0 skipped" in out and ", 0 failed" in out, out  # the retried tasks' rows counted as written once
            held = {it.key: it.value for it in client.scan("sa/")}
        assert len(held) == ROWS
        with open(source, newline="") as f:
            rows = list(csv.reader(f))[1:]
        assert all(held[k] == v.encode() for k, v in rows)
        mods = {}
        with kv.Client(eps) as client:
            for it in client.scan("sa/"):
                mods[it.key] = it.mod_index
        exported = tmp_path / "export.parquet"
        r = subprocess.run([sys.executable, "-m", "kv", "spark", "export", str(exported), "--master", standalone.url, "--prefix", "sa/", "--value-type", "string"],
                           capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        # The executors read their key ranges of a view the leader pinned, from that node
        # (no file shared with the driver, no snapshot written), and the driver let it go.
        calls = {}
        for i in c.ids:
            with urllib.request.urlopen(c.url(i) + "/metrics", timeout=10) as resp:
                for m in re.finditer(r'kv_http_request_duration_seconds_count\{route="(export_\w+|snapshot_\w+)",status="(\d+)"\} (\S+)', resp.read().decode()):
                    calls[m.group(1), m.group(2)] = calls.get((m.group(1), m.group(2)), 0) + float(m.group(3))
        assert calls.get(("export_open", "200")) == 1 and calls.get(("export_close", "200")) == 1, calls
        assert calls.get(("export_read", "200"), 0) >= 2 and not any(route.startswith("snapshot_") for route, _ in calls), calls
        import pyarrow.parquet as pq

        table = pq.read_table(str(exported)).to_pydict()
        assert sorted(zip(table["key"], table["value"])) == sorted((k, v) for k, v in rows)
        assert all(mods[k] == m for k, m in zip(table["key"], table["mod_index"]))
    finally:
        c.close()
