"""Client sessions inside the state machine: exactly-once writes (Raft dissertation §6.3,
LogCabin).

A write that reached the log may commit even when its sender never hears so: the leader
that appended it died after replicating it, a follower's forward lost its connection, a
client's connection reset. Sent again, it would be applied twice (a put moves its key's
mod_index after it was acknowledged and shows twice to watchers; a compare-and-set fails
against its own first copy and is answered 412). So every write carries (session, seq):
the state machine keeps, per session, the last request number it applied and that
request's result, and answers a copy with the result of the first instead of applying it
again.

One request at a time per session: a sender with several in flight uses several sessions
(kv.Client and kv.Node keep a pool of them, see kv/common/sessions.py and kv/server/writes.py). So the table holds one
(seq, result) per session, and a request numbered below the last is one its sender has
moved past (StaleRequest; never applied).

Sessions are opened through the log (SessionOpen, with an id the opener chose at random)
before they are used, and closed through the log: SessionsExpire(upto) closes those last
used at or before an index (the leader's clock decides when, kv/common/sessions.py and kv/server/writes.py), and opening
one more than the entry's max_sessions evicts one. Every replica does the same at the same
index.

Which one: the least recently used of the owner that holds the most (ties: the owner whose
least recently used session is the older). A session's owner is who opened it: a digest of
the token, for a token that is not admin (kv.Node.open_session); "node:" and its id, for the
sessions a node opens for the writes it is handed without one (kv/server/writes.py); ""
for the sessions others open (the admin's, kv.Node.open_session's). One tenant opening
sessions in a loop then evicts its own, never another's while it holds more than they do.
Owners are recorded once every member applies them (kv.Node.open_session): before, every
session's is "" and the least recently used goes. A write in a session that is not open is refused
(SessionExpired) and changes nothing, so a copy that arrives after its session closed can
never apply a second time.

They are stored as reserved records in the key space, like leases (leases.py), so that
snapshots, install-snapshot and restore carry them:

    "\\x00sess/" + id as 16 hex digits    mod_index = the index that last used it;
                                         value = the last seq (u64), its fingerprint (u32,
                                         fingerprint()) and its encoded result
    "\\x00sown/" + id as 16 hex digits    its owner (UTF-8), for a session that has one;
                                         mod_index = the index that opened it

(Keys in snapshots are UTF-8 text, so the id is written in hex.)

The same table lives in memory in least-recently-used order (rebuilt at open and after a
snapshot load by sorting on the index that last used each session: every entry uses at
most one, so the order is the same on every replica). Results are read back from the
record only to answer a copy. A copy must be the same request: one numbered like the last
request but with other bytes (a client reusing a number for a new write) is refused
(RequestMismatch), never answered with the other write's result.

An unconditional put, the hot path, does not rewrite its session's record: its answer is
PutResult(its own index), which the log says. Its session is marked dirty in memory, and
the records are brought up to date (and `sessions_at`, the index as of which they are)
before a snapshot is taken and when the state machine closes. After a crash, a restart
replays the session headers of the ledger's entries after `sessions_at` (`replay`): the
ledger keeps them, as it is compacted only behind a snapshot. Everything else a session
does (its opening, closing, a result that is not a plain put's) is written in the entry's
own batch.
"""

from __future__ import annotations

import struct
import sys
import zlib
from collections import OrderedDict
from collections.abc import Iterable

from .commands import IN_SESSION, PUT_HEAD, SESSION_HEAD_BYTES, SESSION_IDS

SESSION_RECORD = b"\x00sess/"
SESSION_OWNER = b"\x00sown/"
SESSION_RESULT_MAX = 64 << 10  # a larger result (a transaction's gets) is kept as "applied, reads not kept"
_U64 = struct.Struct(">Q")
_SEQ_FP = struct.Struct(">QI")


def session_record(session: int) -> bytes:
    return SESSION_RECORD + b"%016x" % session


def owner_record(session: int) -> bytes:
    return SESSION_OWNER + b"%016x" % session


