"""Request limits, checked before anything is proposed: a committed entry must always be
applicable, on every replica, so whatever could make applying it slow or huge is refused
while it is still only a request (etcd's --max-txn-ops and --max-request-bytes).

- `--max-txn-ops`: compares, and operations of each branch, of one transaction (400);
- `--max-request-bytes`: the encoded command (413);
- `--max-txn-read-bytes`: what a transaction's gets would return (413), estimated from
  this node's state; the node that answers also stops reading at the limit when applying.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..errors import BadRequest, ValueTooLarge
from ..common.arguments import value_bytes
from ..statemachine import commands as cmds

DEFAULT_MAX_TXN_OPS = 128
DEFAULT_MAX_REQUEST_BYTES = 1536 * 1024
DEFAULT_MAX_TXN_READ_BYTES = 4 << 20
# What a single put needs beyond its value: key, opcode and framing.
REQUEST_OVERHEAD = cmds.MAX_KEY_BYTES + 64


def check_txn_size(conds: Sequence, ops: Sequence, else_ops: Sequence, max_ops: int) -> None:
    for what, items in (("compares", conds), ("success operations", ops), ("failure operations", else_ops)):
        if len(items) > max_ops:
            raise BadRequest(
                f"the transaction has {len(items)} {what}; the limit is {max_ops} compares and {max_ops} operations "
                "per branch (--max-txn-ops): split it into several transactions"
            )


def check_request_bytes(payload: bytes, limit: int) -> None:
    if len(payload) > limit:
        raise ValueTooLarge(f"the request is {len(payload)} bytes once encoded; the limit is {limit} (--max-request-bytes)")


def check_read_bytes(ops: Sequence, else_ops: Sequence, stored_size: Callable[[str], int], limit: int) -> None:
    """Refuse a transaction whose gets would read more than `limit` bytes (the larger of
    its two branches, each get seeing the branch's own earlier puts and deletes)."""
    for branch in (ops, else_ops):
        total = _branch_reads(branch, stored_size)
        if total > limit:
            gets = sum(1 for op in branch if type(op) is cmds.Get)
            raise ValueTooLarge(
                f"the transaction's {gets} gets would read {total} bytes; the limit is {limit} "
                "(--max-txn-read-bytes): read large values with GET /v1/kv/{key}"
            )


def _branch_reads(branch: Sequence, stored_size: Callable[[str], int]) -> int:
    own: dict[str, int] = {}  # sizes this branch's earlier ops leave
    total = 0
    for op in branch:
        t = type(op)
        if t is cmds.Put:
            own[op.key] = len(op.value)
        elif t is cmds.Delete:
            own[op.key] = 0
        elif t is cmds.Get:
            total += own[op.key] if op.key in own else stored_size(op.key)
    return total


def check_bulk_values(rows, max_value_bytes: int) -> None:
    """Every value of a bulk put (statemachine/rows.py) at most --max-value-bytes."""
    lens = rows.value_lens
    if max(lens) > max_value_bytes:
        i = max(range(rows.n), key=lens.__getitem__)
        raise ValueTooLarge(f"row {i}: the value is {lens[i]} bytes; the limit is {max_value_bytes} (--max-value-bytes)")


def check_value(value, max_value_bytes: int) -> bytes:
    """A value as bytes (a bytearray or memoryview is copied), at most --max-value-bytes."""
    value = value_bytes(value)
    if len(value) > max_value_bytes:
        raise ValueTooLarge(f"value is {len(value)} bytes; the limit is {max_value_bytes} (--max-value-bytes)")
    return value
