"""The history: the earlier versions of every key, until compacted (etcd's MVCC on LevelDB).

A change at revision R (the index of the entry that made it), the n-th of that entry's,
moves the record the key held before it into the history, under (key, R, n): its
create_revision, mod_revision, version, lease and value; and it is listed under (R, n).
(A ledgerkv transaction may change a key twice: each change is kept.) A change that
creates the key keeps no record, as there was nothing, unless the same batch of entries
changed the key before (then an "absent" record: see below). So, with no more than a seek
each:

- the key as of revision X is its first history record after X, or its current record when
  it has none (nothing changed it since X); unless that version was created after X, which
  means the key was absent at X (a version created at or before X that lived on past X
  was the key at X: any change in between would have kept a record);
- a change's prev_kv is its history record (none: it created the key), and what it wrote
  is the key's next history record, or its current record, unless that version was created
  after R (the change was a delete). A delete and a creation in the same entry leave a
  version created at R, hence the "absent" record a creation keeps after the batch's
  earlier changes of the key;
- Compact(C) makes every record below C useless (a read at C or later stops at a record
  above C), so compaction drops them, in bounded batches after the Compact is applied.

Every change since `history_from` is recorded (a data dir from before the history starts it
at the index it was opened at). Both kinds of records sit among the data records
(b"k\\x00hist/...", b"k\\x00hrev/...") with a mod_index prefix like every other, so a
snapshot carries the history that is not yet compacted, and a restore loads it back.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import NamedTuple

from .commands import KeyValue, key_text
from .lease_table import RESERVED

_DATA = b"k"
VERSIONS = _DATA + RESERVED + b"hist/"  # + escaped key + revision + n: the key before that change
CHANGES = _DATA + RESERVED + b"hrev/"  # + revision + n: the n-th key that revision changed
HISTORY_FROM = RESERVED + b"hfrom"  # (a data record) the first revision whose changes are all kept
_U64 = struct.Struct(">Q")
_REV_N = struct.Struct(">QI")
_VERSION = struct.Struct(">QQQQQ")  # mod_index prefix (= the revision), create, mod, version, lease
_END = b"\x00\x00"
_ALL_ONES = b"\xff" * (_REV_N.size + 1)  # after every (revision, n) of a key


def escaped(raw: bytes) -> bytes:
    """A key as it sorts among version records: NUL bytes doubled up as NUL 0xFF, and the
    key ended with two NULs, so that every key's records sort together and in key order."""
    return (raw.replace(b"\x00", b"\x00\xff") if b"\x00" in raw else raw) + _END


def unescaped(esc: bytes) -> bytes:
    return esc.replace(b"\x00\xff", b"\x00")


def version_key(raw: bytes, revision: int, n: int) -> bytes:
    return _version_key(raw, _REV_N.pack(revision, n))


def _version_key(raw: bytes, rev_n: bytes) -> bytes:
    """version_key with (revision, n) packed already: the end of the change's own record key."""
    return VERSIONS + escaped(raw) + rev_n


def version_value(revision: int, prev: KeyValue | None) -> bytes:
    """The history record of a change at `revision` of a key that held prev (None: nothing)."""
    if prev is None:
        return _U64.pack(revision)
    return past_record(revision, prev.create_revision, prev.mod_revision, prev.version, prev.lease, prev.value)


def past_record(revision: int, create: int, mod: int, version: int, lease: int, value: bytes) -> bytes:
    """version_value of a key that held these, without making a KeyValue of them (the put's
    hot path)."""
    return _VERSION.pack(revision, create, mod, version, lease) + value


def change_key(revision: int, n: int) -> bytes:
    return CHANGES + _REV_N.pack(revision, n)


def _version_of(key: str, value: bytes) -> KeyValue | None:
    if len(value) == 8:
        return None
    _, create, mod, version, lease = _VERSION.unpack_from(value)
    return KeyValue(key, create, mod, version, value[_VERSION.size :], lease)


class Past(NamedTuple):
    """A key as of a revision, from its history: `found` False when the history has no
    record of it after that revision (then its current record says it)."""

    found: bool
    kv: KeyValue | None


def at(db, raw: bytes, revision: int) -> Past:
    """Key `raw` as of `revision`: its first history record after it (found), if any."""
    head = VERSIONS + escaped(raw)
    it = db.iterator(start=head + _REV_N.pack(revision + 1, 0), stop=head + _ALL_ONES)
    try:
        for k, v in it:
            return Past(True, _version_of(key_text(raw), v))
    finally:
        it.close()
    return Past(False, None)


def keys_between(db, lo: bytes, hi: bytes | None) -> Iterator[bytes]:
    """Every raw key in [lo, hi) (hi None: no end) that has a history record, in key order."""
    start = VERSIONS + escaped(lo)[:-2]
    stop = VERSIONS + escaped(hi)[:-2] if hi is not None else VERSIONS[:-1] + b"0"  # ("0" follows "/")
    it = db.raw_iterator()
    try:
        it.seek(start)
        while it.valid():
            k = it.key()
            if k >= stop:
                return
            esc = k[len(VERSIONS) : -_REV_N.size]
            yield unescaped(esc[:-2])
            it.seek(k[: -_REV_N.size] + _ALL_ONES)  # past every record of this key
    finally:
        it.close()


def changes_from(db, revision: int, upto: int, max_changes: int) -> list[tuple[int, int, bytes]]:
    """(revision, n, raw key) of the changes of revisions [revision, upto], in order, at
    most max_changes of them (then the last revision's changes are all included)."""
    out: list[tuple[int, int, bytes]] = []
    with db.iterator(start=change_key(revision, 0), stop=change_key(upto + 1, 0)) as it:
        for k, v in it:
            rev, n = _REV_N.unpack_from(k, len(CHANGES))
            if len(out) >= max_changes and rev != out[-1][0]:
                break
            out.append((rev, n, v[8:]))
    return out


def prev_of(db, raw: bytes, revision: int, n: int) -> KeyValue | None:
    """What the n-th change at `revision`, of `raw`, found (prev_kv): its own record."""
    v = db.get(version_key(raw, revision, n))
    return None if v is None else _version_of(key_text(raw), v)


def change_of(db, raw: bytes, revision: int, n: int) -> tuple[KeyValue | None, Past]:
    """What the n-th change at `revision`, of `raw`, found (prev_kv) and what it left: the
    key's next history record, or (found False) its current record."""
    key = key_text(raw)
    head = VERSIONS + escaped(raw)
    own = head + _REV_N.pack(revision, n)
    it = db.iterator(start=own, stop=head + _ALL_ONES)
    try:
        prev = None
        for k, v in it:
            if k == own:  # (a creation may have kept none: then prev is None)
                prev = _version_of(key, v)
                continue
            return prev, Past(True, _version_of(key, v))
        return prev, Past(False, None)
    finally:
        it.close()


def purge(db, start: bytes, below: int, max_records: int) -> tuple[int, bytes]:
    """Drop the history records of revisions below `below`, from change record `start` on
    (where the last call stopped: the records before it are gone, and skipping their
    tombstones again would make each call slower than the last), at most max_records
    changes' worth in one write. Returns how many changes were dropped (0: none are left)
    and where the next call starts."""
    wb = db.write_batch()
    n = 0
    at = len(CHANGES)
    with db.iterator(start=max(start, CHANGES), stop=change_key(below, 0)) as it:
        for k, v in it:
            wb.delete(k)
            wb.delete(_version_key(v[8:], k[at:]))  # (the change record's key ends as its version record's)
            n += 1
            if n >= max_records:
                break
    if n:
        start = k + b"\x00"
    wb.write()
    return n, start
