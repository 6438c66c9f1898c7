"""Binary encoding of peer messages: each message type is described once, in `MESSAGES`,
and one generic `encode` / `decode` follows that table.

A frame is `length (u32, big-endian) | type (u8) | body`; `length` counts type and body.
A body is the sender's and the receiver's ids (each u8-length-prefixed UTF-8), then the
message's fixed-size fields in table order (big-endian `struct` codes), then the lengths of
its variable fields, then their contents: the entries of a push packed back to back (their
indexes follow from prev_index), a u8-length-prefixed string, or a payload that takes the
rest of the frame. Anything that does not parse raises CodecError; the transport then
closes that connection and nothing else.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from operator import attrgetter
from typing import Any

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
_ENTRY = struct.Struct(">QBI")  # term, kind, data length; the data follows


class CodecError(RaftError, ValueError):
    """A frame that does not parse: close the connection it came on."""


# -- field kinds ------------------------------------------------------------------------


class _Fixed:
    """A field of the fixed part: one struct code, converted by `conv` when decoded."""

    def __init__(self, name: str, code: str, conv: Callable[[int], Any] | None = None) -> None:
        self.name, self.code, self.conv = name, code, conv
        self.get = attrgetter(name)

    def put(self, value: int, kw: dict) -> None:
        kw[self.name] = value if self.conv is None else self.conv(value)


def u64(name: str) -> _Fixed:
    return _Fixed(name, "Q")


def u8(name: str, conv: Callable[[int], Any]) -> _Fixed:
    """A byte: an enum's value, or a bool (`conv=bool`)."""
    return _Fixed(name, "B", conv)


class _Flags(_Fixed):
    """Booleans packed into one byte, the first in bit 0."""

    def __init__(self, *names: str) -> None:
        super().__init__("/".join(names), "B")
        self.names = names
        self.get = lambda msg: sum(int(getattr(msg, n)) << k for k, n in enumerate(names))

    def put(self, value: int, kw: dict) -> None:
        for k, n in enumerate(self.names):
            kw[n] = bool(value >> k & 1)


class _Entries:
    """A push's entries: their count (u32) in the fixed part, then term, kind and data of
    each; the first has index prev_index + 1."""

    code = "I"

    def __init__(self, name: str) -> None:
        self.name = name

    def length(self, msg: Message) -> int:
        return len(getattr(msg, self.name))

    def write(self, msg: Message, parts: list) -> None:
        pack = _ENTRY.pack
        for e in getattr(msg, self.name):
            parts.append(pack(e.term, e.kind, len(e.data)))
            parts.append(e.data)

    def read(self, b: memoryview, o: int, count: int, kw: dict) -> int:
        entries = []
        unpack, size = _ENTRY.unpack_from, _ENTRY.size
        index = kw["prev_index"]
        for _ in range(count):  # a lying count runs out of frame, never allocates ahead
            term, kind, ln = unpack(b, o)
            o += size
            data = bytes(b[o : o + ln])
            if len(data) != ln:
                raise CodecError("frame ends inside an entry")
            o += ln
            index += 1
            entries.append(Entry(index, term, kind, data))
        kw[self.name] = entries
        return o


class _Str8:
    """A UTF-8 string: its length (u8) in the fixed part, its bytes after it."""

    code = "B"

    def __init__(self, name: str) -> None:
        self.name = name

    def length(self, msg: Message) -> int:
        return len(getattr(msg, self.name).encode())

    def write(self, msg: Message, parts: list) -> None:
        parts.append(getattr(msg, self.name).encode())

    def read(self, b: memoryview, o: int, ln: int, kw: dict) -> int:
        if o + ln > len(b):
            raise CodecError(f"frame ends inside {self.name}")
        kw[self.name] = str(b[o : o + ln], "utf-8")
        return o + ln


class _Rest:
    """Bytes that take the rest of the frame (so they come last, with no length)."""

    code = ""

    def __init__(self, name: str) -> None:
        self.name = name

    def write(self, msg: Message, parts: list) -> None:
        parts.append(getattr(msg, self.name))

    def read(self, b: memoryview, o: int, _ln: None, kw: dict) -> int:
        kw[self.name] = bytes(b[o:])
        return len(b)


class _Spec:
    """One message type: its frame type number (part of the wire format, never reuse
    one), its class, its fixed-size fields and its variable ones, in wire order."""

    def __init__(self, ftype: int, cls: type, fixed: tuple[_Fixed, ...], variable: tuple[_Entries | _Str8 | _Rest, ...] = ()) -> None:
        self.ftype, self.cls, self.fixed, self.variable = ftype, cls, fixed, variable
        self.struct = struct.Struct(">" + "".join(f.code for f in fixed + variable))
        # The hot path: plain fields are read in one C call and converted only where needed.
        plain = all(type(f) is _Fixed for f in fixed)
        self.get_fixed = attrgetter(*(f.name for f in fixed)) if plain and len(fixed) > 1 else None
        self.names = [f.name for f in fixed] if plain else None
        self.convs = [(f.name, f.conv) for f in fixed if f.conv is not None] if plain else None


