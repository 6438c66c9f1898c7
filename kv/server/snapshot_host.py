"""The node as the snapshot layer sees it (snapshot.manager.SnapshotHost)."""

from __future__ import annotations

from collections.abc import Callable

from .config import NodeConfig
from ..statemachine.leveldb import LevelDBStateMachine


class SnapshotHost:
    """Who the node is, when to snapshot, and its state machine's side of taking and loading
    a snapshot. `state()` is read late: the state machine is opened (or rebuilt) after the
    snapshot manager is made, from the snapshots it holds."""

    def __init__(self, config: NodeConfig, state: Callable[[], LevelDBStateMachine]) -> None:
        self._state = state
        self.node_id, self.group = config.id, config.group
        self.snapshot_threshold, self.snapshot_trailing = config.snapshot_threshold, config.snapshot_trailing

    @property
    def cluster_id(self) -> str:
        return self._state().cluster_id

    def capture(self):
        return self._state().capture()

    def not_capturable(self) -> str | None:
        # A node that joined holds the membership of the index it joined at, above what it
        # has applied while it catches up: a snapshot then would pair that membership with
        # an older index, and a node loading it would take the entries between as newer.
        sm = self._state()
        applied, joined = sm.applied()[0], sm.membership_index
        if applied < joined:
            return f"it joined the cluster at index {joined} and has applied up to {applied} so far"
        return None

    def sync_state(self) -> None:
        self._state().sync()

    def load_state(self, index: int, term: int, membership: bytes, records, removed=()) -> int:
        return self._state().restore(index, term, membership, records, removed)
