"""Many rows in one write: the columnar format of a bulk put (POST /v1/bulk, the Bulk
command, kv.spark's import).

    u32        n, the number of rows (1 to MAX_ROWS in a bulk put; a scan's page may hold 0)
    n x u16    each key's length (1 to MAX_KEY_BYTES)
    n x u32    each value's length
    n x u64    each row's condition: the mod_index its key must have (0: absent), or ANY
    keys       concatenated, in strictly increasing byte order (so no key twice)
    values     concatenated

All integers are big-endian. The columns are what Arrow (or numpy) holds already, so a
client builds a body without a Python object per row (kv/spark/bulk.py), and the entry in
the log is the request's body as it came: the leader checks it (check) and proposes it.
Keys are bytes here; the state machine spells them as key_text does every key.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from itertools import accumulate

from ..raft.errors import KVError

ANY = (1 << 64) - 1  # a row without a condition: written whatever its key holds
MAX_ROWS = 1 << 24  # rows in one body at most (an answer lists up to this many refused rows)
_COUNT = struct.Struct(">I")
ROW_OVERHEAD = 14  # bytes per row besides its key and value: the three lengths' columns


class RowsError(KVError, ValueError):
    """A body that is not in this format, or breaks its rules; the message starts with the
    row at fault ("row N: ..."), unless it is the body as a whole."""

    def __init__(self, message: str, row: int | None = None) -> None:
        super().__init__(message if row is None else f"row {row}: {message}")


def pack(rows: Sequence[tuple[bytes, bytes, int]]) -> bytes:
    """The body for (key bytes, value bytes, condition) rows given in key order (Rows.check
    refuses a body whose keys are not in strictly increasing order)."""
    n = len(rows)
    return pack_columns([k for k, _, _ in rows], [v for _, v, _ in rows], struct.pack(f">{n}Q", *(c for _, _, c in rows)))


def pack_columns(keys: Sequence[bytes], values: Sequence[bytes], conds: bytes) -> bytes:
    """The body for rows given as columns: keys (in key order) and values, and the
    conditions already packed (big-endian u64s, as the state's records begin)."""
    n = len(keys)
    return b"".join((
        _COUNT.pack(n),
        struct.pack(f">{n}H", *map(len, keys)),
        struct.pack(f">{n}I", *map(len, values)),
        conds,
        b"".join(keys),
        b"".join(values),
    ))


class Rows:
    """A body taken apart (no copy of the data until a row is read). Constructing it
    checks the framing; check() the rules."""

    __slots__ = ("data", "n", "key_lens", "value_lens", "conds", "_keys_at", "_values_at")

    def __init__(self, data: bytes, max_key_bytes: int) -> None:
        if len(data) < 4:
            raise RowsError("a bulk body starts with its row count (4 bytes)")
        n = _COUNT.unpack_from(data)[0]
        head = 4 + n * ROW_OVERHEAD
        if n == 0 or len(data) < head:
            raise RowsError(f"a bulk body of {len(data)} bytes cannot hold the {n} rows it announces" if n else "a bulk body holds at least one row")
        if n > MAX_ROWS:
            raise RowsError(f"a bulk body holds at most {MAX_ROWS} rows, not {n}: split it")
        self.data, self.n = data, n
        self.key_lens = struct.unpack_from(f">{n}H", data, 4)
        self.value_lens = struct.unpack_from(f">{n}I", data, 4 + 2 * n)
        self.conds = struct.unpack_from(f">{n}Q", data, 4 + 6 * n)
        keys_size = sum(self.key_lens)
        if head + keys_size + sum(self.value_lens) != len(data):
            raise RowsError(f"a bulk body's lengths add up to {head + keys_size + sum(self.value_lens)} bytes, but it has {len(data)}")
        if min(self.key_lens) == 0:
            raise RowsError("a key is at least one byte", self.key_lens.index(0))
        if max(self.key_lens) > max_key_bytes:
            i = max(range(n), key=self.key_lens.__getitem__)
            raise RowsError(f"the key is {self.key_lens[i]} bytes long; the limit is {max_key_bytes}", i)
        self._keys_at = list(accumulate(self.key_lens, initial=head))
        self._values_at = list(accumulate(self.value_lens, initial=head + keys_size))

    def key(self, i: int) -> bytes:
        return self.data[self._keys_at[i] : self._keys_at[i + 1]]

    def keys(self) -> list[bytes]:
        d, at = self.data, self._keys_at
        return [d[at[i] : at[i + 1]] for i in range(self.n)]

    def values(self) -> list[bytes]:
        d, at = self.data, self._values_at
        return [d[at[i] : at[i + 1]] for i in range(self.n)]

    def __iter__(self) -> Iterator[tuple[bytes, bytes, int]]:
        return zip(self.keys(), self.values(), self.conds)

    def check(self, max_index: int) -> None:
        """Refuse what no replica may apply: keys out of strictly increasing order, one of
        ledgerkv's own (a leading NUL byte: the first key has none, so no later one has),
        a condition that is neither a log index nor ANY. (Value sizes are a request limit
        of the node that proposes: kv.server.limits.)"""
        keys = self.keys()
        if keys[0][0] == 0:
            raise RowsError("keys starting with a NUL byte are reserved for ledgerkv's own records", 0)
        for i in range(1, self.n):
            if keys[i] <= keys[i - 1]:
                raise RowsError("the keys are not in strictly increasing byte order (a key given twice, or out of order): sort the rows by key", i)
        for i, c in enumerate(self.conds):
            if c > max_index and c != ANY:
                raise RowsError(f"a condition is a mod_index from 0 to {max_index} (or none), not {c}", i)
