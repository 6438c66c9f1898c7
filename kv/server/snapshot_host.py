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

    def sync_state(self) -> None:
        self._state().sync()

    def load_state(self, index: int, term: int, membership: bytes, records, removed=()) -> int:
        return self._state().restore(index, term, membership, records, removed)
