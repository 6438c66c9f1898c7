"""The snapshot file format (version 2; version 1 files still read).

    magic          8 bytes  b"LKVSNAP1"
    header_len     u32
    header         JSON: {"format", "index", "term", "membership", "created", "group", "node"}
    blocks         each: payload_len u32 | records u32 | crc32(payload) u32 | payload
                   payload, columnar (n records, in key order):
                     key offsets   (n + 1) x int32 LE, from 0    | key bytes
                     value offsets (n + 1) x int32 LE, from 0    | value bytes
                     mod_index     n x int64 LE
                   (a block holds about BLOCK_BYTES; records are in key order across blocks;
                   the offsets are Arrow's layout, so a reader can hand a block's buffers to
                   Arrow without touching records one by one)
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
import itertools
import json
import operator
import os
import struct
import sys
import time
import zlib
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ..raft import failpoints
from ..raft.errors import KVError
from ..raft.membership import is_ledger_id
from ..statemachine.commands import MAX_INDEX, MAX_KEY_BYTES

MAGIC = b"LKVSNAP1"
END_MAGIC = b"LKVSEND1"
FORMAT = 2  # 2: a key's creation keeps no history or meta record (statemachine/history.py)
READS = (1, 2)  # format 1's records read as they always did; a ledgerkv that reads only 1
# refuses a format-2 file rather than take a creation's missing record for "unchanged"
BLOCK_BYTES = 1 << 20
_U32 = struct.Struct(">I")
_BLOCK = struct.Struct(">III")
_TRAILER = struct.Struct(">QQQI8s")
END_BLOCK = _BLOCK.pack(0, 0, 0)
_LITTLE = sys.byteorder == "little"


class SnapshotError(KVError):
    """A snapshot file is missing, corrupt or of an unknown format (kv.SnapshotError)."""

    code, http_status = "SNAPSHOT_ERROR", 500


class SnapshotFormatError(SnapshotError):
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
    cluster: str = ""  # the id of the cluster whose state it holds ("": a file from before ids)
    removed: tuple[str, ...] = ()  # the ids removed from the cluster as of it (since 2026-12-07)

    def to_json(self) -> dict:
        return {
            "format": self.format,
            "index": self.index,
            "term": self.term,
            "membership": json.loads(self.membership or b"[]"),
            "created": self.created,
            "group": self.group,
            "node": self.node,
            **({"cluster": self.cluster} if self.cluster else {}),
            **({"removed": list(self.removed)} if self.removed else {}),
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


Block = tuple[list[bytes], list[bytes], bytes]  # keys, values, mod_indexes as int64 LE


def write_snapshot(
    f,
    header: SnapshotHeader,
    blocks: Iterable[Block],
    progress: Callable[[int, int], None] | None = None,
) -> Trailer:
    """Write a whole snapshot to the binary file object f, a block for each of `blocks`
    (records in key order: a state machine view's blocks(), or blocks_of(records)).
    Returns the trailer."""
    w = _CrcWriter(f)
    hdr = json.dumps(header.to_json(), separators=(",", ":")).encode()
    w.write(MAGIC + _U32.pack(len(hdr)) + hdr)
    offsets: list[int] = []
    total = 0
    for keys, values, mods in blocks:
        if not keys:
            continue
        offsets.append(w.pos)
        w.write(framed_block(keys, values, mods))
        total += len(keys)
        failpoints.hit("snapshot.mid_write")
        if held := failpoints.delay("snapshot.mid_write"):
            time.sleep(held)
        if progress is not None:
            progress(total, w.pos)
    w.write(END_BLOCK)
    index_offset = w.pos
    w.write(struct.pack(f">{len(offsets)}Q", *offsets))
    trailer = Trailer(index_offset, total, len(offsets), w.crc)
    f.write(_TRAILER.pack(index_offset, total, len(offsets), w.crc, END_MAGIC))
    if progress is not None:
        progress(total, w.pos + _TRAILER.size)
    return trailer


def blocks_of(records: Iterable[tuple[bytes, bytes, int]], block_bytes: int = BLOCK_BYTES) -> Iterator[Block]:
    """(key, value, mod_index) records, in key order, as blocks of about block_bytes."""
    keys: list[bytes] = []
    values: list[bytes] = []
    mods: list[int] = []
    size = 0
    for k, v, mod in records:
        keys.append(k)
        values.append(v)
        mods.append(mod)
        size += 16 + len(k) + len(v)
        if size >= block_bytes:
            yield keys, values, _le("q", mods)
            keys, values, mods, size = [], [], [], 0
    if keys:
        yield keys, values, _le("q", mods)


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
    except ValueError as e:
        raise SnapshotFormatError(f"snapshot header is not valid JSON: {e}") from e
    return _header_of(d), len(MAGIC) + 4 + n


def _header_of(d) -> SnapshotHeader:
    """A header from its JSON, every field checked (the file may be crafted: a valid CRC
    says nothing about where it came from)."""
    if not isinstance(d, dict):
        raise SnapshotFormatError("snapshot header is not a JSON object")
    if type(d.get("format")) is not int or d["format"] not in READS:
        raise SnapshotFormatError(f"snapshot format {d.get('format')!r} is not one this ledgerkv reads ({', '.join(map(str, READS))}): a newer ledgerkv wrote it?")
    index, term = _index_field(d, "index"), _index_field(d, "term")
    if index > 0 and term == 0:
        raise SnapshotFormatError(f"snapshot header: index {index} with term 0")
    created = d.get("created", 0)
    if type(created) not in (int, float) or not 0 <= created < 1e11:
        raise SnapshotFormatError(f"snapshot header: created must be a Unix time, not {created!r}")
    group, node = d.get("group", "default"), d.get("node", "")
    if type(group) is not str or not group or type(node) is not str:
        raise SnapshotFormatError("snapshot header: group (non-empty) and node must be strings")
    cluster = d.get("cluster", "")
    if type(cluster) is not str or len(cluster) > 64:
        raise SnapshotFormatError("snapshot header: cluster must be a cluster id (a string)")
    membership = d.get("membership", [])
    _check_membership(membership)
    removed = d.get("removed", [])
    if type(removed) is not list or len(removed) > MAX_REMOVED or any(type(r) is not str or not 0 < len(r) <= 255 for r in removed):
        raise SnapshotFormatError(f"snapshot header: removed must be a list of at most {MAX_REMOVED} member ids")
    return SnapshotHeader(
        index, term, json.dumps(membership, separators=(",", ":")).encode(), float(created), group, node, d["format"], cluster, tuple(removed)
    )


MAX_REMOVED = 100_000  # (a header is read whole: bounded)


def _index_field(d: dict, name: str) -> int:
    v = d.get(name)
    if type(v) is not int or not 0 <= v <= MAX_INDEX:
        raise SnapshotFormatError(f"snapshot header: {name} must be an integer from 0 to {MAX_INDEX}, not {v!r}")
    return v


# "ledger" since 2026-12-06 (raft/membership.py): an earlier version refuses a snapshot whose
# membership has a member that joined since, as it refuses a later format (docs/design.md).
_MEMBER_FIELDS = {"id": str, "peer": str, "http": str, "voter": bool, "promote": bool, "ledger": str}


def _check_membership(members) -> None:
    if not isinstance(members, list):
        raise SnapshotFormatError("snapshot header: membership must be a list of members")
    ids = set()
    for m in members:
        if not isinstance(m, dict) or not {"id", "peer"} <= set(m):
            raise SnapshotFormatError(f"snapshot header: a member must be an object with id and peer, not {m!r:.100}")
        for k, v in m.items():
            if k not in _MEMBER_FIELDS or type(v) is not _MEMBER_FIELDS[k]:
                raise SnapshotFormatError(f"snapshot header: member field {k!r} is unknown or of the wrong type")
        if "ledger" in m and not is_ledger_id(m["ledger"]):
            raise SnapshotFormatError(f"snapshot header: member {m['id']!r:.40}'s ledger is not a ledger id")
        if not m["id"] or m["id"] in ids:
            raise SnapshotFormatError(f"snapshot header: member id {m['id']!r} is empty or repeated")
        ids.add(m["id"])


ETCD_SUFFIX_ALIGN, ETCD_SUFFIX_HASH = 512, 32  # see _snapshot_end


def _snapshot_end(f, size: int) -> int:
    """Where the snapshot ends in a file of `size` bytes: its end, or, for a file saved by
    etcd's client (`etcdctl snapshot save` from ledgerkv's etcd API), before the zeros that
    pad it to a multiple of 512 bytes and the sha256 after them, which that client wants."""
    f.seek(max(0, size - len(END_MAGIC)))
    if f.read(len(END_MAGIC)) == END_MAGIC or size % ETCD_SUFFIX_ALIGN != ETCD_SUFFIX_HASH:
        return size
    room = min(size, ETCD_SUFFIX_ALIGN + ETCD_SUFFIX_HASH)
    f.seek(size - room)
    body = f.read(room)[:-ETCD_SUFFIX_HASH]
    kept = body.rstrip(b"\0")
    return size - ETCD_SUFFIX_HASH - (len(body) - len(kept)) if kept.endswith(END_MAGIC) else size


def read_trailer(f) -> Trailer:
    f.seek(0, io.SEEK_END)
    size = _snapshot_end(f, f.tell())
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
        header, _ = read_header(f)  # first: another kind of file is "not a snapshot", not "damaged"
        trailer = read_trailer(f)
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
        _, first_block = read_header(f)
        offsets = block_offsets(f, trailer)
        n = blocks = 0
        last_key = None
        at = first_block  # where the next block starts
        for count, payload in iter_blocks(f, first_block):
            if blocks >= len(offsets) or offsets[blocks] != at:
                raise SnapshotFormatError(f"the snapshot's block index does not match its block {blocks}")
            blocks += 1
            at += _BLOCK.size + len(payload)
            last_key = _check_records(*_keys_and_mods(payload, count), last_key, header.index)
            n += count
        if blocks != trailer.blocks or n != trailer.records:
            raise SnapshotFormatError(
                f"snapshot holds {n} records in {blocks} blocks; its trailer says {trailer.records} in {trailer.blocks}"
            )
    return header, trailer


_MAX_RESERVED_KEY_BYTES = 2 * MAX_KEY_BYTES + 64


def _keys_and_mods(payload: bytes, n: int) -> tuple[list[bytes], list[int]]:
    """A block's keys and mod_indexes (verify has no use for the values)."""
    ko, kb, _vo, _vb, mb = block_columns(payload, n)
    return _slices(ko, kb, n), _from_le("q", mb).tolist()


