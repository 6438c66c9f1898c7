"""--cors: the web pages (origins) whose scripts may call a node's client API; checked where
the node's settings are (kv.server.config) and used by the front (http/cors.py)."""

from __future__ import annotations

import re

from ..errors import BadRequest

# scheme://host[:port] as a browser serializes an origin: a desktop app's or an extension's
# scheme too (tauri://localhost); no user, path, query or wildcard
_ORIGIN = re.compile(r"([a-z][a-z0-9+.-]*)://([^/\s?#,*@:]+|\[[0-9a-f:.]+\])(?::(\d{1,5}))?")
_DEFAULT_PORTS = {"http": "80", "https": "443"}


def parse_origins(text: str) -> frozenset[str]:
    """Origins comma-separated, or * alone for every page; "": none. Each as browsers send
    it: lower case, without its scheme's default port."""
    items = [o.strip() for o in (text or "").split(",") if o.strip()]
    if "*" in items:
        if items != ["*"]:
            raise BadRequest("--cors: * (every page) stands alone; list origins without it, or give * only")
        return frozenset(items)
    origins = set()
    for o in items:
        m = _ORIGIN.fullmatch(o.lower().removesuffix("/"))
        if m is None or not o.isascii() or m.group(3) and not 0 < int(m.group(3)) < 65536:
            raise BadRequest(
                f"--cors: {o!r} is not an origin: give the web pages' scheme://host[:port] without a path "
                "(e.g. http://localhost:3000; a host name that is not ASCII in its xn-- form), several "
                "comma-separated, or * for any page"
            )
        scheme, host, port = m.groups()
        origins.add(f"{scheme}://{host}" + (f":{port}" if port and port != _DEFAULT_PORTS.get(scheme) else ""))
    return frozenset(origins)
