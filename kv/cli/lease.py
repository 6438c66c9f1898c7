"""`kv lease grant|keepalive|revoke|info|list`, `kv lock NAME -- CMD`, `kv elect NAME VALUE`:
coordination over HTTP."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from ..errors import BadRequest
from ..common.arguments import ttl_ms
from ..common.results import LeaseStatus
from .options import client_options, positive_seconds, with_client
from .output import add_output_option, emit, listing_text


def _client_options(a: argparse.ArgumentParser) -> argparse.ArgumentParser:
    a.set_defaults(run=run)
    return client_options(a, timeout_help="seconds before giving up on a request (default 10)")


def add_parser(sub) -> None:
    lk = _client_options(
        sub.add_parser(
            "lock",
            help="run a command while holding a lock",
            usage="kv lock [options] NAME [-- COMMAND ARGS...]",
            description=(
                "Run COMMAND while holding the lock NAME (FIFO across processes); without a command, hold it until "
                "Ctrl-C. The lock is freed when the command ends. If the lock is lost (its lease revoked or expired), "
                "the command's process group is killed at once; if kv lock is told to stop (SIGTERM, Ctrl-C), the group "
                "gets that signal, and SIGKILL ttl/2 later, before the lock is released; if kv lock is killed, the "
                "command is killed with it (Linux) and the lock's lease expires."
            ),
        )
    )
    lk.add_argument("name")
    lk.set_defaults(command=[])
    lk.add_argument("--ttl", type=float, default=10.0, help="lease ttl in seconds: how soon a dead holder frees the lock (default 10)")
    lk.add_argument("--wait", type=positive_seconds, default=None, help="give up after this many seconds of waiting (default: wait)")
    el = _client_options(sub.add_parser("elect", help="campaign in an election, or watch one", description="Campaign with VALUE and hold the leadership until Ctrl-C; with --listen, print the leader's value each time it changes."))
    el.add_argument("name")
    el.add_argument("value", nargs="?")
    el.add_argument("--listen", action="store_true", help="only observe the election")
    el.add_argument("--ttl", type=float, default=10.0, help="lease ttl in seconds (default 10)")
    p = sub.add_parser("lease", help="leases: grant, keepalive, revoke, info, list", description="Leases: keys attached to one go when it expires or is revoked.")
    p.set_defaults(run=run)
    acts = p.add_subparsers(dest="lease_cmd", metavar="ACTION", required=True)

    def action(name: str, help_: str) -> argparse.ArgumentParser:
        a = _client_options(acts.add_parser(name, help=help_, description=help_))
        add_output_option(a)
        return a

    action("grant", "grant a lease and print its id").add_argument("ttl", type=lease_ttl, help="seconds it lives without a keepalive")
    k = action("keepalive", "keep a lease alive until Ctrl-C (or renew it once with --once)")
    k.add_argument("id", type=int)
    k.add_argument("--once", action="store_true", help="renew it once and exit")
    action("revoke", "revoke a lease now; its keys are deleted").add_argument("id", type=int)
    action("info", "a lease's ttl, time left and keys").add_argument("id", type=int)
    action("list", "every live lease")


def _show(args: argparse.Namespace, s: LeaseStatus, *, full: bool = True) -> None:
    if args.output == "json":
        doc = {"id": s.id, "ttl": s.ttl, **({"remaining": s.remaining, "keys": list(s.keys)} if full else {})}
        emit(doc)
    elif full:
        print(f"{s.id}\tttl={s.ttl:g}s\tremaining={s.remaining:g}s" + (f"\tkeys={','.join(s.keys)}" if s.keys else ""), flush=True)
    else:
        print(f"{s.id}\tttl={s.ttl:g}s", flush=True)


def lease_ttl(raw: str) -> float:
    """An argparse type: a lease's ttl, checked as the node checks it (a usage error)."""
    try:
        ttl = float(raw)
        ttl_ms(ttl)
    except (ValueError, BadRequest) as e:
        raise argparse.ArgumentTypeError(str(e) if isinstance(e, BadRequest) else f"expected a number of seconds, not {raw!r}") from None
    return ttl