def _slices(offsets: bytes, data: bytes, n: int) -> list[bytes]:
    """The n items of an offsets column and the data it points into."""
    o = _from_le("i", offsets)
    return [data[o[i] : o[i + 1]] for i in range(n)]


def _check_records(keys: list[bytes], mods: list[int], last_key: bytes | None, index: int) -> bytes | None:
    """Keys are within the key limit (any bytes: see commands.key_bytes; ledgerkv's own records, the reserved keys
    starting with NUL, are bytes, at most twice as long plus some: a history record holds a
    key), strictly increasing; mod_indexes are in [1, the snapshot's index]. Returns the last key."""
    for k, mod in zip(keys, mods):
        if k[:1] == b"\x00":
            if len(k) > _MAX_RESERVED_KEY_BYTES:
                raise SnapshotFormatError(f"snapshot record: a reserved key of {len(k)} bytes (at most {_MAX_RESERVED_KEY_BYTES})")
        elif not 0 < len(k) <= MAX_KEY_BYTES:
            raise SnapshotFormatError(f"snapshot record: a key of {len(k)} bytes (keys are 1 to {MAX_KEY_BYTES})")
        if last_key is not None and k <= last_key:
            raise SnapshotFormatError(f"snapshot record: key {k[:60]!r} is out of order")
        if not 0 < mod <= index:
            raise SnapshotFormatError(f"snapshot record: key {k[:60]!r} has mod_index {mod}, outside 1..{index}")
        last_key = k
    return last_key


