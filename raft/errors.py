"""The root of ledgerkv's errors, and the errors the Raft layer raises to its callers.

raft/ is the bottom layer, so the root every layer's errors derive from lives here; `kv`
re-exports it as `kv.KVError` (and `NotLeader` as `kv.NotLeader`). Every exception a user
can see is a KVError: the public ones are in kv/errors.py, the layers' own (RaftError,
statemachine's StateCorrupt, snapshot's SnapshotError, ...) derive from it too, and kv.Node
turns those that have a public meaning into the public class (kv/errors.py, `public`).
"""

from __future__ import annotations


class KVError(Exception):
    """Base class of all ledgerkv errors. `code` is the HTTP error code name."""

    code = "INTERNAL"
    http_status = 500

    def details(self) -> dict:
        """Fields beside "code" and "message" in the HTTP error body."""
        return {}


class NotLeader(KVError):
    """No leader could take the request (this node is not the leader, none is known, or it
    cannot be reached). Nothing was written; retrying later is safe. `leader` is the
    leader this node knows of, if any."""

    code, http_status = "NO_LEADER", 503

    def __init__(self, message: str | None = None, leader: str | None = None) -> None:
        self.leader = leader
        if message is None:
            message = (
                f"this node is not the leader; the leader is {leader}: send the request there"
                if leader
                else "this node is not the leader and no leader is known yet: retry shortly"
            )
        super().__init__(message)


class NoSpace(KVError):
    """The node's disk has less free space than its reserve (--min-free-bytes), or is full:
    it takes no writes until there is room again (it resumes by itself), and still serves
    reads. Nothing was written."""

    code, http_status = "NO_SPACE", 507


class LeaderChanged(NotLeader):
    """The leader changed while a read waited for the old one's answer: ask the new one
    (the read barrier does so at once, instead of waiting out its deadline)."""


class RaftError(KVError):
    """Base class of the Raft layer's own errors below."""


class MemberRemoved(RaftError):
    """This node was removed from the cluster (most of the other members refuse it as such):
    it stops."""


class TransferInProgress(RaftError):
    """The leader is handing leadership over and refuses new writes meanwhile."""

    def __init__(self, transferee: str) -> None:
        self.transferee = transferee
        super().__init__(
            f"leadership is being transferred to {transferee}; retry in a moment (the new leader will take the write)"
        )


class LedgerError(RaftError):
    """The ledger on disk cannot be used as it is (corrupt, foreign or full)."""


class ConfigChangeRefused(RaftError):
    """A membership change was refused; nothing was changed. The message says why."""


class CommittedEntryConflict(RaftError):
    """The leader's log differs from this node's at an entry this node has committed (and
    applied): one of them does not hold what it acknowledged (a data dir put back from an
    older copy, a disk that lost writes). Raft cannot go on safely from there (etcd panics
    alike): the node stops rather than overwrite, or serve, what it applied."""

    def __init__(self, node: str, leader: str, term: int, index: int, ours: int | None, theirs: int | None) -> None:
        held = "no entry" if theirs is None else f"an entry of term {theirs}"
        super().__init__(
            f"node {node}: leader {leader} (term {term}) holds {held} at index {index}, which this node "
            f"committed and applied with term {ours}: one of them lost entries it had acknowledged (a data dir put back "
            "from an older copy, or a disk that lost writes). Stopping rather than overwrite or serve it. Find the nodes "
            "that hold every acknowledged write (kv status: the highest applied index, each node's log), and bring the "
            "others back from them (kv member remove, then kv serve --join with an empty data dir)"
        )
