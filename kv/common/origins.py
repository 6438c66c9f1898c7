"""--cors: the web pages (origins) whose scripts may call a node's client API; checked where
the node's settings are (kv.server.config) and used by the front (http/cors.py)."""

from __future__ import annotations

import re

from ..errors import BadRequest

_ORIGIN = re.compile(r"https?://[^/\s?#,*]+")


def parse_origins(text: str) -> frozenset[str]:
    """Origins (scheme://host[:port]) comma-separated, or * for every page; "": none."""
    items = [o.strip() for o in (text or "").split(",") if o.strip()]
    if items == ["*"]:
        return frozenset(items)
    origins = set()
    for o in items:
        o = o[:-1] if o.endswith("/") else o
        if not _ORIGIN.fullmatch(o):
            raise BadRequest(
                f"--cors: {o!r} is not an origin: give the web pages' scheme://host[:port] without a path "
                "(e.g. http://localhost:3000), several comma-separated, or * for any page"
            )
        origins.add(o.lower())
    return frozenset(origins)
