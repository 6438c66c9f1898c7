"""The ledger: the Raft log and hard state on LMDB.

Layout of the LMDB environment (one directory):

    meta     b"format"        ledger format version (LEDGER_FORMAT)
             b"identity"      JSON {"node_id", "group", "ledger_id"}: a data dir never changes
                              owner; ledger_id tells this ledger from any other the same node
                              id had (one drawn at random when it is made, or when a ledger
                              from before it is opened): a member re-added from an empty data
                              dir is known by its new one, and its old data dir refused
             b"hard_state"    term (8 bytes, big-endian) + vote (UTF-8, may be empty)
             b"before_begin"  ledgerBeforeBeginIndex + ledgerBeforeBeginTerm (2 x 8 bytes)
             b"term_runs"     (first index, term) pairs of the log, 16 bytes each
    entries  key: index (8 bytes, big-endian, so LMDB keeps them in order)
             value: term (8) + kind (1) + crc32 (4) + data; the crc covers index, term,
             kind and data, and is checked on every read.

A write (`write`) applies a sequence of `LedgerWrite`s — hard state, a snapshot reset,
a truncation and appended entries — in one transaction with one fsync: the driver hands it
everything that queued up while the previous fsync ran (group commit). LMDB commits are
atomic, so a crash leaves the ledger as it was before or after a write, never in between.

Term lookups never touch the disk: the log's terms change rarely, so the ledger keeps the
runs of equal terms in memory (and on disk, in the same transaction as the entries).
"""

from __future__ import annotations

import bisect
import json
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import lmdb

from . import failpoints
from .errors import LedgerError
from .log import limit_bytes
from .membership import new_ledger_id
from .messages import Entry, HardState

LEDGER_FORMAT = 1
_U64 = struct.Struct(">Q")
_TWO_U64 = struct.Struct(">QQ")
_HEADER = struct.Struct(">QBI")  # term, kind, crc32
_HEADER_SIZE = _HEADER.size


def _crc(index: int, term: int, kind: int, data: bytes) -> int:
    return zlib.crc32(data, zlib.crc32(_TWO_U64.pack(index, term) + bytes((kind,))))


def encode_entry(e: Entry) -> bytes:
    return _HEADER.pack(e.term, e.kind, _crc(e.index, e.term, e.kind, e.data)) + e.data


def decode_entry(index: int, raw: bytes | memoryview) -> Entry:
    term, kind, crc = _HEADER.unpack_from(raw)
    data = bytes(raw[_HEADER_SIZE:])
    if _crc(index, term, kind, data) != crc:
        raise LedgerError(
            f"ledger entry {index} fails its checksum: the ledger is corrupt. Remove this "
            "node's data dir and let it catch up from the cluster (install-snapshot)."
        )
    return Entry(index, term, kind, data)


# LMDB's meta pages (lmdb/mdb.c, MDB_meta after the page header, native byte order): two
# copies, at page 0 and page 1; the one with the higher txnid is current.
_LMDB_MAGIC = 0xBEEFC0DE
_META_MAGIC = struct.Struct("=I")  # at 16
_META_PSIZE = struct.Struct("=I")  # at 40: mm_dbs[FREE_DBI].md_pad holds the page size
_META_LAST_TXN = struct.Struct("=QQ")  # at 136: mm_last_pg, mm_txnid


def _check_not_truncated(path: str) -> None:
    """Refuse an LMDB file shorter than its own meta page says it is: mapped, its missing
    pages would kill the process with SIGBUS (and no message) at the first read."""
    try:
        with open(path, "rb") as f:
            head = f.read(2 * 65536)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return  # a new ledger
    needed = 0
    best_txn = -1
    offsets = [0]
    if len(head) >= 44 and _META_MAGIC.unpack_from(head, 16)[0] == _LMDB_MAGIC:
        offsets.append(_META_PSIZE.unpack_from(head, 40)[0])
    for off in offsets:
        if len(head) < off + 152 or _META_MAGIC.unpack_from(head, off + 16)[0] != _LMDB_MAGIC:
            continue
        psize = _META_PSIZE.unpack_from(head, off + 40)[0]
        last_pg, txn = _META_LAST_TXN.unpack_from(head, off + 136)
        if txn > best_txn:
            best_txn, needed = txn, (last_pg + 1) * psize
    if best_txn >= 0 and size < needed:  # (no meta page: LMDB itself refuses the file)
        raise LedgerError(
            f"{path} is {size} bytes, but its header says it holds {needed}: the file was cut short (a copy that did not "
            "finish, a full disk). Remove this node's data dir and let it catch up from the cluster, or restore it from a "
            "snapshot (kv snapshot restore)"
        )


@dataclass(slots=True)
class LedgerWrite:
    """One unit of a group-committed write, applied in this order."""

    hard_state: HardState | None = None
    reset_to: tuple[int, int] | None = None  # install-snapshot: empty log after (index, term)
    entries_from: int = 0  # drop entries at or after this index, then append `entries`
    entries: Sequence[Entry] = field(default_factory=tuple)


