"""kv.Node: a cluster member in-process — the replicated log, the state machine, snapshots
and the store API, wired together. `kv serve` runs one of these behind the HTTP API."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import hashlib
import logging
import os
import secrets
import time
from collections.abc import Sequence
from typing import NamedTuple

from . import bootstrap, limits, logguard, tls
from .config import NodeConfig, check_hostport
from .coordination import AsyncElection, AsyncLease, AsyncLock
from .datadir import DataDirLock
from .diskguard import DiskGuard
from .leases import LeaseClock
from .scan import Scan
from .sessions import RequestId, SessionPool, SessionSweeper, new_session_id
from .errors import (
    BadRequest,
    Compacted,
    Conflict,
    DataDirLocked,
    KVError,
    LeaseNotFound,
    MemberExists,
    NotFound,
    NoQuorum,
    NoSpace,
    NotLeader,
    PreconditionFailed,
    ReadsOmitted,
    SessionExpired,
    Timeout,
    Unavailable,
    ValueTooLarge,
)
from .raft import failpoints
from .raft.errors import ConfigChangeRefused, LeaderChanged, TransferInProgress
from .raft.ledger import Ledger, LedgerWrite
from .raft.membership import Member, Membership
from .raft.messages import Entry, EntryKind, ForwardCode, Role
from .raft.node import Applied, CoreConfig, DeadlineExceeded, NeverCommitted, NodeStopped, OutcomeUnknown, Overloaded, RaftNode
from .raft.transport_protocol import Transport
from .statemachine import commands as cmds
from .statemachine.caller import FSMCaller
from .statemachine.leveldb import LevelDBStateMachine, StateCorrupt, StateLocked
from .watch import Watch, WatchHub

log = logging.getLogger("kv.node")

CONSISTENCY = ("linearizable", "lease", "stale")
_HOLD_ANSWER = failpoints.delay("write.before_answer")  # a fault test's wide window (raft/failpoints.py)


class Item(NamedTuple):
    key: str
    value: bytes
    mod_index: int


# Set when this node hands a client's request to the leader (the access log says so).
request_forwarded: contextvars.ContextVar[bool] = contextvars.ContextVar("kv_request_forwarded", default=False)


class WriteResult(NamedTuple):
    index: int
    term: int


class DeleteResult(NamedTuple):
    index: int
    term: int
    deleted: bool


class PrefixDeleteResult(NamedTuple):
    index: int
    term: int
    deleted: int  # keys deleted


class TxnResult(NamedTuple):
    index: int
    term: int
    succeeded: bool
    results: tuple  # per op: WriteResult, DeleteResult or Item|None for a get


class LeaseStatus(NamedTuple):
    """A lease: its ttl and the seconds left on the leader's clock (the full ttl right
    after a grant), and the keys attached to it."""

    id: int
    ttl: float
    remaining: float
    keys: tuple[str, ...] = ()


class RevokeResult(NamedTuple):
    index: int
    keys: tuple[str, ...]  # deleted with the lease


class Page(NamedTuple):
    """One page of a scan, and the applied index it was read at: watch from index + 1 to
    see every change after it, none twice."""

    items: list[Item]
    index: int


class Node:
    """A member of a ledgerkv cluster, in-process.

        async with kv.Node(id="n1", data_dir="/tmp/n1",
                           peers={"n1": "127.0.0.1:7001", "n2": ..., "n3": ...}) as node:
            await node.put("config/db", b"postgres://...")
            item = await node.get("config/db")          # linearizable by default

    Any member takes writes (a follower forwards them to the leader over the peer link) and
    linearizable reads (it asks the leader for a read index, then reads locally).

    Peers talk over TCP on the node's own `peers` entry unless `transport` is given (a
    `kv.raft.transport_protocol.Transport`, e.g. `kv.raft.loopback.LoopbackNetwork().transport(id)`
    for a cluster inside one process).
    """

    def __init__(
        self,
        config: NodeConfig | None = None,
        *,
        initial_membership: Membership | None = None,
        data_dir_lock: DataDirLock | None = None,
        transport: Transport | None = None,
        **options,
    ) -> None:
        self.config = config if config is not None else NodeConfig(**options)
        # The data dir's lock, if the caller took it already (kv serve does, before it
        # looks into the directory); the node releases it when it stops.
        self._lock = data_dir_lock
        # A node that joins a running cluster starts from the membership the cluster gave it.
        self._initial_membership = initial_membership
        self._transport = transport
        self.raft: RaftNode | None = None
        self.sm: LevelDBStateMachine | None = None
        self.ledger: Ledger | None = None
        self.caller: FSMCaller | None = None
        self.snapshots = None  # snapshot.manager.SnapshotManager, set in start()
        self.leases = LeaseClock(self)
        self.watches = WatchHub(self, self.config.watch_budget_bytes)
        # Sessions for the writes this node is handed without one (kv/sessions.py).
        self.sessions = SessionPool(self._open_session)
        self._session_sweeper: SessionSweeper | None = None
        self.disk: DiskGuard | None = None  # the free-space reserve (kv/diskguard.py), made in start()
        self.started_at = 0.0
        self.counters = collections.Counter()
        self._metrics = None  # kv.metrics.NodeMetrics, made on first use (see metrics)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> Node:
        c = self.config
        if self._lock is None or not self._lock.held:
            self._lock = DataDirLock.acquire(c.data_dir)  # before anything in it is read
        try:
            return await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> Node:
        from .snapshot.manager import SnapshotManager  # the snapshot layer sits above raft

        c = self.config
        peer_tls = tls.peer_tls(c.peer_cert, c.peer_key, c.peer_ca)
        logguard.guard("kv.raft.transport")  # strangers on the peer port must not flood the log
        self.ledger = Ledger(c.ledger_path, c.id, c.group, map_size=c.ledger_map_size, sync=c.fsync)
        self.disk = DiskGuard(c.data_dir, c.min_free_bytes, c.id, stalled=self._stalled_on_disk)
        self.disk.check()
        self.snapshots = SnapshotManager(_SnapshotHost(self), c.snapshot_path, keep=c.snapshot_keep)
        loop = asyncio.get_running_loop()
        try:
            self.sm = LevelDBStateMachine(c.state_path, max_read_bytes=c.max_txn_read_bytes)
        except StateLocked as e:  # never damage: the lock above makes this one owner's
            raise DataDirLocked(c.data_dir) from e
        except StateCorrupt as e:
            self.sm = await loop.run_in_executor(None, self._rebuild_state, e)
        await loop.run_in_executor(None, self._reconcile)
        await loop.run_in_executor(None, self._replay_sessions)
        if c.force_new_cluster:
            await loop.run_in_executor(None, self._force_new_cluster)
        membership = self._membership()
        core_cfg = CoreConfig(
            node_id=c.id,
            heartbeat_ms=c.heartbeat_ms,
            election_timeout_ms=c.election_timeout_ms,
            push_timeout_ms=max(1000.0, c.election_timeout_ms),
            append_hold_ms=c.append_hold_ms,
        )
        if not self.sm.membership() and self.ledger.last_index() == 0:
            bootstrap.record(c.data_dir, c.peers or membership.ids)
            self.sm.set_membership(membership.encode())
        elif c.peers:
            bootstrap.check_peers(c.data_dir, c.id, c.peers, membership.ids)
        self.sm.on_changes = self.watches.publish
        self.raft = RaftNode(
            core_cfg,
            self.ledger,
            membership,
            group=c.group,
            listen=c.peers.get(c.id),
            secret=c.cluster_secret,
            advertise_url=c.advertise_url,
            applied_index=self.sm.applied()[0],
            refuse_peer=lambda peer: peer in self.sm.removed(),
            dial=c.peers,
            serve_local=self._serve_local,
            peer_tls=peer_tls,
            transport=self._transport,
            snapshots=self.snapshots,
            result_encoder=cmds.encode_result,
            observe_fsync=self._observe_fsync,
            observe_rtt=self._observe_rtt,
            no_space=self.disk.why,
        )
        self.caller = FSMCaller(
            self.sm,
            self.raft.committed,
            c.id,
            load_snapshot=self.snapshots.load_into_state_machine,
            after_apply=[self.snapshots.after_apply],
            after_load=[self.watches.snapshot_loaded],
            observe_apply=self._observe_apply,
            after_reopen=[self._replay_sessions],
        )
        self.snapshots.attach(self.raft)
        await self.raft.start()
        self.caller.start()
        self.leases.start()
        self.disk.start()
        sessions = self.sm.sessions
        self._session_sweeper = SessionSweeper(
            c.session_ttl_s, self._leading, sessions.oldest_use, self._expire_sessions, f"sessions-{c.id}",
            evicted=lambda: sessions.evicted, max_sessions=c.max_sessions,
        )
        self._session_sweeper.start()
        self.started_at = time.time()
        return self

    @property
    def metrics(self):
        """This node's metrics (kv.metrics.NodeMetrics: its own Prometheus registry, what
        GET /metrics serves). Made on first use: an embedded store that never reads them
        pays neither for prometheus_client nor for the observations."""
        if self._metrics is None:
            from .metrics import NodeMetrics

            self._metrics = NodeMetrics(self)
        return self._metrics

    # The lower layers' observation hooks, given at construction: they count once the
    # metrics exist (kv serve makes them at start; an embedded store maybe never).

    def _observe_fsync(self, seconds: float) -> None:
        if self._metrics is not None:
            self._metrics.fsync.observe(seconds)

    def _observe_rtt(self, peer: str, seconds: float) -> None:
        if self._metrics is not None:
            self._metrics.observe_rtt(peer, seconds)

    def _observe_apply(self, seconds: float) -> None:
        if self._metrics is not None:
            self._metrics.apply.observe(seconds)

    def _rebuild_state(self, damage: StateCorrupt) -> LevelDBStateMachine:
        """The state machine is damaged: set it aside and start an empty one, which
        _reconcile fills from the newest snapshot and the ledger — if they cover it."""
        c, ledger = self.config, self.ledger
        start = ledger.before_begin_index
        if start > 0 and self.snapshots.store.newest_valid(start) is None:
            raise StateCorrupt(
                f"{damage}. It cannot be rebuilt here: the ledger starts after index {start} and no valid snapshot "
                f"covers that. Save a snapshot from a healthy member (kv snapshot save FILE) into {c.snapshot_path} "
                "under its snapshot name, or restore this member from one; do not delete the data dir, its term and "
                "vote must be kept"
            ) from damage
        aside = f"{c.state_path}.damaged-{int(time.time())}"
        os.replace(c.state_path, aside)
        log.error("node %s: %s; moved it to %s and rebuilding from the snapshot and the ledger", c.id, damage, aside)
        return LevelDBStateMachine(c.state_path, max_read_bytes=c.max_txn_read_bytes)

    def _reconcile(self) -> None:
        """Bring ledger and state machine into agreement after a crash at any point."""
        sm, ledger = self.sm, self.ledger
        applied = sm.applied()[0]
        if sm.incomplete or applied < ledger.before_begin_index:
            # A snapshot load was cut short, or the ledger was reset to a snapshot the state
            # machine never loaded: load the newest snapshot that covers the ledger's start.
            meta = self.snapshots.newest_covering(ledger.before_begin_index)
            self.snapshots.load_into_state_machine(meta)
            applied = meta.index
        if applied > ledger.last_index():
            # Only an unclean reset can leave the log behind what was applied; everything
            # applied was committed, so the log can start over after it.
            idx, term = sm.applied()
            log.warning("node %s: ledger ends at %d, state at %d: resetting the ledger", self.config.id, ledger.last_index(), idx)
            ledger.write([LedgerWrite(reset_to=(idx, term))])

    def _stalled_on_disk(self) -> Exception | None:
        """A write (the ledger's, or the state machine's) waiting for disk space, if any."""
        return (self.raft.write_stalled if self.raft else None) or (self.caller.stalled if self.caller else None)

    def _replay_sessions(self) -> None:
        """What the plain puts after the session records' `sessions_at` did to their
        sessions (statemachine/sessions.py): read back from the ledger, which keeps every
        entry after the newest snapshot."""
        sm, ledger = self.sm, self.ledger
        lo, hi = sm.sessions_at + 1, sm.applied()[0]
        if lo <= hi and lo <= ledger.before_begin_index:
            raise StateCorrupt(
                f"the client sessions in {self.config.state_path} are recorded as of index {lo - 1}, and the ledger starts after "
                f"{ledger.before_begin_index}: restore this member from a snapshot (kv snapshot save, kv snapshot restore)"
            )
        while lo <= hi:
            batch = ledger.entries(lo, hi + 1, 8 << 20)
            sm.replay_sessions(batch)
            lo = batch[-1].index + 1

    def _force_new_cluster(self) -> None:
        """`--force-new-cluster`: the majority is lost for good, so make this member the
        only one, keeping its data (etcd's flag of that name). A CONFIG entry naming only
        this node goes at the end of its log; alone, it elects itself and commits its whole
        log, that entry included. The old members count as removed from then on (their
        connections are refused): each is added back from an empty data dir."""
        c, ledger = self.config, self.ledger
        if ledger.last_index() == 0:
            raise BadRequest(f"--force-new-cluster recovers an existing member's data, and {c.data_dir} holds none")
        old = self._membership()
        me = old.get(c.id)
        peer = c.peers.get(c.id) or (me.peer_addr if me else "")
        alone = Membership.of([Member(c.id, peer, c.advertise_url or (me.http_url if me else ""), True)])
        last = ledger.last_index()
        ledger.write([LedgerWrite(entries_from=last + 1, entries=[Entry(last + 1, ledger.term(last), EntryKind.CONFIG, alone.encode())])])
        log.warning(
            "node %s: --force-new-cluster: now the only member of a new one-member cluster, with its data up to index "
            "%d (members before: %s). Add the others back from empty data dirs (kv serve --join, or kv member add), "
            "and restart this node without the flag",
            c.id, last, ", ".join(sorted(old.ids)) or "none",
        )

    def _membership(self) -> Membership:
        stored = self.sm.membership()
        if stored:
            return Membership.decode(stored)
        if self._initial_membership is not None:
            return self._initial_membership
        c = self.config
        me_url = c.advertise_url
        return Membership.of(Member(i, addr, me_url if i == c.id else "") for i, addr in (c.peers or {c.id: ""}).items())

    async def stop(self) -> None:
        await self.leases.stop()
        if self.disk is not None:
            await self.disk.stop()
        if self._session_sweeper is not None:
            await self._session_sweeper.stop()
        if self.snapshots is not None:
            await self.snapshots.stop()  # a snapshot in progress still needs the ledger writer
        if self.raft is not None:
            await self.raft.stop()
        if self.caller is not None:
            await self.caller.stop()
        self.watches.close_all()
        if self.sm is not None:
            self.sm.close()
        if self.ledger is not None:
            self.ledger.close()
        if self._lock is not None:
            self._lock.release()

    async def __aenter__(self) -> Node:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # -- writes ----------------------------------------------------------------------------

    async def put(
        self, key: str, value: bytes, *, if_mod_index: int | None = None, if_absent: bool = False, if_exists: bool = False,
        lease: int | None = None, timeout: float | None = None, request_id: RequestId | None = None,
    ) -> WriteResult:
        """Write a value. `if_mod_index=N` writes only if the key's mod_index is N (CAS);
        `if_absent` only if the key does not exist, `if_exists` only if it does (HTTP's
        If-Match: *). Raises PreconditionFailed otherwise. `lease=ID` attaches the key to
        a lease (LeaseNotFound if there is none); a put without it detaches the key from
        the lease it had.

        Every write is applied at most once, however often it has to be sent (kv/sessions.py);
        `request_id=(session, seq)` is a caller's own session request (X-Kv-Session), else
        the node sends it in one of its own sessions."""
        return write_result(await self.submit(self.put_command(key, value, if_mod_index, if_absent, lease, if_exists), timeout, request_id=request_id))

    async def cas(self, key: str, expected_mod_index: int, value: bytes, *, timeout: float | None = None, request_id: RequestId | None = None) -> WriteResult:
        """Compare-and-set on the key's mod_index (0: the key must not exist)."""
        return await self.put(key, value, if_mod_index=expected_mod_index, timeout=timeout, request_id=request_id)

    async def delete(
        self, key: str, *, if_mod_index: int | None = None, if_exists: bool = False, timeout: float | None = None, request_id: RequestId | None = None
    ) -> DeleteResult:
        return delete_result(await self.submit(cmds.Delete(key, _cond(key, if_mod_index, False, if_exists)), timeout, request_id=request_id))

    async def delete_prefix(self, prefix: str, *, timeout: float | None = None, request_id: RequestId | None = None) -> PrefixDeleteResult:
        """Delete every key under `prefix` ("": every key) in one committed entry; watchers
        see a delete for each. `deleted`: how many there were."""
        if not isinstance(prefix, str):
            raise BadRequest(f"a prefix is a string, not {type(prefix).__name__}")
        return prefix_delete_result(await self.submit(cmds.DeletePrefix(prefix), timeout, request_id=request_id))

    async def txn(
        self, conds: Sequence[cmds.Cond] = (), ops: Sequence = (), else_ops: Sequence = (), *, timeout: float | None = None, request_id: RequestId | None = None
    ) -> TxnResult:
        """Atomically: if every condition holds run `ops`, else `else_ops`. Ops are
        kv.Put / kv.Delete / kv.Get; conditions are kv.Cond(key, kind, arg)."""
        raft = self._running()
        if raft.role != Role.LEADER and any(type(op) is cmds.Get for op in (*ops, *else_ops)):
            # What the gets would read is estimated from this node's state (the leader
            # stops reading at the limit anyway): bring it up to date first, so that a
            # write this follower has not applied yet cannot hide a huge value.
            start = raft.loop.time()
            await self.read_barrier("linearizable", timeout)
            if timeout is not None:  # one budget for both: the caller waits for the sum
                timeout -= raft.loop.time() - start
                if timeout <= 0:
                    raise NotLeader("the transaction's time ran out while this follower caught up with the leader; it was not carried out: retry shortly")
        return txn_result(await self.submit(self.txn_command(conds, ops, else_ops), timeout, request_id=request_id))

    def put_command(
        self, key: str, value: bytes, if_mod_index: int | None = None, if_absent: bool = False, lease: int | None = None, if_exists: bool = False,
    ) -> cmds.Put:
        return cmds.Put(key, self._value(value), _cond(key, if_mod_index, if_absent, if_exists), lease_id(lease) if lease is not None else 0)

    def txn_command(self, conds: Sequence[cmds.Cond], ops: Sequence, else_ops: Sequence) -> cmds.Txn:
        c = self.config
        limits.check_txn_size(conds, ops, else_ops, c.max_txn_ops)
        limit = c.max_value_bytes
        for op in (*ops, *else_ops):
            if type(op) is cmds.Put and (type(op.value) is not bytes or len(op.value) > limit):
                self._value(op.value)  # raises with the reason (or accepts a bytearray)
        limits.check_read_bytes(ops, else_ops, self._stored_size, c.max_txn_read_bytes)
        return cmds.Txn(tuple(conds), tuple(ops), tuple(else_ops))

    def _stored_size(self, key: str) -> int:
        """The size of key's value in this node's state (0 if absent), for read estimates."""
        if self.sm is None:
            return 0
        try:
            got = self.sm.get(validate_key(key))
        except StateCorrupt as e:
            raise public_error(e, fix="use another member meanwhile") from e
        return len(got[1]) if got else 0

    def _value(self, value: bytes) -> bytes:
        value = value_bytes(value)
        if len(value) > self.config.max_value_bytes:
            raise ValueTooLarge(f"value is {len(value)} bytes; the limit is {self.config.max_value_bytes} (--max-value-bytes)")
        return value

    def encode_request(self, cmd: cmds.Command | cmds.LocalCommand) -> bytes:
        """A request's command, encoded and checked against --max-request-bytes."""
        payload = encode_command(cmd)
        limits.check_request_bytes(payload, self.config.max_request_bytes)
        return payload

    async def submit(
        self, cmd: cmds.Command | cmds.LocalCommand, timeout: float | None = None, *, request_id: RequestId | None = None, resent: bool = False
    ) -> Applied:
        """Replicate a command and wait until it is applied here. A write goes in a client
        session, its caller's (`request_id`; `resent`: the caller sent it before and does
        not know how that ended) or one of this node's: then it is sent again whenever its
        outcome is unknown (a leader died, a forward was lost), until the deadline, and
        applied once."""
        try:
            payload = self.encode_request(cmd)
            raft = self._running()
            if self.disk.low and not cmds.is_local(payload):  # (the leader checks its own disk too)
                raise NoSpace(self.disk.why())
            wait = timeout if timeout is not None else self.config.write_timeout_s
            deadline = raft.loop.time() + wait
            self.counters["writes"] += 1
            if payload[1:2] not in cmds.SESSION_OPCODES:  # a lease keepalive or query, a session's opening or expiry
                return (await self._send(payload, deadline, wait))[0]
            if request_id is not None:
                session, seq = request_id
                applied, unknown = await self._send(self._in_session(session, seq, payload), deadline, wait)
                return _session_answer(applied, session, seq, unknown, resent)
            lane = self.sessions.take() or await self._new_lane(deadline, wait)
            try:
                while True:
                    seq = lane.next_seq()
                    applied, unknown = await self._send(cmds.in_session(lane.id, seq, payload), deadline, wait)
                    if type(applied.result) not in cmds.NOT_APPLIED:
                        return applied
                    if type(applied.result) is not cmds.SessionExpired or resent or unknown is not None:
                        return _session_answer(applied, lane.id, seq, unknown, resent)
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

    async def open_session(self, *, timeout: float | None = None) -> int:
        """Open a client session (for X-Kv-Session); returns its id. Its writes are applied
        at most once however often they are sent; it closes after --session-ttl-s unused."""
        raft = self._running()
        wait = timeout if timeout is not None else self.config.write_timeout_s
        return await self._open_session(raft.loop.time() + wait, wait)  # a new one: never one of the node's own

    def propose_now(self, slots: Sequence) -> None:
        """kv.open's write path, on the event loop: propose writes encoded by
        encode_request at once (one Ready, one fsync for all), each as the next request of
        a session from this node's pool, resolving each slot (a kv.raft.node.Waiter with
        `.payload`, and `.rid` and `.lane` set here) when it is applied. A slot that cannot
        go this way (no free session, no leader here) is given up (`slot.give_up()`): its
        caller takes submit(), with the slot's request id if it has one."""
        raft = self.raft
        if raft is None or raft.role != Role.LEADER:
            for s in slots:
                s.give_up()
            return
        items = []
        for s in slots:
            s.lane = lane = self.sessions.take()
            if lane is None:
                s.give_up()
                continue
            s.rid = rid = RequestId(lane.id, lane.next_seq())
            items.append((EntryKind.NORMAL, cmds.in_session(rid.session, rid.seq, s.payload), s))
        if not items:
            return
        try:
            raft.propose_waiters(items, raft.loop.time() + self.config.write_timeout_s)
        except Exception:  # nothing was appended
            for *_, s in items:
                s.give_up()

    async def _new_lane(self, deadline: float, wait: float):
        try:
            return await self.sessions.acquire(deadline, wait)
        except Timeout as e:
            raise NotLeader(f"no client session could be opened for the write in time ({e}); it was not carried out: retry shortly") from e

    async def _open_session(self, deadline: float, wait: float) -> int:
        session = new_session_id()
        applied, _ = await self._send(encode_command(cmds.SessionOpen(session, self.config.max_sessions)), deadline, wait)
        if type(applied.result) is not cmds.SessionOpened:
            raise Unavailable(f"opening client session {session} failed: {applied.result!r}")
        return session

    def _leading(self) -> tuple[bool, int, int]:
        m = self.raft.metrics()
        return m.role == Role.LEADER, m.term, m.ledger_end_index

    async def _expire_sessions(self, upto: int, term: int) -> None:
        await self.propose_as_leader(cmds.SessionsExpire(upto), term)

    async def propose_as_leader(self, cmd: cmds.Command, term: int) -> Applied | None:
        """The leader's own housekeeping, decided on its clock while it led in `term` (a
        lease's or a session's expiry): proposed only while this node still leads in that
        term, and never forwarded. A leader paused past its followers' election timeout
        wakes up believing every lease has expired: forwarded to the new leader, its
        revokes deleted leases that were being kept alive. Proposed in the old term, they
        can never commit. Returns None when it no longer leads in that term; raises like
        submit when the entry's fate is unknown."""
        raft = self._running()
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
        raft = self._running()
        unknown: Exception | None = None
        while True:
            sent = False  # whether this copy may have reached a leader's log
            try:
                if raft.role == Role.LEADER and cmds.is_local(payload):
                    return Applied(raft.applied_index, raft.term, await self.leases.answer(cmds.decode(payload))), unknown
                if raft.role == Role.LEADER:
                    fut = raft.loop.create_future()
                    raft.propose_waiters(((EntryKind.NORMAL, payload, fut),), deadline)
                    sent = True
                    t0 = time.perf_counter()
                    applied = await fut
                    if self._metrics is not None and payload[1] == cmds.OP_IN_SESSION:  # a write's
                        self._metrics.commit_latency.observe(time.perf_counter() - t0)
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
                await self._await_leader(deadline, e, unknown, force_wait=isinstance(e, TransferInProgress))
                continue
            except DeadlineExceeded as e:
                raise _unknown_outcome(e, wait) from e
            except NodeStopped as e:  # this node stops: no copy goes out any more
                if sent and not isinstance(e, NeverCommitted):
                    raise _unknown_outcome(e, wait) from e
                if unknown is not None:
                    raise _unknown_outcome(unknown, wait) from e
                raise public_error(e) from e
            except OutcomeUnknown as e:
                unknown = e  # the leader it went to was replaced: send it to the next one
                self.counters["writes_resent"] += 1
                await self._await_leader(deadline, e, unknown)
                continue
            except (Overloaded, NoSpace) as e:  # refused before anything was appended
                if unknown is not None:
                    raise _unknown_outcome(unknown, wait) from e
                raise public_error(e) from e
            if resp.code == ForwardCode.OK:
                return Applied(resp.index, resp.term, cmds.decode_result(resp.payload)), unknown
            if resp.code in (ForwardCode.NOT_LEADER, ForwardCode.TRANSFERRING):
                await self._await_leader(deadline, NotLeader(resp.payload.decode()), unknown, force_wait=True)
                continue
            if resp.code == ForwardCode.NO_SPACE:
                if unknown is not None:
                    raise _unknown_outcome(unknown, wait)
                raise NoSpace(f"the leader refuses writes: {resp.payload.decode()}")
            if resp.code == ForwardCode.STOPPED:  # the leader could not tell how it ended
                unknown = OutcomeUnknown(f"the leader could not confirm the write: {resp.payload.decode()}")
                self.counters["writes_resent"] += 1
                await self._await_leader(deadline, unknown, unknown, force_wait=True)
                continue
            if unknown is not None:
                raise _unknown_outcome(unknown, wait)
            raise Unavailable(resp.payload.decode())

    def _serve_local(self, payload: bytes):
        """What the leader answers for a follower without logging it (see kv/leases.py)."""
        return self._answer_local(payload) if cmds.is_local(payload) else None

    async def _answer_local(self, payload: bytes) -> bytes:
        try:
            return cmds.encode_result(await self.leases.answer(cmds.decode(payload)))
        except KVError as e:  # no quorum to confirm the leadership: the follower retries
            raise NotLeader(str(e)) from e

    async def _await_leader(self, deadline: float, cause: Exception, unknown: Exception | None = None, force_wait: bool = False) -> None:
        """Wait for a (new) leader. Once the deadline has passed, raise NotLeader (the
        request was not carried out: nothing was proposed too late for its caller to hear
        how it ended), or Timeout if an earlier copy's outcome is `unknown`."""
        raft = self.raft
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
                raise _unknown_outcome(unknown, 0.0)
            why = "none is known, and one needs a majority of the members up and in touch: see kv status" if raft.leader_id is None else cause
            raise NotLeader(f"no leader could take the request in time ({why}); it was not carried out: retry shortly", raft.leader_id)

    def _running(self) -> RaftNode:
        if self.raft is None:
            raise Unavailable("the node is not started: call await node.start() first")
        if self.raft.failure is not None:
            raise Unavailable(f"the node stopped after an error: {self.raft.failure}")
        return self.raft

    # -- waiting for the cluster -------------------------------------------------------------

    async def wait_applied(self, index: int, *, timeout: float | None = None) -> None:
        """Return once this node has applied `index` (a write's `.index`): a stale read
        here sees that write from then on. Raises Timeout after `timeout` seconds."""
        raft = self._running()
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        try:
            await raft.wait_applied(index, deadline)
        except DeadlineExceeded:
            raise Timeout(f"{raft.id} did not apply index {index} within {timeout}s (it applied {raft.applied_index})") from None
        except NodeStopped as e:
            raise Unavailable(str(e)) from e

    async def wait_leader(self, *, timeout: float | None = None) -> str:
        """The leader's id, once this node knows one; on the leader itself, once it has
        committed an entry of its own term (until then its commit index may lag). Raises
        Timeout after `timeout` seconds."""
        raft = self._running()
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

    # -- reads -----------------------------------------------------------------------------

    async def read_barrier(self, consistency: str = "linearizable", timeout: float | None = None) -> int:
        """Wait until a local read is as fresh as `consistency` asks; returns the index
        this node has applied. stale: at once; lease: the leader's lease; linearizable: a
        read index confirmed by a majority (Raft thesis §6.4)."""
        if consistency not in CONSISTENCY:
            raise BadRequest(f"consistency must be one of {', '.join(CONSISTENCY)}, not {consistency!r}")
        raft = self._running()
        if consistency == "stale":
            return raft.applied_index
        deadline = raft.loop.time() + (timeout if timeout is not None else self.config.read_timeout_s)
        self.counters["read_barriers"] += 1
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
                    await self._await_leader(deadline, e, force_wait=raft.leader_id is not None)
                except NotLeader as nl:
                    raise NoQuorum(str(nl), raft.leader_id) from None
            except NodeStopped as e:
                raise public_error(e) from e

    async def get(self, key: str, *, consistency: str = "linearizable", timeout: float | None = None) -> Item | None:
        return (await self.get_at(key, consistency=consistency, timeout=timeout))[0]

    async def get_at(self, key: str, *, consistency: str = "linearizable", timeout: float | None = None) -> tuple[Item | None, int]:
        """get, and the applied index the read was at."""
        validate_key(key)
        index = await self.read_barrier(consistency, timeout)
        try:
            got = self.sm.get(key)  # no await since the barrier: the state is at `index`
        except StateCorrupt as e:
            raise public_error(e) from e
        return (Item(key, got[1], got[0]) if got else None), index

    def scan(self, prefix: str = "", *, after: str | None = None, limit: int | None = None, consistency: str = "linearizable", timeout: float | None = None, page: int = 1000) -> Scan:
        """Every key under a prefix in key order (strictly after `after`; at most `limit`):
        `await node.scan(p)` gives a list, `async for item in node.scan(p)` streams pages.
        The first page waits for `consistency`; the ones after it read on from there."""
        barrier = [consistency]

        async def fetch(after: str | None, n: int) -> tuple[list[Item], bool]:
            if barrier:
                await self.read_barrier(barrier.pop(), timeout)
            self._running()
            try:
                rows = self.sm.scan(prefix, after, n)
            except StateCorrupt as e:
                raise public_error(e) from e
            return [Item(k, v, m) for k, v, m in rows], len(rows) == n

        return Scan(fetch, after=after, limit=limit, page=page)

    async def scan_page(self, prefix: str = "", *, after: str | None = None, limit: int = 1000, consistency: str = "linearizable", timeout: float | None = None) -> Page:
        """scan, and the applied index the page was read at (list, then watch from index + 1)."""
        if limit <= 0:
            raise BadRequest("limit must be positive")
        index = await self.read_barrier(consistency, timeout)
        try:
            return Page([Item(k, v, m) for k, v, m in self.sm.scan(prefix, after, limit)], index)
        except StateCorrupt as e:
            raise public_error(e) from e

    async def put_many(self, items: dict[str, bytes] | Sequence[tuple[str, bytes]], *, timeout: float | None = None) -> TxnResult:
        """Write many keys in one atomic transaction (at most --max-txn-ops keys, and
        --max-request-bytes encoded: split a larger batch, or use kv.bulk)."""
        pairs = items.items() if isinstance(items, dict) else items
        return await self.txn(ops=[cmds.Put(k, v) for k, v in pairs], timeout=timeout)

    # -- leases ----------------------------------------------------------------------------

    def lease(self, ttl: float, *, on_lost=None) -> AsyncLease:
        """A lease that keeps itself alive until revoked: `async with node.lease(10) as l`
        or `l = await node.lease(10)`; see kv.coordination.AsyncLease."""
        return AsyncLease(self, ttl, on_lost=on_lost)

    def lock(self, name: str, *, ttl: float = 10, timeout: float | None = None, on_lost=None) -> AsyncLock:
        """Mutual exclusion across processes, FIFO: `async with node.lock("jobs"):`;
        on_lost(error) is called if the lock is lost while held."""
        return AsyncLock(self, name, ttl=ttl, timeout=timeout, on_lost=on_lost)

    def election(self, name: str, *, ttl: float = 10, on_lost=None) -> AsyncElection:
        """Leader election: campaign(value), leader(), observe(), resign(); on_lost(error)
        is called if a leadership won is lost."""
        return AsyncElection(self, name, ttl=ttl, on_lost=on_lost)

    async def lease_grant(
        self, ttl: float, *, owner: str = "", timeout: float | None = None, request_id: RequestId | None = None
    ) -> LeaseStatus:
        """A new lease of `ttl` seconds (more than 0, at most a year); keep it alive with
        lease_keepalive (or use `lease()`, which does), attach keys with put(lease=...).
        Its id is random (nobody can guess another's); `owner`: the key prefix of the token
        that asks (see lease_scope)."""
        ms = ttl_ms(ttl)
        while True:
            # A caller's request is sent again, perhaps through another node, as the very same
            # command: its id comes from the request's, unguessable as the session's is.
            lease = _lease_of(request_id) if request_id is not None else secrets.randbelow(cmds.MAX_LEASE_ID) + 1
            r = (await self.submit(cmds.LeaseGrant(ms, lease, owner), timeout, request_id=request_id)).result
            if type(r) is not cmds.CommandError or request_id is not None or "in use" not in str(r):
                return lease_status(_raise_failed(r))

    def lease_scope(self, lease: int) -> tuple[str, tuple[str, ...]] | None:
        """(the key prefix of the token that granted it, its keys) as this node has applied
        them, or None for no such lease here: what decides whether a token scoped to a
        prefix may see the lease (http/auth.py)."""
        sm = self.sm
        if sm is None or lease not in sm.leases.ttl_ms:
            return None
        return sm.leases.owner.get(lease, ""), tuple(sm.leases.keys[lease])

    async def lease_keepalive(self, lease: int, *, timeout: float | None = None) -> LeaseStatus:
        """Renew a lease to its full ttl (LeaseNotFound once it expired or was revoked)."""
        return lease_status(_raise_failed((await self.submit(cmds.LeaseKeepAlive(lease_id(lease)), timeout)).result))

    async def lease_keepalives(self, leases: Sequence[int], *, timeout: float | None = None) -> list[LeaseStatus | None]:
        """Renew several leases in one round (one read barrier on the leader): for each,
        in order, its LeaseStatus, or None if it expired or was revoked. At most
        MAX_KEEPALIVES (10,000) at once; what AsyncLease's keepalives go through."""
        ids = tuple(lease_id(x) for x in leases)
        if not 0 < len(ids) <= cmds.MAX_KEEPALIVES:
            raise BadRequest(f"renew 1 to {cmds.MAX_KEEPALIVES} leases at once, not {len(ids)}")
        unique = tuple(dict.fromkeys(ids))  # a lease named twice is renewed once
        r = _raise_failed((await self.submit(cmds.LeaseKeepAlives(unique), timeout)).result)
        renewed = {x.lease: lease_status(x) if type(x) is cmds.LeaseInfo else None for x in r.leases}
        return [renewed[i] for i in ids]

    async def lease_revoke(self, lease: int, *, timeout: float | None = None, request_id: RequestId | None = None) -> RevokeResult:
        """End a lease now; its keys are deleted in the same committed entry."""
        r = _raise_failed((await self.submit(cmds.LeaseRevoke(lease_id(lease)), timeout, request_id=request_id)).result)
        return RevokeResult(r.index, r.keys)

    async def lease_info(self, lease: int, *, timeout: float | None = None) -> LeaseStatus:
        """A lease's ttl, the seconds it has left (on the leader's clock) and its keys."""
        return lease_status(_raise_failed((await self.submit(cmds.LeaseQuery(lease_id(lease)), timeout)).result))

    async def lease_list(self, *, timeout: float | None = None) -> list[LeaseStatus]:
        """Every live lease (without its keys)."""
        r = (await self.submit(cmds.LeaseQuery(0), timeout)).result
        return [lease_status(x) for x in r.leases]

    # -- watch -----------------------------------------------------------------------------

    def watch(self, prefix: str = "", start_index: int | None = None, *, buffer_bytes: int | None = None, resume_when_behind: bool = True) -> Watch:
        """Every change under prefix in commit order, from start_index (default: the next
        one applied), as far back as this node's ledger goes; older raises WatchCompacted:
        scan_page the prefix, then watch from its index + 1. A watch more than buffer_bytes
        behind the live changes reads on from the ledger (resume_when_behind), or ends with
        SlowWatcher (for a stream whose client resumes)."""
        self._running()
        if start_index is not None and (type(start_index) is not int or start_index < 1):
            raise BadRequest(f"start_index must be a log index (an integer >= 1), not {start_index!r}")
        size = buffer_bytes if buffer_bytes is not None else self.config.watch_buffer_bytes
        return self.watches.open(prefix, start_index, size, resume_when_behind)

    # -- the committed log -----------------------------------------------------------------

    def log_range(self) -> tuple[int, int]:
        """(first, last): the indexes of the committed entries this node's ledger still
        holds (last is its applied index; first - 1 is ledgerBeforeBeginIndex)."""
        raft = self._running()
        return raft.log_range()

    def log_entries(self, lo: int, hi: int, max_bytes: int = 1 << 20):
        """Committed entries [lo, hi) (hi clipped to the applied index), about max_bytes."""
        first, last = self.log_range()
        if lo < first:
            raise Compacted(
                f"entries up to index {first - 1} were compacted into a snapshot; this node holds the "
                f"log from {first} (export the snapshot for the state before it)"
            )
        return self._running().entries(lo, min(hi, last + 1), max_bytes)

    # -- administration --------------------------------------------------------------------

    async def take_snapshot(self, *, timeout: float | None = None) -> tuple[object, int]:
        """A snapshot that holds every write acknowledged before the call, on any member:
        first a linearizable read barrier (a follower catches up with the leader's commit
        index, as a read does), then a snapshot of everything applied (snapshot.manager's
        take). Returns (the snapshot file's info, the commit index the barrier waited for)."""
        index = await self.read_barrier("linearizable", timeout)
        return await self.snapshots.take(), index

    async def transfer_leadership(self, to: str, *, timeout: float | None = None) -> str:
        """Hand leadership to member `to` (it is caught up first; writes are refused while
        the transfer runs). Returns the leader afterwards. Raises NotLeader on a follower."""
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
                raise Timeout(f"leadership did not move to {to} in time; the leader is {raft.leader_id}")
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                await asyncio.wait_for(raft.leader_changed.wait(), left)
        return to

    async def hand_over_leadership(self, *, timeout: float | None = None) -> str | None:
        """Before a clean stop of the leader: hand leadership to the most caught-up voter,
        so that writes go on at once instead of after an election timeout (etcd does the
        same). Returns the new leader, or None: not the leader, no other voter, or the
        transfer did not finish within `timeout` (default: two election timeouts)."""
        raft = self.raft
        if raft is None or raft.failure is not None or raft.role != Role.LEADER:
            return None
        peers = raft.metrics().peers
        voters = [(p.match, pid) for pid, p in peers.items() if pid in raft.membership.voters]
        if not voters:
            return None
        _, to = max(voters)
        try:
            return await self.transfer_leadership(to, timeout=timeout if timeout is not None else 2 * self.config.election_timeout_ms / 1000)
        except KVError as e:
            log.info("node %s: leadership was not handed to %s before stopping (%s)", self.config.id, to, e)
            return None

    # -- membership ------------------------------------------------------------------------

    async def add_member(self, member_id: str, peer: str, http: str = "", *, voter: bool = False, replace: bool = False, timeout: float | None = None) -> list[dict]:
        """Add a member that listens for peers on `peer`. It always joins as a learner;
        with voter=True the leader promotes it once it has caught up (a voter that cannot
        be reached would count against the quorum). With replace=True an existing member's
        addresses change (a node moved)."""
        if not member_id or any(ch in member_id for ch in ",= /"):
            raise BadRequest(f"bad member id {member_id!r}: a non-empty name without ',', '=', ' ' or '/'")
        check_hostport(peer, f"member {member_id}")
        cur = self._running().membership
        old = cur.get(member_id)
        if old is not None and not replace:
            if (old.peer_addr, old.http_url) == (peer, http) and (not voter or old.voter or old.promote):
                return self.members()  # asked again for what is already so
            raise MemberExists(f"{member_id} is already a member (at {old.peer_addr}); remove it first, or replace its addresses")
        if old is None and replace:
            raise NotFound(f"{member_id} is not a member; add it instead")
        if old is None:
            new = Member(member_id, peer, http, voter=False, promote=voter)
        else:
            new = Member(member_id, peer, http, old.voter, old.promote)
        await self._change(cur.with_member(new), timeout)
        return self.members()

    async def remove_member(self, member_id: str, *, timeout: float | None = None) -> list[dict]:
        cur = self._running().membership
        if member_id not in cur:
            raise NotFound(f"{member_id} is not a member; members: {', '.join(sorted(cur.ids))}")
        if cur.voters == {member_id}:
            raise BadRequest(f"{member_id} is the last voter; add another voter before removing it")
        await self._change(cur.without(member_id), timeout)
        return self.members()

    async def promote_member(self, member_id: str, *, timeout: float | None = None) -> list[dict]:
        """Make a learner a voter (refused with Conflict until it has caught up)."""
        cur = self._running().membership
        m = cur.get(member_id)
        if m is None:
            raise NotFound(f"{member_id} is not a member; add it as a learner first")
        if m.voter:
            return self.members()
        await self._change(cur.with_member(Member(m.id, m.peer_addr, m.http_url, True)), timeout)
        return self.members()

    async def _change(self, new: Membership, timeout: float | None) -> None:
        raft = self._running()
        if raft.role != Role.LEADER:
            raise NotLeader("membership changes are made by the leader", raft.leader_id)
        deadline = asyncio.get_running_loop().time() + (timeout if timeout is not None else self.config.write_timeout_s)
        try:
            await raft.change_membership(new, deadline)
        except (ConfigChangeRefused, TransferInProgress) as e:
            raise public_error(e) from None
        except (OutcomeUnknown, NodeStopped) as e:
            raise public_error(e, written=True, wait=self.config.write_timeout_s) from e

    def members(self) -> list[dict]:
        raft = self._running()
        leader = raft.leader_id
        out = []
        for m in sorted(raft.membership.members.values(), key=lambda m: m.id):
            d = {"id": m.id, "peer": m.peer_addr, "http": m.http_url or raft.peer_url(m.id), "voter": m.voter}
            if m.id == raft.id:
                d["http"] = self.config.advertise_url
            d["leader"] = m.id == leader
            if m.promote:
                d["promote"] = True  # a learner the leader promotes once it has caught up
            out.append(d)
        return out

    def leader_url(self) -> str | None:
        """The leader's client URL, if this node knows it."""
        return self._running().leader_url()

    # -- status ----------------------------------------------------------------------------

    def status(self) -> dict:
        """This node's own view (never forwarded): the fields of GET /v1/status."""
        raft = self._running() if self.raft is not None else None
        if raft is None:
            return {"id": self.config.id, "role": "stopped"}
        r = raft.metrics()
        snap = self.snapshots.newest_meta() if self.snapshots else None
        return {
            "id": self.config.id,
            "role": r.role.label,
            "term": r.term,
            "leader": r.leader,
            "commit_index": r.commit_index,
            "applied_index": r.applied_index,
            "ledger_begin_index": r.ledger_begin_index,
            "ledger_end_index": r.ledger_end_index,
            "snapshot_index": snap.index if snap else 0,
            "alarms": self.disk.alarms(),
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


class _SnapshotHost:
    """The node as the snapshot layer sees it (snapshot.manager.SnapshotHost). The state
    machine is read late: it is opened (or rebuilt) after the manager is made."""

    def __init__(self, node: Node) -> None:
        c = node.config
        self.node = node
        self.node_id, self.group = c.id, c.group
        self.snapshot_threshold, self.snapshot_trailing = c.snapshot_threshold, c.snapshot_trailing

    def capture(self):
        return self.node.sm.capture()

    def sync_state(self) -> None:
        self.node.sm.sync()

    def forget_effects(self, index: int) -> None:
        self.node.sm.forget_effects(index)

    def load_state(self, index: int, term: int, membership: bytes, records) -> int:
        return self.node.sm.restore(index, term, membership, records)


def public_error(e: KVError, *, written: bool = False, wait: float = 0.0, fix: str = "read from another member meanwhile") -> KVError:
    """The one place where the layers' own errors become the public ones of kv/errors.py.
    `written`: the request may have been appended, so a stop or a missed deadline leaves its
    outcome unknown (Timeout) rather than refused (Unavailable); `fix`: what a reader of a
    damaged state machine should do."""
    if written and isinstance(e, (OutcomeUnknown, NodeStopped)):
        return _unknown_outcome(e, wait)
    if isinstance(e, (Overloaded, NodeStopped)):
        return Unavailable(str(e))
    if isinstance(e, (ConfigChangeRefused, TransferInProgress)):
        return Conflict(str(e))
    if isinstance(e, cmds.CommandError):
        return BadRequest(str(e))
    if isinstance(e, StateCorrupt):
        return Unavailable(f"{e}; {fix}")
    return e


def _session_answer(applied: Applied, session: int, seq: int, unknown: Exception | None, resent: bool) -> Applied:
    """A session request's answer, or the error that says why it was not applied."""
    r = applied.result
    if type(r) is cmds.SessionExpired:
        if resent or unknown is not None:  # an earlier copy may have been applied before it closed
            raise Timeout(
                f"the write was sent again after its outcome was unknown ({unknown or 'the caller resent it'}), and by then its "
                f"session {session} had closed (idle longer than --session-ttl-s, or evicted beyond --max-sessions): "
                "the first copy may or may not have been applied; read the key before retrying"
            )
        raise SessionExpired(session)
    if type(r) is cmds.StaleRequest:
        raise Conflict(
            f"request {r.seq} of session {r.session} is numbered below its last one ({r.last_seq}), and was not applied: "
            "a session carries one request at a time, numbered upwards (a copy of the last one gets its answer again)"
        )
    if type(r) is cmds.RequestMismatch:
        raise Conflict(
            f"request {r.seq} of session {r.session} was a different write, applied before; this one was not applied: "
            "number each new write with the next number (the same number is for sending the same write again)"
        )
    return applied


def encode_command(cmd: cmds.Command) -> bytes:
    try:
        return cmds.encode(cmd)
    except cmds.CommandError as e:
        raise public_error(e) from e


def _unknown_outcome(e: Exception, wait: float) -> Timeout:
    """The error for a write whose outcome cannot be known any more."""
    if isinstance(e, DeadlineExceeded):
        return Timeout(f"the write was not confirmed within {wait:.1f}s; it may or may not have been committed: read the key before retrying")
    if isinstance(e, OutcomeUnknown):
        return Timeout(f"{e}: read the key before retrying")
    return Timeout(f"the node stopped before the write was confirmed; it may or may not have been committed ({e})")


def ttl_ms(ttl: float) -> int:
    """A lease ttl in seconds, checked, as whole milliseconds."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl != ttl:
        raise BadRequest(f"a lease's ttl is a number of seconds, not {ttl!r}")
    # The range first: round() overflows on inf and 1e308.
    if not 0 < ttl * 1000 <= cmds.MAX_TTL_MS or round(ttl * 1000) == 0:
        raise BadRequest(f"a lease's ttl is more than 0 and at most a year ({cmds.MAX_TTL_MS // 1000} s), not {ttl!r}")
    return round(ttl * 1000)


def value_bytes(value) -> bytes:
    """A value as bytes: bytes, bytearray or memoryview; anything else is refused (bytes(5)
    would be five NUL bytes, and a str has no one right encoding)."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise BadRequest(f"values are bytes, not {type(value).__name__}: encode it first")
    return bytes(value)


def lease_id(lease) -> int:
    """A lease id, from an int or anything with an `.id` (a Lease)."""
    lid = getattr(lease, "id", lease)
    if isinstance(lid, bool) or not isinstance(lid, int) or not 0 < lid < 1 << 63:
        raise BadRequest(f"a lease id is a positive integer, not {lid!r}")
    return lid


def _lease_of(request_id: RequestId) -> int:
    """The lease id a caller's grant request (session, seq) gets, the same on every node."""
    digest = hashlib.blake2b(b"lease/%d/%d" % tuple(request_id), digest_size=8).digest()
    return int.from_bytes(digest, "big") % cmds.MAX_LEASE_ID + 1


def lease_status(r: cmds.LeaseInfo) -> LeaseStatus:
    return LeaseStatus(r.lease, r.ttl_ms / 1000, r.remaining_ms / 1000, r.keys)


def _raise_failed(result):
    if isinstance(result, cmds.NoSuchLease):
        raise LeaseNotFound(result.lease)
    if isinstance(result, cmds.ConditionFailed):
        raise PreconditionFailed(result.key, result.mod_index)
    if isinstance(result, cmds.CommandError):
        raise public_error(result)
    return result


def prefix_delete_result(applied: Applied) -> PrefixDeleteResult:
    r = _raise_failed(applied.result)
    return PrefixDeleteResult(r.index, applied.term, len(r.keys))


def write_result(applied: Applied) -> WriteResult:
    return WriteResult(_raise_failed(applied.result).index, applied.term)


def delete_result(applied: Applied) -> DeleteResult:
    r = _raise_failed(applied.result)
    return DeleteResult(r.index, applied.term, r.deleted)


def txn_result(applied: Applied) -> TxnResult:
    r = _raise_failed(applied.result)
    out = []
    written = WriteResult(r.index, applied.term)  # every put of a txn has the txn's index
    omitted = []
    for x in r.results:
        if isinstance(x, cmds.PutResult):
            out.append(written)
        elif isinstance(x, cmds.DeleteApplied):
            out.append(DeleteResult(x.index, applied.term, x.deleted))
        elif isinstance(x, cmds.GetOmitted):
            omitted.append(x.key)
            out.append(None)
        else:
            out.append(Item(x.key, x.value, x.mod_index) if x.value is not None else None)
    if omitted:
        raise ReadsOmitted(r.index, applied.term, r.succeeded, tuple(out), omitted)
    return TxnResult(r.index, applied.term, r.succeeded, tuple(out))


def validate_key(key: str) -> str:
    """Raise BadRequest unless key is a non-empty UTF-8 string within the length limit."""
    try:
        cmds.check_key(key)
    except cmds.CommandError as e:
        raise public_error(e) from None
    return key


def _cond(key: str, if_mod_index: int | None, if_absent: bool, if_exists: bool = False) -> cmds.Cond | None:
    if if_absent + if_exists + (if_mod_index is not None) > 1:
        raise BadRequest("give at most one of if_mod_index, if_absent and if_exists")
    if if_exists:
        return cmds.Cond(key, "exists", True)
    if if_absent:
        return cmds.Cond(key, "mod", 0)
    if if_mod_index is not None:
        if if_mod_index < 0:
            raise BadRequest("if_mod_index must be >= 0")
        return cmds.Cond(key, "mod", int(if_mod_index))
    return None
