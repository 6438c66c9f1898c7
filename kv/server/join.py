"""Joining a running cluster (kv serve --join URL): a new node asks a member to add it as
a learner to be promoted once caught up (`kv member add --voter`: the leader promotes it by
itself, raft/core.py _maybe_promote), and starts from the membership it is given."""

from __future__ import annotations

import asyncio
import logging

import orjson

from ..client.async_client import AsyncClient
from ..errors import BadRequest, Conflict, MemberExists, NotLeader, Timeout, Unauthorized, Unavailable
from ..raft.backoff import Backoff
from ..raft.membership import Member, Membership, new_ledger_id
from .config import NodeConfig

log = logging.getLogger("kv.serve")


async def join_cluster(config: NodeConfig) -> tuple[Membership, int, str]:
    """Ask a member of a running cluster (config.join) to add this new node as a learner;
    returns the membership to start from (the committed one with the addition) and the
    index of its log entry (0: a leader of a version that does not say), and the ledger_id
    to give the node's ledger: the
    cluster knows the member by it, and refuses any other data dir as it (the one it had
    before it was removed, say: raft/transport.py). Temporary refusals (another membership change in
    progress, no leader, the member not reachable yet) are waited out with backoff until
    --join-timeout; a permanent one (the id is a member with other addresses, a bad token,
    a bad request) ends it at once."""
    if config.id not in config.peers:
        raise BadRequest(f"with --join, --peers must still give this node's own peer address ({config.id}=HOST:PORT)")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.join_timeout_s
    backoff = Backoff(0.2, 5.0)
    ledger_id = new_ledger_id()
    async with AsyncClient(config.join, token=config.token, timeout=min(10.0, config.join_timeout_s), cacert=config.cacert) as c:
        while True:
            try:
                doc = {"id": config.id, "peer": config.peers[config.id], "http": config.advertise_url, "voter": True, "ledger": ledger_id}
                _, _, body = await c.request("POST", "/v1/members", data=orjson.dumps(doc), headers={"Content-Type": "application/json"})
                answer = orjson.loads(body)
                members = answer["members"]
                _refuse_a_voter_that_lost_its_data(config, members)  # (the leader's list, as of the add)
                membership = Membership.of(
                    Member(m["id"], m["peer"], m.get("http", ""), m["voter"], bool(m.get("promote")), m.get("ledger", "")) for m in members
                )
                return membership, int(answer.get("index", 0)), ledger_id
            except (MemberExists, Unauthorized, BadRequest):
                raise
            except (Conflict, NotLeader, Unavailable, Timeout) as e:
                # Adding the same member again is idempotent, so a Timeout (outcome
                # unknown) is retried like the rest.
                delay = backoff.next()
                if loop.time() + delay > deadline:
                    raise Unavailable(
                        f"--join {config.join}: the cluster did not add {config.id} within {config.join_timeout_s:g}s "
                        f"(last answer: {e}); check that the cluster has a leader (kv status), or raise --join-timeout"
                    ) from e
                log.info("join: not added yet (%s); retrying in %.1fs", e, delay)
                await asyncio.sleep(delay)


def _refuse_a_voter_that_lost_its_data(config: NodeConfig, members: list[dict]) -> None:
    """A voter at this node's own peer address, asked to join from an empty data dir, is
    that voter started again after its data was lost: it forgot its log and the votes it
    cast, and a vote cast twice in a term can elect two leaders. It must be removed first
    and join as a new member (etcd says the same). The leader answered the add (a no-op for
    a voter) with its membership: a follower's list could be behind a promotion or a remove."""
    me = next((m for m in members if m["id"] == config.id), None)
    if me is not None and me["voter"] and me["peer"] == config.peers[config.id]:
        raise MemberExists(
            f"{config.id} is already a voting member at {me['peer']}, and this data dir ({config.data_dir}) holds "
            f"no data: the node lost its log and the votes it cast, so it cannot take its old place. Remove it "
            f"first (kv member remove {config.id} --endpoints {config.join}{' --token ...' if config.token else ''}), then run "
            f"this command again (no leader to remove it? kv status says; docs/cluster.md: a majority lost for good)"
        )
