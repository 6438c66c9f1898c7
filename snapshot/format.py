"""The snapshot file format (version 1).

    magic          8 bytes  b"LKVSNAP1"
    header_len     u32
    header         JSON: {"format", "index", "term", "membership", "created", "group", "node"}
    blocks         each: payload_len u32 | records u32 | crc32(payload) u32 | payload
                   payload: records, each key_len u32 | value_len u32 | mod_index u64 | key | value
                   (a block holds about BLOCK_BYTES; records are in key order across blocks)
    end block      payload_len = 0, records = 0, crc = 0
    block index    u64 offset of every block, in order
    trailer        index_offset u64 | records u64 | blocks u64 | crc32 u32 | magic b"LKVSEND1"
                   (the crc covers every byte before the trailer)

Readers stream it without loading it whole. The per-block CRCs and the block index let a
reader start at any block (the Spark export splits a file by blocks); the trailer CRC
verifies the file as a whole before it is installed or loaded.
"""

from __future__ import annotations

import io
import json
import os
import struct
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ..raft import failpoints

MAGIC = b"LKVSNAP1"
END_MAGIC = b"LKVSEND1"
FORMAT = 1
BLOCK_BYTES = 1 << 20
_U32 = struct.Struct(">I")
_BLOCK = struct.Struct(">III")
_RECORD = struct.Struct(">IIQ")
_TRAILER = struct.Struct(">QQQI8s")


class SnapshotFormatError(Exception):
    """The file is not a snapshot, is truncated, or fails a checksum."""


@dataclass(frozen=True, slots=True)
class SnapshotHeader:
    index: int
    term: int
    membership: bytes  # encoded raft.membership.Membership
    created: float
    group: str = "default"
    node: str = ""
    format: int = FORMAT

    def to_json(self) -> dict:
        return {
            "format": self.format,
            "index": self.index,
            "term": self.term,
            "membership": json.loads(self.membership or b"[]"),
            "created": self.created,
            "group": self.group,
            "node": self.node,
        }


@dataclass(frozen=True, slots=True)
class Trailer:
    index_offset: int
    records: int
    blocks: int
    crc: int


class _CrcWriter:
    """A file wrapper that keeps a running crc32 and the position."""

    def __init__(self, f) -> None:
        self.f, self.crc, self.pos = f, 0, 0

    def write(self, b: bytes) -> None:
        self.f.write(b)
        self.crc = zlib.crc32(b, self.crc)
        self.pos += len(b)


def write_snapshot(
    f,
    header: SnapshotHeader,
    items: Iterable[tuple[bytes, bytes, int]],
    progress: Callable[[int, int], None] | None = None,
) -> Trailer:
    """Write a whole snapshot to the binary file object f. Returns the trailer."""
    w = _CrcWriter(f)
    hdr = json.dumps(header.to_json(), separators=(",", ":")).encode()
    w.write(MAGIC + _U32.pack(len(hdr)) + hdr)
    offsets: list[int] = []
    total = 0
    pack = _RECORD.pack
    parts: list[bytes] = []
    size = count = 0
    for k, v, mod in items:
        parts.append(pack(len(k), len(v), mod))
        parts.append(k)
        parts.append(v)
        size += 16 + len(k) + len(v)
        count += 1
        if size >= BLOCK_BYTES:
            offsets.append(w.pos)
            payload = b"".join(parts)
            w.write(_BLOCK.pack(len(payload), count, zlib.crc32(payload)) + payload)
            total += count
            parts, size, count = [], 0, 0
            failpoints.hit("snapshot.mid_write")
            if progress is not None:
                progress(total, w.pos)
    if count:
        offsets.append(w.pos)
        payload = b"".join(parts)
        w.write(_BLOCK.pack(len(payload), count, zlib.crc32(payload)) + payload)
        total += count
    w.write(_BLOCK.pack(0, 0, 0))
    index_offset = w.pos
    w.write(struct.pack(f">{len(offsets)}Q", *offsets))
    trailer = Trailer(index_offset, total, len(offsets), w.crc)
    f.write(_TRAILER.pack(index_offset, total, len(offsets), w.crc, END_MAGIC))
    if progress is not None:
        progress(total, w.pos + _TRAILER.size)
    return trailer


