"""The KV state machine on LevelDB (plyvel).

Layout:

    b"\\x00applied"     index + term of the last applied entry (2 x u64, big-endian)
    b"\\x00membership"  the membership as of the applied index (from CONFIG entries)
    b"\\x00restoring"   present while a snapshot is being loaded: the state is incomplete
    b"k" + key         mod_index (u64) + value
    b"k\x00..."        reserved records: leases and the keys attached to them (leases.py)
    b"\\x00fx" + index  what that entry changed, when its log rows do not say (effect_record)
    b"\\x00effects_from" the first index with effect records (the watch history's floor)

The effect records let a watch replay history from the ledger: an entry's mutations are
in the log, but whether a compare-and-set's condition held, which branch of a transaction
ran, whether a delete found its key, and which keys a lease's revoke deleted were decided
here. An entry whose mutations all took effect (every unconditional put) has no record. Records are dropped with the ledger prefix
they describe (`forget_effects`).

Every applied batch is one WriteBatch that also moves the applied index, so a crash never
applies an entry twice or skips one: on restart the node replays the ledger from the
applied index. Writes are not fsynced one by one (the ledger is the durable record and
replays them); `sync()` makes everything durable before the ledger is compacted.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable, Container, Iterator, Sequence
from typing import Any

import plyvel

from ..raft.errors import KVError
from ..raft.messages import Entry, EntryKind
from .commands import (
    COMMAND_FORMAT,
    CommandError,
    Cond,
    Delete,
    DeleteApplied,
    Get,
    GetResult,
    LeaseGrant,
    LeaseInfo,
    LeaseRevoke,
    LeaseRevoked,
    NoSuchLease,
    ConditionFailed,
    Put,
    PutResult,
    ReadLimitExceeded,
    Txn,
    TxnApplied,
    decode,
    txn_branches,
)
from .leases import ATTACH_RECORD, RESERVED, LeaseTable, lease_record

_APPLIED = b"\x00applied"
_MEMBERSHIP = b"\x00membership"
_RESTORING = b"\x00restoring"
_SYNC = b"\x00sync"
_REMOVED = b"\x00removed"  # ids removed from the cluster (JSON list): their peers are refused
_EFFECTS = b"\x00fx"
_EFFECTS_FROM = b"\x00effects_from"
_DATA = b"k"
_USER_DATA = _DATA + b"\x01"  # where user keys start: the reserved ones sort before
_TWO_U64 = struct.Struct(">QQ")
_PLAIN_PUT = bytes((COMMAND_FORMAT, 1))  # format 1, opcode PUT
_U64 = struct.Struct(">Q")
_RESTORE_BATCH = 10_000

# A change event for watchers: (index, key, value or None for a delete, mod_index).
Change = tuple[int, str, bytes | None]


class StateCorrupt(KVError):
    """The state directory is incomplete or unreadable."""


class StateLocked(KVError):
    """LevelDB's own lock is held by another opener: the directory is in use, not damaged."""


DAMAGED_MARKER = "DAMAGED"  # written into the state dir when a read finds corruption


