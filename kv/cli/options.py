"""Options shared by the commands that talk to a cluster over HTTP, and the client they open."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Awaitable, Callable

from .output import add_output_option

ENDPOINTS_HELP = "comma-separated client URLs (default: $KV_ENDPOINTS or the local `kv cluster up` nodes)"


def positive_seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{raw} is not a positive number of seconds")
    if value == float("inf"):
        raise argparse.ArgumentTypeError(f"{raw} is not a finite number of seconds (see the option's default in --help)")
    return value


def at_least(least: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least `least`."""

    def whole_number(raw: str) -> int:
        if not raw.isdigit() or int(raw) < least:
            raise argparse.ArgumentTypeError(f"expected a whole number of at least {least}, not {raw!r}")
        return int(raw)

    return whole_number


def client_options(
    a: argparse.ArgumentParser,
    timeout_help: str | None = "seconds before giving up (default 10)",
    token_help: str | None = "bearer token of the cluster, if it has one",
) -> argparse.ArgumentParser:
    """--endpoints, --token, --cacert and (unless timeout_help is None) --timeout."""
    a.add_argument("--endpoints", default=os.environ.get("KV_ENDPOINTS"), help=ENDPOINTS_HELP)
    a.add_argument("--token", default=os.environ.get("KV_TOKEN"), help=token_help)
    a.add_argument("--cacert", default=os.environ.get("KV_CACERT"), help="CA certificate (PEM) to verify https:// endpoints with")
    if timeout_help is not None:
        a.add_argument("--timeout", type=positive_seconds, default=10.0, help=timeout_help)
    return a


def client_command(sub, name: str, help_: str, run: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """`kv NAME`: a command with the client options and -o."""
    a = client_options(sub.add_parser(name, help=help_, description=help_))
    add_output_option(a)
    a.set_defaults(run=run)
    return a


def with_client(args: argparse.Namespace, fn: Callable[..., Awaitable[int]]) -> int:
    """Run fn(client, args) with an AsyncClient on the command's endpoints."""
    from ..client.async_client import AsyncClient

    async def go() -> int:
        async with AsyncClient(args.endpoints, token=args.token, timeout=args.timeout, cacert=args.cacert) as c:
            return await fn(c, args)

    return asyncio.run(go())