class SessionTable:
    def __init__(self) -> None:
        # session -> [last seq, index that last used it, whether its record holds that
        # request's result, its fingerprint, its owner]; least recently used first
        # (OrderedDicts: a session used moves to the end, and the first is found at once
        # however many came and went before it)
        self.last: OrderedDict[int, list] = OrderedDict()
        self.of_owner: dict[str, OrderedDict[int, None]] = {}  # owner -> its sessions, in the same order
        self.dirty: set[int] = set()  # sessions whose record a plain put left behind
        self.evicted = 0  # sessions closed to make room for new ones (a metric)

    def __len__(self) -> int:
        return len(self.last)

    def load(self, records: Iterable[tuple[bytes, int, bytes]]) -> None:
        """Rebuild from the reserved records: (key without the data prefix, mod_index,
        value without it)."""
        rows, owners = {}, {}
        for key, used, value in records:
            if key.startswith(SESSION_RECORD):
                seq, fp = _SEQ_FP.unpack_from(value)
                rows[int(key[len(SESSION_RECORD) :], 16)] = [seq, used, True, fp]
            elif key.startswith(SESSION_OWNER):
                owners[int(key[len(SESSION_OWNER) :], 16)] = value.decode()
        self.last, self.dirty = OrderedDict((k, v + [sys.intern(owners.get(k, ""))]) for k, v in rows.items()), set()
        self._sort()

    def _sort(self) -> None:
        """Put both orders in the order of the index that last used each session, the order
        every replica has (each entry uses at most one session)."""
        rows = sorted(self.last.items(), key=lambda row: row[1][1])
        self.last, self.of_owner = OrderedDict(), {}
        for session, s in rows:
            self._add(session, s)

    def _add(self, session: int, s: list) -> None:
        """A session at the most recently used end."""
        self.last[session] = s
        mine = self.of_owner.get(s[4])
        if mine is None:
            mine = self.of_owner[s[4]] = OrderedDict()
        mine[session] = None

    def use(self, session: int) -> list:
        """Session's row, moved to the most recently used end (the caller updates it)."""
        s = self.last[session]
        self.last.move_to_end(session)
        self.of_owner[s[4]].move_to_end(session)
        return s

    def _drop(self, session: int) -> str:
        """Close a session; returns its owner."""
        owner = self.last.pop(session)[4]
        self.dirty.discard(session)
        mine = self.of_owner[owner]
        del mine[session]
        if not mine:
            del self.of_owner[owner]
        return owner

    def replay(self, entries: Iterable) -> None:
        """Apply again what the plain puts of these entries (the ledger's, after the records'
        `sessions_at`) did to their sessions; everything else is in the records already.
        (The sessions replayed and those whose records are newer are put back in order at
        the end: a session used by a plain put before another's record was written goes
        before it.)"""
        last = self.last
        replayed = False
        for e in entries:
            head = plain_put_in_session(e.data) if e.kind == 0 else None
            if head is None:
                continue
            session, seq = head
            s = last.get(session)
            if s is not None and seq > s[0] and e.index > s[1]:
                s[0], s[1], s[2], s[3] = seq, e.index, False, fingerprint(e.data, SESSION_HEAD_BYTES)
                self.dirty.add(session)
                replayed = True
        if replayed:
            self._sort()

    def open(self, session: int, index: int, max_sessions: int, owner: str = "") -> list[tuple[int, str]]:
        """Open a session (again: a no-op); returns the sessions evicted to make room, each
        with its owner."""
        if session in self.last:
            return []
        evicted = []
        while len(self.last) >= max_sessions:
            # The owner holding the most (ties: the one whose least recently used is the older).
            last = self.last
            mine = max(self.of_owner.values(), key=lambda m: (len(m), -last[next(iter(m))][1]))
            oldest = next(iter(mine))
            evicted.append((oldest, self._drop(oldest)))
        self.evicted += len(evicted)
        self._add(session, [0, index, True, 0, sys.intern(owner)])  # (one string an owner: its sessions share it)
        return evicted

    def expire(self, upto: int) -> list[tuple[int, str]]:
        """Close the sessions last used at or before index `upto`; returns them, each with
        its owner."""
        gone = []
        for session, s in self.last.items():
            if s[1] > upto:
                break
            gone.append(session)
        return [(session, self._drop(session)) for session in gone]

    def oldest_use(self) -> int | None:
        """The index that used the least recently used session, if there is one."""
        for s in self.last.values():
            return s[1]
        return None


def record_value(seq: int, fp: int, result: bytes) -> bytes:
    return _SEQ_FP.pack(seq, fp) + result


RESULT_AT = 12  # where a record's value (after its mod_index) holds the result


def fingerprint(data: bytes, start: int) -> int:
    """What tells a copy of a request from another request under the same number: a
    checksum of the command's encoding (after the session header at `start`)."""
    return zlib.crc32(memoryview(data)[start:])


def plain_put_in_session(data: bytes) -> tuple[int, int] | None:
    """(session, seq) of an entry that is an unconditional put sent in a session, else None
    (the state machine's hot path, LevelDBStateMachine.apply: a put without a condition or
    a lease)."""
    h = SESSION_HEAD_BYTES
    if data[:2] != IN_SESSION or len(data) < h + 4 or data[h : h + 2] != PUT_HEAD:
        return None
    end = h + 4 + ((data[h + 2] << 8) | data[h + 3])
    if len(data) <= end or data[end] != 0:
        return None
    return SESSION_IDS.unpack_from(data, 2)
