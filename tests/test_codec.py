"""Peer frames: every message round-trips; anything malformed raises CodecError."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from kv.raft import codec
from kv.raft.messages import (
    Entry,
    ForwardCode,
    ForwardRequest,
    ForwardResponse,
    HeartbeatCode,
    HeartbeatRequest,
    HeartbeatResponse,
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

SAMPLES = [
    VoteRequest("n1", "n2", 5, 100, 4, True, False),
    VoteRequest("n1", "n2", 5, 100, 4, False, True),
    VoteResponse("n2", "n1", 5, VoteResult.REJECT_ALREADY_HAS_LEADER, True),
    HeartbeatRequest("n1", "n2", 5, 99, 17),
    HeartbeatResponse("n2", "n1", 5, HeartbeatCode.EXPIRED_TERM, 17),
    PushRequest("n1", "n2", 5, PushType.APPEND, 3, 10, 4, [Entry(11, 5, 0, b"a"), Entry(12, 5, 1, b""), Entry(13, 5, 2, b"\x00" * 300)], 9, 0),
    PushRequest("n1", "n2", 5, PushType.TRUNCATE, 3, 10, 4, [], 9, 13),
    PushRequest("n1", "n2", 5, PushType.COMMIT, 3, 0, 0, [], 12, 0),
    PushResponse("n2", "n1", 5, PushType.COMPARE, 3, PushCode.INCONSISTENT_STATE, 10, 20, 3, 7),
    TimeoutNow("n1", "n2", 5),
    ReadIndexRequest("n2", "n1", 5, 42),
    ReadIndexResponse("n1", "n2", 5, 42, 77, True),
    SnapshotChunk("n1", "n2", 5, 3, 100, 4, 1 << 20, 5 << 20, b"chunk", False),
    SnapshotChunkAck("n2", "n1", 5, 100, 2 << 20, True),
    ForwardRequest("n2", "n1", 9, b"\x01\x01cmd"),
    ForwardResponse("n1", "n2", 9, ForwardCode.NOT_LEADER, 0, 0, "n3", b"go away"),
    VoteRequest("nöde-ü", "n2", 1, 0, 0),  # ids are UTF-8
]


def split(frame: bytes):
    length, ftype = codec.FRAME_HEADER.unpack_from(frame)
    assert length == len(frame) - 4
    return ftype, frame[codec.FRAME_HEADER.size :]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    got = codec.decode(*split(codec.encode(msg)))
    if isinstance(msg, PushRequest):
        assert list(got.entries) == list(msg.entries)
        got = PushRequest(**{**{f: getattr(got, f) for f in got.__dataclass_fields__}, "entries": msg.entries})
    assert got == msg


def test_truncated_and_extended_frames_are_rejected():
    for msg in SAMPLES:
        ftype, body = split(codec.encode(msg))
        for cut in range(0, len(body) - 1, max(1, len(body) // 7)):
            if isinstance(msg, (SnapshotChunk, ForwardRequest, ForwardResponse)) and cut >= len(body) - len(getattr(msg, "data", getattr(msg, "payload", b""))):
                continue  # their trailing payload has no length of its own
            with pytest.raises(codec.CodecError):
                codec.decode(ftype, body[:cut])
        if not isinstance(msg, (SnapshotChunk, ForwardRequest, ForwardResponse)):
            with pytest.raises(codec.CodecError):
                codec.decode(ftype, body + b"\x00")


def test_random_garbage_never_escapes_as_another_exception():
    rng = random.Random(7)
    for _ in range(20_000):
        ftype = rng.randrange(0, 20)
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 80)))
        try:
            codec.decode(ftype, body)
        except codec.CodecError:
            pass


# One frame of every message type, as the codec wrote it before it became table-driven:
# the wire format is pinned byte for byte (a change here breaks mixed-version clusters).
GOLDEN = [
    (VoteRequest("n1", "n2", 5, 100, 4, True, True),
     "0000002001026e31026e3200000000000000050000000000000064000000000000000403"),
    (VoteResponse("n2", "n1", 5, VoteResult.REJECT_ALREADY_HAS_LEADER, True),
     "0000001102026e32026e3100000000000000050601"),
    (HeartbeatRequest("n1", "n2", 5, 99, 17),
     "0000001f03026e31026e32000000000000000500000000000000630000000000000011"),
    (HeartbeatResponse("n2", "n1", 5, HeartbeatCode.EXPIRED_TERM, 17),
     "0000001804026e32026e310000000000000005010000000000000011"),
    (PushRequest("n1", "n2", 5, PushType.APPEND, 3, 10, 4, [Entry(11, 5, 0, b"a"), Entry(12, 5, 1, b""), Entry(13, 5, 2, b"xyz")], 9, 0),
     "0000006705026e31026e320000000000000005000000000000000003000000000000000a000000000000000400000000000000090000000000000000000000030000000000000005000000000161000000000000000501000000000000000000000005020000000378797a"),
    (PushRequest("n1", "n2", 5, PushType.TRUNCATE, 3, 10, 4, [], 9, 13),
     "0000003c05026e31026e320000000000000005030000000000000003000000000000000a00000000000000040000000000000009000000000000000d00000000"),
    (PushResponse("n2", "n1", 5, PushType.COMPARE, 3, PushCode.INCONSISTENT_STATE, 10, 20, 3, 7),
     "0000003906026e32026e31000000000000000502000000000000000301000000000000000a000000000000001400000000000000030000000000000007"),
    (TimeoutNow("n1", "n2", 5),
     "0000000f07026e31026e320000000000000005"),
    (ReadIndexRequest("n2", "n1", 5, 42),
     "0000001708026e32026e310000000000000005000000000000002a"),
    (ReadIndexResponse("n1", "n2", 5, 42, 77, True),
     "0000002009026e31026e320000000000000005000000000000002a000000000000004d01"),
    (SnapshotChunk("n1", "n2", 5, 3, 100, 4, 1 << 20, 5 << 20, b"chunk", True),
     "0000003d0a026e31026e32000000000000000500000000000000030000000000000064000000000000000400000000001000000000000000500000016368756e6b"),
    (SnapshotChunkAck("n2", "n1", 5, 100, 2 << 20, True),
     "000000200b026e32026e3100000000000000050000000000000064000000000020000001"),
    (ForwardRequest("n2", "n1", 9, b"\x01\x01cmd"),
     "000000140c026e32026e3100000000000000090101636d64"),
    (ForwardResponse("n1", "n2", 9, ForwardCode.NOT_LEADER, 0, 0, "n3", b"go away"),
     "0000002a0d026e31026e3200000000000000090100000000000000000000000000000000026e33676f2061776179"),
    (VoteRequest("nöde-ü", "n2", 1, 0, 0),
     "0000002601086ec3b664652dc3bc026e3200000000000000010000000000000000000000000000000000"),
]


@pytest.mark.parametrize("msg,frame", GOLDEN, ids=lambda x: type(x).__name__ if not isinstance(x, str) else "")
def test_wire_format_is_pinned(msg, frame):
    assert codec.encode(msg).hex() == frame
    got = codec.decode(*split(bytes.fromhex(frame)))
    assert got == (replace(msg, entries=got.entries) if isinstance(msg, PushRequest) else msg)
    if isinstance(msg, PushRequest):
        assert list(got.entries) == list(msg.entries)


def test_the_golden_frames_cover_every_frame_type():
    assert {bytes.fromhex(frame)[4] for _, frame in GOLDEN} == set(range(1, 14))
