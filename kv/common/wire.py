"""Values and keys in JSON, as the HTTP API spells them on every route and the clients read
and write them: UTF-8 text as `"value": text`, any other bytes as `"value": base64` with
`"encoding": "base64"` (and `"value_base64"`, the deprecated spelling, accepted on input).
A key is `"key": text`; a key whose bytes are not UTF-8 (etcd's clients may write one) is
`"key": base64` with `"key_encoding": "base64"` (likewise `"next"` of a page)."""

from __future__ import annotations

import base64
import binascii
import re
from typing import NamedTuple

from ..errors import BadRequest, Forbidden, KVError, ValueTooLarge
from .results import BulkResult
from ..statemachine import rows
from ..statemachine.commands import MAX_INDEX, MAX_KEY_BYTES, NO_BYTE, CommandError, Cond, Delete, Get, Put, check_key, key_bytes, key_text, shown_key  # noqa: F401  (shown_key: for http/)
from .arguments import value_bytes


def value_fields(value: bytes, base64_always: bool = False) -> dict:
    """{"value": text} when the bytes are UTF-8 (and not base64_always), else
    {"value": base64, "encoding": "base64"}."""
    if not base64_always:
        try:
            return {"value": value.decode("utf-8")}
        except UnicodeDecodeError:
            pass
    return {"value": base64.b64encode(value).decode(), "encoding": "base64"}


def key_fields(key: str, name: str = "key") -> dict:
    """{name: key}, or {name: base64, name_encoding: "base64"} for a key whose bytes are not
    UTF-8 (held as lone surrogates, see commands.key_bytes)."""
    if not key.isascii():
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            return {name: base64.b64encode(checked_key_bytes(key)).decode(), f"{name}_encoding": "base64"}
    return {name: key}


def checked_key_bytes(key: str) -> bytes:
    """key_bytes, or BadRequest for a key whose lone surrogates stand for no byte."""
    try:
        return key_bytes(key)
    except UnicodeEncodeError:
        raise BadRequest(NO_BYTE) from None


class BulkBody(NamedTuple):
    """A bulk put's body, and where each of its rows (sorted by key) was among the caller's."""

    data: bytes
    order: list[int] | None  # the caller's place of each row of data (None: the caller gave data)

    def row(self, i: int) -> int:
        return self.order[i] if self.order is not None else i

    def renumbered(self, e: KVError) -> KVError:
        """An error that names a row of the body ("row N: ..."), naming the caller's row."""
        text = str(e)
        m = re.search(r"\brow (\d+): ", text)  # (a client's message starts with the endpoint)
        if self.order is None or m is None or not isinstance(e, (BadRequest, ValueTooLarge, Forbidden)):
            return e
        return type(e)(f"{text[: m.start()]}row {self.row(int(m.group(1)))}: {text[m.end():]}")

    def result(self, r: BulkResult) -> BulkResult:
        """r with each refused row numbered as the caller's, in the caller's order."""
        if self.order is None:
            return r
        return r._replace(refused=tuple(sorted((x._replace(row=self.row(x.row)) for x in r.refused), key=lambda x: x.row)))


