"""The numbers etcd's API names members and clusters by (uint64), for ledgerkv's string ids."""

from __future__ import annotations

import hashlib


def etcd_id(name: str) -> int:
    """A stable, nonzero 64-bit id for a name (a node's id, a group's name)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") or 1
