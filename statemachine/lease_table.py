"""Leases inside the state machine: which leases exist, their ttl, and the keys each holds.

They are stored as reserved records in the key space itself — keys that start with NUL,
which user keys cannot — so snapshots, install-snapshot and restore carry them with
everything else, at the same index:

    "\\x00lease/" + id as 16 hex digits    the lease's ttl in ms (u64), then the key prefix of the
                                         token that granted it (UTF-8; none in older records)
    "\\x00lkey/" + key                     the id (u64) of the lease the key is attached to

Each record's value has the usual mod_index prefix. The same tables live in memory
(rebuilt at open and after a snapshot load), so applying a put asks `key in attached`
instead of reading LevelDB. Expiry is not decided here: the leader's clock decides it and
commits a revoke (kv/server/lessor.py); applying that revoke is what deletes the keys.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from .commands import key_text

RESERVED = b"\x00"  # the first byte of every reserved key
LEASE_RECORD = b"\x00lease/"
ATTACH_RECORD = b"\x00lkey/"
_U64 = struct.Struct(">Q")


def lease_record(lease: int) -> bytes:
    return LEASE_RECORD + b"%016x" % lease


class LeaseTable:
    def __init__(self) -> None:
        self.ttl_ms: dict[int, int] = {}
        self.owner: dict[int, str] = {}  # the granting token's key prefix ("": any), where one was given
        self.keys: dict[int, set[str]] = {}
        self.attached: dict[str, int] = {}  # key -> lease
        self.version = 0  # moves on every grant and revoke (the leader's clock follows it)

    def load(self, records: Iterable[tuple[bytes, bytes]]) -> None:
        """Rebuild from the reserved records: (key without the data prefix, value without
        its mod_index)."""
        self.__init__()
        attached = []
        for key, value in records:
            if key.startswith(LEASE_RECORD):
                lease = int(key[len(LEASE_RECORD) :], 16)
                self.ttl_ms[lease] = _U64.unpack_from(value)[0]
                if len(value) > 8:
                    self.owner[lease] = value[8:].decode()
                self.keys.setdefault(lease, set())
            elif key.startswith(ATTACH_RECORD):
                attached.append((key_text(key[len(ATTACH_RECORD) :]), _U64.unpack(value)[0]))
        for key, lease in attached:
            if lease in self.ttl_ms:
                self.attach_in_memory(key, lease)
        self.version += 1

    def grant(self, lease: int, ttl_ms: int, owner: str = "") -> tuple[bytes, bytes]:
        """Record a new lease; returns the (record key, payload) to write."""
        self.ttl_ms[lease] = ttl_ms
        self.keys[lease] = set()
        if owner:
            self.owner[lease] = owner
        self.version += 1
        return lease_record(lease), _U64.pack(ttl_ms) + owner.encode()

    def revoke(self, lease: int) -> list[str]:
        """Forget a lease; returns its keys (which the caller deletes, records and all)."""
        del self.ttl_ms[lease]
        self.owner.pop(lease, None)
        keys = sorted(self.keys.pop(lease))
        for k in keys:
            del self.attached[k]
        self.version += 1
        return keys

    def attach_in_memory(self, key: str, lease: int) -> None:
        self.attached[key] = lease
        self.keys[lease].add(key)

    def detach_in_memory(self, key: str) -> None:
        lease = self.attached.pop(key)
        self.keys[lease].discard(key)
