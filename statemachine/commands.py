"""KV commands: what a NORMAL log entry carries, in a versioned binary format.

    byte 0   format version (COMMAND_FORMAT); a newer reader keeps decoding older versions
    byte 1   opcode
    ...      opcode-specific fields; keys are u16-length-prefixed UTF-8, values u32-length

Commands:

- Put(key, value, cond)      write; with a condition it is a compare-and-set
- Delete(key, cond)          remove
- DeletePrefix(prefix)       remove every key under a prefix, at one index
- Txn(conds, ops, else_ops)  if every condition holds run `ops`, else `else_ops`, atomically
                             (ops: Put, Delete, Get)
- LeaseGrant(ttl_ms, lease, owner)  a lease with this id (chosen at random by the node that
                             proposes it; 0 in entries from before: the entry's index),
                             granted by a token scoped to key prefix `owner` ("": any)
- LeaseRevoke(lease)         end a lease and delete its keys (the leader commits one when a
                             lease expires on its clock)
- SessionOpen(session, max)  open a client session (Raft dissertation §6.3; see sessions.py)
- InSession(session, seq, cmd)  a write sent in a session: applied at most once, a repeat
                             is answered with the first one's result
- SessionsExpire(upto)       close the sessions last used at or before index `upto` (the
                             leader commits one when they have been idle --session-ttl-s)
- TxnReq(compares, success, failure)  etcd's v3 transaction (what the v3 API's Put,
                             DeleteRange and Txn become): compares on a key's version,
                             create/mod revision, value or lease, over one key or a range;
                             ops RangeReq, PutReq, DeleteRangeReq and nested TxnReq
- AlarmSet(member, alarm, active)  raise or clear an alarm of a member (0: the cluster):
                             while a NOSPACE one is raised, writes that add data are refused
- Compact(revision)          etcd's Compact: no read or watch at or below `revision` is
                             served from now on (ledgerkv keeps no older versions to drop)
- ClusterId(cluster_id)      the cluster's identity, in the no-op of a new cluster's first
                             entry (never a normal entry): peers of another cluster are
                             not let in
- Bulk(rows)                 put many keys at one index, each only if its own condition
                             holds (a mod_index, or none); rows.py holds the columnar format

A Put with `lease` attaches the key to that lease (refused with NoSuchLease when the lease
does not exist); a Put without one, or a Delete, detaches it. Two more commands never enter
the log: LeaseKeepAlive and LeaseQuery are answered by the leader from its own clock (a
follower forwards them), see kv/server/lessor.py.

A condition compares a key's `mod_index` (the log index of its last change; 0 when the
key does not exist), its value, or its existence. `mod_index` is the HTTP ETag.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from ..raft.errors import KVError
from . import rows as bulk_rows

COMMAND_FORMAT = 1
MAX_KEY_BYTES = 4096
MAX_CONDS = 0xFFFF  # the condition count is a u16
MAX_INDEX = (1 << 63) - 1  # log indexes (and so mod_index) fit a signed 64-bit integer

_OP_PUT, _OP_DELETE, _OP_TXN, _OP_GET = 1, 2, 3, 4
_OP_PUT_LEASE, _OP_LEASE_GRANT, _OP_LEASE_REVOKE, _OP_LEASE_KEEPALIVE, _OP_LEASE_QUERY = 5, 6, 7, 8, 9
_OP_LEASE_KEEPALIVES = 10
_OP_SESSION_OPEN, _OP_SESSION, _OP_SESSIONS_EXPIRE = 11, 12, 13
_OP_LEASE_GRANT_ID = 14  # a grant with its id and owner (_OP_LEASE_GRANT: the id was the index)
_OP_DELETE_PREFIX = 15
_OP_TXN_REQ = 16  # etcd's v3 transaction (TxnReq)
_OP_ALARM = 17  # raise or clear an alarm (etcd's Maintenance.Alarm)
_OP_COMPACT = 18  # etcd's Compact: the revision below which no read or watch is served
_OP_BULK = 19  # many puts, each with its own condition (rows.py)
_OP_SESSION_OPEN_OWNED = 20  # a session opened for an owner (_OP_SESSION_OPEN: for none)

# What this version applies, which a node says to its peers (raft/transport.py): a command
# an earlier version cannot apply is proposed only once every member says it can. 0: a
# version before levels; 2: SessionOpen with an owner (opcode 20).
COMMAND_LEVEL = 2
OWNED_SESSIONS = 2
_OP_CLUSTER_ID = 21  # the cluster's identity (ClusterId)
OP_IN_SESSION = _OP_SESSION
MAX_KEEPALIVES = 10_000  # leases one batched keepalive renews
MAX_TTL_MS = 365 * 24 * 3600 * 1000  # a year
MAX_LEASE_ID = (1 << 63) - 1  # lease ids are positive signed 64-bit integers (etcd's too)
_COND_MOD, _COND_VALUE, _COND_EXISTS = 1, 2, 3
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")


class CommandError(KVError, ValueError):
    """A command that cannot be encoded or decoded."""


class Cond(NamedTuple):
    """A precondition on one key. kind: "mod" (mod_index == arg; 0 = absent), "value"
    (value == arg), or "exists" (existence == arg)."""

    key: str
    kind: str
    arg: int | bytes | bool

    def holds(self, current: tuple[int, bytes] | None) -> bool:
        if self.kind == "mod":
            return (current[0] if current else 0) == self.arg
        if self.kind == "value":
            return current is not None and current[1] == self.arg
        if self.kind == "exists":
            return (current is not None) == bool(self.arg)
        raise CommandError(f"unknown condition kind {self.kind!r}")


class Put(NamedTuple):
    key: str
    value: bytes
    cond: Cond | None = None
    lease: int = 0  # attach the key to this lease (0: none; detaches a lease it had)


class Delete(NamedTuple):
    key: str
    cond: Cond | None = None


class DeletePrefix(NamedTuple):
    """Delete every key that starts with `prefix` ("": every key), in one entry."""

    prefix: str


class Get(NamedTuple):
    """Read a key inside a transaction (sees the transaction's earlier writes)."""

    key: str


class Txn(NamedTuple):
    """If every condition holds, run `ops`, else `else_ops` — atomically, at one index."""

    conds: tuple[Cond, ...] = ()
    ops: tuple[Put | Delete | Get, ...] = ()
    else_ops: tuple[Put | Delete | Get, ...] = ()


class LeaseGrant(NamedTuple):
    ttl_ms: int
    lease: int = 0  # the id (0: the index of the entry, as before ids were random)
    owner: str = ""  # the key prefix of the token that granted it: who may see it before it holds keys


class LeaseRevoke(NamedTuple):
    lease: int


class LeaseKeepAlive(NamedTuple):
    """Renew a lease to its full ttl: answered by the leader, never logged."""

    lease: int


class LeaseKeepAlives(NamedTuple):
    """Renew several leases at once (one read barrier for all): answered by the leader,
    never logged; the answer is a LeaseList of LeaseInfo (renewed) and NoSuchLease."""

    leases: tuple[int, ...]


class LeaseQuery(NamedTuple):
    """One lease (lease > 0) or all of them (0), with the time left on the leader's clock:
    answered by the leader, never logged."""

    lease: int = 0


class SessionOpen(NamedTuple):
    """Open a client session with this id (chosen at random by whoever opens it) for
    `owner` (see sessions.py; "": none). Opening one more than
    `max_sessions` (the proposer's --max-sessions, carried in the entry so that every
    replica evicts alike) closes the least recently used of the owner holding the most
    (sessions.py)."""

    session: int
    max_sessions: int
    owner: str = ""


class InSession(NamedTuple):
    """A write sent as request `seq` of a client session: applied at most once, however
    often it is sent; a repeat gets the first one's result (see sessions.py)."""

    session: int
    seq: int
    cmd: Put | Delete | DeletePrefix | Txn | LeaseGrant | LeaseRevoke


class SessionsExpire(NamedTuple):
    """Close every session last used at or before log index `upto`: the leader's clock
    decides when they have been idle long enough and commits this, so every replica
    closes the same ones at the same index."""

    upto: int


# -- etcd's v3 transaction ---------------------------------------------------------------------
#
# The etcd v3 API's writes (v3api/) are one command, TxnReq, with etcd's semantics: keys
# as bytes with a `range_end` (b"": the key alone; b"\x00": every key from `key` on; else
# the keys in [key, range_end)); a key's revisions are the log indexes of its creation and
# of its last change. Compares and the checks of the branch that runs (a put's lease
# exists, an ignore_value/ignore_lease put's key exists) are decided against the state
# before the transaction, nested transactions' compares included (etcd's txnPath); then
# the ops run in order, each seeing the ones before it.

CMP_VERSION, CMP_CREATE, CMP_MOD, CMP_VALUE, CMP_LEASE = range(5)  # etcd's Compare.CompareTarget
CMP_EQUAL, CMP_GREATER, CMP_LESS, CMP_NOT_EQUAL = range(4)  # etcd's Compare.CompareResult
MIN_INT64, MAX_INT64 = -(1 << 63), (1 << 63) - 1


class Compare(NamedTuple):
    target: int  # CMP_VERSION ... CMP_LEASE
    result: int  # CMP_EQUAL ... CMP_NOT_EQUAL
    key: bytes
    arg: int | bytes  # bytes for CMP_VALUE
    range_end: bytes = b""


class RangeReq(NamedTuple):
    key: bytes
    range_end: bytes = b""
    limit: int = 0  # 0: every key
    keys_only: bool = False
    count_only: bool = False


class PutReq(NamedTuple):
    key: bytes
    value: bytes
    lease: int = 0
    prev_kv: bool = False
    ignore_value: bool = False
    ignore_lease: bool = False


class DeleteRangeReq(NamedTuple):
    key: bytes
    range_end: bytes = b""
    prev_kv: bool = False


class TxnReq(NamedTuple):
    compares: tuple[Compare, ...] = ()
    success: tuple[RangeReq | PutReq | DeleteRangeReq | TxnReq, ...] = ()
    failure: tuple[RangeReq | PutReq | DeleteRangeReq | TxnReq, ...] = ()


class KeyValue(NamedTuple):
    """A key as etcd reports it: create/mod revision (log indexes), version (1 at create,
    +1 per put), lease (0: none)."""

    key: str
    create_revision: int
    mod_revision: int
    version: int
    value: bytes
    lease: int


class RangeResp(NamedTuple):
    kvs: tuple[KeyValue, ...]
    count: int  # every key in the range, whatever the limit
    more: bool


class PutResp(NamedTuple):
    prev_kv: KeyValue | None


class DeleteRangeResp(NamedTuple):
    deleted: int
    prev_kvs: tuple[KeyValue, ...]


class TxnResp(NamedTuple):
    index: int  # the entry's index: the revision of what it changed
    succeeded: bool
    responses: tuple[RangeResp | PutResp | DeleteRangeResp | TxnResp | None, ...]  # None: a range nobody reads here


def read_bytes(resp) -> int:
    """The bytes of keys and values a range's response read, or all the ranges of a
    transaction's (what --max-txn-read-bytes counts)."""
    if type(resp) is RangeResp:
        return sum(len(kv.key) + len(kv.value) for kv in resp.kvs)
    if type(resp) is TxnResp:
        return sum(map(read_bytes, resp.responses))
    return 0


class AlarmSet(NamedTuple):
    member: int  # etcd's member id (0: not one member's)
    alarm: int  # etcd's AlarmType: 1 NOSPACE, 2 CORRUPT
    active: bool


class Alarms(NamedTuple):
    """The alarms an AlarmSet raised or cleared: (member, alarm) pairs, as two columns."""

    members: tuple[int, ...]
    kinds: tuple[int, ...]


ALARM_NOSPACE, ALARM_CORRUPT = 1, 2


class Compact(NamedTuple):
    revision: int


class ClusterId(NamedTuple):
    """The cluster's identity (16 hex digits, drawn at random): the no-op of a new
    cluster's first entry carries it (kv.Node, raft/core.py); a restore sets another.
    The peer handshake says it (raft/transport.py), so a node of another cluster, a
    restored one given the old cluster's --peers say, is not let in. Never logged as a
    normal entry (a normal entry holding one is refused, changing nothing)."""

    cluster_id: str


class CompactAnswer(NamedTuple):
    """The compact revision after a Compact, and why it was refused ("": it was not;
    "compacted": at or below the compact revision already; "future": above the entry's
    own index)."""

    compact_revision: int
    refused: str


class SpaceExceeded(NamedTuple):
    """Refused when applied: a NOSPACE alarm is raised and the command adds data (every
    replica refuses it alike, as etcd's capped applier does). Nothing changed."""


class KeyNotFound(NamedTuple):
    """A put with ignore_value or ignore_lease on a key that does not exist: nothing of
    the transaction was applied (etcd's "key not found")."""

    key: str


def prefix_end(prefix: bytes) -> bytes:
    """etcd's range_end for every key with the prefix (b"\\x00": every key, for b"" or all 0xFF)."""
    stripped = prefix.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else b"\x00"


def in_range(k: bytes, key: bytes, range_end: bytes) -> bool:
    """Whether raw key k is in etcd's range (key, range_end)."""
    if not range_end:
        return k == key
    return k >= key and (range_end == b"\x00" or k < range_end)


def compare_holds(c: Compare, kv: KeyValue | None) -> bool:
    """One key against a compare (None: the key does not exist, compared as zeros; a
    value compare on it does not hold)."""
    if c.target == CMP_VALUE:
        if kv is None:
            return False
        a, b = kv.value, c.arg
    else:
        a = 0 if kv is None else (kv.version, kv.create_revision, kv.mod_revision, 0, kv.lease)[c.target]
        b = c.arg
    r = c.result
    if r == CMP_EQUAL:
        return a == b
    if r == CMP_NOT_EQUAL:
        return a != b
    if r == CMP_GREATER:
        return a > b
    return a < b


def txn_ops(txn: TxnReq):
    """Every op of a transaction, both branches and nested ones (for checks and counts)."""
    for op in txn.success + txn.failure:
        yield op
        if type(op) is TxnReq:
            yield from txn_ops(op)


class Bulk(NamedTuple):
    """Put every row at one index, atomically; a row whose condition does not hold is
    left out (and named in the answer), the others are written."""

    rows: bulk_rows.Rows


class BulkApplied(NamedTuple):
    """What a Bulk did: every row was written except `refused` (row numbers, whose
    condition did not hold); for each of those, its key's mod_index and whether the key
    holds the row's value already (1) or another (0)."""

    index: int
    refused: tuple[int, ...]
    mod_indexes: tuple[int, ...]
    held: tuple[int, ...]


def bulk(data: bytes) -> Bulk:
    """A Bulk command of a body in rows.py's format, checked as every replica checks it
    (no value limit here: that one is a request limit, kv.server.limits)."""
    try:
        r = bulk_rows.Rows(data, MAX_KEY_BYTES)
        r.check(MAX_INDEX)
    except bulk_rows.RowsError as e:
        raise CommandError(str(e)) from e
    return Bulk(r)


Command = Put | Delete | DeletePrefix | Txn | LeaseGrant | LeaseRevoke | SessionOpen | InSession | SessionsExpire | TxnReq | AlarmSet | Compact | Bulk | ClusterId
LocalCommand = LeaseKeepAlive | LeaseKeepAlives | LeaseQuery  # what a follower forwards but nobody logs


def txn_branches(txn: Txn) -> tuple[tuple[str | None, tuple], ...]:
    """A transaction's branches in the order its mutations are listed wherever they are
    listed one by one (the log's audit rows, the watch history's effect records): ("then",
    ops) and ("else", else_ops) when it has conditions, else (None, ops) alone."""
    return (("then", txn.ops), ("else", txn.else_ops)) if txn.conds else ((None, txn.ops),)


# -- results (what apply hands back to the proposer; kv turns them into kv.WriteResult,
# kv.DeleteResult, kv.TxnResult, hence names of their own) ------------------------------


class PutResult(NamedTuple):
    index: int  # the key's new mod_index


class DeleteApplied(NamedTuple):
    index: int
    deleted: bool


class GetResult(NamedTuple):
    key: str
    value: bytes | None
    mod_index: int


class ConditionFailed(NamedTuple):
    """The condition did not hold; nothing was changed (an apply result: kv raises
    kv.PreconditionFailed for it)."""

    key: str
    mod_index: int  # the key's current mod_index (0: absent)


class TxnApplied(NamedTuple):
    index: int
    succeeded: bool
    results: tuple[PutResult | DeleteApplied | GetResult | GetOmitted | None, ...]  # None: a get nobody reads here


class NoSuchLease(NamedTuple):
    """The lease does not exist (expired, revoked, or never granted); nothing changed."""

    lease: int


class LeaseInfo(NamedTuple):
    lease: int
    ttl_ms: int
    remaining_ms: int  # on the leader's clock; the full ttl where it was just granted
    keys: tuple[str, ...] = ()


class PrefixDeleted(NamedTuple):
    index: int
    keys: tuple[str, ...]  # the keys it deleted


class LeaseRevoked(NamedTuple):
    index: int
    keys: tuple[str, ...]  # the keys deleted with it


class LeaseList(NamedTuple):
    leases: tuple[LeaseInfo | NoSuchLease, ...]  # without their keys (NoSuchLease: in a keepalive's answer)


class SessionOpened(NamedTuple):
    session: int


class SessionExpired(NamedTuple):
    """The session is not open (it expired, was evicted, or was never opened): the write
    was not applied."""

    session: int


class StaleRequest(NamedTuple):
    """A request numbered below the session's last one: it was answered already (or given
    up on); it was not applied again."""

    session: int
    seq: int
    last_seq: int


class RequestMismatch(NamedTuple):
    """Numbered as the session's last request, but not the same request (other bytes): a
    client that reused a number for a new write. Not applied."""

    session: int
    seq: int


NOT_APPLIED = (SessionExpired, StaleRequest, RequestMismatch)  # a session's answers that applied nothing


class GetOmitted(NamedTuple):
    """A transaction's get whose value is not returned: what the transaction's gets read came
    to more than the answering node's read limit when it was applied (the limit is checked
    before proposing, so only when values grew in between), or than a session keeps to
    answer a copy. The transaction itself was applied."""

    key: str


# -- encoding ---------------------------------------------------------------------------------


def key_bytes(key: str) -> bytes:
    """A key's bytes. Keys are str; bytes of a key that are not UTF-8 (etcd's clients may
    write any) are held the way Python holds undecodable file names (PEP 383's
    surrogateescape): each one as a lone surrogate U+DC80..U+DCFF."""
    return key.encode("utf-8", "surrogateescape")


NO_BYTE = "a key holds a lone surrogate that stands for no byte (only U+DC80..U+DCFF stand for bytes that are not UTF-8)"


def shown_key(key: str) -> str:
    """A key in a message: repr of the text, or of its bytes when they are not UTF-8."""
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        try:
            return repr(key_bytes(key))
        except UnicodeEncodeError:
            pass
    return repr(key)


def key_text(raw: bytes) -> str:
    """The key of stored bytes (see key_bytes): any bytes are a key."""
    return raw.decode("utf-8", "surrogateescape")


def check_key(key: str) -> bytes:
    if not isinstance(key, str) or not key:
        raise CommandError("a key is a non-empty string")
    if key[0] == "\x00":
        raise CommandError("keys starting with a NUL character are reserved for ledgerkv's own records (leases)")
    try:
        raw = key_bytes(key)
    except UnicodeEncodeError:
        raise CommandError(NO_BYTE) from None
    if not key.isascii() and key_text(raw) != key:
        # "\udcc3\udca9" would be stored as the bytes of "é", and read back as "é"
        raise CommandError(f"a key's escaped bytes spell UTF-8 text: write the key as {key_text(raw)!r}")
    if len(raw) > MAX_KEY_BYTES:
        raise CommandError(f"key is {len(raw)} bytes long; the limit is {MAX_KEY_BYTES}")
    return raw


def _key(key: str) -> bytes:
    raw = check_key(key)
    return _U16.pack(len(raw)) + raw


def _cond(c: Cond | None) -> bytes:
    if c is None:
        return b"\x00"
    if c.kind == "mod":
        if type(c.arg) is not int or not 0 <= c.arg <= MAX_INDEX:
            raise CommandError(f"a mod_index is an integer from 0 to {MAX_INDEX}, not {c.arg!r}")
        return bytes((_COND_MOD,)) + _key(c.key) + _U64.pack(c.arg)
    if c.kind == "value":
        v = bytes(c.arg)
        return bytes((_COND_VALUE,)) + _key(c.key) + _U32.pack(len(v)) + v
    if c.kind == "exists":
        return bytes((_COND_EXISTS,)) + _key(c.key) + bytes((1 if c.arg else 0,))
    raise CommandError(f"unknown condition kind {c.kind!r}")


def _ops(ops, parts: list) -> None:
    """Append the encodings of transaction ops (a txn may hold thousands: plain puts are
    encoded inline, the rest by _op)."""
    pack16, pack32 = _U16.pack, _U32.pack
    for op in ops:
        if type(op) is Put and op.cond is None and not op.lease and type(op.key) is str and type(op.value) is bytes:
            raw = op.key.encode() if op.key.isascii() else b""  # (any other key: check_key's bytes)
            if not raw or raw[0] == 0 or len(raw) > MAX_KEY_BYTES:
                raw = check_key(op.key)  # raises with the reason, or gives the bytes
            parts.append(_PUT_OPCODE + pack16(len(raw)) + raw + pack32(len(op.value)))
            parts.append(op.value)
            parts.append(b"\x00")
        else:
            parts.append(_op(op))


def _op(op: Put | Delete | Get) -> bytes:
    if getattr(op, "cond", None) is not None:
        raise CommandError("operations inside a transaction take no condition of their own: put it in the transaction's conds")
    if getattr(op, "lease", 0):
        raise CommandError("a lease is attached by a single put, not inside a transaction")
    if isinstance(op, Put):
        return bytes((_OP_PUT,)) + _key(op.key) + _U32.pack(len(op.value)) + bytes(op.value) + _cond(op.cond)
    if isinstance(op, Delete):
        return bytes((_OP_DELETE,)) + _key(op.key) + _cond(op.cond)
    if isinstance(op, Get):
        return bytes((_OP_GET,)) + _key(op.key)
    raise CommandError(f"not a transaction operation: {op!r}")


_HEAD = bytes((COMMAND_FORMAT,))
_BULK_HEAD = bytes((COMMAND_FORMAT, _OP_BULK))
PUT_HEAD = _PUT_HEAD = bytes((COMMAND_FORMAT, _OP_PUT))  # a put without a lease (the state machine's hot path)
_PUT_OPCODE = bytes((_OP_PUT,))


def check_ttl_ms(ttl_ms: int) -> int:
    if type(ttl_ms) is not int or not 0 < ttl_ms <= MAX_TTL_MS:
        raise CommandError(f"a lease's ttl is more than 0 and at most a year ({MAX_TTL_MS // 1000} s)")
    return ttl_ms


def _lease_id(lease: int) -> bytes:
    if type(lease) is not int or not 0 < lease < 1 << 63:
        raise CommandError(f"a lease id is a positive integer below 2**63, not {lease!r}")
    return _U64.pack(lease)


def is_cluster_id(s: object) -> bool:
    return type(s) is str and len(s) == 16 and all(c in "0123456789abcdef" for c in s)


MAX_SESSION_ID = (1 << 53) - 1  # session ids travel as JSON numbers: exact in every language
MAX_SESSIONS = 10_000_000
MAX_OWNER_BYTES = 64  # a session's owner (SessionOpen): a token's digest, "node:" and a member id (or its digest)
IN_SESSION = bytes((COMMAND_FORMAT, _OP_SESSION))
SESSION_IDS = struct.Struct(">QQ")
SESSION_HEAD_BYTES = len(IN_SESSION) + SESSION_IDS.size
_SESSION_PREFIX = struct.Struct(">BBQQ")


def check_request_id(session: int, seq: int) -> None:
    if type(session) is not int or not 0 < session <= MAX_SESSION_ID:
        raise CommandError(f"a session id is an integer from 1 to {MAX_SESSION_ID}, not {session!r}")
    if type(seq) is not int or not 0 < seq <= MAX_INDEX:
        raise CommandError(f"a request's sequence number is an integer from 1 to {MAX_INDEX}, not {seq!r}")


def _session_id(session: int) -> bytes:
    check_request_id(session, 1)
    return _U64.pack(session)


def _max_sessions(n: int) -> int:
    if type(n) is not int or not 0 < n <= MAX_SESSIONS:
        raise CommandError(f"--max-sessions is an integer from 1 to {MAX_SESSIONS}, not {n!r}")
    return n


def in_session(session: int, seq: int, payload: bytes) -> bytes:
    """An encoded write, as request `seq` of a session."""
    if not can_be_in_session(payload):
        raise CommandError("only puts, deletes, transactions and lease grants and revokes are sent in a session")
    try:
        if 0 < session <= MAX_SESSION_ID and 0 < seq <= MAX_INDEX:
            return _SESSION_PREFIX.pack(COMMAND_FORMAT, _OP_SESSION, session, seq) + payload
    except (TypeError, struct.error):
        pass
    check_request_id(session, seq)  # raises with the reason
    raise CommandError(f"not a request id: {session!r}, {seq!r}")


def can_be_in_session(payload: bytes) -> bool:
    return payload[1:2] in SESSION_OPCODES and payload[:1] == _HEAD


def session_of(data: bytes) -> tuple[int, int, bytes] | None:
    """(session, seq, the write's own encoding) of a write sent in a session, else None."""
    if data[:2] != IN_SESSION or len(data) < SESSION_HEAD_BYTES:
        return None
    session, seq = SESSION_IDS.unpack_from(data, 2)
    return session, seq, data[SESSION_HEAD_BYTES:]


class _Reader:
    __slots__ = ("b", "o")

    def __init__(self, b: bytes) -> None:
        self.b, self.o = b, 0

    def take(self, n: int) -> bytes:
        o = self.o
        out = self.b[o : o + n]
        if len(out) != n:
            raise CommandError("command is truncated")
        self.o = o + n
        return out

    def byte(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return _U16.unpack(self.take(2))[0]

    def u32(self) -> int:
        return _U32.unpack(self.take(4))[0]

    def key(self) -> str:
        return key_text(self.take(self.u16()))

    def cond(self) -> Cond | None:
        kind = self.byte()
        if kind == 0:
            return None
        key = self.key()
        if kind == _COND_MOD:
            return Cond(key, "mod", _U64.unpack(self.take(8))[0])
        if kind == _COND_VALUE:
            return Cond(key, "value", self.take(self.u32()))
        if kind == _COND_EXISTS:
            return Cond(key, "exists", bool(self.byte()))
        raise CommandError(f"unknown condition kind {kind}")

    def ops(self, n: int) -> tuple[Put | Delete | Get, ...]:
        """n transaction operations, decoded in one loop (a txn may hold thousands)."""
        b, o, out = self.b, self.o, []
        unpack_u16, unpack_u32 = _U16.unpack_from, _U32.unpack_from
        try:
            for _ in range(n):
                code = b[o]
                (kl,) = unpack_u16(b, o + 1)
                key = key_text(b[o + 3 : o + 3 + kl])
                o += 3 + kl
                if code == _OP_PUT:
                    (vl,) = unpack_u32(b, o)
                    value = b[o + 4 : o + 4 + vl]
                    if len(value) != vl:
                        raise CommandError("command is truncated")
                    o += 4 + vl
                    op = Put(key, value)
                elif code == _OP_DELETE:
                    op = Delete(key)
                elif code == _OP_GET:
                    out.append(Get(key))
                    continue
                else:
                    raise CommandError(f"unknown transaction operation {code}")
                if b[o] != 0:
                    raise CommandError("a transaction operation carries a condition")
                o += 1
                out.append(op)
        except (IndexError, struct.error) as e:
            raise CommandError("command is truncated") from e
        self.o = o
        return tuple(out)


# -- the table: each command and result described once ------------------------------------
#
# A field is (its name in the NamedTuple, how it travels). encode and decode below follow
# the tables; only the hot path is written out by hand: a put (its value last and
# unprefixed, so that the entry is header + value), a transaction's ops, and a session's
# wrapping of another command.


class _Field:
    """One field of a command or result: `pack(value)` its bytes, `read(reader)` it back;
    `check(value)` (on both ways) raises CommandError for a value the format refuses."""

    def __init__(self, name: str, check=None) -> None:
        self.name, self.check = name, check

    def encode(self, value) -> bytes:
        if self.check is not None:
            self.check(value)
        return self.pack(value)

    def decode(self, r: _Reader):
        value = self.read(r)
        if self.check is not None:
            self.check(value)
        return value


class _Flag(_Field):
    def pack(self, value) -> bytes:
        return b"\x01" if value else b"\x00"

    def read(self, r: _Reader):
        return bool(r.byte())


class _Int32(_Field):
    def pack(self, value) -> bytes:
        return _U32.pack(value)

    def read(self, r: _Reader):
        return r.u32()


class _Int64(_Field):
    def pack(self, value) -> bytes:
        return _U64.pack(value)

    def read(self, r: _Reader):
        return _U64.unpack(r.take(8))[0]


class _Key(_Field):
    """A key: u16 length, UTF-8 (check_key's rules)."""

    def pack(self, value) -> bytes:
        return _key(value)

    def read(self, r: _Reader):
        return r.key()


class _Text(_Field):
    """A string that is not a key (a prefix, an owner; bytes as key_bytes spells them): u16
    length, UTF-8."""

    def pack(self, value) -> bytes:
        raw = key_bytes(value)
        return _U16.pack(len(raw)) + raw

    def read(self, r: _Reader):
        return key_text(r.take(r.u16()))


class _Cond(_Field):
    def pack(self, value) -> bytes:
        return _cond(value)

    def read(self, r: _Reader):
        return r.cond()


class _LeaseIds(_Field):
    """A u32 count (1 to MAX_KEEPALIVES, checked before reading that many), then each id
    as a u64 (each checked when encoded)."""

    def encode(self, value) -> bytes:
        _keepalive_count(len(value))
        return _U32.pack(len(value)) + b"".join(map(_lease_id, value))

    def decode(self, r: _Reader):
        n = _keepalive_count(r.u32())
        return struct.unpack(f">{n}Q", r.take(8 * n))


class _Keys(_Field):
    def pack(self, value) -> bytes:
        return _keys(value)

    def read(self, r: _Reader):
        return tuple(r.key() for _ in range(r.u32()))


class _Value(_Field):
    """A value that may be absent: a byte 0, or 1 and a u32-prefixed value."""

    def pack(self, value) -> bytes:
        return b"\x00" if value is None else b"\x01" + _U32.pack(len(value)) + value

    def read(self, r: _Reader):
        return r.take(r.u32()) if r.byte() else None


class _Ints(_Field):
    """A u32 count (at most `most`), then each as a u64."""

    def __init__(self, name: str, most: int = MAX_CONDS) -> None:
        super().__init__(name)
        self.most = most

    def pack(self, value) -> bytes:
        return _U32.pack(len(value)) + b"".join(_U64.pack(v) for v in value)

    def read(self, r: _Reader):
        n = r.u32()
        if n > self.most:
            raise CommandError(f"a list of {n} numbers is longer than any this format holds")
        return struct.unpack(f">{n}Q", r.take(8 * n))


class _Results(_Field):
    """Nested results: a u32 count, then each (a transaction's, a lease listing's)."""

    def pack(self, value) -> bytes:
        return _U32.pack(len(value)) + b"".join(map(encode_result, value))

    def read(self, r: _Reader):
        return tuple(_result(r) for _ in range(r.u32()))


# -- TxnReq on the wire ---------------------------------------------------------------------
#
#   TxnReq      u16 compares | each compare | u32 ops | each op (success) | u32 | each (failure)
#   compare     target u8 | result u8 | key bytes16 | range_end bytes16 | arg (value: bytes32, else i64)
#   op          b"r" key16 end16 limit i64 flags u8 | b"p" key16 value32 lease u64 flags u8
#               | b"d" key16 end16 flags u8 | b"t" TxnReq
MAX_TXN_DEPTH = 16  # nested transactions (etcd has no limit; the decoder needs one)
_I64 = struct.Struct(">q")


def _bytes16(b: bytes) -> bytes:
    if len(b) > MAX_KEY_BYTES:
        raise CommandError(f"a key or range end is {len(b)} bytes long; the limit is {MAX_KEY_BYTES}")
    return _U16.pack(len(b)) + b


def _req_key(key: bytes, range_end: bytes) -> bytes:
    """A key with its range end; a key alone (no range end) follows check_key's rules."""
    if type(key) is not bytes or type(range_end) is not bytes:
        raise CommandError("keys and range ends of the v3 API are bytes")
    if not range_end:
        check_key(key_text(key))
    return _bytes16(key) + _bytes16(range_end)


def _i64(v: int) -> bytes:
    if type(v) is not int or not MIN_INT64 <= v <= MAX_INT64:
        raise CommandError(f"a 64-bit integer, not {v!r}")
    return _I64.pack(v)


def _encode_txn_req(txn: TxnReq, parts: list, depth: int = 0) -> None:
    if depth > MAX_TXN_DEPTH:
        raise CommandError(f"transactions nest at most {MAX_TXN_DEPTH} deep")
    if len(txn.compares) > MAX_CONDS:
        raise CommandError(f"a transaction has {len(txn.compares)} compares; the format holds at most {MAX_CONDS}")
    parts.append(_U16.pack(len(txn.compares)))
    for c in txn.compares:
        if c.target not in range(5) or c.result not in range(4):
            raise CommandError(f"not a compare: {c!r}")
        parts.append(bytes((c.target, c.result)) + _req_key(c.key, c.range_end))
        if c.target == CMP_VALUE:
            v = bytes(c.arg)
            parts.append(_U32.pack(len(v)) + v)
        else:
            parts.append(_i64(c.arg))
    for ops in (txn.success, txn.failure):
        parts.append(_U32.pack(len(ops)))
        for op in ops:
            t = type(op)
            if t is RangeReq:
                if type(op.limit) is not int or op.limit < 0:
                    raise CommandError(f"a range's limit is 0 or more, not {op.limit!r}")
                parts.append(b"r" + _req_key(op.key, op.range_end) + _i64(op.limit) + bytes((op.keys_only | op.count_only << 1,)))
            elif t is PutReq:
                _req_key(op.key, b"")
                parts.append(b"p" + _bytes16(op.key) + _U32.pack(len(op.value)) + bytes(op.value) + _U64.pack(op.lease and _lease_id(op.lease) and op.lease))
                parts.append(bytes((op.prev_kv | op.ignore_value << 1 | op.ignore_lease << 2,)))
            elif t is DeleteRangeReq:
                parts.append(b"d" + _req_key(op.key, op.range_end) + bytes((op.prev_kv,)))
            elif t is TxnReq:
                parts.append(b"t")
                _encode_txn_req(op, parts, depth + 1)
            else:
                raise CommandError(f"not an op of a transaction: {op!r}")


def _read_txn_req(r: _Reader, depth: int = 0) -> TxnReq:
    if depth > MAX_TXN_DEPTH:
        raise CommandError(f"transactions nest at most {MAX_TXN_DEPTH} deep")
    compares = []
    for _ in range(r.u16()):
        target, result = r.byte(), r.byte()
        key, end = r.take(r.u16()), r.take(r.u16())
        arg = r.take(r.u32()) if target == CMP_VALUE else _I64.unpack(r.take(8))[0]
        if target > CMP_LEASE or result > CMP_NOT_EQUAL:
            raise CommandError(f"unknown compare {target}/{result}")
        compares.append(Compare(target, result, key, arg, end))
    branches = []
    for _ in range(2):
        ops = []
        for _ in range(r.u32()):
            tag = r.take(1)
            if tag == b"r":
                key, end = r.take(r.u16()), r.take(r.u16())
                limit = _I64.unpack(r.take(8))[0]
                flags = r.byte()
                ops.append(RangeReq(key, end, limit, bool(flags & 1), bool(flags & 2)))
            elif tag == b"p":
                key = r.take(r.u16())
                value = r.take(r.u32())
                lease = _U64.unpack(r.take(8))[0]
                flags = r.byte()
                ops.append(PutReq(key, value, lease, bool(flags & 1), bool(flags & 2), bool(flags & 4)))
            elif tag == b"d":
                key, end = r.take(r.u16()), r.take(r.u16())
                ops.append(DeleteRangeReq(key, end, bool(r.byte())))
            elif tag == b"t":
                ops.append(_read_txn_req(r, depth + 1))
            else:
                raise CommandError(f"unknown transaction op {tag!r}")
        branches.append(tuple(ops))
    return TxnReq(tuple(compares), *branches)


class _TxnReqBody(_Field):
    def encode(self, value) -> bytes:
        parts: list[bytes] = []
        _encode_txn_req(value, parts)
        return b"".join(parts)

    def decode(self, r: _Reader):
        return _read_txn_req(r)


def _kv(kv: KeyValue | None) -> bytes:
    if kv is None:
        return b"\x00"
    return b"\x01" + _key(kv.key) + _U64.pack(kv.create_revision) + _U64.pack(kv.mod_revision) + _U64.pack(kv.version) + _U64.pack(kv.lease) + _U32.pack(len(kv.value)) + kv.value


def _read_kv(r: _Reader) -> KeyValue | None:
    if not r.byte():
        return None
    key = r.key()
    create, mod, version, lease = struct.unpack(">QQQQ", r.take(32))
    return KeyValue(key, create, mod, version, r.take(r.u32()), lease)


class _KeyValue(_Field):
    def pack(self, value) -> bytes:
        return _kv(value)

    def read(self, r: _Reader):
        return _read_kv(r)


class _KeyValues(_Field):
    def pack(self, value) -> bytes:
        return _U32.pack(len(value)) + b"".join(map(_kv, value))

    def read(self, r: _Reader):
        return tuple(_read_kv(r) for _ in range(r.u32()))


def _check(ok, what: str):
    """A field check: raise CommandError(what, with the value) unless ok(value)."""

    def check(value) -> None:
        if not ok(value):
            raise CommandError(f"{what}, not {value!r}")

    return check


_index_check = _check(lambda v: type(v) is int and 0 < v <= MAX_INDEX, "sessions expire up to a log index")


def _keepalive_count(n: int) -> int:
    if not 0 < n <= MAX_KEEPALIVES:
        raise CommandError(f"a batched keepalive renews 1 to {MAX_KEEPALIVES} leases, not {n}")
    return n


def _query_check(lease) -> None:
    if lease != 0:  # 0: every lease
        _lease_id(lease)


def _prefix_bytes(v) -> int:
    """The length of a key prefix's bytes (key_bytes); more than any limit when it has none."""
    try:
        return len(key_bytes(v)) if type(v) is str else MAX_KEY_BYTES + 1
    except UnicodeEncodeError:
        return MAX_KEY_BYTES + 1


_owner_check = _check(lambda v: _prefix_bytes(v) <= MAX_KEY_BYTES, f"a lease's owner is a key prefix of at most {MAX_KEY_BYTES} bytes")
_session_owner_check = _check(
    lambda v: 0 < _prefix_bytes(v) <= MAX_OWNER_BYTES, f"a session's owner is a string of 1 to {MAX_OWNER_BYTES} bytes (none: the other opcode)"
)
_prefix_check = _check(
    lambda v: _prefix_bytes(v) <= MAX_KEY_BYTES and not v.startswith("\x00"),
    f"a prefix is a string of at most {MAX_KEY_BYTES} bytes, not starting with NUL",
)

# opcode -> (the command's type, its fields in wire order). Put, Txn and InSession are
# written out by hand (encode, decode); so is the lease of a Put (_OP_PUT_LEASE).
COMMANDS: dict[int, tuple[type, tuple[_Field, ...]]] = {
    _OP_DELETE: (Delete, (_Key("key"), _Cond("cond"))),
    _OP_DELETE_PREFIX: (DeletePrefix, (_Text("prefix", _prefix_check),)),
    _OP_LEASE_GRANT: (LeaseGrant, (_Int64("ttl_ms", check_ttl_ms),)),  # from before lease ids were random
    _OP_LEASE_GRANT_ID: (LeaseGrant, (_Int64("lease", _lease_id), _Int64("ttl_ms", check_ttl_ms), _Text("owner", _owner_check))),
    _OP_LEASE_REVOKE: (LeaseRevoke, (_Int64("lease", _lease_id),)),
    _OP_LEASE_KEEPALIVE: (LeaseKeepAlive, (_Int64("lease", _lease_id),)),
    _OP_LEASE_KEEPALIVES: (LeaseKeepAlives, (_LeaseIds("leases"),)),
    _OP_LEASE_QUERY: (LeaseQuery, (_Int64("lease", _query_check),)),
    _OP_SESSION_OPEN: (SessionOpen, (_Int64("session", _session_id), _Int32("max_sessions", _max_sessions))),
    _OP_SESSION_OPEN_OWNED: (SessionOpen, (_Int64("session", _session_id), _Int32("max_sessions", _max_sessions), _Text("owner", _session_owner_check))),
    _OP_SESSIONS_EXPIRE: (SessionsExpire, (_Int64("upto", _index_check),)),
    _OP_TXN_REQ: (TxnReq, ()),  # written out by hand (a recursive body)
    _OP_COMPACT: (Compact, (_Int64("revision", _check(lambda v: type(v) is int and 0 < v <= MAX_INDEX, "a revision is a log index")),)),
    _OP_CLUSTER_ID: (ClusterId, (_Text("cluster_id", _check(is_cluster_id, "a cluster id is 16 lowercase hex digits")),)),
    _OP_ALARM: (AlarmSet, (_Int64("member"), _Int32("alarm", _check(lambda v: v in (ALARM_NOSPACE, ALARM_CORRUPT), "an alarm is NOSPACE (1) or CORRUPT (2)")), _Flag("active"))),
}
_OPCODE_OF = {cls: op for op, (cls, _) in COMMANDS.items() if op not in (_OP_LEASE_GRANT, _OP_SESSION_OPEN)}

# tag -> (the result's type, its fields in wire order); CommandError and None by hand.
RESULTS: dict[bytes, tuple[type, tuple[_Field, ...]]] = {
    b"P": (PutResult, (_Int64("index"),)),
    b"D": (DeleteApplied, (_Int64("index"), _Flag("deleted"))),
    b"G": (GetResult, (_Key("key"), _Int64("mod_index"), _Value("value"))),
    b"F": (ConditionFailed, (_Key("key"), _Int64("mod_index"))),
    b"T": (TxnApplied, (_Int64("index"), _Flag("succeeded"), _Results("results"))),
    b"X": (NoSuchLease, (_Int64("lease"),)),
    b"I": (LeaseInfo, (_Int64("lease"), _Int64("ttl_ms"), _Int64("remaining_ms"), _Keys("keys"))),
    b"V": (LeaseRevoked, (_Int64("index"), _Keys("keys"))),
    b"W": (PrefixDeleted, (_Int64("index"), _Keys("keys"))),
    b"S": (LeaseList, (_Results("leases"),)),
    b"g": (GetOmitted, (_Key("key"),)),
    b"O": (SessionOpened, (_Int64("session"),)),
    b"Z": (SessionExpired, (_Int64("session"),)),
    b"Q": (StaleRequest, (_Int64("session"), _Int64("seq"), _Int64("last_seq"))),
    b"M": (RequestMismatch, (_Int64("session"), _Int64("seq"))),
    b"r": (RangeResp, (_KeyValues("kvs"), _Int64("count"), _Flag("more"))),
    b"p": (PutResp, (_KeyValue("prev_kv"),)),
    b"d": (DeleteRangeResp, (_Int64("deleted"), _KeyValues("prev_kvs"))),
    b"t": (TxnResp, (_Int64("index"), _Flag("succeeded"), _Results("responses"))),
    b"k": (KeyNotFound, (_Key("key"),)),
    b"a": (Alarms, (_Ints("members"), _Ints("kinds"))),
    b"n": (SpaceExceeded, ()),
    b"c": (CompactAnswer, (_Int64("compact_revision"), _Text("refused"))),
    b"b": (BulkApplied, (_Int64("index"), _Ints("refused", bulk_rows.MAX_ROWS), _Ints("mod_indexes", bulk_rows.MAX_ROWS), _Ints("held", bulk_rows.MAX_ROWS))),
}
_TAG_OF = {cls: tag for tag, (cls, _) in RESULTS.items()}


def _fields(value, fields: tuple[_Field, ...]) -> bytes:
    return b"".join(f.encode(getattr(value, f.name)) for f in fields)


def _read(cls: type, fields: tuple[_Field, ...], r: _Reader):
    return cls(**{f.name: f.decode(r) for f in fields})


def encode(cmd: Command | LocalCommand) -> bytes:
    kind = type(cmd)
    if kind is Put:
        # The hot path: the value goes last, unprefixed, so the entry is just header + value.
        if cmd.lease:
            return _HEAD + bytes((_OP_PUT_LEASE,)) + _key(cmd.key) + _cond(cmd.cond) + _lease_id(cmd.lease) + bytes(cmd.value)
        return _PUT_HEAD + _key(cmd.key) + _cond(cmd.cond) + bytes(cmd.value)
    if kind is InSession:
        return in_session(cmd.session, cmd.seq, encode(cmd.cmd))
    if kind is Bulk:  # checked when it was made (bulk())
        return _BULK_HEAD + cmd.rows.data
    if kind is TxnReq:
        try:
            return bytes((COMMAND_FORMAT, _OP_TXN_REQ)) + _TxnReqBody("txn").encode(cmd)
        except (TypeError, AttributeError, struct.error) as e:
            raise CommandError(f"a transaction with a field of the wrong type: {cmd!r}") from e
    if kind is Txn:
        if len(cmd.conds) > MAX_CONDS:
            raise CommandError(f"a transaction has {len(cmd.conds)} conditions; the format holds at most {MAX_CONDS}")
        parts = [_HEAD, bytes((_OP_TXN,)), _U16.pack(len(cmd.conds))]
        parts += [_cond(c) for c in cmd.conds]
        parts.append(_U32.pack(len(cmd.ops)))
        _ops(cmd.ops, parts)
        parts.append(_U32.pack(len(cmd.else_ops)))
        _ops(cmd.else_ops, parts)
        return b"".join(parts)
    op = _OPCODE_OF.get(kind)
    if op is None:
        raise CommandError(f"not a command: {cmd!r}")
    if kind is LeaseGrant and not cmd.lease:
        op = _OP_LEASE_GRANT
    elif kind is SessionOpen and not cmd.owner:
        op = _OP_SESSION_OPEN  # (what a version before owners reads)
    try:
        return bytes((COMMAND_FORMAT, op)) + _fields(cmd, COMMANDS[op][1])
    except (TypeError, AttributeError, struct.error) as e:
        raise CommandError(f"a {kind.__name__} with a field of the wrong type: {cmd!r}") from e


def decode(data: bytes) -> Command | LocalCommand:
    if not data:
        raise CommandError("empty command")
    version = data[0]
    if version != COMMAND_FORMAT:  # format 1 is the only one so far
        raise CommandError(f"command format {version} is newer than this ledgerkv understands ({COMMAND_FORMAT})")
    r = _Reader(data)
    r.o = 1
    code = r.byte()
    try:
        if code == _OP_PUT or code == _OP_PUT_LEASE:
            key = r.key()
            cond = r.cond()
            lease = _U64.unpack(r.take(8))[0] if code == _OP_PUT_LEASE else 0
            return Put(key, data[r.o :], cond, lease)
        if code == _OP_SESSION:
            session, seq, inner = session_of(data) or (0, 0, b"")
            if not can_be_in_session(inner):
                raise CommandError("a session carries a put, delete, transaction or lease grant or revoke")
            check_request_id(session, seq)
            return InSession(session, seq, decode(inner))
        if code == _OP_BULK:
            return bulk(data[2:])
        if code == _OP_TXN:
            conds = tuple(r.cond() for _ in range(r.u16()))
            ops = r.ops(r.u32())
            cmd = Txn(conds, ops, r.ops(r.u32()))
        elif code == _OP_TXN_REQ:
            cmd = _read_txn_req(r)
        elif code in COMMANDS:
            cmd = _read(*COMMANDS[code], r)
        else:
            raise CommandError(f"unknown opcode {code}")
    except UnicodeDecodeError as e:
        raise CommandError(f"key is not UTF-8: {e}") from e
    if r.o != len(data):
        raise CommandError("stray bytes after the command")
    return cmd


def adds_data(cmd) -> bool:
    """Whether a command can add data (what a raised NOSPACE alarm refuses: etcd lets
    deletes, revokes and reads through, and clearing the alarm)."""
    if type(cmd) is InSession:
        cmd = cmd.cmd
    if type(cmd) is TxnReq:
        return any(type(op) is PutReq for op in txn_ops(cmd))
    if type(cmd) is Txn:
        return any(type(op) is Put for _, ops in txn_branches(cmd) for op in ops)
    return type(cmd) in (Put, LeaseGrant, Bulk)


def is_local(payload: bytes) -> bool:
    """Whether an encoded command is one the leader answers without logging it."""
    return len(payload) > 1 and payload[0] == COMMAND_FORMAT and payload[1] in (_OP_LEASE_KEEPALIVE, _OP_LEASE_KEEPALIVES, _OP_LEASE_QUERY)


# The opcodes (as one byte) of the commands sent in a session: the writes that are logged.
SESSION_OPCODES = frozenset(bytes((op,)) for op in (_OP_PUT, _OP_PUT_LEASE, _OP_DELETE, _OP_DELETE_PREFIX, _OP_TXN, _OP_LEASE_GRANT, _OP_LEASE_GRANT_ID, _OP_LEASE_REVOKE, _OP_TXN_REQ, _OP_BULK))


# -- results on the wire (a leader answers a forwarded command) --------------------------------


def _keys(keys: tuple[str, ...]) -> bytes:
    return _U32.pack(len(keys)) + b"".join(_key(k) for k in keys)


def encode_result(r) -> bytes:
    tag = _TAG_OF.get(type(r))
    if tag is not None:
        if tag == b"I" and r.remaining_ms < 0:
            r = r._replace(remaining_ms=0)  # overdue on the leader's clock: nothing left
        return tag + _fields(r, RESULTS[tag][1])
    if isinstance(r, CommandError):
        msg = str(r).encode()
        return b"E" + _U32.pack(len(msg)) + msg
    if r is None:
        return b"N"
    raise CommandError(f"cannot encode result {r!r}")


def _result(r: _Reader):
    tag = r.take(1)
    spec = RESULTS.get(tag)
    if spec is not None:
        return _read(*spec, r)
    if tag == b"E":
        return CommandError(r.take(r.u32()).decode())
    if tag == b"N":
        return None
    raise CommandError(f"unknown result tag {tag!r}")


def decode_result(data: bytes):
    r = _Reader(data)
    result = _result(r)
    if r.o != len(data):
        raise CommandError("stray bytes after the result")
    return result
