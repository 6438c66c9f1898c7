"""User-level tests: the CLI and the Python API from separate OS processes, the way people
use them — including their first mistakes (the same data dir twice, `kv cluster up` run
twice, a script that never closes its client, a join while the cluster is busy). Each
checks afterwards that nothing was lost and nothing in the data dir was touched."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from cluster import ProcCluster, wait_until
from kv.bench.harness import free_port
from kv.cli.cluster import layout as cluster_layout
from kv.server.datadir import LOCK_NAME

PY = sys.executable


def run_py(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, timeout=timeout)


KV_BIN = os.path.join(os.path.dirname(PY), "kv")  # the venv's console script


def kv_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "kv", *args], capture_output=True, text=True, timeout=timeout)


LOCK_FILES = {"LOCK", "lock.mdb"}  # ours and LMDB's: an opener may touch them, never data


def tree(path: str) -> dict[str, tuple[int, int]]:
    """Every data file under path with its size and mtime: what "nothing changed" compares."""
    out = {}
    for root, _dirs, files in os.walk(path):
        for f in files:
            if f in LOCK_FILES:
                continue
            p = os.path.join(root, f)
            st = os.stat(p)
            out[os.path.relpath(p, path)] = (st.st_size, st.st_mtime_ns)
    return out


def one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line, got:\n{stderr}"
    assert "Traceback" not in stderr
    return lines[0]


# -- one owner per data dir ---------------------------------------------------------------

HOLDER = """
import sys, kv
db = kv.open(sys.argv[1])
for i in range(100):
    db.put(f"k{i}", b"first")
print("ready", flush=True)
sys.stdin.readline()
for i in range(100, 200):
    db.put(f"k{i}", b"second")
db.close()
print("done", flush=True)
"""


def test_a_second_opener_of_an_embedded_store_is_refused_and_changes_nothing(tmp_path):
    d = str(tmp_path / "store")
    holder = subprocess.Popen([PY, "-c", HOLDER, d], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        before = tree(d)
        second = run_py(
            """
            import sys, kv
            try:
                kv.open(sys.argv[1])
            except kv.DataDirLocked as e:
                assert isinstance(e, kv.KVError)
                print(e)
                sys.exit(3)
            """,
            d,
        )
        assert second.returncode == 3, second.stderr
        assert f"in use by process {holder.pid}" in second.stdout
        served = kv_cli("serve", "--id", "local", "--data-dir", d, "--http", f"127.0.0.1:{free_port()}")
        assert served.returncode != 0
        assert f"in use by process {holder.pid}" in one_line(served.stderr)
        assert tree(d) == before, "a refused opener changed the data dir"
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "done"
        assert holder.wait(30) == 0
    finally:
        holder.kill()
        holder.wait()
    check = run_py(
        """
        import sys, kv
        with kv.open(sys.argv[1]) as db:
            items = {i.key: i.value for i in db.scan("k")}
        assert len(items) == 200, len(items)
        assert all(items[f"k{i}"] == (b"first" if i < 100 else b"second") for i in range(200))
        print("ok")
        """,
        d,
    )
    assert check.stdout.strip() == "ok", check.stderr
    assert not [n for n in os.listdir(d) if "damaged" in n]


def test_kv_serve_on_a_live_members_dir_is_refused(tmp_path):
    c = ProcCluster(str(tmp_path))
    try:
        c.start()
        lead = c.leader()
        for i in range(30):
            c.put(lead, f"a{i}", b"v")
        victim = next(i for i in c.ids if i != lead)
        before = set(os.listdir(c.data_dir(victim)))
        r = kv_cli(
            "serve", "--id", victim, "--data-dir", c.data_dir(victim), "--http", f"127.0.0.1:{free_port()}",
            "--peers", c.peers_for(victim).replace(c.listen[victim], f"127.0.0.1:{free_port()}"),
        )
        assert r.returncode != 0
        assert f"in use by process {c.procs[victim].pid}" in one_line(r.stderr)
        assert set(os.listdir(c.data_dir(victim))) == before
        assert all(c.alive(i) for i in c.ids)
        for i in range(30, 60):
            c.put(c.leader(), f"a{i}", b"v")
        c.wait_converged()
        for i in c.ids:
            assert len([k for k, _, _ in c.dump(i) if k.startswith("a")]) == 60
    finally:
        c.close()


def test_kv_serve_on_a_dir_of_another_cluster_is_refused_and_changes_nothing(tmp_path):
    c = ProcCluster(str(tmp_path / "a"))
    try:
        c.start()
        c.put(c.leader(), "kept", b"yes")
        c.wait_converged()
    finally:
        c.close()
    d = c.data_dir("n1")
    before = tree(d)
    for args, says in (
        (["--id", "n1", "--group", "other"], "of group 'default'"),
        (["--id", "n2"], "belongs to node 'n1'"),
    ):
        port = free_port()
        r = kv_cli("serve", *args, "--data-dir", d, "--http", f"127.0.0.1:{free_port()}", "--peers", f"{args[1]}=127.0.0.1:{port}")
        assert r.returncode != 0
        assert says in one_line(r.stderr)
    assert tree(d) == before


def _free_base_port() -> int:
    """A --base-port whose every port of `kv cluster up`'s layout (HTTP, peers, etcd API) is free."""
    ports = [int(node[part].rsplit(":", 1)[1]) for node in cluster_layout(3, 0) for part in ("http", "peer", "grpc")]
    return free_port(ports)


