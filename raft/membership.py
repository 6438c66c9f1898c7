"""Cluster membership: who votes, who only learns, and where each member listens.

Addresses are part of the membership (not only of a node's flags) so that a member replaced
on a new machine is reached at its new address once the change commits. The membership is
stored in CONFIG log entries and in snapshot headers, encoded as JSON.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from . import quorum
from .errors import ConfigChangeRefused


_LEDGER_ID = re.compile("[0-9a-f]{16}")


def new_ledger_id() -> str:
    """A ledger's ledger_id (raft/ledger.py): 16 hex digits, drawn at random."""
    return secrets.token_hex(8)


def id_order(member_id: str) -> list:
    """The key members are listed by: their ids with the numbers in them as numbers (n2
    before n10)."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", member_id)]


def is_ledger_id(s: object) -> bool:
    return type(s) is str and _LEDGER_ID.fullmatch(s) is not None


@dataclass(frozen=True, slots=True)
class Member:
    id: str
    peer_addr: str  # host:port the member listens on for peers
    http_url: str = ""  # its client URL, used to forward requests to it when it leads
    voter: bool = True
    promote: bool = False  # a learner the leader promotes once it has caught up
    # The ledger_id (raft/ledger.py) of the data dir that joined as this member, "" if not
    # known (a founding member, one added by hand that has not joined): another data dir
    # claiming the id, such as the one it had before it was removed and added back, is
    # refused as removed (raft/transport.py), so no id votes or acknowledges from two logs.
    ledger: str = ""


@dataclass(frozen=True, slots=True)
class Membership:
    members: Mapping[str, Member] = field(default_factory=dict)

    @classmethod
    def of(cls, members: Iterable[Member]) -> Membership:
        return cls({m.id: m for m in members})

    @property
    def voters(self) -> frozenset[str]:
        return frozenset(i for i, m in self.members.items() if m.voter)

    @property
    def learners(self) -> frozenset[str]:
        return frozenset(i for i, m in self.members.items() if not m.voter)

    @property
    def ids(self) -> frozenset[str]:
        return frozenset(self.members)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self.members

    def get(self, node_id: str) -> Member | None:
        return self.members.get(node_id)

    def replaced(self, node_id: str, ledger: str) -> bool:
        """Whether member node_id joined from another data dir than the one whose ledger
        is `ledger` ("": a version before ledger ids): it was removed and joined again,
        and this is its old data dir, whose log lacks what the id acknowledged since and
        whose votes are not the id's. A member no data dir joined as (a founding one, one
        added by hand that has not joined) is not: any data dir is let in as it."""
        m = self.members.get(node_id)
        return m is not None and bool(m.ledger) and m.ledger != ledger

    def refuses_as_replaced(self, own_id: str, node_id: str, ledger: str) -> bool:
        """Whether member own_id, holding this membership, turns away node_id dialling from
        the data dir of `ledger` as replaced. A learner does not: it is catching up, so the
        membership it holds may predate node_id's latest join (a node joining from an empty
        dir held an earlier entry naming the leader's previous data dir, refused the leader
        for it, and never learnt of the newer one, which only that leader could send it)."""
        return own_id in self.voters and self.replaced(node_id, ledger)

    def with_member(self, member: Member) -> Membership:
        return Membership({**self.members, member.id: member})

    def without(self, node_id: str) -> Membership:
        return Membership({i: m for i, m in self.members.items() if i != node_id})

    def encode(self) -> bytes:
        return json.dumps(
            [
                {
                    "id": m.id, "peer": m.peer_addr, "http": m.http_url, "voter": m.voter,
                    **({"promote": True} if m.promote else {}), **({"ledger": m.ledger} if m.ledger else {}),
                }
                for m in sorted(self.members.values(), key=lambda m: m.id)
            ],
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> Membership:
        if not data:
            return cls({})
        return cls.of(
            Member(d["id"], d["peer"], d.get("http", ""), bool(d.get("voter", True)), bool(d.get("promote", False)), d.get("ledger", ""))
            for d in json.loads(data)
        )

    def to_dict(self) -> list[dict]:
        return json.loads(self.encode())


def check_single_change(
    old: Membership,
    new: Membership,
    lag: Callable[[str], tuple[int, bool]],
    healthy: Callable[[str], bool],
    promote_max_lag: int,
) -> None:
    """Raise ConfigChangeRefused unless going from `old` to `new` is safe: one member
    changes, a new member starts as a learner, a learner is promoted only once caught up,
    and the new voters keep a majority that is reachable and caught up now (etcd's strict
    reconfiguration check): no change can leave the cluster without a quorum it could have
    kept. `lag(id)` is how far behind a member is and whether it is replicated to
    normally; `healthy(id)` whether it is reachable and caught up."""
    changed = {i for i in old.ids | new.ids if old.get(i) != new.get(i)}
    if len(changed) != 1:
        raise ConfigChangeRefused(f"change one member at a time (this changes {sorted(changed) or 'nothing'})")
    if not new.voters:
        raise ConfigChangeRefused("the last voter cannot be removed or demoted")
    (who,) = changed
    before, after = old.get(who), new.get(who)
    if before is None and after.voter:
        raise ConfigChangeRefused(f"{who} must join as a learner (promote it, or let it be promoted, once it has caught up)")
    if before is not None and after is not None and after.voter and not before.voter:
        behind, replicating = lag(who)
        if not replicating or behind > promote_max_lag:
            raise ConfigChangeRefused(f"learner {who} is {behind} entries behind; promote it once it has caught up")
    if new.voters != old.voters:
        ok = sorted(v for v in new.voters if healthy(v))
        need = quorum.majority(len(new.voters))
        if len(ok) < need:
            raise ConfigChangeRefused(
                f"refused: the {len(new.voters)} voters after this change need {need} for a majority, but only "
                f"{len(ok)} of them ({', '.join(ok) or 'none'}) {'is' if len(ok) == 1 else 'are'} reachable and caught up; "
                "bring members back first, or remove an unreachable one instead"
            )


class ConfigLog:
    """The configurations in the log (Raft dissertation §4.1, one change at a time).

    `latest` is the newest configuration in the log, committed or not: it is in effect as
    soon as it is appended; `index` is its entry's index (0 if it came from the start, or
    the snapshot's index if it came with one and no CONFIG entry has followed). `committed`
    is the newest one at or below the commit index, `committed_index` its entry's. The
    CONFIG entries above the commit index are kept to fall back on if they are truncated
    away.

    `since`: the index of the entry the starting configuration came from. A node that
    joined a running cluster starts from the committed configuration the leader gave it,
    then replays the log from its start (or from an older snapshot): the CONFIG entries at
    or below that index are older than what it holds and are passed over. Taken as newer,
    they named the members' earlier data dirs, and the node refused a leader that had been
    removed and joined again since, which alone could send it the newer ones: stuck."""

    def __init__(self, committed: Membership, since: int = 0) -> None:
        self.committed = committed
        self.latest = committed
        self.index = self.committed_index = self.since = since
        self._uncommitted: list[tuple[int, Membership]] = []

    def append(self, index: int, membership: Membership) -> None:
        if index <= self.since:
            return
        self._uncommitted.append((index, membership))
        self.latest, self.index = membership, index

    def truncate(self, from_index: int) -> bool:
        """Entries from from_index on were cut. Returns whether `latest` changed."""
        if not self._uncommitted or self._uncommitted[-1][0] < from_index:
            return False
        self._uncommitted = [(i, m) for i, m in self._uncommitted if i < from_index]
        self.index, self.latest = self._uncommitted[-1] if self._uncommitted else (self.committed_index, self.committed)
        return True

    def commit(self, commit_index: int) -> bool:
        """Entries up to commit_index committed. Returns whether `committed` changed."""
        changed = False
        while self._uncommitted and self._uncommitted[0][0] <= commit_index:
            self.committed_index, self.committed = self._uncommitted.pop(0)
            changed = True
        return changed

    def restore(self, membership: Membership, index: int) -> bool:
        """A snapshot up to index, with its configuration, replaced the log. Returns whether
        `latest` changed. A snapshot older than `since` leaves the configuration as of since
        (only the uncommitted entries above it, cut with the log, go)."""
        self._uncommitted = []
        if index < self.since:
            changed = self.latest is not self.committed
            self.latest, self.index = self.committed, self.committed_index
            return changed
        self.committed = self.latest = membership
        self.index = self.committed_index = index
        return True
