"""`kv snapshot save|inspect|restore`."""

from __future__ import annotations

import argparse
import asyncio
import errno
import itertools
import os
import shutil
import sys
import time

from ..server.datadir import DataDirLock
from ..errors import SnapshotError
from ..snapshot.format import SnapshotFormatError, iter_records, read_header, verify
from ..statemachine.lease_table import RESERVED
from ..common.text import Progress, columns
from .options import client_options
from .output import add_output_option, emit, report, wants_json


def add_parser(sub) -> None:
    p = sub.add_parser("snapshot", help="snapshot files")
    p.set_defaults(run=run, usage=p)
    snap = p.add_subparsers(dest="snap_cmd", metavar="ACTION")
    sv = snap.add_parser(
        "save", help="back up the cluster: a snapshot holding every write acknowledged before the command started",
        description="A node takes a snapshot now, once it has applied everything the cluster had committed when asked, "
        "and the file is downloaded from that node (like etcdctl snapshot save).",
    )
    sv.add_argument("file")
    client_options(sv, timeout_help=None, token_help="an admin token of the cluster, if it has tokens (snapshots are the admin's)")
    sv.add_argument("--newest", action="store_true", help="download the node's newest existing snapshot instead (it may be old: it says how old)")
    sv.add_argument("--fresh", action="store_true", help=argparse.SUPPRESS)  # what is done by default now
    add_output_option(sv)
    ins = snap.add_parser("inspect", help="check a snapshot file and say what it holds: its index, when and where it was taken, its keys and members")
    ins.add_argument("file")
    add_output_option(ins)
    rs = snap.add_parser("restore", help="seed a node of a new cluster from a snapshot file")
    rs.add_argument("file")
    rs.add_argument("--data-dir", required=True, help="the new node's data dir (empty or absent); then kv serve it with the same --id and --peers")
    rs.add_argument("--id", required=True, help="the new node's member id, one of --peers")
    rs.add_argument("--peers", required=True, help="the new cluster's members: ID=HOST:PORT,...")
    rs.add_argument("--group", default="default", help="the new cluster's Raft group name (default: default), as kv serve --group")
    add_output_option(rs)


async def _save(args: argparse.Namespace) -> int:
    from ..client.async_client import AsyncClient
    from ..errors import KVError, NotFound

    async with AsyncClient(args.endpoints, token=args.token, cacert=args.cacert) as c:
        first = c.rotation.pick()
        order = c.endpoints[c.endpoints.index(first):] + c.endpoints[: c.endpoints.index(first)]
        for n, ep in enumerate(order):  # taken and downloaded on one node, the next if it fails
            try:
                if not args.newest and sys.stderr.isatty():  # (a large state takes seconds, more under load)
                    print(f"taking a snapshot on {ep} ...", file=sys.stderr, flush=True)
                taken = None if args.newest else await c.take_snapshot(endpoint=ep)
                bar = Progress("downloading")
                info = await c.download_snapshot(args.file, endpoint=ep, progress=bar)
                bar.done()
                break
            except NotFound as e:  # --newest, and this node has taken none yet
                raise NotFound(f"{e}; without --newest, kv snapshot save takes one") from None
            except KVError as e:
                if n == len(order) - 1:
                    raise
                print(f"{ep}: {e}; trying {order[n + 1]}", file=sys.stderr)
        commit = taken["commit_index"] if taken else max((s.get("commit_index", 0) for _, s in await c.status_all() if isinstance(s, dict)), default=0)
    behind = commit - info["index"]
    held = (
        f"every write acknowledged before it started (the cluster's commit index was {commit})"
        if taken else (f"the cluster's commit index is {commit}: {behind} entries are NOT in it" if behind > 0 else f"the cluster's commit index is {commit}")
    )
    report(
        args, {"file": args.file, **info, "commit_index": commit},
        f"saved {args.file}: index {info['index']}, term {info['term']}, {info['bytes']} bytes, from {info['endpoint']}; {held}",
    )
    return 0


def _readable(path: str) -> None:
    """A missing file is "no such file", not a failed checksum."""
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)


def _inspect(args: argparse.Namespace) -> int:
    path = args.file
    try:
        header, trailer = verify(path)
    except SnapshotFormatError as e:
        raise SnapshotError(f"{path} is not a valid ledgerkv snapshot: {e}; save a new one with kv snapshot save") from e
    with open(path, "rb") as f:  # ledgerkv's own records (leases, client sessions) sort first
        _, offset = read_header(f)
        own = sum(1 for _ in itertools.takewhile(lambda r: r[0][:1] == RESERVED, iter_records(f, offset)))
    out = header.to_json()
    out.update({
        "keys": trailer.records - own, "own_records": own, "blocks": trailer.blocks, "checksum": f"crc32:{trailer.crc:08x}", "checksum_status": "ok",
    })
    if wants_json(args):
        emit(out)
    else:
        print("\n".join(_described(path, out)))
    return 0


def _described(path: str, info: dict) -> list[str]:
    """`kv snapshot inspect` as text: what the file holds, as of when, and from where."""
    created = info.get("created") or 0
    if created <= 0:
        when = "not recorded"
    else:
        ago = time.time() - created
        age = f"{_age(ago)} ago" if ago >= 0 else f"{_age(-ago)} in the future: a clock is wrong"
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(created)) + f", {age}"
    members = ", ".join(f"{m['id']} ({'voter' if m.get('voter', True) else 'learner'}, peer {m['peer']})" for m in info["membership"])
    return columns(
        [
            ["file", f"{path}: a ledgerkv snapshot (format {info['format']}), checksum {info['checksum_status']} ({info['checksum']})"],
            ["index", f"{info['index']} (term {info['term']}): every entry of the log up to it"],
            ["created", f"{when}, by node {info.get('node') or '(not recorded)'} of group {info.get('group') or '(not recorded)'}"],
            ["keys", f"{info['keys']} (and {info['own_records']} records of ledgerkv's own: versions, history, leases, sessions)"],
            ["blocks", str(info["blocks"])],
            ["members", members or "(none)"],
            ["cluster", info.get("cluster") or "(not recorded: written before cluster ids)"],
        ]
    )


def _age(seconds: float) -> str:
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.0f} {unit}"
    return "1 second" if round(seconds) == 1 else f"{seconds:.0f} seconds"


def run(args: argparse.Namespace) -> int:
    if args.snap_cmd == "save":
        return asyncio.run(_save(args))
    if args.snap_cmd == "inspect":
        return _inspect(args)
    if args.snap_cmd == "restore":
        from ..server.config import parse_peers
        from ..snapshot.restore import RestoreError, check_file, restore  # (loads the storage engines)

        _readable(args.file)
        peers = parse_peers(args.peers)

        def say(message: str) -> None:
            print(message, file=sys.stderr)

        try:
            say(f"verifying {args.file} ...")
            checked = check_file(args.file)  # before the data dir is created or locked
            made = not os.path.exists(args.data_dir)
            lock = DataDirLock.acquire(args.data_dir)
            try:
                summary = restore(args.file, args.data_dir, args.id, peers, group=args.group, progress=say, checked=checked)
            except RestoreError:
                if made:  # refused before anything was written: the dir holds only the lock it was made for
                    shutil.rmtree(args.data_dir, ignore_errors=True)
                raise
            finally:
                lock.release()
        except RestoreError as e:
            raise SnapshotError(str(e)) from e
        text = f"restored {summary['keys']} keys at index {summary['index']} (term {summary['term']}) into {summary['data_dir']} for {args.id}; members: {', '.join(summary['members'])}"
        report(args, summary, text)
        return 0
    args.usage.parse_args(["--help"])
    return 2
