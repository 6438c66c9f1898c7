"""The checks of a caller's arguments that every face makes the same way, before anything
is sent: a value is bytes, a lease's ttl and id are in range."""

from __future__ import annotations

from ..errors import BadRequest
from ..statemachine.commands import MAX_TTL_MS


def ttl_ms(ttl: float) -> int:
    """A lease ttl in seconds, checked, as whole milliseconds."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl != ttl:
        raise BadRequest(f"a lease's ttl is a number of seconds, not {ttl!r}")
    # The range first: round() overflows on inf and 1e308.
    if not 0 < ttl * 1000 <= MAX_TTL_MS or round(ttl * 1000) == 0:
        raise BadRequest(f"a lease's ttl is more than 0 and at most a year ({MAX_TTL_MS // 1000} s), not {ttl!r}")
    return round(ttl * 1000)


def value_bytes(value) -> bytes:
    """A value as bytes: bytes, bytearray or memoryview; anything else is refused (bytes(5)
    would be five NUL bytes, and a str has no one right encoding)."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise BadRequest(f"values are bytes, not {type(value).__name__}: encode it first")
    return bytes(value)


def lease_id(lease) -> int:
    """A lease id, from an int or anything with an `.id` (a Lease)."""
    lid = getattr(lease, "id", lease)
    if isinstance(lid, bool) or not isinstance(lid, int) or not 0 < lid < 1 << 63:
        raise BadRequest(f"a lease id is a positive integer, not {lid!r}")
    return lid
