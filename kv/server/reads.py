"""How a node waits for the cluster: for a read to be as fresh as asked (the read index,
Raft thesis §6.4), for an index to be applied, for a leader to be known. Functions of the
node's Raft driver alone; kv.Node's methods of the same names call them."""

from __future__ import annotations

import asyncio
import contextlib

from ..errors import BadRequest, NoQuorum, NotLeader, Timeout, Unavailable
from ..raft.errors import LeaderChanged
from ..raft.node import DeadlineExceeded, NodeStopped, RaftNode
from .answers import public_error, unknown_outcome

CONSISTENCY = ("linearizable", "lease", "stale")


async def read_barrier(raft: RaftNode, consistency: str, timeout: float) -> int:
    """Wait until a local read is as fresh as `consistency` asks; returns the index the
    node has applied. stale: at once; lease: the leader's lease; linearizable: a read index
    confirmed by a majority."""
    if consistency not in CONSISTENCY:
        raise BadRequest(f"consistency must be one of {', '.join(CONSISTENCY)}, not {consistency!r}")
    if consistency == "stale":
        return raft.applied_index
    deadline = raft.loop.time() + timeout
    while True:
        try:
            await raft.read_index(consistency == "lease", deadline)
            return raft.applied_index
        except DeadlineExceeded:
            raise NoQuorum(
                "could not confirm a read with a majority in time (no leader, or it cannot reach a quorum); "
                "retry, or read with consistency=stale", raft.leader_id
            ) from None
        except LeaderChanged:
            continue  # ask the new one (or wait for one); past the deadline the ask fails at once
        except NotLeader as e:
            try:
                await await_leader(raft, deadline, e, force_wait=raft.leader_id is not None)
            except NotLeader as nl:
                raise NoQuorum(str(nl), raft.leader_id) from None
        except NodeStopped as e:
            raise public_error(e) from e


async def wait_applied(raft: RaftNode, index: int, timeout: float | None) -> None:
    deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
    try:
        await raft.wait_applied(index, deadline)
    except DeadlineExceeded:
        raise Timeout(f"{raft.id} did not apply index {index} within {timeout}s (it applied {raft.applied_index})") from None
    except NodeStopped as e:
        raise Unavailable(str(e)) from e


async def wait_leader(raft: RaftNode, timeout: float | None) -> str:
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    while True:
        changed, lid = raft.leader_changed, raft.leader_id
        if lid is not None and (lid != raft.id or raft.committed_in_term()):
            return lid
        waits = [loop.create_task(changed.wait())]
        if lid == raft.id:  # its first entry of the term is on its way
            waits.append(loop.create_task(raft.wait_applied(raft.metrics().ledger_end_index)))
        done, pending = await asyncio.wait(waits, timeout=None if deadline is None else max(0.0, deadline - loop.time()), return_when=asyncio.FIRST_COMPLETED)
        for t in pending:
            t.cancel()
        for t in done:
            if isinstance(t.exception(), NodeStopped):
                raise Unavailable(str(t.exception())) from t.exception()
        if not done:
            raise Timeout(f"{raft.id} knew no leader within {timeout}s")


async def await_leader(raft: RaftNode, deadline: float, cause: Exception, unknown: Exception | None = None, force_wait: bool = False) -> None:
    """Wait for a (new) leader. Once the deadline has passed, raise NotLeader (the
    request was not carried out: nothing was proposed too late for its caller to hear
    how it ended), or Timeout if an earlier copy's outcome is `unknown`."""
    loop = asyncio.get_running_loop()
    left = deadline - loop.time()
    if left > 0:
        if raft.leader_id is None or force_wait:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 0.05 if not force_wait else left)):
                    await raft.leader_changed.wait()
        else:
            await asyncio.sleep(min(left, 0.01))
        left = deadline - loop.time()
    if left <= 0:
        if unknown is not None:
            raise unknown_outcome(unknown, 0.0)
        why = "none is known, and one needs a majority of the members up and in touch: see kv status" if raft.leader_id is None else cause
        raise NotLeader(f"no leader could take the request in time ({why}); it was not carried out: retry shortly", raft.leader_id)
