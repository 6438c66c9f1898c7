"""Node configuration: one dataclass read by kv.Node, `kv serve` and the tests.

`kv serve` fills it from flags, a TOML file (`--config`) and `KV_*` environment variables,
in that precedence (see kv/cli/settings.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..common.addresses import split_hostport, url_of
from ..common.origins import parse_origins
from ..errors import BadRequest
from .datadir import LEDGER_NAME
from .compactor import DEFAULT_RETENTION, parse_retention
from .limits import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_TXN_OPS, DEFAULT_MAX_TXN_READ_BYTES, REQUEST_OVERHEAD
from .session_sweeper import DEFAULT_MAX_SESSIONS, DEFAULT_SESSION_TTL_S
from ..statemachine.commands import MAX_CONDS, MAX_SESSIONS

MIN_SESSION_TTL_S = 1.0


def parse_peers(spec: str | dict) -> dict[str, str]:
    """`n1=127.0.0.1:7001,n2=...` -> {"n1": "127.0.0.1:7001", ...}."""
    if isinstance(spec, dict):
        return {str(k): str(v) for k, v in spec.items()}
    peers: dict[str, str] = {}
    at: dict[tuple[str, int], str] = {}  # address -> the peer given it
    for item in filter(None, (p.strip() for p in spec.split(","))):
        nid, sep, addr = item.partition("=")
        if not sep or not nid or not addr:
            raise BadRequest(f"bad peer {item!r}: expected ID=HOST:PORT, e.g. n1=127.0.0.1:7001")
        where = check_hostport(addr, f"peer {nid}")
        if nid in peers:
            raise BadRequest(f"peer {nid!r} is listed twice in --peers")
        if where in at:  # (a node given its own address for another dials itself)
            raise BadRequest(f"peers {at[where]!r} and {nid!r} have the same address {addr}: each member listens on its own")
        peers[nid], at[where] = addr, nid
    return peers


def hostport_wanted(addr: str, example: str) -> str:
    """What a bad HOST:PORT is told to give instead: for a URL (etcd's flags take them,
    so its users write them), the same address without the scheme."""
    if "://" in addr:
        return f"HOST:PORT without the scheme, e.g. {addr.split('://', 1)[1].rstrip('/')}"
    return f"HOST:PORT, e.g. {example}"


def check_hostport(addr: str, what: str) -> tuple[str, int]:
    host, port = split_hostport(addr)
    if "://" in addr or ":" not in addr or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadRequest(f"bad address {addr!r} for {what}: expected {hostport_wanted(addr, '127.0.0.1:7001')}")
    return host or "127.0.0.1", int(port)


@dataclass
class NodeConfig:
    id: str
    data_dir: str
    peers: dict[str, str] = field(default_factory=dict)  # id -> HOST:PORT peers dial
    http: str | None = None  # HOST:PORT of the client API (None: no HTTP server)
    grpc: str | None = None  # HOST:PORT of etcd's v3 API over gRPC (v3api/; None: not served)
    group: str = "default"
    heartbeat_ms: float = 100.0
    election_timeout_ms: float = 1000.0
    append_hold_ms: float = 5.0  # Nagle's rule for APPENDs (raft.config.CoreConfig.append_hold_ms)
    snapshot_threshold: int = 100_000  # take a snapshot after this many applied entries
    snapshot_trailing: int = 5_000  # entries kept in the ledger behind a snapshot
    snapshot_keep: int = 3  # snapshot files kept
    max_value_bytes: int = 1 << 20
    max_txn_ops: int = DEFAULT_MAX_TXN_OPS  # compares, and ops per branch, of a transaction
    max_request_bytes: int | None = None  # an encoded command; None: 1.5 MiB, or enough for the largest value
    max_txn_read_bytes: int = DEFAULT_MAX_TXN_READ_BYTES  # what a transaction's gets may return
    force_new_cluster: bool = False  # start as the only member, keeping the data (lost majority)
    token: str | None = None
    tokens: str | None = None  # file of tokens with roles (see http/auth.py)
    metrics_public: bool = False  # serve /metrics without the token
    cluster_secret: str | None = None
    peer_cert: str | None = None  # mutual TLS between peers: this node's certificate,
    peer_key: str | None = None  # its key,
    peer_ca: str | None = None  # and the CA that signs every member's certificate
    tls_cert: str | None = None  # HTTPS for the client API
    tls_key: str | None = None
    cacert: str | None = None  # CA this node trusts for other members' HTTPS (forwarding, --join)
    http_idle_timeout_s: float = 30.0  # idle keep-alive, and the time to send a request head
    max_http_connections: int = 10_000
    http_unread_bytes: int = 256 << 20  # answers queued for clients that do not read them, in all; beyond: 503 to large ones
    http_aiohttp_only: bool = False  # no fast path (http/fastpath.py): every request through aiohttp
    join: str | None = None
    join_timeout_s: float = 60.0  # how long --join waits through temporary refusals
    advertise_http: str | None = None
    write_timeout_s: float = 5.0
    read_timeout_s: float = 5.0
    fsync: bool = True
    min_free_bytes: int = 128 << 20  # free disk space kept in reserve: below it the node takes no writes (NOSPACE)
    ledger_map_size: int = 32 << 30
    watch_buffer_bytes: int = 4 << 20  # changes a watcher may fall behind before it is cut off
    watch_budget_bytes: int = 128 << 20  # changes all watches of the node may hold together
    watch_progress_ms: float = 5000.0  # an idle watch stream says how far it has seen this often
    session_ttl_s: float = DEFAULT_SESSION_TTL_S  # a client session unused this long closes (kv/common/sessions.py and kv/server/writes.py)
    max_sessions: int = DEFAULT_MAX_SESSIONS  # open sessions at most; one more evicts the least recently used
    auto_compaction_retention: str = DEFAULT_RETENTION  # history kept: revisions ("100000"), a time ("1h"), or "0": all (compactor.py)
    cors: str = ""  # origins whose web pages may call the client API ("*": any); none by default (http/cors.py)

    def __post_init__(self) -> None:
        self.peers = parse_peers(self.peers)
        if not self.id:
            raise BadRequest("a node needs an id (--id)")
        if self.peers and self.id not in self.peers and not self.join:
            raise BadRequest(f"--peers must list this node ({self.id}) with the address it listens on for peers")
        if self.http:
            check_hostport(self.http, "--http")
        parse_origins(self.cors)
        if self.heartbeat_ms <= 0 or self.election_timeout_ms < 2 * self.heartbeat_ms:
            raise BadRequest("--election-timeout-ms must be at least twice --heartbeat-ms, and both positive")
        if self.join_timeout_s <= 0:
            raise BadRequest("--join-timeout must be positive (seconds)")
        if self.max_value_bytes <= 0:
            raise BadRequest("--max-value-bytes must be positive")
        if self.max_request_bytes is None:
            self.max_request_bytes = max(DEFAULT_MAX_REQUEST_BYTES, self.max_value_bytes + REQUEST_OVERHEAD)
        if self.max_request_bytes < self.max_value_bytes + REQUEST_OVERHEAD:
            raise BadRequest(
                f"--max-request-bytes must leave room for the largest value: at least --max-value-bytes + {REQUEST_OVERHEAD}"
            )
        if not 1 <= self.max_txn_ops <= MAX_CONDS:
            raise BadRequest(f"--max-txn-ops must be between 1 and {MAX_CONDS}")
        if self.force_new_cluster and self.join:
            raise BadRequest("--force-new-cluster restarts an existing member alone; it does not go with --join")
        if type(self.min_free_bytes) is not int or self.min_free_bytes < 0:
            raise BadRequest(f"--min-free-bytes must be 0 or more, not {self.min_free_bytes!r}")
        if self.max_txn_read_bytes <= 0:
            raise BadRequest("--max-txn-read-bytes must be positive")
        if self.snapshot_threshold <= 0 or self.snapshot_trailing < 0 or self.snapshot_keep < 1:
            raise BadRequest("snapshot settings: --snapshot-threshold > 0, trailing >= 0, keep >= 1")
        if self.http_unread_bytes <= 0:
            raise BadRequest("--http-unread-bytes must be positive")
        if self.http_idle_timeout_s <= 0 or self.max_http_connections < 1:
            raise BadRequest("--http-idle-timeout-s must be positive and --max-http-connections at least 1")
        parse_retention(self.auto_compaction_retention)
        if self.watch_buffer_bytes <= 0 or self.watch_progress_ms <= 0 or self.watch_budget_bytes <= 0:
            raise BadRequest("--watch-buffer-bytes, --watch-budget-bytes and --watch-progress-ms must be positive")
        if not self.session_ttl_s >= MIN_SESSION_TTL_S or self.session_ttl_s == float("inf"):
            raise BadRequest(
                f"--session-ttl-s must be at least {MIN_SESSION_TTL_S:g} s (a session must outlive every retry of its "
                f"writes), not {self.session_ttl_s!r}"
            )
        if type(self.max_sessions) is not int or not 1 <= self.max_sessions <= MAX_SESSIONS:
            raise BadRequest(f"--max-sessions must be an integer from 1 to {MAX_SESSIONS}, not {self.max_sessions!r}")

    @property
    def advertise_url(self) -> str:
        if self.advertise_http:
            return self.advertise_http.rstrip("/")
        if not self.http:
            return ""
        return self._url_of(self.http, "--http")

    @property
    def grpc_url(self) -> str:
        """The etcd API's URL, as etcd's MemberList and the status name it ("" when not served)."""
        return self._url_of(self.grpc, "--grpc") if self.grpc else ""

    def _url_of(self, hostport: str, what: str) -> str:
        host, port = check_hostport(hostport, what)
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return url_of("https" if self.tls_cert else "http", host, port)

    @property
    def ledger_path(self) -> str:
        return os.path.join(self.data_dir, LEDGER_NAME)

    @property
    def state_path(self) -> str:
        return os.path.join(self.data_dir, "state")

    @property
    def snapshot_path(self) -> str:
        return os.path.join(self.data_dir, "snapshots")
