"""Binary encoding of peer messages.

A frame is `length (u32, big-endian) | type (u8) | body`; `length` counts type and body.
Bodies are fixed `struct` layouts, node ids are u8-length-prefixed UTF-8, and the entries of
a push are packed back to back (their indexes follow from prev_index). Anything that does not
parse raises CodecError; the transport then closes that connection and nothing else.
"""

from __future__ import annotations

import struct

from .errors import RaftError
from .messages import (
    Entry,
    ForwardCode,
    ForwardRequest,
    ForwardResponse,
    HeartbeatCode,
    HeartbeatRequest,
    HeartbeatResponse,
    Message,
    PushCode,
    PushRequest,
    PushResponse,
    PushType,
    ReadIndexRequest,
    ReadIndexResponse,
    SnapshotChunk,
    SnapshotChunkAck,
    TimeoutNow,
    VoteRequest,
    VoteResponse,
    VoteResult,
)

MAX_FRAME = 64 << 20  # a frame larger than this closes the connection
FRAME_HEADER = struct.Struct(">IB")


class CodecError(RaftError, ValueError):
    """A frame that does not parse: close the connection it came on."""


_VOTE_REQ = struct.Struct(">QQQB")
_VOTE_RESP = struct.Struct(">QBB")
_HB_REQ = struct.Struct(">QQQ")
_HB_RESP = struct.Struct(">QBQ")
_PUSH_REQ = struct.Struct(">QBQQQQQI")
_ENTRY = struct.Struct(">QBI")  # term, kind, data length
_PUSH_RESP = struct.Struct(">QBQBQQQQ")
_TERM = struct.Struct(">Q")
_READ_REQ = struct.Struct(">QQ")
_READ_RESP = struct.Struct(">QQQB")
_CHUNK = struct.Struct(">QQQQQQB")
_CHUNK_ACK = struct.Struct(">QQQB")
_FWD_REQ = struct.Struct(">Q")
_FWD_RESP = struct.Struct(">QBQQB")

# Frame type numbers: part of the wire format, never reuse one.
T_VOTE_REQ, T_VOTE_RESP, T_HB_REQ, T_HB_RESP, T_PUSH_REQ, T_PUSH_RESP = 1, 2, 3, 4, 5, 6
T_TIMEOUT_NOW, T_READ_REQ, T_READ_RESP, T_CHUNK, T_CHUNK_ACK = 7, 8, 9, 10, 11
T_FWD_REQ, T_FWD_RESP = 12, 13


def _ids(src: str, dst: str) -> bytes:
    s, d = src.encode(), dst.encode()
    return bytes((len(s),)) + s + bytes((len(d),)) + d


def _frame(ftype: int, body: bytes) -> bytes:
    return FRAME_HEADER.pack(len(body) + 1, ftype) + body


def encode(msg: Message) -> bytes:
    """One message as a complete frame."""
    t = type(msg)
    ids = _ids(msg.src, msg.dst)
    if t is PushRequest:
        head = ids + _PUSH_REQ.pack(
            msg.term, msg.type, msg.seq, msg.prev_index, msg.prev_term, msg.commit_index, msg.leader_end_index, len(msg.entries)
        )
        pack = _ENTRY.pack
        parts = [head]
        for e in msg.entries:
            parts.append(pack(e.term, e.kind, len(e.data)))
            parts.append(e.data)
        return _frame(T_PUSH_REQ, b"".join(parts))
    if t is PushResponse:
        body = _PUSH_RESP.pack(msg.term, msg.type, msg.seq, msg.code, msg.index, msg.end_index, msg.x_term, msg.x_index)
        return _frame(T_PUSH_RESP, ids + body)
    if t is HeartbeatRequest:
        return _frame(T_HB_REQ, ids + _HB_REQ.pack(msg.term, msg.commit_index, msg.read_seq))
    if t is HeartbeatResponse:
        return _frame(T_HB_RESP, ids + _HB_RESP.pack(msg.term, msg.code, msg.read_seq))
    if t is VoteRequest:
        flags = int(msg.pre_vote) | int(msg.transfer) << 1
        return _frame(T_VOTE_REQ, ids + _VOTE_REQ.pack(msg.term, msg.ledger_end_index, msg.ledger_end_term, flags))
    if t is VoteResponse:
        return _frame(T_VOTE_RESP, ids + _VOTE_RESP.pack(msg.term, msg.result, int(msg.pre_vote)))
    if t is TimeoutNow:
        return _frame(T_TIMEOUT_NOW, ids + _TERM.pack(msg.term))
    if t is ReadIndexRequest:
        return _frame(T_READ_REQ, ids + _READ_REQ.pack(msg.term, msg.ctx))
    if t is ReadIndexResponse:
        return _frame(T_READ_RESP, ids + _READ_RESP.pack(msg.term, msg.ctx, msg.index, int(msg.ok)))
    if t is SnapshotChunk:
        head = _CHUNK.pack(msg.term, msg.seq, msg.snapshot_index, msg.snapshot_term, msg.offset, msg.total_size, int(msg.done))
        return _frame(T_CHUNK, ids + head + msg.data)
    if t is SnapshotChunkAck:
        return _frame(T_CHUNK_ACK, ids + _CHUNK_ACK.pack(msg.term, msg.snapshot_index, msg.next_offset, int(msg.ok)))
    if t is ForwardRequest:
        return _frame(T_FWD_REQ, ids + _FWD_REQ.pack(msg.req_id) + msg.payload)
    if t is ForwardResponse:
        leader = msg.leader.encode()
        head = _FWD_RESP.pack(msg.req_id, msg.code, msg.index, msg.term, len(leader))
        return _frame(T_FWD_RESP, ids + head + leader + msg.payload)
    raise TypeError(f"cannot encode {t.__name__}")


