"""Token files, the new `kv serve` settings from flags, TOML and KV_* variables, and the
log guard that keeps what strangers can make a node log short and few."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from kv.bench.harness import free_port

from kv import BadRequest
from kv.cli import build_parser, serve_config
from kv.http.auth import Grant, grant_of, load_tokens
from kv.server.eventlog import RateLimit


def test_tokens_file_in_toml_and_json(tmp_path):
    toml = tmp_path / "tokens.toml"
    toml.write_text('"r1" = "read"\n"w1" = { role = "write", prefix = "app/" }\n"a1" = "admin"\n')
    assert load_tokens(str(toml)) == {"r1": Grant("read"), "w1": Grant("write", "app/"), "a1": Grant("admin")}
    js = tmp_path / "tokens.json"
    js.write_text('{"r1": "read", "w1": {"role": "write", "prefix": "app/"}}')
    grants = load_tokens(str(js))
    assert grants["w1"] == Grant("write", "app/")
    assert grant_of(grants, "Bearer w1") == Grant("write", "app/")
    assert grant_of(grants, "Bearer w") is None and grant_of(grants, "w1") is None and grant_of(grants, "Bearer ") is None


@pytest.mark.parametrize(
    "text, says",
    [
        ('"t" = "root"', "role must be one of"),
        ('"t" = { role = "read", prefix = 3 }', "prefix a string"),
        ('"t" = { role = "read", prefixes = "a/" }', "give a role .*'prefixes': not one of them"),
        ('"t" = 5', "give a role"),
        ("", "lists no tokens"),
        ("not [valid", "neither JSON nor TOML"),
        ('" t" = "read"', "spaces"),
    ],
)
def test_a_bad_tokens_file_is_one_clear_error(tmp_path, text, says):
    f = tmp_path / "tokens.toml"
    f.write_text(text)
    with pytest.raises(BadRequest, match=says):
        load_tokens(str(f))
    with pytest.raises(BadRequest, match="cannot read --tokens"):
        load_tokens(str(tmp_path / "missing.toml"))


def test_roles_order():
    assert Grant("admin").may("write") and Grant("write").may("read") and not Grant("read").may("write")
    assert not Grant("write").may("admin")


def test_new_serve_settings_read_from_flags_toml_and_environment(tmp_path, monkeypatch):
    cfg = tmp_path / "node.toml"
    cfg.write_text('peer_cert = "/toml/cert.pem"\nmax_http_connections = 77\ntokens = "/toml/tokens.toml"\n')
    monkeypatch.setenv("KV_PEER_KEY", "/env/key.pem")
    monkeypatch.setenv("KV_PEER_CA", "/env/ca.pem")
    monkeypatch.setenv("KV_HTTP_IDLE_TIMEOUT_S", "7.5")
    monkeypatch.setenv("KV_TLS_CERT", "/env/http.pem")
    args = build_parser().parse_args(["serve", "--id", "n1", "--data-dir", str(tmp_path), "--config", str(cfg), "--peer-ca", "/flag/ca.pem"])
    c = serve_config(args)
    assert (c.peer_cert, c.peer_key, c.peer_ca) == ("/toml/cert.pem", "/env/key.pem", "/flag/ca.pem")
    assert (c.max_http_connections, c.http_idle_timeout_s, c.tokens, c.tls_cert) == (77, 7.5, "/toml/tokens.toml", "/env/http.pem")


def test_kv_variables_no_setting_reads_are_named_with_the_likely_one(monkeypatch):
    from kv.cli.settings import unknown_env

    for name in [n for n in os.environ if n.startswith("KV_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("KV_HEARTBAET_MS", "50")  # a typo: it was read by nothing, and nothing said so
    monkeypatch.setenv("KV_SOMETHING_ELSE", "1")
    monkeypatch.setenv("KV_PEER_KEY", "/env/key.pem")  # a setting's
    monkeypatch.setenv("KV_ENDPOINTS", "http://x")  # the client commands'
    assert unknown_env() == ["KV_HEARTBAET_MS (did you mean KV_HEARTBEAT_MS?)", "KV_SOMETHING_ELSE"]


def _record(msg: str, *args, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, None) if exc else None
    return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, msg, args, exc_info)


class _BadRequest(Exception):
    code = 400


def test_log_guard_cuts_rate_limits_and_counts(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("kv.server.eventlog.time.monotonic", lambda: now[0])
    guard = RateLimit(per_second=2, burst=5, max_chars=200)
    passed = [r for r in (_record("Error handling request from %s", "x" * 100_000) for _ in range(100)) if guard.filter(r)]
    assert len(passed) == 5  # the burst, then nothing until the bucket refills
    assert all(len(r.getMessage()) < 300 for r in passed)
    now[0] += 1.0
    r = _record("Error handling request from %s", "127.0.0.1")
    assert guard.filter(r) and "95 more like this were not logged" in r.getMessage()
    # Another kind has its own budget.
    assert guard.filter(_record("something else"))


def test_log_guard_logs_a_clients_bad_request_as_one_warning_line():
    guard = RateLimit()
    r = _record("Error handling request from %s", "127.0.0.1", exc=_BadRequest("Invalid method " + "\x00" * 50_000))
    assert guard.filter(r)
    assert r.levelno == logging.WARNING and r.exc_info is None
    assert "_BadRequest: Invalid method" in r.getMessage() and len(r.getMessage()) < 500
    # A real error keeps its traceback the first time, then is one line.
    first = _record("Unhandled exception", exc=RuntimeError("bug"))
    assert guard.filter(first) and first.exc_info is not None and first.levelno == logging.ERROR
    again = _record("Unhandled exception", exc=RuntimeError("bug"))
    assert guard.filter(again) and again.exc_info is None and "RuntimeError: bug" in again.getMessage()


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--tokens", "/nonexistent/tokens.toml"], "cannot read --tokens /nonexistent/tokens.toml"),
        (["--peer-cert", "/nonexistent/cert.pem"], "peer TLS needs all three of --peer-cert, --peer-key and --peer-ca"),
        (["--peer-cert", "/nonexistent/c.pem", "--peer-key", "/nonexistent/k.pem", "--peer-ca", "/nonexistent/ca.pem"], "cannot load the peer certificate"),
        (["--tls-cert", "/nonexistent/c.pem"], "--tls-cert and --tls-key go together"),
    ],
)
def test_kv_serve_refuses_bad_security_files_with_one_line(tmp_path, flags, says):
    cmd = [sys.executable, "-m", "kv", "serve", "--id", "n1", "--data-dir", str(tmp_path / "d"), "--http", f"127.0.0.1:{free_port()}", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert says in out.stderr and "Traceback" not in out.stderr, out.stderr
