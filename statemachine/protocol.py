"""The contract between the replicated log and what it drives (DLedger's StateMachine:
onApply / onSnapshotSave / onSnapshotLoad / onShutdown; hashicorp's FSM), as the LevelDB
machine implements it and its callers use it: the FSM caller (apply, reopen), the snapshot
layer through the node (capture, sync, restore), the node at start (applied,
membership) and the watch hub (on_changes, history_changes).
`tests/test_statemachine.py` checks that LevelDBStateMachine has every member named here
with the same parameters."""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from typing import Any, Protocol

from ..raft.messages import Entry


class SnapshotView(Protocol):
    """A frozen, point-in-time view of the state (taking it is cheap); the snapshot writer
    streams it to a file while applying goes on."""

    index: int  # the last applied entry the view includes
    term: int
    membership: bytes

    def items(self) -> Iterator[tuple[bytes, bytes, int]]:
        """(key, value, mod_index) in key order."""
        ...

    def blocks(self, block_bytes: int, lo: bytes | None = None, hi: bytes | None = None) -> Iterator[tuple[list[bytes], list[bytes], bytes]]:
        """The same records as columns of about block_bytes each: (keys, values, mod_indexes
        as int64 little-endian), so a writer handles them without a step per record; with
        lo or hi, only the user keys of [lo, hi) (hi None: to the last; an export's range)."""
        ...

    def user_key_splits(self, lo: bytes, hi: bytes | None, parts: int) -> tuple[int | None, list[bytes]]:
        """Up to parts - 1 keys cutting the user keys of [lo, hi) into runs of about equal
        bytes, and how many keys there are (None: not counted)."""
        ...

    def release(self) -> None: ...


class StateMachine(Protocol):
    path: str  # where it keeps its state on disk (named in errors, checked for free space)
    on_changes: Callable[[list], None] | None  # told each applied batch's changes (the watch hub)

    def applied(self) -> tuple[int, int]:
        """The (index, term) of the last applied entry, as persisted."""
        ...

    def membership(self) -> bytes:
        """The membership as of the applied index (b"": none recorded yet)."""
        ...

    def apply(self, entries: Sequence[Entry], answering: Container[int] | None = None) -> list[Any]:
        """Apply committed entries in order, atomically together with the new applied
        index; return one result per entry (None where there is nothing to say). Reads
        inside a transaction are made only for the indexes in `answering` (None: all)."""
        ...

    def capture(self) -> SnapshotView:
        """onSnapshotSave, first half: pin the current state (cheap)."""
        ...

    def sync(self) -> None:
        """Make everything applied durable (before the ledger drops the entries)."""
        ...

    def history_changes(self, start: int, prefix: str, max_changes: int) -> tuple[list, int]:
        """The changes under prefix from revision `start` on, with the key before and
        after each, and the revision to go on from."""
        ...

    def watch_floor(self) -> int:
        """The oldest revision whose changes history_changes still has."""
        ...

    def close_for_restore(self) -> None:
        """The first step of loading a snapshot, on the thread that reads the state: close
        it, refusing every use until restore() has loaded the new one."""
        ...

    def restore(self, index: int, term: int, membership: bytes, items: Iterator[tuple[bytes, bytes, int]], removed: Iterable[str] = ()) -> int:
        """onSnapshotLoad: replace the whole state with a snapshot's (`removed`: the ids
        removed from the cluster as of it); returns the number of keys loaded."""
        ...

    def reopen(self) -> None:
        """Open the store again from disk after a write failed on a full disk."""
        ...

    def close(self) -> None: ...
