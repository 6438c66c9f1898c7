"""Locks and elections across real OS processes on a real cluster: a lock contended by
several processes (Python API and `kv lock`) gives no overlapping critical sections and
loses no increment; a holder killed with -9 frees the lock within its ttl (plus the
election timeout and a second); `kv elect` hands leadership over when the leader dies and
a listener sees every change."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import orjson
import pytest
from cluster import Proc, ProcCluster, wait_until

import kv

PY = sys.executable
ELECTION_S = 0.5  # tests/cluster.py FAST
SLACK_S = 3.0  # a loaded 2-core machine: process start-up and scheduling


@pytest.fixture
def cluster(tmp_path):
    c = ProcCluster(str(tmp_path / "cluster"))
    c.start()
    c.leader()
    yield c
    c.close()


def endpoints(c: ProcCluster, first: int = 0) -> str:
    ids = c.ids[first:] + c.ids[:first]  # each process starts at a different node
    return ",".join(c.url(i) for i in ids)


def waiting_line(c: ProcCluster, name: str) -> list[dict]:
    """The keys of a lock's (or an election's) queue, oldest first: the first holds it."""
    items = orjson.loads(c.request(c.leader(), "GET", f"/v1/kv?prefix={name}/")[2])["items"]
    return sorted(items, key=lambda it: it["mod_index"])


def lease_of(item: dict) -> int:
    return int(item["key"].rsplit("/", 1)[1], 16)  # NAME/<lease id in hex>


def holding(kv_lock: list[str], pidfile: str) -> subprocess.Popen:
    """kv lock running HOLDS: returned once its command runs (it holds the lock)."""
    a = subprocess.Popen(kv_lock + [PY, "-c", HOLDS, pidfile], stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: os.path.exists(pidfile) and open(pidfile).read(), 60, "the first command running")
    except BaseException:
        stop(a)
        raise
    return a


def revoke(c: ProcCluster, lease: int) -> None:
    r = subprocess.run([PY, "-m", "kv", "lease", "revoke", str(lease), "--endpoints", endpoints(c)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def stop(*procs) -> None:
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(10)


INCREMENTER = """
import os, sys, time, kv
eps, n, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with kv.Client(eps) as c:
    for _ in range(n):
        with c.lock("jobs/counter", ttl=5):
            # O_EXCL: a second holder inside the section at the same time fails here.
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            try:
                item = c.get("counter")
                value = int(item.value) if item else 0
                time.sleep(0.01)  # widen the window a second holder would need
                c.put("counter", str(value + 1).encode())
            finally:
                os.close(fd)
                os.unlink(marker)
