"""`kv status`, `kv leader transfer`, `kv member list|add|remove|promote`: the cluster's members."""

from __future__ import annotations

import argparse
import sys

from ..client import HINT
from .options import client_command, with_client
from .output import emit, report, wants_json


def add_parser(sub) -> None:
    client_command(sub, "status", "show every node's status", run)
    a = client_command(sub, "leader", "leadership", run)
    a.add_argument("action", choices=["transfer"])
    a.add_argument("to", help="id of the member that should lead")
    a = client_command(sub, "member", "membership: list, add (learner or voter), remove, promote", run)
    a.add_argument("action", choices=["list", "add", "remove", "promote"])
    a.add_argument("id", nargs="?", help="the member's id (add, remove, promote)")
    a.add_argument("peer", nargs="?", help="add: HOST:PORT the new member listens on for peers")
    a.add_argument("--http", default="", help="add: the new member's client URL")
    a.add_argument("--voter", action="store_true", help="add: as a voter at once (default: a learner, promoted later)")
    a.add_argument("--replace", action="store_true", help="add: change an existing member's addresses")


def run(args: argparse.Namespace) -> int:
    return with_client(args, {"status": _status, "leader": _leader, "member": _member}[args.cmd])


async def _status(c, args: argparse.Namespace) -> int:
    rows = await c.status_all()
    return _emit_status(rows) if wants_json(args) else _print_status(rows)


async def _leader(c, args: argparse.Namespace) -> int:
    r = await c.transfer_leader(args.to)
    report(args, {"leader": r["leader"]}, f"OK leader={r['leader']}")
    return 0


async def _member(c, args: argparse.Namespace) -> int:
    if args.action != "list" and not args.id:
        print(f"kv member {args.action}: give the member's id", file=sys.stderr)
        return 2
    if args.action == "add":
        if not args.peer:
            print("kv member add: give the HOST:PORT the new member listens on for peers", file=sys.stderr)
            return 2
        members = await c.add_member(args.id, args.peer, args.http, voter=args.voter, replace=args.replace)
    elif args.action == "remove":
        members = await c.remove_member(args.id)
    elif args.action == "promote":
        members = await c.promote_member(args.id)
    else:
        members = await c.members()
    if wants_json(args):
        emit({"members": members})
        return 0
    for m in members:
        role = "voter" if m["voter"] else "learner (promoted once caught up)" if m.get("promote") else "learner"
        print(f"{m['id']}\t{role}{' (leader)' if m.get('leader') else ''}\tpeer={m['peer']}\thttp={m.get('http') or '-'}")
    return 0


def _emit_status(rows: list) -> int:
    nodes = [
        {"endpoint": ep, "reachable": False, "error": str(st)} if isinstance(st, Exception) else {"endpoint": ep, "reachable": True, **st}
        for ep, st in rows
    ]
    emit({"nodes": nodes})
    return 1 if not any(n["reachable"] for n in nodes) else 0


def _print_status(rows: list) -> int:
    cols = ("id", "role", "term", "leader", "commit_index", "applied_index", "ledger_begin_index", "ledger_end_index", "snapshot_index")
    heads = ("ID", "ROLE", "TERM", "LEADER", "COMMIT", "APPLIED", "LEDGER_BEGIN", "LEDGER_END", "SNAPSHOT", "ENDPOINT")
    table = [heads]
    down = 0
    for ep, st in rows:
        if isinstance(st, Exception):
            down += 1
            table.append(("?", "unreachable", "", "", "", "", "", "", "", ep))
        else:
            table.append(tuple(str(st.get(k) if st.get(k) is not None else "-") for k in cols) + (ep,))
    widths = [max(len(r[i]) for r in table) for i in range(len(heads))]
    for r in table:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    for ep, st in rows:  # why, on stderr under the table (too long for a column)
        if isinstance(st, Exception):
            why = str(st) if str(st).startswith(ep) else f"{ep}: {st}"
            if down < len(rows):  # others answered: "is the cluster running?" is beside the point
                why = why.split(HINT, 1)[0]
            print(why, file=sys.stderr)
    return 1 if down == len(rows) else 0  # the same rule as _emit_status
