"""Joining a running cluster (kv serve --join URL): a new node asks a member to add it as
a learner to be promoted once caught up (`kv member add --voter`: the leader promotes it by
itself, raft/core.py _maybe_promote), and starts from the membership it is given."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass

import orjson

from ..client.async_client import AsyncClient
from ..errors import BadRequest, Conflict, MemberExists, NotLeader, Timeout, Unauthorized, Unavailable
from ..raft.backoff import Backoff
from ..raft.membership import Member, Membership, new_ledger_id
from ..snapshot.format import fsync_dir
from .config import NodeConfig

log = logging.getLogger("kv.serve")


@dataclass(frozen=True)
class Joined:
    """What a node that joins a running cluster starts from: the cluster's answer to its
    addition (the newest committed membership, the log index of its entry, and the ids
    removed from the cluster before, whose old data dirs it refuses), and the ledger_id it
    gave for its ledger (the cluster refuses any other data dir as it)."""

    membership: Membership
    index: int
    ledger_id: str
    removed: frozenset[str] = frozenset()

    def to_dict(self) -> dict:
        return {"members": self.membership.to_dict(), "index": self.index, "ledger": self.ledger_id, "removed": sorted(self.removed)}

    @classmethod
    def from_dict(cls, d: dict, ledger_id: str | None = None) -> Joined:
        """From to_dict's form, or from the cluster's answer (with the ledger_id sent)."""
        members = Membership.of(
            Member(m["id"], m["peer"], m.get("http", ""), bool(m["voter"]), bool(m.get("promote")), m.get("ledger", "")) for m in d["members"]
        )
        return cls(members, int(d.get("index", 0)), ledger_id or str(d["ledger"]), frozenset(map(str, d.get("removed", ()))))


async def join_cluster(config: NodeConfig) -> Joined:
    """Ask a member of a running cluster (config.join) to add this new node as a learner,
    to be known by a new ledger_id (Joined). Temporary refusals (another membership change
    in progress, no leader, the member not reachable yet) are waited out with backoff until
    --join-timeout; a permanent one (the id is a member with other addresses, a bad token,
    a bad request) ends it at once. (A leader of a version before 2026-12-07 answers
    without "index" and "removed": 0 and none.)"""
    if config.id not in config.peers:
        raise BadRequest(f"with --join, --peers must still give this node's own peer address ({config.id}=HOST:PORT)")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.join_timeout_s
    backoff = Backoff(0.2, 5.0)
    ledger_id = new_ledger_id()
    while True:
        try:
            return await _ask(config, ledger_id, left=min(10.0, max(0.1, deadline - loop.time())))
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


async def _ask(config: NodeConfig, ledger_id: str, left: float) -> Joined:
    """One attempt, within `left` seconds (what is left of --join-timeout, 10 at most)."""
    async with AsyncClient(config.join, token=config.token, timeout=left, cacert=config.cacert) as c:
        answer = await c.join_member(config.id, config.peers[config.id], config.advertise_url, ledger_id)
    _refuse_a_voter_that_lost_its_data(config, answer["members"])  # (the leader's list, as of the add)
    return Joined.from_dict(answer, ledger_id)


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


# The cluster's answer to a join, kept in the data dir from the moment it is given until the
# node has recorded it: a joiner killed in between (its ledger made, the membership not yet
# recorded) was started again as a cluster of its own, whose only member it was.
JOINED_FILE = "joined.json"


def keep_join(data_dir: str, joined: Joined) -> None:
    """Keep a join's answer (written whole, then fsynced) until forget_join."""
    path = os.path.join(data_dir, JOINED_FILE)
    with open(path + ".tmp", "wb") as f:
        f.write(orjson.dumps(joined.to_dict()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    fsync_dir(data_dir)


def kept_join(data_dir: str, joining: bool) -> Joined | None:
    """The answer to a join that began in this data dir and was not recorded yet, or None.
    A join cut short before its answer was kept is refused unless this start joins
    (`joining`: --join given): without --join the empty dir would begin a cluster of its own."""
    path = os.path.join(data_dir, JOINED_FILE)
    try:
        with open(path, "rb") as f:
            return Joined.from_dict(orjson.loads(f.read()))
    except FileNotFoundError:
        if not joining and os.path.exists(path + ".tmp"):
            raise BadRequest(
                f"a join began in {data_dir} and was cut short before the cluster's answer was kept ({JOINED_FILE}.tmp): "
                "run the same command with --join URL again (without it, this node would begin a cluster of its own)"
            ) from None
        return None
    except (ValueError, KeyError, TypeError) as e:
        raise BadRequest(f"{path} is damaged ({e}): it holds the answer to a join that did not finish; remove the data dir and run the join again") from None


def forget_join(data_dir: str) -> None:
    """The node recorded the membership it joined with (kv.Node started)."""
    try:
        os.remove(os.path.join(data_dir, JOINED_FILE))
    except FileNotFoundError:
        pass
