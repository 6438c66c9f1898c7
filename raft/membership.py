"""Cluster membership: who votes, who only learns, and where each member listens.

Addresses are part of the membership (not only of a node's flags) so that a member replaced
on a new machine is reached at its new address once the change commits. The membership is
stored in CONFIG log entries and in snapshot headers, encoded as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Member:
    id: str
    peer_addr: str  # host:port the member listens on for peers
    http_url: str = ""  # its client URL, used to forward requests to it when it leads
    voter: bool = True
    promote: bool = False  # a learner the leader promotes once it has caught up


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

    def with_member(self, member: Member) -> Membership:
        return Membership({**self.members, member.id: member})

    def without(self, node_id: str) -> Membership:
        return Membership({i: m for i, m in self.members.items() if i != node_id})

    def encode(self) -> bytes:
        return json.dumps(
            [
                {"id": m.id, "peer": m.peer_addr, "http": m.http_url, "voter": m.voter, **({"promote": True} if m.promote else {})}
                for m in sorted(self.members.values(), key=lambda m: m.id)
            ],
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> Membership:
        if not data:
            return cls({})
        return cls.of(
            Member(d["id"], d["peer"], d.get("http", ""), bool(d.get("voter", True)), bool(d.get("promote", False)))
            for d in json.loads(data)
        )

    def to_dict(self) -> list[dict]:
        return json.loads(self.encode())