def framed_block(keys: list[bytes], values: list[bytes], mods: bytes) -> bytes:
    """A block as the file holds it: its length, record count and crc32, then its payload
    (also how an export view's key ranges are streamed: GET /v1/export/{view})."""
    payload = encode_block(keys, values, mods)
    return _BLOCK.pack(len(payload), len(keys), zlib.crc32(payload)) + payload


def iter_blocks(f, start: int | None) -> Iterator[tuple[int, bytes]]:
    """(record count, payload) of each block from offset `start` (None: where f is, for a
    stream) to the end block."""
    if start is not None:
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


def _le(typecode: str, values) -> bytes:
    a = array(typecode, values)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def _from_le(typecode: str, raw: bytes | memoryview) -> array:
    a = array(typecode)
    a.frombytes(raw)
    if not _LITTLE:
        a.byteswap()
    return a


def encode_block(keys: list[bytes], values: list[bytes], mods: bytes) -> bytes:
    """A block's payload; mods: the mod_indexes as int64 little-endian."""
    return b"".join(
        (
            _le("i", itertools.accumulate(map(len, keys), initial=0)),
            b"".join(keys),
            _le("i", itertools.accumulate(map(len, values), initial=0)),
            b"".join(values),
            mods,
        )
    )


def block_columns(payload: bytes, n: int) -> tuple[bytes, bytes, bytes, bytes, bytes]:
    """The raw buffers of a block of n records: key offsets, keys, value offsets, values,
    mod indexes (Arrow's layout: little-endian int32 offsets, int64 values)."""
    o = 0
    w = 4 * (n + 1)
    if w + w + 8 * n > len(payload):
        raise SnapshotFormatError(f"a snapshot block says it holds {n} records, more than fit in it")
    ko = payload[o : o + w]
    o += w
    klen = _offsets_end(ko, len(payload) - o)
    kb = payload[o : o + klen]
    o += klen
    vo = payload[o : o + w]
    o += w
    vlen = _offsets_end(vo, len(payload) - o)
    vb = payload[o : o + vlen]
    o += vlen
    mb = payload[o : o + 8 * n]
    if len(vo) != w or len(mb) != 8 * n or o + 8 * n != len(payload):
        raise SnapshotFormatError("a snapshot block is malformed")
    return ko, kb, vo, vb, mb


