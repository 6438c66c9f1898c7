"""Errors the Raft layer raises to its callers. Each says what to do about it."""

from __future__ import annotations


class RaftError(Exception):
    """Base class of the errors below."""


class NotLeader(RaftError):
    """This node is not the leader; the write was not appended. Safe to retry elsewhere."""

    def __init__(self, leader: str | None, message: str | None = None) -> None:
        self.leader = leader
        if message is None:
            message = (
                f"this node is not the leader; the leader is {leader}: send the request there"
                if leader
                else "this node is not the leader and no leader is known yet: retry shortly"
            )
        super().__init__(message)


class TransferInProgress(RaftError):
    """The leader is handing leadership over and refuses new writes meanwhile."""

    def __init__(self, transferee: str) -> None:
        self.transferee = transferee
        super().__init__(
            f"leadership is being transferred to {transferee}; retry in a moment (the new leader will take the write)"
        )


class LedgerError(RaftError):
    """The ledger on disk cannot be used as it is (corrupt, foreign or full)."""


class ConfigChangeRefused(RaftError):
    """A membership change was refused; nothing was changed. The message says why."""