def test_cluster_up_twice_on_one_dir_refuses_the_second_and_keeps_the_first(tmp_path):
    d = str(tmp_path / "kvdata")
    base = _free_base_port()
    endpoints = ",".join(f"http://127.0.0.1:{base + i}" for i in range(3))
    up_args = ["cluster", "up", "--data-dir", d, "--base-port", str(base), "--heartbeat-ms", "50", "--election-timeout-ms", "500"]
    out = open(tmp_path / "up.out", "w")
    first = subprocess.Popen([PY, "-m", "kv", *up_args], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: kv_cli("put", "hello", "world", "--endpoints", endpoints, "--timeout", "5").returncode == 0, 60, "a write")
        node_dirs = {n: set(os.listdir(os.path.join(d, n))) for n in ("n1", "n2", "n3")}
        second = kv_cli(*up_args, "--base-port", str(_free_base_port()))
        assert second.returncode != 0
        assert f"in use by process {first.pid}" in one_line(second.stderr)
        assert first.poll() is None
        # Another data dir on the first cluster's ports: refused before anything starts
        # (it said "3/3 nodes answering", the first cluster's, while its own nodes died).
        third = kv_cli("cluster", "up", "--data-dir", str(tmp_path / "other"), "--base-port", str(base))
        assert third.returncode == 1 and f"n1's --http 127.0.0.1:{base}: port {base} is already in use" in one_line(third.stderr), third
        assert "--base-port N puts its nodes on ports N..N+2, N+100..N+102 and N+200..N+202" in one_line(third.stderr)
        assert not os.path.exists(tmp_path / "other")  # not even the lock it took while it looked
        got = kv_cli("get", "hello", "--endpoints", endpoints)
        assert got.returncode == 0 and got.stdout.strip() == "world"
        assert {n: set(os.listdir(os.path.join(d, n))) for n in node_dirs} == node_dirs
        first.send_signal(signal.SIGINT)
        assert first.wait(30) == 0
    finally:
        _stop_cluster_up(first, d)
        out.close()


@pytest.mark.parametrize("tokens", ["KV_TOKEN", "KV_TOKENS"])
def test_cluster_up_with_a_token_reports_its_leader_and_a_new_one(tmp_path, tokens):
    """With KV_TOKEN set (as docs/etcd.md starts one), `kv cluster up` asked its nodes'
    /v1/status without it, got 401s, and never reported a leader, not even after the
    leader was killed. (KV_TOKENS: a file whose tokens can only read and write.)"""
    (tmp_path / "tokens.toml").write_text('r1 = "read"\nw1 = "write"\n')
    env = {"KV_TOKEN": "s3cret"} if tokens == "KV_TOKEN" else {"KV_TOKENS": str(tmp_path / "tokens.toml")}
    base = _free_base_port()
    d = str(tmp_path / "kvdata")
    out_path = tmp_path / "up.out"
    out = open(out_path, "w")
    up = subprocess.Popen([PY, "-m", "kv", "cluster", "up", "--data-dir", d, "--base-port", str(base)],
                          stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})

    def leaders() -> list[str]:
        return [ln.split("leader: ", 1)[1].split()[0] for ln in out_path.read_text().splitlines() if "] leader: " in ln]

    try:
        wait_until(lambda: leaders(), 60, "kv cluster up to report a leader")
        first = leaders()[0]
        pid = next(int(ln.split()[-1]) for ln in out_path.read_text().splitlines() if ln.strip().startswith(first + " "))
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: any(x != first for x in leaders()), 60, "kv cluster up to report the new leader")
    finally:
        _stop_cluster_up(up, d)
        out.close()


