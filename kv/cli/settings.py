"""`kv serve`'s settings: from flags, a TOML file (`--config`) and `KV_*` variables.

Precedence: flags, then the file, then the environment, then the defaults. Every value is
checked here, before anything starts, and a bad one is refused with its source named: the
flag, the file and line, or the variable (`KV_HEARTBEAT_MS=abc: ...`).
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..server.compactor import parse_retention
from ..server.config import NodeConfig, check_hostport, hostport_wanted, parse_peers
from ..errors import BadRequest

_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")


def _number(what: str, minimum: float, exclusive: bool = True) -> Callable[[Any], float]:
    def parse(v: Any) -> float:
        if isinstance(v, str):
            try:
                v = float(v)
            except ValueError:
                raise ValueError(f"expected a number of {what}") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"expected a number of {what}")
        if v < minimum or (exclusive and v == minimum):
            raise ValueError(f"expected a number of {what} {'above' if exclusive else 'of at least'} {minimum:g}")
        return float(v)

    return parse


def _integer(minimum: int) -> Callable[[Any], int]:
    def parse(v: Any) -> int:
        if isinstance(v, str):
            try:
                v = int(v)
            except ValueError:
                raise ValueError("expected a whole number") from None
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError("expected a whole number")
        if v < minimum:
            raise ValueError(f"expected a whole number of at least {minimum}")
        return v

    return parse


def _text(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError("expected a non-empty string")
    return v


def _hostport(v: Any) -> str:
    try:
        check_hostport(_text(v), "")
    except BadRequest:
        raise ValueError(f"expected {hostport_wanted(v, '127.0.0.1:8001')}") from None
    return v


def _retention(v: Any) -> str:
    try:
        parse_retention(str(v))
    except BadRequest:
        raise ValueError("expected a number of revisions (100000), a time with its unit (30m, 1h, 90s), or 0") from None
    return str(v)


def _url(v: Any) -> str:
    if not re.match(r"^https?://[^/\s]+", _text(v)):
        raise ValueError("expected a URL such as http://10.0.0.1:8001")
    return v


def _peers(v: Any) -> dict[str, str]:
    if not isinstance(v, (str, dict)):
        raise ValueError("expected ID=HOST:PORT,... (or a TOML table id = \"HOST:PORT\")")
    return parse_peers(v)


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in _TRUE | _FALSE:
        return v.lower() in _TRUE
    raise ValueError("expected true or false (1/0, yes/no)")


def _choice(choices: tuple[str, ...], fold: Callable[[str], str]) -> Callable[[Any], str]:
    def parse(v: Any) -> str:
        if isinstance(v, str) and fold(v) in choices:
            return fold(v)
        raise ValueError(f"expected one of {', '.join(choices)}")

    return parse


@dataclass(frozen=True)
class Option:
    flag: str
    field: str
    parse: Callable[[Any], Any]
    help: str
    node: bool = True  # a NodeConfig field; else a setting of the `kv serve` process only

    @property
    def env(self) -> str:
        return "KV_" + self.field.upper()


SERVE_OPTIONS = [
    Option("--id", "id", _text, "this node's id, e.g. n1 (must appear in --peers)"),
    Option("--data-dir", "data_dir", _text, "directory for the ledger, state and snapshots"),
    Option("--http", "http", _hostport, "HOST:PORT for the client API, e.g. 127.0.0.1:8001"),
    Option("--grpc", "grpc", _hostport, "HOST:PORT for etcd's v3 API over gRPC (etcdctl, python-etcd3, the Go client), e.g. 127.0.0.1:2379"),
    Option("--peers", "peers", _peers, "ID=HOST:PORT of every member, comma-separated; this node listens on its own"),
    Option("--group", "group", _text, "cluster name; nodes of other groups are refused (default: default)"),
    Option("--heartbeat-ms", "heartbeat_ms", _number("milliseconds", 0), "leader heartbeat interval (default 100)"),
    Option("--election-timeout-ms", "election_timeout_ms", _number("milliseconds", 0), "follower election timeout (default 1000)"),
    Option("--append-hold-ms", "append_hold_ms", _number("milliseconds", 0, exclusive=False), "while an APPEND is in flight to a follower, hold the next partial one this long at most for its ack, to send more entries at once (default 5; 0: never hold)"),
    Option("--snapshot-threshold", "snapshot_threshold", _integer(1), "take a snapshot every this many applied entries (default 100000; one of 64 MiB or more, once the entries since add up to half its size too)"),
    Option("--snapshot-trailing", "snapshot_trailing", _integer(0), "entries kept in the ledger behind a snapshot (default 5000)"),
    Option("--snapshot-keep", "snapshot_keep", _integer(1), "snapshot files kept (default 3)"),
    Option("--max-value-bytes", "max_value_bytes", _integer(1), "largest value accepted (default 1048576)"),
    Option("--max-txn-ops", "max_txn_ops", _integer(1), "most compares, and operations per branch, in a transaction (default 128; the etcd API counts nested ones with their parent: that many compares and twice that many operations in all)"),
    Option("--max-request-bytes", "max_request_bytes", _integer(1), "largest encoded write request (default 1572864, or the largest value + 4160)"),
    Option("--max-txn-read-bytes", "max_txn_read_bytes", _integer(1), "most bytes a transaction's gets may return (default 4194304)"),
    Option("--token", "token", _text, "require Authorization: Bearer TOKEN on client routes (an admin token)"),
    Option("--tokens", "tokens", _text, "TOML or JSON file of tokens with roles: TOKEN = \"read\"|\"write\"|\"admin\" or {role, prefix}"),
    Option("--cluster-secret", "cluster_secret", _text, "shared secret authenticating peer connections"),
    Option("--peer-cert", "peer_cert", _text, "mutual TLS between peers: this node's certificate (PEM)"),
    Option("--peer-key", "peer_key", _text, "mutual TLS between peers: the certificate's private key (PEM)"),
    Option("--peer-ca", "peer_ca", _text, "mutual TLS between peers: the CA every member's certificate is signed by (PEM)"),
    Option("--tls-cert", "tls_cert", _text, "serve the client API over HTTPS with this certificate (PEM)"),
    Option("--tls-key", "tls_key", _text, "the certificate's private key (PEM)"),
    Option("--cacert", "cacert", _text, "CA (PEM) trusted for the other members' HTTPS: forwarding to the leader, --join"),
    Option("--http-idle-timeout-s", "http_idle_timeout_s", _number("seconds", 0), "close an idle client connection, or one that has not sent a request head, after this (default 30)"),
    Option("--max-http-connections", "max_http_connections", _integer(1), "open client connections at most; more get 503 and are closed (default 10000)"),
    Option("--http-unread-bytes", "http_unread_bytes", _integer(1), "bytes of answers the node keeps queued for clients that do not read them, in all; beyond it a large answer (a value over 64 KiB) gets 503 (default 256 MiB)"),
    Option("--http-aiohttp-only", "http_aiohttp_only", _bool, "serve every request through aiohttp, without the fast path for key reads, writes and transactions (slower; a fallback)"),
    Option("--join", "join", _url, "URL of a cluster member: ask the cluster to add this new node"),
    Option("--join-timeout", "join_timeout_s", _number("seconds", 0), "seconds --join waits through temporary refusals (default 60)"),
    Option("--advertise-http", "advertise_http", _url, "client URL other nodes and clients use for this node"),
    Option("--write-timeout-s", "write_timeout_s", _number("seconds", 0), "how long a write may wait to commit before 504 (default 5)"),
    Option("--read-timeout-s", "read_timeout_s", _number("seconds", 0), "how long a linearizable read may wait for the leader's confirmation before 503/504 (default 5)"),
    Option("--watch-buffer-bytes", "watch_buffer_bytes", _integer(1), "changes a watch stream may fall behind before it is ended (default 4 MiB)"),
    Option("--watch-budget-bytes", "watch_budget_bytes", _integer(1), "changes all of a node's watches may hold for their readers together; the one behind that wants more is ended (default 128 MiB)"),
    Option("--watch-progress-ms", "watch_progress_ms", _number("milliseconds", 0), "how often an idle watch stream sends a progress line (default 5000)"),
    Option("--min-free-bytes", "min_free_bytes", _integer(0), "free disk space kept in reserve: below it the node refuses writes (507 NO_SPACE, reads go on) until there is room again (default 128 MiB)"),
    Option("--session-ttl-s", "session_ttl_s", _number("seconds", 0), "a client session unused this long is closed; a write retried in it after that has an unknown outcome (default 600)"),
    Option("--auto-compaction-retention", "auto_compaction_retention", _retention, "the history kept for reads and watches at past revisions: a number of revisions, a time (30m, 1h) or 0 for all until a Compact (default 100000)"),
    Option("--max-sessions", "max_sessions", _integer(1), "client sessions open at once; opening one more closes the least recently used (default 50000)"),
    Option("--metrics-public", "metrics_public", _bool, "serve /metrics without the token (default: it needs the token)"),
    Option("--cors", "cors", _text, "origins (scheme://host[:port], comma-separated, or *) of the web pages whose scripts may call the client API from a browser; a request from any other page is refused, 403 (default: none; etcd's is *)"),
    Option("--log-level", "log_level", _choice(LOG_LEVELS, str.upper), "DEBUG, INFO, WARNING or ERROR (default INFO)", node=False),
    Option("--log-format", "log_format", _choice(LOG_FORMATS, str.lower), "text or json, one object per line (default text)", node=False),
    Option("--access-log", "access_log", _bool, "log one line per HTTP request (method, route, status, duration)", node=False),
]
BOOL_FIELDS = {o.field for o in SERVE_OPTIONS if o.parse is _bool}
_BY_FIELD = {o.field: o for o in SERVE_OPTIONS}


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    """The flags of `kv serve`: raw strings here, checked in serve_settings() with their source."""
    for o in SERVE_OPTIONS:
        if o.field in BOOL_FIELDS:
            parser.add_argument(o.flag, dest=o.field, action="store_const", const=True, default=None, help=o.help)
        else:
            parser.add_argument(o.flag, dest=o.field, default=None, help=o.help)
    parser.add_argument("--config", help="TOML file with the settings above (keys: field names, e.g. heartbeat_ms)")


def _toml_line(text: str, key: str) -> int | None:
    for n, line in enumerate(text.splitlines(), 1):
        if re.match(rf'^\s*["\']?{re.escape(key)}["\']?\s*=', line):
            return n
    return None


def _from_file(path: str) -> dict[str, tuple[Any, str]]:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise BadRequest(f"--config {path}: no such file") from None
    except OSError as e:
        raise BadRequest(f"--config {path}: cannot read it: {e.strerror}") from None
    try:
        text = raw.decode()
        doc = tomllib.loads(text)
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise BadRequest(f"--config {path}: not valid TOML: {e}") from None
    values = {}
    for key, v in doc.items():
        line = _toml_line(text, key)
        where = f"{path} line {line}" if line else path
        where += f" ({key} = {v!r})"
        field = key.replace("-", "_")
        if field not in _BY_FIELD:
            known = ", ".join(sorted(_BY_FIELD))
            raise BadRequest(f"{where}: unknown setting; known: {known}")
        values[field] = (v, where)
    return values


def _collect(args: argparse.Namespace) -> dict[str, tuple[Any, str]]:
    """field -> (raw value, where it came from), the highest-precedence source winning."""
    values: dict[str, tuple[Any, str]] = {}
    for o in SERVE_OPTIONS:
        raw = os.environ.get(o.env)
        if raw is not None:
            values[o.field] = (raw, f"{o.env}={raw!r}")
    if getattr(args, "config", None):
        values.update(_from_file(args.config))
    for o in SERVE_OPTIONS:
        v = getattr(args, o.field, None)
        if v is not None:
            values[o.field] = (v, o.flag if v is True else f"{o.flag} {v!r}")
    return values


@dataclass(frozen=True)
class ServeSettings:
    node: NodeConfig
    log_level: str = "INFO"
    log_format: str = "text"
    access_log: bool = False


# KV_ variables that are not kv serve's settings but are read elsewhere (the client
# commands, the tests): no warning for them.
_OTHER_ENV = frozenset({"KV_ENDPOINTS", "KV_CACERT", "KV_DEBUG", "KV_SOAK", "KV_FAILPOINTS"})


def unknown_env() -> list[str]:
    """KV_ variables of the environment that no setting reads (a typo: KV_HEARTBAET_MS),
    each with the setting it is most like, if any."""
    settings = sorted(o.env for o in SERVE_OPTIONS)
    out = []
    for name in sorted(n for n in os.environ if n.startswith("KV_") and n not in _OTHER_ENV and n not in settings):
        like = difflib.get_close_matches(name, settings, n=1, cutoff=0.85)
        out.append(f"{name} (did you mean {like[0]}?)" if like else name)
    return out


def serve_settings(args: argparse.Namespace) -> ServeSettings:
    """Every setting of `kv serve`, checked; BadRequest names the source of a bad one."""
    raw = _collect(args)
    parsed: dict[str, Any] = {}
    for field, (v, where) in raw.items():
        o = _BY_FIELD[field]
        try:
            parsed[field] = o.parse(v)
        except (ValueError, BadRequest) as e:
            raise BadRequest(f"{where}: {e}") from None
    missing = [f for f in ("id", "data_dir") if f not in parsed]
    if missing:
        raise BadRequest(f"a node needs {' and '.join(_BY_FIELD[m].flag for m in missing)} (a flag, the --config file or KV_{missing[0].upper()})")
    hb = parsed.get("heartbeat_ms", NodeConfig.heartbeat_ms)
    et = parsed.get("election_timeout_ms", NodeConfig.election_timeout_ms)
    hold = parsed.get("append_hold_ms", NodeConfig.append_hold_ms)

    def src(f: str) -> str:
        return raw[f][1] if f in raw else "the default"

    if et < 2 * hb:
        raise BadRequest(
            f"--election-timeout-ms ({et:g}, from {src('election_timeout_ms')}) must be at least twice "
            f"--heartbeat-ms ({hb:g}, from {src('heartbeat_ms')}): raise the timeout or lower the heartbeat"
        )
    if hold > hb:
        raise BadRequest(
            f"--append-hold-ms ({hold:g}, from {src('append_hold_ms')}) must be at most --heartbeat-ms "
            f"({hb:g}, from {src('heartbeat_ms')}): a write would wait longer than a heartbeat for a batch to fill"
        )
    extra = {k: parsed.pop(k) for k in [f for f in parsed if not _BY_FIELD[f].node]}
    # A one-off recovery step, so a flag only (never from the file or the environment).
    parsed["force_new_cluster"] = bool(getattr(args, "force_new_cluster", False))
    return ServeSettings(NodeConfig(**parsed), **extra)


def serve_config(args: argparse.Namespace) -> NodeConfig:
    return serve_settings(args).node