def bulk_body(items) -> BulkBody:
    """A bulk put's body (kv/statemachine/rows.py) from rows (key, value) or (key, value,
    if_mod_index) — a key str (or bytes), a value bytes, if_mod_index None (no condition) or
    the mod_index the key must have (0: absent) — or the body itself. The rows are sent
    sorted by key; BadRequest names the caller's row that no node would take."""
    if isinstance(items, (bytes, bytearray, memoryview)):
        return BulkBody(bytes(items), None)
    out = []
    for i, row in enumerate(items):
        if not isinstance(row, (tuple, list)) or len(row) not in (2, 3):
            raise BadRequest(f"row {i}: a row is (key, value) or (key, value, if_mod_index), not {type(row).__name__} {row!r:.80}")
        key, value, cond = (*row, None) if len(row) == 2 else row
        try:
            raw = bytes(key) if isinstance(key, (bytes, bytearray)) else check_key(key)
        except CommandError as e:
            raise BadRequest(f"row {i}: {e}") from None
        if len(raw) > MAX_KEY_BYTES:
            raise BadRequest(f"row {i}: the key is {len(raw)} bytes long; the limit is {MAX_KEY_BYTES}")
        if cond is not None and (type(cond) is not int or not 0 <= cond <= MAX_INDEX):
            raise BadRequest(f"row {i}: if_mod_index is a log index (0: the key must not exist) or None, not {cond!r}")
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise BadRequest(f"row {i}: values are bytes, not {type(value).__name__}: encode it first")
        if len(value) > 0xFFFFFFFF:
            raise BadRequest(f"row {i}: the value is {len(value)} bytes; the format holds at most 4 GiB")
        out.append((raw, bytes(value), rows.ANY if cond is None else cond))
    if not out:
        raise BadRequest("a bulk put holds at least one row")
    order = sorted(range(len(out)), key=lambda i: out[i][0])
    for a, b in zip(order, order[1:]):
        if out[a][0] == out[b][0]:
            raise BadRequest(f"rows {min(a, b)} and {max(a, b)} have the same key {shown_key(key_text(out[a][0]))}: give each key once")
    return BulkBody(rows.pack([out[i] for i in order]), order)


def rows_body(items) -> bytes:
    """Scanned items in the bulk format (kv/statemachine/rows.py), each key's mod_index in
    the condition column: a scan's answer with ?format=rows."""
    return rows.pack([(key_bytes(it.key), it.value, it.mod_index) for it in items])


def key_from(d: dict, name: str = "key", where: str = "") -> str:
    """The key key_fields spelled (`where`: the part of the request it came from)."""
    if d.get(f"{name}_encoding") == "base64":
        return key_text(_base64(d[name], f"{where}: {name}" if where else name))
    return d[name]


def value_from(d: dict, where: str = "the value") -> bytes:
    """The bytes of a value spelled as value_fields spells it, or BadRequest saying what is
    wrong with it (`where`: the part of the request it came from)."""
    if "value_base64" in d:
        if "value" in d or "encoding" in d:
            raise BadRequest(f'{where}: give "value" (with "encoding": "base64" for bytes) or the deprecated "value_base64", not both')
        return _base64(d["value_base64"], f"{where}: value_base64")
    v = d.get("value")
    if not isinstance(v, str):
        raise BadRequest(f'{where}: needs "value", a string (base64 with "encoding": "base64" for bytes)')
    if "encoding" not in d:
        return v.encode()
    if d["encoding"] != "base64":
        raise BadRequest(f'{where}: "encoding" must be "base64" (or left out for UTF-8 text)')
    return _base64(v, f"{where}: value")


def _base64(text, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, TypeError, ValueError) as e:
        raise BadRequest(f"{what} is not valid base64") from e


def cond_fields(c: Cond) -> dict:
    """A transaction's condition as POST /v1/txn takes it."""
    if c.kind == "mod":
        return {**key_fields(c.key), "mod_index": c.arg}
    if c.kind == "exists":
        return {**key_fields(c.key), "exists": bool(c.arg)}
    return {**key_fields(c.key), **value_fields(value_bytes(c.arg))}


def op_fields(o) -> dict:
    """A transaction's operation (kv.Put, kv.Delete, kv.Get) as POST /v1/txn takes it."""
    if isinstance(o, Put):
        return {"op": "put", **key_fields(o.key), **value_fields(value_bytes(o.value))}
    if isinstance(o, Delete):
        return {"op": "delete", **key_fields(o.key)}
    if isinstance(o, Get):
        return {"op": "get", **key_fields(o.key)}
    raise BadRequest(f"not a transaction operation: {o!r}")