def test_cluster_up_whose_terminal_closes_stops_its_nodes(tmp_path):
    """The terminal running `kv cluster up` closes (SIGHUP): it stops its nodes, as on
    Ctrl-C. It used to die at once, and the nodes (in sessions of their own) ran on, holding
    the ports and data dirs the next `kv cluster up` wanted."""
    d = str(tmp_path / "kvdata")
    base = _free_base_port()
    endpoints = ",".join(f"http://127.0.0.1:{base + i}" for i in range(3))
    out = open(tmp_path / "up.out", "w")
    up = subprocess.Popen([PY, "-m", "kv", "cluster", "up", "--data-dir", d, "--base-port", str(base)], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: kv_cli("put", "hello", "world", "--endpoints", endpoints, "--timeout", "5").returncode == 0, 60, "a write")
        pids = [int(ln.split()[-1]) for ln in (tmp_path / "up.out").read_text().splitlines() if ln.strip()[:2] in ("n1", "n2", "n3")]
        assert len(pids) == 3
        up.send_signal(signal.SIGHUP)
        assert up.wait(30) == 0
        for pid in pids:  # (not left as zombies either: cluster up waited for them)
            assert not os.path.exists(f"/proc/{pid}"), f"node {pid} still running"
        # The next run on this data dir keeps its ports: its members know each other by them
        # (other ones ran, but `kv member list` and etcd's MemberList showed the old ones).
        moved = kv_cli("cluster", "up", "--data-dir", d, "--base-port", str(base + 7))
        assert moved.returncode == 1 and f"holds a cluster of 3 nodes on --base-port {base}" in one_line(moved.stderr), moved.stderr
        assert "starting" not in moved.stdout
        up = subprocess.Popen([PY, "-m", "kv", "cluster", "up", "--data-dir", d], stdout=out, stderr=subprocess.STDOUT)
        wait_until(lambda: kv_cli("get", "hello", "--endpoints", endpoints, "--timeout", "5").stdout.strip() == "world", 60, "the same cluster back on its ports")
        assert (tmp_path / "up.out").read_text().count(f"with the data of an earlier run or a restore (n1, n2, n3), kept; to start an empty cluster instead, stop this and delete {d} first") == 1  # (the second run only)
        up.send_signal(signal.SIGINT)
        assert up.wait(30) == 0
    finally:
        _stop_cluster_up(up, d)
        out.close()


def _stop_cluster_up(up: subprocess.Popen, d: str) -> None:
    """Stop a `kv cluster up` a test started on data dir d as Ctrl-C does (it stops its
    nodes), then kill -9 whatever still runs on d: killed, cluster up cannot stop its
    nodes, which run in sessions of their own (a test failing before it stopped it)."""
    if up.poll() is None:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
    for pid in _processes_naming(d):
        os.kill(pid, signal.SIGKILL)


