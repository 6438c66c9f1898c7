"""The KV state machine on LevelDB (plyvel).

Layout:

    b"\\x00applied"     index + term of the last applied entry (2 x u64, big-endian)
    b"\\x00membership"  the membership as of the applied index (from CONFIG entries)
    b"\\x00membership_at"  the index of the entry (or snapshot) it came from, u64 (none: 0);
                       a node that joined: of the committed one the leader gave it, above
                       the older CONFIG entries it applies next (passed over)
    b"\\x00restoring"   present while a snapshot is being loaded: the state is incomplete
    b"\\x00state_format"  the layout's version (STATE_FORMAT; none: 1, before 2026-11-29)
    b"k" + key         mod_index (u64) + value: a key's first version (created at its mod_index,
                       version 1); or, once it has changed, mod_index with its top bit set
                       (STAMPED) + create_revision (u64) + version (u64) + value: what etcd's
                       v3 API reports, read with the value in one get
    b"k\x00..."        reserved records: leases and the keys attached to them (leases.py)
    b"k\x00compact"    the compact revision (etcd's Compact), after the usual mod_index
    b"k\x00cluster_id" the cluster's identity (ClusterId, or set by a restore), after the usual mod_index
    b"k\x00alarm/" + member (16 hex digits) + "/" + alarm   a raised alarm (etcd's AlarmMember)
    b"k\x00meta/" + key  create_revision (u64) + version (u64) of a key, after the usual
                       mod_index: where earlier versions kept them, and where snapshots still
                       do (LevelDBView.blocks writes them, so every version reads them). A
                       state that has them folds them into the keys' records when it opens
                       or is restored (_fold_meta_records).
    b"k\x00hist/...", b"k\x00hrev/..."  the history: every key's earlier versions (history.py)
    b"k\x00hfrom"      the first revision whose changes the history holds (after the usual mod_index)
    b"\\x00sessions_at"  the index as of which every client session's record is up to date
    b"k\\x00sess/..."      client sessions (sessions.py)

Every applied batch is one WriteBatch that also moves the applied index, so a crash never
applies an entry twice or skips one: on restart the node replays the ledger from the
applied index. Writes are not fsynced one by one (the ledger is the durable record and
replays them); `sync()` makes everything durable before the ledger is compacted.
"""

from __future__ import annotations

import bisect
import contextlib
import heapq
import itertools
import json
import logging
import operator
import os
import shutil
import struct
import sys
from array import array
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from typing import Any

import plyvel

from ..raft.disk import is_disk_full
from ..raft.errors import KVError, NoSpace
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
    read_bytes,
    StaleRequest,
    Txn,
    TxnApplied,
    ALARM_NOSPACE,
    AlarmSet,
    ClusterId,
    Bulk,
    BulkApplied,
    Compact,
    CompactAnswer,
    Alarms,
    SpaceExceeded,
    adds_data,
    decode,
    decode_result,
    encode_result,
    DeleteRangeReq,
    DeleteRangeResp,
    KeyNotFound,
    KeyValue,
    PutReq,
    PutResp,
    RangeReq,
    RangeResp,
    TxnReq,
    TxnResp,
    compare_holds,
    in_range,
    key_bytes,
    key_text,
    prefix_end,
)
from . import history
from .rows import ANY, pack_columns
from .lease_table import ATTACH_RECORD, RESERVED, LeaseTable, lease_record
from .sessions import RESULT_AT, SESSION_RESULT_MAX, SessionTable, fingerprint, owner_record, record_value, session_record

log = logging.getLogger("kv.statemachine")

_APPLIED = b"\x00applied"
_MEMBERSHIP = b"\x00membership"
_MEMBERSHIP_AT = b"\x00membership_at"
_RESTORING = b"\x00restoring"
_SYNC = b"\x00sync"
_REMOVED = b"\x00removed"  # ids removed from the cluster (JSON list): their peers are refused
_EFFECTS = b"\x00fx"  # what entries changed, kept by versions before the history: dropped at open
_EFFECTS_FROM = b"\x00effects_from"
_SESSIONS_AT = b"\x00sessions_at"  # every session record is up to date as of this index
_STATE_FORMAT = b"\x00state_format"  # STATE_FORMAT, as a decimal number (none: 1)
STATE_FORMAT = 2  # 2: a changed key's create_revision and version are in its record (1: meta records)
_DATA = b"k"
_DATA_END = b"l"  # the first key after every data record
_USER_DATA = _DATA + b"\x01"  # where user keys start: the reserved ones sort before
_META = _DATA + RESERVED + b"meta/"  # + key: its create_revision and version
_META_END = _DATA + RESERVED + b"meta0"  # ("0" follows "/")
_META_VALUE = struct.Struct(">QQ")
STAMPED = 1 << 63  # in a user key's mod_index: create_revision and version follow it
_STAMP = struct.Struct(">QQQ")  # mod_index | STAMPED, create_revision, version
_NO_STAMP = bytes(range(128)) * 2  # bytes.translate table: a byte without its top bit
_FOLD_BATCH = 10_000
_HELD_MAX = 1 << 18  # meta records a restore holds in memory until their keys' records come
_UNREAD = object()  # (_write: the caller has not read the key)
_SPLIT_SAMPLE = 4096  # keys user_key_splits keeps at least (of those it visits), to cut among
_SPLIT_BYTES = 8 << 20  # below this estimate of a range's files, user_key_splits counts its keys
_CUT_BYTES = 24  # how finely a cut by estimate places itself: the bytes past a range's shared prefix
_ALARM = RESERVED + b"alarm/"
_COMPACT = RESERVED + b"compact"
_CLUSTER_ID = RESERVED + b"cluster_id"
_HISTORY_END = history.CHANGES[:-1] + b"0"  # the first key after both history ranges
_TWO_U64 = struct.Struct(">QQ")
_U64 = struct.Struct(">Q")
_RESTORE_BATCH = 10_000
# The user records the last applied batches wrote, kept in memory (LevelDBStateMachine._recent)
# up to about this many bytes a generation, two generations: 16 MiB at most, kept while idle.
RECENT_BYTES = 8 << 20
_RECENT_ENTRY = 256  # what an entry costs besides its key and value (dict slot, key object, tuple, ints)

# A change event for watchers: (index, key, value or None for a delete, mod_index).
Change = tuple[int, str, bytes | None]


def _member_ids(membership: bytes) -> set[str]:
    """The ids of an encoded membership (raft.membership.Membership.encode)."""
    return {m["id"] for m in json.loads(membership or b"[]")}


def _put_membership(wb, membership: bytes, index: int, removed: set[str]) -> None:
    """The membership records: the membership, the index it came from, the removed ids."""
    wb.put(_MEMBERSHIP, membership)
    wb.put(_MEMBERSHIP_AT, _U64.pack(index))
    wb.put(_REMOVED, json.dumps(sorted(removed)).encode())


class StateUnreadable(KVError):
    """The state machine cannot be read here now (kv.Node answers kv.Unavailable: read from
    another member meanwhile)."""


class StateLoading(StateUnreadable):
    """The node is loading a snapshot into its state machine (it fell behind the leader's
    ledger): retry in a moment, or ask another node."""

    code, http_status = "UNAVAILABLE", 503


class _Loading:
    """The database while a snapshot is loaded into a new one: every use is refused (from
    any thread) rather than reaching the closed LevelDB or the half-loaded one."""

    closed = True

    def __getattr__(self, name: str):
        raise StateLoading("this node is loading a snapshot into its state machine: retry in a moment")


_LOADING = _Loading()


class StateCorrupt(StateUnreadable):
    """The state directory is incomplete or unreadable."""


class StateLocked(KVError):
    """LevelDB's own lock is held by another opener: the directory is in use, not damaged."""


class StateTooNew(KVError):
    """The state directory was written by a later ledgerkv, in a layout this one does not read."""


class StateUpgradeFailed(KVError):
    """Bringing a state directory written by an earlier ledgerkv to this one's layout failed
    (a full disk, say); it is not damaged: start again once the cause is gone."""


