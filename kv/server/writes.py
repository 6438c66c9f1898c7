"""A node's write path: every command it is handed goes to the leader's log (proposed here
on the leader, forwarded to it elsewhere) and is answered once applied.

Every write travels in a client session (kv/common/sessions.py; the state machine's half is
statemachine/sessions.py): its caller's, or one of the node's own pool. Whenever a copy's
outcome is unknown (the leader it went to died, a forward was lost) the same request is sent
again to the next leader until the deadline, and the state machine applies it once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

from ..common.sessions import RequestId, SessionPool, Slot, new_session_id
from .config import NodeConfig
from ..errors import KVError, NoQuorum, NoSpace, NotLeader, SessionExpired, Timeout, Unavailable
from ..raft import failpoints
from ..raft.errors import TransferInProgress
from ..raft.messages import EntryKind, ForwardCode, Role
from ..raft.node import Applied, DeadlineExceeded, NeverCommitted, NodeStopped, OutcomeUnknown, Overloaded, RaftNode
from ..statemachine import commands as cmds
from .access import request_forwarded
from .answers import NOSPACE_ALARM, encode_command, public_error, session_answer, unknown_outcome
from .diskguard import DiskGuard
from .limits import check_request_bytes
from .reads import await_leader
from .samples import Sample, counter

_HOLD_ANSWER = failpoints.delay("write.before_answer")  # a fault test's wide window (raft/failpoints.py)


def _goes_again(err: BaseException) -> bool:
    """Whether a proposal that failed with err is sent again (as the same session request):
    not appended, refused during a hand-over, replaced by another leader's entry, or of
    unknown outcome; but not once its deadline has passed (DeadlineExceeded, an
    OutcomeUnknown too) or the node stops."""
    return isinstance(err, (NotLeader, TransferInProgress, OutcomeUnknown)) and not isinstance(err, (DeadlineExceeded, NodeStopped))


class Writer:
    """Sends commands to the leader's log for a node whose Raft driver is `raft`.
    `answer_local(cmd)` answers a keepalive or a lease query on the leader (the lessor);
    `observe_commit(seconds)` times a write from proposal to applied; `counters` counts
    writes, failures and resends (the node's metrics read them)."""

    def __init__(
        self,
        config: NodeConfig,
        raft: RaftNode,
        disk: DiskGuard,
        answer_local: Callable[[cmds.LocalCommand], Awaitable[object]],
        counters: Counter,
        observe_commit: Callable[[float], None],
        alarms: Callable[[], bool] = lambda: False,
        owned_sessions: Callable[[], bool] = lambda: False,
    ) -> None:
        """`alarms()`: whether a NOSPACE alarm is raised through the log (set_alarm);
        `owned_sessions()` whether every member records sessions' owners."""
        self.config, self.raft, self.disk, self.alarms = config, raft, disk, alarms
        self._answer_local, self._observe_commit = answer_local, observe_commit
        self._owned_sessions = owned_sessions
        self.counters = counters
        # Sessions for the writes this node is handed without one (kv.open's, the etcd
        # API's, HTTP writes without X-Kv-Session): owned by the node, so that writes
        # flooding in (they grow the pool) cost the pool its sessions past --max-sessions,
        # not those clients opened (statemachine/sessions.py).
        mine = "node:" + config.id
        if len(mine.encode()) > cmds.MAX_OWNER_BYTES:  # (ids are not bounded)
            mine = "node:" + hashlib.blake2b(config.id.encode(), digest_size=8).hexdigest()
        self.sessions = SessionPool(lambda deadline, wait: self._open_session(deadline, wait, mine if self._owned_sessions() else ""))

    def samples(self) -> list[Sample]:
        c = self.counters
        return [
            counter("kv_proposals_failed", "Writes that failed: no leader in time, outcome unknown, node stopping.", c["proposals_failed"]),
            counter("kv_writes_resent", "Writes this node sent again, in the same session request, after their outcome was unknown (a leader change).", c["writes_resent"]),
        ]

    def encode_request(self, cmd: cmds.Command | cmds.LocalCommand) -> bytes:
        """A request's command, encoded and checked against --max-request-bytes."""
        payload = encode_command(cmd)
        check_request_bytes(payload, self.config.max_request_bytes)
        return payload

    async def submit(
        self, cmd: cmds.Command | cmds.LocalCommand, timeout: float | None = None, *, request_id: RequestId | None = None, resent: bool = False,
        counted: bool = False,
    ) -> Applied:
        """Replicate a command and wait until it is applied here. A write goes in a client
        session, its caller's (`request_id`; `resent`: the caller sent it before and does
        not know how that ended) or one of this node's: then it is sent again whenever its
        outcome is unknown (a leader died, a forward was lost), until the deadline, and
        applied once. `counted`: the write was counted already (propose_now sent it)."""
        try:
            payload = self.encode_request(cmd)
            raft = self.raft
            if self.disk.low and not cmds.is_local(payload):  # (the leader checks its own disk too)
                raise NoSpace(self.disk.why())
            if self.alarms() and cmds.adds_data(cmd):
                raise NoSpace(NOSPACE_ALARM)
            wait = timeout if timeout is not None else self.config.write_timeout_s
            deadline = raft.loop.time() + wait
            if not counted:
                self.counters["writes"] += 1
            if payload[1:2] not in cmds.SESSION_OPCODES:  # a lease keepalive or query, a session's opening or expiry
                return (await self._send(payload, deadline, wait))[0]
            if request_id is not None:
                session, seq = request_id
                applied, unknown = await self._send(self._in_session(session, seq, payload), deadline, wait)
                return session_answer(applied, session, seq, unknown, resent)
            lane = self.sessions.take() or await self._new_lane(deadline, wait)
            try:
                while True:
                    seq = lane.next_seq()
                    applied, unknown = await self._send(cmds.in_session(lane.id, seq, payload), deadline, wait)
                    if type(applied.result) not in cmds.NOT_APPLIED:
                        return applied
                    if type(applied.result) is not cmds.SessionExpired or resent or unknown is not None:
                        return session_answer(applied, lane.id, seq, unknown, resent)
                    lane = None  # it closed before this write reached it: applied nowhere
                    lane = await self._new_lane(deadline, wait)
            finally:
                if lane is not None:
                    self.sessions.release(lane)
        except KVError:
            self.counters["proposals_failed"] += 1
            raise

    @staticmethod
    def _in_session(session: int, seq: int, payload: bytes) -> bytes:
        try:
            return cmds.in_session(session, seq, payload)
        except cmds.CommandError as e:
            raise public_error(e) from e

    async def open_session(self, *, timeout: float | None = None, owner: str = "") -> int:
        """Open a client session (for X-Kv-Session) for `owner` (SessionOpen's); returns its
        id. Its writes are applied at most once however often they are sent; it closes
        after --session-ttl-s unused."""
        raft = self.raft
        wait = timeout if timeout is not None else self.config.write_timeout_s
        return await self._open_session(raft.loop.time() + wait, wait, owner, here=True)  # a new one: never one of the node's own

    def propose_now(self, slots: Sequence[Slot]) -> None:
        """The write path without a task per write (kv.open's, and the etcd API's plain
        puts), on the event loop: propose the slots' writes, encoded by encode_request, at
        once (one Ready, one fsync for all), each as the next request of a session from this
        node's pool; each slot is resolved when its write is applied, then `settle(slot)`
        says what it came to. A slot that cannot go this way (no leader here, no free
        session, writes refused for want of disk, a fault test holding answers) is given
        up (`slot.give_up()`): settle sends it the general way."""
        raft = self.raft
        if raft.role != Role.LEADER or self.disk.low or self.alarms() or _HOLD_ANSWER:
            for s in slots:
                s.give_up()
            return
        items = []
        now = time.perf_counter()
        for s in slots:
            s.lane = lane = self.sessions.take()
            if lane is None:
                s.give_up()
                continue
            s.rid = rid = RequestId(lane.id, lane.next_seq())
            s.proposed_at, s.writer = now, self
            items.append((EntryKind.NORMAL, cmds.in_session(rid.session, rid.seq, s.payload), s))
        if not items:
            return
        try:
            raft.propose_waiters(items, raft.loop.time() + self.config.write_timeout_s)
        except Exception:  # nothing was appended
            for *_, s in items:
                s.give_up()
            return
        self.counters["writes"] += len(items)

    def resolved(self, slot: Slot) -> None:
        """A proposed slot's outcome is in: its metrics, on the event loop."""
        err = slot.error
        if err is None:
            if type(slot.applied.result) is not cmds.SessionExpired:
                self._observe_commit(time.perf_counter() - slot.proposed_at)
        elif not _goes_again(err):
            self.counters["proposals_failed"] += 1

    def settle(self, slot: Slot) -> Applied | None:
        """What a slot propose_now resolved comes to: its Applied, or None when it goes the
        general way, `await resubmit(slot)` (it was given up, not appended, refused while
        the leadership is handed over, replaced by another leader's entry, or its outcome is
        unknown). Raises what its caller is to see. Its session is given back here unless
        resubmit still needs it."""
        err = slot.error
        if err is None and not slot.fallback:
            applied = slot.applied
            if type(applied.result) is cmds.SessionExpired:  # it closed before this write reached it: applied nowhere
                slot.lane = slot.rid = None
                return None
            self.abandon(slot)  # (its request is over: the session is free)
            if type(applied.result) in cmds.NOT_APPLIED:
                return session_answer(applied, slot.rid.session, slot.rid.seq, None, False)
            return applied
        if err is None or _goes_again(err):
            return None
        self.abandon(slot)
        if isinstance(err, (DeadlineExceeded, NodeStopped)):
            raise public_error(err, written=not isinstance(err, NeverCommitted), wait=self.config.write_timeout_s) from err
        raise err

    async def resubmit(self, slot: Slot) -> Applied:
        """A slot settle() sent the general way: submit(), as the same session request
        where it was sent in one. When its first copy's outcome is unknown, so is the
        write's whatever refuses the copy sent now (a full disk, a stopping node): Timeout,
        never a refusal that says it was not carried out."""
        lane, slot.lane = slot.lane, None  # (given back below, once: abandon() after this finds none)
        counted = slot.writer is not None and not slot.fallback  # propose_now counted it
        unknown = slot.error if isinstance(slot.error, OutcomeUnknown) else None
        if unknown is not None:
            self.counters["writes_resent"] += 1
        try:
            if slot.rid is not None:
                try:
                    return await self.submit(slot.cmd, request_id=slot.rid, resent=unknown is not None, counted=counted)
                except SessionExpired:  # (never for a resend, whose answer then is Timeout) applied nowhere
                    lane, counted = None, True
            return await self.submit(slot.cmd, counted=counted)
        except KVError as e:
            if unknown is None or isinstance(e, Timeout):
                raise
            raise unknown_outcome(unknown, self.config.write_timeout_s) from e
        finally:
            if lane is not None:
                self.sessions.release(lane)

    def abandon(self, slot: Slot) -> None:
        """The slot's request is over, or nobody waits for it any more: its session is free
        for the next write (once: a second call finds none)."""
        if slot.lane is not None:
            self.sessions.release(slot.lane)
            slot.lane = None

    async def _new_lane(self, deadline: float, wait: float):
        try:
            return await self.sessions.acquire(deadline, wait)
        except Timeout as e:
            raise NotLeader(f"no client session could be opened for the write in time ({e}); it was not carried out: retry shortly") from e

    async def _open_session(self, deadline: float, wait: float, owner: str = "", here: bool = False) -> int:
        """`here`: wait until this node has applied the open too (kv.Node counts a token's
        open sessions in its own table: one opened through a follower that lags is not
        there yet, and would be taken for closed)."""
        session = new_session_id()
        applied, _ = await self._send(encode_command(cmds.SessionOpen(session, self.config.max_sessions, owner)), deadline, wait)
        if type(applied.result) is not cmds.SessionOpened:
            raise Unavailable(f"opening client session {session} failed: {applied.result!r}")
        if here:
            with contextlib.suppress(DeadlineExceeded):  # (open all the same: the cap counts it a little late)
                await self.raft.wait_applied(applied.index, deadline)
        return session

    def leader_view(self) -> tuple[bool, int, int]:
        """(whether this node leads, its term, the last index of its log)."""
        m = self.raft.metrics()
        return m.role == Role.LEADER, m.term, m.ledger_end_index

    async def propose_as_leader(self, cmd: cmds.Command, term: int) -> Applied | None:
        """The leader's own housekeeping, decided on its clock while it led in `term` (a
        lease's or a session's expiry): proposed only while this node still leads in that
        term, and never forwarded. A leader paused past its followers' election timeout
        wakes up believing every lease has expired: forwarded to the new leader, its
        revokes deleted leases that were being kept alive. Proposed in the old term, they
        can never commit. Returns None when it no longer leads in that term; raises like
        submit when the entry's fate is unknown."""
        raft = self.raft
        if raft.role != Role.LEADER or raft.term != term:
            return None
        fut = raft.loop.create_future()
        try:
            raft.propose_waiters(((EntryKind.NORMAL, encode_command(cmd), fut),), raft.loop.time() + self.config.write_timeout_s)
            return await fut
        except (NotLeader, TransferInProgress):
            return None  # not appended, or replaced by the next leader's entries
        except NoSpace as e:
            raise public_error(e) from e
        except (OutcomeUnknown, NodeStopped, Overloaded) as e:
            raise public_error(e, written=True, wait=self.config.write_timeout_s) from e

    async def _send(self, payload: bytes, deadline: float, wait: float) -> tuple[Applied, Exception | None]:
        """Propose (on the leader) or forward (elsewhere) until applied or the deadline;
        returns the result and, if an earlier copy's outcome was unknown, why. Every
        payload here is applied at most once however often it is sent (a session's
        request, an opening, an expiry, or a command nobody logs), so one whose outcome
        is unknown is sent again while there is time."""
        raft = self.raft
        unknown: Exception | None = None
        while True:
            sent = False  # whether this copy may have reached a leader's log
            try:
                if raft.role == Role.LEADER and cmds.is_local(payload):
                    return Applied(raft.applied_index, raft.term, await self._answer_local(cmds.decode(payload))), unknown
                if raft.role == Role.LEADER:
                    fut = raft.loop.create_future()
                    raft.propose_waiters(((EntryKind.NORMAL, payload, fut),), deadline)
                    sent = True
                    t0 = time.perf_counter()
                    applied = await fut
                    if payload[1] == cmds.OP_IN_SESSION:  # a write's
                        self._observe_commit(time.perf_counter() - t0)
                    if _HOLD_ANSWER:  # (0 unless a fault test armed it)
                        await asyncio.sleep(_HOLD_ANSWER)
                    return applied, unknown
                request_forwarded.set(True)
                sent = True
                resp = await raft.forward(payload, deadline)
            except NoQuorum:
                raise  # a read barrier (a lease keepalive's) gave up already: so does this
            except (NotLeader, TransferInProgress) as e:
                # Not appended (or replaced by another leader's entry): send it once a leader can take it.
                await await_leader(self.raft, deadline, e, unknown, force_wait=isinstance(e, TransferInProgress))
                continue
            except DeadlineExceeded as e:
                raise unknown_outcome(e, wait) from e
            except NodeStopped as e:  # this node stops: no copy goes out any more
                if sent and not isinstance(e, NeverCommitted):
                    raise unknown_outcome(e, wait) from e
                if unknown is not None:
                    raise unknown_outcome(unknown, wait) from e
                raise public_error(e) from e
            except OutcomeUnknown as e:
                unknown = e  # the leader it went to was replaced: send it to the next one
                self.counters["writes_resent"] += 1
                await await_leader(self.raft, deadline, e, unknown)
                continue
            except (Overloaded, NoSpace) as e:  # refused before anything was appended
                if unknown is not None:
                    raise unknown_outcome(unknown, wait) from e
                raise public_error(e) from e
            if resp.code == ForwardCode.OK:
                return Applied(resp.index, resp.term, cmds.decode_result(resp.payload)), unknown
            if resp.code in (ForwardCode.NOT_LEADER, ForwardCode.TRANSFERRING):
                await await_leader(self.raft, deadline, NotLeader(resp.payload.decode()), unknown, force_wait=True)
                continue
            if resp.code == ForwardCode.NO_SPACE:
                if unknown is not None:
                    raise unknown_outcome(unknown, wait)
                raise NoSpace(f"the leader refuses writes: {resp.payload.decode()}")
            if resp.code == ForwardCode.STOPPED:  # the leader could not tell how it ended
                unknown = OutcomeUnknown(f"the leader could not confirm the write: {resp.payload.decode()}")
                self.counters["writes_resent"] += 1
                await await_leader(self.raft, deadline, unknown, unknown, force_wait=True)
                continue
            if unknown is not None:
                raise unknown_outcome(unknown, wait)
            raise Unavailable(resp.payload.decode())