def _processes_naming(text: str) -> list[int]:
    """The pids of processes with `text` in their command line."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


@contextlib.contextmanager
def _piped_cluster_up(d: str, nodes: int):
    """`kv cluster up` on data dir d, its output read through a pipe; whatever it leaves
    running is killed at the end."""
    up = subprocess.Popen([PY, "-m", "kv", "cluster", "up", "--data-dir", d, "--base-port", str(_free_base_port()), "--nodes", str(nodes)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        yield up
    finally:
        _stop_cluster_up(up, d)


def test_cluster_up_whose_output_pipe_closes_stops_its_nodes(tmp_path):
    """`kv cluster up | head -1`: the reader goes away before the table of nodes is printed.
    The command stops its nodes and ends as a Unix tool does on a closed pipe (141); it
    used to die there and leave the nodes running, holding the ports and data dirs."""
    d = str(tmp_path / "kvdata")
    with _piped_cluster_up(d, 1) as up:
        assert up.stdout.readline().startswith(b"[")  # "starting 1 node under ..."
        up.stdout.close()  # (what head does once it has its line)
        assert up.wait(60) == 141
        time.sleep(1.0)  # (a node left behind would have its data dir by now)
        assert _processes_naming(d) == [], "the node runs on"


def test_cluster_up_whose_output_pipe_closes_later_stops_its_nodes_at_its_next_line(tmp_path):
    """The reader goes away after the table (kv cluster up | head -15): at the next line the
    command has to say (a node exited), it stops the others and ends (141). It ran on."""
    d = str(tmp_path / "kvdata")
    with _piped_cluster_up(d, 2) as up:
        lines = []
        while not any(ln.startswith(b"[") and b"leader: " in ln for ln in lines):
            lines.append(up.stdout.readline())
            assert lines[-1], lines
        pids = [int(ln.split()[-1]) for ln in lines if ln.strip()[:2] in (b"n1", b"n2")]
        up.stdout.close()
        os.kill(pids[0], signal.SIGKILL)
        assert up.wait(60) == 141
        time.sleep(0.5)
        assert _processes_naming(d) == [], "a node runs on"


def test_cluster_up_whose_nodes_die_at_start_exits_non_zero_naming_them(tmp_path):
    d = str(tmp_path / "kvdata")
    # A heartbeat longer than half the election timeout: every node refuses to start. (With
    # $KV_TOKEN, which the nodes inherit: it says that other shells need a token too.)
    r = subprocess.run([PY, "-m", "kv", "cluster", "up", "--data-dir", d, "--base-port", str(_free_base_port()), "--heartbeat-ms", "800"],
                       capture_output=True, text=True, timeout=90, env={**os.environ, "KV_TOKEN": "t0ken"})
    assert r.returncode != 0
    assert "tokens are on ($KV_TOKEN / $KV_TOKENS): in another shell, export KV_TOKEN=<a token> first" in r.stdout
    for n in ("n1", "n2", "n3"):
        assert f"node {n} exited with code 1; its log is {os.path.join(os.path.abspath(d), n, 'serve.log')}" in r.stdout
    assert "election-timeout" in r.stdout  # the node's own one-line reason



def _node_pid(data_dir: str) -> int:
    """The pid of the node that holds a data dir (written in its lock file), as `kv cluster
    up` names it: the shell that ran a bring-back command forks it."""
    with open(os.path.join(data_dir, LOCK_NAME)) as f:
        return int(f.read())


def _stop_shell_and_node(shell: subprocess.Popen, node_pid: int | None) -> None:
    """SIGTERM to the shell's process group (the shell and the node it started), then wait
    for both: the node's clean stop takes a while after the shell is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(shell.pid, signal.SIGTERM)
    shell.wait(30)
    if node_pid is not None and not wait_gone(node_pid, 30):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
        wait_gone(node_pid, 10)


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


class _UpRun:
    """`kv cluster up` on ports of its own, its output in a file, and the shell of a command
    it printed (run as a user would, in a session of its own); close() stops them all."""

    def __init__(self, tmp_path) -> None:
        self.d = str(tmp_path / "kvdata")
        self.base = _free_base_port()
        self.endpoints = ",".join(f"http://127.0.0.1:{self.base + i}" for i in range(3))
        self.out_path = tmp_path / "up.out"
        self._out = open(self.out_path, "w")
        # As the README runs it: the venv's kv, from a shell where the venv is not activated.
        self.up = subprocess.Popen(
            [KV_BIN, "cluster", "up", "--data-dir", self.d, "--base-port", str(self.base)], stdout=self._out, stderr=subprocess.STDOUT,
            env={**os.environ, "PATH": "/usr/bin:/bin"},
        )
        self.back: subprocess.Popen | None = None

    def text(self) -> str:
        return self.out_path.read_text()

    def printed(self, what: str) -> str:
        """The command on the line that says `what`."""
        return next(ln for ln in self.text().splitlines() if what in ln).split("in another shell: ", 1)[1]

    def run(self, command: str) -> None:
        self.back = subprocess.Popen(["bash", "-c", command], env={"PATH": "/usr/bin:/bin"}, start_new_session=True)

    def close(self) -> None:
        if self.back is not None:
            try:
                pid = _node_pid(os.path.join(self.d, "n3"))
            except (OSError, ValueError):
                pid = None
            _stop_shell_and_node(self.back, pid)
        if self.up.poll() is None:
            self.up.send_signal(signal.SIGINT)
            try:
                self.up.wait(30)
            except subprocess.TimeoutExpired:
                self.up.kill()
                self.up.wait()
        self._out.close()


