"""`kv lease grant|keepalive|revoke|info|list`: leases over HTTP."""

from __future__ import annotations

import argparse
import asyncio
import json
import os

from .client import AsyncClient
from .node import LeaseStatus


def add_parser(sub) -> None:
    p = sub.add_parser("lease", help="leases: grant, keepalive, revoke, info, list", description="Leases: keys attached to one go when it expires or is revoked.")
    acts = p.add_subparsers(dest="lease_cmd", metavar="ACTION", required=True)

    def action(name: str, help_: str) -> argparse.ArgumentParser:
        a = acts.add_parser(name, help=help_, description=help_)
        a.add_argument("--endpoints", default=os.environ.get("KV_ENDPOINTS"), help="comma-separated client URLs (default: $KV_ENDPOINTS or the local `kv cluster up` nodes)")
        a.add_argument("--token", default=os.environ.get("KV_TOKEN"), help="bearer token of the cluster, if it has one")
        a.add_argument("--timeout", type=float, default=10.0, help="seconds before giving up on a request (default 10)")
        a.add_argument("-o", "--output", choices=["text", "json"], default="text", help="text (default) or json")
        return a

    action("grant", "grant a lease and print its id").add_argument("ttl", type=float, help="seconds it lives without a keepalive")
    k = action("keepalive", "keep a lease alive until Ctrl-C (or renew it once with --once)")
    k.add_argument("id", type=int)
    k.add_argument("--once", action="store_true", help="renew it once and exit")
    action("revoke", "revoke a lease now; its keys are deleted").add_argument("id", type=int)
    action("info", "a lease's ttl, time left and keys").add_argument("id", type=int)
    action("list", "every live lease")


def _show(args: argparse.Namespace, s: LeaseStatus, *, full: bool = True) -> None:
    if args.output == "json":
        doc = {"id": s.id, "ttl": s.ttl, **({"remaining": s.remaining, "keys": list(s.keys)} if full else {})}
        print(json.dumps(doc), flush=True)
    elif full:
        print(f"{s.id}\tttl={s.ttl:g}s\tremaining={s.remaining:g}s" + (f"\tkeys={','.join(s.keys)}" if s.keys else ""), flush=True)
    else:
        print(f"{s.id}\tttl={s.ttl:g}s", flush=True)


async def _run(args: argparse.Namespace) -> int:
    async with AsyncClient(args.endpoints, token=args.token, timeout=args.timeout) as c:
        act = args.lease_cmd
        if act == "grant":
            _show(args, await c.lease_grant(args.ttl), full=False)
        elif act == "keepalive":
            while True:
                s = await c.lease_keepalive(args.id)
                _show(args, s, full=False)
                if args.once:
                    return 0
                await asyncio.sleep(s.ttl / 3)
        elif act == "revoke":
            r = await c.lease_revoke(args.id)
            if args.output == "json":
                print(json.dumps({"id": args.id, "index": r.index, "keys": list(r.keys)}))
            else:
                print(f"OK index={r.index} deleted={len(r.keys)} keys")
        elif act == "info":
            _show(args, await c.lease_info(args.id))
        else:
            leases = await c.lease_list()
            if args.output == "json":
                print(json.dumps({"leases": [{"id": s.id, "ttl": s.ttl, "remaining": s.remaining} for s in leases]}))
            for s in leases if args.output == "text" else ():
                _show(args, s)
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_run(args))
    except KeyboardInterrupt:
        return 0
