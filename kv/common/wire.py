"""Values and keys in JSON, as the HTTP API spells them on every route and the clients read
and write them: UTF-8 text as `"value": text`, any other bytes as `"value": base64` with
`"encoding": "base64"` (and `"value_base64"`, the deprecated spelling, accepted on input).
A key is `"key": text`; a key whose bytes are not UTF-8 (etcd's clients may write one) is
`"key": base64` with `"key_encoding": "base64"` (likewise `"next"` of a page)."""

from __future__ import annotations

import base64
import binascii

from ..errors import BadRequest
from ..statemachine import rows
from ..statemachine.commands import MAX_INDEX, NO_BYTE, CommandError, Cond, Delete, Get, Put, check_key, key_bytes, key_text, shown_key  # noqa: F401  (shown_key: for http/)
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


def bulk_body(items) -> bytes:
    """A bulk put's body (kv/statemachine/rows.py) from (key, value) or (key, value,
    if_mod_index) rows — None: no condition, 0: the key must not exist — or the body
    itself; BadRequest for a row no node would take."""
    if isinstance(items, (bytes, bytearray, memoryview)):
        return bytes(items)
    out = []
    for i, row in enumerate(items):
        key, value, cond = (*row, None) if len(row) == 2 else row
        try:
            raw = check_key(key)
        except CommandError as e:
            raise BadRequest(f"row {i}: {e}") from None
        if cond is not None and (type(cond) is not int or not 0 <= cond <= MAX_INDEX):
            raise BadRequest(f"row {i}: if_mod_index is a log index (0: the key must not exist) or None, not {cond!r}")
        out.append((raw, value_bytes(value), rows.ANY if cond is None else cond))
    if not out:
        raise BadRequest("a bulk put holds at least one row")
    try:
        return rows.pack(out)
    except rows.RowsError as e:
        raise BadRequest(str(e)) from None


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