def test_cluster_up_says_how_to_add_back_a_removed_node_and_that_works(tmp_path):
    """A newcomer's run: after `kv member remove n3`, `kv cluster up` quoted "stopping: exit
    code 1 after the error above" and printed n3's old command, which its old data dir makes
    fail at once. It quotes the error now, and prints the way back as a new member."""
    run = _UpRun(tmp_path)
    try:
        wait_until(lambda: kv_cli("put", "before", "1", "--endpoints", run.endpoints, "--timeout", "5").returncode == 0, 60, "a write")
        assert kv_cli("member", "remove", "n3", "--endpoints", run.endpoints).returncode == 0
        wait_until(lambda: "add it back as a new member" in run.text(), 30, "cluster up telling how to add n3 back")
        assert "this node as a member removed from the cluster" in run.text() and "after the error above" not in run.text(), run.text()
        assert kv_cli("put", "while-out", "2", "--endpoints", run.endpoints).returncode == 0
        run.run(run.printed("add it back as a new member"))

        def n3_voter() -> bool:
            r = kv_cli("member", "list", "-o", "json", "--endpoints", run.endpoints)
            return r.returncode == 0 and any(m["id"] == "n3" and m["voter"] for m in json.loads(r.stdout)["members"])

        wait_until(n3_voter, 60, "n3 a voter again")
        n3_url = f"http://127.0.0.1:{run.base + 2}"
        wait_until(lambda: kv_cli("get", "while-out", "--endpoints", n3_url, "--stale").stdout.strip() == "2", 30, "n3 caught up")
    finally:
        run.close()


def test_cluster_up_says_how_to_bring_a_dead_node_back_and_that_works(tmp_path):
    run = _UpRun(tmp_path)
    d, base, endpoints, up_out, up = run.d, run.base, run.endpoints, run.out_path, run.up
    try:
        wait_until(lambda: kv_cli("put", "before", "1", "--endpoints", endpoints, "--timeout", "5").returncode == 0, 60, "a write")
        # Not the default ports: it says how to point every command at them.
        assert f"export KV_ENDPOINTS={endpoints}" in up_out.read_text()
        # The commands it suggests run as printed, in a shell where the venv is not active.
        tried = next(ln for ln in up_out.read_text().splitlines() if "try:  " in ln).split("try:  ", 1)[1]
        assert tried.startswith(shlex.quote(KV_BIN) + " put hello world"), tried
        r = subprocess.run(["bash", "-c", tried], capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
        assert r.returncode == 0 and r.stdout.startswith("OK index="), (r.stdout, r.stderr)
        # ... the Python clients too: kv.Client() without endpoints reads it, as the CLI does.
        code = "import kv\nwith kv.Client() as c:\n    c.put('from-env', b'3')\n    print(c.get('from-env').value.decode(), c.endpoints[0])"
        r = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60, env={**os.environ, "KV_ENDPOINTS": endpoints})
        assert r.returncode == 0 and r.stdout.split() == ["3", endpoints.split(",")[0]], r.stderr[-2000:]
        assert kv_cli("get", "from-env", "--endpoints", endpoints).stdout == "3"

        def pid_of(nid: str) -> int:  # from the table cluster up printed
            return next(int(ln.split()[-1]) for ln in up_out.read_text().splitlines() if ln.strip().startswith(f"{nid} "))

        os.kill(pid_of("n3"), signal.SIGKILL)
        wait_until(lambda: "to bring n3 back" in up_out.read_text(), 30, "cluster up telling how to restart n3")
        command = run.printed("to bring n3 back")
        # Runnable as printed, in a shell where the venv is not active (the same
        # interpreter `kv cluster up` started the node with; after `env KV_...=...` for the
        # settings it inherited, if any), with -P: not whatever `kv` folder the shell is in.
        interpreter = shlex.split(command.split(" -P -m kv serve --id n3 ")[0])[-1]
        assert os.path.realpath(interpreter) == os.path.realpath(sys.executable), command
        assert kv_cli("put", "while-down", "2", "--endpoints", endpoints).returncode == 0
        run.run(command)
        n3_url = f"http://127.0.0.1:{base + 2}"
        wait_until(
            lambda: kv_cli("get", "while-down", "--endpoints", n3_url, "--stale").stdout.strip() == "2", 60, "n3 back and caught up"
        )
        assert up.poll() is None  # the others went on
        wait_until(lambda: "n3 answers again (restarted by hand); 3/3 nodes answering" in up_out.read_text(), 30, "cluster up seeing n3 back")
        # A node restarted by hand that dies again is reported too (it said nothing), and again back.
        os.killpg(run.back.pid, signal.SIGKILL)
        run.back.wait()
        wait_until(lambda: "n3 (restarted by hand) stopped answering; 2/3 nodes answering" in up_out.read_text(), 30, "cluster up seeing n3 gone again")
        # This time its data dir is gone too (rm -rf): the command does not make it anew (an
        # empty one comes back as a founding member that forgot its vote); the hint says to
        # remove and rejoin it. Made anew anyway, the cluster idles, and the leader finds it
        # out at a heartbeat and catches it up.
        n3_dir = os.path.join(d, "n3")
        shutil.rmtree(n3_dir)
        assert f"(if {shlex.quote(n3_dir)} is gone, a lost disk: kv member remove n3, then join it afresh" in up_out.read_text()
        refused = subprocess.run(["bash", "-c", command], env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=30)
        assert refused.returncode != 0 and "No such file or directory" in refused.stderr and not os.path.exists(n3_dir)
        os.makedirs(n3_dir)
        run.run(command)
        wait_until(lambda: up_out.read_text().count("n3 answers again (restarted by hand)") == 2, 60, "cluster up seeing n3 back again")
        wait_until(
            lambda: kv_cli("get", "while-down", "--endpoints", n3_url, "--stale").stdout.strip() == "2", 60, "n3 caught up from an empty data dir"
        )
        logs = "".join(open(os.path.join(d, n, "serve.log"), errors="replace").read() for n in ("n1", "n2"))
        assert "follower n3 answered with a ledger that ends at index 0" in logs and "kv member remove n3" in logs
        # Its own nodes all gone, but n3 (started by hand) answers: not "every node has exited".
        for nid in ("n1", "n2"):
            os.kill(pid_of(nid), signal.SIGKILL)
        wait_until(lambda: "restarted by hand?" in up_out.read_text(), 30, "cluster up noticing n3 still answers")
        assert "every node has exited" not in up_out.read_text() and up.poll() is None
        wait_until(lambda: "no leader: 1/3 nodes answering, and 2 are needed" in up_out.read_text(), 30, "cluster up saying n3 cannot lead alone")
        up.send_signal(signal.SIGINT)
        assert up.wait(30) == 1  # its nodes died
        n3_pid = _node_pid(os.path.join(d, "n3"))
        assert f"still running, started by hand: n3 (pid {n3_pid}): stop them with kill {n3_pid}" in up_out.read_text()
        # Another `kv cluster up` there is refused before it starts anything (its n3 would
        # stop at the data dir's lock, after the banner, with a bring-back hint that fails alike).
        again = kv_cli("cluster", "up", "--data-dir", d, "--base-port", str(base))
        assert again.returncode == 1 and f"n3 (pid {n3_pid}). Stop them first (kill {n3_pid})" in again.stderr, again.stderr
        assert "starting" not in again.stdout + again.stderr and run.back.poll() is None
    finally:
        run.close()