class _Told:
    """Set once, with what told it: the signal that stops kv lock or kv elect, or the
    error their lost lease gave (as on_lost: said in the command's one line, since the
    library's own warning is silenced in the CLI)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.why = None

    def __call__(self, why) -> None:
        if not self.event.is_set():
            self.why = why
            self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()

    async def wait(self) -> None:
        await self.event.wait()


def _stop_on_signals() -> _Told:
    """Told by SIGINT or SIGTERM (`why` says which): installed before the line that tells
    the caller it may send one, so that a signal sent on reading that line is never the
    default's kill. An inherited SIG_IGN (a background job's SIGINT) is kept."""
    stop = _Told()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            loop.add_signal_handler(sig, stop, sig)
    return stop


async def _unless_stopped(aw, stop: _Told) -> bool:
    """Await a lock's acquire or a campaign unless SIGINT or SIGTERM comes first; then it is
    cancelled and withdraws its key from the queue at once (not a ttl later). True if it
    finished."""
    task = asyncio.ensure_future(aw)
    await _first(task, stop.wait())
    await asyncio.wait((task,))  # its clean-up, if cancelled
    if task.cancelled():
        return False
    task.result()  # its error, if any
    return True


async def _lock(c, args: argparse.Namespace) -> int:
    from ..client.recipes import AsyncLock

    lost, stop = _Told(), _stop_on_signals()
    lock = AsyncLock(c, args.name, ttl=args.ttl, timeout=args.wait, on_lost=lost)
    if not await _unless_stopped(lock.acquire(), stop):
        return 128 + stop.why  # interrupted while waiting: its command never ran
    try:
        print(f"locked {args.name} ({lock.key})", file=sys.stderr, flush=True)
        if not args.command:
            await _first(stop.wait(), lost.wait())
            if lost.is_set():
                print(f"kv lock: the lock {args.name} was lost ({lost.why})", file=sys.stderr)
                return 1
            return 0
        # The command runs under kv.cli.supervise, which takes its whole process group down
        # when told to, or when this process dies: it never runs on without the lock.
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kv.cli.supervise", str(os.getpid()), f"{args.ttl / 2:g}", *args.command
        )
        await _first(proc.wait(), stop.wait(), lost.wait())
        if proc.returncode is not None:
            return proc.returncode
        if lost.is_set():  # another holder may have it already: kill at once, no grace
            proc.send_signal(signal.SIGUSR1)
            await proc.wait()
            print(f"kv lock: the lock {args.name} was lost ({lost.why}); killed the command", file=sys.stderr)
            return 1
        proc.send_signal(stop.why)  # passed on to the command, which has ttl/2 to end
        await proc.wait()
        return 128 + stop.why
    finally:
        await lock.release()


async def _first(*aws) -> None:
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


async def _elect(c, args: argparse.Namespace) -> int:
    lost = _Told()
    e = c.election(args.name, ttl=args.ttl, on_lost=lost)
    if args.listen:
        async for value in e.observe():
            print("-" if value is None else listing_text(value), flush=True)
        return 0
    if args.value is None:
        print("kv elect: give the VALUE to campaign with, or --listen", file=sys.stderr)
        return 2
    stop = _stop_on_signals()
    if not await _unless_stopped(e.campaign(args.value.encode()), stop):
        return 128 + stop.why  # interrupted while campaigning: never elected
    print(f"elected: {args.value}", flush=True)
    try:
        await _first(stop.wait(), lost.wait())
    finally:
        await e.resign()
    if lost.is_set():  # another candidate may lead already: say so and stop claiming it
        print(f"kv elect: lost the leadership of {args.name} ({lost.why})", file=sys.stderr)
        return 1
    return 0


async def _run(c, args: argparse.Namespace) -> int:
    if args.cmd == "lock":
        return await _lock(c, args)
    if args.cmd == "elect":
        return await _elect(c, args)
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
            emit({"id": args.id, "index": r.index, "keys": list(r.keys)})
        else:
            n = len(r.keys)
            print(f"OK index={r.index} revoked; {n} key{'' if n == 1 else 's'} deleted with it")
    elif act == "info":
        _show(args, await c.lease_info(args.id))
    else:
        leases = await c.lease_list()
        if args.output == "json":
            emit({"leases": [{"id": s.id, "ttl": s.ttl, "remaining": s.remaining} for s in leases]})
        for s in leases if args.output == "text" else ():
            _show(args, s)
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        return with_client(args, _run)
    except KeyboardInterrupt:
        # Ctrl-C is how a keepalive or a listener is ended: done. (kv lock and kv elect
        # catch it themselves: 128 + the signal while waiting.)
        return 0
