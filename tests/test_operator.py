"""The `kv` command as an operator meets it, run as a subprocess: every refusal is one line
that names its source and exits non-zero; --debug shows the traceback; --version; -o json;
ports in use; JSON logs that carry the node and the term, and the access log."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys

import orjson
import pytest
from cluster import ProcCluster, wait_until
from kv.bench.harness import free_port

KV = [sys.executable, "-m", "kv"]


def run_kv(*argv: str, env: dict | None = None, cwd: str | None = None, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KV_")}
    return subprocess.run(KV + list(argv), capture_output=True, env={**full_env, **(env or {})}, cwd=cwd, input=stdin, timeout=60)


def refusal(r: subprocess.CompletedProcess) -> str:
    """The one line a refusal prints; fails unless that is all it printed."""
    err = r.stderr.decode()
    assert r.returncode != 0, err
    assert "Traceback" not in err, err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert r.stdout == b"", r.stdout
    return err.strip()


SERVE = ["serve", "--id", "n1", "--data-dir", "d"]

# (argv, environment, files to write first, what the line must say, exit status)
CASES = [
    pytest.param(SERVE + ["--config", "bad.toml"], {}, {"bad.toml": 'group = "g"\nheartbeat_ms = "fast"\n'},
                 "bad.toml line 2 (heartbeat_ms = 'fast'): expected a number of milliseconds", 1, id="toml-type"),
    pytest.param(SERVE + ["--config", "rel.toml"], {}, {"rel.toml": "\nelection_timeout_ms = 150\n"},
                 "--election-timeout-ms (150, from rel.toml line 2 (election_timeout_ms = 150)) must be at least twice --heartbeat-ms (100, from the default)", 1, id="toml-relation"),
    pytest.param(SERVE + ["--config", "unk.toml"], {}, {"unk.toml": "heartbeat = 1\n"}, "unk.toml line 1 (heartbeat = 1): unknown setting; known:", 1, id="toml-unknown"),
    pytest.param(SERVE + ["--config", "junk.toml"], {}, {"junk.toml": "heartbeat_ms = = 3\n"}, "--config junk.toml: not valid TOML", 1, id="toml-junk"),
    pytest.param(SERVE + ["--config", "missing.toml"], {}, {}, "--config missing.toml: no such file", 1, id="toml-missing"),
    pytest.param(SERVE, {"KV_HEARTBEAT_MS": "abc"}, {}, "KV_HEARTBEAT_MS='abc': expected a number of milliseconds", 1, id="env-number"),
    pytest.param(SERVE, {"KV_SNAPSHOT_KEEP": "0"}, {}, "KV_SNAPSHOT_KEEP='0': expected a whole number of at least 1", 1, id="env-range"),
    pytest.param(SERVE, {"KV_METRICS_PUBLIC": "maybe"}, {}, "KV_METRICS_PUBLIC='maybe': expected true or false", 1, id="env-bool"),
    pytest.param(SERVE, {"KV_HTTP_AIOHTTP_ONLY": "maybe"}, {}, "KV_HTTP_AIOHTTP_ONLY='maybe': expected true or false", 1, id="env-bool-front"),
    pytest.param(SERVE, {"KV_LOG_LEVEL": "loud"}, {}, "KV_LOG_LEVEL='loud': expected one of DEBUG, INFO, WARNING, ERROR", 1, id="env-log-level"),
    pytest.param(SERVE + ["--log-level", "LOUD"], {}, {}, "--log-level 'LOUD': expected one of DEBUG, INFO, WARNING, ERROR", 1, id="log-level"),
    pytest.param(SERVE + ["--log-format", "xml"], {}, {}, "--log-format 'xml': expected one of text, json", 1, id="log-format"),
    pytest.param(SERVE + ["--heartbeat-ms", "-5"], {}, {}, "--heartbeat-ms '-5': expected a number of milliseconds above 0", 1, id="flag-range"),
    pytest.param(SERVE + ["--heartbeat-ms", "600"], {"KV_ELECTION_TIMEOUT_MS": "1000"}, {},
                 "--election-timeout-ms (1000, from KV_ELECTION_TIMEOUT_MS='1000') must be at least twice --heartbeat-ms (600, from --heartbeat-ms '600')", 1, id="flag-relation"),
    pytest.param(SERVE + ["--append-hold-ms", "nan"], {}, {}, "--append-hold-ms 'nan': expected a number of milliseconds", 1, id="flag-nan"),
    pytest.param(SERVE + ["--append-hold-ms", "500"], {}, {},
                 "--append-hold-ms (500, from --append-hold-ms '500') must be at most --heartbeat-ms (100, from the default)", 1, id="flag-hold-relation"),
    pytest.param(SERVE + ["--read-timeout-s", "0"], {}, {}, "--read-timeout-s '0': expected a number of seconds above 0", 1, id="flag-read-timeout"),
    pytest.param(SERVE + ["--cors", "http://localhost:3000,localhost:8080"], {}, {}, "--cors: 'localhost:8080' is not an origin: give the web pages' scheme://host[:port]", 1, id="flag-cors"),
    pytest.param(SERVE + ["--http", "127.0.0.1:28999", "--peers", "n1=127.0.0.1:28999"], {}, {},
                 "kv serve: --peers n1=127.0.0.1:28999 and --http 127.0.0.1:28999 are the same port: give each its own", 1, id="http-is-peer-port"),
    pytest.param(SERVE + ["--http", "0.0.0.0:28999", "--peers", "n1=127.0.0.1:28999"], {}, {},
                 "kv serve: --peers n1=127.0.0.1:28999 and --http 0.0.0.0:28999 are the same port: give each its own", 1, id="http-all-is-peer-port"),
    # (a node given its own address for another member dialled itself, and the logs spoke of a handshake refused)
    pytest.param(SERVE + ["--peers", "n1=127.0.0.1:28997,n2=127.0.0.1:28998,n3=127.0.0.1:28997"], {}, {},
                 "kv serve: --peers 'n1=127.0.0.1:28997,n2=127.0.0.1:28998,n3=127.0.0.1:28997': peers 'n1' and 'n3' have the same address 127.0.0.1:28997: each member listens on its own", 1, id="peers-same-address"),
    pytest.param(["put", "k", "v", "--timeout", "inf"], {}, {}, "kv put: argument --timeout: inf is not a finite number of seconds", 2, id="timeout-inf"),
    pytest.param(SERVE + ["--http", "nowhere"], {}, {}, "--http 'nowhere': expected HOST:PORT", 1, id="flag-hostport"),
    pytest.param(SERVE + ["--grpc", "http://127.0.0.1:2379"], {}, {}, "--grpc 'http://127.0.0.1:2379': expected HOST:PORT without the scheme, e.g. 127.0.0.1:2379", 1, id="flag-hostport-url"),
    pytest.param(SERVE + ["--peers", "n1=http://127.0.0.1:7001/"], {}, {}, "bad address 'http://127.0.0.1:7001/' for peer n1: expected HOST:PORT without the scheme, e.g. 127.0.0.1:7001", 1, id="flag-peers-url"),
    pytest.param(SERVE + ["--peers", "n1=x"], {}, {}, "--peers 'n1=x': bad address 'x' for peer n1", 1, id="flag-peers"),
    pytest.param(SERVE + ["--join", "foo"], {}, {}, "--join 'foo': expected a URL such as http://10.0.0.1:8001", 1, id="flag-url"),
    pytest.param(["serve", "--data-dir", "d"], {}, {}, "kv serve: a node needs --id (a flag, the --config file or KV_ID)", 1, id="missing-id"),
    pytest.param(SERVE + ["--tls-cert", "no.pem", "--tls-key", "no.key"], {}, {}, "cannot load --tls-cert/--tls-key from no.pem, no.key", 1, id="tls-missing"),
    pytest.param(SERVE + ["--tls-cert", "x.pem"], {}, {}, "kv serve: --tls-cert and --tls-key go together: give both", 1, id="tls-half"),
    pytest.param(["serve", "--id", "n1", "--data-dir", "afile", "--http", "127.0.0.1:1"], {}, {"afile": "x"}, "kv serve: cannot use afile as the data dir: it is a file; give a directory", 1, id="data-dir-is-a-file"),
    pytest.param(SERVE + ["--bogus"], {}, {}, "kv serve: unrecognized arguments: --bogus; see kv serve --help", 2, id="unknown-flag"),
    pytest.param(["get", "k", "--timeout", "abc"], {}, {}, "kv get: argument --timeout: 'abc' is not a number of seconds; see kv get --help", 2, id="bad-flag-value"),
    pytest.param(["get"], {}, {}, "kv get: the following arguments are required: key", 2, id="missing-arg"),
    pytest.param(["frobnicate"], {}, {}, "kv: argument COMMAND: invalid choice: 'frobnicate'", 2, id="unknown-command"),
    pytest.param(["get", "k", "-o", "yaml"], {}, {}, "argument -o/--output: invalid choice: 'yaml'", 2, id="bad-output"),
    pytest.param(["snapshot", "inspect", "missing.lkvs"], {}, {}, "kv snapshot inspect: no such file or directory: missing.lkvs", 1, id="snapshot-missing"),
    pytest.param(["snapshot", "inspect", "junk.lkvs"], {}, {"junk.lkvs": "junk"}, "kv snapshot inspect: junk.lkvs is not a valid ledgerkv snapshot: not a ledgerkv snapshot file (bad magic)", 1, id="snapshot-junk"),
    pytest.param(["snapshot", "inspect", "."], {}, {}, "kv snapshot inspect: . is a directory; give a file", 1, id="snapshot-dir"),
    pytest.param(["snapshot", "restore", "missing.lkvs", "--data-dir", "r", "--id", "n1", "--peers", "n1=127.0.0.1:7001"], {}, {},
                 "kv snapshot restore: no such file or directory: missing.lkvs", 1, id="restore-missing"),
    pytest.param(["get", "k", "--timeout", "0.5"], {"KV_ENDPOINTS": "http://127.0.0.1:9"}, {}, "kv get: no endpoint answered", 1, id="unreachable"),
    pytest.param(["snapshot", "save", "x.lkvs", "--endpoints", "http://127.0.0.1:9"], {}, {},
                 "kv snapshot save: http://127.0.0.1:9 did not answer", 1, id="download-unreachable"),
    pytest.param(["put", "k", "v", "--endpoints", "ftp://x", "--timeout", "1"], {}, {}, "kv put: endpoint 'ftp://x' is not a client URL: give http://HOST:PORT or https://HOST:PORT, comma-separated", 1, id="endpoint-scheme"),
    pytest.param(["get", "k"], {"KV_ENDPOINTS": "127.0.0.1:8001/v1"}, {}, "kv get: $KV_ENDPOINTS='127.0.0.1:8001/v1': endpoint '127.0.0.1:8001/v1' has more", 1, id="endpoint-from-env"),
    pytest.param(["get", "k", "--endpoints", "http://127.0.0.1:80O1"], {}, {}, "kv get: endpoint 'http://127.0.0.1:80O1' is not a client URL", 1, id="endpoint-port"),
    # A path would be put before /v1/kv/...: every request would miss its route, and a
    # key's GET would read as "no such key".
    pytest.param(["get", "k", "--endpoints", "http://127.0.0.1:8001,http://127.0.0.1:8002/v1"], {}, {}, "kv get: endpoint 'http://127.0.0.1:8002/v1' has more than a host and port ('/v1'): give http://127.0.0.1:8002", 1, id="endpoint-path"),
    pytest.param(["cluster", "up", "--nodes", "0", "--data-dir", "d"], {}, {}, "kv cluster up: argument --nodes: expected a whole number of at least 1, not '0'", 2, id="cluster-nodes"),
    pytest.param(["cluster", "up", "--base-port", "99999", "--data-dir", "d"], {}, {}, "kv cluster up: argument --base-port: expected a port from 1 to 65000", 2, id="cluster-port"),
]


@pytest.mark.parametrize("argv, env, files, says, status", CASES)
def test_refusal_is_one_line_naming_its_source(tmp_path, argv, env, files, says, status):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    r = run_kv(*argv, env=env, cwd=str(tmp_path))
    line = refusal(r)
    assert says in line, line
    assert r.returncode == status
    assert not (tmp_path / "d").exists()  # refused before anything started


def test_debug_shows_the_traceback(tmp_path):
    (tmp_path / "junk.lkvs").write_text("junk")
    for argv, env in ((["--debug", "snapshot", "inspect", "junk.lkvs"], {}), (["snapshot", "inspect", "junk.lkvs", "--debug"], {}), (["snapshot", "inspect", "junk.lkvs"], {"KV_DEBUG": "1"})):
        r = run_kv(*argv, env=env, cwd=str(tmp_path))
        assert r.returncode != 0 and b"Traceback" in r.stderr and b"SnapshotError" in r.stderr, argv


def test_version():
    r = run_kv("--version")
    assert r.returncode == 0 and r.stdout.decode().startswith("kv (ledgerkv) 0.")


def test_ports_in_use_are_named(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        free = free_port()
        r = run_kv("serve", "--id", "n1", "--data-dir", str(tmp_path / "a"), "--http", f"127.0.0.1:{port}", "--peers", f"n1=127.0.0.1:{free}")
        assert refusal(r) == (
            f"kv serve: --http 127.0.0.1:{port}: port {port} is already in use; "
            f"find who holds it with `ss -ltnp 'sport = :{port}'`, stop it or choose another port"
        )
        r = run_kv("serve", "--id", "n1", "--data-dir", str(tmp_path / "b"), "--http", f"127.0.0.1:{free}", "--peers", f"n1=127.0.0.1:{port}")
        assert f"kv serve: --peers n1=127.0.0.1:{port}: port {port} is already in use" in refusal(r)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """One `kv serve` with a token, JSON logs and the access log."""
    c = ProcCluster(str(tmp_path_factory.mktemp("op")), n=1, proxies=False, extra=["--log-format", "json", "--access-log"], env={"KV_TOKEN": "s3cret"})
    try:
        c.node_env["n1"]["KV_METRICS_PUBLIC"] = "1"
        c.start()
        yield c
    finally:
        c.close()


def kv_json(c: ProcCluster, *argv: str, stdin: bytes | None = None) -> list:
    r = run_kv(*argv, "--endpoints", c.url("n1"), "-o", "json", env={"KV_TOKEN": "s3cret"}, stdin=stdin)
    assert r.returncode == 0, r.stderr
    return [orjson.loads(line) for line in r.stdout.splitlines()]


def test_put_and_del_are_conditional_on_if_match(node):
    c = node
    [put] = kv_json(c, "put", "cond/k", "v1", "--if-match", "0")  # 0: only if absent
    stale = str(put["index"])
    kv_json(c, "put", "cond/k", "v2", "--if-match", stale)
    for argv in (["put", "cond/k", "v3"], ["del", "cond/k"]):
        r = run_kv(*argv, "--if-match", stale, "--endpoints", c.url("n1"), env={"KV_TOKEN": "s3cret"})
        assert r.returncode == 1 and "did not hold" in refusal(r), r.stderr
    [got] = kv_json(c, "get", "cond/k")
    assert got["value"] == "v2"
    [deleted] = kv_json(c, "del", "cond/k", "--if-match", str(got["mod_index"]))
    assert deleted["deleted"] is True


def test_the_peer_port_given_as_an_endpoint_is_named(node):
    """A newcomer's run: the peer port as --endpoints reset the connection, and a put
    said its outcome was unknown. Nothing can be written there: the node says what the
    port is."""
    for argv in (["put", "k", "v"], ["get", "k"]):
        r = run_kv(*argv, "--endpoints", f"http://{node.listen['n1']}", env={"KV_TOKEN": "s3cret"})
        line = refusal(r)
        assert "this is node n1's peer port" in line and "--http address" in line and "unknown" not in line, line
    # etcd's clients (gRPC, HTTP/2) there: closed at once (grpcio then fails at once), and the
    # node's log says what it was (it said "frame length 1347569952 out of bounds")
    host, port = node.listen["n1"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        mine = "%s:%d" % s.getsockname()[:2]
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        assert s.recv(4096) == b""
    said = f"closing peer connection from {mine}: an HTTP/2 (gRPC) client was given the peer port instead of the node's --grpc address"
    wait_until(lambda: said in node.log("n1"), 10, "the log saying so, and where the connection came from")


def test_json_output_of_every_command(node, tmp_path):
    c = node
    [put] = kv_json(c, "put", "j/text", "hello")
    assert set(put) == {"key", "index", "term"} and put["key"] == "j/text"
    kv_json(c, "put", "j/bin", "-", stdin=b"\xff\x00")
    [got] = kv_json(c, "get", "j/text")
    assert got["key"] == "j/text" and got["value"] == "hello" and "mod_index" in got and "encoding" not in got
    [got] = kv_json(c, "get", "j/bin")
    assert got["value"] == "/wA=" and got["encoding"] == "base64"
    scanned = kv_json(c, "scan", "j/")  # a stream: one document per line
    assert [d["key"] for d in scanned] == ["j/bin", "j/text"]
    assert kv_json(c, "scan", "j/", "--stale") == scanned  # the node's own state (a newcomer compared nodes so)
    [deleted] = kv_json(c, "del", "j/bin")
    assert deleted["deleted"] is True and deleted["key"] == "j/bin"
    [status] = kv_json(c, "status")
    [n1] = status["nodes"]
    assert n1["reachable"] is True and n1["id"] == "n1" and n1["role"] == "leader" and n1["endpoint"] == c.url("n1")
    [members] = kv_json(c, "member", "list")
    assert [m["id"] for m in members["members"]] == ["n1"] and members["members"][0]["voter"] is True
    assert kv_json(c, "leader", "transfer", "n1") == [{"leader": "n1"}]
    snap = str(tmp_path / "s.lkvs")
    [saved] = kv_json(c, "snapshot", "save", snap, "--fresh")
    assert saved["file"] == snap and saved["index"] > 0
    r = run_kv("snapshot", "inspect", snap, "-o", "json")
    info = orjson.loads(r.stdout)
    assert r.stdout.count(b"\n") == 1 and info["keys"] == 1 and info["checksum_status"] == "ok"
    r = run_kv("snapshot", "restore", snap, "--data-dir", str(tmp_path / "r2"), "--id", "n9", "--peers", "n1=127.0.0.1:1")
    assert r.returncode != 0 and b"--peers must list the restored node 'n9'" in r.stderr
    assert not (tmp_path / "r2").exists()  # (it was left holding a LOCK file)
    r = run_kv("snapshot", "restore", snap, "--data-dir", str(tmp_path / "r"), "--id", "n1", "--peers", "n1=127.0.0.1:1", "-o", "json")
    assert orjson.loads(r.stdout)["keys"] == 1


def test_status_json_marks_unreachable_nodes(node):
    r = run_kv("status", "--endpoints", f"{node.url('n1')},http://127.0.0.1:9", "-o", "json", "--timeout", "1", env={"KV_TOKEN": "s3cret"})
    nodes = orjson.loads(r.stdout)["nodes"]
    assert r.returncode == 0 and [n["reachable"] for n in nodes] == [True, False] and nodes[1]["error"]
    # the dead node's own reason, not one about every endpoint (the other one answered)
    assert nodes[1]["error"].startswith("http://127.0.0.1:9 did not answer") and "no endpoint answered" not in nodes[1]["error"]
    # the table says why too, under it
    r = run_kv("status", "--endpoints", f"{node.url('n1')},http://127.0.0.1:9", "--timeout", "1", env={"KV_TOKEN": "s3cret"})
    lines = r.stdout.decode().splitlines()
    assert r.returncode == 0 and len(lines) == 3 and lines[2].split()[1] == "unreachable", lines
    why = r.stderr.decode().splitlines()
    assert len(why) == 1 and why[0].startswith("http://127.0.0.1:9 did not answer (") and "is the cluster running" not in why[0], why


def test_json_log_lines_carry_node_and_term_and_the_access_log(node):
    code, _, _ = node.request("n1", "GET", "/v1/status", headers={"Authorization": "Bearer s3cret"})
    assert code == 200
    assert node.request("n1", "GET", "/metrics")[0] == 200  # KV_METRICS_PUBLIC=1: no token needed
    assert node.request("n1", "GET", "/v1/status")[0] == 401
    lines = [orjson.loads(line) for line in node.log("n1").splitlines() if line.strip()]
    assert lines and all(d["node"] == "n1" and "term" in d and d["level"] and d["ts"].endswith("Z") for d in lines)
    assert any(d["logger"] == "kv.serve" and d["msg"].startswith("ready") and d["term"] >= 1 for d in lines)
    access = [d["http"] for d in lines if d["logger"] == "kv.access"]
    assert any(a["method"] == "GET" and a["path"] == "/v1/status" and a["route"] == "status" and a["status"] == 200 and a["forwarded"] is False for a in access)
    assert any(a["route"] == "status" and a["status"] == 401 for a in access)
    assert all(a["duration_ms"] >= 0 for a in access)


def test_container_healthcheck_follows_kv_http(node):
    check = [sys.executable, "-m", "kv.healthcheck"]
    ok = subprocess.run(check, capture_output=True, env={**os.environ, "KV_HTTP": node.http["n1"]}, timeout=30)
    assert ok.returncode == 0, ok.stderr  # /healthz needs no token
    port = free_port()
    down = subprocess.run(check, capture_output=True, env={**os.environ, "KV_HTTP": f"0.0.0.0:{port}"}, timeout=30)
    assert down.returncode == 1 and down.stderr.decode().startswith(f"kv healthcheck: http://127.0.0.1:{port}/healthz:")


def test_a_write_to_a_node_without_a_leader_is_refused_before_the_client_gives_up(tmp_path):
    """One member of three, started alone, never has a leader. The client's time-out was
    as long as the node's own (5 s), so the client gave up first and said the write's
    outcome was unknown. The client now tells the node how long it waits (X-Kv-Timeout),
    and the node answers by then that no leader took it: nothing was written."""
    c = ProcCluster(str(tmp_path), n=3, proxies=False)
    try:
        c.start("n1")
        for argv in (["put", "k", "v"], ["get", "k"]):
            r = run_kv(*argv, "--timeout", "3", "--endpoints", c.url("n1"))
            line = refusal(r)
            assert r.returncode == 1 and "no leader could take the request in time" in line and "it was not carried out" in line, line
        c.start("n2")  # a majority: a leader; the put was not carried out, then or since
        r = run_kv("get", "k", "--timeout", "20", "--endpoints", c.url("n1"))
        assert r.returncode == 1 and "does not exist" in r.stderr.decode(), r.stderr
    finally:
        c.close()


def test_a_node_started_alone_then_with_the_full_peers_is_refused(tmp_path):
    """A newcomer's run: n1 started alone first (a cluster of one), then with all three
    in --peers. n1 went on as a cluster of one, n2 and n3 formed a second cluster of the
    same name, and both took writes: a key read back differently from each. --peers only
    describes a new cluster, so n1 now refuses to start with other members than its
    cluster began with, and the other two are one cluster on their own."""
    c = ProcCluster(str(tmp_path), n=3, proxies=False)
    try:
        alone = ["--id", "n1", "--data-dir", c.data_dir("n1"), "--http", c.http["n1"], "--peers", f"n1={c.listen['n1']}", *c.extra]
        c.procs.start("n1", alone, os.path.join(c.root, "n1-alone.log"))
        c.wait_http("n1")
        r = run_kv("put", "split/a", "from-n1", "--endpoints", c.url("n1"), "--timeout", "20")
        assert r.returncode == 0, r.stderr
        c.stop("n1")
        c.start("n1", wait=False)  # now with n1, n2 and n3 in --peers
        assert c.procs["n1"].wait(timeout=60) == 1
        assert "holds a cluster that began with n1 and has the members n1 now, but --peers names n1, n2, n3" in c.log("n1"), c.log("n1")
        c.start("n2", "n3")
        r = run_kv("put", "split/a", "from-n2", "--endpoints", f"{c.url('n2')},{c.url('n3')}", "--timeout", "20")
        assert r.returncode == 0, r.stderr
        # The restart with the --peers it began with still works.
        c.procs.start("n1", alone, os.path.join(c.root, "n1-alone-again.log"))
        c.wait_http("n1")
    finally:
        c.close()


def test_a_member_restarted_on_another_peer_address_says_where_it_is_dialled_and_the_advice_works(tmp_path):
    """A follower started again with another address of its own in --peers waited as a
    pre-candidate for ever, its log saying only that it had no leader: the others dial the
    address in the membership. It now says so at start, with both ways out, and the first
    (tell the cluster it moved) brings it back."""
    c = ProcCluster(str(tmp_path), n=3, proxies=False)
    try:
        c.start()
        follower = next(i for i in c.ids if i != c.leader())
        c.stop(follower)
        old, new = c.listen[follower], f"127.0.0.1:{free_port()}"
        c.listen[follower] = new
        c.start(follower)
        line = f"--peers gives its peer address as {new}, but the membership it began with has {old}"
        wait_until(lambda: line in c.log(follower), 20, "the warning")
        assert f"kv member add {follower} {new} --replace" in c.log(follower) and f"{follower}={old} in --peers" in c.log(follower)
        r = run_kv("put", "moved/a", "1", "--endpoints", c.endpoints(), "--timeout", "20")
        assert r.returncode == 0, r.stderr
        r = run_kv("member", "add", follower, new, "--replace", "--endpoints", c.endpoints(), "--timeout", "20")
        assert r.returncode == 0, r.stderr
        wait_until(lambda: c.get(follower, "moved/a", consistency="stale")[1] == b"1", 20, "the moved member to catch up")
        c.stop(follower)
        c.start(follower)  # with the address the cluster now has for it: nothing to say
        wait_until(lambda: c.status(follower)["applied_index"] >= c.status(c.leader())["commit_index"], 20, "the restart to catch up")
        assert c.log(follower).count("--peers gives its peer address as") == 1
        # Moved as docs/cluster.md says (the cluster told while it is down): it says so, and is reached.
        c.stop(follower)
        r = run_kv("member", "add", follower, moved := f"127.0.0.1:{free_port()}", "--replace", "--endpoints", c.endpoints(), "--timeout", "20")
        assert r.returncode == 0, r.stderr
        r = run_kv("put", "moved/b", "2", "--endpoints", c.endpoints(), "--timeout", "20")
        assert r.returncode == 0, r.stderr
        c.listen[follower] = moved
        c.start(follower)
        wait_until(lambda: c.get(follower, "moved/b", consistency="stale")[1] == b"2", 20, "the member moved while down to catch up")
        assert c.log(follower).count("Unless the cluster was told it moved while it was down") == 2  # (its own membership was older)
    finally:
        c.close()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_a_cluster_runs_on_ipv6_addresses_in_brackets_and_names_them_so(tmp_path):
    """`--http [::1]:PORT` was refused ("cannot resolve the host"), `--http ::1:PORT`
    advertised http://::1:PORT, which etcdctl's --cluster could not reach, and a peer at
    `[::1]:PORT` stopped the node ("Name or service not known"). Two members on IPv6
    only: a write through one is read from the other."""
    from kv.server.config import NodeConfig, check_hostport

    assert check_hostport("[::1]:7001", "--http") == ("::1", 7001)
    assert NodeConfig(id="n1", data_dir=str(tmp_path / "c"), http="::1:8001").advertise_url == "http://[::1]:8001"
    ids = ("n1", "n2")
    http = {i: f"[::1]:{free_port()}" for i in ids}
    grpc = {i: f"[::1]:{free_port()}" for i in ids}
    peers = ",".join(f"{i}=[::1]:{free_port()}" for i in ids)
    procs = [subprocess.Popen(KV + ["serve", "--id", i, "--data-dir", str(tmp_path / i), "--http", http[i], "--grpc", grpc[i], "--peers", peers],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for i in ids]
    try:
        wait_until(lambda: run_kv("put", "v6", "1", "--endpoints", f"http://{http['n1']}", "--timeout", "5").returncode == 0, 30, "a write over IPv6")
        got = run_kv("get", "v6", "--endpoints", f"http://{http['n2']}")
        assert (got.returncode, got.stdout.strip()) == (0, b"1"), got.stdout + got.stderr
        members = orjson.loads(run_kv("member", "list", "-o", "json", "--endpoints", f"http://{http['n2']}").stdout)
        assert sorted(m["http"] for m in members["members"]) == sorted(f"http://{h}" for h in http.values()), members
        if shutil.which("etcdctl"):
            r = subprocess.run(["etcdctl", "--endpoints", grpc["n1"], "endpoint", "health", "--cluster"], capture_output=True, text=True,
                               env={**os.environ, "ETCDCTL_API": "3"}, timeout=30)
            assert r.returncode == 0 and all(f"http://{g} is healthy" in r.stdout + r.stderr for g in grpc.values()), r.stdout + r.stderr
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


def test_cors_from_the_command_line_lets_the_listed_page_in_and_no_other(tmp_path):
    """kv serve --cors, as an operator gives it, reaches the node: the listed page's write
    is answered with its CORS header, another page's is refused and writes nothing, and a
    client that sends no Origin (the kv CLI) is served as before."""
    import urllib.error
    import urllib.request

    http = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(KV + ["serve", "--id", "n1", "--data-dir", str(tmp_path / "n1"), "--http", http, "--peers", f"n1=127.0.0.1:{free_port()}",
                                  "--cors", "http://ui.example:3000/"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: run_kv("put", "cli", "1", "--endpoints", f"http://{http}", "--timeout", "5").returncode == 0, 30, "the CLI's write")

        def put(key: str, origin: str):
            req = urllib.request.Request(f"http://{http}/v1/kv/{key}", data=b"x", method="PUT", headers={"Origin": origin, "Content-Type": "text/plain"})
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return r.status, r.headers
            except urllib.error.HTTPError as e:
                return e.code, e.headers

        status, headers = put("page", "http://ui.example:3000")
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://ui.example:3000"
        status, headers = put("evil", "http://evil.example")
        assert status == 403 and "Access-Control-Allow-Origin" not in headers
        assert run_kv("get", "evil", "--endpoints", f"http://{http}").returncode != 0  # not written
        assert run_kv("get", "page", "--endpoints", f"http://{http}").stdout == b"x"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_listing_piped_into_head_stops_quietly(node):
    """`kv scan p/ | head -1` printed "kv scan: Broken pipe" once head had its line."""
    import kv

    c = node
    with kv.Client(c.url("n1"), token="s3cret") as client:
        for batch in range(40):  # 5,000 lines of 1 KB: far more than a pipe holds
            client.put_many({f"pipe/{batch:02d}/{i:03d}": b"v" * 1000 for i in range(125)})
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KV_")}, "KV_TOKEN": "s3cret"}
    with run_pipe(KV + ["scan", "pipe/", "--endpoints", c.url("n1")], env) as (proc, head):
        assert head.startswith(b"pipe/00/000\tvvv") and head.count(b"\n") == 1
        assert proc.returncode == 141, proc.returncode  # 128 + SIGPIPE, as `seq 1e9 | head -1`
        assert proc.stderr.read() == b""  # not "kv scan: Broken pipe"


@contextlib.contextmanager
def run_pipe(argv: list[str], env: dict):
    """argv | head -1: yields the command (finished) and what head printed."""
    kv = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    head = subprocess.run(["head", "-1"], stdin=kv.stdout, capture_output=True, timeout=60)
    kv.stdout.close()
    kv.wait(timeout=60)
    try:
        yield kv, head.stdout
    finally:
        kv.stderr.close()
