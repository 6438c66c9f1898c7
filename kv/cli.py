"""The `kv` command line (also `python -m kv`)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tomllib

from . import errors
from .config import NodeConfig, parse_peers

# (flag, NodeConfig field, type, help) for `kv serve`; each also reads from the TOML file
# given with --config (key: the field name) and from KV_<FIELD> in the environment.
SERVE_OPTIONS = [
    ("--id", "id", str, "this node's id, e.g. n1 (must appear in --peers)"),
    ("--data-dir", "data_dir", str, "directory for the ledger, state and snapshots"),
    ("--http", "http", str, "HOST:PORT for the client API, e.g. 127.0.0.1:8001"),
    ("--peers", "peers", str, "ID=HOST:PORT of every member, comma-separated; this node listens on its own"),
    ("--group", "group", str, "cluster name; nodes of other groups are refused (default: default)"),
    ("--heartbeat-ms", "heartbeat_ms", float, "leader heartbeat interval (default 100)"),
    ("--election-timeout-ms", "election_timeout_ms", float, "follower election timeout (default 1000)"),
    ("--snapshot-threshold", "snapshot_threshold", int, "take a snapshot every this many applied entries (default 100000)"),
    ("--snapshot-trailing", "snapshot_trailing", int, "entries kept in the ledger behind a snapshot (default 5000)"),
    ("--snapshot-keep", "snapshot_keep", int, "snapshot files kept (default 3)"),
    ("--max-value-bytes", "max_value_bytes", int, "largest value accepted (default 1048576)"),
    ("--token", "token", str, "require Authorization: Bearer TOKEN on client routes"),
    ("--cluster-secret", "cluster_secret", str, "shared secret authenticating peer connections"),
    ("--join", "join", str, "URL of a cluster member: ask the cluster to add this new node"),
    ("--join-timeout", "join_timeout_s", float, "seconds --join waits through temporary refusals (default 60)"),
    ("--advertise-http", "advertise_http", str, "client URL other nodes and clients use for this node"),
    ("--write-timeout-s", "write_timeout_s", float, "how long a write may wait to commit before 504 (default 5)"),
    ("--watch-buffer-bytes", "watch_buffer_bytes", int, "changes a watch stream may fall behind before it is ended (default 4 MiB)"),
    ("--watch-progress-ms", "watch_progress_ms", float, "how often an idle watch stream sends a progress line (default 5000)"),
]

ENDPOINTS_HELP = "comma-separated client URLs (default: $KV_ENDPOINTS or the local `kv cluster up` nodes)"


def _env_value(field: str):
    return os.environ.get("KV_" + field.upper())


def serve_config(args: argparse.Namespace) -> NodeConfig:
    """Flags, then the TOML file, then KV_* variables, then defaults."""
    values: dict = {}
    for _flag, field, typ, _help in SERVE_OPTIONS:
        raw = _env_value(field)
        if raw is not None:
            values[field] = typ(raw)
    if args.config:
        try:
            with open(args.config, "rb") as f:
                doc = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise errors.BadRequest(f"cannot read --config {args.config}: {e}") from e
        known = {f for _, f, _, _ in SERVE_OPTIONS}
        for k, v in doc.items():
            field = k.replace("-", "_")
            if field not in known:
                raise errors.BadRequest(f"unknown setting {k!r} in {args.config}; known: {', '.join(sorted(known))}")
            values[field] = v
    for _flag, field, _typ, _help in SERVE_OPTIONS:
        v = getattr(args, field)
        if v is not None:
            values[field] = v
    missing = [f for f in ("id", "data_dir") if not values.get(f)]
    if missing:
        raise errors.BadRequest(f"kv serve needs {' and '.join('--' + m.replace('_', '-') for m in missing)}")
    if "peers" in values:
        values["peers"] = parse_peers(values["peers"])
    return NodeConfig(**values)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kv", description="ledgerkv: a key-value store on a Raft replicated log.")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    s = sub.add_parser("serve", help="run a node", description="Run a node: peer transport, ledger, state machine, HTTP API.")
    for flag, field, typ, help_ in SERVE_OPTIONS:
        s.add_argument(flag, dest=field, type=typ, default=None, help=help_)
    s.add_argument("--config", help="TOML file with the settings above (keys: field names, e.g. heartbeat_ms)")
    s.add_argument("--tls-cert", help="serve the client API over HTTPS with this certificate (PEM)")
    s.add_argument("--tls-key", help="the certificate's private key (PEM)")
    s.add_argument("--log-level", default=os.environ.get("KV_LOG_LEVEL", "INFO"), help="DEBUG, INFO, WARNING (default INFO)")

    c = sub.add_parser("cluster", help="local clusters").add_subparsers(dest="cluster_cmd", metavar="ACTION")
    up = c.add_parser("up", help="run a local cluster in the foreground; Ctrl-C stops it")
    up.add_argument("--nodes", type=int, default=3, help="how many nodes (default 3)")
    up.add_argument("--data-dir", default="./kvdata", help="where the nodes keep their data (default ./kvdata)")
    up.add_argument("--base-port", type=int, default=8001, help="HTTP port of n1; peers listen 100 higher (default 8001)")
    up.add_argument("--heartbeat-ms", type=float, default=None)
    up.add_argument("--election-timeout-ms", type=float, default=None)

    def client_cmd(name: str, help_: str) -> argparse.ArgumentParser:
        a = sub.add_parser(name, help=help_, description=help_)
        a.add_argument("--endpoints", default=os.environ.get("KV_ENDPOINTS"), help=ENDPOINTS_HELP)
        a.add_argument("--token", default=os.environ.get("KV_TOKEN"), help="bearer token of the cluster, if it has one")
        a.add_argument("--timeout", type=float, default=10.0, help="seconds before giving up (default 10)")
        return a

    a = client_cmd("put", "write a value")
    a.add_argument("key")
    a.add_argument("value", help="the value; '-' reads it from standard input")
    a.add_argument("--if-match", type=int, help="write only if the key's mod_index is this (0: absent)")
    a.add_argument("--lease", type=int, help="attach the key to this lease (kv lease grant)")
    a = client_cmd("get", "read a value (linearizable unless --stale)")
    a.add_argument("key")
    a.add_argument("--stale", action="store_true", help="read the node's local state without a quorum check")
    a = client_cmd("del", "delete a key")
    a.add_argument("key")
    a = client_cmd("scan", "list keys under a prefix")
    a.add_argument("prefix", nargs="?", default="")
    a.add_argument("--limit", type=int, default=None)
    a = client_cmd("watch", "print every change under a prefix as it commits (Ctrl-C stops)")
    a.add_argument("prefix", nargs="?", default="")
    a.add_argument("--from", dest="from_index", type=int, default=None, help="start at this log index (default: the next commit)")
    a.add_argument("-o", "--output", choices=["text", "json"], default="text", help="text: INDEX TYPE KEY VALUE; json: one object a line")
    client_cmd("status", "show every node's status")
    a = client_cmd("leader", "leadership")
    a.add_argument("action", choices=["transfer"])
    a.add_argument("to", help="id of the member that should lead")
    a = client_cmd("member", "membership: list, add (learner or voter), remove, promote")
    a.add_argument("action", choices=["list", "add", "remove", "promote"])
    a.add_argument("id", nargs="?", help="the member's id (add, remove, promote)")
    a.add_argument("peer", nargs="?", help="add: HOST:PORT the new member listens on for peers")
    a.add_argument("--http", default="", help="add: the new member's client URL")
    a.add_argument("--voter", action="store_true", help="add: as a voter at once (default: a learner, promoted later)")
    a.add_argument("--replace", action="store_true", help="add: change an existing member's addresses")

    snap = sub.add_parser("snapshot", help="snapshot files").add_subparsers(dest="snap_cmd", metavar="ACTION")
    sv = snap.add_parser("save", help="download the newest snapshot of a node")
    sv.add_argument("file")
    sv.add_argument("--endpoints", default=os.environ.get("KV_ENDPOINTS"), help=ENDPOINTS_HELP)
    sv.add_argument("--token", default=os.environ.get("KV_TOKEN"))
    sv.add_argument("--fresh", action="store_true", help="ask the node to take a snapshot first")
    ins = snap.add_parser("inspect", help="print a snapshot file's header, key count and checksum status")
    ins.add_argument("file")
    rs = snap.add_parser("restore", help="seed a node of a new cluster from a snapshot file")
    rs.add_argument("file")
    rs.add_argument("--data-dir", required=True)
    rs.add_argument("--id", required=True)
    rs.add_argument("--peers", required=True, help="the new cluster's members: ID=HOST:PORT,...")
    rs.add_argument("--group", default="default")

    from . import bench, coordination_cli, spark_cli

    bench.add_parser(sub)
    spark_cli.add_parser(sub)
    coordination_cli.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd is None:
        parser.print_help()
        return 2
    from .raft.errors import LedgerError
    from .snapshot.format import SnapshotFormatError
    from .statemachine.leveldb import StateCorrupt

    try:
        return _dispatch(parser, args)
    except (errors.KVError, LedgerError, StateCorrupt, SnapshotFormatError) as e:
        print(f"kv {args.cmd}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .serve import install_uvloop, run, setup_logging

    if args.cmd == "serve":
        config = serve_config(args)
        setup_logging(config.id, args.log_level)
        install_uvloop()
        return asyncio.run(run(config, tls_cert=args.tls_cert, tls_key=args.tls_key))
    if args.cmd == "cluster":
        if args.cluster_cmd != "up":
            parser.parse_args(["cluster", "--help"])
        from .cluster import up

        extra = []
        if args.heartbeat_ms:
            extra += ["--heartbeat-ms", str(args.heartbeat_ms)]
        if args.election_timeout_ms:
            extra += ["--election-timeout-ms", str(args.election_timeout_ms)]
        return asyncio.run(up(args.nodes, args.data_dir, args.base_port, extra))
    if args.cmd == "spark":
        from . import spark_cli

        return spark_cli.run(args)
    if args.cmd == "bench":
        from . import bench

        return bench.run(args)
    if args.cmd in ("lease", "lock", "elect"):
        from . import coordination_cli

        return coordination_cli.run(args)
    if args.cmd == "snapshot":
        from . import snapshot_cli

        return snapshot_cli.run(args, parser)
    from . import client_cli

    return client_cli.run(args)
