"""Keys in URL paths: percent-encoded UTF-8, '/' allowed, decoded strictly (aiohttp and yarl
decode leniently, which would turn a bad escape into a different key)."""

from __future__ import annotations

import re

from kv import BadRequest

_HEX = re.compile(rb"%[0-9A-Fa-f]{2}")


def key_from_raw_path(raw_path: str, prefix: str) -> str:
    """The key in raw_path after `prefix` (e.g. "/v1/kv/"), decoded strictly."""
    path = raw_path.partition("?")[0]
    if not path.startswith(prefix) or len(path) == len(prefix):
        raise BadRequest("the key is missing from the path: /v1/kv/{key}")
    key = path[len(prefix) :]
    if "%" not in key and key.isascii():
        return key  # nothing to decode (the common case)
    raw = key.encode()
    out = bytearray()
    i = 0
    while i < len(raw):
        c = raw[i]
        if c == 0x25:  # '%'
            if not _HEX.match(raw, i):
                raise BadRequest(f"bad percent-encoding in the key at position {i}: '%' must be followed by two hex digits")
            out.append(int(raw[i + 1 : i + 3], 16))
            i += 3
        else:
            out.append(c)
            i += 1
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"the key is not valid UTF-8 once percent-decoded: {e.reason}") from None
