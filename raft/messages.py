"""The vocabulary of the Raft core: roles, DLedger's result codes, entries and messages.

Everything here is plain data. Messages are frozen, slotted dataclasses; `codec.py` turns
them into bytes and back. Node ids are strings ("n1"); indexes and terms are ints, and index 0
/ term 0 mean "nothing" (the log's first entry has index 1).

Result codes follow DLedger (seeds/000, /003) so that its documents read naturally against
this code. Where this implementation behaves like Raft/etcd instead of DLedger, the code is
still DLedger's, with a note on when it is sent:

- A node that sees a vote or heartbeat with a higher term adopts that term at once and
  evaluates the request in the same step (Raft §5.1), so it never answers DLedger's
  REJECT_TERM_NOT_READY / TERM_NOT_READY (which forces a second round). Those two codes are
  kept in the enums for the vocabulary only; nothing here sends them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple


class Role(enum.IntEnum):
    FOLLOWER = 0
    PRE_CANDIDATE = 1  # pre-vote phase (Raft thesis §9.6); the term is not yet incremented
    CANDIDATE = 2
    LEADER = 3

    @property
    def label(self) -> str:
        return self.name.lower()


class VoteResult(enum.IntEnum):
    """DLedger's VoteResponse.RESULT."""

    UNKNOWN = 0
    ACCEPT = 1
    REJECT_UNKNOWN_LEADER = 2  # the candidate is not a voting member
    REJECT_UNEXPECTED_LEADER = 3  # a vote request that claims to come from ourselves
    REJECT_EXPIRED_VOTE_TERM = 4  # the candidate's term is older than ours
    REJECT_ALREADY_VOTED = 5  # we voted for someone else in this term
    REJECT_ALREADY_HAS_LEADER = 6  # we follow a live leader (leader lease / check quorum)
    REJECT_TERM_NOT_READY = 7  # vocabulary only, see the module docstring
    REJECT_TERM_SMALL_THAN_LEDGER = 8  # the candidate's term is below our last entry's term
    REJECT_EXPIRED_LEDGER_TERM = 9  # the candidate's last entry has an older term than ours
    REJECT_SMALL_LEDGER_END_INDEX = 10  # same last term, shorter log
    REJECT_TAKING_LEADERSHIP = 11  # we are taking over leadership by a transfer


class HeartbeatCode(enum.IntEnum):
    """DLedger's heartbeat response codes."""

    SUCCESS = 0
    EXPIRED_TERM = 1  # the sender's term is older than ours
    INCONSISTENT_LEADER = 2  # we follow another leader in this very term (must not happen)
    TERM_NOT_READY = 3  # vocabulary only, see the module docstring
    UNKNOWN_MEMBER = 4  # the sender is not a member of our group
    # The heartbeat's commit index (never past what we acknowledged) is past our log's end:
    # we lost entries we had acknowledged (a wiped data dir). Not DLedger's.
    LOST_ENTRIES = 5


class PushType(enum.IntEnum):
    """DLedger's PushEntryRequest.Type: the EntryDispatcher's requests."""

    APPEND = 0
    COMMIT = 1
    COMPARE = 2
    TRUNCATE = 3
    INSTALL_SNAPSHOT = 4


class PushCode(enum.IntEnum):
    SUCCESS = 0
    INCONSISTENT_STATE = 1  # prev entry missing or of another term; hints say where to look
    EXPIRED_TERM = 2
    INCONSISTENT_LEADER = 3
    UNKNOWN_MEMBER = 4


class EntryKind(enum.IntEnum):
    NORMAL = 0  # an opaque command for the state machine
    NOOP = 1  # appended by every new leader so earlier terms' entries can commit (Raft §8)
    CONFIG = 2  # a membership change (raft.membership)


class Entry(NamedTuple):
    index: int
    term: int
    kind: int
    data: bytes


class HardState(NamedTuple):
    term: int
    vote: str | None


class SnapshotMeta(NamedTuple):
    """What the core knows of a snapshot: the last entry it includes, and the membership."""

    index: int
    term: int
    membership: bytes  # an encoded raft.membership.Membership


# ---------------------------------------------------------------------------------------
# Messages between nodes. `src`/`dst` identify nodes by id, never by address.


@dataclass(slots=True, frozen=True)
class VoteRequest:
    src: str
    dst: str
    term: int  # for a pre-vote: the term the candidate would campaign in
    ledger_end_index: int
    ledger_end_term: int
    pre_vote: bool = False
    transfer: bool = False  # campaign started by a leadership transfer: ignore leader leases


@dataclass(slots=True, frozen=True)
class VoteResponse:
    src: str
    dst: str
    term: int
    result: VoteResult
    pre_vote: bool = False


@dataclass(slots=True, frozen=True)
class HeartbeatRequest:
    src: str
    dst: str
    term: int
    commit_index: int  # min(leader commit, what this follower is known to hold)
    read_seq: int = 0  # read-index round this heartbeat belongs to (0: none)


@dataclass(slots=True, frozen=True)
class HeartbeatResponse:
    src: str
    dst: str
    term: int
    code: HeartbeatCode
    read_seq: int = 0


