"""The core's view of the replicated log: what is persisted (through a read-only storage
interface) plus what is not yet persisted (the unstable tail), plus a cache of recent entries.

The ledger (LMDB) implements `LogStorage`; tests use `MemoryStorage`. Nothing here does I/O
itself: reads go through the storage interface, writes leave as `Ready.entries` and come
back as `stable_to()` once the driver has fsynced them.

Index layout (DLedger's names):

    ledgerBeforeBeginIndex = before_index      (compacted into a snapshot, term known)
    (before_index, u_offset)                   persisted in storage; the newest of them cached
    [u_offset, last_index()]                   unstable: appended here, not yet fsynced

Invariant: before_index < u_offset <= last_index() + 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .messages import Entry

ENTRY_OVERHEAD = 24  # bytes counted per entry on top of its data when sizing batches


def entry_size(entry: Entry) -> int:
    return len(entry.data) + ENTRY_OVERHEAD


class LogStorage(Protocol):
    """Read access to the persisted log."""

    @property
    def before_begin_index(self) -> int: ...

    @property
    def before_begin_term(self) -> int: ...

    def last_index(self) -> int: ...

    def term(self, index: int) -> int:
        """Term of the entry at `index`, for before_begin_index < index <= last_index()."""
        ...

    def entries(self, lo: int, hi: int, max_bytes: int) -> list[Entry]:
        """Entries [lo, hi); at least one if lo < hi, then stop before exceeding max_bytes."""
        ...


class MemoryStorage:
    """An in-memory LogStorage, also writable: the simulator's stand-in for the ledger."""

    def __init__(self) -> None:
        self.before_begin_index = 0
        self.before_begin_term = 0
        self._entries: list[Entry] = []  # entries[k] has index before_begin_index + 1 + k

    def last_index(self) -> int:
        return self.before_begin_index + len(self._entries)

    def term(self, index: int) -> int:
        if index == self.before_begin_index:
            return self.before_begin_term
        return self._entries[index - self.before_begin_index - 1].term

    def entries(self, lo: int, hi: int, max_bytes: int) -> list[Entry]:
        off = self.before_begin_index + 1
        return limit_bytes(self._entries[lo - off : hi - off], max_bytes)

    def write(self, from_index: int, entries: Sequence[Entry]) -> None:
        """Drop everything at or after from_index, then append `entries` (which start there)."""
        keep = from_index - self.before_begin_index - 1
        assert keep >= 0, "write below the compacted prefix"
        del self._entries[keep:]
        self._entries.extend(entries)

    def compact(self, index: int, term: int) -> None:
        """Forget entries up to and including `index` (now covered by a snapshot)."""
        drop = index - self.before_begin_index
        if drop <= 0:
            return
        del self._entries[:drop]
        self.before_begin_index, self.before_begin_term = index, term

    def reset(self, index: int, term: int) -> None:
        """Make the log empty after (index, term): install-snapshot on a follower."""
        self._entries = []
        self.before_begin_index, self.before_begin_term = index, term


def limit_bytes(entries: list[Entry], max_bytes: int) -> list[Entry]:
    """Cut a batch so that it stays under max_bytes, keeping at least one entry."""
    total = 0
    for k, e in enumerate(entries):
        total += len(e.data) + ENTRY_OVERHEAD
        if total > max_bytes and k > 0:
            return entries[:k]
    return entries