def _offsets_end(raw: bytes, room: int) -> int:
    """The end of the data an offsets column points into, once it is checked: starting at
    0, never decreasing, within the `room` left in the block."""
    offs = _from_le("i", raw)
    if offs[0] != 0 or offs[-1] > room or any(map(operator.gt, offs, itertools.islice(offs, 1, None))):
        raise SnapshotFormatError("a snapshot block has malformed offsets")
    return offs[-1]


def parse_block(payload: bytes, n: int) -> tuple[list[bytes], list[bytes], list[int]]:
    """The records of one block, as columns: keys, values, mod_indexes."""
    ko, kb, vo, vb, mb = block_columns(payload, n)
    return _slices(ko, kb, n), _slices(vo, vb, n), _from_le("q", mb).tolist()




def iter_records(f, header_offset: int | None = None) -> Iterator[tuple[bytes, bytes, int]]:
    """Every record of the file in key order (blocks are checked as they are read)."""
    if header_offset is None:
        _, header_offset = read_header(f)
    for count, payload in iter_blocks(f, header_offset):
        yield from zip(*parse_block(payload, count))


def new_header(index: int, term: int, membership: bytes, group: str, node: str, cluster: str = "", removed: Iterable[str] = ()) -> SnapshotHeader:
    return SnapshotHeader(index, term, membership, time.time(), group, node, cluster=cluster, removed=tuple(sorted(removed)))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
