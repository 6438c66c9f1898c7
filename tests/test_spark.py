"""The Spark pipeline with a real local SparkSession (local[2]) and a real 3-node cluster."""

from __future__ import annotations

import glob
import os
import struct
import subprocess
import sys
import time

import pytest
from cluster import ProcCluster

pyspark = pytest.importorskip("pyspark", reason="the spark extra is not installed (pip install -e '.[spark]')")

import kv  # noqa: E402
import kv.spark as kvspark  # noqa: E402
from kv import BadRequest  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(scope="module")
def spark():
    # local[2,2]: two cores, and a failed task is tried once more (local[2] gives up at the
    # first failure), as on a cluster: test_a_retried_task_is_counted_once needs that.
    s = kvspark.session("local[2,2]", "ledgerkv-tests")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = ProcCluster(str(tmp_path_factory.mktemp("spark")), proxies=False)
    c.start()
    c.leader()
    yield c
    c.close()


def endpoints(c: ProcCluster) -> str:
    return ",".join(c.url(i) for i in c.ids)


def test_import_50k_rows_then_again_changes_nothing(spark, cluster):
    df = spark.range(50_000).selectExpr("concat('imp/', lpad(cast(id as string), 6, '0')) as key", "concat('v', cast(id * 7 as string)) as value")
    report = kvspark.write(df, endpoints(cluster))
    assert report.rows == 50_000 and not report.failures and report.written == 50_000
    lead = cluster.leader()
    cluster.wait_converged()
    data = {k: (v, m) for k, v, m in cluster.dump(lead) if k.startswith("imp/")}
    assert len(data) == 50_000
    import base64

    assert base64.b64decode(data["imp/012345"][0]) == b"v%d" % (12345 * 7)
    for probe in (0, 31_337, 49_999):  # and by plain HTTP reads against other nodes
        code, body, _ = cluster.get(cluster.ids[probe % 3], f"imp/{probe:06d}")
        assert code == 200 and body == b"v%d" % (probe * 7)
    again = kvspark.write(df, endpoints(cluster))
    assert again.rows == 50_000 and again.written == 0 and again.skipped == 50_000 and not again.failures
    after = {k: (v, m) for k, v, m in cluster.dump(lead) if k.startswith("imp/")}
    assert after == data  # not a value, not a mod_index moved


