"""The errors of the store API. Every message says what happened and what to do.

One hierarchy: everything a user can see is a KVError. The root and NotLeader live at the
bottom (raft/errors.py) so that every layer's own errors can derive from it; SnapshotError
is the snapshot layer's (snapshot/format.py). They are re-exported here.

    KVError
    ├── NotLeader ── NoQuorum                        NO_LEADER / NO_QUORUM, 503
    ├── BadRequest (ValueError) ── ValueTooLarge, FutureRevision  400 / 413 / 400
    ├── NotFound (KeyError) ── LeaseNotFound         404
    ├── PreconditionFailed                           412
    ├── Conflict ── MemberExists, SessionExpired     409
    ├── Timeout (TimeoutError)                       504
    ├── ReadsOmitted                                 200 (applied; HTTP marks the gets "omitted")
    ├── Unavailable                                  503
    ├── NoSpace                                      507 (the disk is below its reserve: reads go on)
    ├── Unauthorized, Forbidden                      401, 403
    ├── DataDirLocked                                409
    ├── Compacted ── WatchCompacted, RevisionCompacted  410
    ├── SnapshotError ── SnapshotFormatError, RestoreError (kv.snapshot)
    ├── SlowWatcher                                  503
    ├── LogStreamError (kv.common.entry_stream), CannotListen (kv.server.process)
    └── the layers' own, translated by kv.Node where they have a public meaning:
        RaftError (kv.raft.errors: TransferInProgress, LedgerError, ConfigChangeRefused,
        CodecError; kv.raft.node: NodeStopped, Overloaded, OutcomeUnknown ── DeadlineExceeded),
        kv.statemachine: CommandError, StateUnreadable (StateCorrupt, StateLoading: kv.Unavailable),
        StateLocked, ApplyFailed
"""

from __future__ import annotations

import os

from .raft.errors import KVError, NoSpace, NotLeader
from .snapshot.format import SnapshotError
from .statemachine.commands import shown_key

__all__ = [
    "BadRequest",
    "Compacted",
    "Conflict",
    "DataDirLocked",
    "Forbidden",
    "FutureRevision",
    "KVError",
    "LeaseNotFound",
    "MemberExists",
    "NoQuorum",
    "NoSpace",
    "NotFound",
    "NotLeader",
    "PreconditionFailed",
    "ReadsOmitted",
    "RevisionCompacted",
    "SessionExpired",
    "SnapshotError",
    "Timeout",
    "Unauthorized",
    "Unavailable",
    "ValueTooLarge",
]



class BadRequest(KVError, ValueError):
    """The request is malformed (bad key, bad body); nothing was changed."""

    code, http_status = "BAD_REQUEST", 400


class ValueTooLarge(BadRequest):
    code, http_status = "VALUE_TOO_LARGE", 413


class FutureRevision(BadRequest):
    """A read at a revision this node has not reached (etcd's ErrFutureRev)."""

    code = "FUTURE_REVISION"


class NotFound(KVError, KeyError):
    code, http_status = "NOT_FOUND", 404

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "not found"


class LeaseNotFound(NotFound):
    """The lease does not exist: it expired, was revoked, or was never granted. Nothing was
    written; grant a new lease."""

    code = "LEASE_NOT_FOUND"

    def __init__(self, lease: int, message: str | None = None) -> None:
        self.lease = lease
        super().__init__(message or f"lease {lease} does not exist (it expired, was revoked, or was never granted); grant a new one")

    def details(self) -> dict:
        return {"lease": self.lease}


class KeyNotFound(NotFound):
    """A put that keeps the key's value or lease (etcd's ignore_value / ignore_lease) on a
    key that does not exist; nothing was written."""

    code = "KEY_NOT_FOUND"

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"key {shown_key(key)} does not exist: a put that keeps its value or lease needs the key; write it in full")


class LeaseExists(KVError):
    """A lease was asked for with an id that another lease has; nothing was granted."""

    code, http_status = "LEASE_EXISTS", 409

    def __init__(self, lease: int) -> None:
        self.lease = lease
        super().__init__(f"lease {lease} exists already: ask for another id, or for none (the node picks one)")


class PreconditionFailed(KVError):
    """A condition (If-Match, If-None-Match, a txn compare) did not hold; nothing changed."""

    code, http_status = "PRECONDITION_FAILED", 412

    def __init__(self, key: str, mod_index: int, message: str | None = None) -> None:
        self.key, self.mod_index = key, mod_index
        now = f"its mod_index is now {mod_index}" if mod_index else "it does not exist"
        super().__init__(message or f"the condition on key {shown_key(key)} did not hold ({now}); read it again and retry")

    def details(self) -> dict:
        return {"key": self.key, "mod_index": self.mod_index}


class NoQuorum(NotLeader):
    """The node cannot reach a majority, so it cannot confirm a read or commit a write."""

    code = "NO_QUORUM"


class Conflict(KVError):
    """The request conflicts with the cluster's current state (a member that already
    exists, a membership change still in progress, a learner not yet caught up)."""

    code, http_status = "CONFLICT", 409