class Ledger:
    """The persisted log and hard state of one node (implements raft.log.LogStorage)."""

    def __init__(
        self,
        path: str,
        node_id: str,
        group: str = "default",
        *,
        map_size: int = 32 << 30,
        sync: bool = True,
        ledger_id: str | None = None,
    ) -> None:
        """`ledger_id`: the one to give the ledger if it is made now (a node that
        joins gave the cluster one before its ledger existed); otherwise one is drawn."""
        self.path = path
        os.makedirs(path, exist_ok=True)
        _check_not_truncated(os.path.join(path, "data.mdb"))
        try:
            self._env = lmdb.open(
                path, map_size=map_size, max_dbs=4, sync=sync, metasync=sync, subdir=True, lock=True, max_readers=256
            )
        except lmdb.Error as e:
            raise LedgerError(f"cannot open the ledger in {path}: {e}. Is it an LMDB directory of ledgerkv?") from e
        self._meta = self._env.open_db(b"meta")
        self._db = self._env.open_db(b"entries")
        with self._env.begin(write=True) as txn:
            self.ledger_id = self._check_identity(txn, node_id, group, ledger_id or new_ledger_id())
            hs = txn.get(b"hard_state", db=self._meta)
            bb = txn.get(b"before_begin", db=self._meta)
            runs = txn.get(b"term_runs", db=self._meta)
            cur = txn.cursor(db=self._db)
            last = _U64.unpack(cur.key())[0] if cur.last() else 0
        self._hard_state = _decode_hard_state(hs) if hs else HardState(0, None)
        self.before_begin_index, self.before_begin_term = _TWO_U64.unpack(bb) if bb else (0, 0)
        self._last = max(last, self.before_begin_index)
        self._run_starts: list[int] = []
        self._run_terms: list[int] = []
        if runs:
            flat = struct.unpack(f">{len(runs) // 8}Q", runs)
            self._run_starts, self._run_terms = list(flat[0::2]), list(flat[1::2])
        self._verify_tail()

    # -- opening ---------------------------------------------------------------------------

    def _check_identity(self, txn, node_id: str, group: str, ledger_id: str) -> str:
        """Returns the ledger's ledger_id (giving it `ledger_id` if it has none)."""
        fmt = txn.get(b"format", db=self._meta)
        ident = txn.get(b"identity", db=self._meta)
        if fmt is None:
            if txn.stat(self._db)["entries"]:
                raise LedgerError(f"{self.path} holds entries but no ledger header: it is not a ledgerkv ledger")
            txn.put(b"format", _U64.pack(LEDGER_FORMAT), db=self._meta)
            txn.put(b"identity", json.dumps({"node_id": node_id, "group": group, "ledger_id": ledger_id}).encode(), db=self._meta)
            return ledger_id
        version = _U64.unpack(fmt)[0]
        if version != LEDGER_FORMAT:
            raise LedgerError(
                f"{self.path} has ledger format {version}; this ledgerkv reads format {LEDGER_FORMAT}"
            )
        who = json.loads(ident)
        if who["node_id"] != node_id or who["group"] != group:
            raise LedgerError(
                f"the data dir {os.path.dirname(self.path) or self.path} belongs to node {who['node_id']!r} of group "
                f"{who['group']!r}, not to node {node_id!r} of group {group!r}: check --id, --group and --data-dir (kv.open: its id= and group=; a cluster member's dir is opened by kv serve)"
            )
        if "ledger_id" not in who:  # a ledger from before ledger ids
            txn.put(b"identity", json.dumps({**who, "ledger_id": ledger_id}).encode(), db=self._meta)
            return ledger_id
        return who["ledger_id"]

    def _verify_tail(self) -> None:
        """Read the last entry back: a torn or foreign file shows up here, not later."""
        if self._last > self.before_begin_index:
            (e,) = self.entries(self._last, self._last + 1, 1 << 62)
            if not self._run_terms or self.term(self._last) != e.term:
                raise LedgerError(
                    f"the ledger in {self.path} is inconsistent (term index disagrees with entry "
                    f"{self._last}); remove this node's data dir and let it catch up from the cluster"
                )

    # -- LogStorage ------------------------------------------------------------------------

    def last_index(self) -> int:
        return self._last

    def term(self, index: int) -> int:
        if index == self.before_begin_index:
            return self.before_begin_term
        if not (self.before_begin_index < index <= self._last):
            raise IndexError(f"no entry {index} in ledger ({self.before_begin_index}, {self._last}]")
        return self._run_terms[bisect.bisect_right(self._run_starts, index) - 1]

    def entries(self, lo: int, hi: int, max_bytes: int) -> list[Entry]:
        out: list[Entry] = []
        total = 0
        with self._env.begin(db=self._db, buffers=True) as txn:
            cur = txn.cursor()
            if not cur.set_key(_U64.pack(lo)):
                raise LedgerError(f"ledger entry {lo} is missing: the ledger is corrupt")
            expect = lo
            for k, v in cur:
                index = _U64.unpack(k)[0]
                if index >= hi:
                    break
                if index != expect:
                    raise LedgerError(f"ledger entry {expect} is missing: the ledger is corrupt")
                e = decode_entry(index, v)
                out.append(e)
                total += len(e.data) + 24
                expect += 1
                if total > max_bytes:
                    break
        return limit_bytes(out, max_bytes)

    # -- hard state ------------------------------------------------------------------------

    def hard_state(self) -> HardState:
        return self._hard_state

    # -- writing ---------------------------------------------------------------------------

    def write(self, writes: Sequence[LedgerWrite]) -> None:
        """Apply the writes in order in one transaction, then fsync (group commit)."""
        runs_before = (len(self._run_starts), self._run_starts[-1:], self._run_terms[-1:])
        state = (self.before_begin_index, self.before_begin_term, self._last, list(self._run_starts), list(self._run_terms))
        saves_vote = any(w.hard_state is not None for w in writes)
        try:
            with self._env.begin(write=True) as txn:
                for w in writes:
                    if w.hard_state is not None:
                        txn.put(b"hard_state", _encode_hard_state(w.hard_state), db=self._meta)
                    if w.reset_to is not None:
                        self._reset(txn, *w.reset_to)
                    if w.entries_from:
                        self._append(txn, w.entries_from, w.entries)
                if (len(self._run_starts), self._run_starts[-1:], self._run_terms[-1:]) != runs_before:
                    self._put_runs(txn)
                failpoints.hit("ledger.before_commit")
                if saves_vote:
                    failpoints.hit("hardstate.before_save")
        except lmdb.MapFullError as e:
            self._restore_state(state)
            raise LedgerError(
                f"the ledger in {self.path} is full (LMDB map size): take a snapshot to compact it, or raise the map size"
            ) from e
        except lmdb.Error as e:
            self._restore_state(state)
            raise LedgerError(f"writing the ledger in {self.path} failed: {e}") from e
        failpoints.hit("ledger.after_commit")
        if saves_vote:
            failpoints.hit("hardstate.after_save")
        for w in writes:
            if w.hard_state is not None:
                self._hard_state = w.hard_state

    def _restore_state(self, state) -> None:
        self.before_begin_index, self.before_begin_term, self._last, self._run_starts, self._run_terms = state

    def _append(self, txn, start: int, entries: Sequence[Entry]) -> None:
        if start <= self._last:
            self._delete_from(txn, start)
        if not entries:
            return
        assert entries[0].index == start == self._last + 1, "the ledger only grows at its end"
        pack = _U64.pack
        cur = txn.cursor(db=self._db)
        cur.putmulti([(pack(e.index), encode_entry(e)) for e in entries], append=True)
        starts, terms = self._run_starts, self._run_terms
        for e in entries:
            if not terms or terms[-1] != e.term:
                starts.append(e.index)
                terms.append(e.term)
        self._last = entries[-1].index

    def _delete_from(self, txn, start: int) -> None:
        cur = txn.cursor(db=self._db)
        if cur.set_range(_U64.pack(start)):
            while cur.delete():
                pass
        self._last = start - 1
        k = bisect.bisect_left(self._run_starts, start)
        del self._run_starts[k:], self._run_terms[k:]

    def _reset(self, txn, index: int, term: int) -> None:
        txn.drop(self._db, delete=False)
        self._set_before_begin(txn, index, term)
        self._last = index
        self._run_starts, self._run_terms = [], []

    def _set_before_begin(self, txn, index: int, term: int) -> None:
        txn.put(b"before_begin", _TWO_U64.pack(index, term), db=self._meta)
        self.before_begin_index, self.before_begin_term = index, term

    def _put_runs(self, txn) -> None:
        flat = [x for pair in zip(self._run_starts, self._run_terms) for x in pair]
        txn.put(b"term_runs", struct.pack(f">{len(flat)}Q", *flat), db=self._meta)

    def compact(self, index: int) -> None:
        """Drop entries up to and including index (they are in a snapshot now), moving
        ledgerBeforeBeginIndex/Term; both are persisted (DLedger keeps the term in memory
        only)."""
        if index <= self.before_begin_index:
            return
        if index > self._last:
            raise ValueError(f"cannot compact to {index}: the ledger ends at {self._last}")
        term = self.term(index)
        with self._env.begin(write=True) as txn:
            cur = txn.cursor(db=self._db)
            if cur.first():
                # delete() moves to the next record; past the last one key() is empty. (Keys
                # are big-endian: bytes order as their indexes do.)
                last = _U64.pack(index)
                while (key := cur.key()) and key <= last:
                    if not cur.delete():
                        break
            self._set_before_begin(txn, index, term)
            k = bisect.bisect_right(self._run_starts, index) - 1  # the run holding `index`
            if k > 0:
                del self._run_starts[:k], self._run_terms[:k]
            self._put_runs(txn)

    def stats(self) -> dict:
        info = self._env.info()
        return {"map_size": info["map_size"], "last_pgno": info["last_pgno"], "page_size": self._env.stat()["psize"]}

    def close(self) -> None:
        self._env.close()


def _encode_hard_state(hs: HardState) -> bytes:
    return _U64.pack(hs.term) + (hs.vote or "").encode()


def _decode_hard_state(raw: bytes) -> HardState:
    return HardState(_U64.unpack_from(raw)[0], raw[8:].decode() or None)