def test_binary_columns_and_files(spark, cluster, tmp_path):
    from pyspark.sql.types import BinaryType, StringType, StructField, StructType

    rows = [(f"bin/{i}", bytes([i % 256, 0, 255])) for i in range(300)]
    df = spark.createDataFrame(rows, StructType([StructField("key", StringType()), StructField("value", BinaryType())]))
    path = str(tmp_path / "in.parquet")
    df.write.parquet(path)
    r = subprocess.run(
        [sys.executable, "-m", "kv", "spark", "import", path, "--endpoints", endpoints(cluster)],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "imported 300 rows" in r.stdout
    assert r.stderr == ""  # no JVM start-up chatter (log4j, NativeCodeLoader, incubator modules)
    code, body, _ = cluster.get(cluster.ids[0], "bin/7")
    assert code == 200 and body == bytes([7, 0, 255])


def test_bad_column_types_and_rows_are_refused(spark, cluster):
    nums = spark.range(10).selectExpr("cast(id as string) as key", "array(id) as value")
    with pytest.raises(BadRequest, match="the value is a array"):
        kvspark.write(nums, endpoints(cluster))
    with pytest.raises(BadRequest, match="no column 'k'"):
        kvspark.write(nums, endpoints(cluster), key_col="k")
    nulls = spark.createDataFrame([("a", "1"), (None, "2")], "key string, value string")
    with pytest.raises(BadRequest, match="1 row with a null key"):
        kvspark.write(nulls, endpoints(cluster))


def test_export_a_100k_key_snapshot_to_parquet(spark, cluster, tmp_path):
    df = spark.range(100_000).selectExpr("concat('exp/', lpad(cast(id as string), 6, '0')) as key", "cast(concat('x', cast(id as string)) as binary) as value")
    assert not kvspark.write(df, endpoints(cluster)).failures
    lead = cluster.leader()
    assert cluster.request(lead, "POST", "/v1/snapshot")[0] == 200
    snap = kvspark.fetch_snapshot(cluster.url(lead), directory=str(tmp_path))
    out = str(tmp_path / "out.parquet")
    kvspark.read_snapshot(spark, snap, prefix="exp/", partitions=4).write.parquet(out)
    got = spark.read.parquet(out)
    assert got.rdd.getNumPartitions() >= 2
    rows = {r.key: (bytes(r.value), r.mod_index) for r in got.collect()}
    import base64

    live = {k: (base64.b64decode(v), m) for k, v, m in cluster.dump(lead) if k.startswith("exp/")}
    assert len(rows) == 100_000 and rows == live
    # The whole snapshot, through the command line.
    out2 = str(tmp_path / "all.parquet")
    r = subprocess.run([sys.executable, "-m", "kv", "spark", "export", out2, "--snapshot", snap], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert spark.read.parquet(out2).count() == len(cluster.dump(lead))
    assert os.path.getsize(snap) > 0


def test_change_feed_exports_a_committed_log_range_raw(spark, cluster, tmp_path):
    lead = cluster.leader()
    code, first = cluster.put(lead, "feed/a", b"1")
    assert code == 200
    assert cluster.request(lead, "PUT", "/v1/kv/feed/a", b"2", {"If-Match": f'"{first["index"]}"'})[0] == 200
    assert cluster.request(lead, "DELETE", "/v1/kv/feed/a")[0] == 200
    rows = spark.range(5_000).selectExpr("concat('feed/', cast(id as string)) as key", "cast(id as string) as value")
    assert not kvspark.write(rows, endpoints(cluster), batch_rows=125).failures  # 40 bulk puts
    cluster.wait_converged()
    end = cluster.status(cluster.ids[0])["applied_index"]
    start = first["index"]

    df = kvspark.read_log(spark, endpoints(cluster), start, end, partitions=3)
    assert df.rdd.getNumPartitions() == 3
    got = df.orderBy("index").collect()
    assert sorted({r["index"] for r in got}) == list(range(start, end + 1))  # every index appears
    head = [(r["op"], r["key"], r["value"] and bytes(r["value"]), r["conditional"], r["branch"]) for r in got[:3]]
    assert head == [("put", "feed/a", b"1", False, None), ("put", "feed/a", b"2", True, None), ("delete", "feed/a", None, False, None)]
    imported = [r for r in got if r["key"] and r["key"].startswith("feed/") and r["key"] != "feed/a"]
    # An import batch is a bulk put: each row conditional on its key's mod_index.
    assert len(imported) == 5_000 and {(r["op"], r["conditional"], r["branch"]) for r in imported} == {("put", True, None)}
    assert len({r["index"] for r in imported}) == 40
    assert {r["key"]: bytes(r["value"]) for r in imported}["feed/4321"] == b"4321"

    out = str(tmp_path / "feed.parquet")
    r = subprocess.run(
        [sys.executable, "-m", "kv", "spark", "export-log", out, "--raw", "--endpoints", endpoints(cluster), "--from", str(start), "--to", str(end)],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"exported {len(got)} rows from the log [{start}, {end}] of" in r.stdout  # the range read
    assert spark.read.parquet(out).filter("op = 'delete'").count() == 1

    with pytest.raises(BadRequest, match="start must be at least 1"):
        kvspark.read_log(spark, endpoints(cluster), 0, 5)
    with pytest.raises(BadRequest, match="is not applied on"):
        kvspark.read_log(spark, endpoints(cluster), start, end + 1_000_000)


def test_export_then_changes_is_a_gapless_cdc_bootstrap(spark, cluster, tmp_path):
    """export at index N, then the effective changes from N + 1: the exported state with the
    changes applied in order is the cluster's state — nothing missed, nothing twice, and
    writes that changed nothing (a failed compare-and-set, the branch not taken) absent."""
    eps = endpoints(cluster)
    with kv.Client(eps) as c:
        c.put_many({f"cdc/{i}": b"v0" for i in range(100)})
        c.put("other/x", b"1")
    snap = str(tmp_path / "cdc.parquet")
    meta = kvspark.export_snapshot(spark, snap, endpoints=eps, prefix="cdc/")
    n = meta["index"]
    with kv.Client(eps) as c:
        c.put("cdc/1", b"v1")
        c.delete("cdc/2")
        c.put("cdc/new", b"n")
        c.txn([kv.Cond("cdc/3", "exists", True)], [kv.Put("cdc/3", b"t"), kv.Delete("cdc/4")], [kv.Put("cdc/never", b"x")])
        c.txn([kv.Cond("cdc/missing", "exists", True)], [kv.Put("cdc/never2", b"x")], [kv.Put("cdc/else", b"e")])
        with pytest.raises(kv.PreconditionFailed):
            c.cas("cdc/5", 1, b"stale")
        c.put("other/y", b"2")
        end = c.put("cdc/1", b"v2").index  # the last write; nothing writes after it
        final = {it.key: it.value for it in c.scan("cdc/")}

    changes = kvspark.read_changes(spark, eps, n + 1, end, prefix="cdc/", partitions=3).collect()
    changes.sort(key=lambda r: r["index"])  # ranges come back in any order; a stable sort keeps one index's changes in theirs
    state = {r["key"]: bytes(r["value"]) for r in spark.read.parquet(snap).collect()}
    assert len(state) == 100
    for r in changes:
        assert r["mod_index"] == r["index"] and n < r["index"] <= end
        if r["type"] == "put":
            state[r["key"]] = bytes(r["value"])
        else:
            del state[r["key"]]
    assert state == final
    keys = [r["key"] for r in changes]
    assert "cdc/never" not in keys and "cdc/never2" not in keys and "cdc/5" not in keys and "cdc/else" in keys
    assert keys.count("cdc/1") == 2 and not any(k.startswith("other/") for k in keys)

    out = str(tmp_path / "changes.parquet")
    r = subprocess.run(
        [sys.executable, "-m", "kv", "spark", "export-log", out, "--endpoints", eps, "--from", str(n + 1), "--to", str(end), "--prefix", "cdc/"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"exported {len(changes)} rows" in r.stdout
    assert spark.read.parquet(out).filter("type = 'delete'").count() == 2
    again = subprocess.run([sys.executable, "-m", "kv", "spark", "export-log", out, "--endpoints", eps], capture_output=True, text=True, timeout=300)
    assert again.returncode == 1 and "exists" in again.stderr and "--overwrite" in again.stderr, again.stderr[-2000:]
    assert spark.read.parquet(out).count() == len(changes)  # left as it was


def test_export_timeout_cancels_the_job_and_removes_the_output(spark, tmp_path):
    """--timeout on kv spark export/export-log: a job still running then is cancelled, what
    it wrote removed, and the error says so (one line, kv.Timeout)."""
    import argparse

    from kv.cli.spark import _deadline

    out = tmp_path / "out.parquet"
    args = argparse.Namespace(timeout=2.0, out=str(out))
    t0 = time.monotonic()
    with pytest.raises(kv.Timeout, match="gave up after 2s"):
        with _deadline(spark, args):
            out.mkdir()
            (out / "part-0").write_bytes(b"partial")
            spark.range(10**13).selectExpr("max(id)").collect()  # hours of work (max: no overflow to end it early)
    assert time.monotonic() - t0 < 60
    assert not out.exists()
    with _deadline(spark, argparse.Namespace(timeout=60.0, out=str(out))):  # in time: nothing happens
        assert spark.range(10).count() == 10


# -- how Spark is started, errors, summaries --------------------------------------------------


def test_master_follows_sparks_own_precedence(tmp_path):
    """--master, then --conf spark.master, then Spark's configuration (PYSPARK_SUBMIT_ARGS,
    spark-defaults.conf, $MASTER, in spark-submit's order), then local[2]."""
    from kv.spark.runtime import resolve_master, session_settings, worker_python

    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    env = {"SPARK_CONF_DIR": str(conf_dir)}
    assert resolve_master(None, {}, env) == ("local[2]", "the default")
    env["MASTER"] = "spark://env:7077"
    assert resolve_master(None, {}, env) == ("spark://env:7077", "$MASTER")
    (conf_dir / "spark-defaults.conf").write_text("# comment\nspark.executor.memory 2g\nspark.master   spark://defaults:7077\n")
    assert resolve_master(None, {}, env)[0] == "spark://defaults:7077"
    env["PYSPARK_SUBMIT_ARGS"] = "--conf spark.master=spark://submit-conf:7077 pyspark-shell"
    assert resolve_master(None, {}, env)[0] == "spark://submit-conf:7077"
    env["PYSPARK_SUBMIT_ARGS"] = "--master=spark://submit:7077 --conf spark.master=spark://submit-conf:7077 pyspark-shell"
    assert resolve_master(None, {}, env)[0] == "spark://submit:7077"
    assert resolve_master(None, {"spark.master": "yarn"}, env) == ("yarn", "--conf spark.master")
    assert resolve_master("local[1]", {"spark.master": "yarn"}, env) == ("local[1]", "--master")
    props = tmp_path / "my.conf"
    props.write_text("spark.master=k8s://https://k:6443\n")
    assert resolve_master(None, {}, {**env, "PYSPARK_SUBMIT_ARGS": f"--properties-file {props} pyspark-shell"})[0] == "k8s://https://k:6443"

    # kv sets spark.master only when it chose it; Spark's configuration applies as Spark applies it.
    settings, master, _ = session_settings(None, "t", {"spark.executor.memory": "4g", "spark.sql.execution.arrow.pyspark.enabled": "false"}, env=env)
    assert master == "spark://submit:7077" and "spark.master" not in settings
    assert settings["spark.executor.memory"] == "4g" and settings["spark.sql.execution.arrow.pyspark.enabled"] == "false"  # --conf wins
    settings, master, _ = session_settings(None, "t", {}, env={"SPARK_CONF_DIR": str(tmp_path / "none")})
    assert settings["spark.master"] == master == "local[2]"
    # Quiet: this package's log4j2 file, after the user's own JVM options; not with --debug,
    # nor when the user names a log4j configuration.
    settings, _, _ = session_settings("local[1]", "t", {"spark.driver.extraJavaOptions": "-Dx=1"})
    opts = settings["spark.driver.extraJavaOptions"]
    assert opts.startswith("-Dx=1 -Dlog4j2.configurationFile=file:") and os.path.isfile(opts.split("file:", 1)[1])
    assert "spark.driver.extraJavaOptions" not in session_settings("local[1]", "t", {}, quiet=False)[0]
    # The executors run the driver's Python only when they are on this machine.
    assert worker_python("local[2]", {}) == worker_python("local-cluster[2,1,1024]", {}) == sys.executable
    assert worker_python("local[2]", {"spark.pyspark.python": "/opt/py"}) == "/opt/py"
    assert worker_python("spark://head:7077", {}) is None and worker_python("yarn", {}) is None
    own = "-Dlog4j2.configurationFile=file:/etc/mine.properties"
    assert session_settings("local[1]", "t", {"spark.driver.extraJavaOptions": own})[0]["spark.driver.extraJavaOptions"] == own


def test_conf_and_master_on_every_command_that_starts_spark():
    from kv.cli import build_parser

    from kv.spark.runtime import parse_conf

    p = build_parser()
    for argv in (["spark", "import", "x.csv"], ["spark", "export", "out"], ["spark", "export-log", "out"], ["bench", "spark"]):
        a = p.parse_args([*argv, "--conf", "spark.a=1", "--conf", "spark.b=x=y"])
        assert a.master is None and parse_conf(a.conf) == {"spark.a": "1", "spark.b": "x=y"}, argv
    with pytest.raises(BadRequest, match="KEY=VALUE"):
        parse_conf(["spark.a"])
    with pytest.raises(BadRequest, match=r"--conf 'executor.memory=4g': Spark takes only settings whose names start with 'spark.'"):
        parse_conf(["executor.memory=4g"])


def test_an_export_range_cut_short_says_to_run_the_export_again():
    """The node holding an export's view dies (refuses connections, or its answer stops
    mid-block): one KVError naming the node and what to do; its refusals keep their kind."""
    import http.server
    import threading

    from kv.snapshot.format import framed_block
    from kv.spark.views import range_blocks

    block = framed_block([b"a", b"b"], [b"1", b"2"], struct.pack("<2q", 1, 2))

    class Half(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if "refuse" in self.path:
                self.send_response(403)
                self.end_headers()
                self.wfile.write(b'{"error": {"code": "FORBIDDEN", "message": "a read token may not"}}')
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(block) * 2))
            self.end_headers()
            self.wfile.write(block + block[:10])  # then the node is gone

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Half)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        got = []
        with pytest.raises(kv.KVError, match=r"which holds the export's view, stopped answering .*run the export again"):
            for n, payload in range_blocks(f"{url}/v1/export/v?from=", None):
                got.append(n)
        assert got == [2]  # the whole block came through first
        with pytest.raises(kv.Forbidden, match="a read token may not"):
            list(range_blocks(f"{url}/v1/export/refuse", None))
    finally:
        server.shutdown()
    with pytest.raises(kv.KVError, match=r"127.0.0.1:1, which holds the export's view, stopped answering"):
        list(range_blocks("http://127.0.0.1:1/v1/export/v", None))


def test_partitions_out_of_range_are_refused_before_spark_starts(tmp_path):
    for argv, want in (
        (["export", str(tmp_path / "o"), "--partitions", "0"], "--partitions must be at least 1 and at most 4096, not 0"),
        (["export", str(tmp_path / "o"), "--partitions", "5000"], "at most 4096, not 5000"),
        (["export-log", str(tmp_path / "o"), "--partitions", "-3"], "--partitions must be at least 1, not -3"),
    ):
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "kv", "spark", *argv], capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and want in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert time.monotonic() - t0 < 30 and not os.path.exists(tmp_path / "o")  # (Spark alone takes longer to start)


@pytest.mark.parametrize("partitions, task", [(2, "write_task"), (1, "whole_task")])
def test_a_retried_task_is_counted_once(spark, cluster, monkeypatch, tmp_path, partitions, task):
    """The import summary comes from the tasks' own results: a task that wrote its rows and
    then failed, and was run again, counts once, and its rows as written (its second attempt
    finds them held, changed since the import began), as an unbroken run counts them. With
    one partition, one task checks then writes (whole_task); with more, write_task writes."""
    import kv.spark.importer as importer

    real = getattr(importer, task)
    died = str(tmp_path / "died")

    def flaky(*args):
        from pyspark import TaskContext

        ctx = TaskContext.get()
        out = list(real(*args))  # every row of the partition written
        if ctx.partitionId() == 0 and ctx.attemptNumber() == 0:
            open(died, "w").close()
            raise RuntimeError("injected: the task dies after its writes")
        yield from out

    monkeypatch.setattr(importer, task, flaky)
    prefix = f"retry{partitions}/"
    df = spark.range(2_000).selectExpr(f"concat('{prefix}', lpad(cast(id as string), 5, '0')) as key", "cast(id as string) as value")
    report = kvspark.write(df, endpoints(cluster), partitions=partitions)
    assert report.rows == 2_000 and not report.failures and os.path.exists(died)
    assert (report.written, report.skipped) == (2_000, 0)  # partition 0 ran twice: its rows were held the second time
    again = kvspark.write(df, endpoints(cluster), partitions=partitions)
    assert (again.written, again.skipped) == (0, 2_000)  # held from before this import: skipped
    with kv.Client(endpoints(cluster)) as c:
        assert sum(1 for _ in c.scan(prefix)) == 2_000


def _snapshot_file(path: str, n: int = 50) -> str:
    from kv.snapshot.format import blocks_of, new_header
    from kv.snapshot.store import SnapshotStore

    snap = SnapshotStore(path).write(new_header(n, 1, b"[]", "default", "test"), blocks_of((b"k/%04d" % i, b"v", i + 1) for i in range(n)))
    return snap.path


def test_bad_py_files_is_one_line_with_its_cause(tmp_path):
    snap = _snapshot_file(str(tmp_path / "snap"))
    r = subprocess.run(
        [sys.executable, "-m", "kv", "spark", "export", str(tmp_path / "out"), "--snapshot", snap, "--conf", "spark.submit.pyFiles=/nonexistent/deps.zip"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1, r.stderr[-3000:]  # one line: no JVM log, no stack
    assert r.stderr.startswith("kv spark export: FileNotFoundException: File file:/nonexistent/deps.zip does not exist — check the paths given to --py-files"), r.stderr


WORKER_WITHOUT_KV = """#!{python}
# An executor's Python without ledgerkv: neither the checkout (working directory,
# PYTHONPATH) nor the editable install can be imported; a zip added by addPyFile can.
import os, runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
sys.path[:] = [p for p in sys.path if "__editable__" not in p and not os.path.isdir(os.path.join(p or ".", "kv"))]
args = sys.argv[1:]
while args[0] != "-m":
    args.pop(0)
sys.argv = [args[1]] + args[2:]
runpy.run_module(args[1], run_name="__main__", alter_sys=True)
"""


def test_executors_without_kv_one_line_then_ship_package(tmp_path):
    """Executors that cannot import kv: the error names the ModuleNotFoundError and what to
    do; --ship-package then gets the package there (and the run says nothing on stderr)."""
    worker = tmp_path / "python-without-kv"
    worker.write_text(WORKER_WITHOUT_KV.format(python=sys.executable))
    worker.chmod(0o755)
    snap = _snapshot_file(str(tmp_path / "snap"))
    env = {**os.environ, "PYSPARK_PYTHON": str(worker)}
    cmd = [sys.executable, "-m", "kv", "spark", "export", "--snapshot", snap]
    # Both at once: each is mostly a JVM starting.
    without = subprocess.Popen([*cmd, str(tmp_path / "out1")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    shipped = subprocess.Popen([*cmd, str(tmp_path / "out2"), "--ship-package"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    (_, err), (out2, err2) = without.communicate(timeout=300), shipped.communicate(timeout=300)
    assert without.returncode == 1
    assert err.count("\n") == 1, err[-3000:]
    assert err.startswith("kv spark export: ModuleNotFoundError: No module named 'kv' — ") and "--ship-package" in err, err
    assert shipped.returncode == 0 and err2 == "", err2[-3000:]
    assert "exported 50 rows" in out2


def test_package_zip_holds_the_mapped_sub_packages(tmp_path):
    """The zip --ship-package adds imports as the installed package does, the folders that
    pyproject.toml maps into kv included."""
    import tomllib

    from kv.spark.runtime import MAPPED_PACKAGES, package_zip

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml"), "rb") as f:
        mapped = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    assert sorted(MAPPED_PACKAGES) == sorted(k.split(".", 1)[1] for k in mapped if k != "kv")
    z = package_zip(str(tmp_path))
    code = (
        f"import sys; sys.path.insert(0, {z!r}); "
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')]; "
        "import kv, kv.raft.core, kv.statemachine.commands, kv.snapshot.format, kv.http.app, kv.v3api.proto.kv_pb2, kv.spark.runtime; "
        "import importlib.resources as r; assert r.files('kv.http').joinpath('openapi.json').is_file(); "
        "print(sorted({m.__file__.startswith(sys.path[0]) for n, m in list(sys.modules.items()) if n.split('.')[0] == 'kv' and getattr(m, '__file__', None)}))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(tmp_path), env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[True]"  # every kv module from the zip


def test_log_ranges_start_at_the_lowest_index_any_member_holds():
    """export-log's default range does not depend on which node answers first: it starts at
    the lowest index any member holds, and each piece is read from members holding it whole."""
    import itertools

    from kv.spark.export import plan_log_ranges

    nodes = [("a", 50, 200), ("b", 1, 100), ("c", 120, 210)]
    for order in itertools.permutations(nodes):
        start, end, pieces = plan_log_ranges(list(order), None, None, 4)
        assert (start, end) == (1, 210)
        assert [lo for _, lo, _ in pieces] == [1] + [hi + 1 for _, _, hi in pieces[:-1]] and pieces[-1][2] == 210  # no gap, no overlap
        for holders, lo, hi in pieces:
            held = {ep: (f, last) for ep, f, last in order}
            assert holders and all(held[ep][0] <= lo and hi <= held[ep][1] for ep in holders), (holders, lo, hi)
        assert pieces[0][0] == ["b"]
    assert plan_log_ranges(nodes, 60, 70, 1)[2] == [(["a", "b"], 60, 70)]
    with pytest.raises(kv.Compacted, match="no member holds the log before index 5"):
        plan_log_ranges([("a", 5, 10), ("b", 7, 12)], 2, None, 2)
    with pytest.raises(kv.Compacted, match=r"no member holds the entries \[11, 19\]"):
        plan_log_ranges([("a", 1, 10), ("b", 20, 30)], None, None, 2)
    with pytest.raises(BadRequest, match="not applied on any member yet .* 12, on b"):
        plan_log_ranges([("a", 5, 10), ("b", 7, 12)], None, 13, 2)
    assert plan_log_ranges([("a", 11, 10)], None, None, 2) == (11, 10, [])  # everything compacted, nothing new: empty


def test_root_cause_is_the_innermost_cause():
    from kv.spark.runtime import root_cause

    java = (
        "An error occurred while calling o42.save.\n: org.apache.spark.SparkException: Job aborted.\n\tat org.apache.spark.Foo(Foo.scala:1)\n"
        "Caused by: java.lang.RuntimeException: wrapped\n\tat x.Y(Y.java:2)\nCaused by: java.io.IOException: No space left on device\n\tat z.W(W.java:3)\n"
    )
    assert root_cause(Exception(java)) == "IOException: No space left on device (--debug shows Spark's log)"
    python = (
        "Job aborted due to stage failure: Task 0 in stage 1.0 failed 1 times\norg.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
        '  File "/x/worker.py", line 1, in main\n    func()\n'
        "kv.common.entry_stream.LogStreamError: log range [1, 9] from http://n1: the stream ended at index 4\n\tat org.apache.spark.api.python.BasePythonRunner(Py.scala:5)\n"
    )
    assert root_cause(Exception(python), debug_hint=False) == "kv.common.entry_stream.LogStreamError: log range [1, 9] from http://n1: the stream ended at index 4"


def test_an_export_names_a_key_that_is_not_utf8_instead_of_altering_it():
    import pyarrow as pa

    from kv.spark import export

    assert export._text_keys(pa.array([b"a", "é".encode()], pa.binary())).to_pylist() == ["a", "é"]
    with pytest.raises(BadRequest, match=r"key b'v3/\\xff' is not UTF-8.*--prefix"):
        export._text_keys(pa.array([b"a", b"v3/\xff"], pa.binary()))
    from kv.spark.export import _arrow, log_schema

    assert _arrow([(5, 1, "put", "é", b"v", False, None)], log_schema()).num_rows == 1
    with pytest.raises(BadRequest, match=r"entry 5 writes key b'ok\\xff', which is not UTF-8"):
        _arrow([(4, 1, "put", "ok", b"v", False, None), (5, 1, "put", "ok\udcff", b"v", False, None)], log_schema())


def test_the_progress_line_sums_what_the_tasks_report_and_ignores_strangers():
    """kv spark import/export on a terminal: rows, rows/s and the time left, from the UDP
    datagrams the tasks send (kv/spark/progress.py)."""
    import io
    import socket
    import time
    from types import SimpleNamespace

    from kv.spark.progress import ProgressLine, Reporter

    out = io.StringIO()
    spark = SimpleNamespace(sparkContext=SimpleNamespace(master="local[2]"))
    with ProgressLine(spark, 1000, "imported", out=out) as line:
        assert line.address[0] == "127.0.0.1"
        tasks = [Reporter(line.address) for _ in range(3)]
        for r in tasks:
            r.add(100, 100)
        stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        stranger.sendto(b"x" * 8 + (10**6).to_bytes(8, "big") * 2, line.address[:2])  # not this run's tag
        stranger.sendto(b"garbage", line.address[:2])
        deadline = time.monotonic() + 10
        while line.rows < 300 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # (the stranger's datagrams, sent before the last task's, are read by now)
        assert (line.rows, line.units) == (300, 300)
        assert line.line(10.0) == "imported 300 rows (30%), 30 rows/s, 0:23 left"
        for r in tasks:
            r.close()
        stranger.close()
        time.sleep(0.6)
    assert "imported 300 rows (30%)" in out.getvalue() and out.getvalue().endswith("\r\x1b[K")
    assert Reporter(None).add(5, 5) is None  # no line: nothing sent


def test_a_small_input_is_imported_as_one_task(spark, tmp_path):
    """Range-partitioning into more samples the input first (a Spark job of its own)."""
    import kv.spark
    from kv.spark.importer import SMALL_INPUT_BYTES, default_partitions

    (tmp_path / "small.csv").write_text("key,value\n" + "".join(f"k{i},v\n" for i in range(100)))
    assert default_partitions(kv.spark.load(spark, str(tmp_path / "small.csv"))) == 1
    unknown = spark.createDataFrame([("k", "v")], "key string, value string")  # (Python data: no estimate)
    assert default_partitions(unknown) == spark.sparkContext.defaultParallelism * 2
    big = spark.range(SMALL_INPUT_BYTES).selectExpr("cast(id as string) as key", "'v' as value")  # ~8M rows: estimated far above
    assert default_partitions(big) == spark.sparkContext.defaultParallelism * 2


def test_values_exported_as_text_must_be_utf8(spark, tmp_path):
    """--value-type string: text values as they are (null stays null); a value that is not
    UTF-8 stops the export naming its key, instead of Spark putting U+FFFD for its bytes."""
    from kv.spark.export import save, with_value_type

    ok = spark.createDataFrame([("a", bytearray("é".encode()), 1), ("n", None, 2)], "key string, value binary, mod_index long")
    assert sorted(tuple(r) for r in with_value_type(ok, "string", None).collect()) == [("a", "é", 1), ("n", None, 2)]
    bad = spark.createDataFrame([("a", bytearray(b"ok"), 1), ("k/\u00e9", bytearray(b"bad\xff"), 2)], "key string, value binary, mod_index long")
    out = str(tmp_path / "out.json")
    with pytest.raises(Exception, match="the value of key k/é is not UTF-8, and text .--value-type string, or CSV. would alter it"):
        save(with_value_type(bad, "string", None), out, "json", False)
    assert not os.path.exists(out)


def test_an_export_that_fails_leaves_no_folder_behind(spark, tmp_path):
    """A second try would otherwise be refused: the folder exists."""
    from kv.spark.export import save

    out = str(tmp_path / "out.parquet")
    with pytest.raises(Exception, match="boom"):
        save(spark.range(10).selectExpr("if(id = 7, raise_error('boom'), id) as id"), out, "parquet", False)
    assert not os.path.exists(out)
    save(spark.range(3), out, "parquet", False)
    assert spark.read.parquet(out).count() == 3


def test_a_csv_export_is_read_back_by_pandas_and_by_the_import(spark, cluster, tmp_path):
    """A CSV export has a header line and RFC 4180 quoting (a quote doubled, a line break
    inside quotes; spaces at a value's ends kept): pandas reads it as it is, and `kv spark
    import` takes it back unchanged. Values are text in CSV (binary is refused), the change
    feed's too."""
    import pandas as pd

    from kv.spark.export import save

    awkward = {"csv/1": 'a "quoted", comma', "csv/2": "two\nlines", "csv/3": "back\\slash \u00e9", "csv/4": "  spaces at both ends\t ", "csv/5": "plain"}
    eps = endpoints(cluster)
    assert kvspark.write(spark.createDataFrame(list(awkward.items()), "key string, value string"), eps).written == len(awkward)
    out = str(tmp_path / "out.csv")
    with pytest.raises(BadRequest, match="CSV holds text: binary values would be written as their bytes in hex"):
        kvspark.export_snapshot(spark, out, endpoints=eps, prefix="csv/", fmt="csv", value_type="binary")
    assert not os.path.exists(out)
    meta = kvspark.export_snapshot(spark, out, endpoints=eps, prefix="csv/", fmt="csv")  # (values as text: CSV's default)
    assert meta["rows"] == len(awkward)
    got = pd.concat([pd.read_csv(f, keep_default_na=False) for f in sorted(glob.glob(os.path.join(out, "part-*.csv")))])
    assert list(got.columns) == ["key", "value", "mod_index"]
    assert dict(zip(got.key, got.value)) == awkward
    back = kvspark.load(spark, out).selectExpr("concat('csv2/', substr(key, 5)) as key", "value")
    assert kvspark.write(back, eps).written == len(awkward)
    with kv.Client(eps) as c:
        assert {i.key[5:]: i.value.decode() for i in c.scan("csv2/")} == {k[4:]: v for k, v in awkward.items()}
    # the change feed as CSV: its values as text too, not Spark's hex of their bytes
    log = str(tmp_path / "changes.csv")
    start, end = kvspark.log_range(eps, None, None)
    save(kvspark.read_changes(spark, eps, start, end, prefix="csv/"), log, "csv", False)
    got = pd.concat([pd.read_csv(f, keep_default_na=False) for f in sorted(glob.glob(os.path.join(log, "part-*.csv")))])
    assert dict(zip(got.key, got.value)) == awkward


WARM_UP_CHECK = r"""
import sys, threading, time
import kv.spark as kvspark
t0 = time.time()
s = kvspark.session("local[1]", "warm-up-check")
(warm,) = [t for t in threading.enumerate() if t.name == "kv-spark-warm-up"]
warm.join(120)
time.sleep(1)  # (Spark takes a finished task's worker back a moment after the job ends)
submitted = time.time()

def task(batches):
    import os, sys
    import pyarrow as pa
    with open(f"/proc/{os.getpid()}/stat") as f:
        age_ticks = float(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        age = float(f.read().split()[0]) - age_ticks / os.sysconf("SC_CLK_TCK")
    ready = all(m in sys.modules for m in ("kv.spark.bulk", "kv.client.async_client", "pyarrow.compute"))
    yield pa.RecordBatch.from_arrays([pa.array([age]), pa.array([ready])], names=["age", "ready"])

(row,) = s.range(1).coalesce(1).mapInArrow(task, "age double, ready boolean").collect()
print(row.ready, row.age > time.time() - submitted)
s.stop()
quiet = kvspark.session("local[1]", "stopped-at-once")
quiet.stop()
"""


def test_a_local_session_readies_its_first_tasks_worker(tmp_path):
    """kv.spark.session with a local master starts the first task's Python worker in the
    background (kv/spark/warmup.py): the next task runs in a worker that was started before
    the task was submitted, with ledgerkv's task modules imported already. A session stopped
    at once, its warm-up still running, says nothing."""
    r = subprocess.run([sys.executable, "-c", WARM_UP_CHECK], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["True", "True"], r.stdout
    assert "Traceback" not in r.stderr and "ERROR" not in r.stderr, r.stderr[-2000:]


def test_ctrl_c_cancels_the_import_and_says_so_in_one_line(cluster, tmp_path):
    """SIGINT while Spark writes: the jobs are cancelled, and the command ends with one line
    saying what is left, exit status 130 — not PySpark's 48 lines of py4j errors (its own
    handler cancels from inside the signal, in the middle of a call to the JVM)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 400_000
    path = str(tmp_path / "big.parquet")
    pq.write_table(pa.table({"key": [f"intr/{i:07d}" for i in range(n)], "value": ["v" * 100] * n}), path)
    lead = cluster.leader()
    before = cluster.status(lead)["commit_index"]
    p = subprocess.Popen([sys.executable, "-m", "kv", "spark", "import", path, "--master", "local[2]", "--endpoints", endpoints(cluster)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while cluster.status(lead)["commit_index"] < before + 3 and p.poll() is None and time.time() < deadline:
            time.sleep(0.1)  # until the writes are under way
        assert p.poll() is None, "the import ended before it could be interrupted"
        p.send_signal(2)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, err[-2000:]
    assert err.strip().splitlines() == ["kv spark import: interrupted (Ctrl-C): the rows written so far stay written; run the same import again to finish it (the rows the cluster holds already are skipped)"], err[-3000:]
    assert out == ""


def test_an_unreachable_standalone_master_is_refused_at_once():
    """A spark:// master no host of which takes a connection fails in a moment, naming it;
    Spark itself would try for a minute, then say only 'Cannot call methods on a stopped
    SparkContext'. A master that answers passes (the standalone test starts a real one)."""
    import socket

    from kv.bench.harness import free_port
    from kv.spark.runtime import SparkDidNotStart, refuse_unreachable_master

    dead = free_port()
    t0 = time.monotonic()
    with pytest.raises(SparkDidNotStart, match=rf"the master spark://127.0.0.1:{dead} \(from --master\) does not answer \(127.0.0.1:{dead}: Connection refused\)"):
        refuse_unreachable_master(f"spark://127.0.0.1:{dead}", "--master")
    assert time.monotonic() - t0 < 5
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen()
        refuse_unreachable_master(f"spark://127.0.0.1:{dead},127.0.0.1:{live.getsockname()[1]}", "$MASTER")  # one of two answers
    with pytest.raises(SparkDidNotStart, match=rf"\[::1\]:{dead}: "):  # an IPv6 host, with its port
        refuse_unreachable_master(f"spark://[::1]:{dead}", "--master")
    refuse_unreachable_master("yarn", "--master")
    r = subprocess.run([sys.executable, "-m", "kv", "spark", "export", "out", "--master", f"spark://127.0.0.1:{dead}"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and "does not answer" in r.stderr, r.stderr