@dataclass(slots=True, frozen=True)
class PushRequest:
    src: str
    dst: str
    term: int
    type: PushType
    seq: int  # the dispatcher's epoch for this follower; answers to older epochs are stale
    prev_index: int
    prev_term: int
    entries: tuple[Entry, ...] | list[Entry] = ()
    commit_index: int = 0
    # The leader's last index when the request was made (0: not said, a version before
    # 2026-12-07 but for TRUNCATE): the follower's answer to TRUNCATE reads it, and a
    # follower that committed entries of earlier terms beyond it stops (core._handle_push).
    leader_end_index: int = 0


@dataclass(slots=True, frozen=True)
class PushResponse:
    src: str
    dst: str
    term: int
    type: PushType
    seq: int
    code: PushCode
    index: int = 0  # SUCCESS: entries up to here match the leader's
    end_index: int = 0  # the follower's ledgerEndIndex
    x_term: int = 0  # INCONSISTENT_STATE: term of the follower's conflicting entry (0: none)
    x_index: int = 0  # ... and the first index the follower holds of that term


@dataclass(slots=True, frozen=True)
class InstallSnapshotRequest:
    """Sent to the follower's core once the driver has received and verified a whole
    snapshot file (chunks travel as SnapshotChunk, outside the core)."""

    src: str
    dst: str
    term: int
    seq: int
    snapshot: SnapshotMeta


@dataclass(slots=True, frozen=True)
class TimeoutNow:
    """Leadership transfer: the leader tells a caught-up follower to campaign now."""

    src: str
    dst: str
    term: int


@dataclass(slots=True, frozen=True)
class ReadIndexRequest:
    """A follower asks the leader for a read index (Raft thesis §6.4)."""

    src: str
    dst: str
    term: int
    ctx: int


@dataclass(slots=True, frozen=True)
class ReadIndexResponse:
    src: str
    dst: str
    term: int
    ctx: int
    index: int  # 0 with ok=False: the leader could not serve it (not leader any more)
    ok: bool


# Driver-level messages: they travel over the same connections but the core never sees them.
# Snapshot chunks (install-snapshot streaming) and forwarded client writes.


@dataclass(slots=True, frozen=True)
class SnapshotChunk:
    src: str
    dst: str
    term: int
    seq: int  # the leader's dispatcher epoch, echoed in the follower's final answer
    snapshot_index: int
    snapshot_term: int
    offset: int
    total_size: int
    data: bytes
    done: bool


@dataclass(slots=True, frozen=True)
class SnapshotChunkAck:
    src: str
    dst: str
    term: int
    snapshot_index: int
    next_offset: int  # where the follower wants the next chunk from (resume point)
    ok: bool


class ForwardCode(enum.IntEnum):
    OK = 0
    NOT_LEADER = 1  # `leader` names the one we know of; retry there
    TRANSFERRING = 2
    OVERLOADED = 3
    STOPPED = 4  # the leader stopped before the outcome was known
    REJECTED = 5  # the leader could not take the command (detail in payload)
    NO_SPACE = 6  # the leader's disk is (nearly) full: it takes no writes for now


@dataclass(slots=True, frozen=True)
class ForwardRequest:
    """A follower hands a client's command to the leader over the peer link."""

    src: str
    dst: str
    req_id: int
    payload: bytes


@dataclass(slots=True, frozen=True)
class ForwardResponse:
    src: str
    dst: str
    req_id: int
    code: ForwardCode
    index: int = 0
    term: int = 0
    leader: str = ""
    payload: bytes = b""  # the encoded apply result (OK) or an error message


CoreMessage = (
    VoteRequest
    | VoteResponse
    | HeartbeatRequest
    | HeartbeatResponse
    | PushRequest
    | PushResponse
    | InstallSnapshotRequest
    | TimeoutNow
    | ReadIndexRequest
    | ReadIndexResponse
)
Message = CoreMessage | SnapshotChunk | SnapshotChunkAck | ForwardRequest | ForwardResponse


def superseded_acks_dropped(msgs: list[Message]) -> list[Message]:
    """The messages of one ledger write, less each APPEND ack that another ack in the same
    write makes redundant: acks are cumulative (the leader's Progress.ack), so of the acks
    to one leader for one replication stream (term and seq) only the highest counts. A
    follower that took several append frames into one fsync answers them with one frame,
    and the leader steps one answer instead of several."""
    best: dict[tuple, int] = {}
    acks = 0
    for i, m in enumerate(msgs):
        if _is_append_ack(m):
            acks += 1
            key = (m.dst, m.term, m.seq)
            j = best.get(key)
            if j is None or msgs[j].index <= m.index:
                best[key] = i
    if len(best) == acks:
        return msgs
    keep = set(best.values())
    return [m for i, m in enumerate(msgs) if i in keep or not _is_append_ack(m)]


def _is_append_ack(m: Message) -> bool:
    return type(m) is PushResponse and m.code == PushCode.SUCCESS and m.type == PushType.APPEND
