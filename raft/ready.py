"""What the core hands out (`RaftCore.ready()`), in the order the driver handles it: see
core.py's docstring. Plain data."""

from __future__ import annotations

from dataclasses import dataclass, field

from .messages import CoreMessage, Entry, HardState, SnapshotMeta
from .readindex import ReadFailed, ReadState


@dataclass(frozen=True, slots=True)
class SnapshotSend:
    """The driver should stream the newest snapshot to `peer`, then `report_snapshot`."""

    peer: str
    seq: int


@dataclass(frozen=True, slots=True)
class LostEntries:
    """`peer` answered with a log that ends at `holds`, below the `acknowledged` index it
    had acknowledged in this term: its data dir was lost or replaced. It no longer counts
    toward a quorum for what it lost, and is caught up again (from a snapshot if need be)."""

    peer: str
    acknowledged: int
    holds: int


@dataclass(slots=True)
class Ready:
    hard_state: HardState | None = None
    snapshot: SnapshotMeta | None = None
    entries_from: int = 0  # with entries or a bare truncation: drop the ledger from here
    log_epoch: int = 0
    entries: list[Entry] = field(default_factory=list)
    messages: list[CoreMessage] = field(default_factory=list)
    persisted_messages: list[CoreMessage] = field(default_factory=list)
    # Apply entries up to here: committed, and fsynced on this node (so the state machine
    # never gets ahead of the local ledger).
    applicable_index: int | None = None
    read_states: list[ReadState] = field(default_factory=list)
    read_failures: list[ReadFailed] = field(default_factory=list)
    snapshot_sends: list[SnapshotSend] = field(default_factory=list)
    lost_entries: list[LostEntries] = field(default_factory=list)
    role_changed: bool = False  # role, term or leader changed since the last Ready
    membership_changed: bool = False  # a configuration was appended, truncated or installed

    @property
    def must_persist(self) -> bool:
        return self.hard_state is not None or self.snapshot is not None or self.entries_from > 0
