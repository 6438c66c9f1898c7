"""The driver: runs a RaftCore with asyncio, the LMDB ledger and a peer transport (TCP
unless another `Transport` is given, see transport_protocol.py).

One task (`_run`) owns the core. It wakes when something arrives (a message, a proposal, a
read, a finished write, a timer) — never by polling — steps the core with everything that
queued up, and handles the Ready in the order core.py documents:

- `messages` go to the transport at once;
- hard state, snapshot reset and entries go to the ledger writer: one thread, one LMDB
  transaction and one fsync for everything queued while the previous write ran (group
  commit); `persisted_messages` leave only when their write is done;
- `applicable_index` lets `committed` (raft/committed.py) read the committed entries in
  bounded batches and queue them for the FSM caller (statemachine/caller.py), which applies
  them and resolves each batch's future with the results: the driver then resolves the
  proposals' futures.

The layers above use the methods and properties below (`metrics()`, `membership`,
`log_range()`, `compact()`, `send()`, ...), never the core itself: its state changes only
inside the driver's step.

A proposal's future resolves when the state machine has applied its index: with the result
if the entry there still has the proposal's term, with NotLeader if another leader's entry
took its place (this copy did not happen), with OutcomeUnknown if a snapshot from the
leader replaced this node's log past it (it may have committed). A deposed leader therefore
never acknowledges a write it cannot prove committed; a caller that gives up waiting knows
only that the outcome is unknown. Either way an earlier copy of the same command may still
commit, so a command is sent again only if the state machine recognises copies (a client
session's request, kv/common/sessions.py and kv/server/writes.py), never as a new write.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol

from . import failpoints
from .committed import CommittedFeed
from .config import CoreConfig
from .core import RaftCore, Ready
from .deadlines import AllOf, Deadlines, bucket_of
from .disk import DISK_RETRY_S, EIO_AFTER_FULL_S, is_disk_full, is_io_error
from .errors import LeaderChanged, MemberRemoved, NoSpace, NotLeader, RaftError, TransferInProgress
from .ledger import Ledger, LedgerWrite
from .membership import Membership
from .messages import (
    Entry,
    EntryKind,
    ForwardCode,
    ForwardRequest,
    ForwardResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    Message,
    Role,
    SnapshotChunk,
    SnapshotChunkAck,
    SnapshotMeta,
    superseded_acks_dropped,
)
from .transport import PeerTLS, TcpTransport
from .transport_protocol import NO_TRANSPORT, Transport, TransportCounters

log = logging.getLogger("kv.raft.node")

# How long a leader waits for a forwarded write to apply (the follower gives up earlier).
FORWARD_WAIT_S = 60.0
REMOVED_QUORUM_S = 30.0  # refusals as a removed member counted together (_refused_as_removed)
REFUSED_WARN_S = 60.0  # a leader refused by a member that is behind logs it this often


class NodeStopped(RaftError):
    """The node stopped (or failed) before the request finished; its outcome is unknown."""


class Overloaded(RaftError):
    """Too many writes are waiting to commit on this node; retry after a moment."""


class NeverCommitted(NodeStopped):
    """The node stopped before the proposal could commit anywhere: it was still queued, or
    its entry was in a ledger write that failed on the only voter."""


class OutcomeUnknown(RaftError):
    """This node can no longer tell whether a proposal committed: it may have. Never a
    reason to re-propose as a new write (that could apply it twice); only the very same
    request, which the state machine recognises (a client session's)."""


class DeadlineExceeded(OutcomeUnknown):
    """A request was not answered by its deadline; for a write its outcome is unknown."""


class SnapshotHooks(Protocol):
    """What the driver needs from the snapshot layer (snapshot/manager.py). The driver
    binds itself to the hooks when it is made: the one place the two are wired."""

    def bind(self, driver: RaftNode) -> None:
        """The driver the snapshots are streamed through, installed by and compacted in."""

    def start_send(self, peer: str, seq: int, term: int) -> None:
        """Stream the newest snapshot to peer; then call node.report_snapshot()."""

    def on_message(self, msg: SnapshotChunk | SnapshotChunkAck) -> None: ...

    def install(self, meta: SnapshotMeta) -> None:
        """In the ledger writer thread, before the ledger is reset to the snapshot: make the
        received snapshot file the node's newest one."""


class Waiter(Protocol):
    """What a proposal's outcome is delivered to (asyncio.Future fits)."""

    def done(self) -> bool: ...

    def set_result(self, result: Any) -> None: ...

    def set_exception(self, exc: BaseException) -> None: ...


class Applied(NamedTuple):
    """What a proposal's future resolves to."""

    index: int
    term: int
    result: Any


class ReadBatch:
    """The reads asked for in one turn of the loop with the same lease flag and deadline:
    one ask of the core under one ctx (the core answers every read waiting for its next
    heartbeat round with that round anyway), one deadline; each reader awaits a future of
    its own, so that one reader's cancellation touches no other. Filed in the driver's
    Deadlines as a future would be."""

    __slots__ = ("waiters", "waiting", "ctx")

    def __init__(self, first: asyncio.Future) -> None:
        self.waiters = [first]
        self.waiting = 1  # readers still awaiting (the last one to stop lets go of the ctx)
        self.ctx: int | None = None  # once asked of the core

    def done(self) -> bool:
        return not self.waiting

    def set_result(self, index: int) -> None:
        for w in self.waiters:
            if not w.done():
                w.set_result(index)

    def set_exception(self, exc: BaseException) -> None:
        for w in self.waiters:
            if not w.done():
                w.set_exception(exc)


class PeerProgress(NamedTuple):
    """The leader's view of one follower's replication."""

    match: int
    state: str  # the dispatcher state: compare, truncate, append, snapshot, ...


class RaftMetrics(NamedTuple):
    """One consistent view of the driver and its core, for status pages and metrics."""

    id: str
    role: Role
    term: int
    leader: str | None
    commit_index: int
    applied_index: int
    ledger_begin_index: int  # ledgerBeforeBeginIndex: entries up to here are compacted
    ledger_end_index: int
    peers: dict[str, PeerProgress]  # the leader's followers (empty on a follower)
    pending_proposals: int
    proposals: int  # entries proposed here as leader
    writes: int  # group-committed ledger writes (one fsync each)
    fsynced_entries: int
    ready: int  # Ready batches handled
    leader_changes: int
    followers_lost_entries: int  # times a follower answered that it lost what it acknowledged
    transport: TransportCounters


class RaftNode:
    def __init__(
        self,
        config: CoreConfig,
        ledger: Ledger,
        membership: Membership,
        *,
        group: str = "default",
        listen: str | None = None,
        secret: str | None = None,
        advertise_url: str = "",
        applied_index: int = 0,
        max_pending: int = 1 << 16,
        refuse_peer: Callable[[str], bool] = lambda peer: False,
        dial: dict[str, str] | None = None,
        serve_local: Callable[[bytes], Awaitable[bytes] | None] | None = None,
        peer_tls: PeerTLS | None = None,
        transport: Transport | None = None,
        snapshots: SnapshotHooks | None = None,
        result_encoder: Callable[[Any], bytes] = lambda r: b"",
        observe_fsync: Callable[[float], None] | None = None,
        observe_rtt: Callable[[str, float], None] | None = None,
        no_space: Callable[[int], str | None] = lambda nbytes: None,
        cluster_id: Callable[[], str] = lambda: "",
        noop_data: bytes = b"",
        level: int = 0,
        membership_index: int = 0,
    ) -> None:
        """`membership_index`: the index of the entry `membership` came from (RaftCore's).
        Hooks: `snapshots` streams and receives snapshot files;
        `no_space(nbytes)` says why proposals of nbytes are refused for now (the disk is
        nearly full), or None;
        `result_encoder` encodes an apply result for a follower that forwarded the command;
        `cluster_id()` is this node's cluster's identity ("": none yet; raft/transport.py);
        `noop_data` what the no-op this node appends when it becomes leader carries (the
        application's to read as it applies it; raft/core.py); `level` the level of the
        application's commands this node applies, which its peers learn (peer_level).
        Metrics: `observe_fsync(seconds)` of each ledger write (called from the writer
        thread), `observe_rtt(peer, seconds)` of a heartbeat's round trip.
        Peers are reached through `transport`; without one, through TCP on `listen` (with
        `secret`, `advertise_url`, `peer_tls`), or not at all when there is no address."""
        self.id = config.node_id
        self.cfg = config
        self.ledger = ledger
        self._membership0 = membership
        me = membership.get(self.id)
        listen = listen or (me.peer_addr if me is not None and me.peer_addr else None)
        self.core = RaftCore(config, ledger, ledger.hard_state(), membership, applied_index, self._clock(), seed=None, membership_index=membership_index)
        self.core.noop_data = noop_data
        self._refuse_peer = refuse_peer
        # Where this node dials a peer, when that differs from the address the membership
        # gives (a proxy, a NAT): this node's own --peers entries for the others.
        self._dial = {k: v for k, v in (dial or {}).items() if k != config.node_id}
        if transport is None and listen is not None:
            # Peers are admitted unless they were removed from the cluster: a member added
            # while this node lagged must still reach it (see RaftCore.known).
            transport = TcpTransport(
                self.id,
                group,
                listen,
                removed=self._why_removed,
                stranger=self._stranger,
                ledger_id=ledger.ledger_id,
                cluster_id=cluster_id,
                secret=secret,
                advertise_url=advertise_url,
                ssl=peer_tls,
            )
        self.transport = transport
        if transport is not None:
            transport.level = level
        self._advertise_url = advertise_url
        self._snapshots = snapshots
        if snapshots is not None:
            snapshots.bind(self)
        self._observe_fsync, self._observe_rtt = observe_fsync, observe_rtt
        self._no_space = no_space
        self.write_stalled: BaseException | None = None  # the ledger write waiting for disk space
        self._stalled_at = 0.0  # since when
        self._installed: set[int] = set()  # the Readies of the batch being written whose snapshot is installed
        self._removed_by: dict[str, float] = {}  # peer -> when it last refused this node as removed
        self._removed_warned: dict[str, float] = {}  # peer -> when that was last logged (as leader)
        self._heartbeat_sent: dict[str, float] = {}  # peer -> when the oldest unanswered heartbeat left
        self._last_leader: str | None = None
        self._result_encoder = result_encoder
        self._forwards: dict[int, tuple[str, asyncio.Future]] = {}  # req_id -> (the leader it went to, its future)
        # For a forwarded request the leader answers itself instead of logging it (a lease
        # keepalive): returns the encoded answer, or None when the payload is to be proposed.
        self._serve_local = serve_local
        self.applied_index = applied_index
        self._inbox: list[Message] = []
        self._proposals: list[tuple[int, bytes, asyncio.Future]] = []
        self._read_batches: dict[tuple[bool, int | None], ReadBatch] = {}  # (lease, deadline's bucket): reads not yet asked of the core
        self._read_futs: dict[int, ReadBatch] = {}  # ctx -> the reads the core was asked for under it
        # Numbers forwards and read batches from a random start: a leader's late answer to a
        # forward from this node's run before a restart must not be taken for this run's.
        self._ctx = itertools.count(secrets.randbits(62))
        self._pending: dict[int, tuple[int, asyncio.Future]] = {}  # index -> (term, future)
        # Proposals' deadline entries, in proposal order: (bucket, waiter or AllOf), taken
        # out of the Deadlines once answered (_forget_answered), not held until they are due.
        self._filed: deque[tuple[int, Any]] = deque()
        self._apply_waiters: list[tuple[int, asyncio.Future]] = []
        # What the state machine applies, in order (the FSM caller takes from it).
        self.committed = CommittedFeed(
            self.entries,
            applied_index,
            self._pending.keys(),
            on_applied=self._applied,
            on_loaded=self._reset_applied,
            on_failed=self.fail,
        )
        self.max_pending = max_pending
        self._persist_queue: list[Ready] = []
        self._writing = False
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"ledger-{self.id}")
        self._kicked = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._deadlines = Deadlines(lambda: DeadlineExceeded("not answered in time"))
        self._stopped = False
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None  # type: ignore[assignment]  # start() sets it (the loop the node runs on)
        self.failure: BaseException | None = None
        self.leader_changed = asyncio.Event()
        self.stats = {"proposals": 0, "writes": 0, "fsynced_entries": 0, "ready": 0, "leader_changes": 0, "followers_lost_entries": 0}

    @staticmethod
    def _clock() -> float:
        return time.monotonic() * 1000.0

    # ======================================================================================
    # Lifecycle

    async def start(self) -> None:
        # Kept: asyncio.get_running_loop() makes a getpid() system call each time, and the
        # hot paths would call it several times per request.
        self.loop = asyncio.get_running_loop()
        if self.transport is not None:
            self.transport.on_removed = self._refused_as_removed
            await self.transport.start(self._on_message, self._on_connected)
            self._update_peers()
        if self.core.membership.voters == {self.id}:
            self.core.campaign(self._clock())  # alone: no reason to wait for a timeout
        self._kick()

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
        self._deadlines.close()
        if self.transport is not None:
            await self.transport.stop()
        # Let an fsync in progress finish: its entries were handed to the ledger.
        await asyncio.get_running_loop().run_in_executor(None, self._writer.shutdown, True)
        self._fail_all(NodeStopped("the node stopped; the outcome of this request is unknown"))

    def _fail_all(self, exc: BaseException, lost_from: int | None = None) -> None:
        """Fail everything waiting with exc; proposals that cannot have committed (still
        queued, or at or after `lost_from`) with NeverCommitted."""
        never = NeverCommitted(f"{exc}; the request was not carried out")
        for i, (_, f) in self._pending.items():
            if lost_from is not None and i >= lost_from and not f.done():
                f.set_exception(never)
        for *_, f in self._proposals:
            if not f.done():
                f.set_exception(never)
        futs = [f for _, f in self._pending.values()]
        futs += list(self._read_futs.values()) + list(self._read_batches.values()) + [f for _, f in self._apply_waiters]
        futs += [f for _, f in self._forwards.values()]
        self._forwards.clear()
        self._pending.clear()
        self._filed.clear()
        self._proposals.clear()
        self._read_futs.clear()
        self._read_batches.clear()
        self._apply_waiters.clear()
        for f in futs:
            if not f.done():
                f.set_exception(exc)

    def _update_peers(self) -> None:
        """Dial the members of the newest and of the committed configuration: a member a
        pending change removes must still get answers until the change commits (a leader
        that removes itself needs them to commit its removal)."""
        if self.transport is not None:
            core = self.core
            members = {**core.committed_membership.members, **core.membership.members}
            # This node's --peers entry for a peer first (a proxy, a NAT), then the
            # membership's address, which a member moved with --replace changes.
            self.transport.set_peers(
                {i: tuple(dict.fromkeys((self._dial.get(i, m.peer_addr), m.peer_addr))) for i, m in members.items() if i != self.id}
            )
            # a member known by another ledger now (from a CONFIG entry or a snapshot):
            # the links of the data dir it had close
            self.transport.refuse_removed()

    # ======================================================================================
    # Requests

    def _check_running(self) -> None:
        if self._stopped or self.failure is not None:
            raise NodeStopped(f"node {self.id} is not running" + (f": {self.failure}" if self.failure else ""))

    async def propose(self, data: bytes, kind: int = EntryKind.NORMAL, deadline: float | None = None) -> Applied:
        """Replicate one command; resolves once it is committed and applied here. With a
        deadline (loop.time()), fails with DeadlineExceeded after it (outcome unknown)."""
        (fut,) = self.propose_many([(kind, data)], deadline)
        return await fut

    def propose_many(self, items: Sequence[tuple[int, bytes]], deadline: float | None = None) -> list[asyncio.Future]:
        """Queue several commands at once; each future resolves like propose()'s."""
        loop = self.loop
        futs = [loop.create_future() for _ in items]
        self.propose_waiters([(kind, data, f) for (kind, data), f in zip(items, futs)], deadline)
        return futs

    def propose_waiters(self, items: Sequence[tuple[int, bytes, Waiter]], deadline: float | None = None) -> None:
        """Like propose_many, with the caller's own waiters: anything with a future's
        done / set_result / set_exception (kv.open resolves its threads' slots this way
        without an asyncio future per write). Raises when nothing was appended."""
        self._check_running()
        core = self.core
        if core.role != Role.LEADER:
            raise NotLeader(leader=core.leader_id)
        if core.transferee is not None:
            raise TransferInProgress(core.transferee)
        if self.pending_proposals() >= self.max_pending:
            raise Overloaded(f"{self.max_pending} writes are already waiting to commit on {self.id}; retry shortly")
        why = self._no_space(sum(len(item[1]) for item in items))
        if why is not None:
            raise NoSpace(why)
        self._proposals.extend(items)
        if deadline is not None:
            waiter = AllOf([w for _, _, w in items]) if len(items) > 1 else items[0][2]
            bucket = self._deadlines.add(deadline, waiter)
            if bucket is not None:
                self._filed.append((bucket, waiter))
        self._kick()

    async def forward(self, payload: bytes, deadline: float | None = None) -> ForwardResponse:
        """Hand a command to the leader over the peer link and wait for its answer; after
        the deadline it fails with DeadlineExceeded (the outcome is unknown)."""
        self._check_running()
        leader = self.core.leader_id
        if leader is None or leader == self.id or self.transport is None:
            raise NotLeader(leader=leader)
        req_id = next(self._ctx)
        fut = self.loop.create_future()
        self._forwards[req_id] = (leader, fut)
        try:
            with self._deadlines.held(deadline, fut):
                if not self.transport.send(ForwardRequest(self.id, leader, req_id, payload)):
                    raise NotLeader(f"the leader {leader} cannot be reached from {self.id} right now; retry shortly")
                return await fut
        finally:
            self._forwards.pop(req_id, None)
            if not fut.done():
                fut.cancel()

    async def _serve_forward(self, m: ForwardRequest) -> None:
        code, index, term, payload = ForwardCode.OK, 0, 0, b""
        try:
            local = self._serve_local(m.payload) if self._serve_local is not None else None
            if local is not None:
                payload = await local
                index, term = self.applied_index, self.core.term
            else:
                deadline = self.loop.time() + FORWARD_WAIT_S
                applied = await self.propose(m.payload, deadline=deadline)
                index, term, payload = applied.index, applied.term, self._result_encoder(applied.result)
                if failpoints.delay("write.before_answer"):
                    await asyncio.sleep(failpoints.delay("write.before_answer"))
        except NotLeader as e:
            code, payload = ForwardCode.NOT_LEADER, str(e).encode()
        except TransferInProgress as e:
            code, payload = ForwardCode.TRANSFERRING, str(e).encode()
        except Overloaded as e:
            code, payload = ForwardCode.OVERLOADED, str(e).encode()
        except NoSpace as e:
            code, payload = ForwardCode.NO_SPACE, str(e).encode()
        except (NodeStopped, OutcomeUnknown) as e:
            code, payload = ForwardCode.STOPPED, str(e).encode()
        if self.transport is not None and not self._stopped:
            leader = self.core.leader_id or ""
            self.transport.send(ForwardResponse(self.id, m.src, m.req_id, code, index, term, leader, payload))

    async def read_index(self, lease: bool = False, deadline: float | None = None) -> int:
        """Linearizable read barrier: returns an index such that once this node has applied
        it (it has, when this returns), a local read sees every write acknowledged before
        the call. On a follower the leader is asked for it. Fails with DeadlineExceeded
        after the deadline."""
        self._check_running()
        fut = self.loop.create_future()
        # (deadlines within one of the Deadlines' buckets fail together anyway)
        key = (lease, None if deadline is None else bucket_of(deadline))
        batch = self._read_batches.get(key)
        if batch is None:
            self._read_batches[key] = batch = ReadBatch(fut)
            if deadline is not None:
                self._deadlines.add(deadline, batch)
            self._kick()
        else:
            batch.waiters.append(fut)
            batch.waiting += 1
        try:
            index = await fut
        finally:
            batch.waiting -= 1
            if not batch.waiting and batch.ctx is not None:
                self._read_futs.pop(batch.ctx, None)
        if self.applied_index < index:
            await self.wait_applied(index, deadline)
        return index

    async def wait_applied(self, index: int, deadline: float | None = None) -> None:
        if self.applied_index >= index:
            return
        self._check_running()  # a stopped node applies nothing more (and fails its waiters once)
        fut = self.loop.create_future()
        self._apply_waiters.append((index, fut))
        with self._deadlines.held(deadline, fut):
            await fut

    async def change_membership(self, new: Membership, deadline: float | None = None) -> Applied:
        """Propose a membership change (one member at a time) and wait until it is applied
        here. Raises ConfigChangeRefused (nothing changed), NotLeader, TransferInProgress."""
        self._check_running()
        term, index = self.core.propose_config(new, self._clock())
        fut = asyncio.get_running_loop().create_future()
        self._pending[index] = (term, fut)
        self._kick()
        with self._deadlines.held(deadline, fut):
            return await fut

    async def transfer_leadership(self, to: str) -> None:
        self._check_running()
        self.core.transfer_leadership(to, self._clock())
        self._kick()

    async def run_in_writer(self, fn: Callable[[], Any]) -> Any:
        """Run fn in the ledger writer thread, between group commits (ledger compaction)."""
        return await asyncio.get_running_loop().run_in_executor(self._writer, fn)

    def report_snapshot(self, peer: str, seq: int, ok: bool) -> None:
        self.core.report_snapshot(peer, seq, ok, self._clock())
        self._kick()

    def step_local(self, msg: Message) -> None:
        """Feed a message produced on this node (the snapshot receiver's install request)."""
        self._inbox.append(msg)
        self._kick()

    def entries(self, lo: int, hi: int, max_bytes: int = 8 << 20) -> list[Entry]:
        """Entries [lo, hi) of the log, about max_bytes (the caller keeps to committed ones)."""
        return self.core.log.entries(lo, hi, max_bytes, 1 << 30)

    # ======================================================================================
    # What comes back from the state machine (through self.committed)

    def _applied(self, entries: Sequence[Entry], results: Sequence[Any]) -> None:
        """The state machine applied these entries (in order) with these results."""
        if self.transport is not None and any(e.kind == EntryKind.CONFIG for e in entries):
            self.transport.refuse_removed()  # a removed member's links close: it learns why when it dials again
        pending = self._pending
        for e, r in zip(entries, results):
            p = pending.pop(e.index, None) if pending else None
            if p is not None:
                term, fut = p
                if fut.done():
                    continue
                if term == e.term:
                    fut.set_result(Applied(e.index, e.term, r))
                else:
                    fut.set_exception(NotLeader("the write was replaced by a new leader's entry and did not happen; retry it", self.core.leader_id))
        if entries:
            self.applied_index = entries[-1].index
        self._forget_answered()
        self._release_apply_waiters()

    def _forget_answered(self) -> None:
        """Take the answered proposals out of the Deadlines. Left there until their bucket
        fell due (the write timeout), every write's waiter, and what it holds (a gRPC call,
        its stream and request), outlived it by seconds: tens of thousands of objects on a
        busy leader that each young-generation collection of the garbage collector walked
        and kept, 20-120 ms pauses of the event loop (the tail of a put's latency)."""
        filed = self._filed
        while filed and filed[0][1].done():
            self._deadlines.discard(*filed.popleft())

    def _reset_applied(self, index: int) -> None:
        """The state machine was replaced by a snapshot up to index (one the leader
        installed, loaded by the FSM caller)."""
        self.applied_index = index
        for i in [i for i in self._pending if i <= index]:
            term, fut = self._pending.pop(i)
            if not fut.done():
                # The snapshot may hold the entry (a new leader committed it) or not: unknown.
                fut.set_exception(OutcomeUnknown(f"node {self.id} installed a snapshot that covers this write; it may or may not have been committed"))
        self._release_apply_waiters()

    def _release_apply_waiters(self) -> None:
        if not self._apply_waiters:
            return
        keep = []
        for idx, fut in self._apply_waiters:
            if idx <= self.applied_index:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((idx, fut))
        self._apply_waiters = keep

    # ======================================================================================
    # Inputs from the network

    def _on_message(self, msg: Message) -> None:
        t = type(msg)
        if t is ForwardRequest:
            self.loop.create_task(self._serve_forward(msg))
            return
        if t is ForwardResponse:
            leader, fut = self._forwards.get(msg.req_id, (None, None))
            if fut is not None and msg.src == leader and not fut.done():
                fut.set_result(msg)
            return
        if t is SnapshotChunk or t is SnapshotChunkAck:
            if self._snapshots is not None:
                self._snapshots.on_message(msg)
            return
        if t is HeartbeatResponse and self._observe_rtt is not None:
            sent = self._heartbeat_sent.pop(msg.src, None)
            if sent is not None:
                self._observe_rtt(msg.src, time.monotonic() - sent)
        self._inbox.append(msg)
        self._kick()

    def _on_connected(self, peer: str) -> None:
        self.core.peer_connected(peer, self._clock())
        self._kick()

    def _refused_as_removed(self, peer: str) -> None:
        """A peer refused this node as a member removed from the cluster (or as a data dir
        the member no longer joins from). Once most of the other voters it knows of have
        said so within REMOVED_QUORUM_S, or the leader it follows has, it was: stop, with
        one line saying so. (One follower alone may not have applied a later re-adding yet;
        the leader has every committed change. Most voters alone kept a node running that
        could not reach them: an empty data dir whose --peers named a member since moved.)"""
        now = time.monotonic()
        self._removed_by[peer] = now
        others = [v for v in self.core.membership.voters if v != self.id] or [peer]
        said = [p for p in others if now - self._removed_by.get(p, -REMOVED_QUORUM_S) < REMOVED_QUORUM_S]
        if len(said) * 2 > len(others) or peer == self.core.leader_id:
            if self.failure is not None:
                return
            said = sorted(set(said) | {peer})
            log.error(
                "node %s: %s %s this node as a member removed from the cluster (kv member remove), or as a data dir its id "
                "no longer runs from (it joined again from another): it stops. To run it "
                "again, start it from an empty data dir with --join URL (a member's client URL): it adds itself back. Still "
                "listed by kv member list? Then the cluster knows it by another data dir: remove it first, if that one is gone",
                self.id, ", ".join(said), "refuses" if len(said) == 1 else "refuse",
            )
            self.fail(MemberRemoved(f"node {self.id} was removed from the cluster ({', '.join(sorted(said))} refuse it)"))
        elif self.role == Role.LEADER and now - self._removed_warned.get(peer, -REFUSED_WARN_S) >= REFUSED_WARN_S:
            # A leader the others follow: the refusing member is the one behind (a voter that
            # was down while this node's id was removed and joined again twice holds an entry
            # naming its earlier data dir, and only this node could send it the newer).
            self._removed_warned[peer] = now
            log.warning(
                "node %s: %s refuses this node, which leads, as a removed member or as an earlier data dir of its id: %s "
                "was down while this node's id was removed and joined again, and its membership is older. It catches up "
                "from another leader (kv leader transfer)",
                self.id, peer, peer,
            )

    # ======================================================================================
    # The loop

    def _kick(self) -> None:
        """Something arrived: step the core once the current callbacks are done, so that
        everything arriving meanwhile is handled in one step."""
        if not self._kicked and not self._stopped:
            self._kicked = True
            self.loop.call_soon(self._on_kick)

    def _on_kick(self) -> None:
        self._kicked = False
        if self._stopped:
            return
        try:
            self._step()
        except Exception as e:  # a bug or a failed fsync: stop rather than go on wrong
            log.exception("node %s failed", self.id)
            self.fail(e)

    def fail(self, e: BaseException, lost_from: int | None = None) -> None:
        """Stop serving after an error that leaves this node unable to go on safely;
        entries from `lost_from` on are known to have committed nowhere."""
        self.failure = e
        self._stopped = True
        self._fail_all(NodeStopped(f"node {self.id} failed: {e}"), lost_from)
        self.leader_changed.set()

    def _step(self) -> None:
        core = self.core
        now = self._clock()
        if self._inbox:
            inbox, self._inbox = self._inbox, []
            for m in inbox:
                core.step(m, now)
        if self._proposals:
            self._propose_queued(now)
        if self._read_batches:
            batches, self._read_batches = self._read_batches, {}
            for (lease, _), batch in batches.items():
                if batch.waiting:
                    batch.ctx = ctx = next(self._ctx)
                    self._read_futs[ctx] = batch
                    core.read_index(ctx, now, lease)
        if now >= core.next_deadline():
            core.tick(now)
        while core.has_ready():
            self._handle(core.ready())
        self._arm_timer()

    def _propose_queued(self, now: float) -> None:
        props, self._proposals = self._proposals, []
        try:
            term, first = self.core.propose([(k, d) for k, d, _ in props], now)
        except (NotLeader, TransferInProgress) as e:
            for *_, f in props:
                if not f.done():
                    f.set_exception(e)
            self._forget_answered()
            return
        self.stats["proposals"] += len(props)
        for i, (_, _, f) in enumerate(props, first):
            self._pending[i] = (term, f)

    def _handle(self, rd: Ready) -> None:
        self.stats["ready"] += 1
        if rd.role_changed:
            self._role_changed()
        if rd.membership_changed:
            self._update_peers()
        t = self.transport
        if t is not None:
            for m in rd.messages:
                if type(m) is HeartbeatRequest and self._observe_rtt is not None:
                    self._heartbeat_sent_now(m.dst)
                t.send(m)
        if rd.must_persist or rd.persisted_messages:
            self._persist_queue.append(rd)
            self._kick_writer()
        if rd.snapshot is not None:
            self.committed.snapshot_reset(rd.snapshot.index)
        if rd.applicable_index is not None:
            self.committed.commit(rd.applicable_index)
        for rs in rd.read_states:
            batch = self._read_futs.pop(rs.ctx, None)
            if batch is not None:
                batch.set_result(rs.index)
        for rf in rd.read_failures:
            batch = self._read_futs.pop(rf.ctx, None)
            if batch is not None:
                batch.set_exception(NotLeader(leader=rf.leader))
        for lost in rd.lost_entries:
            self.stats["followers_lost_entries"] += 1
            log.error(
                "node %s: follower %s answered with a ledger that ends at index %d, below the %d it had acknowledged: "
                "its data dir was lost or replaced. It is being caught up again (by a snapshot if the ledger no longer "
                "holds its entries), but until then the cluster has one copy fewer of those entries than it counted on. "
                "A node whose data is gone should rejoin as a new member: kv member remove %s, then start it with an "
                "empty data dir and --join",
                self.id, lost.peer, lost.holds, lost.acknowledged, lost.peer,
            )
        if rd.snapshot_sends:
            for s in rd.snapshot_sends:
                if self._snapshots is not None:
                    self._snapshots.start_send(s.peer, s.seq, self.core.term)
                else:
                    self.core.report_snapshot(s.peer, s.seq, False, self._clock())

    def _heartbeat_sent_now(self, peer: str) -> None:
        """Time the oldest unanswered heartbeat; one lost over a second ago is forgotten."""
        now = time.monotonic()
        sent = self._heartbeat_sent.get(peer)
        if sent is None or now - sent > 1.0:
            self._heartbeat_sent[peer] = now

    def _role_changed(self) -> None:
        c = self.core
        gone = "" if self.id in c.membership.ids else " (no longer a member: the membership change that removed it took effect)"
        log.info("node %s: %s in term %d, leader %s%s", self.id, c.role.label, c.term, c.leader_id, gone)
        if c.leader_id is not None and c.leader_id != self._last_leader:
            self.stats["leader_changes"] += 1
        if c.leader_id != self._last_leader and self._read_futs:
            # Reads waiting on the old leader's answer (it may be dead, and the new one
            # knows nothing of them) or on our own rounds as leader: ask again now.
            reads, self._read_futs = self._read_futs, {}
            for batch in reads.values():
                if not batch.done():
                    batch.set_exception(LeaderChanged(f"the leader changed ({self._last_leader} -> {c.leader_id}) while a read waited; retry", c.leader_id))
        if c.leader_id != self._last_leader and self._forwards:
            # Writes handed to the old leader: it is dead or cut off (we stopped hearing it,
            # or a newer term began), so its answer will not come; what it did with them is
            # unknown (it may have replicated them before it went). Say so now rather than at
            # the write's deadline.
            gone = self._last_leader
            for leader, fut in self._forwards.values():
                if leader == gone and not fut.done():
                    fut.set_exception(OutcomeUnknown(f"the leader {gone} was replaced while this write waited for its answer; it may or may not have been committed"))
        self._last_leader = c.leader_id
        self.leader_changed.set()
        self.leader_changed = asyncio.Event()

    def _arm_timer(self) -> None:
        at = self.core.next_deadline()
        if self._timer is not None:
            if self._timer_at <= at:
                return  # an earlier wake-up is set already; the step then re-arms
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        delay = max(0.0, (at - self._clock()) / 1000.0)
        self._timer_at = at
        self._timer = loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._forget_answered()  # (those failed at their deadline where nothing applies: a cut-off leader)
        self._kick()

    # ======================================================================================
    # The ledger writer (group commit)

    def _kick_writer(self) -> None:
        if self._writing or not self._persist_queue:
            return
        batch, self._persist_queue = self._persist_queue, []
        self._writing = True
        fut = self.loop.run_in_executor(self._writer, self._write, batch)
        fut.add_done_callback(lambda f: self._written(batch, f))

    def _write_again(self, batch: list[Ready]) -> None:
        if self._stopped:
            return
        fut = self.loop.run_in_executor(self._writer, self._write, batch)
        fut.add_done_callback(lambda f: self._written(batch, f))

    def _write(self, batch: list[Ready]) -> None:
        writes = []
        for rd in batch:
            if rd.snapshot is not None and self._snapshots is not None and id(rd) not in self._installed:
                self._snapshots.install(rd.snapshot)
                self._installed.add(id(rd))  # (a write tried again after a full disk does not install it twice)
            if rd.must_persist:
                reset = (rd.snapshot.index, rd.snapshot.term) if rd.snapshot is not None else None
                writes.append(LedgerWrite(rd.hard_state, reset, rd.entries_from, rd.entries))
        if writes:
            t0 = time.perf_counter()
            self.ledger.write(writes)
            if self._observe_fsync is not None:
                self._observe_fsync(time.perf_counter() - t0)

    def _disk_full(self, exc: BaseException) -> bool:
        # EIO tells a full tmpfs from a failing disk only by the free space, read after the
        # write failed: once the operator has made room, the retry's EIO can still be the
        # full disk's. For a while after a stall it is taken as such; a disk that keeps
        # failing with room stops the node after that.
        if is_disk_full(exc, self.ledger.path):
            return True
        return self.write_stalled is not None and time.monotonic() - self._stalled_at < EIO_AFTER_FULL_S and is_io_error(exc)

    def _written(self, batch: list[Ready], fut: asyncio.Future) -> None:
        exc = fut.exception()
        if exc is not None and self._disk_full(exc):
            # Wait for space and write the same batch again (nothing of it was written, and
            # nothing after it goes first): the node stays up, serving reads, and its acks
            # and proposals wait. kv/server/diskguard.py refuses new writes meanwhile.
            if self.write_stalled is None:
                log.error("node %s: the disk is full (%s); the ledger write waits for space and is tried again every second", self.id, exc)
                self._stalled_at = time.monotonic()
            self.write_stalled = exc
            self.loop.call_later(DISK_RETRY_S, self._write_again, batch)
            return
        if self.write_stalled is not None:
            log.warning("node %s: the ledger write went through: there is disk space again", self.id)
            self.write_stalled = None
        self._installed.clear()
        self._writing = False
        if exc is not None:
            log.error("node %s: ledger write failed, stopping: %s", self.id, exc)
            # With this node the only voter, entries that did not reach its ledger cannot
            # have committed; elsewhere the followers may commit what they were sent.
            first = min((rd.entries[0].index for rd in batch if rd.entries), default=None)
            self.fail(exc, first if self.core.membership.voters == {self.id} else None)
            return
        self.stats["writes"] += 1
        t = self.transport
        if t is not None:
            for m in superseded_acks_dropped([m for rd in batch for m in rd.persisted_messages]):
                t.send(m)
        for rd in batch:
            self.stats["fsynced_entries"] += len(rd.entries)
            self.core.on_persisted(rd)
            if rd.snapshot is not None:
                self.committed.snapshot_durable(rd.snapshot)
        self._kick_writer()
        self._kick()

    # ======================================================================================
    # Status

    def pending_proposals(self) -> int:
        """Writes proposed here that have not committed or failed yet."""
        return len(self._pending) + len(self._proposals)

    def status(self) -> dict:
        s = self.core.status()
        s["applied_index"] = self.applied_index
        s["membership"] = self.core.membership.to_dict()
        return s

    def metrics(self) -> RaftMetrics:
        """Role, indexes, the leader's view of each follower and the driver's counters."""
        c, st, t = self.core, self.stats, self.transport
        return RaftMetrics(
            id=self.id,
            role=c.role,
            term=c.term,
            leader=c.leader_id,
            commit_index=c.commit_index,
            applied_index=self.applied_index,
            ledger_begin_index=c.log.before_index,
            ledger_end_index=c.log.last_index(),
            peers={p: PeerProgress(pr.match, pr.state.value) for p, pr in c.progress.items()},
            pending_proposals=self.pending_proposals(),
            proposals=st["proposals"],
            writes=st["writes"],
            fsynced_entries=st["fsynced_entries"],
            ready=st["ready"],
            leader_changes=st["leader_changes"],
            followers_lost_entries=st["followers_lost_entries"],
            transport=NO_TRANSPORT if t is None else t.counters(),
        )

    @property
    def membership(self) -> Membership:
        """The newest configuration this node knows (an immutable value)."""
        return self.core.membership

    @property
    def committed_membership_at(self) -> tuple[Membership, int]:
        """The newest configuration known committed, and the index of its entry."""
        return self.core.committed_membership, self.core.committed_membership_index

    def log_range(self) -> tuple[int, int]:
        """(first, last): the committed entries this node's ledger holds and it has applied
        (first - 1 is ledgerBeforeBeginIndex; last is the applied index)."""
        return self.core.log.before_index + 1, self.applied_index

    def committed_in_term(self) -> bool:
        """Whether this leader has committed an entry of its own term (its no-op): until
        then its commit index may lag what an earlier leader committed."""
        return self.core.committed_in_term()

    async def compact(self, upto: int, before: Callable[[], None] | None = None) -> tuple[int, int] | None:
        """Drop the ledger's entries up to `upto`, in the writer thread between group
        commits (`before` runs first there: what the ledger drops must be durable above
        it), then move the core's ledgerBeforeBeginIndex. Returns the new
        (ledgerBeforeBeginIndex, term), or None when nothing was to be dropped."""
        ledger = self.ledger
        if upto <= ledger.before_begin_index:
            return None

        def compact() -> tuple[int, int]:
            if before is not None:
                before()
            ledger.compact(upto)
            return ledger.before_begin_index, ledger.before_begin_term

        index, term = await self.run_in_writer(compact)
        self.core.compacted(index, term)
        return index, term

    def send(self, msg: Message) -> bool:
        """Send a message to a peer now (the snapshot streams); False if it was not sent."""
        t = self.transport
        return t.send(msg) if t is not None else False

    def peer_url(self, peer: str) -> str:
        """The client URL a peer announced in its transport handshake ("" if none)."""
        return self.transport.peer_url(peer) if self.transport is not None else ""

    def peers_apply(self, level: int) -> bool:
        """Whether every other member said, when this node last reached it, that it applies
        commands of `level` (a command an earlier version cannot apply waits for that)."""
        others = [m for m in self.membership.members if m != self.id]
        said = getattr(self.transport, "peer_level", None)  # (a transport of the caller's may not say)
        return not others or (said is not None and all(said(m) >= level for m in others))

    @property
    def role(self) -> Role:
        return self.core.role

    @property
    def leader_id(self) -> str | None:
        return self.core.leader_id

    @property
    def term(self) -> int:
        return self.core.term

    def _why_removed(self, peer: str, ledger: str) -> str | None:
        """Why a peer dialling with this ledger_id is refused as a member removed from the
        cluster (the log line keeps 200 characters), or None."""
        if self._refuse_peer(peer):
            return f"{peer!r} was removed from this cluster"
        if self.core.membership.refuses_as_replaced(self.id, peer, ledger):
            return (
                f"{peer!r} joined from another data dir than this one (ledger {ledger or 'not said'}): "
                "removed and joined again, or this one's data was lost (or this node has not caught up with its latest join)"
            )
        return None

    def _stranger(self, peer: str) -> str | None:
        """A node whose cluster has no member but itself lets no other node in. It was started
        as a cluster of its own (without --peers, say), or restored or forced to one: no
        peer dials it but one of another cluster, whose leader's pushes would be taken for
        its own log (entries of the same index and term, other contents: a node added with
        kv member add, then started alone from a data dir that held writes, served them).
        Peers not yet in a larger membership are let in: a member added while this node lagged."""
        if set(self.core.membership.ids) != {self.id}:
            return None
        return (  # (the log line keeps 200 characters, its start included)
            f"{peer!r} is not a member: this node's cluster is {self.id!r} alone; "
            f"a node added with kv member add starts from an empty data dir with --join URL"
        )

    def leader_url(self) -> str | None:
        """The client URL of the leader, if known (announced in its transport handshake)."""
        lid = self.core.leader_id
        if lid is None:
            return None
        if lid == self.id:
            return self._advertise_url or None
        m = self.core.membership.get(lid)
        if m is not None and m.http_url:
            return m.http_url
        return (self.transport.peer_url(lid) or None) if self.transport is not None else None
