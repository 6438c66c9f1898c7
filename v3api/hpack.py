"""HPACK (RFC 7541), the header compression of HTTP/2, as the gRPC front needs it: a full
decoder (indexed fields, literals with and without indexing, the dynamic table and its size
updates, Huffman-coded strings) for what clients send, and the few fixed header blocks the
server answers with (literals without indexing: the server never touches its peer's table).
Malformed input raises HpackError, which the connection answers with COMPRESSION_ERROR."""

from __future__ import annotations

from kv import KVError

# RFC 7541 Appendix A: the static table (index 1 first)
STATIC_TABLE = (
    (':authority', ''),
    (':method', 'GET'),
    (':method', 'POST'),
    (':path', '/'),
    (':path', '/index.html'),
    (':scheme', 'http'),
    (':scheme', 'https'),
    (':status', '200'),
    (':status', '204'),
    (':status', '206'),
    (':status', '304'),
    (':status', '400'),
    (':status', '404'),
    (':status', '500'),
    ('accept-charset', ''),
    ('accept-encoding', 'gzip, deflate'),
    ('accept-language', ''),
    ('accept-ranges', ''),
    ('accept', ''),
    ('access-control-allow-origin', ''),
    ('age', ''),
    ('allow', ''),
    ('authorization', ''),
    ('cache-control', ''),
    ('content-disposition', ''),
    ('content-encoding', ''),
    ('content-language', ''),
    ('content-length', ''),
    ('content-location', ''),
    ('content-range', ''),
    ('content-type', ''),
    ('cookie', ''),
    ('date', ''),
    ('etag', ''),
    ('expect', ''),
    ('expires', ''),
    ('from', ''),
    ('host', ''),
    ('if-match', ''),
    ('if-modified-since', ''),
    ('if-none-match', ''),
    ('if-range', ''),
    ('if-unmodified-since', ''),
    ('last-modified', ''),
    ('link', ''),
    ('location', ''),
    ('max-forwards', ''),
    ('proxy-authenticate', ''),
    ('proxy-authorization', ''),
    ('range', ''),
    ('referer', ''),
    ('refresh', ''),
    ('retry-after', ''),
    ('server', ''),
    ('set-cookie', ''),
    ('strict-transport-security', ''),
    ('transfer-encoding', ''),
    ('user-agent', ''),
    ('vary', ''),
    ('via', ''),
    ('www-authenticate', ''),
)