DAMAGED_MARKER = "DAMAGED"  # written into the state dir when a read finds corruption


def _open(path: str):
    # The bloom filter answers "no such key" without reading a table: every put reads the
    # key's record, which a new key does not have. A 16 MiB memtable (LevelDB's default is
    # 4) flushes a quarter as often: an update writes three records (the value with its
    # version, two history records), and with 4 MiB an import of 336k rows
    # spent half of its CPU in compactions (22 µs a row applied, 11 with 16 MiB). It costs
    # at most twice that in memory (the memtable and the one being flushed).
    # No compression (LevelDB's default is Snappy), as etcd's bbolt: compactions rewrite
    # every record several times, and compressing each time took three times the CPU of the
    # rest of the compaction (an import of 336k JSON rows: 3 s of compaction a node with
    # Snappy, 0.9 s without, and an import 20-25 % faster) for 2.4x less disk (54 MB of
    # state a node instead of 130 MB; the Raft log holds the same data uncompressed until
    # it is compacted). Files written with Snappy by an earlier version are read as before.
    return plyvel.DB(path, create_if_missing=True, paranoid_checks=True, bloom_filter_bits=10, write_buffer_size=16 << 20, compression=None)


def _bounds(key: bytes, end: bytes) -> tuple[bytes, bytes]:
    """The records of etcd's range (key, end), end not empty: [lo, hi)."""
    return max(_DATA + key, _USER_DATA), _DATA_END if end == b"\x00" else _DATA + end


def _record(raw: bytes) -> tuple[int, bytes, int, int]:
    """A data record as (mod_index, value, create_revision, version)."""
    if raw[0] < 0x80:
        mod = _U64.unpack_from(raw)[0]
        return mod, raw[8:], mod, 1
    mod, create, version = _STAMP.unpack_from(raw)
    return mod - STAMPED, raw[24:], create, version


def _stamped(mod: int, create: int, version: int, value: bytes) -> bytes:
    """The record of a key that has changed since its creation (the layout at the top)."""
    return _STAMP.pack(mod | STAMPED, create, version) + value