class LevelDBStateMachine:
    """Reads verify LevelDB's block checksums: a damaged file gives an error, never wrong
    data. Corruption found while reading leaves a marker, so the next start rebuilds."""

    def __init__(self, path: str, *, max_read_bytes: int | None = None) -> None:
        self.path = path
        # The most a transaction's gets may return on the node answering it (None: no limit).
        self.max_read_bytes = max_read_bytes
        self._db = None
        if os.path.exists(os.path.join(path, DAMAGED_MARKER)):
            raise StateCorrupt(f"the state machine in {path} was found damaged while running")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:
            self._db = plyvel.DB(path, create_if_missing=True, paranoid_checks=True)
            raw = self._db.get(_APPLIED, verify_checksums=True)
            self.incomplete = self._db.get(_RESTORING, verify_checksums=True) is not None
        except plyvel.Error as e:
            if getattr(self, "_db", None) is not None:
                self._db.close()
            if isinstance(e, plyvel.IOError) and "lock" in str(e).lower():
                raise StateLocked(f"the state machine in {path} is open in another process ({e})") from e
            raise StateCorrupt(f"the state machine in {path} cannot be opened ({e})") from e
        self._applied = _TWO_U64.unpack(raw) if raw else (0, 0)
        self._membership = self._db.get(_MEMBERSHIP) or b""
        self._removed = set(json.loads(self._db.get(_REMOVED) or b"[]"))
        self.leases = LeaseTable()
        self._load_leases()
        raw_from = self._db.get(_EFFECTS_FROM)
        if raw_from is None:  # a new state, or one from a version that kept no records
            raw_from = _U64.pack(self._applied[0] + 1)
            self._db.put(_EFFECTS_FROM, raw_from)
        self.effects_from = _U64.unpack(raw_from)[0]
        # Called with the changes of each applied batch, when someone watches.
        self.on_changes: Callable[[list[Change]], None] | None = None

    # -- reading ---------------------------------------------------------------------------

    def applied(self) -> tuple[int, int]:
        return self._applied

    def membership(self) -> bytes:
        return self._membership

    def _damaged(self, e: Exception) -> StateCorrupt:
        try:
            with open(os.path.join(self.path, DAMAGED_MARKER), "w") as f:
                f.write(f"{e}\n")
        except OSError:
            pass
        return StateCorrupt(
            f"the state machine in {self.path} is damaged ({e}); restart the node to rebuild it from its newest "
            "snapshot and ledger"
        )

    def get(self, key: str) -> tuple[int, bytes] | None:
        """(mod_index, value) of a key, or None."""
        try:
            raw = self._db.get(_DATA + key.encode(), verify_checksums=True)
        except plyvel.CorruptionError as e:
            raise self._damaged(e) from e
        if raw is None:
            return None
        return _U64.unpack_from(raw)[0], raw[8:]

    def scan(self, prefix: str = "", after: str | None = None, limit: int = 1000) -> list[tuple[str, bytes, int]]:
        """Keys with the prefix, in key order, strictly after `after`: (key, value, mod_index)."""
        pre = _DATA + prefix.encode()
        start = _DATA + after.encode() + b"\x00" if after is not None else pre
        out = []
        it = self._db.iterator(start=max(start, pre, _USER_DATA), prefix=None, verify_checksums=True)
        try:
            for k, v in it:
                if not k.startswith(pre):
                    break
                out.append((k[1:].decode(), v[8:], _U64.unpack_from(v)[0]))
                if len(out) >= limit:
                    break
        except plyvel.CorruptionError as e:
            raise self._damaged(e) from e
        finally:
            it.close()
        return out

    def count(self) -> int:
        with self._db.iterator(start=_USER_DATA, stop=_DATA + b"\xff" * 8, include_value=False) as it:
            return sum(1 for k in it if k.startswith(_DATA))

    def _load_leases(self) -> None:
        with self._db.iterator(prefix=_DATA + RESERVED, verify_checksums=True) as it:
            self.leases.load((k[1:], v[8:]) for k, v in it)

    def lease_info(self, lease: int) -> LeaseInfo | None:
        """A lease as applied here (remaining: the full ttl; only the leader's clock knows
        better), or None."""
        ttl = self.leases.ttl_ms.get(lease)
        return None if ttl is None else LeaseInfo(lease, ttl, ttl, tuple(sorted(self.leases.keys[lease])))

    # -- applying --------------------------------------------------------------------------

    def apply(self, entries: Sequence[Entry], answering: Container[int] | None = None) -> list[Any]:
        """Apply entries; a transaction's gets are read only for the indexes in `answering`
        (those whose result someone waits for here; None: every entry). Gets change
        nothing, so the other replicas skip them and never build a reply nobody reads."""
        wb = self._db.write_batch()
        overlay: dict[bytes, tuple[int, bytes] | None] = {}  # this batch's writes, by raw key
        changes: list[Change] | None = [] if self.on_changes is not None else None
        results: list[Any] = []
        put_kind = EntryKind.NORMAL
        pack = _U64.pack
        attached = self.leases.attached
        for e in entries:
            if e.kind == put_kind:
                d = e.data
                if d[:2] == _PLAIN_PUT and len(d) > 4:
                    # The hot path, an unconditional put, read straight from the encoding:
                    # version, opcode, key length, key, no condition, value.
                    end = 4 + ((d[2] << 8) | d[3])
                    if len(d) > end and d[end] == 0:
                        raw = d[4:end]
                        try:
                            key = raw.decode()
                        except UnicodeDecodeError:
                            key = None  # the slow path rejects it with a reason
                        if key is not None:
                            k = _DATA + raw
                            value = d[end + 1 :]
                            overlay[k] = (e.index, value)
                            wb.put(k, pack(e.index) + value)
                            if key in attached:
                                self._detach(key, wb)
                            if changes is not None:
                                changes.append((e.index, key, value))
                            results.append(PutResult(e.index))
                            continue
                try:
                    cmd = decode(d)
                except CommandError as err:
                    results.append(err)  # deterministic: every replica rejects it alike
                    continue
                reads = answering is None or e.index in answering
                result = self._execute(cmd, e.index, wb, overlay, changes, reads)
                took = effect_record(cmd, result)
                if took is not None:
                    wb.put(_EFFECTS + pack(e.index), took)
                results.append(result)
            elif e.kind == EntryKind.CONFIG:
                self._apply_config(e.data, wb)
                results.append(None)
            else:
                results.append(None)
        if entries:
            last = entries[-1]
            wb.put(_APPLIED, _TWO_U64.pack(last.index, last.term))
            self._applied = (last.index, last.term)
        wb.write()
        if changes:
            self.on_changes(changes)
        return results

    def _apply_config(self, data: bytes, wb) -> None:
        before = {m["id"] for m in json.loads(self.membership() or b"[]")}
        after = {m["id"] for m in json.loads(data or b"[]")}
        self._removed = (self._removed | (before - after)) - after
        wb.put(_MEMBERSHIP, data)
        wb.put(_REMOVED, json.dumps(sorted(self._removed)).encode())
        self._membership = data

    def effects(self, lo: int, hi: int) -> dict[int, bytes]:
        """The effect records of entries [lo, hi), by index (see effect_record). Entries
        without one had every mutation in their log rows take effect."""
        out = {}
        with self._db.iterator(start=_EFFECTS + _U64.pack(lo), stop=_EFFECTS + _U64.pack(hi)) as it:
            for k, v in it:
                out[_U64.unpack_from(k, len(_EFFECTS))[0]] = v
        return out

    def forget_effects(self, upto: int) -> None:
        """Drop the effect records of entries up to `upto` (the ledger no longer has them)."""
        wb = self._db.write_batch()
        with self._db.iterator(start=_EFFECTS + _U64.pack(0), stop=_EFFECTS + _U64.pack(upto + 1), include_value=False) as it:
            for k in it:
                wb.delete(k)
        wb.write()

    def removed(self) -> frozenset[str]:
        """Ids that were members and were removed (a re-added id leaves this set)."""
        return frozenset(self._removed)

    def _current(self, k: bytes, overlay: dict) -> tuple[int, bytes] | None:
        if k in overlay:
            return overlay[k]
        raw = self._db.get(k)
        return None if raw is None else (_U64.unpack_from(raw)[0], raw[8:])

    def _check(self, cond: Cond | None, overlay: dict) -> ConditionFailed | None:
        if cond is None:
            return None
        cur = self._current(_DATA + cond.key.encode(), overlay)
        if cond.holds(cur):
            return None
        return ConditionFailed(cond.key, cur[0] if cur else 0)

    def _execute(self, cmd, index: int, wb, overlay: dict, changes: list | None, reads: bool):
        if isinstance(cmd, Put):
            if cmd.lease and cmd.lease not in self.leases.ttl_ms:
                return NoSuchLease(cmd.lease)
            return self._check(cmd.cond, overlay) or self._put(cmd, index, wb, overlay, changes)
        if isinstance(cmd, LeaseGrant):
            rec, payload = self.leases.grant(index, cmd.ttl_ms)
            wb.put(_DATA + rec, _U64.pack(index) + payload)
            return LeaseInfo(index, cmd.ttl_ms, cmd.ttl_ms)
        if isinstance(cmd, LeaseRevoke):
            return self._revoke(cmd.lease, index, wb, overlay, changes)
        if isinstance(cmd, Delete):
            return self._check(cmd.cond, overlay) or self._delete(cmd, index, wb, overlay, changes)
        if isinstance(cmd, Txn):
            ok = all(self._check(c, overlay) is None for c in cmd.conds)
            out = []
            put_result = PutResult(index)  # every put of the txn has the same one
            pack_index = _U64.pack(index)
            budget = self.max_read_bytes if self.max_read_bytes is not None else float("inf")
            for op in cmd.ops if ok else cmd.else_ops:
                t = type(op)
                if t is Put:
                    k = _DATA + op.key.encode()
                    overlay[k] = (index, op.value)
                    wb.put(k, pack_index + op.value)
                    if op.key in self.leases.attached:
                        self._detach(op.key, wb)
                    if changes is not None:
                        changes.append((index, op.key, op.value))
                    out.append(put_result)
                elif t is Get:
                    if not reads:
                        out.append(None)
                        continue
                    cur = self._current(_DATA + op.key.encode(), overlay)
                    budget -= len(cur[1]) if cur else 0
                    if budget < 0:
                        reads = False  # read no more (the writes still go on); see below
                        out.append(None)
                        continue
                    out.append(GetResult(op.key, cur[1] if cur else None, cur[0] if cur else 0))
                else:
                    out.append(self._delete(op, index, wb, overlay, changes))
            if budget < 0:
                return ReadLimitExceeded(index, ok, self.max_read_bytes)
            return TxnApplied(index, ok, tuple(out))
        raise CommandError(f"unknown command {cmd!r}")

    def _put(self, op: Put, index: int, wb, overlay: dict, changes: list | None) -> PutResult:
        k = _DATA + op.key.encode()
        overlay[k] = (index, op.value)
        wb.put(k, _U64.pack(index) + op.value)
        had = self.leases.attached.get(op.key)
        if had != (op.lease or None):
            if had is not None:
                self._detach(op.key, wb)
            if op.lease:
                self.leases.attach_in_memory(op.key, op.lease)
                wb.put(_DATA + ATTACH_RECORD + op.key.encode(), _U64.pack(index) + _U64.pack(op.lease))
        if changes is not None:
            changes.append((index, op.key, op.value))
        return PutResult(index)

    def _delete(self, op: Delete, index: int, wb, overlay: dict, changes: list | None) -> DeleteApplied:
        k = _DATA + op.key.encode()
        existed = self._current(k, overlay) is not None
        overlay[k] = None
        if existed:
            wb.delete(k)
        if op.key in self.leases.attached:
            self._detach(op.key, wb)
        if changes is not None and existed:
            changes.append((index, op.key, None))
        return DeleteApplied(index, existed)

    def _detach(self, key: str, wb) -> None:
        self.leases.detach_in_memory(key)
        wb.delete(_DATA + ATTACH_RECORD + key.encode())

    def _revoke(self, lease: int, index: int, wb, overlay: dict, changes: list | None) -> LeaseRevoked | NoSuchLease:
        """End a lease and delete its keys, at this entry's index (watchers see deletes)."""
        if lease not in self.leases.ttl_ms:
            return NoSuchLease(lease)
        keys = self.leases.revoke(lease)
        wb.delete(_DATA + lease_record(lease))
        for key in keys:
            raw = key.encode()
            wb.delete(_DATA + ATTACH_RECORD + raw)
            wb.delete(_DATA + raw)
            overlay[_DATA + raw] = None
            if changes is not None:
                changes.append((index, key, None))
        return LeaseRevoked(index, tuple(keys))

    # -- snapshots -------------------------------------------------------------------------

    def capture(self) -> LevelDBView:
        return LevelDBView(self._db.snapshot(), *self._applied, self.membership())

    def restore(self, index: int, term: int, membership: bytes, items: Iterator[tuple[bytes, bytes, int]]) -> int:
        """Replace everything with a snapshot's records; returns how many were loaded. A
        marker makes a crash in the middle visible at the next start (`incomplete`)."""
        self._db.put(_RESTORING, b"1", sync=True)
        self._db.close()
        shutil.rmtree(self.path)
        os.makedirs(self.path)
        self._db = plyvel.DB(self.path, create_if_missing=True, paranoid_checks=True)
        self._db.put(_RESTORING, b"1", sync=True)
        n = 0
        wb = self._db.write_batch()
        pack = _U64.pack
        for key, value, mod in items:
            wb.put(_DATA + key, pack(mod) + value)
            n += 1
            if n % _RESTORE_BATCH == 0:
                wb.write()
                wb = self._db.write_batch()
        wb.write()
        # A synced write flushes LevelDB's log, and with it every record written above.
        fin = self._db.write_batch(sync=True)
        fin.put(_MEMBERSHIP, membership)
        fin.put(_APPLIED, _TWO_U64.pack(index, term))
        self._membership = membership
        fin.delete(_RESTORING)
        fin.put(_EFFECTS_FROM, _U64.pack(index + 1))  # the records before it were not loaded
        self.effects_from = index + 1
        fin.write()
        self._applied = (index, term)
        self.incomplete = False
        self._load_leases()
        return n

    def sync(self) -> None:
        """Make every applied batch durable (before the ledger drops the entries). A synced
        write flushes LevelDB's log, and with it every write before it; it must not touch
        the applied index, which a batch in another thread may be moving."""
        self._db.put(_SYNC, b"", sync=True)

    def set_membership(self, membership: bytes) -> None:
        """Record the bootstrap membership of a brand-new node."""
        self._db.put(_MEMBERSHIP, membership, sync=True)
        self._membership = membership

    def close(self) -> None:
        if self._db is not None and not self._db.closed:
            self._db.close()