# -- the HTTP client ----------------------------------------------------------------------

CLIENT_SCRIPT = """
import sys, kv
c = kv.Client(sys.argv[1])  # never closed: the script must still end quietly
c.put("services/api", b'{"port": 8080}')
item = c.get("services/api")
assert item.value == b'{"port": 8080}' and item.mod_index > 0, item
c.cas("services/api", item.mod_index, b'{"port": 9090}')
try:
    c.cas("services/api", item.mod_index, b'{"port": 1}')
    sys.exit("a stale compare-and-set succeeded")
except kv.PreconditionFailed as e:
    now = c.get("services/api")
    assert e.key == "services/api" and e.mod_index == now.mod_index > item.mod_index, (e.key, e.mod_index, now)
    assert now.value == b'{"port": 9090}'
try:
    c.put("services/db", b"x", if_absent=True)
    c.put("services/db", b"y", if_absent=True)
    sys.exit("if_absent wrote over an existing key")
except kv.PreconditionFailed as e:
    assert e.key == "services/db" and e.mod_index > 0
c.put_many({f"hosts/{i:05d}": b"up" for i in range(2500)})
keys = [i.key for i in c.scan("hosts/")]
assert keys == [f"hosts/{i:05d}" for i in range(2500)], len(keys)
assert len(list(c.scan("hosts/", limit=10))) == 10
print("ok")
"""

ASYNC_CLIENT_SCRIPT = """
import asyncio, sys, kv

async def main():
    c = kv.AsyncClient(sys.argv[1])  # never closed either
    await c.put("a", b"1")
    item = await c.get("a")
    await c.cas("a", item.mod_index, b"2")
    assert len(await c.scan("hosts/")) == 2500
    print("ok")

asyncio.run(main())
"""


