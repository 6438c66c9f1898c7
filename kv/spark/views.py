"""A node's view pinned for an export (kv/server/exports.py), read over HTTP: the driver pins
it (`POST /v1/export`) and lets it go (`DELETE /v1/export/{view}`); each executor streams
its key ranges (`GET /v1/export/{view}?from=&to=`) as blocks of the snapshot file's format.
Nothing is written on the node, and no file is shared between hosts."""

from __future__ import annotations

import http.client
import io
import json
import urllib.error
import urllib.request
from collections.abc import Iterator

from ..client.endpoints import error_for, with_query
from ..errors import KVError

TIMEOUT_S = 60.0


def open_view(endpoint: str, token: str | None, prefix: str, parts: int) -> dict:
    """Pin every key under prefix on this node, as of now: {"view", "index", "term", "keys",
    "ranges" ([from, to) in hex; to None: the end)}."""
    with _request("POST", with_query(f"{endpoint}/v1/export", {"prefix": prefix, "parts": parts}), token) as resp:
        return json.loads(resp.read())


def close_view(endpoint: str, token: str | None, view: str) -> None:
    """Let the view go (best effort: a node lets an unread view go by itself)."""
    try:
        with _request("DELETE", f"{endpoint}/v1/export/{view}", token):
            pass
    except KVError:
        pass


def range_url(endpoint: str, view: str, lo: str, hi: str | None) -> str:
    return with_query(f"{endpoint}/v1/export/{view}", {"from": lo, **({"to": hi} if hi is not None else {})})


def range_blocks(url: str, token: str | None) -> Iterator[tuple[int, bytes]]:
    """(record count, payload) of each block of a view's key range, as they arrive."""
    from ..snapshot.format import SnapshotFormatError, iter_blocks

    try:
        with _request("GET", url, token) as resp:
            yield from iter_blocks(io.BufferedReader(resp, 1 << 20), None)
    except (_Unreachable, SnapshotFormatError, OSError, http.client.HTTPException) as e:
        node = url.split("/v1/")[0]
        raise KVError(f"{node}, which holds the export's view, stopped answering ({e}): run the export again (a node that answers pins a new one)") from None


class _Unreachable(KVError):
    """The node did not answer at all."""


def _request(method: str, url: str, token: str | None):
    """urllib's answer; an error answer as the kv error it stands for (kv.Client's mapping)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        return urllib.request.urlopen(urllib.request.Request(url, method=method, headers=headers), timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        raise error_for(e.code, e.read(), f"{method} {url.split('?')[0]}") from None
    except OSError as e:
        raise _Unreachable(f"{method} {url.split('?')[0]}: {e}") from None