EFFECT_MASK, EFFECT_DELETED = b"m", b"d"


def effect_record(cmd, result) -> bytes | None:
    """What an applied command changed, where the log does not say it: for a put, delete or
    transaction which of its mutations took effect, in the order of the log's rows
    (kv.logstream.entry_rows): EFFECT_MASK + one byte each, 1 or 0 (None when all did); for
    a lease's revoke, the keys it deleted: EFFECT_DELETED + a JSON list (None if none)."""
    if isinstance(cmd, LeaseRevoke):
        keys = result.keys if isinstance(result, LeaseRevoked) else ()
        return EFFECT_DELETED + json.dumps(list(keys)).encode() if keys else None
    if isinstance(cmd, Put):
        took = [isinstance(result, PutResult)]  # not a failed condition, nor an unknown lease
    elif isinstance(cmd, Delete):
        took = [isinstance(result, DeleteApplied) and result.deleted]
    elif isinstance(cmd, Txn) and isinstance(result, TxnApplied):
        took = []
        for branch, ops in txn_branches(cmd):
            ran = (branch == "else") != result.succeeded
            outcomes = iter(result.results if ran else ())
            for op in ops:
                r = next(outcomes, None)
                if type(op) is not Get:
                    took.append(ran and (type(op) is Put or r.deleted))
    else:
        return None
    return None if all(took) else EFFECT_MASK + bytes(took)


class LevelDBView:
    """A LevelDB snapshot: a consistent view while writes go on."""

    def __init__(self, snap, index: int, term: int, membership: bytes) -> None:
        self._snap = snap
        self.index, self.term, self.membership = index, term, membership

    def items(self) -> Iterator[tuple[bytes, bytes, int]]:
        unpack = _U64.unpack_from
        with self._snap.iterator(prefix=_DATA, verify_checksums=True) as it:
            for k, v in it:
                yield k[1:], v[8:], unpack(v)[0]

    def release(self) -> None:
        self._snap.close()
