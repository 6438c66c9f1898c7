"""Quorum arithmetic as pure functions (etcd keeps the same in its quorum/ package)."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping


def majority(voters: int) -> int:
    """The smallest number of voters that is more than half of them."""
    return voters // 2 + 1


def committed_index(match: Mapping[str, int], voters: Iterable[str]) -> int:
    """The highest index stored on a majority of voters: DLedger's QuorumAckChecker takes the
    median of the watermarks sorted from high to low.

    `match` holds each voter's watermark (the leader's own is its fsynced ledger end);
    a voter missing from it counts as 0.
    """
    marks = sorted((match.get(v, 0) for v in voters), reverse=True)
    if not marks:
        return 0
    return marks[majority(len(marks)) - 1]


class VoteOutcome(enum.Enum):
    PENDING = "pending"
    WON = "won"
    LOST = "lost"


def vote_outcome(granted: set[str], rejected: set[str], voters: frozenset[str]) -> VoteOutcome:
    """WON once a majority granted, LOST once a majority can no longer be reached."""
    need = majority(len(voters))
    if len(granted & voters) >= need:
        return VoteOutcome.WON
    if len(voters) - len(rejected & voters) < need:
        return VoteOutcome.LOST
    return VoteOutcome.PENDING


def has_quorum(active: Iterable[str], voters: frozenset[str]) -> bool:
    """Whether the voters in `active` form a majority."""
    return len(voters.intersection(active)) >= majority(len(voters))