# -- the messages -----------------------------------------------------------------------

MESSAGES = (
    _Spec(1, VoteRequest, (u64("term"), u64("ledger_end_index"), u64("ledger_end_term"), _Flags("pre_vote", "transfer"))),
    _Spec(2, VoteResponse, (u64("term"), u8("result", VoteResult), u8("pre_vote", bool))),
    _Spec(3, HeartbeatRequest, (u64("term"), u64("commit_index"), u64("read_seq"))),
    _Spec(4, HeartbeatResponse, (u64("term"), u8("code", HeartbeatCode), u64("read_seq"))),
    _Spec(
        5,
        PushRequest,
        (u64("term"), u8("type", PushType), u64("seq"), u64("prev_index"), u64("prev_term"), u64("commit_index"), u64("leader_end_index")),
        (_Entries("entries"),),
    ),
    _Spec(
        6,
        PushResponse,
        (u64("term"), u8("type", PushType), u64("seq"), u8("code", PushCode), u64("index"), u64("end_index"), u64("x_term"), u64("x_index")),
    ),
    _Spec(7, TimeoutNow, (u64("term"),)),
    _Spec(8, ReadIndexRequest, (u64("term"), u64("ctx"))),
    _Spec(9, ReadIndexResponse, (u64("term"), u64("ctx"), u64("index"), u8("ok", bool))),
    _Spec(
        10,
        SnapshotChunk,
        (u64("term"), u64("seq"), u64("snapshot_index"), u64("snapshot_term"), u64("offset"), u64("total_size"), u8("done", bool)),
        (_Rest("data"),),
    ),
    _Spec(11, SnapshotChunkAck, (u64("term"), u64("snapshot_index"), u64("next_offset"), u8("ok", bool))),
    _Spec(12, ForwardRequest, (u64("req_id"),), (_Rest("payload"),)),
    _Spec(
        13,
        ForwardResponse,
        (u64("req_id"), u8("code", ForwardCode), u64("index"), u64("term")),
        (_Str8("leader"), _Rest("payload")),
    ),
)
_BY_CLASS = {s.cls: s for s in MESSAGES}
_BY_FTYPE = {s.ftype: s for s in MESSAGES}


def frame(ftype: int, body: bytes) -> bytes:
    return FRAME_HEADER.pack(len(body) + 1, ftype) + body


def encode(msg: Message) -> bytes:
    """One message as a complete frame."""
    spec = _BY_CLASS.get(type(msg))
    if spec is None:
        raise TypeError(f"cannot encode {type(msg).__name__}")
    s, d = msg.src.encode(), msg.dst.encode()
    values = spec.get_fixed(msg) if spec.get_fixed else [f.get(msg) for f in spec.fixed]
    if spec.variable:
        values = [*values, *(v.length(msg) for v in spec.variable if v.code)]
    parts = [bytes((len(s),)), s, bytes((len(d),)), d, spec.struct.pack(*values)]
    for v in spec.variable:
        v.write(msg, parts)
    return frame(spec.ftype, b"".join(parts))


def decode(ftype: int, body: bytes | memoryview) -> Message:
    """Parse one frame body (without the length and type header)."""
    try:
        return _decode(ftype, memoryview(body))
    except CodecError:
        raise
    except (struct.error, ValueError, IndexError, UnicodeDecodeError) as e:
        raise CodecError(f"malformed frame of type {ftype}: {e}") from e


def _decode(ftype: int, b: memoryview) -> Message:
    spec = _BY_FTYPE.get(ftype)
    if spec is None:
        raise CodecError(f"unknown frame type {ftype}")
    st = spec.struct
    n = b[0]
    m = b[1 + n]
    o = 2 + n + m
    kw: dict[str, Any] = {"src": str(b[1 : 1 + n], "utf-8"), "dst": str(b[2 + n : o], "utf-8")}
    values = st.unpack_from(b, o)
    o += st.size
    if spec.names is not None:
        kw.update(zip(spec.names, values))
        for name, conv in spec.convs:
            kw[name] = conv(kw[name])
    else:
        for f, value in zip(spec.fixed, values):
            f.put(value, kw)
    lengths = iter(values[len(spec.fixed) :])
    for v in spec.variable:
        o = v.read(b, o, next(lengths) if v.code else None, kw)
    if o != len(b):
        raise CodecError(f"{len(b) - o} stray bytes after the message")
    return spec.cls(**kw)
