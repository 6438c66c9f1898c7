"""The `kv` command line (also `python -m kv`)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from .output import add_output_option
from .refusal import debug_wanted, describe
from .settings import add_serve_options, serve_config, serve_settings

__all__ = ["build_parser", "main", "serve_config"]

ENDPOINTS_HELP = "comma-separated client URLs (default: $KV_ENDPOINTS or the local `kv cluster up` nodes)"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line that says where to look."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help\n")

    def parse_args(self, args=None, namespace=None):
        # argparse reports leftovers from the top parser ("kv: unrecognized arguments");
        # name the command they were given to instead.
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            prog = getattr(ns, "prog_name", self.prog)
            self.exit(2, f"{prog}: unrecognized arguments: {' '.join(extras)}; see {prog} --help\n")
        return ns


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from . import __version__

    try:
        v = version("ledgerkv")
    except PackageNotFoundError:
        v = __version__
    return f"kv (ledgerkv) {v}, Python {sys.version.split()[0]}"


def _at_least_one(raw: str) -> int:
    if not raw.isdigit() or int(raw) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, not {raw!r}")
    return int(raw)


def _base_port(raw: str) -> int:
    # n1..nN serve HTTP from here and peers from 100 higher: leave room below 65536.
    if not raw.isdigit() or not 1 <= int(raw) <= 65000:
        raise argparse.ArgumentTypeError(f"expected a port from 1 to 65000, not {raw!r}")
    return int(raw)


def _all_parsers(p: argparse.ArgumentParser):
    yield p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in {id(s): s for s in action.choices.values()}.values():
                yield from _all_parsers(sub)


def _add_common_options(root: argparse.ArgumentParser) -> None:
    """--debug on every command (also before it), and the command's name for its errors."""
    root.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors (or KV_DEBUG=1)")
    for p in _all_parsers(root):
        if p is not root:
            p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        p.set_defaults(prog_name=p.prog)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kv", description="ledgerkv: a key-value store on a Raft replicated log.")
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    s = sub.add_parser("serve", help="run a node", description="Run a node: peer transport, ledger, state machine, HTTP API.")
    add_serve_options(s)
    s.add_argument(
        "--force-new-cluster",
        action="store_true",
        help="the cluster lost its majority for good: start this member alone, as a one-member cluster with its "
        "data; then add the others back (use once, restart without it)",
    )

    c = sub.add_parser("cluster", help="local clusters").add_subparsers(dest="cluster_cmd", metavar="ACTION")
    up = c.add_parser("up", help="run a local cluster in the foreground; Ctrl-C stops it")
    up.add_argument("--nodes", type=_at_least_one, default=3, help="how many nodes (default 3)")
    up.add_argument("--data-dir", default="./kvdata", help="where the nodes keep their data (default ./kvdata)")
    up.add_argument("--base-port", type=_base_port, default=8001, help="HTTP port of n1; peers listen 100 higher (default 8001)")
    up.add_argument("--heartbeat-ms", type=float, default=None)
    up.add_argument("--election-timeout-ms", type=float, default=None)

    def client_cmd(name: str, help_: str) -> argparse.ArgumentParser:
        a = sub.add_parser(name, help=help_, description=help_)
        a.add_argument("--endpoints", default=os.environ.get("KV_ENDPOINTS"), help=ENDPOINTS_HELP)
        a.add_argument("--token", default=os.environ.get("KV_TOKEN"), help="bearer token of the cluster, if it has one")
        a.add_argument("--cacert", default=os.environ.get("KV_CACERT"), help="CA certificate (PEM) to verify https:// endpoints with")
        a.add_argument("--timeout", type=float, default=10.0, help="seconds before giving up (default 10)")
        add_output_option(a)
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
    sv.add_argument("--cacert", default=os.environ.get("KV_CACERT"), help="CA certificate (PEM) to verify https:// endpoints with")
    sv.add_argument("--fresh", action="store_true", help="ask the node to take a snapshot first")
    add_output_option(sv)
    ins = snap.add_parser("inspect", help="print a snapshot file's header, key count and checksum status")
    ins.add_argument("file")
    add_output_option(ins)
    rs = snap.add_parser("restore", help="seed a node of a new cluster from a snapshot file")
    rs.add_argument("file")
    rs.add_argument("--data-dir", required=True)
    rs.add_argument("--id", required=True)
    rs.add_argument("--peers", required=True, help="the new cluster's members: ID=HOST:PORT,...")
    rs.add_argument("--group", default="default")
    add_output_option(rs)

    from . import bench, coordination_cli, spark_cli

    bench.add_parser(sub)
    spark_cli.add_parser(sub)
    coordination_cli.add_parser(sub)
    _add_common_options(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command. Every refusal is one line on stderr and a non-zero exit status:
    commands raise, and this is the one place that turns what they raise into that line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd is None:
        parser.print_help()
        return 2
    try:
        return _dispatch(parser, args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if debug_wanted(args.debug):
            raise
        line, code = describe(e)
        print(f"{args.prog_name}: {line}", file=sys.stderr)
        return code


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .logs import setup_logging
    from .serve import install_uvloop, run

    if args.cmd == "serve":
        s = serve_settings(args)
        setup_logging(s.node.id, s.log_level, s.log_format)
        install_uvloop()
        return asyncio.run(run(s.node, access_log=s.access_log))
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
