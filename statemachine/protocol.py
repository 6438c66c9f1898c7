"""The contract between the replicated log and what it drives (DLedger's StateMachine:
onApply / onSnapshotSave / onSnapshotLoad / onShutdown; hashicorp's FSM)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
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

    def release(self) -> None: ...


class StateMachine(Protocol):
    def applied(self) -> tuple[int, int]:
        """The (index, term) of the last applied entry, as persisted."""
        ...

    def apply(self, entries: Sequence[Entry]) -> list[Any]:
        """Apply committed entries in order, atomically together with the new applied
        index; return one result per entry (None where there is nothing to say)."""
        ...

    def capture(self) -> SnapshotView:
        """onSnapshotSave, first half: pin the current state (cheap)."""
        ...

    def restore(self, index: int, term: int, membership: bytes, items: Iterator[tuple[bytes, bytes, int]]) -> None:
        """onSnapshotLoad: replace the whole state with a snapshot's."""
        ...

    def reopen(self) -> None:
        """Open the store again from disk after a write failed on a full disk."""
        ...

    def close(self) -> None: ...
