"""The committed log as a stream: the body of GET /v1/log, and the rows it becomes.

A node serves the entries of its ledger that it has applied (so they are committed) as a
sequence of records:

    index (8) + term (8) + kind (1) + length (4) + data      big-endian, one per entry
    0 (8) + 0 (8) + status (1) + length (4) + message        the end record

The end record says whether the stream is whole (status END_OK, empty message) or why it
stopped early (END_ERROR, e.g. the range was compacted while it was being sent). The HTTP
status is sent before the first entry, so an error found later can only travel in-band; a
stream without an end record was cut short. Entries are the raw command bytes: the node
does no decoding, the reader (a Spark task, say) does.

`entry_rows` turns one entry into audit rows (index, term, op, key, value, conditional,
branch): one per mutation. A conditional mutation (a compare-and-set, or an operation of a
transaction with conditions) is what was asked; whether its condition held was decided
when it was applied and is not in the log, and so is whether a write sent in a client
session was a copy of one applied before (statemachine/sessions.py): the log holds every
copy that was appended; a watch (kv/server/watch.py) shows what took effect. Entries without a
mutation still get one row (op "noop", "config", "read", "lease", "session": a session
opened or expired, "alarm" or "compact": etcd's Alarm and Compact), so every index of the range appears; a prefix's delete is one row
(op "delete_prefix", key = the prefix).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

from ..errors import KVError
from ..raft.messages import Entry, EntryKind
from ..statemachine import commands as cmds
from ..statemachine.rows import ANY

RECORD = struct.Struct(">QQBI")
END_OK, END_ERROR = 0, 1

Row = tuple[int, int, str, "str | None", "bytes | None", bool, "str | None"]
COLUMNS = ("index", "term", "op", "key", "value", "conditional", "branch")


class LogStreamError(KVError):
    """The log stream stopped early or is malformed."""

    code, http_status = "LOG_STREAM", 502


def encode_entries(entries: list[Entry]) -> bytes:
    parts = []
    for e in entries:
        parts.append(RECORD.pack(e.index, e.term, e.kind, len(e.data)))
        parts.append(e.data)
    return b"".join(parts)


def encode_end(error: str | None = None) -> bytes:
    msg = (error or "").encode()
    return RECORD.pack(0, 0, END_ERROR if error else END_OK, len(msg)) + msg


class RecordReader:
    """Feed it the bytes of a stream as they arrive; it hands back whole entries."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self.ended = False

    def feed(self, chunk: bytes) -> list[Entry]:
        if self.ended:
            raise LogStreamError("data after the end of the log stream")
        self._buf += chunk
        out, pos, buf = [], 0, self._buf
        while len(buf) - pos >= RECORD.size:
            index, term, kind, n = RECORD.unpack_from(buf, pos)
            if len(buf) - pos - RECORD.size < n:
                break
            data = bytes(buf[pos + RECORD.size : pos + RECORD.size + n])
            pos += RECORD.size + n
            if index == 0:
                self.ended = True
                if kind != END_OK:
                    raise LogStreamError(f"the node stopped the log stream: {data.decode(errors='replace')}")
                if pos != len(buf):
                    raise LogStreamError("data after the end of the log stream")
                break
            out.append(Entry(index, term, kind, data))
        del buf[:pos]
        return out

    def finish(self, last_seen: int) -> None:
        if not self.ended:
            raise LogStreamError(f"the log stream was cut short after index {last_seen}; run the export again")


def entry_rows(e: Entry) -> Iterator[Row]:
    if e.kind == EntryKind.NOOP:
        yield (e.index, e.term, "noop", None, None, False, None)
        return
    if e.kind == EntryKind.CONFIG:
        yield (e.index, e.term, "config", None, e.data, False, None)  # the membership, as JSON
        return
    try:
        cmd = cmds.decode(e.data)
    except cmds.CommandError as exc:
        raise LogStreamError(f"entry {e.index} (term {e.term}) is not a command this version can read: {exc}") from None
    if type(cmd) is cmds.InSession:
        cmd = cmd.cmd
    elif isinstance(cmd, (cmds.SessionOpen, cmds.SessionsExpire)):
        yield (e.index, e.term, "session", None, None, False, None)
        return
    if type(cmd) is cmds.DeletePrefix:
        # Which keys it deleted was decided when it was applied: the watch history has them.
        yield (e.index, e.term, "delete_prefix", cmd.prefix, None, False, None)
        return
    if type(cmd) is cmds.AlarmSet:
        yield (e.index, e.term, "alarm", None, None, False, None)
        return
    if type(cmd) is cmds.Compact:
        yield (e.index, e.term, "compact", None, None, False, None)
        return
    if isinstance(cmd, (cmds.LeaseGrant, cmds.LeaseRevoke)):
        # Which keys a revoke deletes was decided when it was applied: it is not in the log.
        yield (e.index, e.term, "lease", None, None, False, None)
        return
    if type(cmd) is cmds.TxnReq:
        yield from _txn_req_rows(e, cmd)
        return
    if type(cmd) is cmds.Bulk:  # each row conditional on its key's mod_index, or not
        for raw, value, cond in cmd.rows:
            yield (e.index, e.term, "put", cmds.key_text(raw), value, cond != ANY, None)
        return
    if isinstance(cmd, cmds.Txn):
        wrote = False
        for branch, ops in cmds.txn_branches(cmd):
            for op in ops:
                if not isinstance(op, cmds.Get):
                    wrote = True
                    yield _mutation(e, op, bool(cmd.conds), branch)
        if not wrote:
            yield (e.index, e.term, "read", None, None, bool(cmd.conds), None)
        return
    yield _mutation(e, cmd, cmd.cond is not None, None)


def _txn_req_rows(e: Entry, txn: cmds.TxnReq) -> Iterator[Row]:
    """An etcd transaction's puts and deletes, as asked: a delete of a range is one row
    (op "delete_range", key = its start); what took effect is in the watch history."""
    wrote = False
    stack = [(txn, None)]
    while stack:
        t, outer = stack.pop()
        conditional = bool(t.compares) or outer is not None
        for branch, ops in (("then", t.success), ("else", t.failure)) if t.compares else ((outer, t.success),):
            for op in ops:
                kind = type(op)
                if kind is cmds.PutReq:
                    wrote = True
                    yield (e.index, e.term, "put", cmds.key_text(op.key), None if op.ignore_value else op.value, conditional, branch)
                elif kind is cmds.DeleteRangeReq:
                    wrote = True
                    yield (e.index, e.term, "delete_range" if op.range_end else "delete", cmds.key_text(op.key), None, conditional, branch)
                elif kind is cmds.TxnReq:
                    stack.append((op, branch or "then"))
    if not wrote:
        yield (e.index, e.term, "read", None, None, bool(txn.compares), None)


def _mutation(e: Entry, op: cmds.Put | cmds.Delete, conditional: bool, branch: str | None) -> Row:
    if isinstance(op, cmds.Put):
        return (e.index, e.term, "put", op.key, op.value, conditional, branch)
    return (e.index, e.term, "delete", op.key, None, conditional, branch)