class RaftLog:
    def __init__(self, storage: LogStorage, cache_entries: int = 16384, cache_bytes: int = 16 << 20) -> None:
        self.storage = storage
        self.before_index = storage.before_begin_index
        self.before_term = storage.before_begin_term
        self._u_offset = storage.last_index() + 1
        self._unstable: list[Entry] = []
        self._handed = 0  # how many unstable entries were handed out for persisting
        self._rewrite = False  # storage holds entries past a truncation point: drop them
        # Entries up to durable_index are fsynced and are the ones this log holds now.
        self.durable_index = self._u_offset - 1
        # Changes when a snapshot replaces the log: completions of writes handed out before
        # that are ignored (what they wrote is gone with the reset).
        self.epoch = 0
        self._cache: list[Entry] = []  # persisted entries [cache_offset, u_offset)
        self._cache_offset = self._u_offset
        # The cache keeps the newest persisted entries (followers that are a little behind,
        # the FSM caller) off the disk; bounded in entries and in bytes (entries can be big
        # transactions).
        self._cache_cap = cache_entries
        self._cache_bytes_cap = cache_bytes
        self._cache_bytes = 0

    # -- reading ---------------------------------------------------------------------------

    def last_index(self) -> int:
        return self._u_offset - 1 + len(self._unstable)

    def last_term(self) -> int:
        t = self.term(self.last_index())
        assert t is not None
        return t

    def persisting_index(self) -> int:
        """The last index handed out for persisting (not necessarily fsynced yet)."""
        return self._u_offset - 1 + self._handed

    def has_unpersisted(self) -> bool:
        return self._handed != len(self._unstable) or self._rewrite

    def term(self, index: int) -> int | None:
        """The term of the entry at index; None if compacted away or beyond the end."""
        if index >= self._u_offset:
            k = index - self._u_offset
            return self._unstable[k].term if k < len(self._unstable) else None
        if index == self.before_index:
            return self.before_term
        if index < self.before_index:
            return None
        if index >= self._cache_offset:
            return self._cache[index - self._cache_offset].term
        return self.storage.term(index)

    def entries(self, lo: int, hi: int, max_bytes: int, max_count: int) -> list[Entry]:
        """Entries [lo, hi) (hi clipped to the end), at most max_count, about max_bytes."""
        hi = min(hi, self.last_index() + 1, lo + max_count)
        if lo >= hi:
            return []
        assert lo > self.before_index, "entries below ledgerBeforeBeginIndex are compacted"
        out: list[Entry] = []
        if lo < self._cache_offset:
            out = self.storage.entries(lo, min(hi, self._cache_offset), max_bytes)
            if len(out) < min(hi, self._cache_offset) - lo:
                return out  # the byte limit cut it short
            lo = self._cache_offset
        if lo < self._u_offset and lo < hi:
            c = self._cache_offset
            out += self._cache[lo - c : min(hi, self._u_offset) - c]
            lo = self._u_offset
        if lo < hi:
            u = self._u_offset
            out += self._unstable[lo - u : hi - u]
        return limit_bytes(out, max_bytes)

    def first_index_of_term(self, term: int, upto: int) -> int:
        """The first index in (before_index, upto] whose entry has `term`, or upto if the
        entry at upto has another term. Terms never decrease along a log, so this is a
        binary search (the fast-backup hint xIndex)."""
        lo, hi = self.before_index + 1, upto
        while lo < hi:
            mid = (lo + hi) // 2
            t = self.term(mid)
            assert t is not None
            if t < term:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def last_index_of_term(self, term: int, upto: int) -> int:
        """The last index <= upto whose entry has `term`; 0 if there is none."""
        lo, hi = self.before_index, min(upto, self.last_index())
        while lo < hi:  # largest i with term(i) <= term
            mid = (lo + hi + 1) // 2
            t = self.term(mid)
            assert t is not None
            if t <= term:
                lo = mid
            else:
                hi = mid - 1
        return lo if lo > self.before_index and self.term(lo) == term else 0

    # -- writing ---------------------------------------------------------------------------

    def append(self, entries: Sequence[Entry]) -> None:
        """Append entries that continue the log (the leader's proposals)."""
        self._unstable.extend(entries)

    def truncate_and_append(self, from_index: int, entries: Sequence[Entry]) -> None:
        """Replace everything at or after from_index with `entries` (possibly none)."""
        assert from_index > self.before_index
        if from_index <= self.persisting_index():
            self._rewrite = True
        self.durable_index = min(self.durable_index, from_index - 1)
        if from_index >= self._u_offset:
            k = from_index - self._u_offset
            del self._unstable[k:]
            self._handed = min(self._handed, k)
        else:
            self._u_offset = from_index
            self._unstable = []
            self._handed = 0
            if from_index < self._cache_offset:
                self._cache, self._cache_bytes = [], 0
                self._cache_offset = from_index
            else:
                self._drop_cache_from(from_index - self._cache_offset)
        self._unstable.extend(entries)

    def take_unpersisted(self) -> tuple[int, list[Entry]] | None:
        """Hand out what has not been handed out for persisting: (from_index, entries). The
        storage must drop any entry at or after from_index before writing the entries. After
        a truncation this can be a bare truncation (no entries)."""
        if self._handed == len(self._unstable) and not self._rewrite:
            return None
        self._rewrite = False
        start = self._handed
        self._handed = len(self._unstable)
        return self._u_offset + start, self._unstable[start:]

    def persisted(self, entries: Sequence[Entry], epoch: int) -> None:
        """A write handed out by take_unpersisted() in `epoch` is fsynced: move its entries
        from the unstable tail to the cache."""
        if epoch != self.epoch:
            return
        u = self._unstable
        n = 0
        for e in entries:
            if n < len(u) and u[n].index == e.index and u[n].term == e.term:
                n += 1
            else:
                break
        if n:
            moved = u[:n]
            del u[:n]
            self._handed -= n
            self._u_offset += n
            self._cache.extend(moved)
            self._cache_bytes += sum(len(e.data) for e in moved)
            self._trim_cache()
        # Below the unstable tail everything is now on disk: writes complete in order, and
        # a truncation moves the tail down (and durable_index with it).
        self.durable_index = self._u_offset - 1

    def _trim_cache(self) -> None:
        """Drop the oldest cached entries once a cap is passed (to 3/4 of the byte cap, so
        that trimming happens in chunks, not per entry)."""
        cache = self._cache
        over = len(cache) - self._cache_cap
        if over <= self._cache_cap // 4 and self._cache_bytes <= self._cache_bytes_cap:
            return
        drop = max(over, 0)
        dropped = sum(len(e.data) for e in cache[:drop])
        while drop < len(cache) and self._cache_bytes - dropped > self._cache_bytes_cap * 3 // 4:
            dropped += len(cache[drop].data)
            drop += 1
        del cache[:drop]
        self._cache_bytes -= dropped
        self._cache_offset += drop

    def _drop_cache_from(self, k: int) -> None:
        """Forget cached entries from position k on."""
        self._cache_bytes -= sum(len(e.data) for e in self._cache[k:])
        del self._cache[k:]

    def restore(self, index: int, term: int) -> None:
        """Start over after (index, term): a snapshot replaces the whole log. Nothing of the
        new log is durable until the write that installs the snapshot completes."""
        self.epoch += 1
        self.durable_index = 0
        self.before_index, self.before_term = index, term
        self._u_offset = index + 1
        self._unstable = []
        self._handed = 0
        self._cache, self._cache_bytes = [], 0
        self._cache_offset = self._u_offset
        self._rewrite = False

    def compacted(self, index: int, term: int) -> None:
        """The storage dropped its prefix up to index (covered by a snapshot)."""
        if index <= self.before_index:
            return
        self.before_index, self.before_term = index, term
        if index >= self._cache_offset:
            drop = min(index + 1, self._u_offset) - self._cache_offset
            self._cache_bytes -= sum(len(e.data) for e in self._cache[:drop])
            del self._cache[:drop]
            self._cache_offset += drop