# RFC 7541 Appendix B: the Huffman code of each byte value, and its length in bits (EOS: 30 ones)
HUFFMAN_CODES = (
    0x1ff8, 0x7fffd8, 0xfffffe2, 0xfffffe3, 0xfffffe4, 0xfffffe5, 0xfffffe6, 0xfffffe7, 0xfffffe8,
    0xffffea, 0x3ffffffc, 0xfffffe9, 0xfffffea, 0x3ffffffd, 0xfffffeb, 0xfffffec, 0xfffffed,
    0xfffffee, 0xfffffef, 0xffffff0, 0xffffff1, 0xffffff2, 0x3ffffffe, 0xffffff3, 0xffffff4,
    0xffffff5, 0xffffff6, 0xffffff7, 0xffffff8, 0xffffff9, 0xffffffa, 0xffffffb, 0x14, 0x3f8, 0x3f9,
    0xffa, 0x1ff9, 0x15, 0xf8, 0x7fa, 0x3fa, 0x3fb, 0xf9, 0x7fb, 0xfa, 0x16, 0x17, 0x18, 0x0, 0x1,
    0x2, 0x19, 0x1a, 0x1b, 0x1c, 0x1d, 0x1e, 0x1f, 0x5c, 0xfb, 0x7ffc, 0x20, 0xffb, 0x3fc, 0x1ffa,
    0x21, 0x5d, 0x5e, 0x5f, 0x60, 0x61, 0x62, 0x63, 0x64, 0x65, 0x66, 0x67, 0x68, 0x69, 0x6a, 0x6b,
    0x6c, 0x6d, 0x6e, 0x6f, 0x70, 0x71, 0x72, 0xfc, 0x73, 0xfd, 0x1ffb, 0x7fff0, 0x1ffc, 0x3ffc,
    0x22, 0x7ffd, 0x3, 0x23, 0x4, 0x24, 0x5, 0x25, 0x26, 0x27, 0x6, 0x74, 0x75, 0x28, 0x29, 0x2a,
    0x7, 0x2b, 0x76, 0x2c, 0x8, 0x9, 0x2d, 0x77, 0x78, 0x79, 0x7a, 0x7b, 0x7ffe, 0x7fc, 0x3ffd,
    0x1ffd, 0xffffffc, 0xfffe6, 0x3fffd2, 0xfffe7, 0xfffe8, 0x3fffd3, 0x3fffd4, 0x3fffd5, 0x7fffd9,
    0x3fffd6, 0x7fffda, 0x7fffdb, 0x7fffdc, 0x7fffdd, 0x7fffde, 0xffffeb, 0x7fffdf, 0xffffec,
    0xffffed, 0x3fffd7, 0x7fffe0, 0xffffee, 0x7fffe1, 0x7fffe2, 0x7fffe3, 0x7fffe4, 0x1fffdc,
    0x3fffd8, 0x7fffe5, 0x3fffd9, 0x7fffe6, 0x7fffe7, 0xffffef, 0x3fffda, 0x1fffdd, 0xfffe9,
    0x3fffdb, 0x3fffdc, 0x7fffe8, 0x7fffe9, 0x1fffde, 0x7fffea, 0x3fffdd, 0x3fffde, 0xfffff0,
    0x1fffdf, 0x3fffdf, 0x7fffeb, 0x7fffec, 0x1fffe0, 0x1fffe1, 0x3fffe0, 0x1fffe2, 0x7fffed,
    0x3fffe1, 0x7fffee, 0x7fffef, 0xfffea, 0x3fffe2, 0x3fffe3, 0x3fffe4, 0x7ffff0, 0x3fffe5,
    0x3fffe6, 0x7ffff1, 0x3ffffe0, 0x3ffffe1, 0xfffeb, 0x7fff1, 0x3fffe7, 0x7ffff2, 0x3fffe8,
    0x1ffffec, 0x3ffffe2, 0x3ffffe3, 0x3ffffe4, 0x7ffffde, 0x7ffffdf, 0x3ffffe5, 0xfffff1,
    0x1ffffed, 0x7fff2, 0x1fffe3, 0x3ffffe6, 0x7ffffe0, 0x7ffffe1, 0x3ffffe7, 0x7ffffe2, 0xfffff2,
    0x1fffe4, 0x1fffe5, 0x3ffffe8, 0x3ffffe9, 0xffffffd, 0x7ffffe3, 0x7ffffe4, 0x7ffffe5, 0xfffec,
    0xfffff3, 0xfffed, 0x1fffe6, 0x3fffe9, 0x1fffe7, 0x1fffe8, 0x7ffff3, 0x3fffea, 0x3fffeb,
    0x1ffffee, 0x1ffffef, 0xfffff4, 0xfffff5, 0x3ffffea, 0x7ffff4, 0x3ffffeb, 0x7ffffe6, 0x3ffffec,
    0x3ffffed, 0x7ffffe7, 0x7ffffe8, 0x7ffffe9, 0x7ffffea, 0x7ffffeb, 0xffffffe, 0x7ffffec,
    0x7ffffed, 0x7ffffee, 0x7ffffef, 0x7fffff0, 0x3ffffee,
)
HUFFMAN_BITS = (
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 30, 28,
    28, 28, 28, 28, 28, 28, 28, 28, 6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, 5, 5, 5,
    6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10, 13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
    7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6, 15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5,
    6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28, 20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23,
    23, 23, 23, 24, 23, 24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, 22, 21, 20,
    22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23, 21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22,
    22, 23, 22, 22, 23, 26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25, 19, 21, 26,
    27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27, 20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25,
    25, 24, 24, 26, 23, 26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26,
)


class HpackError(KVError):
    """A header block that does not decode."""


def _huffman_machine():
    """The Huffman decoder as a state machine read four bits at a time (as nghttp2's):
    a state is an inner node of the code tree; MACHINE[state * 16 + nibble] is (next state,
    the bytes completed on the way, or None where the nibble reaches EOS or no code).
    ENDS: the states a string may end in (padding: up to 7 one-bits, a prefix of EOS)."""
    tree: list[list] = [[None, None]]  # inner nodes: [child for 0, child for 1]; a leaf is an int
    for sym, (code, bits) in enumerate(zip(HUFFMAN_CODES, HUFFMAN_BITS)):
        node = 0
        for i in range(bits - 1, -1, -1):
            b = (code >> i) & 1
            if i == 0:
                tree[node][b] = -1 - sym
            else:
                if tree[node][b] is None:
                    tree.append([None, None])
                    tree[node][b] = len(tree) - 1
                node = tree[node][b]
    machine: list = []
    for state in range(len(tree)):
        for nibble in range(16):
            node, out, ok = state, bytearray(), True
            for i in (3, 2, 1, 0):
                nxt = tree[node][(nibble >> i) & 1]
                if nxt is None:  # past the 30 ones of EOS
                    ok = False
                    break
                if nxt < 0:
                    out.append(-1 - nxt)
                    node = 0
                else:
                    node = nxt
            machine.append((node, bytes(out)) if ok else None)
    ends, node = {0}, 0
    for _ in range(7):
        node = tree[node][1]
        ends.add(node)
    return tuple(machine), frozenset(ends)


MACHINE, ENDS = _huffman_machine()


def huffman_decode(data: bytes) -> bytes:
    state, out, machine = 0, [], MACHINE
    for byte in data:
        for nibble in (byte >> 4, byte & 15):
            step = machine[state * 16 + nibble]
            if step is None:
                raise HpackError("a Huffman string holds EOS or an invalid code")
            state, got = step
            if got:
                out.append(got)
    if state not in ENDS:
        raise HpackError("a Huffman string ends in padding that is not a prefix of EOS")
    return b"".join(out)