print("done", flush=True)
"""


def test_contended_lock_no_overlap_no_lost_increment(cluster, tmp_path):
    c = cluster
    marker = str(tmp_path / "inside")
    workers, each = 4, 8
    procs = [subprocess.Popen([PY, "-c", INCREMENTER, endpoints(c, w % 3), str(each), marker], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(workers)]
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-3000:]
            assert out.strip() == "done"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    with kv.Client(endpoints(c)) as client:
        assert client.get("counter").value == str(workers * each).encode()
        assert list(client.scan("jobs/counter/")) == [], "a released lock left its key behind"


INCREMENT_FILE = """
import os, sys, time
path = sys.argv[1]
fd = os.open(path + ".inside", os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # fails if another holder is inside
try:
    n = int(open(path).read()) if os.path.exists(path) else 0
    time.sleep(0.2)  # longer than a process start: concurrent holders would meet here
    with open(path + ".tmp", "w") as f:
        f.write(str(n + 1))
    os.replace(path + ".tmp", path)
finally:
    os.close(fd)
    os.unlink(path + ".inside")
"""


def test_kv_lock_cli_serialises_commands(cluster, tmp_path):
    c = cluster
    counter = str(tmp_path / "counter")
    script = tmp_path / "incr.py"
    script.write_text(INCREMENT_FILE)
    loop = textwrap.dedent(f"""
        import subprocess, sys
        for i in range(5):
            # options before or after the name: both are the lock's
            opts = ["--endpoints", sys.argv[1], "--ttl", "5"]
            args = opts + ["files/counter"] if i % 2 else ["files/counter"] + opts
            r = subprocess.run([sys.executable, "-m", "kv", "lock", *args, "--", sys.executable, {str(script)!r}, {counter!r}])
            if r.returncode:
                sys.exit(r.returncode)
    """)
    procs = [subprocess.Popen([PY, "-c", loop, endpoints(c, w)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(3)]
    try:
        for p in procs:
            _, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert open(counter).read() == "15"
    # The command's exit status is kv lock's.
    r = subprocess.run([PY, "-m", "kv", "lock", "--endpoints", endpoints(c), "files/counter", "--", PY, "-c", "raise SystemExit(3)"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stderr


HOLDER = """
import sys, time, kv
with kv.Client(sys.argv[1]) as c:
    with c.lock("jobs/k9", ttl=float(sys.argv[2])):
        print("held", flush=True)
        time.sleep(float(sys.argv[3]))  # holds the lock this long
print("released", flush=True)
"""


def test_holder_killed_with_sigkill_frees_the_lock_within_ttl(cluster):
    c = cluster
    ttl = 2.0
    a = Proc([PY, "-c", HOLDER, endpoints(c, 0), str(ttl), "600"])
    b = None
    try:
        a.expect("held", 60)
        b = Proc([PY, "-c", HOLDER, endpoints(c, 1), str(ttl), "0"])
        b.quiet(ttl * 1.5)  # A keeps its lease alive: B waits, longer than a ttl
        a.p.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        got = b.expect("held", ttl + ELECTION_S + 1 + SLACK_S + 10)
        waited = got - killed
        assert waited <= ttl + ELECTION_S + 1 + SLACK_S, f"the lock was freed {waited:.2f}s after its holder died (ttl {ttl}s)"
        b.expect("released", 30)
        assert b.p.wait(30) == 0, b.stderr()
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_ctrl_c_while_waiting_for_a_lock_in_python_leaves_the_queue_at_once(cluster):
    """A newcomer's run: Ctrl-C in c.lock() printed "Task exception was never retrieved
    ... Session is closed" and left its place in the queue until its lease expired (the
    client closed before the waiter's cleanup ran), so the next waiter waited that long."""
    c = cluster
    ttl = 30.0
    a = Proc([PY, "-c", HOLDER, endpoints(c, 0), str(ttl), "600"])
    b = None
    try:
        a.expect("held", 60)
        b = Proc([PY, "-c", HOLDER, endpoints(c, 1), str(ttl), "0"])
        wait_until(lambda: len(waiting_line(c, "jobs/k9")) == 2, 60, "the second holder queued")
        b.p.send_signal(signal.SIGINT)
        assert b.p.wait(30) != 0
        wait_until(lambda: len(waiting_line(c, "jobs/k9")) == 1, ttl / 3, "the interrupted waiter's key gone, well before its lease's ttl")
        err = b.p.stderr.read()
        assert "KeyboardInterrupt" in err and "never retrieved" not in err and "Session is closed" not in err, err
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_kv_elect_says_when_it_lost_the_leadership_and_exits(cluster):
    """`kv elect` held on after its lease was revoked elsewhere, still "elected", beside the
    next leader. It now watches its key and exits 1 saying so."""
    c = cluster
    kv_cmd = [PY, "-m", "kv", "elect", "--endpoints", endpoints(c), "--ttl", "30", "revoked"]
    a = Proc(kv_cmd + ["host-a"])
    b = None
    try:
        a.expect("elected: host-a", 30)
        b = Proc(kv_cmd + ["host-b"])
        wait_until(lambda: len(waiting_line(c, "revoked")) == 2, 60, "host-b campaigning")
        revoke(c, lease_of(waiting_line(c, "revoked")[0]))
        b.expect("elected: host-b", 30)
        assert a.p.wait(10) == 1  # well before a keepalive (every 10 s) would have told it
        said = a.stderr().splitlines()
        assert len(said) == 1 and said[0].startswith("kv elect: lost the leadership of revoked (its key revoked/"), said
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_kv_elect_hands_over_when_the_leader_dies(cluster):
    c = cluster
    ttl = 2.0
    kv_cmd = [PY, "-m", "kv", "elect", "--endpoints", endpoints(c), "--ttl", str(ttl), "scheduler"]
    listener = Proc(kv_cmd + ["--listen"])
    a = b = None
    try:
        listener.expect("-", 30)  # nobody leads yet
        a = Proc(kv_cmd + ["host-a"])
        a.expect("elected: host-a", 30)
        listener.expect("host-a", 30)
        b = Proc(kv_cmd + ["host-b"])
        b.quiet(ttl * 1.5)  # host-a is alive: host-b waits
        a.p.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        got = b.expect("elected: host-b", ttl + ELECTION_S + 1 + SLACK_S + 10)
        assert got - killed <= ttl + ELECTION_S + 1 + SLACK_S, got - killed
        listener.expect("host-b", 30)
        b.p.send_signal(signal.SIGTERM)  # resigns on the way out
        assert b.p.wait(30) == 0, b.stderr()
        listener.expect("-", 30)
        with kv.Client(endpoints(c)) as client:
            assert client.election("scheduler").leader() is None
    finally:
        for p in (listener, a, b):
            if p is not None:
                p.stop()


HOLDS = """
import os, signal, sys, time
def on_term(*_):
    open(sys.argv[1] + ".term", "w").write("got SIGTERM")
    sys.exit(3)
signal.signal(signal.SIGTERM, on_term)
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(600)  # runs until it is signalled
"""

CHECKS_PREDECESSOR_GONE = """
import os, sys
pid = int(open(sys.argv[1]).read())
try:
    os.kill(pid, 0)
    print("overlap: the previous holder's command is still running", flush=True)
except ProcessLookupError:
    print("alone", flush=True)
"""


def test_kv_lock_killed_with_sigkill_takes_its_command_down(cluster, tmp_path):
    """The command must not run on without the lock: when kv lock dies (kill -9), its
    command (and what the command started) dies too, before the next holder starts."""
    c = cluster
    pidfile = str(tmp_path / "a.pid")
    kv_lock = [PY, "-m", "kv", "lock", "jobs/cmd", "--endpoints", endpoints(c), "--ttl", "3", "--"]
    a = subprocess.Popen(kv_lock + [PY, "-c", HOLDS, pidfile], stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: os.path.exists(pidfile) and open(pidfile).read(), 60, "the first command running")
        command_pid = int(open(pidfile).read())
        time.sleep(1)  # the command runs a while under the lock before kv lock dies
        a.send_signal(signal.SIGKILL)
        second = subprocess.run(kv_lock + [PY, "-c", CHECKS_PREDECESSOR_GONE, pidfile], capture_output=True, text=True, timeout=60)
        assert second.returncode == 0, second.stderr
        assert second.stdout.strip() == "alone", second.stdout
        with pytest.raises(ProcessLookupError):
            os.kill(command_pid, 0)
    finally:
        if a.poll() is None:
            a.kill()
        a.wait(10)


def test_a_lock_revoked_elsewhere_stops_its_command_before_the_next_holder_starts(cluster, tmp_path):
    """A newcomer's run: A held a lock (ttl 15), B waited, and A's lease was revoked with
    kv lease revoke. B's command started at once, but A's ran on until A's next keepalive
    (up to ttl/3), both holding the lock meanwhile. A now watches its own key."""
    c = cluster
    pidfile = str(tmp_path / "a.pid")
    kv_lock = [PY, "-m", "kv", "lock", "jobs/rev", "--endpoints", endpoints(c), "--ttl", "30", "--"]
    a = holding(kv_lock, pidfile)
    b = bare = None
    try:
        b = subprocess.Popen(kv_lock + [PY, "-c", CHECKS_PREDECESSOR_GONE, pidfile], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_until(lambda: len(waiting_line(c, "jobs/rev")) == 2, 60, "the second kv lock queued")
        revoke(c, lease_of(waiting_line(c, "jobs/rev")[0]))
        out, err = b.communicate(timeout=60)
        assert b.returncode == 0 and out.strip() == "alone", (out, err)
        assert a.wait(30) == 1
        said = a.stderr.read().splitlines()  # "locked ...", then one line for the loss
        assert len(said) == 2 and said[1].startswith("kv lock: the lock jobs/rev was lost (its key jobs/rev/"), said
        # Without a command, kv lock holds until Ctrl-C, or until the lock is lost: said too.
        bare = subprocess.Popen([PY, "-m", "kv", "lock", "jobs/bare", "--endpoints", endpoints(c), "--ttl", "30"], stderr=subprocess.PIPE, text=True)
        wait_until(lambda: len(waiting_line(c, "jobs/bare")) == 1, 60, "kv lock holding without a command")
        revoke(c, lease_of(waiting_line(c, "jobs/bare")[0]))
        assert bare.wait(30) == 1
        said = bare.stderr.read().splitlines()
        assert len(said) == 2 and said[1].startswith("kv lock: the lock jobs/bare was lost (its key jobs/bare/"), said
    finally:
        stop(a, b, bare)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_kv_lock_and_elect_interrupted_while_waiting_leave_the_queue_at_once(cluster, tmp_path, sig):
    """128 + the signal, the command not run, the waiter's key gone at once. Ctrl-C of kv
    lock was 0, as if its command had run and succeeded; kv elect's was 0; SIGTERM left
    the key in the queue for a ttl (30 s here), holding up whoever came next."""
    c = cluster
    pidfile, ran = str(tmp_path / "a.pid"), tmp_path / "ran"
    kv_lock = [PY, "-m", "kv", "lock", "jobs/int", "--ttl", "30", "--endpoints", endpoints(c), "--"]
    kv_elect = [PY, "-m", "kv", "elect", "--endpoints", endpoints(c), "--ttl", "30", "jobs/int", "host-w"]
    a = holding(kv_lock, pidfile)
    w = None
    try:
        for waiter in (kv_lock + ["touch", str(ran)], kv_elect):
            w = subprocess.Popen(waiter, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            wait_until(lambda: len(waiting_line(c, "jobs/int")) == 2, 60, f"{waiter[3]} queued")
            w.send_signal(sig)
            assert w.wait(30) == 128 + sig, w.stderr.read()
            assert not ran.exists() and w.stdout.read() == ""  # neither ran nor was elected
            assert len(waiting_line(c, "jobs/int")) == 1  # at once: not when its lease runs out
    finally:
        stop(a, w)


def test_kv_lock_passes_sigterm_to_its_command_then_frees_the_lock(cluster, tmp_path):
    c = cluster
    pidfile = str(tmp_path / "c.pid")
    kv_lock = [PY, "-m", "kv", "lock", "jobs/term", "--endpoints", endpoints(c), "--ttl", "30", "--"]
    a = subprocess.Popen(kv_lock + [PY, "-c", HOLDS, pidfile], stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: os.path.exists(pidfile) and open(pidfile).read(), 60, "the command running")
        a.send_signal(signal.SIGTERM)
        assert a.wait(30) == 128 + signal.SIGTERM
        assert open(pidfile + ".term").read() == "got SIGTERM"
        t0 = time.monotonic()
        r = subprocess.run(kv_lock[:-1] + ["--wait", "10", "--", PY, "-c", "print('next')"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == "next", r.stderr
        assert time.monotonic() - t0 < 10  # released at once, not after its 30 s ttl
    finally:
        if a.poll() is None:
            a.kill()
        a.wait(10)
    r = subprocess.run([PY, "-m", "kv", "lock", "jobs/term", "--endpoints", endpoints(c), "--", "/nonexistent/command"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 127 and "cannot run /nonexistent/command" in r.stderr, r.stderr


HOLDS_WITH_ON_LOST = """
import sys, threading, kv
lost = threading.Event()
def on_lost(err):
    print("lost:", type(err).__name__, err, flush=True)
    lost.set()
with kv.Client(sys.argv[1]) as c:
    with c.lock("guarded", ttl=60, on_lost=on_lost) as held:
        assert held.held
        print("holding", flush=True)
        lost.wait(120)
        print("held:", held.held, flush=True)
"""


def test_python_lock_calls_on_lost_when_its_lease_is_revoked_elsewhere(cluster):
    """Client.lock(on_lost=) as election(on_lost=): the holder is told at once (it watches
    its own key), not at its next keepalive 20 s later; `held` turns False."""
    c = cluster
    a = Proc([PY, "-c", HOLDS_WITH_ON_LOST, endpoints(c)])
    try:
        a.expect("holding", 60)
        revoke(c, lease_of(waiting_line(c, "guarded")[0]))
        revoked = time.monotonic()
        got = a.expect("lost: LeaseNotFound", 30)
        assert got - revoked < 10, got - revoked  # its keepalive (every ttl/3 = 20 s) would be later
        a.expect("held: False", 30)
    finally:
        a.stop()


def test_an_election_gives_each_leadership_a_fencing_token(cluster):
    """Election had no fencing token: a paused leader logged "LEADING" seconds after
    another was elected. is_leader turns False when the leadership is lost, and every later
    leadership's revision is higher, for the guarded resource to refuse the stale one."""
    c = cluster
    with kv.Client(endpoints(c)) as a, kv.Client(endpoints(c)) as b:
        first = a.election("fenced", ttl=5)
        first.campaign(b"a")
        assert first.is_leader and first.key.startswith("fenced/") and first.revision > 0
        token = first.revision
        assert b.get(first.key).mod_index == token  # the token is its key's revision
        b.lease_revoke(first._e.lease.id)  # as if its lease expired while it was paused
        wait_until(lambda: not first.is_leader, timeout=10, what="the lost leadership noticed")
        second = b.election("fenced", ttl=5)
        second.campaign(b"b", timeout=10)
        assert second.is_leader and second.revision > token
        second.resign()
        assert not second.is_leader
