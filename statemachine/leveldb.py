"""The KV state machine on LevelDB (plyvel).

Layout:

    b"\\x00applied"     index + term of the last applied entry (2 x u64, big-endian)
    b"\\x00membership"  the membership as of the applied index (from CONFIG entries)
    b"\\x00restoring"   present while a snapshot is being loaded: the state is incomplete
    b"k" + key         mod_index (u64) + value
    b"k\x00..."        reserved records: leases and the keys attached to them (leases.py)
    b"\\x00fx" + index  what that entry changed, when its log rows do not say (effect_record)
    b"\\x00effects_from" the first index with effect records (the watch history's floor)
    b"\\x00sessions_at"  the index as of which every client session's record is up to date
    b"k\\x00sess/..."      client sessions (sessions.py)

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

import contextlib
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
    IN_SESSION,
    SESSION_IDS,
    PUT_HEAD,
    SESSION_HEAD_BYTES,
    CommandError,
    Cond,
    Delete,
    DeleteApplied,
    DeletePrefix,
    Get,
    GetResult,
    LeaseGrant,
    LeaseInfo,
    LeaseRevoke,
    LeaseRevoked,
    NoSuchLease,
    ConditionFailed,
    Put,
    PrefixDeleted,
    PutResult,
    RequestMismatch,
    InSession,
    GetOmitted,
    SessionExpired,
    SessionOpen,
    SessionOpened,
    SessionsExpire,
    StaleRequest,
    Txn,
    TxnApplied,
    decode,
    decode_result,
    encode_result,
    txn_branches,
)
from .lease_table import ATTACH_RECORD, RESERVED, LeaseTable, lease_record
from .sessions import RESULT_AT, SESSION_RESULT_MAX, SessionTable, fingerprint, record_value, session_record

_APPLIED = b"\x00applied"
_MEMBERSHIP = b"\x00membership"
_RESTORING = b"\x00restoring"
_SYNC = b"\x00sync"
_REMOVED = b"\x00removed"  # ids removed from the cluster (JSON list): their peers are refused
_EFFECTS = b"\x00fx"
_EFFECTS_FROM = b"\x00effects_from"
_SESSIONS_AT = b"\x00sessions_at"  # every session record is up to date as of this index
_DATA = b"k"
_USER_DATA = _DATA + b"\x01"  # where user keys start: the reserved ones sort before
_TWO_U64 = struct.Struct(">QQ")
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
            self.leases = LeaseTable()
            self.sessions = SessionTable()
            self._load_reserved()
        except plyvel.Error as e:
            if getattr(self, "_db", None) is not None:
                self._db.close()
            if isinstance(e, plyvel.IOError) and "lock" in str(e).lower():
                raise StateLocked(f"the state machine in {path} is open in another process ({e})") from e
            raise StateCorrupt(f"the state machine in {path} cannot be opened ({e})") from e
        self._applied = _TWO_U64.unpack(raw) if raw else (0, 0)
        self._membership = self._db.get(_MEMBERSHIP) or b""
        self._removed = set(json.loads(self._db.get(_REMOVED) or b"[]"))
        raw_from = self._db.get(_EFFECTS_FROM)
        if raw_from is None:  # a new state, or one from a version that kept no records
            raw_from = _U64.pack(self._applied[0] + 1)
            self._db.put(_EFFECTS_FROM, raw_from)
        self.effects_from = _U64.unpack(raw_from)[0]
        raw_at = self._db.get(_SESSIONS_AT)
        if raw_at is None:  # a new state, or one from a version without sessions: none to replay
            raw_at = _U64.pack(self._applied[0])
            self._db.put(_SESSIONS_AT, raw_at)
        self.sessions_at = _U64.unpack(raw_at)[0]
        self.copies = 0  # session requests applied again and answered with the first one's result
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

    def scan(self, prefix: str = "", after: str | None = None, limit: int = 1000, max_bytes: int | None = None) -> list[tuple[str, bytes, int]]:
        """Keys with the prefix, in key order, strictly after `after`: (key, value, mod_index);
        at most `limit`, and no more once their keys and values add up to `max_bytes`
        (the one that reaches it included, so a page always holds a key when one is left)."""
        pre = _DATA + prefix.encode()
        start = _DATA + after.encode() + b"\x00" if after is not None else pre
        out = []
        left = max_bytes if max_bytes is not None else float("inf")
        it = self._db.iterator(start=max(start, pre, _USER_DATA), prefix=None, verify_checksums=True)
        try:
            for k, v in it:
                if not k.startswith(pre):
                    break
                out.append((k[1:].decode(), v[8:], _U64.unpack_from(v)[0]))
                left -= len(k) + len(v) - 9
                if len(out) >= limit or left <= 0:
                    break
        except plyvel.CorruptionError as e:
            raise self._damaged(e) from e
        finally:
            it.close()
        return out

    def count(self) -> int:
        with self._db.iterator(start=_USER_DATA, stop=_DATA + b"\xff" * 8, include_value=False) as it:
            return sum(1 for k in it if k.startswith(_DATA))

    def _load_reserved(self) -> None:
        """The lease and session tables, from their records."""
        with self._db.iterator(prefix=_DATA + RESERVED, verify_checksums=True) as it:
            records = [(k[1:], _U64.unpack_from(v)[0], v[8:]) for k, v in it]
        self.leases.load((k, v) for k, _, v in records)
        self.sessions.load(records)

    def lease_info(self, lease: int) -> LeaseInfo | None:
        """A lease as applied here (remaining: the full ttl; only the leader's clock knows
        better), or None."""
        ttl = self.leases.ttl_ms.get(lease)
        return None if ttl is None else LeaseInfo(lease, ttl, ttl, tuple(sorted(self.leases.keys[lease])))

    # -- applying --------------------------------------------------------------------------

    def apply(self, entries: Sequence[Entry], answering: Container[int] | None = None) -> list[Any]:
        """Apply entries; a transaction's gets are read only for the indexes in `answering`
        (those whose result someone waits for here; None: every entry) or sent in a session
        (whose result every replica keeps). Gets change nothing, so the other replicas skip
        them and never build a reply nobody reads."""
        wb = self._db.write_batch()
        overlay: dict[bytes, tuple[int, bytes] | None] = {}  # this batch's writes, by raw key
        changes: list[Change] | None = [] if self.on_changes is not None else None
        results: list[Any] = []
        put_kind = EntryKind.NORMAL
        pack = _U64.pack
        attached = self.leases.attached
        sessions = self.sessions.last
        for e in entries:
            if e.kind != put_kind:
                if e.kind == EntryKind.CONFIG:
                    self._apply_config(e.data, wb)
                results.append(None)
                continue
            d = e.data
            session = o = 0  # o: where the command starts (after a session's header)
            if d[:2] == IN_SESSION and len(d) >= SESSION_HEAD_BYTES:
                session, seq = SESSION_IDS.unpack_from(d, 2)
                s = sessions.get(session)
                if s is None or seq <= s[0]:
                    results.append(self._not_again(e, session, seq, s, wb, overlay))
                    continue
                o = SESSION_HEAD_BYTES
                fp = fingerprint(d, o)
            result = None
            if d[o : o + 2] == PUT_HEAD and len(d) > o + 4:
                # The hot path, an unconditional put, read straight from the encoding:
                # version, opcode, key length, key, no condition, value.
                end = o + 4 + ((d[o + 2] << 8) | d[o + 3])
                if len(d) > end and d[end] == 0:
                    raw = d[o + 4 : end]
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
                        result = PutResult(e.index)
                        if session:  # its answer is PutResult(this index): the record can wait (sessions.py)
                            s = sessions.pop(session)
                            s[0], s[1], s[2], s[3] = seq, e.index, False, fp
                            sessions[session] = s
                            self.sessions.dirty.add(session)
                            results.append(result)
                            continue
            if result is None:
                try:
                    cmd = decode(d[o:] if o else d)
                except CommandError as err:
                    results.append(err)  # deterministic: every replica rejects it alike
                    continue
                if type(cmd) is Txn:
                    result = self._txn(cmd, e.index, wb, overlay, changes, answering is None or session or e.index in answering)
                else:
                    result = self._execute(cmd, e.index, wb, overlay, changes)
                took = effect_record(cmd, result)
                if took is not None:
                    wb.put(_EFFECTS + pack(e.index), took)
            if session:
                self._answered(session, seq, fp, e.index, result, wb, overlay)
            results.append(result)
        if entries:
            last = entries[-1]
            wb.put(_APPLIED, _TWO_U64.pack(last.index, last.term))
            self._applied = (last.index, last.term)
        wb.write()
        if changes:
            self.on_changes(changes)
        return results

    # -- sessions (sessions.py) ------------------------------------------------------------

    def _answered(self, session: int, seq: int, fp: int, index: int, result, wb, overlay: dict) -> None:
        """Keep request `seq`'s result, the answer to any copy of it."""
        if type(result) is PutResult:
            encoded = b"P" + _U64.pack(result.index)
        else:
            encoded = encode_result(result)
            if len(encoded) > SESSION_RESULT_MAX and type(result) is TxnApplied:  # its gets: a copy is answered without them
                kept = tuple(GetOmitted(r.key) if type(r) is GetResult else r for r in result.results)
                encoded = encode_result(result._replace(results=kept))
        table = self.sessions.last
        s = table.pop(session)  # to the end: the most recently used
        s[0], s[1], s[2], s[3] = seq, index, True, fp
        table[session] = s
        self.sessions.dirty.discard(session)
        k = _DATA + session_record(session)
        v = record_value(seq, fp, encoded)
        overlay[k] = (index, v)
        wb.put(k, _U64.pack(index) + v)

    def _not_again(self, e: Entry, session: int, seq: int, s: list[int] | None, wb, overlay: dict):
        """A write in a session that is not open, or a copy of one applied already: the
        first one's result, or why it is refused. Nothing is applied; the effect record
        says so (the ledger holds the copy's mutations)."""
        if s is None:
            result = SessionExpired(session)
        elif seq < s[0]:
            result = StaleRequest(session, seq, s[0])
        elif seq == 0:  # never sent by ledgerkv (in_session refuses it): no result to repeat
            return CommandError("a request's sequence number starts at 1")
        elif fingerprint(e.data, SESSION_HEAD_BYTES) != s[3]:
            result = RequestMismatch(session, seq)
        else:
            if s[2]:
                kept = self._current(_DATA + session_record(session), overlay)
                result = decode_result(kept[1][RESULT_AT:])
            else:  # a plain put, whose record waits for the next flush
                result = PutResult(s[1])
            self.copies += 1
        try:
            took = effect_record(decode(e.data).cmd, None)
        except CommandError:
            took = None  # nothing to mark: its mutations cannot be read either
        if took is not None:
            wb.put(_EFFECTS + _U64.pack(e.index), took)
        return result

    def flush_sessions(self, wb=None) -> None:
        """Write the records that plain puts left waiting, and note that every record is up
        to date as of the applied index (`sessions_at`): a restart replays the session
        headers of the ledger's entries after it (replay_sessions)."""
        own = wb is None
        wb = wb if wb is not None else self._db.write_batch()
        table = self.sessions.last
        for session in self.sessions.dirty:
            seq, used, _, fp = s = table[session]
            wb.put(_DATA + session_record(session), _U64.pack(used) + record_value(seq, fp, b"P" + _U64.pack(used)))
            s[2] = True
        self.sessions.dirty.clear()
        self.sessions_at = self._applied[0]
        wb.put(_SESSIONS_AT, _U64.pack(self.sessions_at))
        if own:
            wb.write()

    def replay_sessions(self, entries: Sequence[Entry]) -> None:
        """After a restart: what the plain puts of these entries (after sessions_at, up to the
        applied index) did to their sessions, which their records do not say yet."""
        self.sessions.replay(entries)

    def _open_session(self, cmd: SessionOpen, index: int, wb) -> SessionOpened:
        for gone in self.sessions.open(cmd.session, index, cmd.max_sessions):
            wb.delete(_DATA + session_record(gone))
        if self.sessions.last[cmd.session][1] == index:  # new (opening it again changes nothing)
            wb.put(_DATA + session_record(cmd.session), _U64.pack(index) + record_value(0, 0, b""))
        return SessionOpened(cmd.session)

    def _expire_sessions(self, upto: int, wb) -> None:
        for gone in self.sessions.expire(upto):
            wb.delete(_DATA + session_record(gone))

    def open_sessions(self) -> int:
        return len(self.sessions)

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

    def _execute(self, cmd, index: int, wb, overlay: dict, changes: list | None):
        if isinstance(cmd, Put):
            if cmd.lease and cmd.lease not in self.leases.ttl_ms:
                return NoSuchLease(cmd.lease)
            return self._check(cmd.cond, overlay) or self._put(cmd, index, wb, overlay, changes)
        if isinstance(cmd, LeaseGrant):
            lease = cmd.lease or index
            if lease in self.leases.ttl_ms:  # a random id taken (the node draws another)
                return CommandError(f"lease id {lease} is in use")
            rec, payload = self.leases.grant(lease, cmd.ttl_ms, cmd.owner)
            wb.put(_DATA + rec, _U64.pack(index) + payload)
            return LeaseInfo(lease, cmd.ttl_ms, cmd.ttl_ms)
        if isinstance(cmd, LeaseRevoke):
            return self._revoke(cmd.lease, index, wb, overlay, changes)
        if isinstance(cmd, SessionOpen):
            return self._open_session(cmd, index, wb)
        if isinstance(cmd, SessionsExpire):
            return self._expire_sessions(cmd.upto, wb)
        if isinstance(cmd, InSession):  # ledgerkv never sends one (in_session refuses it)
            return CommandError("a session's request carries a session's request")
        if isinstance(cmd, Delete):
            return self._check(cmd.cond, overlay) or self._delete(cmd, index, wb, overlay, changes)
        if isinstance(cmd, DeletePrefix):
            return self._delete_prefix(cmd.prefix, index, wb, overlay, changes)
        raise CommandError(f"unknown command {cmd!r}")

    def _delete_prefix(self, prefix: str, index: int, wb, overlay: dict, changes: list | None) -> PrefixDeleted:
        """Every key under the prefix, as this batch leaves them (its own earlier writes
        included), deleted at this index; watchers see a delete per key."""
        pre = _DATA + prefix.encode()
        keys = set()
        with self._db.iterator(start=max(pre, _USER_DATA), prefix=None, include_value=False) as it:
            for k in it:
                if not k.startswith(pre):
                    break
                keys.add(k)
        keys |= {k for k, v in overlay.items() if v is not None and k.startswith(pre) and k >= _USER_DATA}
        deleted = []
        for k in sorted(keys):
            if self._current(k, overlay) is None:
                continue
            key = k[1:].decode()
            self._delete(Delete(key), index, wb, overlay, changes)
            deleted.append(key)
        return PrefixDeleted(index, tuple(deleted))

    def _txn(self, cmd: Txn, index: int, wb, overlay: dict, changes: list | None, reads: bool) -> TxnApplied:
        """Run a transaction. Its gets are read if `reads` (else None), up to the read budget
        (GetOmitted beyond it: the writes still go on)."""
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
                if budget < 0:
                    out.append(GetOmitted(op.key))
                    continue
                cur = self._current(_DATA + op.key.encode(), overlay)
                budget -= len(cur[1]) if cur else 0
                out.append(GetResult(op.key, cur[1] if cur else None, cur[0] if cur else 0) if budget >= 0 else GetOmitted(op.key))
            else:
                out.append(self._delete(op, index, wb, overlay, changes))
        return TxnApplied(index, ok, tuple(out))

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
        self.flush_sessions()  # the snapshot carries every session as of its index
        return LevelDBView(self._db.snapshot(), *self._applied, self.membership())

    def restore(self, index: int, term: int, membership: bytes, items: Iterator[tuple[bytes, bytes, int]]) -> int:
        """Replace everything with a snapshot's records; returns how many user keys were
        loaded (besides ledgerkv's own records). A marker makes a crash in the middle
        visible at the next start (`incomplete`)."""
        self._db.put(_RESTORING, b"1", sync=True)
        self._db.close()
        shutil.rmtree(self.path)
        os.makedirs(self.path)
        self._db = plyvel.DB(self.path, create_if_missing=True, paranoid_checks=True)
        self._db.put(_RESTORING, b"1", sync=True)
        n = own = 0
        wb = self._db.write_batch()
        pack = _U64.pack
        for key, value, mod in items:
            wb.put(_DATA + key, pack(mod) + value)
            n += 1
            if key[:1] == RESERVED:
                own += 1
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
        fin.put(_SESSIONS_AT, _U64.pack(index))
        self.sessions_at = index
        fin.write()
        self._applied = (index, term)
        self.incomplete = False
        self._load_reserved()
        return n - own

    def reopen(self) -> None:
        """Open the database again, from disk: after a failed write (a full disk) LevelDB
        refuses every later one until then. What the failed batch changed in this object's
        tables is read back from disk, where none of it went."""
        on_changes, copies = self.on_changes, self.copies
        if self._db is not None and not self._db.closed:
            self._db.close()
        self.__init__(self.path, max_read_bytes=self.max_read_bytes)
        self.on_changes, self.copies = on_changes, copies

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
            if not self.incomplete:
                with contextlib.suppress(plyvel.Error):  # a full disk: the restart replays them instead
                    self.flush_sessions()  # a restart then has nothing to replay
            self._db.close()