def _values_and_mods(records_values: list[bytes]) -> tuple[list[bytes], bytes]:
    """The values of user keys' records, and their mod_indexes (u64 big-endian, joined),
    without a key's create_revision and version: C loops when no record has them."""
    heads = b"".join(map(_VALUE_HEAD, records_values))
    tops = heads[::8]
    if not tops or max(tops) < 0x80:
        return list(map(_VALUE_TAIL, records_values)), heads
    stamped = bytearray(heads)
    stamped[::8] = tops.translate(_NO_STAMP)
    return [v[24:] if v[0] >= 0x80 else v[8:] for v in records_values], bytes(stamped)


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
            self._db = _open(path)
            raw = self._db.get(_APPLIED, verify_checksums=True)
            self.incomplete = self._db.get(_RESTORING, verify_checksums=True) is not None
            self.leases = LeaseTable()
            self.sessions = SessionTable()
            self._load_reserved()
            layout = int(self._db.get(_STATE_FORMAT) or b"1")
        except plyvel.Error as e:
            if getattr(self, "_db", None) is not None:
                self._db.close()
            if isinstance(e, plyvel.IOError) and "lock" in str(e).lower():
                raise StateLocked(f"the state machine in {path} is open in another process ({e})") from e
            if is_disk_full(e, path):  # (not damage: it was moved aside as such, and its copy kept on the full disk)
                raise NoSpace(f"the state machine in {path} cannot be opened: its disk is full ({e}). Free space on it and start the node again; nothing is lost") from e
            raise StateCorrupt(f"the state machine in {path} cannot be opened ({e})") from e
        if layout > STATE_FORMAT:
            self._db.close()
            raise StateTooNew(
                f"the state machine in {path} was written by a later ledgerkv (state format {layout}; this one reads "
                f"up to {STATE_FORMAT}): run that version or a later one (docs/design.md, Upgrades)"
            )
        if layout < STATE_FORMAT and not self.incomplete:
            self._upgrade_layout()
        self._applied = _TWO_U64.unpack(raw) if raw else (0, 0)
        if self.history_from is None and not self.incomplete:
            self._start_history(self._db, self._applied[0] + 1)
        self._changes_at = self._changes_n = 0  # the entry whose changes _keep lists, and how many so far
        self._forget_recent()
        self._purge_from = history.CHANGES  # where purge_history goes on from
        self.purged_below = 0  # every history record below this revision is gone (as far as this process knows)
        if not hasattr(self, "purged"):  # (kept across reopen: a counter)
            self.purged = 0  # changes whose history records purge_history dropped
        self._membership = self._db.get(_MEMBERSHIP) or b""
        raw_at = self._db.get(_MEMBERSHIP_AT)
        self.membership_index = _U64.unpack(raw_at)[0] if raw_at else 0
        self._removed = set(json.loads(self._db.get(_REMOVED) or b"[]"))
        if self._db.get(_EFFECTS_FROM) is not None:
            self._drop_effect_records()
        raw_at = self._db.get(_SESSIONS_AT)
        if raw_at is None:  # a new state, or one from a version without sessions: none to replay
            raw_at = _U64.pack(self._applied[0])
            self._db.put(_SESSIONS_AT, raw_at)
        self.sessions_at = _U64.unpack(raw_at)[0]
        self.copies = 0  # session requests applied again and answered with the first one's result
        # Called with the changes of each applied batch, when someone watches.
        self.on_changes: Callable[[list[Change]], None] | None = None
        # Changes carry the key before and after (etcd's watchers want them): Change + (KeyValue, KeyValue or None).
        self.rich_changes = False

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
            raw = self._db.get(_DATA + key_bytes(key), verify_checksums=True)
        except plyvel.CorruptionError as e:
            raise self._damaged(e) from e
        if raw is None:
            return None
        mod, value, _, _ = _record(raw)
        return mod, value

    def scan(
        self, prefix: str = "", after: str | None = None, limit: int = 1000, max_bytes: int | None = None, revision: int | None = None
    ) -> list[tuple[str, bytes, int]]:
        """Keys with the prefix, in key order, strictly after `after`: (key, value, mod_index);
        at most `limit`, and no more once their keys and values add up to `max_bytes`
        (the one that reaches it included, so a page always holds a key when one is left).
        `revision`: as of that revision (see oldest_revision), not as of now."""
        if revision is not None:
            pre = key_bytes(prefix)
            start = key_bytes(after) + b"\x00" if after is not None else pre
            items = ((kv.key, kv.value, kv.mod_revision) for _, kv in self._items_at(max(start, pre), prefix_end(pre), revision))
        else:
            items = self._scan_now(prefix, after)
        out = []
        left = max_bytes if max_bytes is not None else float("inf")
        for item in items:
            out.append(item)
            left -= len(item[0]) + len(item[1])
            if len(out) >= limit or left <= 0:
                break
        return out

    def _page_records(self, prefix: str, after: str | None):
        """An iterator over the data records of the user keys with the prefix, strictly
        after `after`, in key order (close it)."""
        pre = _DATA + key_bytes(prefix)
        start = _DATA + key_bytes(after) + b"\x00" if after is not None else pre
        return self._db.iterator(start=max(start, pre, _USER_DATA), stop=prefix_end(pre), verify_checksums=True)

    def _scan_now(self, prefix: str, after: str | None) -> Iterator[tuple[str, bytes, int]]:
        it = self._page_records(prefix, after)
        try:
            for k, v in it:
                mod, value, _, _ = _record(v)
                yield key_text(k[1:]), value, mod
        except plyvel.CorruptionError as e:
            raise self._damaged(e) from e
        finally:
            it.close()

    def scan_rows(self, prefix: str, after: str | None, limit: int, max_bytes: int) -> tuple[bytes, int, int, bool]:
        """scan's page as of now in the bulk format (rows.py; each key's mod_index in the
        condition column), built by C loops from the records as LevelDB gives them, not
        through a Python object per row (a third of the CPU of scan's tuples then packed):
        (body, rows, their keys' and values' bytes, whether more keys follow or the page was
        cut at max_bytes)."""
        records_keys: list[bytes] = []
        records_values: list[bytes] = []
        size = 0
        more = False
        it = self._page_records(prefix, after)
        try:
            for k, v in it:
                records_keys.append(k)
                records_values.append(v)
                size += len(k) + len(v) - len(_DATA) - (_U64.size if v[0] < 0x80 else _STAMP.size)
                if size >= max_bytes:
                    more = True
                    break
                if len(records_keys) >= limit:
                    more = next(it, None) is not None
                    break
        except plyvel.CorruptionError as e:
            raise self._damaged(e) from e
        finally:
            it.close()
        values, mods = _values_and_mods(records_values)
        body = pack_columns(list(map(_KEY_TAIL, records_keys)), values, mods)
        return body, len(records_keys), size, more

    # -- the history (history.py) -----------------------------------------------------------

    def _start_history(self, target, revision: int) -> None:
        # (its mod_index: the last applied entry's, as every record's is at most that)
        target.put(_DATA + history.HISTORY_FROM, _U64.pack(max(revision - 1, 1)) + _U64.pack(revision))
        self.history_from = revision

    def oldest_revision(self) -> int:
        """The oldest revision a read can be at: the last Compact's, or the one before the
        history began (a data dir from before it)."""
        return max(self.compact_revision, self.history_from - 1)

    def get_at(self, key: str, revision: int) -> tuple[int, bytes] | None:
        """(mod_index, value) of a key as of a revision (see oldest_revision), or None."""
        kv = self._key_at(key_bytes(key), revision)
        return None if kv is None else (kv.mod_revision, kv.value)

    def _key_at(self, raw: bytes, revision: int, cur=_UNREAD) -> KeyValue | None:
        """The key as of `revision` (cur: its record, _current's, if read). A key not
        changed since is its record, without a seek for a history record after the
        revision: one that finds none goes on past the key's records, over whatever a
        compaction's purge deleted after them (LevelDB's iterators stop only at a live
        record; milliseconds a key after a large purge)."""
        if cur is _UNREAD:
            cur = self._current(_DATA + raw, {})
        if cur is not None and cur[0] <= revision:
            return self._kv(raw, cur)
        return self._as_of(raw, self._at(raw, revision), revision, cur)

    def _at(self, raw: bytes, revision: int) -> history.Past:
        try:
            return history.at(self._db, raw, revision)
        except plyvel.CorruptionError as e:
            raise self._damaged(e) from e

    def _as_of(self, raw: bytes, past: history.Past, revision: int, cur=_UNREAD) -> KeyValue | None:
        """The key as of `revision`: what a history record after it says, or, when the
        history has none (nothing changed it since), its current record (`cur`, if read
        already); none when that version was created after the revision (its creation kept
        no record: history.py)."""
        if past.found:
            kv = past.kv
        else:
            if cur is _UNREAD:
                cur = self._current(_DATA + raw, {})
            kv = self._kv(raw, cur) if cur is not None else None
        return kv if kv is not None and kv.create_revision <= revision else None

    def _items_at(self, key: bytes, end: bytes, revision: int) -> Iterator[tuple[bytes, KeyValue]]:
        """(raw key, KeyValue) of every key of etcd's range (key, end) as of a revision, in
        key order: the keys there now and the keys with history, merged."""
        if not end:
            keys = iter(((key, _UNREAD),)) if key[:1] > RESERVED else iter(())
        else:
            now = self._range_items(key, end, {})
            had = ((raw, _UNREAD) for raw in history.keys_between(self._db, max(key, b"\x01"), None if end == b"\x00" else end))
            keys = heapq.merge(now, had, key=lambda item: item[0])
        last = None
        for raw, cur in keys:
            if raw == last:
                continue
            last = raw
            kv = self._key_at(raw, revision, cur)
            if kv is not None:
                yield raw, kv

    def watch_floor(self) -> int:
        """The oldest revision whose changes the history still holds."""
        return max(self.compact_revision, self.history_from)

    def history_changes(self, start: int, prefix: str, max_changes: int) -> tuple[list[tuple[int, str, bytes | None, KeyValue, KeyValue | None]], int]:
        """The changes under prefix of revisions from start on, in order, as rich changes
        (index, key, value or None, the key after, the key before or None), from about
        max_changes of every key's; and the revision to go on from (the applied index + 1
        once they are all read)."""
        upto = self._applied[0]
        listed = history.changes_from(self._db, start, upto, max_changes)
        after = listed[-1][0] + 1 if len(listed) >= max_changes else upto + 1
        pre = key_bytes(prefix)
        complete = len(listed) < max_changes  # every change up to the applied index is listed
        last = {raw: (rev, n) for rev, n, raw in listed}  # each key's last change listed
        out = []
        for rev, n, raw in listed:
            if not raw.startswith(pre):
                continue
            key = key_text(raw)
            if last[raw] == (rev, n):
                # The key's last change of its revision (a revision's changes are all listed)
                # left the key as of that revision, which _key_at finds without a seek when
                # nothing changed the key since; a key gone after its last change listed,
                # with every change up to the applied index listed, was deleted by it (a
                # seek for what it left would find nothing, after a purge slowly).
                prev = history.prev_of(self._db, raw, rev, n)
                cur = self._current(_DATA + raw, {})
                kv = None if cur is None and complete else self._key_at(raw, rev, cur)
            else:
                prev, then = history.change_of(self._db, raw, rev, n)
                kv = self._as_of(raw, then, rev)
            if kv is None:
                out.append((rev, key, None, KeyValue(key, 0, rev, 0, b"", 0), prev))
            else:
                out.append((rev, key, kv.value, kv, prev))
        return out, after

    def purge_history(self, max_changes: int = 10_000) -> int:
        """Drop up to max_changes changes' history records below the compact revision (no
        read can reach them), going on from where the last call stopped; returns how many
        went (0: none are left)."""
        below = self.compact_revision
        n, self._purge_from = history.purge(self._db, self._purge_from, below, max_changes)
        self.purged += n
        if n < max_changes:
            self.purged_below = below
        return n

    def count(self) -> int:
        with self._db.iterator(start=_USER_DATA, stop=_DATA_END, include_value=False) as it:
            return sum(1 for _ in it)

    def _load_reserved(self, db=None) -> None:
        """The lease and session tables, from their records (of db, this state's database by
        default)."""
        db = self._db if db is None else db
        records = []
        # Not the keys' meta records, nor the history (history.py): every key has those.
        for lo, hi in ((_DATA + RESERVED, history.VERSIONS), (_HISTORY_END, _META), (_META_END, _USER_DATA)):
            with db.iterator(start=lo, stop=hi, verify_checksums=True) as it:
                records += [(k[1:], _U64.unpack_from(v)[0], v[8:]) for k, v in it]
        self.leases.load((k, v) for k, _, v in records)
        self.sessions.load(records)
        self.alarms = {(int(k[len(_ALARM) : len(_ALARM) + 16], 16), int(k[len(_ALARM) + 17 :])) for k, _, _ in records if k.startswith(_ALARM)}
        self.nospace = any(kind == ALARM_NOSPACE for _, kind in self.alarms)  # writes that add data are refused
        self.compact_revision, self.compacted_at = next(((_U64.unpack(v)[0], mod) for k, mod, v in records if k == _COMPACT), (0, 0))
        self.cluster_id = next((v.decode() for k, _, v in records if k == _CLUSTER_ID), "")  # "": not chosen yet
        # A state from before the history: it starts with the next entry applied.
        self.history_from = next((_U64.unpack(v)[0] for k, _, v in records if k == history.HISTORY_FROM), None)

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
        overlay: dict[bytes, tuple | None] = {}  # this batch's writes, by raw key: _current's tuples (session records: (index, value))
        changes: list[Change] | None = [] if self.on_changes is not None else None
        results: list[Any] = []
        put_kind = EntryKind.NORMAL
        attached = self.leases.attached
        table = self.sessions
        sessions = table.last
        for e in entries:
            if e.kind != put_kind:
                if e.kind == EntryKind.CONFIG:
                    self._apply_config(e.index, e.data, wb)
                elif e.index == 1 and e.data:  # a new cluster's first leader's no-op: the cluster's identity
                    self._noop(e, wb)
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
            if d[o : o + 2] == PUT_HEAD and len(d) > o + 4 and not self.nospace:
                # The hot path, an unconditional put, read straight from the encoding:
                # version, opcode, key length, key, no condition, value.
                end = o + 4 + ((d[o + 2] << 8) | d[o + 3])
                if len(d) > end and d[end] == 0:
                    raw = d[o + 4 : end]
                    key = key_text(raw)
                    value = d[end + 1 :]
                    self._write(key, raw, e.index, wb, overlay, value, 0, changes)
                    if key in attached:
                        self._detach(key, wb)
                    result = PutResult(e.index)
                    if session:  # its answer is PutResult(this index): the record can wait (sessions.py)
                        s = table.use(session)
                        s[0], s[1], s[2], s[3] = seq, e.index, False, fp
                        table.dirty.add(session)
                        results.append(result)
                        continue
            if result is None:
                try:
                    cmd = decode(d[o:] if o else d)
                except CommandError as err:
                    results.append(err)  # deterministic: every replica rejects it alike
                    continue
                if self.nospace and adds_data(cmd):
                    result = SpaceExceeded()
                elif type(cmd) is Txn:
                    result = self._txn(cmd, e.index, wb, overlay, changes, answering is None or session or e.index in answering)
                elif type(cmd) is TxnReq:
                    result = self._txn_req(cmd, e.index, wb, overlay, changes, answering is None or session or e.index in answering)
                else:
                    result = self._execute(cmd, e.index, wb, overlay, changes)
            if session:
                self._answered(session, seq, fp, e.index, result, wb, overlay)
            results.append(result)
        if entries:
            last = entries[-1]
            wb.put(_APPLIED, _TWO_U64.pack(last.index, last.term))
            self._applied = (last.index, last.term)
        wb.write()
        self._remember(overlay)
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
        s = self.sessions.use(session)
        s[0], s[1], s[2], s[3] = seq, index, True, fp
        self.sessions.dirty.discard(session)
        k = _DATA + session_record(session)
        v = record_value(seq, fp, encoded)
        overlay[k] = (index, v)
        wb.put(k, _U64.pack(index) + v)

    def _not_again(self, e: Entry, session: int, seq: int, s: list[int] | None, wb, overlay: dict):
        """A write in a session that is not open, or a copy of one applied already: the
        first one's result, or why it is refused. Nothing is applied (the ledger holds
        the copy's mutations; the history does not)."""
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
        return result

    def flush_sessions(self, wb=None) -> None:
        """Write the records that plain puts left waiting, and note that every record is up
        to date as of the applied index (`sessions_at`): a restart replays the session
        headers of the ledger's entries after it (replay_sessions)."""
        own = wb is None
        wb = wb if wb is not None else self._db.write_batch()
        table = self.sessions.last
        for session in self.sessions.dirty:
            seq, used, _, fp, _ = s = table[session]
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
        self._close_sessions(self.sessions.open(cmd.session, index, cmd.max_sessions, cmd.owner), wb)
        if self.sessions.last[cmd.session][1] == index:  # new (opening it again changes nothing)
            wb.put(_DATA + session_record(cmd.session), _U64.pack(index) + record_value(0, 0, b""))
            if cmd.owner:
                wb.put(_DATA + owner_record(cmd.session), _U64.pack(index) + cmd.owner.encode())
        return SessionOpened(cmd.session)

    def _expire_sessions(self, upto: int, wb) -> None:
        self._close_sessions(self.sessions.expire(upto), wb)

    @staticmethod
    def _close_sessions(closed: list[tuple[int, str]], wb) -> None:
        for session, owner in closed:
            wb.delete(_DATA + session_record(session))
            if owner:
                wb.delete(_DATA + owner_record(session))

    def open_sessions(self) -> int:
        return len(self.sessions)

    def _apply_config(self, index: int, data: bytes, wb) -> None:
        if index <= self.membership_index:
            return  # older than the membership this node joined with (raft/membership.py ConfigLog)
        after = _member_ids(data)
        self._removed = (self._removed | (_member_ids(self._membership) - after)) - after
        _put_membership(wb, data, index, self._removed)
        self._membership, self.membership_index = data, index

    def _drop_effect_records(self) -> None:
        """Versions before the history kept a record of what some entries changed, for
        watches to read the ledger with; the history says it all now."""
        wb = self._db.write_batch()
        with self._db.iterator(start=_EFFECTS, stop=_EFFECTS + b"\xff" * 8, include_value=False) as it:
            for k in it:
                wb.delete(k)
        wb.delete(_EFFECTS_FROM)
        wb.write()

    def removed(self) -> frozenset[str]:
        """Ids that were members and were removed (a re-added id leaves this set)."""
        return frozenset(self._removed)

    def _current(self, k: bytes, overlay: dict) -> tuple[int, bytes, int, int] | None:
        """A data record as this batch leaves it: (mod_index, value, create_revision,
        version) (a reserved record's last two mean nothing), or None."""
        if k in overlay:
            return overlay[k]
        cur = self._recent.get(k, _UNREAD)
        if cur is _UNREAD:
            cur = self._recent_old.get(k, _UNREAD)
            if cur is _UNREAD:
                raw = self._db.get(k)
                return None if raw is None else _record(raw)
        return cur

    # -- the records applied batches wrote last, in memory ----------------------------------
    #
    # Every put reads the key's record before it writes it (its version, and what the history
    # keeps): a key written again soon is read from here rather than from LevelDB, whose Get
    # was 8-10 % of a node's event loop under a put load. Only apply writes user records
    # (besides a restore, which forgets them all), and it adds what it wrote once its batch is
    # on disk, on the same thread as every read of the live state: so the records here are
    # always LevelDB's. Reserved records are not kept (flush_sessions writes some outside a
    # batch). Two generations bound the memory: when the new one passes RECENT_BYTES it
    # becomes the old one, and the old one goes.

    def _remember(self, overlay: dict) -> None:
        recent, size = self._recent, self._recent_bytes
        for k, v in overlay.items():
            if k >= _USER_DATA:
                was = recent.get(k, _UNREAD)
                if was is _UNREAD:
                    size += len(k) + _RECENT_ENTRY
                elif was is not None:
                    size -= len(was[1])
                if v is not None:
                    size += len(v[1])
                recent[k] = v
        self._recent_bytes = size
        if size > RECENT_BYTES:
            # (a generation one batch swelled far past the bound, a delete of a large prefix
            # say, is let go whole: a small entry can change any number of keys)
            self._recent_old = recent if size <= 2 * RECENT_BYTES else {}
            self._recent, self._recent_bytes = {}, 0

    def _forget_recent(self) -> None:
        # (the old generation first: a read between the two finds the new one or nothing)
        self._recent_old: dict[bytes, tuple | None] = {}
        self._recent: dict[bytes, tuple | None] = {}
        self._recent_bytes = 0

    def _check(self, cond: Cond | None, overlay: dict) -> ConditionFailed | None:
        if cond is None:
            return None
        cur = self._current(_DATA + key_bytes(cond.key), overlay)
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
        if isinstance(cmd, AlarmSet):
            return self._set_alarm(cmd, index, wb)
        if isinstance(cmd, Compact):
            return self._compact(cmd.revision, index, wb)
        if isinstance(cmd, Bulk):
            return self._bulk(cmd, index, wb, overlay, changes)
        # A command that is never logged (a lease keepalive, a cluster id outside a no-op),
        # sent by a peer: refused alike by every replica, never an exception in apply.
        return CommandError(f"not a command to apply: {type(cmd).__name__}")

    def _delete_prefix(self, prefix: str, index: int, wb, overlay: dict, changes: list | None) -> PrefixDeleted:
        """Every key under the prefix, as this batch leaves them (its own earlier writes
        included), deleted at this index; watchers see a delete per key."""
        pre = _DATA + key_bytes(prefix)
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
            key = key_text(k[1:])
            self._delete(Delete(key), index, wb, overlay, changes)
            deleted.append(key)
        return PrefixDeleted(index, tuple(deleted))

    def _txn(self, cmd: Txn, index: int, wb, overlay: dict, changes: list | None, reads: bool) -> TxnApplied:
        """Run a transaction. Its gets are read if `reads` (else None), up to the read budget
        (GetOmitted beyond it: the writes still go on)."""
        ok = all(self._check(c, overlay) is None for c in cmd.conds)
        out = []
        put_result = PutResult(index)  # every put of the txn has the same one
        budget = self.max_read_bytes if self.max_read_bytes is not None else float("inf")
        for op in cmd.ops if ok else cmd.else_ops:
            t = type(op)
            if t is Put:
                self._write(op.key, key_bytes(op.key), index, wb, overlay, op.value, 0, changes)
                if op.key in self.leases.attached:
                    self._detach(op.key, wb)
                out.append(put_result)
            elif t is Get:
                if not reads:
                    out.append(None)
                    continue
                if budget < 0:
                    out.append(GetOmitted(op.key))
                    continue
                cur = self._current(_DATA + key_bytes(op.key), overlay)
                budget -= len(cur[1]) if cur else 0
                out.append(GetResult(op.key, cur[1] if cur else None, cur[0] if cur else 0) if budget >= 0 else GetOmitted(op.key))
            else:
                out.append(self._delete(op, index, wb, overlay, changes))
        return TxnApplied(index, ok, tuple(out))

    def _bulk(self, cmd: Bulk, index: int, wb, overlay: dict, changes: list | None) -> BulkApplied:
        """Put each row whose condition holds, as a put without a lease does."""
        rows = cmd.rows
        refused, mods, held = [], [], []
        attached = self.leases.attached
        for i, (raw, value, cond) in enumerate(rows):
            k = _DATA + raw
            cur = self._current(k, overlay)
            if cond != ANY and (cur[0] if cur else 0) != cond:
                refused.append(i)
                mods.append(cur[0] if cur else 0)
                held.append(1 if cur is not None and cur[1] == value else 0)
                continue
            key = key_text(raw)
            self._write(key, raw, index, wb, overlay, value, 0, changes, cur)
            if key in attached:
                self._detach(key, wb)
        return BulkApplied(index, tuple(refused), tuple(mods), tuple(held))

    def _put(self, op: Put, index: int, wb, overlay: dict, changes: list | None) -> PutResult:
        self._write(op.key, key_bytes(op.key), index, wb, overlay, op.value, op.lease, changes)
        had = self.leases.attached.get(op.key)
        if had != (op.lease or None):
            if had is not None:
                self._detach(op.key, wb)
            if op.lease:
                self.leases.attach_in_memory(op.key, op.lease)
                wb.put(_DATA + ATTACH_RECORD + key_bytes(op.key), _U64.pack(index) + _U64.pack(op.lease))
        return PutResult(index)

    def _delete(self, op: Delete, index: int, wb, overlay: dict, changes: list | None) -> DeleteApplied:
        k = _DATA + key_bytes(op.key)
        cur = self._current(k, overlay)
        overlay[k] = None
        if cur is not None:
            wb.delete(k)
            self._unstamp(op.key, k[1:], index, wb, overlay, cur, self.leases.attached.get(op.key, 0), changes)
        if op.key in self.leases.attached:
            self._detach(op.key, wb)
        return DeleteApplied(index, cur is not None)

    def _detach(self, key: str, wb) -> None:
        self.leases.detach_in_memory(key)
        wb.delete(_DATA + ATTACH_RECORD + key_bytes(key))

    def _revoke(self, lease: int, index: int, wb, overlay: dict, changes: list | None) -> LeaseRevoked | NoSuchLease:
        """End a lease and delete its keys, at this entry's index (watchers see deletes)."""
        if lease not in self.leases.ttl_ms:
            return NoSuchLease(lease)
        keys = self.leases.revoke(lease)
        wb.delete(_DATA + lease_record(lease))
        for key in keys:
            raw = key_bytes(key)
            cur = self._current(_DATA + raw, overlay)
            wb.delete(_DATA + ATTACH_RECORD + raw)
            wb.delete(_DATA + raw)
            overlay[_DATA + raw] = None
            if cur is not None:
                self._unstamp(key, raw, index, wb, overlay, cur, lease, changes)
        return LeaseRevoked(index, tuple(keys))

    def _noop(self, e: Entry, wb) -> None:
        """The cluster's identity, from the no-op of the log's first entry (kv.Node's
        noop_data). Only there: a cluster made by an earlier version, whose first no-op
        offered none, keeps having none (its members, upgraded one at a time, skip or
        apply later no-ops alike, and would each take another id). Anything else a no-op
        carries is not ours to read."""
        try:
            cmd = decode(e.data)
        except CommandError:
            return
        if type(cmd) is ClusterId:
            self.cluster_id = cmd.cluster_id
            wb.put(_DATA + _CLUSTER_ID, _U64.pack(e.index) + cmd.cluster_id.encode())

    def set_cluster_id(self, cluster_id: str) -> None:
        """A restore's: the new cluster's identity (snapshot/restore.py), not the old one's."""
        self._db.put(_DATA + _CLUSTER_ID, _U64.pack(self._applied[0]) + cluster_id.encode(), sync=True)
        self.cluster_id = cluster_id

    def _compact(self, revision: int, index: int, wb) -> CompactAnswer:
        if revision <= self.compact_revision:
            return CompactAnswer(self.compact_revision, "compacted")
        if revision >= index:  # (at most the index applied before this entry)
            return CompactAnswer(self.compact_revision, "future")
        self.compact_revision, self.compacted_at = revision, index
        wb.put(_DATA + _COMPACT, _U64.pack(index) + _U64.pack(revision))
        return CompactAnswer(revision, "")

    def _set_alarm(self, cmd: AlarmSet, index: int, wb) -> Alarms:
        pair = (cmd.member, cmd.alarm)
        if cmd.active == (pair in self.alarms):  # raised already (etcd answers it), or not raised
            return Alarms((cmd.member,), (cmd.alarm,)) if cmd.active else Alarms((), ())
        rec = _DATA + _ALARM + b"%016x/%d" % pair
        if cmd.active:
            self.alarms.add(pair)
            wb.put(rec, _U64.pack(index))
        else:
            self.alarms.discard(pair)
            wb.delete(rec)
        self.nospace = any(kind == ALARM_NOSPACE for _, kind in self.alarms)
        return Alarms((cmd.member,), (cmd.alarm,))

    # -- create_revision and version (etcd's v3 API) --------------------------------------

    def _write(self, key: str, raw: bytes, index: int, wb, overlay: dict, value: bytes, lease: int, changes: list | None, old=_UNREAD) -> None:
        """Put a value at a key (raw: its bytes) at index, leases aside: its record, with its
        create_revision and version (version + 1); what it held goes to the history; and the
        change is listed for watchers (with the key before and after, in rich_changes mode).
        `old`: what the key holds (_current), when the caller has read it.

        A key created here is written as its first version (no create_revision and version:
        they are its mod_index and 1) and, unless this batch changed it before, keeps no
        history record (history.py): one record of the three an update writes."""
        k = _DATA + raw
        if old is _UNREAD:
            old = self._current(k, overlay)
        if old is None:
            create, version = index, 1
            if k in overlay:  # (deleted earlier in this batch)
                self._keep(raw, index, history.version_value(index, None), wb)
            else:
                self._list_change(raw, index, wb)
            wb.put(k, _U64.pack(index) + value)
        else:
            create, version = old[2], old[3]
            held = self.leases.attached.get(key, 0)
            self._keep(raw, index, history.past_record(index, create, old[0], version, held, old[1]), wb)
            version += 1
            wb.put(k, _stamped(index, create, version, value))
        overlay[k] = (index, value, create, version)
        if changes is not None:
            if not self.rich_changes:
                changes.append((index, key, value))
                return
            prev = None if old is None else KeyValue(key, create, old[0], version - 1, old[1], held)
            changes.append((index, key, value, KeyValue(key, create, index, version, value, lease), prev))

    def _unstamp(self, key: str, raw: bytes, index: int, wb, overlay: dict, cur: tuple[int, bytes, int, int], lease: int, changes: list | None) -> None:
        """A delete of key at index (cur: what it held, _current)."""
        prev = KeyValue(key, cur[2], cur[0], cur[3], cur[1], lease)
        self._keep(raw, index, history.version_value(index, prev), wb)
        if changes is not None:
            if not self.rich_changes:
                changes.append((index, key, None))
            else:
                changes.append((index, key, None, KeyValue(key, 0, index, 0, b"", 0), prev))

    def _keep(self, raw: bytes, index: int, past: bytes, wb) -> None:
        """Move what key raw held before this change (of entry `index`; `past`: its
        history.version_value) into the history, and list the change (history.py)."""
        n = self._list_change(raw, index, wb)
        wb.put(history.version_key(raw, index, n), past)

    def _list_change(self, raw: bytes, index: int, wb) -> int:
        """List a change of key raw, the n-th of entry `index`'s; returns n."""
        if self._changes_at != index:
            self._changes_at, self._changes_n = index, 0
        n = self._changes_n
        self._changes_n += 1
        wb.put(history.change_key(index, n), _U64.pack(index) + raw)
        return n

    def _kv(self, raw: bytes, cur: tuple[int, bytes, int, int]) -> KeyValue:
        key = key_text(raw)
        return KeyValue(key, cur[2], cur[0], cur[3], cur[1], self.leases.attached.get(key, 0))

    def _range_items(self, key: bytes, end: bytes, overlay: dict) -> Iterator[tuple[bytes, tuple[int, bytes, int, int]]]:
        """(raw key, (mod_index, value, create_revision, version)) of every key in etcd's
        range (key, end), in key order, as this batch leaves them."""
        if not end:
            cur = self._current(_DATA + key, overlay) if key[:1] > RESERVED else None
            if cur is not None:
                yield key, cur
            return
        lo, hi = _bounds(key, end)
        if hi <= lo:
            return
        ov = sorted((k, v) for k, v in overlay.items() if lo <= k < hi)
        j = 0
        try:
            with self._db.iterator(start=lo, stop=hi, verify_checksums=True) as it:
                for k, raw in it:
                    while j < len(ov) and ov[j][0] < k:
                        if ov[j][1] is not None:
                            yield ov[j][0][1:], ov[j][1]
                        j += 1
                    if j < len(ov) and ov[j][0] == k:
                        if ov[j][1] is not None:
                            yield k[1:], ov[j][1]
                        j += 1
                        continue
                    yield k[1:], _record(raw)
        except plyvel.CorruptionError as e:
            raise self._damaged(e) from e
        for k, v in ov[j:]:
            if v is not None:
                yield k[1:], v

    def keys_in(self, key: bytes, end: bytes, most: int) -> int:
        """How many keys etcd's range (key, end) holds as applied here, counted no further
        than most + 1 (keys only: a transaction's compares are weighed before they run)."""
        if not end:
            return 1
        lo, hi = _bounds(key, end)
        if hi <= lo:
            return 0
        with self._db.iterator(start=lo, stop=hi, include_value=False) as it:
            return sum(1 for _ in itertools.islice(it, most + 1))

    def key_value(self, raw: bytes) -> KeyValue | None:
        """One key (its bytes) as applied here, or None: what range() answers for a range
        of that key alone, without a range's machinery (etcd's get, the common call)."""
        if raw[:1] <= RESERVED:
            return None
        cur = self._current(_DATA + raw, {})
        return None if cur is None else self._kv(raw, cur)

    def range(self, req: RangeReq, revision: int | None = None) -> RangeResp:
        """Keys of etcd's range as applied here (the v3 API's Range), or as of a revision
        (see oldest_revision)."""
        return self._range(req, {}, self.max_read_bytes, revision)

    def _range(self, req: RangeReq, overlay: dict, budget: int | None, revision: int | None = None) -> RangeResp:
        """At most req.limit keys (0: all) and at most `budget` bytes of values (then `more`),
        with the count of every key in the range."""
        kvs, count, left, full = [], 0, budget if budget is not None else float("inf"), False
        spent = left <= 0  # (by the ranges before it in a transaction: then not even one key)
        now = revision is None
        for raw, cur in self._range_items(req.key, req.range_end, overlay) if now else self._items_at(req.key, req.range_end, revision):
            count += 1
            if req.count_only or full or (req.limit and len(kvs) >= req.limit):
                continue
            kv = self._kv(raw, cur) if now else cur
            if req.keys_only:
                kv = kv._replace(value=b"")
            left -= len(raw) + len(kv.value)
            if left < 0 and (kvs or spent):
                full = True
                continue
            kvs.append(kv)
        return RangeResp(tuple(kvs), count, not req.count_only and count > len(kvs))

    def _txn_req(self, txn: TxnReq, index: int, wb, overlay: dict, changes: list, reads: bool):
        """etcd's Txn: which branch of it and of every nested transaction runs is decided
        first, then the chosen ops are checked, then they run (see commands.TxnReq)."""
        path: list[bool] = []
        self._txn_path(txn, overlay, path)
        refused = self._txn_check(txn, iter(path), overlay, [])
        if refused is not None:
            return refused
        return self._txn_run(txn, iter(path), index, wb, overlay, changes, reads, [self.max_read_bytes])

    def read_txn(self, txn: TxnReq, index: int) -> TxnResp:
        """A TxnReq that writes nothing, evaluated on the applied state (no entry): its
        compares decide the branch, its ranges are read (up to the read budget)."""
        path: list[bool] = []
        self._txn_path(txn, {}, path)
        return self._txn_run(txn, iter(path), index, None, {}, [], True, [self.max_read_bytes], read_only=True)

    def _txn_path(self, txn: TxnReq, overlay: dict, path: list[bool]) -> None:
        ok = all(self._compare(c, overlay) for c in txn.compares)
        path.append(ok)
        for op in txn.success if ok else txn.failure:
            if type(op) is TxnReq:
                self._txn_path(op, overlay, path)

    def _compare(self, c, overlay: dict) -> bool:
        found = False
        for raw, cur in self._range_items(c.key, c.range_end, overlay):
            found = True
            if not compare_holds(c, self._kv(raw, cur)):
                return False
        return found or compare_holds(c, None)

    def _txn_check(self, txn: TxnReq, path, overlay: dict, earlier: list) -> NoSuchLease | KeyNotFound | None:
        """Refuse the transaction before any op runs if one could not: a put on a lease
        that does not exist, or one that keeps the key's value or lease when the key will
        not exist by then (`earlier`: the puts and deletes of the chosen ops before it, so
        a key the transaction itself deleted counts as absent)."""
        for op in txn.success if next(path) else txn.failure:
            t = type(op)
            if t is PutReq:  # (the key first, then the lease: etcd's order)
                if (op.ignore_value or op.ignore_lease) and not self._exists_then(op.key, overlay, earlier):
                    return KeyNotFound(key_text(op.key))
                if op.lease and op.lease not in self.leases.ttl_ms:
                    return NoSuchLease(op.lease)
                earlier.append((op.key, b"", True))
            elif t is DeleteRangeReq:
                earlier.append((op.key, op.range_end, False))
            elif t is TxnReq:
                refused = self._txn_check(op, path, overlay, earlier)
                if refused is not None:
                    return refused
        return None

    def _exists_then(self, key: bytes, overlay: dict, earlier: list) -> bool:
        for k, end, put in reversed(earlier):  # the latest op on the key decides
            if in_range(key, k, end):
                return put
        return self._current(_DATA + key, overlay) is not None

    def _txn_run(self, txn: TxnReq, path, index: int, wb, overlay: dict, changes: list, reads: bool, left: list, read_only: bool = False) -> TxnResp:
        """Run the chosen ops; `left`: [the bytes the transaction's ranges, nested ones
        included, may still return] (one budget for them all: a range of 3 MB asked 100
        times in one request would build 300 MB)."""
        ok = next(path)
        out = []
        for op in txn.success if ok else txn.failure:
            t = type(op)
            if t is RangeReq:
                if not reads:
                    out.append(None)
                    continue
                got = self._range(op, overlay, left[0])
                if left[0] is not None:
                    left[0] -= read_bytes(got)
                out.append(got)
            elif read_only and t is not TxnReq:
                raise CommandError("a read-only transaction puts or deletes nothing")
            elif t is PutReq:
                prev = None
                if op.prev_kv or op.ignore_value or op.ignore_lease:  # (the key's versions cost a read)
                    cur = self._current(_DATA + op.key, overlay)
                    prev = self._kv(op.key, cur) if cur is not None else None
                value = prev.value if op.ignore_value else op.value
                lease = prev.lease if op.ignore_lease else op.lease
                self._put(Put(key_text(op.key), value, None, lease), index, wb, overlay, changes)
                out.append(PutResp(prev if op.prev_kv else None))
            elif t is DeleteRangeReq:
                items = list(self._range_items(op.key, op.range_end, overlay))
                prevs = tuple(self._kv(raw, cur) for raw, cur in items) if op.prev_kv else ()
                for raw, _ in items:
                    self._delete(Delete(key_text(raw)), index, wb, overlay, changes)
                out.append(DeleteRangeResp(len(items), prevs))
            else:
                out.append(self._txn_run(op, path, index, wb, overlay, changes, reads, left, read_only))
        return TxnResp(index, ok, tuple(out))

    # -- snapshots -------------------------------------------------------------------------

    def capture(self) -> LevelDBView:
        self.flush_sessions()  # the snapshot carries every session as of its index
        return LevelDBView(self._db.snapshot(), *self._applied, self.membership(), self._db.approximate_size, self.removed())

    def restore(self, index: int, term: int, membership: bytes, items: Iterator[tuple[bytes, bytes, int]], removed: Iterable[str] = ()) -> int:
        """Replace everything with a snapshot's records (`removed`: the ids removed from the
        cluster as of it); returns how many user keys were loaded (besides ledgerkv's own
        records). A marker makes a crash in the middle visible at the next start
        (`incomplete`). The database is refused to every other user until it is whole
        (close_for_restore, unless that was called already)."""
        removed = set(removed)
        if self.membership_index > index:  # a node that joined since, loading an older snapshot
            membership, membership_at = self._membership, self.membership_index
            removed |= self._removed
        else:
            membership_at = index
        removed -= _member_ids(membership)
        if self._db is not _LOADING:
            self.close_for_restore()
        shutil.rmtree(self.path)
        os.makedirs(self.path)
        db = _open(self.path)
        try:
            # The membership it keeps goes with the marker: a load cut short is loaded again
            # at the next start, and a node that joined since the snapshot must still pass
            # over the older membership entries then (its floor, membership_at).
            mark = db.write_batch(sync=True)
            mark.put(_RESTORING, b"1")
            _put_membership(mark, membership, membership_at, removed)
            mark.write()
            self._purge_from = history.CHANGES
            n = own = 0
            wb = db.write_batch()
            pack = _U64.pack
            # A snapshot carries the keys' create_revision and version as meta records, which
            # sort before every user key: they are held until their keys' records come and
            # written into them (those beyond _HELD_MAX as they are, folded afterwards).
            meta = _META[len(_DATA) :]
            held: dict[bytes, bytes] = {}
            for key, value, mod in items:
                n += 1
                if key[:1] == RESERVED:
                    own += 1
                    if key.startswith(meta) and len(held) < _HELD_MAX:
                        held[key[len(meta) :]] = value
                    else:
                        wb.put(_DATA + key, pack(mod) + value)
                else:
                    versions = held.pop(key, None) if held else None
                    wb.put(_DATA + key, pack(mod) + value if versions is None else _stamped(mod, *_META_VALUE.unpack(versions), value))
                if n % _RESTORE_BATCH == 0:
                    wb.write()
                    wb = db.write_batch()
            wb.write()
            self._fold_meta_records(db)
            # A synced write flushes LevelDB's log, and with it every record written above.
            fin = db.write_batch(sync=True)
            fin.put(_STATE_FORMAT, b"%d" % STATE_FORMAT)
            fin.put(_APPLIED, _TWO_U64.pack(index, term))
            self._membership, self.membership_index, self._removed = membership, membership_at, removed
            fin.delete(_RESTORING)
            fin.put(_SESSIONS_AT, _U64.pack(index))
            self.sessions_at = index
            fin.write()
        except BaseException:
            db.close()  # (a full disk, say: FSMCaller opens the state again once there is room)
            raise
        self._load_reserved(db)
        if self.history_from is None:  # a snapshot from before the history
            self._start_history(db, index + 1)
        self._applied = (index, term)
        self.incomplete = False
        self._db = db  # (last: readers see the new state once its tables match it)
        return n - own

    def close_for_restore(self) -> None:
        """A restore's first step, on the thread that serves reads (the event loop's, where
        no read is in progress then): the state marked as being replaced (durably: a crash
        from here on is seen at the next start), the database closed, and refused to every
        user until restore() has loaded the new one. Its users in other threads are let go
        first (FSMCaller's before_close hooks): closed under a read in another thread, a
        LevelDB database crashed the process (SIGSEGV)."""
        self._db.put(_RESTORING, b"1", sync=True)
        self._forget_recent()
        db, self._db = self._db, _LOADING
        db.close()

    def _upgrade_layout(self) -> None:
        """An earlier version's state: its meta records folded into the keys' records, then
        this layout's version noted. A failure (a full disk: the fold writes every changed
        key's record again before LevelDB drops the old ones) leaves a state that opens and
        folds the rest next time, so it is no reason to rebuild."""
        try:
            folded = self._fold_meta_records()
            self._db.put(_STATE_FORMAT, b"%d" % STATE_FORMAT, sync=True)
        except plyvel.Error as e:
            self._db.close()
            raise StateUpgradeFailed(
                f"bringing the state machine in {self.path} to this version's layout failed ({e}): free disk space "
                "(it needs about as much again as the keys' records) and start again; nothing is lost"
            ) from e
        if folded:
            log.info("state machine %s: folded %d keys' create_revision and version into their records", self.path, folded)

    def _fold_meta_records(self, db=None) -> int:
        """Move the keys' create_revision and version from their meta records into the
        keys' own records (of db, this state's database by default); returns how many keys.
        A key's meta record goes in the batch that folds it, so a crash in between leaves
        the rest for the next open."""
        db = self._db if db is None else db
        n, start = 0, _META
        while True:
            wb = db.write_batch()
            batch = 0
            with db.iterator(start=start, stop=_META_END, verify_checksums=True) as it:
                for mk, mv in it:
                    wb.delete(mk)
                    k = _DATA + mk[len(_META) :]
                    raw = db.get(k, verify_checksums=True)
                    if raw is not None and raw[0] < 0x80:
                        wb.put(k, _stamped(_U64.unpack_from(raw)[0], *_META_VALUE.unpack_from(mv, _U64.size), raw[8:]))
                        n += 1
                    batch += 1
                    if batch >= _FOLD_BATCH:
                        start = mk + b"\x00"  # (not over the tombstones just written again)
                        break
            if batch:
                wb.write()
            if batch < _FOLD_BATCH:
                return n

    def reopen(self) -> None:
        """Open the database again, from disk: after a failed write (a full disk) LevelDB
        refuses every later one until then. What the failed batch changed in this object's
        tables is read back from disk, where none of it went."""
        on_changes, copies, rich = self.on_changes, self.copies, self.rich_changes
        if self._db is not None and not self._db.closed:
            self._db.close()
        self.__init__(self.path, max_read_bytes=self.max_read_bytes)
        self.on_changes, self.copies, self.rich_changes = on_changes, copies, rich

    def sync(self) -> None:
        """Make every applied batch durable (before the ledger drops the entries). A synced
        write flushes LevelDB's log, and with it every write before it; it must not touch
        the applied index, which a batch in another thread may be moving."""
        self._db.put(_SYNC, b"", sync=True)

    def set_membership(self, membership: bytes, index: int = 0, removed: Iterable[str] = ()) -> None:
        """Record the bootstrap membership of a brand-new node: a new cluster's, or (at
        `index`, its entry's, with the ids `removed` before) the one a node that joins was
        given."""
        removed = set(removed) - _member_ids(membership)
        wb = self._db.write_batch(sync=True)
        _put_membership(wb, membership, index, removed)
        wb.write()
        self._membership, self.membership_index, self._removed = membership, index, removed

    def close(self) -> None:
        if self._db is not None and not self._db.closed:
            if not self.incomplete:
                with contextlib.suppress(plyvel.Error):  # a full disk: the restart replays them instead
                    self.flush_sessions()  # a restart then has nothing to replay
            self._db.close()


