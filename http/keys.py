"""Keys in URL paths and query strings: percent-encoded bytes, '/' allowed in a path, decoded
strictly (aiohttp and yarl decode leniently, which would turn a bad escape into a different
key, and bytes that are not UTF-8 into U+FFFD). Bytes that are not UTF-8 come back as
commands.key_text holds them."""

from __future__ import annotations

import re

from kv import BadRequest
from kv.common.wire import key_text

_HEX = re.compile(rb"%[0-9A-Fa-f]{2}")


def key_from_raw_path(raw_path: str, prefix: str) -> str:
    """The key in raw_path after `prefix` (e.g. "/v1/kv/"), decoded strictly."""
    path = raw_path.partition("?")[0]
    if not path.startswith(prefix) or len(path) == len(prefix):
        raise BadRequest("the key is missing from the path: /v1/kv/{key}")
    key = path[len(prefix) :]
    if "%" not in key and key.isascii():
        return key  # nothing to decode (the common case)
    return key_text(_unescape(key, "the key"))


def key_param(request, name: str, default: str | None = None) -> str | None:
    """A key or prefix in the query string (?prefix=, ?after=), any bytes percent-encoded
    ("+" a space, as aiohttp reads it), decoded strictly."""
    value = request.query.get(name)
    if value is None:
        return default
    query = request.raw_path.partition("?")[2]
    if "%" not in query:
        return value  # nothing escaped (the common case)
    for part in query.split("&"):
        k, _, v = part.partition("=")
        if k == name:
            return key_text(_unescape(v.replace("+", " "), f"?{name}="))
    return value


def _unescape(text: str, what: str) -> bytes:
    raw = text.encode()
    out = bytearray()
    i = 0
    while i < len(raw):
        c = raw[i]
        if c == 0x25:  # '%'
            if not _HEX.match(raw, i):
                raise BadRequest(f"bad percent-encoding in {what} at position {i}: '%' must be followed by two hex digits")
            out.append(int(raw[i + 1 : i + 3], 16))
            i += 3
        else:
            out.append(c)
            i += 1
    return bytes(out)
