"""The command line: config precedence, errors, help (the Docker files: test_docker.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kv import BadRequest
from kv.cli import build_parser, serve_config

def config_of(argv, env=None, monkeypatch=None):
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    return serve_config(build_parser().parse_args(["serve", *argv]))


def test_flags_beat_toml_beat_environment(tmp_path, monkeypatch):
    toml = tmp_path / "node.toml"
    toml.write_text('heartbeat_ms = 70\nelection_timeout_ms = 900\ngroup = "from-toml"\npeers = "n1=127.0.0.1:7001"\n')
    env = {"KV_HEARTBEAT_MS": "60", "KV_GROUP": "from-env", "KV_TOKEN": "env-token", "KV_ELECTION_TIMEOUT_MS": "800"}
    c = config_of(["--id", "n1", "--data-dir", str(tmp_path), "--config", str(toml), "--heartbeat-ms", "80"], env, monkeypatch)
    assert c.heartbeat_ms == 80  # flag
    assert c.group == "from-toml" and c.election_timeout_ms == 900  # toml over env
    assert c.token == "env-token"  # only the environment sets it
    assert c.peers == {"n1": "127.0.0.1:7001"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data-dir", "/tmp/x"], "--id"),
        (["--id", "n1", "--data-dir", "/tmp/x", "--peers", "n1=nowhere"], "HOST:PORT"),
        (["--id", "n1", "--data-dir", "/tmp/x", "--peers", "n2=127.0.0.1:1"], "must list this node"),
        (["--id", "n1", "--data-dir", "/tmp/x", "--heartbeat-ms", "600"], "twice"),
    ],
)
def test_bad_settings_name_the_problem(argv, message):
    with pytest.raises(BadRequest, match=message):
        serve_config(build_parser().parse_args(["serve", *argv]))


def test_unknown_toml_key_is_an_error(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text("heartbeat = 1\n")
    with pytest.raises(BadRequest, match="line 1 \\(heartbeat = 1\\): unknown setting"):
        serve_config(build_parser().parse_args(["serve", "--id", "n1", "--data-dir", "x", "--config", str(toml)]))


def test_help_and_errors_from_the_real_command():
    kv = [sys.executable, "-m", "kv"]
    for sub in ([], ["serve"], ["cluster", "up"], ["snapshot", "restore"], ["put"], ["status"]):
        r = subprocess.run(kv + sub + ["--help"], capture_output=True, text=True)
        assert r.returncode == 0 and "usage: kv" in r.stdout
    r = subprocess.run(kv + ["serve", "--data-dir", "/tmp/nowhere"], capture_output=True, text=True)
    assert r.returncode == 1 and "needs --id" in r.stderr
    r = subprocess.run(kv + ["get", "k", "--endpoints", "http://127.0.0.1:9", "--timeout", "0.5"], capture_output=True, text=True)
    assert r.returncode == 1 and "no endpoint answered" in r.stderr
    # a write whose session could not be opened was never sent (it said only "...: TimeoutError")
    r = subprocess.run(kv + ["put", "k", "v", "--endpoints", "http://127.0.0.1:9", "--timeout", "0.5"], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith("kv put: the write was not sent: opening its session failed: no endpoint answered"), r.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        # No abbreviations: a script that says --endpoint would break when an option
        # sharing the prefix is added, and --endpoint is what people type for --endpoints.
        (["get", "k", "--endpoint", "http://127.0.0.1:9"], "(did you mean --endpoints?)"),
        (["put", "--if-mach", "3", "k", "v"], "(did you mean --if-match?)"),
        (["--endpoints=http://127.0.0.1:9", "get", "k"], "kv: --endpoints goes after the command, as in kv"),
        (["--endpoints", "http://127.0.0.1:9", "get", "k"], "kv: --endpoints goes after the command, as in kv"),
        (["get", "k", "--zzz"], "unrecognized arguments: --zzz; see kv get --help"),
        (["get", "k", "--t", "1"], "(did you mean --token or --timeout?)"),
        (["status", "--", "x"], "unrecognized arguments: -- x; see kv status --help"),  # no hint for what follows --
        (["watch", "x/", "--from", "0"], "argument --from: expected a whole number of at least 1, not '0'"),
        (["put", "--if-match", "-1", "k", "v"], "argument --if-match: expected a whole number of at least 0, not '-1'"),
        (["lock", "x", "--wait", "-1", "--", "true"], "argument --wait: -1 is not a positive number of seconds"),
    ],
)
def test_a_mistyped_option_is_refused_with_what_was_meant(argv, message):
    r = subprocess.run([sys.executable, "-m", "kv", *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r
    assert message in r.stderr and r.stderr.count("\n") == 1, r.stderr


def _free_urls():
    from kv.bench.harness import free_port

    return [f"http://127.0.0.1:{free_port()}" for _ in range(2)]


@pytest.mark.parametrize(
    "command, urls, says, asks",
    [
        (["get", "k"], _free_urls(), "kv get: nothing listens at ", "is the cluster running"),
        # A mistyped host name (.invalid never resolves: RFC 6761)
        (["get", "k"], ["http://ledgerkv-n1.invalid:8001"], "kv get: no node can answer at ", "the host name does not resolve); still trying"),
        (["watch", "jobs/"], _free_urls(), "kv watch: nothing listens at ", "is the cluster running"),  # a stream, not a request
    ],
    ids=["nothing-listens", "name-does-not-resolve", "watch"],
)
def test_a_cluster_that_cannot_be_reached_is_named_while_the_command_waits(command, urls, says, asks):
    """An operator's first mistake: nothing runs at the endpoints, or a URL is mistyped.
    The command says so on stderr while it still waits out its timeout, instead of after
    it, in silence."""
    import selectors

    proc = subprocess.Popen(
        [sys.executable, "-m", "kv", *command, "--endpoints", ",".join(urls), "--timeout", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stderr, selectors.EVENT_READ)
            assert sel.select(timeout=60), "nothing on stderr within 60 s"
        line = proc.stderr.readline()
        assert proc.poll() is None, "it gave up instead of waiting for its timeout"
        assert line.startswith(says) and all(u in line for u in urls), line
        assert asks in line and "120s timeout" in line, line
    finally:
        proc.kill()
        proc.communicate()


def test_scan_and_watch_lines_escape_what_would_break_them():
    """A value in a tab-separated listing stays on its line: bytes that are not UTF-8 and
    control characters (NUL, tab, newline) are escaped; other text is kept as it is."""
    from kv.cli.output import listing_text

    assert listing_text(b"\xff\xfe\x00\x80hi") == "\\xff\\xfe\\x00\\x80hi"
    assert listing_text(b"a\tb\nc\r") == "a\\tb\\nc\\r"
    assert listing_text("héllo wörld".encode()) == "héllo wörld"


def test_cluster_up_does_not_count_a_node_of_another_cluster_on_a_members_ports(capsys):
    """A node started by hand on n3's ports with another cluster's data dir (a newcomer's
    slip): kv cluster up said 'n3 answers again; 3/3 nodes answering'. It is not counted,
    and said once."""
    from kv.cli.cluster import _Ours

    ours = _Ours()
    assert sorted(ours.only({"n1": {"cluster_id": ""}, "n2": {"cluster_id": ""}})) == ["n1", "n2"]  # (no id chosen yet)
    seen = {"n1": {"cluster_id": "a1"}, "n2": {"cluster_id": "a1"}, "n3": {"cluster_id": "b2"}}
    for _ in range(2):
        assert sorted(ours.only(seen)) == ["n1", "n2"]
    said = capsys.readouterr().out
    assert said.count("n3's address answers as a node of another cluster (id b2, this one's a1): not counted") == 1
    # its own nodes down and strangers in their places: still this cluster's id, not the most common one
    assert sorted(ours.only({"n1": {"cluster_id": "b2"}, "n2": {"cluster_id": "b2"}, "n3": {"cluster_id": "a1"}})) == ["n3"]


def test_a_url_of_the_wrong_scheme_is_named_as_such(tmp_path):
    """http:// to a node serving TLS ended in "Server disconnected", https:// to one that
    does not in "[SSL: WRONG_VERSION_NUMBER]": neither said to change the scheme."""
    from kv.bench.harness import free_port
    from pki import make_pki

    files = make_pki(tmp_path, ["node"])
    secure, plain = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen([sys.executable, "-m", "kv", "serve", "--id", "n1", "--data-dir", str(tmp_path / name), "--http", http,
                               "--peers", f"n1=127.0.0.1:{free_port()}", *tls], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for name, http, tls in (("secure", secure, ["--tls-cert", files["node"][0], "--tls-key", files["node"][1]]), ("plain", plain, []))]
    try:
        ok = subprocess.run([sys.executable, "-m", "kv", "put", "k", "v", "--endpoints", f"https://{secure}", "--cacert", files["ca"], "--timeout", "30"],
                            capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0, ok.stderr  # (the TLS node is up)
        for url, says in ((f"https://{plain}", "no TLS at this address: a node started without --tls-cert serves http://, not https://"),
                          (f"http://{secure}", "if the node serves TLS (kv serve --tls-cert), its URL is https://")):
            r = subprocess.run([sys.executable, "-m", "kv", "get", "k", "--endpoints", url, "--timeout", "3"], capture_output=True, text=True, timeout=60)
            assert r.returncode == 1 and says in r.stderr.splitlines()[-1], r.stderr
    finally:
        for n in nodes:
            n.terminate()
        for n in nodes:
            n.wait(timeout=30)