class LevelDBView:
    """A LevelDB snapshot: a consistent view while writes go on."""

    def __init__(
        self, snap, index: int, term: int, membership: bytes, approximate_size: Callable[[bytes, bytes], int] | None = None, removed: frozenset[str] = frozenset()
    ) -> None:
        self._snap = snap
        self.index, self.term, self.membership, self.removed = index, term, membership, removed
        self._size = approximate_size  # of the database's files between two keys (now, not as of the view: an estimate)

    def items(self) -> Iterator[tuple[bytes, bytes, int]]:
        for keys, values, mods in self.blocks(1 << 20):
            yield from zip(keys, values, _int64_le(mods).tolist())

    def blocks(self, block_bytes: int, lo: bytes | None = None, hi: bytes | None = None) -> Iterator[tuple[list[bytes], list[bytes], bytes]]:
        """The records in blocks of columns of about block_bytes; with lo or hi, only the
        user keys of [lo, hi) (hi None: to the last), without ledgerkv's own records.

        The keys' create_revision and version go as meta records (the layout at the top),
        as every version of ledgerkv reads them, and the values without them."""
        # No Python loop visits a record: they are taken _CHUNK_RECORDS at a time, split
        # into keys and values, measured, and the keys' prefix and the values' mod_index
        # cut off and decoded per block, by C loops (islice, map, accumulate, join, array),
        # a few times faster than per record in Python.
        # (A whole view's meta records take one more pass over the user keys.)
        keys: list[bytes] = []
        values: list[bytes] = []
        size = 0
        with contextlib.ExitStack() as open_iterators:

            def records(start: bytes, stop: bytes):
                return open_iterators.enter_context(self._snap.iterator(start=start, stop=stop, verify_checksums=True))

            if lo is None and hi is None:
                stream = itertools.chain(records(_DATA, _META), _meta_records(records(_USER_DATA, _DATA_END)), records(_META_END, _DATA_END))
            else:
                stream = records(max(_DATA + (lo or b""), _USER_DATA), _DATA + hi if hi is not None else _DATA_END)
            while chunk := list(itertools.islice(stream, _CHUNK_RECORDS)):
                ks, vs = list(map(_FIRST, chunk)), list(map(_SECOND, chunk))
                # ends[i]: the bytes counted with the chunk's first i records; a block ends
                # with the record that reaches block_bytes, as a record-by-record loop's would
                ends = list(itertools.accumulate(map(operator.add, map(len, ks), map(len, vs)), initial=size))
                start = counted = 0  # the chunk's records and bytes already in blocks given
                while (cut := bisect.bisect_left(ends, counted + block_bytes, start + 1)) < len(ends):
                    keys += ks[start:cut]
                    values += vs[start:cut]
                    yield _columns(keys, values)
                    keys, values, start, counted = [], [], cut, ends[cut]
                keys += ks[start:]
                values += vs[start:]
                size = ends[-1] - counted
        if keys:
            yield _columns(keys, values)

    def user_key_splits(self, lo: bytes, hi: bytes | None, parts: int) -> tuple[int | None, list[bytes]]:
        """Up to parts - 1 keys that cut the user keys of [lo, hi) (ledgerkv's own records
        left out) into runs of about equal bytes, and how many keys there are when that was
        counted (None: not). The cuts come from LevelDB's estimate of its files' bytes
        between two keys, found by bisection, without reading the keys; data too small for
        the estimate to see (still in the memtable) is counted key by key instead."""
        start = max(_DATA + lo, _USER_DATA)
        stop = _DATA + hi if hi is not None else _DATA_END
        total = self._size(start, stop) if self._size is not None and parts > 1 else 0
        if total < _SPLIT_BYTES:
            return self._counted_splits(start, stop, parts)
        cuts = []
        for i in range(1, parts):
            cut = _bisect_bytes(start, stop, lambda k: self._size(start, k) >= total * i / parts)
            if cuts and cut <= cuts[-1] or not start < cut < stop:
                continue
            cuts.append(cut)
        return None, [c[len(_DATA) :] for c in cuts]

    def _counted_splits(self, start: bytes, stop: bytes, parts: int) -> tuple[int, list[bytes]]:
        # Every step-th key is kept; the step doubles (every other kept key dropped) each
        # time the sample fills up, so the sample stays evenly spread, whatever the count.
        step = 1
        sample: list[bytes] = []
        n = 0
        with self._snap.iterator(start=start, stop=stop, include_value=False) as it:
            for n, k in enumerate(it, 1):
                if n % step == 0:
                    sample.append(k)
                    if len(sample) >= 2 * _SPLIT_SAMPLE:
                        sample, step = sample[1::2], step * 2
        per = len(sample) / max(parts, 1)
        cuts = sorted({sample[int(per * i)][len(_DATA) :] for i in range(1, parts) if int(per * i) < len(sample)})
        return n, cuts

    def release(self) -> None:
        self._snap.close()


