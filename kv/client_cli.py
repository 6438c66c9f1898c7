"""`kv put|get|del|scan|watch|status|leader|member`: client commands over HTTP."""

from __future__ import annotations

import argparse
import asyncio
import base64
import sys

import orjson

from .client import AsyncClient
from .errors import BadRequest, NotFound
from .output import emit, report, value_fields, wants_json


def _out(data: bytes) -> None:
    sys.stdout.buffer.write(data)
    if sys.stdout.isatty() and not data.endswith(b"\n"):
        sys.stdout.buffer.write(b"\n")
    sys.stdout.flush()


def _item(it) -> dict:
    return {"key": it.key, **value_fields(it.value), "mod_index": it.mod_index}


async def _run(args: argparse.Namespace) -> int:
    js = wants_json(args)
    async with AsyncClient(args.endpoints, token=args.token, timeout=args.timeout, cacert=args.cacert) as c:
        cmd = args.cmd
        if cmd == "put":
            value = sys.stdin.buffer.read() if args.value == "-" else args.value.encode()
            r = await c.put(args.key, value, if_mod_index=args.if_match, lease=args.lease)
            report(args, {"key": args.key, "index": r.index, "term": r.term}, f"OK index={r.index} term={r.term}")
        elif cmd == "get":
            item = await c.get(args.key, consistency="stale" if args.stale else "linearizable")
            if item is None:
                raise NotFound(f"key {args.key!r} does not exist")
            if js:
                emit(_item(item))
            else:
                _out(item.value)
        elif cmd == "del":
            r = await c.delete(args.key)
            text = f"OK index={r.index} deleted={'yes' if r.deleted else 'no (it did not exist)'}"
            report(args, {"key": args.key, "index": r.index, "term": r.term, "deleted": r.deleted}, text)
        elif cmd == "scan":
            async for it in c.scan(args.prefix, limit=args.limit):
                report(args, _item(it), f"{it.key}\t{it.value.decode(errors='backslashreplace')}\t{it.mod_index}")
        elif cmd == "watch":
            await _watch(c, args)
        elif cmd == "status":
            rows = await c.status_all()
            return _emit_status(rows) if js else _print_status(rows)
        elif cmd == "leader":
            r = await c.transfer_leader(args.to)
            report(args, {"leader": r["leader"]}, f"OK leader={r['leader']}")
        elif cmd == "member":
            return await _member(c, args)
    return 0


async def _member(c: AsyncClient, args: argparse.Namespace) -> int:
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


async def _watch(c: AsyncClient, args: argparse.Namespace) -> None:
    if args.from_index is not None and args.from_index < 1:
        raise BadRequest("--from is a log index: 1 or more")
    out = sys.stdout.buffer
    async for ev in c.watch(args.prefix, args.from_index):
        if args.output == "json":
            d = {"type": ev.type, "key": ev.key, "mod_index": ev.mod_index, "index": ev.index}
            if ev.value is not None:
                try:
                    d["value"] = ev.value.decode()
                except UnicodeDecodeError:
                    d["value"], d["encoding"] = base64.b64encode(ev.value).decode(), "base64"
            out.write(orjson.dumps(d, option=orjson.OPT_APPEND_NEWLINE))
        else:
            value = "" if ev.value is None else ev.value.decode(errors="backslashreplace")
            out.write(f"{ev.index}\t{ev.type}\t{ev.key}\t{value}\n".encode())
        out.flush()


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
    return 1 if down == len(rows) else 0  # the same rule as _emit_status


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))
