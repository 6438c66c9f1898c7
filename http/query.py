"""The query parameters each key route (routes_kv.ROUTES: the keys, txn, bulk) and the watch
take, read from openapi.json (the one list of them), and the refusal of any other: a
mistyped name (GET /v1/kv?prefx=photos/) was ignored, so the listing it meant to narrow
went over every key instead, and a script deleting what it listed would have deleted them
all."""

from __future__ import annotations

import functools
import json
import re

from kv import BadRequest

from . import routes_kv
from .routes_admin import OPENAPI_PATH


@functools.cache  # (read at the first request, not at import: Spark's executors import kv.http from a zip)
def _taken() -> dict[str, frozenset[str]]:
    with open(OPENAPI_PATH, "rb") as f:
        doc = json.load(f)
    shared = doc["components"]["parameters"]

    def query_names(method: str, path: str) -> frozenset[str]:
        params = doc["paths"][path][method.lower()].get("parameters", [])
        params = [shared[p["$ref"].rsplit("/", 1)[1]] if "$ref" in p else p for p in params]
        return frozenset(p["name"] for p in params if p["in"] == "query")

    routes = [(m, re.sub(r"\{(\w+):[^}]*\}", r"{\1}", path), name) for m, path, _, name in routes_kv.ROUTES] + [("GET", "/v1/watch", "watch")]
    return {name: query_names(m, path) for m, path, name in routes}  # (a HEAD is its GET's route)


def unknown_query(route: str | None, method: str, path: str, query) -> BadRequest | None:
    """The refusal of a request to `route` whose query names a parameter it does not take."""
    takes = _taken().get(route)
    if takes is None:
        return None
    unknown = sorted(set(query) - takes)
    if not unknown:
        return None
    return BadRequest(
        f"{method} {path} takes no query parameter {', '.join(map(repr, unknown))} (a typo?); it takes "
        f"{', '.join(sorted(takes)) or 'none'} (see /v1/openapi.json)"
    )