def read_header(f) -> tuple[SnapshotHeader, int]:
    """The header, and the offset of the first block."""
    f.seek(0)
    head = f.read(len(MAGIC) + 4)
    if len(head) < len(MAGIC) + 4 or head[: len(MAGIC)] != MAGIC:
        raise SnapshotFormatError("not a ledgerkv snapshot file (bad magic)")
    (n,) = _U32.unpack_from(head, len(MAGIC))
    if n > 16 << 20:
        raise SnapshotFormatError("snapshot header is implausibly large")
    raw = f.read(n)
    if len(raw) != n:
        raise SnapshotFormatError("snapshot file is truncated inside its header")
    try:
        d = json.loads(raw)
        if d.get("format") != FORMAT:
            raise SnapshotFormatError(f"snapshot format {d.get('format')} is not one this ledgerkv reads ({FORMAT})")
        header = SnapshotHeader(
            int(d["index"]),
            int(d["term"]),
            json.dumps(d.get("membership", []), separators=(",", ":")).encode(),
            float(d.get("created", 0)),
            str(d.get("group", "default")),
            str(d.get("node", "")),
        )
    except (ValueError, KeyError, TypeError) as e:
        raise SnapshotFormatError(f"snapshot header is not valid: {e}") from e
    return header, len(MAGIC) + 4 + n


def read_trailer(f) -> Trailer:
    f.seek(0, io.SEEK_END)
    size = f.tell()
    if size < _TRAILER.size + len(MAGIC):
        raise SnapshotFormatError("snapshot file is truncated (no trailer)")
    f.seek(size - _TRAILER.size)
    index_offset, records, blocks, crc, magic = _TRAILER.unpack(f.read(_TRAILER.size))
    if magic != END_MAGIC or index_offset + 8 * blocks != size - _TRAILER.size:
        raise SnapshotFormatError("snapshot file is truncated or damaged (bad trailer)")
    return Trailer(index_offset, records, blocks, crc)


def block_offsets(f, trailer: Trailer) -> list[int]:
    f.seek(trailer.index_offset)
    raw = f.read(8 * trailer.blocks)
    return list(struct.unpack(f">{trailer.blocks}Q", raw))


def verify(path: str) -> tuple[SnapshotHeader, Trailer]:
    """Check the whole file: trailer, whole-file crc, every block's crc and the record count."""
    with open(path, "rb") as f:
        trailer = read_trailer(f)
        header, _ = read_header(f)
        f.seek(0)
        crc, left = 0, trailer.index_offset + 8 * trailer.blocks
        while left:
            chunk = f.read(min(left, 4 << 20))
            if not chunk:
                raise SnapshotFormatError("snapshot file is truncated")
            crc = zlib.crc32(chunk, crc)
            left -= len(chunk)
        if crc != trailer.crc:
            raise SnapshotFormatError("snapshot file fails its checksum: it is damaged")
        n = sum(1 for _ in iter_records(f, header_offset=None))
        if n != trailer.records:
            raise SnapshotFormatError(f"snapshot holds {n} records, its trailer says {trailer.records}")
    return header, trailer


def iter_blocks(f, start: int) -> Iterator[tuple[int, bytes]]:
    """(record count, payload) of each block from offset `start` to the end block."""
    f.seek(start)
    while True:
        head = f.read(_BLOCK.size)
        if len(head) != _BLOCK.size:
            raise SnapshotFormatError("snapshot file is truncated inside its records")
        n, count, crc = _BLOCK.unpack(head)
        if n == 0:
            return
        payload = f.read(n)
        if len(payload) != n or zlib.crc32(payload) != crc:
            raise SnapshotFormatError("a snapshot block fails its checksum: the file is damaged")
        yield count, payload


def iter_payload(payload: bytes) -> Iterator[tuple[bytes, bytes, int]]:
    """The records of one block payload: (key, value, mod_index)."""
    unpack = _RECORD.unpack_from
    o, end = 0, len(payload)
    while o < end:
        kl, vl, mod = unpack(payload, o)
        o += 16
        k = payload[o : o + kl]
        o += kl
        yield k, payload[o : o + vl], mod
        o += vl


def iter_records(f, header_offset: int | None = None) -> Iterator[tuple[bytes, bytes, int]]:
    """Every record of the file in key order (blocks are checked as they are read)."""
    if header_offset is None:
        _, header_offset = read_header(f)
    for _, payload in iter_blocks(f, header_offset):
        yield from iter_payload(payload)


def new_header(index: int, term: int, membership: bytes, group: str, node: str) -> SnapshotHeader:
    return SnapshotHeader(index, term, membership, time.time(), group, node)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
