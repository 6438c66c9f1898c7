"""`kv status`, `kv leader transfer`, `kv member list|add|remove|promote`: the cluster's members."""

from __future__ import annotations

import argparse
import asyncio
import sys

from .. import errors
from ..raft.membership import id_order
from ..client.endpoints import HINT
from ..common.text import columns
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
    a.add_argument("--voter", action="store_true", help="add: promote it to a voter once it has caught up (it always joins as a learner; without --voter it stays one until kv member promote)")
    a.add_argument("--replace", action="store_true", help="add: change an existing member's addresses")
    a.add_argument("--stale", action="store_true", help="list: the answering node's own view, without a quorum check (answers without a leader)")


def run(args: argparse.Namespace) -> int:
    return with_client(args, {"status": _status, "leader": _leader, "member": _member}[args.cmd])


async def _status(c, args: argparse.Namespace) -> int:
    rows = await _every_member(c, await c.status_all())
    return _emit_status(rows) if wants_json(args) else _print_status(rows)


async def _every_member(c, rows: list) -> list:
    """The endpoints given, then every other member the cluster knows (a dead one shows as
    unreachable), learners shown as such: a node missing from --endpoints was invisible."""
    asked = {ep.rstrip("/") for ep, _ in rows}
    views = [st for _, st in rows if isinstance(st, dict)]
    learners = {pid for st in views for pid, p in st.get("peers", {}).items() if not p.get("voter", True)}
    known = {}  # member id -> its client URL, from the members' own views of each other
    for st in views:
        for pid, p in st.get("peers", {}).items():
            if p.get("http"):
                known.setdefault(pid, p["http"].rstrip("/"))
    seen = {st["id"] for st in views}
    extra = [(pid, url) for pid, url in sorted(known.items(), key=lambda m: id_order(m[0])) if pid not in seen and url not in asked]

    async def one(pid: str, url: str):
        try:
            return url, await c.status(url)
        except Exception as e:  # a member that is down is part of the answer
            return url, e

    rows = list(rows) + list(await asyncio.gather(*(one(pid, url) for pid, url in extra)))
    return [(ep, {**st, "role": "learner"} if isinstance(st, dict) and st.get("id") in learners and st.get("role") == "follower" else st) for ep, st in rows]


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
        members = await c.members(consistency="stale" if args.stale else "linearizable")
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
    return 1 if not any(n["reachable"] for n in nodes) or _mixed(rows) else 0


def _mixed(rows: list) -> bool:
    """Whether the nodes answering belong to more than one cluster (a slip in the
    endpoints); says so on stderr."""
    ids: dict[str, list[str]] = {}
    for ep, st in rows:
        if isinstance(st, dict) and st.get("cluster_id"):
            ids.setdefault(st["cluster_id"], []).append(ep)
    if len(ids) < 2:
        return False
    which = "; ".join(f"cluster {cid}: {', '.join(eps)}" for cid, eps in ids.items())
    print(f"these endpoints belong to {len(ids)} clusters ({which}): check --endpoints / $KV_ENDPOINTS", file=sys.stderr)
    return True


def _print_status(rows: list) -> int:
    cols = ("id", "role", "term", "leader", "commit_index", "applied_index", "ledger_begin_index", "ledger_end_index", "snapshot_index", "compact_revision")
    heads = ("ID", "ROLE", "TERM", "LEADER", "COMMIT", "APPLIED", "LEDGER_BEGIN", "LEDGER_END", "SNAPSHOT", "COMPACT", "ENDPOINT")
    table = [heads]
    down = 0
    for ep, st in rows:
        if isinstance(st, Exception):
            down += 1
            refused = isinstance(st, (errors.Unauthorized, errors.Forbidden))  # it answered: not with its status
            table.append(("?", "refused" if refused else "unreachable", "", "", "", "", "", "", "", "", ep))
        else:
            table.append(tuple(str(st.get(k) if st.get(k) is not None else "-") for k in cols) + (ep,))
    print("\n".join(columns(table)))
    for ep, st in rows:  # why, on stderr under the table (too long for a column)
        if isinstance(st, Exception):
            why = str(st) if str(st).startswith(ep) else f"{ep}: {st}"
            if down < len(rows):  # others answered: "is the cluster running?" is beside the point
                why = why.split(HINT, 1)[0]
            print(why, file=sys.stderr)
    mixed = _mixed(rows)
    return 1 if down == len(rows) or mixed else 0  # the same rule as _emit_status
