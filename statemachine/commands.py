"""KV commands: what a NORMAL log entry carries, in a versioned binary format.

    byte 0   format version (COMMAND_FORMAT); a newer reader keeps decoding older versions
    byte 1   opcode
    ...      opcode-specific fields; keys are u16-length-prefixed UTF-8, values u32-length

Commands:

- Put(key, value, cond)      write; with a condition it is a compare-and-set
- Delete(key, cond)          remove
- Txn(conds, ops, else_ops)  if every condition holds run `ops`, else `else_ops`, atomically
                             (ops: Put, Delete, Get)

A condition compares a key's `mod_index` (the log index of its last change; 0 when the
key does not exist), its value, or its existence. `mod_index` is the HTTP ETag.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

COMMAND_FORMAT = 1
MAX_KEY_BYTES = 4096

_OP_PUT, _OP_DELETE, _OP_TXN, _OP_GET = 1, 2, 3, 4
_COND_MOD, _COND_VALUE, _COND_EXISTS = 1, 2, 3
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")


class CommandError(ValueError):
    """A command that cannot be encoded or decoded."""


@dataclass(frozen=True, slots=True)
class Cond:
    """A precondition on one key. kind: "mod" (mod_index == arg; 0 = absent), "value"
    (value == arg), or "exists" (existence == arg)."""

    key: str
    kind: str
    arg: int | bytes | bool

    def holds(self, current: tuple[int, bytes] | None) -> bool:
        if self.kind == "mod":
            return (current[0] if current else 0) == self.arg
        if self.kind == "value":
            return current is not None and current[1] == self.arg
        if self.kind == "exists":
            return (current is not None) == bool(self.arg)
        raise CommandError(f"unknown condition kind {self.kind!r}")


@dataclass(frozen=True, slots=True)
class Put:
    key: str
    value: bytes
    cond: Cond | None = None


@dataclass(frozen=True, slots=True)
class Delete:
    key: str
    cond: Cond | None = None


@dataclass(frozen=True, slots=True)
class Get:
    """Read a key inside a transaction (sees the transaction's earlier writes)."""

    key: str


@dataclass(frozen=True, slots=True)
class Txn:
    """If every condition holds, run `ops`, else `else_ops` — atomically, at one index."""

    conds: tuple[Cond, ...] = ()
    ops: tuple[Put | Delete | Get, ...] = ()
    else_ops: tuple[Put | Delete | Get, ...] = field(default_factory=tuple)


Command = Put | Delete | Txn


# -- results (what apply hands back to the proposer) ------------------------------------------


@dataclass(frozen=True, slots=True)
class PutResult:
    index: int  # the key's new mod_index


@dataclass(frozen=True, slots=True)
class DeleteResult:
    index: int
    deleted: bool


@dataclass(frozen=True, slots=True)
class GetResult:
    key: str
    value: bytes | None
    mod_index: int


@dataclass(frozen=True, slots=True)
class PreconditionFailed:
    """The condition did not hold; nothing was changed."""

    key: str
    mod_index: int  # the key's current mod_index (0: absent)


@dataclass(frozen=True, slots=True)
class TxnResult:
    index: int
    succeeded: bool
    results: tuple[PutResult | DeleteResult | GetResult, ...]


# -- encoding ---------------------------------------------------------------------------------


def check_key(key: str) -> bytes:
    if not isinstance(key, str) or not key:
        raise CommandError("a key is a non-empty string")
    raw = key.encode("utf-8")
    if len(raw) > MAX_KEY_BYTES:
        raise CommandError(f"key is {len(raw)} bytes long; the limit is {MAX_KEY_BYTES}")
    return raw


def _key(key: str) -> bytes:
    raw = check_key(key)
    return _U16.pack(len(raw)) + raw


def _cond(c: Cond | None) -> bytes:
    if c is None:
        return b"\x00"
    if c.kind == "mod":
        return bytes((_COND_MOD,)) + _key(c.key) + _U64.pack(int(c.arg))
    if c.kind == "value":
        v = bytes(c.arg)
        return bytes((_COND_VALUE,)) + _key(c.key) + _U32.pack(len(v)) + v
    if c.kind == "exists":
        return bytes((_COND_EXISTS,)) + _key(c.key) + bytes((1 if c.arg else 0,))
    raise CommandError(f"unknown condition kind {c.kind!r}")


def _op(op: Put | Delete | Get) -> bytes:
    if getattr(op, "cond", None) is not None:
        raise CommandError("operations inside a transaction take no condition of their own: put it in the transaction's conds")
    if isinstance(op, Put):
        return bytes((_OP_PUT,)) + _key(op.key) + _U32.pack(len(op.value)) + bytes(op.value) + _cond(op.cond)
    if isinstance(op, Delete):
        return bytes((_OP_DELETE,)) + _key(op.key) + _cond(op.cond)
    if isinstance(op, Get):
        return bytes((_OP_GET,)) + _key(op.key)
    raise CommandError(f"not a transaction operation: {op!r}")


_HEAD = bytes((COMMAND_FORMAT,))


def encode(cmd: Command) -> bytes:
    if isinstance(cmd, Put):
        # The hot path: the value goes last, unprefixed, so the entry is just header + value.
        return _HEAD + bytes((_OP_PUT,)) + _key(cmd.key) + _cond(cmd.cond) + bytes(cmd.value)
    if isinstance(cmd, Delete):
        return _HEAD + bytes((_OP_DELETE,)) + _key(cmd.key) + _cond(cmd.cond)
    if isinstance(cmd, Txn):
        parts = [_HEAD, bytes((_OP_TXN,)), _U16.pack(len(cmd.conds))]
        parts += [_cond(c) for c in cmd.conds]
        parts.append(_U32.pack(len(cmd.ops)))
        parts += [_op(o) for o in cmd.ops]
        parts.append(_U32.pack(len(cmd.else_ops)))
        parts += [_op(o) for o in cmd.else_ops]
        return b"".join(parts)
    raise CommandError(f"not a command: {cmd!r}")


class _Reader:
    __slots__ = ("b", "o")

    def __init__(self, b: bytes) -> None:
        self.b, self.o = b, 0

    def take(self, n: int) -> bytes:
        o = self.o
        out = self.b[o : o + n]
        if len(out) != n:
            raise CommandError("command is truncated")
        self.o = o + n
        return out

    def byte(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return _U16.unpack(self.take(2))[0]

    def u32(self) -> int:
        return _U32.unpack(self.take(4))[0]

    def key(self) -> str:
        return self.take(self.u16()).decode("utf-8")

    def cond(self) -> Cond | None:
        kind = self.byte()
        if kind == 0:
            return None
        key = self.key()
        if kind == _COND_MOD:
            return Cond(key, "mod", _U64.unpack(self.take(8))[0])
        if kind == _COND_VALUE:
            return Cond(key, "value", self.take(self.u32()))
        if kind == _COND_EXISTS:
            return Cond(key, "exists", bool(self.byte()))
        raise CommandError(f"unknown condition kind {kind}")

    def op(self) -> Put | Delete | Get:
        code = self.byte()
        if code == _OP_PUT:
            op = Put(self.key(), self.take(self.u32()))
        elif code == _OP_DELETE:
            op = Delete(self.key())
        else:
            op = None
        if op is not None:
            if self.byte() != 0:
                raise CommandError("a transaction operation carries a condition")
            return op
        if code == _OP_GET:
            return Get(self.key())
        raise CommandError(f"unknown transaction operation {code}")


def decode(data: bytes) -> Command:
    if not data:
        raise CommandError("empty command")
    version = data[0]
    if version != COMMAND_FORMAT:  # format 1 is the only one so far
        raise CommandError(f"command format {version} is newer than this ledgerkv understands ({COMMAND_FORMAT})")
    r = _Reader(data)
    r.o = 1
    code = r.byte()
    try:
        if code == _OP_PUT:
            key = r.key()
            cond = r.cond()
            return Put(key, data[r.o :], cond)
        if code == _OP_DELETE:
            cmd = Delete(r.key(), r.cond())
        elif code == _OP_TXN:
            conds = tuple(r.cond() for _ in range(r.u16()))
            ops = tuple(r.op() for _ in range(r.u32()))
            else_ops = tuple(r.op() for _ in range(r.u32()))
            cmd = Txn(conds, ops, else_ops)
        else:
            raise CommandError(f"unknown opcode {code}")
    except UnicodeDecodeError as e:
        raise CommandError(f"key is not UTF-8: {e}") from e
    if r.o != len(data):
        raise CommandError("stray bytes after the command")
    return cmd


# -- results on the wire (a leader answers a forwarded command) --------------------------------


def _enc_one(r) -> bytes:
    if isinstance(r, PutResult):
        return b"P" + _U64.pack(r.index)
    if isinstance(r, DeleteResult):
        return b"D" + _U64.pack(r.index) + bytes((int(r.deleted),))
    if isinstance(r, GetResult):
        v = r.value
        return b"G" + _key(r.key) + _U64.pack(r.mod_index) + (b"\x00" if v is None else b"\x01" + _U32.pack(len(v)) + v)
    if isinstance(r, PreconditionFailed):
        return b"F" + _key(r.key) + _U64.pack(r.mod_index)
    if isinstance(r, TxnResult):
        return b"T" + _U64.pack(r.index) + bytes((int(r.succeeded),)) + _U32.pack(len(r.results)) + b"".join(
            _enc_one(x) for x in r.results
        )
    if isinstance(r, CommandError):
        msg = str(r).encode()
        return b"E" + _U32.pack(len(msg)) + msg
    if r is None:
        return b"N"
    raise CommandError(f"cannot encode result {r!r}")


def encode_result(r) -> bytes:
    return _enc_one(r)


def _dec_one(rd: _Reader):
    tag = rd.take(1)
    if tag == b"P":
        return PutResult(_U64.unpack(rd.take(8))[0])
    if tag == b"D":
        idx = _U64.unpack(rd.take(8))[0]
        return DeleteResult(idx, bool(rd.byte()))
    if tag == b"G":
        key = rd.key()
        mod = _U64.unpack(rd.take(8))[0]
        value = rd.take(rd.u32()) if rd.byte() else None
        return GetResult(key, value, mod)
    if tag == b"F":
        key = rd.key()
        return PreconditionFailed(key, _U64.unpack(rd.take(8))[0])
    if tag == b"T":
        idx = _U64.unpack(rd.take(8))[0]
        ok = bool(rd.byte())
        return TxnResult(idx, ok, tuple(_dec_one(rd) for _ in range(rd.u32())))
    if tag == b"E":
        return CommandError(rd.take(rd.u32()).decode())
    if tag == b"N":
        return None
    raise CommandError(f"unknown result tag {tag!r}")


def decode_result(data: bytes):
    rd = _Reader(data)
    r = _dec_one(rd)
    if rd.o != len(data):
        raise CommandError("stray bytes after the result")
    return r
