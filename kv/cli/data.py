"""`kv put|get|del|scan|watch|compact`: reading and writing keys over HTTP."""

from __future__ import annotations

import argparse
import sys

import orjson

from ..common.wire import key_fields, value_fields
from ..errors import BadRequest, NotFound
from ..statemachine.commands import key_bytes, shown_key
from .options import at_least, client_command, with_client
from .output import emit, listing_text, report, wants_json


def add_parser(sub) -> None:
    a = client_command(sub, "put", "write a value", run)
    a.add_argument("key")
    a.add_argument("value", help="the value; '-' reads it from standard input")
    a.add_argument("--if-match", type=at_least(0), help="write only if the key's mod_index is this (0: absent)")
    a.add_argument("--lease", type=int, help="attach the key to this lease (kv lease grant)")
    a = client_command(sub, "get", "read a value (linearizable unless --stale)", run)
    a.add_argument("key")
    a.add_argument("--stale", action="store_true", help="read the node's local state without a quorum check")
    a.add_argument("--rev", type=at_least(1), default=None, help="the value as of this revision (log index), from the history")
    a = client_command(sub, "del", "delete a key, or every key under a prefix (--prefix)", run)
    a.add_argument("key")
    a.add_argument("--if-match", type=at_least(0), help="delete only if the key's mod_index is this")
    a.add_argument("--prefix", action="store_true", help="KEY is a prefix: delete every key that starts with it, in one committed entry")
    a = client_command(sub, "scan", "list keys under a prefix", run)
    a.add_argument("prefix", nargs="?", default="")
    a.add_argument("--limit", type=at_least(1), default=None, help="list at most this many keys (pages are fetched as needed)")
    a.add_argument("--rev", type=at_least(1), default=None, help="the keys as of this revision (log index), every page at that one cut")
    a.add_argument("--stale", action="store_true", help="read the node's local state without a quorum check (each page)")
    a = client_command(sub, "watch", "print every change under a prefix as it commits (Ctrl-C stops)", run)
    a.add_argument("prefix", nargs="?", default="")
    a.add_argument("--from", dest="from_index", type=at_least(1), default=None, help="start at this log index (default: the next commit)")
    a = client_command(sub, "compact", "drop the history below a revision on every node (reads below it are refused from then on)", run)
    a.add_argument("revision", type=at_least(1))


def run(args: argparse.Namespace) -> int:
    return with_client(args, _run)


def _out(data: bytes) -> None:
    sys.stdout.buffer.write(data)
    if sys.stdout.isatty() and not data.endswith(b"\n"):
        sys.stdout.buffer.write(b"\n")
    sys.stdout.flush()


def _item(it) -> dict:
    return {**key_fields(it.key), **value_fields(it.value), "mod_index": it.mod_index}


async def _run(c, args: argparse.Namespace) -> int:
    cmd = args.cmd
    if cmd == "put":
        value = sys.stdin.buffer.read() if args.value == "-" else args.value.encode()
        r = await c.put(args.key, value, if_mod_index=args.if_match, lease=args.lease)
        report(args, {**key_fields(args.key), "index": r.index, "term": r.term}, f"OK index={r.index} term={r.term}")
    elif cmd == "get":
        item = await c.get(args.key, consistency="stale" if args.stale else "linearizable", revision=args.rev)
        if item is None:
            raise NotFound(f"key {shown_key(args.key)} does not exist")
        if wants_json(args):
            emit(_item(item))
        else:
            _out(item.value)
    elif cmd == "del" and args.prefix:
        if args.if_match is not None:
            raise BadRequest("--if-match applies to one key, not to --prefix")
        r = await c.delete_prefix(args.key)
        report(args, {**key_fields(args.key, "prefix"), "index": r.index, "term": r.term, "deleted": r.deleted}, f"OK index={r.index} deleted={r.deleted} key(s) under {shown_key(args.key)}")
    elif cmd == "del":
        r = await c.delete(args.key, if_mod_index=args.if_match)
        text = f"OK index={r.index} deleted={'yes' if r.deleted else 'no (it did not exist)'}"
        report(args, {**key_fields(args.key), "index": r.index, "term": r.term, "deleted": r.deleted}, text)
    elif cmd == "scan":
        async for it in c.scan(args.prefix, limit=args.limit, revision=args.rev, consistency="stale" if args.stale else "linearizable"):
            report(args, _item(it), f"{listing_text(key_bytes(it.key))}\t{listing_text(it.value)}\t{it.mod_index}")
    elif cmd == "compact":
        done = await c.compact(args.revision)
        report(args, {"compact_revision": done}, f"OK compact_revision={done}")
    elif cmd == "watch":
        await _watch(c, args)
    return 0


async def _watch(c, args: argparse.Namespace) -> None:
    out = sys.stdout.buffer
    async for ev in c.watch(args.prefix, args.from_index):
        if args.output == "json":
            d = {"type": ev.type, **key_fields(ev.key), "mod_index": ev.mod_index, "index": ev.index}
            if ev.value is not None:
                d.update(value_fields(ev.value))
            out.write(orjson.dumps(d, option=orjson.OPT_APPEND_NEWLINE))
        else:
            value = "" if ev.value is None else listing_text(ev.value)
            out.write(f"{ev.index}\t{ev.type}\t{listing_text(key_bytes(ev.key))}\t{value}\n".encode())
        out.flush()