_CHUNK_RECORDS = 16  # records a view's blocks take from LevelDB at a time
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_KEY_TAIL = operator.itemgetter(slice(len(_DATA), None))
_VALUE_TAIL = operator.itemgetter(slice(_U64.size, None))
_VALUE_HEAD = operator.itemgetter(slice(0, _U64.size))


def _bisect_bytes(lo: bytes, hi: bytes, reached: Callable[[bytes], bool]) -> bytes:
    """About the first key in [lo, hi) at which `reached` turns true (it only ever turns
    from false to true as keys grow), to _CUT_BYTES bytes past what lo and hi share."""
    common = os.path.commonprefix([lo, hi])
    width = len(common) + _CUT_BYTES

    def number(k: bytes) -> int:
        return int.from_bytes(k[:width].ljust(width, b"\x00"), "big")

    a, b = number(lo), number(hi)
    while b - a > 1:
        mid = (a + b) // 2
        if reached(mid.to_bytes(width, "big")):
            b = mid
        else:
            a = mid
    return b.to_bytes(width, "big").rstrip(b"\x00") or lo


def _meta_records(user_records: Iterator[tuple[bytes, bytes]]) -> Iterator[tuple[bytes, bytes]]:
    """The meta record of every key whose record holds a create_revision and version."""
    pack, meta = _U64.pack, _META_VALUE.pack
    for k, v in user_records:
        if v[0] >= 0x80:
            mod, create, version = _STAMP.unpack_from(v)
            yield _META + k[len(_DATA) :], pack(mod - STAMPED) + meta(create, version)


def _columns(records_keys: list[bytes], records_values: list[bytes]) -> tuple[list[bytes], list[bytes], bytes]:
    """Data records as snapshot columns: keys without the data prefix, values without
    their mod_index (and a key's create_revision and version), and the mod_indexes
    (big-endian in the records) as int64 LE."""
    values, heads = _values_and_mods(records_values)
    mods = array("q")
    mods.frombytes(heads)
    mods.byteswap()  # big-endian to little-endian, whatever the host's order
    return list(map(_KEY_TAIL, records_keys)), values, mods.tobytes()


def _int64_le(raw: bytes) -> array:
    a = array("q")
    a.frombytes(raw)
    if sys.byteorder != "little":
        a.byteswap()
    return a