def _raw_http(url: str, data: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(data)
        return s.recv(4096)


@pytest.mark.parametrize("front", ["fast", "aiohttp"])
def test_client_read_then_cas_over_http_from_another_process(tmp_path, front):
    """kv.Client, kv.AsyncClient and the CLI from other processes, over the default HTTP
    front (http/fastpath.py) and with `kv serve --http-aiohttp-only`; malformed requests
    get a 400 on either and change nothing."""
    only = ["--http-aiohttp-only"] if front == "aiohttp" else []
    c = ProcCluster(str(tmp_path), extra=["--max-txn-ops", "2500", *only])  # put_many of 2500 keys
    try:
        c.start()
        lead = c.leader()
        follower = next(i for i in c.ids if i != lead)  # writes are forwarded
        for script in (CLIENT_SCRIPT, ASYNC_CLIENT_SCRIPT):
            r = run_py(script, c.url(follower))
            assert r.stdout.strip() == "ok", r.stderr
            assert "Unclosed" not in r.stderr and "Traceback" not in r.stderr, r.stderr
        endpoints = ["--endpoints", c.url(follower)]
        assert kv_cli("put", "cli/k", "v1", *endpoints).returncode == 0
        got = kv_cli("get", "cli/k", *endpoints)
        assert got.returncode == 0 and got.stdout.strip() == "v1", got
        for bad in (
            b"PUT /v1/kv/cli/k HTTP/1.1\nHost: x\nContent-Length: 2\n\nv2",  # bare LF line ends
            b"PUT /v1/kv/cli/k HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 9000 + b"\r\nContent-Length: 2\r\n\r\nv2",
        ):
            assert _raw_http(c.url(follower), bad).split(b" ")[1] in (b"400", b"431")
        c.wait_converged()
        assert sum(1 for k, _, _ in c.dump(lead) if k.startswith("hosts/")) == 2500
        assert c.get(lead, "cli/k")[:2] == (200, b"v1")  # the malformed PUTs wrote nothing
    finally:
        c.close()


def test_node_scan_reads_past_a_thousand_keys(tmp_path):
    r = run_py(
        """
        import asyncio, sys, kv

        async def main():
            async with kv.Node(id="n1", data_dir=sys.argv[1], max_txn_ops=2345) as node:
                await node.txn(ops=[kv.Put(f"s/{i:05d}", b"x") for i in range(2345)])
                assert len(await node.scan("s/")) == 2345
                assert len(await node.scan("s/", limit=7)) == 7
                assert len([i async for i in node.scan("s/", page=100)]) == 2345
            print("ok")

        asyncio.run(main())
        """,
        str(tmp_path / "n1"),
    )
    assert r.stdout.strip() == "ok", r.stderr


# -- joining ------------------------------------------------------------------------------


@pytest.mark.slow
def test_joins_wait_for_a_cluster_that_is_not_up_yet_and_for_each_other(tmp_path):
    c = ProcCluster(str(tmp_path), proxies=False)
    try:
        c.add_node("n4")
        c.add_node("n5")
        # Both ask n1 before it runs (connection refused), then at the same time (one of the
        # two changes is refused with 409 while the other is in flight): both must wait.
        c.start("n4", "n5", wait=False, join_via="n1")
        time.sleep(1.0)  # a while with nobody to join through: they must keep waiting
        assert c.alive("n4") and c.alive("n5")
        c.start("n1", "n2", "n3")

        def voters():
            try:
                return {m["id"] for m in c.members(c.leader()) if m["voter"]}
            except (OSError, AssertionError):
                return set()

        wait_until(lambda: voters() == {"n1", "n2", "n3", "n4", "n5"}, 90, "n4 and n5 voters")
        assert c.alive("n4") and c.alive("n5")
        c.put(c.leader(), "after-join", b"1")
        c.wait_converged()
    finally:
        c.close()


def test_join_gives_up_on_a_permanent_refusal_and_after_its_timeout(tmp_path):
    c = ProcCluster(str(tmp_path), proxies=False)
    try:
        c.start()
        # The id is already a member with another address: no point in waiting.
        t0 = time.monotonic()
        r = kv_cli(
            "serve", "--id", "n2", "--data-dir", str(tmp_path / "imposter"), "--http", f"127.0.0.1:{free_port()}",
            "--peers", f"n2=127.0.0.1:{free_port()}", "--join", c.url("n1"),
        )
        assert r.returncode != 0 and "already a member" in one_line(r.stderr)
        assert time.monotonic() - t0 < 30
        # A voter whose data dir is gone, started again with --join at its own addresses: it
        # forgot its log and its votes, so it is refused until it is removed (a rejoin).
        c.kill("n3")
        shutil.rmtree(c.data_dir("n3"))
        r = kv_cli(
            "serve", "--id", "n3", "--data-dir", c.data_dir("n3"), "--http", c.http["n3"],
            "--peers", f"n3={c.listen['n3']}", "--join", c.url("n1"),
        )
        _refused_as_a_voter_that_lost_its_data(c, r)
        # As the refusal says: remove it, join again (now its HTTP address is in the
        # membership too, so a join with the same addresses looks like a retry of its own).
        # Added back first as a learner without its client URL, as a newcomer did (the join
        # was refused as "already a member": now it records the URL)...
        assert kv_cli("member", "remove", "n3", "--endpoints", c.url("n1")).returncode == 0
        assert kv_cli("member", "add", "n3", c.listen["n3"], "--endpoints", c.url("n2")).returncode == 0
        assert "membership changed: n1, n2\n" in c.log(c.leader()) and "membership changed: n1, n2, n3 (learner)" in c.log(c.leader())
        c.joining["n3"] = True
        c.start("n3", join_via="n1")
        wait_until(lambda: {m["id"]: m["voter"] for m in c.members(c.leader())}.get("n3"), 60, "n3 a voter again")
        # ... and lose its data once more: refused again, where it was let in before.
        c.kill("n3")
        shutil.rmtree(c.data_dir("n3"))
        r = kv_cli(
            "serve", "--id", "n3", "--data-dir", c.data_dir("n3"), "--http", c.http["n3"],
            "--peers", f"n3={c.listen['n3']}", "--join", c.url("n1"), timeout=30,  # (let in, it would run on)
        )
        _refused_as_a_voter_that_lost_its_data(c, r)
        # --join given to a data dir that holds a one-node cluster of its own (started once
        # without --peers): refused, where it ran on alone saying it had joined.
        alone, http9 = str(tmp_path / "n9-alone"), f"127.0.0.1:{free_port()}"
        first = subprocess.Popen([PY, "-m", "kv", "serve", "--id", "n9", "--data-dir", alone, "--http", http9], stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: kv_cli("put", "x", "1", "--endpoints", f"http://{http9}", "--timeout", "2").returncode == 0, 30, "n9 alone up")
        finally:
            first.terminate()
            first.wait(30)
        r = kv_cli("serve", "--id", "n9", "--data-dir", alone, "--http", http9, "--peers", f"n9=127.0.0.1:{free_port()}", "--join", c.url("n1"), timeout=30)
        assert r.returncode != 0 and "already holds a cluster of its own, whose only member is n9" in one_line(r.stderr), r.stderr
        assert "n9" not in {m["id"] for m in c.members(c.leader())}
    finally:
        c.close()
    dead = f"http://127.0.0.1:{free_port()}"
    r = kv_cli(
        "serve", "--id", "n9", "--data-dir", str(tmp_path / "n9"), "--http", f"127.0.0.1:{free_port()}",
        "--peers", f"n9=127.0.0.1:{free_port()}", "--join", dead, "--join-timeout", "3",
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "did not add n9 within 3s" in r.stderr.strip().splitlines()[-1]  # after its log lines of retrying


def _refused_as_a_voter_that_lost_its_data(c: ProcCluster, r) -> None:
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    said = one_line(r.stderr)
    assert "n3 is already a voting member" in said and "kv member remove n3" in said, said
    assert {m["id"]: m["voter"] for m in c.members(c.leader())} == {"n1": True, "n2": True, "n3": True}
    assert not os.path.exists(os.path.join(c.data_dir("n3"), "ledger"))  # nothing was started


WATCH_UNTIL_CTRL_C = """
import os, signal, sys, threading, kv
with kv.Client(sys.argv[1]) as c:
    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    for ev in c.watch("nothing/"):
        print(ev)
"""


def test_ctrl_c_on_a_watch_loop_is_a_plain_keyboard_interrupt(tmp_path):
    c = ProcCluster(str(tmp_path / "cluster"), proxies=False)
    try:
        c.start()
        c.leader()
        r = run_py(WATCH_UNTIL_CTRL_C, c.url(c.ids[0]), timeout=60)
        assert r.returncode == -signal.SIGINT, r.stderr
        assert r.stderr.rstrip().endswith("KeyboardInterrupt") and "During handling" not in r.stderr, r.stderr
    finally:
        c.close()
