"""Membership administration on a node: who the members are, adding, promoting and
removing them (one joint-consensus change at a time, on the leader), and handing the
leadership over."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable

from ..errors import BadRequest, Conflict, KVError, MemberExists, NotFound, NotLeader, Timeout
from ..raft.errors import ConfigChangeRefused, TransferInProgress
from ..raft.membership import Member, Membership, id_order, is_ledger_id
from ..raft.messages import Role
from ..raft.node import NodeStopped, OutcomeUnknown, RaftNode
from .answers import public_error
from .config import NodeConfig, check_hostport

log = logging.getLogger("kv.node")


class Members:
    """The membership of the cluster a node's Raft driver (`running()`, raising when the
    node is not running) belongs to, and the changes an operator makes to it."""

    def __init__(self, config: NodeConfig, running: Callable[[], RaftNode]) -> None:
        self.config, self._running = config, running

    def list(self, committed: bool = False) -> list[dict]:
        """The newest membership this node knows, or the newest known committed: what a
        change is answered with (a node that joins starts from it, kv/server/join.py)."""
        raft = self._running()
        leader = raft.leader_id
        out = []
        membership = raft.committed_membership_at[0] if committed else raft.membership
        for m in sorted(membership.members.values(), key=lambda m: id_order(m.id)):
            d = {"id": m.id, "peer": m.peer_addr, "http": m.http_url or raft.peer_url(m.id), "voter": m.voter}
            if m.id == raft.id:
                d["http"] = self.config.advertise_url
            d["leader"] = m.id == leader
            if m.promote:
                d["promote"] = True  # a learner the leader promotes once it has caught up
            if m.ledger:
                d["ledger"] = m.ledger  # the data dir it joined from (no other is let in as it)
            out.append(d)
        return out

    def status(self, raft: RaftNode, snapshot_index: int, alarms: list[dict]) -> dict:
        """The node's own view: the fields of GET /v1/status."""
        r = raft.metrics()
        return {
            "id": self.config.id,
            "role": r.role.label,
            "term": r.term,
            "leader": r.leader,
            "commit_index": r.commit_index,
            "applied_index": r.applied_index,
            "ledger_begin_index": r.ledger_begin_index,
            "ledger_end_index": r.ledger_end_index,
            "snapshot_index": snapshot_index,
            "alarms": alarms,
            "grpc": self.config.grpc_url,
            "peers": {
                m.id: {
                    "address": m.peer_addr,
                    "http": m.http_url or raft.peer_url(m.id),
                    "voter": m.voter,
                    **({"match_index": r.peers[m.id].match, "state": r.peers[m.id].state} if m.id in r.peers else {}),
                }
                for m in raft.membership.members.values()
                if m.id != self.config.id
            },
        }

    async def add(self, member_id: str, peer: str, http: str, voter: bool, replace: bool, timeout: float | None, ledger: str = "") -> list[dict]:
        if not member_id or any(ch in member_id for ch in ",= /"):
            raise BadRequest(f"bad member id {member_id!r}: a non-empty name without ',', '=', ' ' or '/'")
        check_hostport(peer, f"member {member_id}")
        if http and not http.startswith(("http://", "https://")):
            # (kept as given, it was the member's client URL; its --join, with the scheme,
            # was then refused as another member with the "same" addresses)
            raise BadRequest(f"bad client URL {http!r} for member {member_id}: expected a URL such as http://10.0.0.4:8001")
        if ledger and (replace or not is_ledger_id(ledger)):
            raise BadRequest(
                '"ledger" is the ledger id (16 hex digits) of the data dir joining as the member, which kv serve --join '
                'sends; not with "replace", which moves a member and keeps its data dir'
            )
        raft = self._leaders("membership changes are made by the leader")
        cur = raft.membership
        old = cur.get(member_id)
        promote = voter and old is not None and not (old.voter or old.promote)
        if old is not None and not replace:
            if old.peer_addr != peer or old.http_url not in (http, ""):
                raise MemberExists(
                    f"{member_id} is already a member (peer {old.peer_addr}, client URL {old.http_url or 'not known'}); "
                    "remove it first, or replace its addresses (kv member add ... --replace)"
                )
            if old.voter or (not promote and (old.http_url == http or not http) and (old.ledger == ledger or not ledger)):
                # asked again for what is already so (a voter's client URL or ledger not
                # known, a founding member's, stays so: a voter's join is refused by the
                # joiner, join.py)
                if raft.membership != raft.committed_membership_at[0]:
                    raise Conflict("a membership change is still in progress; retry once it has committed")
                return self.list(committed=True)
            # a learner added without its client URL (kv member add), now joining with it,
            # or joining again from another data dir: its URL and ledger are recorded (the
            # other data dir's links are refused then); asked to be a voter (a join asks),
            # it is promoted once caught up
        if old is None and replace:
            raise NotFound(f"{member_id} is not a member; add it instead")
        if old is None:
            new = Member(member_id, peer, http, voter=False, promote=voter, ledger=ledger)
        else:
            new = dataclasses.replace(old, peer_addr=peer, http_url=http or old.http_url, ledger=ledger or old.ledger, promote=old.promote or promote)
        await self._change(cur.with_member(new), timeout)
        if replace:
            log.info("member %s moved: peer %s, client URL %s", member_id, new.peer_addr, new.http_url or "not known")
        return self.list(committed=True)

    async def remove(self, member_id: str, timeout: float | None) -> list[dict]:
        cur = self._leaders("membership changes are made by the leader").membership
        if member_id not in cur:
            raise NotFound(f"{member_id} is not a member; members: {', '.join(sorted(cur.ids, key=id_order))}")
        if cur.voters == {member_id}:
            raise BadRequest(f"{member_id} is the last voter; add another voter before removing it")
        await self._change(cur.without(member_id), timeout)
        return self.list(committed=True)

    async def promote(self, member_id: str, timeout: float | None) -> list[dict]:
        cur = self._leaders("membership changes are made by the leader").membership
        m = cur.get(member_id)
        if m is None:
            raise NotFound(f"{member_id} is not a member; add it as a learner first")
        if m.voter:
            return self.list(committed=True)
        await self._change(cur.with_member(dataclasses.replace(m, voter=True, promote=False)), timeout)
        return self.list(committed=True)

    def _leaders(self, why: str) -> RaftNode:
        """The running Raft node, if it leads: what a membership request is answered from
        (a follower's membership may be behind; its HTTP route passes NotLeader on)."""
        raft = self._running()
        if raft.role != Role.LEADER:
            raise NotLeader(why, raft.leader_id)
        return raft

    async def _change(self, new: Membership, timeout: float | None) -> None:
        raft = self._leaders("membership changes are made by the leader")
        deadline = asyncio.get_running_loop().time() + (timeout if timeout is not None else self.config.write_timeout_s)
        try:
            await raft.change_membership(new, deadline)
        except (ConfigChangeRefused, TransferInProgress) as e:
            raise public_error(e) from None
        except (OutcomeUnknown, NodeStopped) as e:
            raise public_error(e, written=True, wait=self.config.write_timeout_s, check="list the members (kv member list)") from e
        log.info("membership changed: %s", ", ".join(f"{m.id}{'' if m.voter else ' (learner)'}" for m in sorted(new.members.values(), key=lambda m: id_order(m.id))))

    async def transfer_leadership(self, to: str, timeout: float | None) -> str:
        raft = self._running()
        voters = raft.membership.voters
        if to not in voters:
            raise BadRequest(f"{to!r} is not a voting member; voters: {sorted(voters)}")
        if raft.role != Role.LEADER:
            raise NotLeader("only the leader can hand leadership over", raft.leader_id)
        if to == raft.id:
            return to
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout if timeout is not None else self.config.election_timeout_ms * 3 / 1000)
        await raft.transfer_leadership(to)
        while raft.leader_id != to:
            left = deadline - loop.time()
            if left <= 0:
                m = raft.metrics()
                p = m.peers.get(to)
                why = "" if p is None or p.match >= m.ledger_end_index else (
                    f": {to} has the log up to {p.match} of {m.ledger_end_index} (is it running, and reachable from the leader?)"
                )
                raise Timeout(f"leadership did not move to {to} in time; the leader is {raft.leader_id}{why}")
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                await asyncio.wait_for(raft.leader_changed.wait(), left)
        return to

    async def hand_over_leadership(self, raft: RaftNode | None, timeout: float | None) -> str | None:
        if raft is None or raft.failure is not None or raft.role != Role.LEADER:
            return None
        peers = raft.metrics().peers
        voters = [(p.match, pid) for pid, p in peers.items() if pid in raft.membership.voters]
        if not voters:
            return None
        _, to = max(voters)
        try:
            return await self.transfer_leadership(to, timeout if timeout is not None else 2 * self.config.election_timeout_ms / 1000)
        except KVError as e:
            log.info("node %s: leadership was not handed to %s before stopping (%s)", self.config.id, to, e)
            return None