class MemberExists(Conflict):
    """The id is already a member of the cluster, with other addresses: a permanent refusal
    (remove it first, or replace its addresses)."""

    code = "MEMBER_EXISTS"


class SessionExpired(Conflict):
    """The write's client session is not open: it was idle longer than --session-ttl-s,
    evicted beyond --max-sessions, or never opened. The write was not applied; open a new
    session (POST /v1/sessions) and send it there. (kv.Client and kv.Node do that
    themselves; if the write had been sent in the closed session before, its outcome is
    unknown, and they raise kv.Timeout instead.)"""

    code = "SESSION_EXPIRED"

    def __init__(self, session: int, message: str | None = None) -> None:
        self.session = session
        super().__init__(
            message
            or f"session {session} is not open (idle longer than --session-ttl-s, evicted beyond --max-sessions, or never "
            "opened), and this copy of the write was not applied. If no copy was sent before, send it in a new session "
            "(POST /v1/sessions); if one was, it may have been applied before the session closed: its outcome is unknown, "
            "read the key before sending it again"
        )

    def details(self) -> dict:
        return {"session": self.session}


class ReadsOmitted(KVError):
    """The transaction WAS applied (at `.index`; `.succeeded` says which branch ran), but its
    gets' values are not returned: they came to more than the answering node's
    --max-txn-read-bytes when it was applied (values grew after the request was checked), or
    it was a copy of a request whose answer was too large to keep. `.results` has the
    transaction's results, with None for each get that was omitted. Read those keys one by
    one; do not send the transaction again as a new one."""

    code, http_status = "READS_OMITTED", 200

    def __init__(self, index: int, term: int, succeeded: bool, results: tuple, omitted: list[str], message: str | None = None) -> None:
        self.index, self.term, self.succeeded, self.results, self.omitted = index, term, succeeded, results, omitted
        super().__init__(
            message
            or f"the transaction was applied at index {index} ({'success' if succeeded else 'failure'} branch: its writes are in), "
            f"but the values of its gets of {', '.join(repr(k) for k in omitted[:5])}{' ...' if len(omitted) > 5 else ''} are not "
            "returned (they came to more than the node's --max-txn-read-bytes when it was applied): read those keys one by one"
        )


class Timeout(KVError, TimeoutError):
    """The write was not confirmed in time: it may or may not have been committed. Read the
    key to find out before retrying a non-idempotent write."""

    code, http_status = "TIMEOUT", 504


class Unavailable(KVError):
    """The node is stopping, stopped, or overloaded; retry against it later or use another."""

    code, http_status = "UNAVAILABLE", 503


class Unauthorized(KVError):
    code, http_status = "UNAUTHORIZED", 401


class WrongCluster(KVError):
    """The node belongs to another cluster than the one the client reached first: its
    endpoints mix two clusters. Nothing was done."""

    code, http_status = "WRONG_CLUSTER", 421


class DataDirLocked(KVError):
    """The data dir is in use by another owner (a process, or another store in this one).
    Nothing in it was read or changed."""

    code, http_status = "DATA_DIR_LOCKED", 409

    def __init__(self, data_dir: str, pid: int | None = None) -> None:
        self.data_dir, self.pid = data_dir, pid
        if pid == os.getpid():
            who = "this process (it is already open here: use that store, or close it first)"
        elif pid:
            who = f"process {pid} (stop it first, or use another data dir)"
        else:
            who = "another process (stop it first, or use another data dir)"
        super().__init__(f"the data dir {data_dir} is in use by {who}; a data dir has one owner")


class Forbidden(KVError):
    """The token is valid, but its role or key prefix does not allow this request."""

    code, http_status = "FORBIDDEN", 403


class Compacted(KVError):
    """What was asked for is older than what the node still keeps (compacted away)."""

    code, http_status = "COMPACTED", 410


class RevisionCompacted(Compacted):
    """A read at a revision older than the history keeps (a Compact, or auto-compaction,
    dropped it): read at `compact_revision` or later."""

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision

    def details(self) -> dict:
        return {"compact_revision": self.compact_revision}


class WatchCompacted(Compacted):
    """The changes asked for are no longer kept on this node (its ledger was compacted into
    a snapshot, or its history by a Compact). Read the prefix, then watch from the index
    the read was at + 1. `oldest_index`: the first index a watch can start at here."""

    def __init__(self, message: str, ledger_begin_index: int, oldest_index: int | None = None) -> None:
        super().__init__(message)
        self.ledger_begin_index = ledger_begin_index
        self.oldest_index = oldest_index if oldest_index is not None else ledger_begin_index + 1

    def details(self) -> dict:
        return {"ledger_begin_index": self.ledger_begin_index, "oldest_index": self.oldest_index}


class SlowWatcher(KVError):
    """The watcher fell too far behind; the stream was ended. Resume from `resume_index`."""

    code, http_status = "SLOW_WATCHER", 503

    def __init__(self, message: str, resume_index: int) -> None:
        super().__init__(message)
        self.resume_index = resume_index

    def details(self) -> dict:
        return {"resume_index": self.resume_index}