def _integer(data: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    """RFC 7541 §5.1: an integer in the low prefix_bits of data[pos], continued in 7-bit groups."""
    limit = (1 << prefix_bits) - 1
    value = data[pos] & limit
    pos += 1
    if value < limit:
        return value, pos
    shift = 0
    while True:
        if pos >= len(data):
            raise HpackError("a header block ends inside an integer")
        b = data[pos]
        pos += 1
        value += (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos
        if shift > 28:
            raise HpackError("an integer in a header block is too large")


def _string(data: bytes, pos: int) -> tuple[str, int]:
    if pos >= len(data):
        raise HpackError("a header block ends before a string")
    huffman = data[pos] & 0x80
    n, pos = _integer(data, pos, 7)
    if pos + n > len(data):
        raise HpackError("a header block ends inside a string")
    raw = data[pos : pos + n]
    return (huffman_decode(raw) if huffman else raw).decode("latin-1"), pos + n


CACHED_BLOCK_BYTES = 256  # blocks up to this size are remembered (a gRPC call's are 10-30 bytes)
CACHED_BLOCKS = 64


class Decoder:
    """One connection's header decoder: its dynamic table lives as long as the connection.

    A client sends the same few header blocks again and again (etcd's Go client: every
    field indexed, one block per method and timeout), so a block that left the table as it
    was is remembered with its fields until the table changes (the same bytes then mean
    the same fields): a call's headers cost a dict lookup instead of 4-5 µs of decoding."""

    def __init__(self, max_table_size: int = 4096) -> None:
        self.max_allowed = max_table_size  # what this side advertised (SETTINGS_HEADER_TABLE_SIZE)
        self.max_size = max_table_size  # what the peer's encoder last set, up to that
        self.table: list[tuple[str, str]] = []  # newest first: index 62 is table[0]
        self.size = 0
        self._decoded: dict[bytes, tuple[tuple[str, str], ...]] = {}  # for the table as it is now
        self._changes = 0  # of the table: entries added, size updates

    def _field(self, index: int) -> tuple[str, str]:
        if 0 < index <= 61:
            return STATIC_TABLE[index - 1]
        if 61 < index <= 61 + len(self.table):
            return self.table[index - 62]
        raise HpackError(f"header index {index} is not in the table")

    def _add(self, name: str, value: str) -> None:
        size = len(name) + len(value) + 32  # RFC 7541 §4.1
        self._changed()
        self.table.insert(0, (name, value))
        self.size += size
        self._evict()

    def _changed(self) -> None:
        """The table changes: the blocks remembered may mean other fields now."""
        self._changes += 1
        self._decoded.clear()

    def _evict(self) -> None:
        while self.size > self.max_size and self.table:
            n, v = self.table.pop()
            self.size -= len(n) + len(v) + 32

    def decode(self, data: bytes) -> tuple[tuple[str, str], ...]:
        """The block's fields, in order (a tuple: it may be handed out again)."""
        known = self._decoded.get(data)
        if known is not None:
            return known
        changes = self._changes
        headers = tuple(self._decode(data))
        if changes == self._changes and len(data) <= CACHED_BLOCK_BYTES:
            if len(self._decoded) >= CACHED_BLOCKS:
                self._decoded.clear()
            self._decoded[data] = headers
        return headers

    def _decode(self, data: bytes) -> list[tuple[str, str]]:
        headers, pos, end = [], 0, len(data)
        while pos < end:
            b = data[pos]
            if b & 0x80:  # indexed field
                if 0x80 < b < 0xBE:  # (most of a request's fields: one byte, the static table)
                    headers.append(STATIC_TABLE[b - 0x81])
                    pos += 1
                    continue
                index, pos = _integer(data, pos, 7)
                headers.append(self._field(index))
                continue
            if b & 0xE0 == 0x20:  # dynamic table size update
                size, pos = _integer(data, pos, 5)
                if size > self.max_allowed:
                    raise HpackError(f"a table size update to {size} exceeds the {self.max_allowed} allowed")
                self.max_size = size
                self._changed()
                self._evict()
                continue
            indexing = b & 0xC0 == 0x40
            index, pos = _integer(data, pos, 6 if indexing else 4)
            if index:
                name = self._field(index)[0]
            else:
                name, pos = _string(data, pos)
            value, pos = _string(data, pos)
            if indexing:
                self._add(name, value)
            headers.append((name, value))
        return headers


def literal(name: str, value: str) -> bytes:
    """A field as a literal without indexing, with a literal name (neither string Huffman-coded)."""
    n, v = name.encode("latin-1"), value.encode("latin-1")
    return b"\x00" + _encode_integer(len(n), 7) + n + _encode_integer(len(v), 7) + v


def _encode_integer(value: int, prefix_bits: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((value,))
    out, value = [limit], value - limit
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# ":status: 200" is static entry 8; content-type (31) as a literal name index, not indexed
RESPONSE_HEADERS = b"\x88" + b"\x0f\x10" + _encode_integer(len(b"application/grpc"), 7) + b"application/grpc"
