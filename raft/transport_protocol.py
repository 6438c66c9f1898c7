"""What the driver (raft/node.py) needs from a peer transport, and what a transport counts.

Two transports implement it: `transport.TcpTransport` (the default: persistent TCP
connections, framed, authenticated) and `loopback.LoopbackTransport` (in-process, for tests
and embedded clusters in one event loop, with cuts, partitions, drops and delays). A
RaftNode takes either at construction; it never reaches past these methods.

Messages are at-most-once: a transport may lose any of them (the driver re-sends and the
heartbeats repair the rest) but delivers the ones of one link in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

from .messages import Message


class TransportCounters(NamedTuple):
    sent_bytes: dict[str, int]  # peer -> bytes of frames sent
    received_bytes: dict[str, int]  # peer -> bytes received
    frames_sent: int
    frames_dropped: int
    connections_rejected: int


NO_TRANSPORT = TransportCounters({}, {}, 0, 0, 0)


class Transport(Protocol):
    # Set by the driver before start: a peer refused this node as a member removed from
    # the cluster (TcpTransport's handshake says so; a transport that cannot tell never calls it).
    on_removed: Callable[[str], None]
    # Set by the driver before start: what this node says it applies (the application's
    # level of commands, kv's COMMAND_LEVEL), which peer_level reports on the other side.
    level: int

    async def start(self, on_message: Callable[[Message], None], on_connected: Callable[[str], None]) -> None:
        """Begin: every message received for this node goes to on_message (in the event
        loop), and on_connected(peer) tells that a link to peer came up, so the driver
        re-sends to it at once instead of after a timeout."""

    def refuse_removed(self) -> None:
        """A membership change was applied: drop the links of peers no longer members, so
        that they learn it (on_removed, on their side)."""

    async def stop(self) -> None:
        """Close every link; nothing is delivered afterwards."""

    def set_peers(self, peers: dict[str, str | tuple[str, ...]]) -> None:
        """Talk to these peers (id -> address to dial, or addresses to try in turn);
        forget those no longer listed."""

    def send(self, msg: Message) -> bool:
        """Queue msg for msg.dst; False if it was dropped at once (no link, the peer too
        slow). True does not promise delivery."""

    def peer_url(self, peer: str) -> str:
        """The client URL the peer announced ("" if none)."""

    def peer_level(self, peer: str) -> int:
        """The level of commands the peer said it applies, when last connected (0: not
        known, or a version before levels)."""

    def counters(self) -> TransportCounters: ...