EFFECT_MASK, EFFECT_DELETED = b"m", b"d"


def effect_record(cmd, result) -> bytes | None:
    """What an applied command changed, where the log does not say it: for a put, delete or
    transaction which of its mutations took effect, in the order of the log's rows
    (kv.common.entry_stream.entry_rows): EFFECT_MASK + one byte each, 1 or 0 (None when all did); for
    a lease's revoke or a prefix's delete, the keys it deleted: EFFECT_DELETED + a JSON list
    (None if none)."""
    if isinstance(cmd, (LeaseRevoke, DeletePrefix)):
        keys = result.keys if isinstance(result, (LeaseRevoked, PrefixDeleted)) else ()
        return EFFECT_DELETED + json.dumps(list(keys)).encode() if keys else None
    if isinstance(cmd, Put):
        took = [isinstance(result, PutResult)]  # not a failed condition, nor an unknown lease
    elif isinstance(cmd, Delete):
        took = [isinstance(result, DeleteApplied) and result.deleted]
    elif isinstance(cmd, Txn):
        if not isinstance(result, TxnApplied):  # refused (a session's copy): nothing took effect
            n = sum(type(op) is not Get for _, ops in txn_branches(cmd) for op in ops)
            return EFFECT_MASK + bytes(n) if n else None
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
