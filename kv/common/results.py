"""What the store API answers, the same on every face (kv.Node, kv.open, kv.Client,
kv.AsyncClient): the client and the server both import these, and nothing else of each other."""

from __future__ import annotations

from typing import NamedTuple


class Item(NamedTuple):
    key: str
    value: bytes
    mod_index: int


class WriteResult(NamedTuple):
    index: int
    term: int


class DeleteResult(NamedTuple):
    index: int
    term: int
    deleted: bool


class PrefixDeleteResult(NamedTuple):
    index: int
    term: int
    deleted: int  # keys deleted


class TxnResult(NamedTuple):
    index: int
    term: int
    succeeded: bool
    results: tuple  # per op: WriteResult, DeleteResult or Item|None for a get


class BulkRefusal(NamedTuple):
    """A row of a bulk put that was not written: its condition did not hold."""

    row: int  # its place among the rows, in key order
    key: str
    mod_index: int  # what the key holds now (0: absent)
    held: bool  # the key holds this row's value already


class BulkResult(NamedTuple):
    index: int
    term: int
    written: int  # rows written (all but the refused)
    refused: tuple[BulkRefusal, ...]


class LeaseStatus(NamedTuple):
    """A lease: its ttl and the seconds left on the leader's clock (the full ttl right
    after a grant), and the keys attached to it."""

    id: int
    ttl: float
    remaining: float
    keys: tuple[str, ...] = ()


class RevokeResult(NamedTuple):
    index: int
    keys: tuple[str, ...]  # deleted with the lease


class Page(NamedTuple):
    """One page of a scan, and the applied index it was read at: watch from index + 1 to
    see every change after it, none twice."""

    items: list[Item]
    index: int


class Event(NamedTuple):
    """One change seen by a watch: value None means the key was deleted. `index` is the
    log index of the entry that made it (a transaction's changes share one)."""

    index: int
    key: str
    value: bytes | None

    @property
    def type(self) -> str:
        return "delete" if self.value is None else "put"

    @property
    def mod_index(self) -> int:
        """The key's mod_index after the change: the index of the entry that made it."""
        return self.index

    def __repr__(self) -> str:
        value = "" if self.value is None else f", value={self.value!r}"
        return f"Event(type={self.type!r}, key={self.key!r}{value}, index={self.index})"