def decode(ftype: int, body: bytes | memoryview) -> Message:
    """Parse one frame body (without the length and type header)."""
    try:
        return _decode(ftype, memoryview(body))
    except CodecError:
        raise
    except (struct.error, ValueError, IndexError, UnicodeDecodeError) as e:
        raise CodecError(f"malformed frame of type {ftype}: {e}") from e


def _decode(ftype: int, b: memoryview) -> Message:
    n = b[0]
    src = str(b[1 : 1 + n], "utf-8")
    m = b[1 + n]
    o = 2 + n + m
    dst = str(b[2 + n : o], "utf-8")
    if ftype == T_PUSH_REQ:
        term, ptype, seq, prev, prev_term, commit, leader_end, count = _PUSH_REQ.unpack_from(b, o)
        o += _PUSH_REQ.size
        entries = []
        unpack = _ENTRY.unpack_from
        size = _ENTRY.size
        index = prev
        for _ in range(count):
            eterm, kind, ln = unpack(b, o)
            o += size
            data = bytes(b[o : o + ln])
            if len(data) != ln:
                raise CodecError("push frame ends inside an entry")
            o += ln
            index += 1
            entries.append(Entry(index, eterm, kind, data))
        _end(b, o)
        return PushRequest(src, dst, term, PushType(ptype), seq, prev, prev_term, entries, commit, leader_end)
    if ftype == T_PUSH_RESP:
        term, ptype, seq, code, index, end, x_term, x_index = _PUSH_RESP.unpack_from(b, o)
        _end(b, o + _PUSH_RESP.size)
        return PushResponse(src, dst, term, PushType(ptype), seq, PushCode(code), index, end, x_term, x_index)
    if ftype == T_HB_REQ:
        term, commit, read_seq = _HB_REQ.unpack_from(b, o)
        _end(b, o + _HB_REQ.size)
        return HeartbeatRequest(src, dst, term, commit, read_seq)
    if ftype == T_HB_RESP:
        term, code, read_seq = _HB_RESP.unpack_from(b, o)
        _end(b, o + _HB_RESP.size)
        return HeartbeatResponse(src, dst, term, HeartbeatCode(code), read_seq)
    if ftype == T_VOTE_REQ:
        term, end_index, end_term, flags = _VOTE_REQ.unpack_from(b, o)
        _end(b, o + _VOTE_REQ.size)
        return VoteRequest(src, dst, term, end_index, end_term, bool(flags & 1), bool(flags & 2))
    if ftype == T_VOTE_RESP:
        term, result, pre = _VOTE_RESP.unpack_from(b, o)
        _end(b, o + _VOTE_RESP.size)
        return VoteResponse(src, dst, term, VoteResult(result), bool(pre))
    if ftype == T_TIMEOUT_NOW:
        (term,) = _TERM.unpack_from(b, o)
        _end(b, o + _TERM.size)
        return TimeoutNow(src, dst, term)
    if ftype == T_READ_REQ:
        term, ctx = _READ_REQ.unpack_from(b, o)
        _end(b, o + _READ_REQ.size)
        return ReadIndexRequest(src, dst, term, ctx)
    if ftype == T_READ_RESP:
        term, ctx, index, ok = _READ_RESP.unpack_from(b, o)
        _end(b, o + _READ_RESP.size)
        return ReadIndexResponse(src, dst, term, ctx, index, bool(ok))
    if ftype == T_CHUNK:
        term, seq, sindex, sterm, offset, total, done = _CHUNK.unpack_from(b, o)
        data = bytes(b[o + _CHUNK.size :])
        return SnapshotChunk(src, dst, term, seq, sindex, sterm, offset, total, data, bool(done))
    if ftype == T_CHUNK_ACK:
        term, sindex, next_offset, ok = _CHUNK_ACK.unpack_from(b, o)
        _end(b, o + _CHUNK_ACK.size)
        return SnapshotChunkAck(src, dst, term, sindex, next_offset, bool(ok))
    if ftype == T_FWD_REQ:
        (req_id,) = _FWD_REQ.unpack_from(b, o)
        return ForwardRequest(src, dst, req_id, bytes(b[o + _FWD_REQ.size :]))
    if ftype == T_FWD_RESP:
        req_id, code, index, term, ln = _FWD_RESP.unpack_from(b, o)
        o += _FWD_RESP.size
        leader = str(b[o : o + ln], "utf-8")
        return ForwardResponse(src, dst, req_id, ForwardCode(code), index, term, leader, bytes(b[o + ln :]))
    raise CodecError(f"unknown frame type {ftype}")


def _end(b: memoryview, o: int) -> None:
    if o != len(b):
        raise CodecError(f"{len(b) - o} stray bytes after the message")
