"""`kv spark import` of a small local file without Spark (kv/spark/local.py): it must leave
the cluster exactly as the same import through Spark would. Checked the strongest way there
is: the file is imported here (`kv spark import`, its own process), then through Spark
(kv.spark.write of kv.spark.load, local[1]), which must find every row held already."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from cluster import ProcCluster

pyspark = pytest.importorskip("pyspark", reason="the spark extra is not installed (pip install -e '.[spark]')")

import kv.spark as kvspark  # noqa: E402
from kv import BadRequest  # noqa: E402
from kv.spark import local  # noqa: E402

# Quoted fields with the file's own line ending, a lone CR and LF, doubled quotes, commas,
# text that other readers take for null ("null", "NA"), spaces, non-ASCII, numbers kept as
# written; an empty value is null to Spark, so the value is never empty here (test below).
ROWS = [
    ("t/1", "x, y"),
    ("t/2", 'he said "hi"'),
    ("t/3", "line1{NL}line2"),
    ("t/4", "a\rb"),
    ("t/5", "a\nb"),
    ("t/6", "null"),
    ("t/7", "NA"),
    ("t/8", " spaced "),
    ("t/9", "café ☕ \\n back\\slash"),
    ("t/10", "007"),
    ("t/11", "1e5"),
    ("t/12", "  "),
]


def write_csv(path: str, newline: str, prefix: str) -> None:
    def field(s: str) -> str:
        s = s.replace("{NL}", newline)
        return '"' + s.replace('"', '""') + '"' if any(c in s for c in ',"\r\n') else s

    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write("key,value,other" + newline)
        for i, (k, v) in enumerate(ROWS):
            f.write(f"{prefix}{k},{field(v)},{i}{newline}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with ProcCluster(str(tmp_path_factory.mktemp("sparklocal")), proxies=False, extra=["--max-value-bytes", str(2 << 20)]) as c:
        c.start()
        c.leader()
        yield c


def kv_import(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER", "PYSPARK_SUBMIT_ARGS", "SPARK_CONF_DIR")}
    return subprocess.run([sys.executable, "-m", "kv", "spark", "import", *args, "--debug"], capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.spark
@pytest.mark.slow
def test_a_small_csv_is_imported_without_spark_as_spark_reads_it(cluster, tmp_path):
    eps = cluster.endpoints()
    files = {}
    for name, newline in (("crlf", "\r\n"), ("lf", "\n"), ("cr", "\r")):
        path = str(tmp_path / f"{name}.csv")
        write_csv(path, newline, f"{name}/")
        files[name] = path
    for name, path in files.items():
        r = kv_import(path, "--endpoints", eps, "--key-col", "key", "--value-col", "value")
        assert r.returncode == 0, r.stderr[-2000:]
        assert "without Spark" in r.stderr and "NativeCodeLoader" not in r.stderr, r.stderr[-2000:]
        assert f"imported {len(ROWS)} rows: {len(ROWS)} written" in r.stdout, r.stdout
    # Spark's reader writes the file's line ending inside a quoted field as "\n" (and keeps
    # other line breaks as they are)
    for key, value in (
        ("crlf/t/3", b"line1\nline2"), ("crlf/t/4", b"a\rb"), ("lf/t/4", b"a\rb"), ("cr/t/4", b"a\nb"), ("cr/t/5", b"a\nb"),
        ("crlf/t/9", "café ☕ \\n back\\slash".encode()), ("crlf/t/6", b"null"), ("lf/t/10", b"007"), ("lf/t/8", b" spaced "),
    ):
        code, body, _ = cluster.get(cluster.ids[1], key)
        assert code == 200 and body == value, (key, body)
    # a Parquet file of pandas categories (dictionary-encoded), and a value of 1.5 MB: more
    # than a block of Arrow's CSV reader by default
    import pandas as pd

    files["parquet"] = str(tmp_path / "cat.parquet")
    pd.DataFrame({"key": pd.Categorical(["parquet/a", "parquet/b"]), "value": pd.Categorical(["x", "y"])}).to_parquet(files["parquet"])
    files["long"] = str(tmp_path / "long.csv")
    with open(files["long"], "w") as f:
        f.write('key,value\nlong/1,"' + "a,\n" * 500_000 + '"\n')
    for name in ("parquet", "long"):
        r = kv_import(files[name], "--endpoints", eps, "--max-value-bytes", str(2 << 20))
        assert r.returncode == 0 and "without Spark" in r.stderr, r.stderr[-2000:]
    assert cluster.get(cluster.ids[0], "parquet/b")[1] == b"y" and cluster.get(cluster.ids[0], "long/1")[1] == b"a,\n" * 500_000
    spark = kvspark.session("local[1]", "ledgerkv-tests-local")
    try:
        for name, path in files.items():
            report = kvspark.write(kvspark.load(spark, path), eps, max_value_bytes=2 << 20)
            # every row held already: Spark reads the file as the import here did
            n = {"parquet": 2, "long": 1}.get(name, len(ROWS))
            assert (report.rows, report.written, report.skipped, report.failures) == (n, 0, n, []), (name, report.summary())
    finally:
        spark.stop()


def test_what_spark_must_read_goes_through_spark(tmp_path):
    csv = tmp_path / "a.csv"
    csv.write_text("key,value\nk,v\n")
    (tmp_path / "a.json").write_text('{"key": "k", "value": "v"}\n')
    base = dict(master_from="the default", conf={}, options={}, key_expr=None, value_expr=None, partitions=None, ship_package=False)

    def why(path=str(csv), fmt=None, **change):
        return local.spark_needed(path, fmt, **{**base, **change})

    assert why() is None
    assert "master" in why(master_from="--master")
    assert "setting" in why(conf={"spark.executor.memory": "1g"})
    assert "Spark SQL" in why(key_expr="upper(key)")
    assert "reader" in why(options={"sep": ";"})
    assert "tasks" in why(partitions=4)
    assert "JSON" in why(str(tmp_path / "a.json"), "json")
    assert "one local file" in why(str(tmp_path), "csv")
    big = tmp_path / "big.csv"
    with open(big, "wb") as f:
        f.truncate(local.LOCAL_MAX_BYTES + 1)
    assert "MiB" in why(str(big))
    # what Arrow's reader would read otherwise than Spark's
    (tmp_path / "ragged.csv").write_text("key,value\nx,1\ny\n")
    assert "Arrow" in local.read(str(tmp_path / "ragged.csv"), None, "key", "value")
    # where the two readers part (found by a newcomer's run): each would undo the other's import
    for text, why in (
        ('key,value\ne10/b,"a\\"b"\n', "quote"),  # \" for a quote: Spark's own CSV writer's default
        ('key,value\ne11/b,"v2" \n', "quote"),  # text after the closing quote
        ('key,value\ne12/a,"ab"c\n', "quote"),
        ('key,value\na,x"y\n', "quote"),
        ("key,value\r\ne22/a,1\ne22/b,2\r\n", "more than one way"),  # univocity keeps a lone \n in the value
        ("key,value\na,x\rb\n", "more than one way"),
    ):
        (tmp_path / "odd.csv").write_bytes(text.encode())
        assert why in local.read(str(tmp_path / "odd.csv"), None, "key", "value"), text
    # found by a second run: a NUL before a doubled quote (Spark's reader drops the NUL),
    # names that differ only in case (one to Spark), more columns than Spark's reader takes
    for text, why in (
        ('key,value\ntn1,"a\x00""b"\n', "NUL"),
        ("key,KEY,value\np1,p1b,v\n", "twice"),
        ("key,value," + ",".join(f"c{i}" for i in range(20_479)) + "\nk,v" + "," * 20_479 + "\n", "columns"),
    ):
        (tmp_path / "odd.csv").write_bytes(text.encode())
        assert why in local.read(str(tmp_path / "odd.csv"), None, "key", "value"), text[:60]
    (tmp_path / "case.csv").write_text("Key,VALUE\nk,v\n")  # a column is named exactly, as through Spark
    with pytest.raises(BadRequest, match="no column 'key'"):
        local.read(str(tmp_path / "case.csv"), None, "key", "value")
    (tmp_path / "latin1.csv").write_bytes(b"key,value\nk,caf\xe9\n")
    assert "UTF-8" in local.read(str(tmp_path / "latin1.csv"), None, "key", "value")
    (tmp_path / "twice.csv").write_text("key,key,value\nx,y,1\n")
    assert "twice" in local.read(str(tmp_path / "twice.csv"), None, "key", "value")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"key": [1, 2], "value": ["a", "b"]}), str(tmp_path / "ints.parquet"))
    assert "int64" in local.read(str(tmp_path / "ints.parquet"), None, "key", "value")
    with pytest.raises(BadRequest, match="no column 'nope'.*key, value"):
        local.read(str(csv), None, "nope", "value")
    table = local.read(str(csv), None, "key", "value")
    assert table.to_pylist() == [{"key": "k", "value": "v"}]


@pytest.mark.slow
def test_a_small_import_refuses_and_keeps_the_last_row_as_through_spark(cluster, tmp_path):
    eps = cluster.endpoints()
    dup = tmp_path / "dup.csv"
    dup.write_text("key,value\nd/1,first\nd/2,x\nd/1,second\nd/3,\n")
    r = kv_import(str(dup), "--endpoints", eps)
    assert r.returncode != 0 and "refused before writing anything (4 rows checked)" in r.stderr, r.stderr[-2000:]
    assert "1 row with a null value (e.g. 'd/3');" in r.stderr and "1 key occurring more than once (1 extra row, e.g. 'd/1' ×2)" in r.stderr
    # without --debug, one line: the problems parted by ";" (they ran together once the CLI made one line of them)
    plain = subprocess.run([sys.executable, "-m", "kv", "spark", "import", str(dup), "--endpoints", eps], capture_output=True, text=True, timeout=300)
    assert "checked): 1 row with a null value (e.g. 'd/3'); 1 key occurring more than once (1 extra row, e.g. 'd/1' ×2)" in plain.stderr.splitlines()[-1], plain.stderr
    assert cluster.get(cluster.ids[0], "d/2")[0] == 404  # nothing written
    dup.write_text("key,value\nd/1,first\nd/2,x\nd/1,second\nd/1,third\n")
    r = kv_import(str(dup), "--endpoints", eps, "--on-duplicate", "last")
    assert r.returncode == 0 and "imported 4 rows: 2 written, 2 skipped" in r.stdout, r.stdout + r.stderr[-2000:]
    code, body, _ = cluster.get(cluster.ids[2], "d/1")
    assert code == 200 and body == b"third"


def test_on_duplicate_last_keeps_each_keys_last_row_across_batches(monkeypatch):
    """A key's rows may run over several Arrow batches: its last row is written, and each
    batch goes out whole (no request of the one row held back at the end)."""
    import orjson
    import pyarrow as pa

    from kv.spark import bulk, importer

    sent = []

    async def capture(chunks, s):
        sent.extend((k.to_pylist(), v.to_pylist()) for k, v in chunks)
        return bulk.Outcome()

    monkeypatch.setattr(bulk, "write_chunks", capture)

    def batch(keys, values):
        return pa.record_batch([pa.array(keys), pa.array(values)], names=["key", "value"])

    batches = [batch(["a", "b", "b"], ["1", "2", "3"]), batch(["b", "b"], ["4", "5"]), batch(["b", "c"], ["6", "7"])]
    (row,) = importer.write_task(iter(batches), bulk.Settings(["http://127.0.0.1:1"]), True)
    assert sent == [([b"a"], [b"1"]), ([b"b", b"c"], [b"6", b"7"])]
    assert orjson.loads(row.column(0)[0].as_py())["skipped"] == 4  # the rows superseded by a later one of their key
    sent.clear()
    (row,) = importer.write_task(iter(batches), bulk.Settings(["http://127.0.0.1:1"]), False)
    assert [len(k) for k, _ in sent] == [3, 2, 2]  # without `last`: every batch as it is
