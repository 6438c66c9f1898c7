"""kv.Node: a cluster member in-process — the replicated log, the state machine, snapshots
and the store API, wired together. `kv serve` runs one of these behind the HTTP API.

The machinery is in kv/server/: recovery.py opens the state, writes.py is the write path,
lessor.py the lease clock, watch.py the watch hub, members.py membership administration,
metrics.py what GET /metrics reads. This module wires them and holds the store API."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import secrets
import time
from collections.abc import Hashable, Iterable, Sequence

from .common.results import BulkResult, DeleteResult, Item, LeaseStatus, Page, PrefixDeleteResult, RevokeResult, TxnResult, WriteResult
from .common.arguments import lease_id, ttl_ms
from .common.etcd_ids import etcd_id
from .common.scan import Scan
from .common.sessions import RequestId
from .common.wire import BulkBody, bulk_body
from .client.recipes import AsyncRecipes
from .errors import BadRequest, Compacted, Forbidden, FutureRevision, KeyNotFound, KVError, LeaseExists, NotLeader, RevisionCompacted, Unavailable
from .raft.ledger import Ledger
from .raft.membership import Membership
from .raft.messages import Role
from .raft.node import Applied, CoreConfig, NodeStopped, RaftNode
from .raft.transport_protocol import Transport
from .server import eventlog, layer_metrics, limits, reads, tls
from .server.answers import (
    bulk_result,
    condition,
    delete_result,
    lease_status,
    prefix_delete_result,
    public_error,
    raise_failed,
    txn_result,
    validate_key,
    write_result,
)
from .server.config import NodeConfig
from .server.datadir import DataDirLock
from .server.join import Joined
from .server.members import Members
from .server.diskguard import DiskGuard
from .server.exports import PinnedViews
from .server.lessor import LeaseClock, granted_id
from .server.recovery import Recovery
from .server.compactor import Compactor
from .server.session_sweeper import SessionSweeper
from .server.snapshot_host import SnapshotHost
from .server.watch import Watch, WatchHub
from .server.writes import Writer
from .common.sessions import Slot
from .statemachine import commands as cmds
from .statemachine.caller import FSMCaller
from .statemachine.leveldb import LevelDBStateMachine, StateUnreadable

SESSIONS_PER_OWNER = 10_000  # open sessions one token may hold, of those opened through one node (open_session)


class Node(AsyncRecipes):
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
        joined: Joined | None = None,
        data_dir_lock: DataDirLock | None = None,
        transport: Transport | None = None,
        **options,
    ) -> None:
        self.config = c = config if config is not None else NodeConfig(**options)
        # The data dir's lock, if the caller took it already (kv serve does, before it
        # looks into the directory); the node releases it when it stops.
        self._lock = data_dir_lock
        # A node that joins a running cluster starts from what the cluster gave it (join.py).
        self._joined = joined
        self._transport = transport
        self.raft: RaftNode | None = None
        self.sm: LevelDBStateMachine | None = None
        self.ledger: Ledger | None = None
        self.caller: FSMCaller | None = None
        self.snapshots = None  # snapshot.manager.SnapshotManager, set in start()
        self.exports = PinnedViews(lambda: self.sm.capture(), self.read_barrier)  # views pinned for exports (kv/server/exports.py)
        self.writer: Writer | None = None  # the write path (kv/server/writes.py), made in start()
        self.disk: DiskGuard | None = None  # the free-space reserve (kv/server/diskguard.py), made in start()
        self.counters = collections.Counter()
        self._session_owners: dict[Hashable, set[int]] = {}  # owner -> the sessions opened for it here (open_session)
        self._sessions_opening: collections.Counter[Hashable] = collections.Counter()  # owner -> those being opened
        self.leases = LeaseClock(f"leases-{c.id}", self._leading, lambda: self.sm.leases, self._propose_as_leader, self.read_barrier)
        self.watches = WatchHub(
            c.watch_budget_bytes, lambda: self.sm.applied()[0], self.log_range,
            lambda start, prefix, n: self.sm.history_changes(start, prefix, n), lambda: self.sm.watch_floor(), self._want_rich_changes,
        )
        self._members = Members(c, self._running)
        self._session_sweeper: SessionSweeper | None = None
        self._compactor: Compactor | None = None
        self.started_at = 0.0
        self._metrics = None  # kv.server.metrics.NodeMetrics, made on first use (see metrics)

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
        eventlog.guard("kv.raft.transport")  # strangers on the peer port must not flood the log
        self.ledger = Ledger(c.ledger_path, c.id, c.group, map_size=c.ledger_map_size, sync=c.fsync, ledger_id=joined.ledger_id if (joined := self._joined) else None)
        self.disk = DiskGuard(c.data_dir, c.min_free_bytes, c.id, stalled=self._stalled_on_disk)
        self.disk.check()
        # The state machine the snapshots are taken from and loaded into: while the node
        # starts, the one recovery opens (it may load a snapshot into it), then the node's.
        host = SnapshotHost(c, lambda: self.sm if self.sm is not None else recovery.sm)
        self.snapshots = SnapshotManager(host, c.snapshot_path, keep=c.snapshot_keep)
        recovery = Recovery(c, self.ledger, self.snapshots, self._joined)
        self.sm, membership = await asyncio.get_running_loop().run_in_executor(None, recovery.open)
        self.sm.on_changes = self.watches.publish
        self.raft = RaftNode(
            CoreConfig(
                node_id=c.id,
                heartbeat_ms=c.heartbeat_ms,
                election_timeout_ms=c.election_timeout_ms,
                push_timeout_ms=max(1000.0, c.election_timeout_ms),
                append_hold_ms=c.append_hold_ms,
            ),
            self.ledger,
            membership,
            group=c.group,
            listen=c.peers.get(c.id),
            secret=c.cluster_secret,
            advertise_url=c.advertise_url,
            applied_index=self.sm.applied()[0],
            refuse_peer=lambda peer: peer in self.sm.removed(),
            dial=c.peers,
            serve_local=self.leases.serve_local,
            peer_tls=peer_tls,
            transport=self._transport,
            snapshots=self.snapshots,
            result_encoder=cmds.encode_result,
            observe_fsync=self._observe("fsync"),
            observe_rtt=lambda peer, seconds: self._metrics is not None and self._metrics.observe_rtt(peer, seconds),
            no_space=self.disk.admit,
            cluster_id=lambda: self.sm.cluster_id,
            # A new cluster's identity is in its first entry, the first leader's no-op: every
            # founding node offers one of its own (statemachine/leveldb.py _noop).
            noop_data=cmds.encode(cmds.ClusterId(secrets.token_hex(8))) if self.ledger.last_index() == 0 and not self.sm.cluster_id else b"",
            level=cmds.COMMAND_LEVEL,
            membership_index=self.sm.membership_index,
        )
        self.writer = Writer(
            c, self.raft, self.disk, self.leases.answer, self.counters, self._observe("commit_latency"),
            alarms=lambda: self.sm.nospace, owned_sessions=lambda: self.raft.peers_apply(cmds.OWNED_SESSIONS),
        )
        self.caller = FSMCaller(
            self.sm,
            self.raft.committed,
            c.id,
            load_snapshot=self.snapshots.load_into_state_machine,
            after_apply=[self.snapshots.after_apply],
            after_load=[self.watches.snapshot_loaded, self.snapshots.resume],
            observe_apply=self._observe("apply"),
            after_reopen=[recovery.replay_sessions, self.snapshots.resume],
            # (the snapshot being written first: an export opened while it is waited for is drained next)
            before_close=[self.snapshots.quiesce, self.exports.drain],
        )
        await self.raft.start()
        self.caller.start()
        self.leases.start()
        self.disk.start()
        sessions = self.sm.sessions
        self._session_sweeper = SessionSweeper(
            c.session_ttl_s, self.writer.leader_view, sessions.oldest_use, self._expire_sessions, f"sessions-{c.id}",
            evicted=lambda: sessions.evicted, max_sessions=c.max_sessions,
        )
        self._session_sweeper.start()
        self._compactor = Compactor(
            c.auto_compaction_retention, lambda: self.writer.leader_view()[:2] + (self.sm.applied()[0],), lambda: self.sm,
            lambda revision, term: self.writer.propose_as_leader(cmds.Compact(revision), term), f"compactor-{c.id}",
        )
        self._compactor.start()
        self.started_at = time.time()
        return self

    @property
    def metrics(self):
        """This node's metrics (kv.server.metrics.NodeMetrics: its own Prometheus registry,
        what GET /metrics serves). Made on first use: an embedded store that never reads
        them pays neither for prometheus_client nor for the observations."""
        if self._metrics is None:
            from .server.metrics import NodeMetrics

            m = NodeMetrics()
            m.register(lambda: layer_metrics.raft_samples(self.raft.metrics(), self._snapshot_index()))
            m.register(lambda: layer_metrics.state_machine_samples(self.sm))
            m.register(lambda: self.writer.samples())
            m.register(self.watches.samples)
            m.register(lambda: self.disk.samples())
            m.register(lambda: layer_metrics.disk_usage_samples(self.config.state_path, self.config.ledger_path))
            m.register(lambda: layer_metrics.snapshot_samples(self.snapshots.stats))
            self._metrics = m
        return self._metrics

    # The lower layers' observation hooks, given at construction: they count once the
    # metrics exist (kv serve makes them at start; an embedded store maybe never).

    def _observe(self, histogram: str):
        def observe(seconds: float) -> None:
            if self._metrics is not None:
                getattr(self._metrics, histogram).observe(seconds)

        return observe

    def _snapshot_index(self) -> int:
        snap = self.snapshots.newest_meta() if self.snapshots else None
        return snap.index if snap else 0

    def _stalled_on_disk(self) -> Exception | None:
        """A write (the ledger's, or the state machine's) waiting for disk space, if any."""
        return (self.raft.write_stalled if self.raft else None) or (self.caller.stalled if self.caller else None)

    async def stop(self) -> None:
        await self.leases.stop()
        if self.disk is not None:
            await self.disk.stop()
        if self._session_sweeper is not None:
            await self._session_sweeper.stop()
        if self._compactor is not None:
            await self._compactor.stop()
        if self.snapshots is not None:
            await self.snapshots.stop()  # a snapshot in progress still needs the ledger writer
        if self.raft is not None:
            await self.raft.stop()
        if self.caller is not None:
            await self.caller.stop()
        self.watches.close_all()
        await self.exports.drain()
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

    # -- the write path (kv/server/writes.py) ---------------------------------------------------

    @property
    def sessions(self):
        """The client sessions this node sends the writes it is handed without one in
        (there to release a session to even after the node failed)."""
        if self.writer is None:
            raise Unavailable("the node is not started: call await node.start() first")
        return self.writer.sessions

    def encode_request(self, cmd: cmds.Command | cmds.LocalCommand) -> bytes:
        """A request's command, encoded and checked against --max-request-bytes."""
        return self._writing().encode_request(cmd)

    async def submit(
        self, cmd: cmds.Command | cmds.LocalCommand, timeout: float | None = None, *, request_id: RequestId | None = None, resent: bool = False
    ) -> Applied:
        """Replicate a command and wait until it is applied here, exactly once (see
        kv.server.writes.Writer.submit)."""
        return await self._writing().submit(cmd, timeout, request_id=request_id, resent=resent)

    async def open_session(self, *, timeout: float | None = None, owner: Hashable | None = None) -> int:
        """Open a client session (for X-Kv-Session); returns its id. Its writes are applied
        at most once however often they are sent; it closes after --session-ttl-s unused.

        `owner` (the HTTP front's: a token that is not admin) is recorded with the session,
        as a digest keyed with the cluster secret, once every member runs a version that
        records owners (raft peers_apply; until then the session has none): past
        --max-sessions the cluster evicts from the owner holding the most
        (statemachine/sessions.py), so one tenant opening sessions in a loop evicts its
        own, not every other client's (whose retried writes would then no longer be known
        as applied). And it may hold at most SESSIONS_PER_OWNER of the sessions opened
        through this node that are still open (those being opened included), or
        Unavailable, whether owners are recorded or not."""
        writer = self._writing()
        if owner is None:
            return await writer.open_session(timeout=timeout)
        held, opening = self._session_owners.setdefault(owner, set()), self._sessions_opening
        if len(held) + opening[owner] >= SESSIONS_PER_OWNER:
            held.intersection_update(self.sm.sessions.last)  # the expired and evicted go
            if len(held) + opening[owner] >= SESSIONS_PER_OWNER:
                raise Unavailable(
                    f"this token holds {len(held) + opening[owner]} open client sessions opened through this node, the most one "
                    f"may: reuse a kv.Client (it keeps one session a write in flight) rather than one a request, or use another "
                    f"node; unused sessions close after --session-ttl-s ({self.config.session_ttl_s:g} s)"
                )
        tag = ""
        if self.raft.peers_apply(cmds.OWNED_SESSIONS):
            secret = hashlib.sha256((self.config.cluster_secret or "").encode()).digest()
            tag = "t:" + hashlib.blake2b(str(owner).encode(), digest_size=8, key=secret).hexdigest()
        opening[owner] += 1  # (counted while it is opened: concurrent opens cannot all pass the check)
        try:
            session = await writer.open_session(timeout=timeout, owner=tag)
        finally:
            opening[owner] -= 1
        held.add(session)
        return session

    def propose_now(self, slots: Sequence[Slot]) -> None:
        """The write path without a task per write (kv.open's, the etcd API's plain puts):
        see kv.server.writes.Writer.propose_now; then settle(slot) once it is resolved."""
        if self.writer is None:
            for s in slots:
                s.give_up()
            return
        self.writer.propose_now(slots)

    def settle(self, slot: Slot) -> Applied | None:
        """A resolved slot's Applied, or None: then `await resubmit(slot)` (Writer.settle)."""
        if self.writer is None:
            return None
        return self.writer.settle(slot)

    async def resubmit(self, slot: Slot) -> Applied:
        """A settled slot's write the general way (Writer.resubmit)."""
        return await (self.writer or self._writing()).resubmit(slot)  # (a failed node: resubmit says how the write ended)

    @staticmethod
    def put_result(applied: Applied) -> WriteResult:
        """What put() returns for a put's Applied (raising what put() raises)."""
        return write_result(applied)

    def abandon(self, slot: Slot) -> None:
        """Nobody waits for a settled slot's write any more: its session is free."""
        if self.writer is not None:
            self.writer.abandon(slot)

    def _writing(self) -> Writer:
        self._running()
        return self.writer

    def leads(self) -> bool:
        """Whether this node is the Raft leader now."""
        raft = self.raft
        return raft is not None and raft.role == Role.LEADER

    def _leading(self) -> tuple[bool, int, str | None]:
        raft = self.raft
        if raft is None:
            return False, 0, None
        return raft.role == Role.LEADER, raft.term, raft.leader_id

    async def _propose_as_leader(self, cmd: cmds.Command, term: int) -> Applied | None:
        return await self._writing().propose_as_leader(cmd, term)

    async def _expire_sessions(self, upto: int, term: int) -> None:
        await self._propose_as_leader(cmds.SessionsExpire(upto), term)

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

        Every write is applied at most once, however often it has to be sent (kv/common/sessions.py and kv/server/writes.py);
        `request_id=(session, seq)` is a caller's own session request (X-Kv-Session), else
        the node sends it in one of its own sessions."""
        return write_result(await self.submit(self.put_command(key, value, if_mod_index, if_absent, lease, if_exists), timeout, request_id=request_id))

    async def cas(self, key: str, expected_mod_index: int, value: bytes, *, timeout: float | None = None, request_id: RequestId | None = None) -> WriteResult:
        """Compare-and-set on the key's mod_index (0: the key must not exist)."""
        return await self.put(key, value, if_mod_index=expected_mod_index, timeout=timeout, request_id=request_id)

    async def delete(
        self, key: str, *, if_mod_index: int | None = None, if_exists: bool = False, timeout: float | None = None, request_id: RequestId | None = None
    ) -> DeleteResult:
        return delete_result(await self.submit(cmds.Delete(key, condition(key, if_mod_index, False, if_exists)), timeout, request_id=request_id))

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
        return cmds.Put(key, limits.check_value(value, self.config.max_value_bytes), condition(key, if_mod_index, if_absent, if_exists), lease_id(lease) if lease is not None else 0)

    def txn_command(self, conds: Sequence[cmds.Cond], ops: Sequence, else_ops: Sequence) -> cmds.Txn:
        c = self.config
        limits.check_txn_size(conds, ops, else_ops, c.max_txn_ops)
        limit = c.max_value_bytes
        for op in (*ops, *else_ops):
            if type(op) is cmds.Put and (type(op.value) is not bytes or len(op.value) > limit):
                limits.check_value(op.value, limit)  # raises with the reason (or accepts a bytearray)
        limits.check_read_bytes(ops, else_ops, self._stored_size, c.max_txn_read_bytes)
        return cmds.Txn(tuple(conds), tuple(ops), tuple(else_ops))

    def _stored_size(self, key: str) -> int:
        """The size of key's value in this node's state (0 if absent), for read estimates."""
        if self.sm is None:
            return 0
        try:
            got = self.sm.get(validate_key(key))
        except StateUnreadable as e:
            raise public_error(e, fix="use another member meanwhile") from e
        return len(got[1]) if got else 0

    def _running(self) -> RaftNode:
        if self.raft is None:
            raise Unavailable("the node is not started: call await node.start() first")
        if self.raft.failure is not None:
            raise Unavailable(f"the node stopped after an error: {self.raft.failure}")
        return self.raft

    # -- waiting for the cluster (kv/server/reads.py) -----------------------------------------

    async def wait_applied(self, index: int, *, timeout: float | None = None) -> None:
        """Return once this node has applied `index` (a write's `.index`): a stale read
        here sees that write from then on. Raises Timeout after `timeout` seconds."""
        raft = self._running()
        if raft.applied_index < index:  # (a write answered here is applied here already)
            await reads.wait_applied(raft, index, timeout)

    async def wait_leader(self, *, timeout: float | None = None) -> str:
        """The leader's id, once this node knows one; on the leader itself, once it has
        committed an entry of its own term (until then its commit index may lag). Raises
        Timeout after `timeout` seconds."""
        return await reads.wait_leader(self._running(), timeout)

    async def read_barrier(self, consistency: str = "linearizable", timeout: float | None = None) -> int:
        """Wait until a local read is as fresh as `consistency` asks; returns the index
        this node has applied. stale: at once; lease: the leader's lease; linearizable: a
        read index confirmed by a majority (Raft thesis §6.4)."""
        raft = self._running()
        if consistency in ("linearizable", "lease"):
            self.counters["read_barriers"] += 1
        return await reads.read_barrier(raft, consistency, timeout if timeout is not None else self.config.read_timeout_s)

    # -- reads -----------------------------------------------------------------------------

    async def get(
        self, key: str, *, consistency: str = "linearizable", timeout: float | None = None, revision: int | None = None
    ) -> Item | None:
        return (await self.get_at(key, consistency=consistency, timeout=timeout, revision=revision))[0]

    async def get_at(
        self, key: str, *, consistency: str = "linearizable", timeout: float | None = None, revision: int | None = None
    ) -> tuple[Item | None, int]:
        """get, and the applied index the read was at. `revision`: the key as it was then
        (RevisionCompacted below what the history keeps, FutureRevision above the index),
        and the index answered is it."""
        validate_key(key)
        index = await self.read_barrier(consistency, timeout)
        try:
            # no await since the barrier: the state is at `index`
            if revision is None:
                got = self.sm.get(key)
            else:
                index = self._past(revision, index)  # (read at it: the index it answers, as scan_page's)
                got = self.sm.get_at(key, index)
        except StateUnreadable as e:
            raise public_error(e) from e
        return (Item(key, got[1], got[0]) if got else None), index

    def _past(self, revision, index: int) -> int:
        """A revision to read at, checked against what this node holds (read at `index`)."""
        if type(revision) is not int or revision < 1:
            raise BadRequest(f"revision must be a log index (an integer >= 1), not {revision!r}")
        if revision > index:
            raise FutureRevision(f"revision {revision} is ahead of this node's applied index {index}; read at {index} or earlier")
        oldest = self.sm.oldest_revision()
        if revision < oldest:
            why = (
                "compacted (--auto-compaction-retention, or a Compact)" if oldest == self.sm.compact_revision
                else "from before this node's history began (data written by a version without it)"
            )
            raise RevisionCompacted(f"revision {revision} is {why}: the history here goes back to revision {oldest}; read at a later revision", oldest)
        return revision

    def oldest_revision(self) -> int:
        """The oldest revision a read can be at on this node (the compact revision, or where
        its history began)."""
        return self.sm.oldest_revision() if self.sm is not None else 0

    def scan(
        self, prefix: str = "", *, after: str | None = None, limit: int | None = None, consistency: str = "linearizable", timeout: float | None = None,
        page: int = 1000, revision: int | None = None,
    ) -> Scan:
        """Every key under a prefix in key order (strictly after `after`; at most `limit`):
        `await node.scan(p)` gives a list, `async for item in node.scan(p)` streams pages.
        The first page waits for `consistency`; the ones after it read on from there (as
        the keys are then), or, with `revision`, every page as the keys were at it."""
        barrier = [consistency]

        async def fetch(after: str | None, n: int) -> tuple[list[Item], bool]:
            if barrier:
                await self.read_barrier(barrier.pop(), timeout)
            self._running()
            try:
                at = None if revision is None else self._past(revision, self.sm.applied()[0])
                rows = self.sm.scan(prefix, after, n, None, at)
            except StateUnreadable as e:
                raise public_error(e) from e
            return [Item(k, v, m) for k, v, m in rows], len(rows) == n

        return Scan(fetch, after=after, limit=limit, page=page)

    async def scan_page(
        self, prefix: str = "", *, after: str | None = None, limit: int = 1000, consistency: str = "linearizable", timeout: float | None = None,
        max_bytes: int | None = None, revision: int | None = None,
    ) -> Page:
        """scan, and the applied index the page was read at (list, then watch from index + 1).
        `max_bytes`: the page ends once its keys and values add up to that many bytes.
        `revision`: the keys as they were at that revision (pass the first page's index to
        page through one consistent cut while writes go on); the page's index is then it."""
        if limit <= 0:
            raise BadRequest("limit must be positive")
        index = await self.read_barrier(consistency, timeout)
        try:
            if revision is not None:
                at = self._past(revision, index)
                return Page([Item(k, v, m) for k, v, m in self.sm.scan(prefix, after, limit, max_bytes, at)], at)
            return Page([Item(k, v, m) for k, v, m in self.sm.scan(prefix, after, limit, max_bytes)], index)
        except StateUnreadable as e:
            raise public_error(e) from e

    async def scan_rows(
        self, prefix: str = "", *, after: str | None = None, limit: int = 1000, consistency: str = "linearizable", timeout: float | None = None,
        max_bytes: int,
    ) -> tuple[bytes, int, int, bool, int]:
        """scan_page as of now, in the bulk format (statemachine/rows.py, each key's
        mod_index in the condition column; what an import reads back): (body, rows, their
        keys' and values' bytes, whether more follow or max_bytes cut the page, the index
        it was read at)."""
        if limit <= 0:
            raise BadRequest("limit must be positive")
        index = await self.read_barrier(consistency, timeout)
        try:
            return (*self.sm.scan_rows(prefix, after, limit, max_bytes), index)
        except StateUnreadable as e:
            raise public_error(e) from e

    async def put_many(self, items: dict[str, bytes] | Sequence[tuple[str, bytes]], *, timeout: float | None = None) -> TxnResult:
        """Write many keys in one atomic transaction (at most --max-txn-ops keys, and
        --max-request-bytes encoded: split a larger batch, or use kv.spark.bulk)."""
        pairs = items.items() if isinstance(items, dict) else items
        return await self.txn(ops=[cmds.Put(k, v) for k, v in pairs], timeout=timeout)

    async def bulk_put(
        self, rows: bytes | Iterable[tuple[str, bytes] | tuple[str, bytes, int | None]], *, within: str = "",
        timeout: float | None = None, request_id: RequestId | None = None,
    ) -> BulkResult:
        """Put many keys in one committed entry (POST /v1/bulk; kv.spark's import): rows
        (key, value) or (key, value, if_mod_index) — a key str (or bytes), a value bytes,
        if_mod_index None (no condition) or the mod_index the key must have (0: absent) —
        or a body in kv/statemachine/rows.py's format; `row` in answers and errors is the
        row's place among `rows`. Bounded by
        --max-request-bytes, not --max-txn-ops. Atomic: every row whose condition holds
        is written at one index; the others are refused, each named in the answer with
        what its key holds, and nothing is written for them. `within`: a key prefix every
        row's key must have (a token's scope; Forbidden otherwise)."""
        body, cmd = self.bulk_command(rows, within)
        return body.result(bulk_result(await self.submit(cmd, timeout, request_id=request_id), cmd))

    def bulk_command(self, rows, within: str = "") -> tuple[BulkBody, cmds.Bulk]:
        """The body of bulk_put's rows and its Bulk command, checked against the format and
        this node's limits (BadRequest, ValueTooLarge, Forbidden naming the caller's row)."""
        body = bulk_body(rows)
        try:
            return body, self._bulk_command(body.data, within)
        except KVError as e:
            raise body.renumbered(e) from None

    def _bulk_command(self, body: bytes, within: str) -> cmds.Bulk:
        c = self.config
        limits.check_request_bytes(body, c.max_request_bytes)
        try:
            cmd = cmds.bulk(body)
        except cmds.CommandError as e:
            raise BadRequest(str(e)) from None
        limits.check_bulk_values(cmd.rows, c.max_value_bytes)
        if within:
            rows = cmd.rows
            try:  # a prefix of whole characters: a key has it as text iff its bytes start with its bytes
                pre = within.encode("utf-8")
            except UnicodeEncodeError:  # it ends inside a character, or spells bytes: text rules, key by key
                pre = None
            if pre is not None:  # the keys are in byte order: every key between two with the prefix has it too
                outside = [(i, raw) for i, raw in ((0, rows.key(0)), (rows.n - 1, rows.key(rows.n - 1))) if not raw.startswith(pre)]
            else:
                outside = [(i, raw) for i, raw in enumerate(rows.keys()) if not cmds.key_text(raw).startswith(within)]
            if outside:
                i, raw = outside[0]
                raise Forbidden(f"row {i}: this token reaches only keys under {within!r}, not {cmds.shown_key(cmds.key_text(raw))[:200]}")
        return cmd

    # -- leases ----------------------------------------------------------------------------

    async def lease_grant(
        self, ttl: float, *, owner: str = "", lease: int | None = None, timeout: float | None = None, request_id: RequestId | None = None
    ) -> LeaseStatus:
        """A new lease of `ttl` seconds (more than 0, at most a year); keep it alive with
        lease_keepalive (or use `lease()`, which does), attach keys with put(lease=...).
        Its id is random (nobody can guess another's); `owner`: the key prefix of the token
        that asks (see lease_scope); `lease`: the id the caller chose (LeaseExists if it is
        taken), as etcd's clients may."""
        ms = ttl_ms(ttl)
        if lease is not None:
            r = (await self.submit(cmds.LeaseGrant(ms, lease_id(lease), owner), timeout, request_id=request_id)).result
            if type(r) is cmds.CommandError and "in use" in str(r):
                raise LeaseExists(lease)
            return lease_status(raise_failed(r))
        while True:
            # A caller's request is sent again, perhaps through another node, as the very same
            # command: its id comes from the request's, unguessable as the session's is.
            lease = granted_id(request_id) if request_id is not None else secrets.randbelow(cmds.MAX_LEASE_ID) + 1
            r = (await self.submit(cmds.LeaseGrant(ms, lease, owner), timeout, request_id=request_id)).result
            if type(r) is not cmds.CommandError or request_id is not None or "in use" not in str(r):
                return lease_status(raise_failed(r))

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
        return lease_status(raise_failed((await self.submit(cmds.LeaseKeepAlive(lease_id(lease)), timeout)).result))

    async def lease_keepalives(self, leases: Sequence[int], *, timeout: float | None = None) -> list[LeaseStatus | None]:
        """Renew several leases in one round (one read barrier on the leader): for each,
        in order, its LeaseStatus, or None if it expired or was revoked. At most
        MAX_KEEPALIVES (10,000) at once; what AsyncLease's keepalives go through."""
        ids = tuple(lease_id(x) for x in leases)
        if not 0 < len(ids) <= cmds.MAX_KEEPALIVES:
            raise BadRequest(f"renew 1 to {cmds.MAX_KEEPALIVES} leases at once, not {len(ids)}")
        unique = tuple(dict.fromkeys(ids))  # a lease named twice is renewed once
        r = raise_failed((await self.submit(cmds.LeaseKeepAlives(unique), timeout)).result)
        renewed = {x.lease: lease_status(x) if type(x) is cmds.LeaseInfo else None for x in r.leases}
        return [renewed[i] for i in ids]

    async def lease_revoke(self, lease: int, *, timeout: float | None = None, request_id: RequestId | None = None) -> RevokeResult:
        """End a lease now; its keys are deleted in the same committed entry."""
        r = raise_failed((await self.submit(cmds.LeaseRevoke(lease_id(lease)), timeout, request_id=request_id)).result)
        return RevokeResult(r.index, r.keys)

    async def lease_info(self, lease: int, *, timeout: float | None = None) -> LeaseStatus:
        """A lease's ttl, the seconds it has left (on the leader's clock) and its keys."""
        return lease_status(raise_failed((await self.submit(cmds.LeaseQuery(lease_id(lease)), timeout)).result))

    async def lease_list(self, *, timeout: float | None = None) -> list[LeaseStatus]:
        """Every live lease (without its keys)."""
        r = (await self.submit(cmds.LeaseQuery(0), timeout)).result
        return [lease_status(x) for x in r.leases]

    # -- etcd's v3 API (v3api/) --------------------------------------------------------------

    async def etcd_range(
        self, req: cmds.RangeReq, *, consistency: str = "linearizable", timeout: float | None = None, revision: int | None = None
    ) -> tuple[cmds.RangeResp, int]:
        """etcd's Range on this node's state (as of `revision`, if given), and the applied
        index it was read at (the response header's revision)."""
        index = await self.read_barrier(consistency, timeout)
        try:
            if revision is not None and revision != index:
                return self.sm.range(req, self._past(revision, index)), index
            return self.sm.range(req), index
        except StateUnreadable as e:
            raise public_error(e) from e

    def etcd_key(self, key: bytes) -> cmds.KeyValue | None:
        """etcd's Range of one key as of now, after the read barrier the caller awaited
        (the common call, without a range's machinery): its KeyValue, None if there is no
        such key."""
        try:
            return self.sm.key_value(key)
        except StateUnreadable as e:
            raise public_error(e) from e

    def etcd_keys_in(self, key: bytes, end: bytes, most: int) -> int:
        """How many keys etcd's range (key, end) holds as this node has applied it, counted
        no further than most + 1."""
        try:
            return self.sm.keys_in(key, end, most)
        except StateUnreadable as e:
            raise public_error(e) from e

    async def etcd_txn(self, txn: cmds.TxnReq, *, timeout: float | None = None, request_id: RequestId | None = None) -> cmds.TxnResp:
        """etcd's Txn (its Put and DeleteRange are transactions of one op): one committed
        entry, applied atomically. LeaseNotFound for a put to a lease that does not exist,
        KeyNotFound for an ignore_value/ignore_lease put of a key that does not: then
        nothing was applied. Answered once this node has applied it."""
        r = (await self.submit(txn, timeout, request_id=request_id)).result
        if type(r) is cmds.KeyNotFound:
            raise KeyNotFound(r.key)
        r = raise_failed(r)
        # As etcd's members do, answer once this node has applied it too: a client that
        # reads from the node it wrote through (serializable, say) sees its write.
        await self.wait_applied(r.index, timeout=timeout if timeout is not None else self.config.write_timeout_s)
        return r

    async def etcd_read_txn(self, txn: cmds.TxnReq, *, consistency: str = "linearizable", timeout: float | None = None) -> cmds.TxnResp:
        """etcd's Txn of compares and ranges only (it writes nothing): evaluated on this
        node's state after a read barrier, as etcd serves a read-only transaction; its
        revision is the applied index it was read at. BadRequest if it writes."""
        index = await self.read_barrier(consistency, timeout)
        try:
            return self.sm.read_txn(txn, index)
        except cmds.CommandError as e:
            raise BadRequest(str(e)) from None
        except StateUnreadable as e:
            raise public_error(e) from e

    async def set_alarm(self, member: int, alarm: int, active: bool, *, timeout: float | None = None) -> list[tuple[int, int]]:
        """Raise (active) or clear an alarm of a member (0: the cluster's), through the log:
        while a NOSPACE one is raised, every node refuses writes that add data (etcd's
        Alarm ACTIVATE/DEACTIVATE). Returns the (member, alarm) pairs it changed."""
        r = raise_failed((await self.submit(cmds.AlarmSet(member, alarm, active), timeout)).result)
        return list(zip(r.members, r.kinds))

    def raised_alarms(self) -> list[tuple[int, int]]:
        """The (member, alarm) pairs raised through the log, as this node has applied them."""
        return sorted(self.sm.alarms) if self.sm is not None else []

    async def compact(self, revision: int, *, timeout: float | None = None) -> int:
        """Compact the history at `revision`, through the log (etcd's Compact): from then on
        every node refuses reads below it and watches from before it, and drops the history
        there. Returns the compact revision; RevisionCompacted if it is there already (or
        past it, as etcd's: a retried compact that was applied gets it, naming the compact
        revision), FutureRevision if `revision` is ahead of the log."""
        if type(revision) is not int or revision < 1:
            raise BadRequest(f"revision must be a log index (an integer >= 1), not {revision!r}")
        if self.sm is not None and revision <= self.sm.compact_revision:  # refused in any case: no entry for it
            raise RevisionCompacted(f"revision {revision} is compacted already (the compact revision is {self.sm.compact_revision})", self.sm.compact_revision)
        r = raise_failed((await self.submit(cmds.Compact(revision), timeout)).result)
        if r.refused == "compacted":
            raise RevisionCompacted(f"revision {revision} is compacted already (the compact revision is {r.compact_revision})", r.compact_revision)
        if r.refused == "future":
            raise FutureRevision(f"revision {revision} is ahead of the log: compact at a revision that was written")
        return r.compact_revision

    def compact_revision(self) -> int:
        """The revision of the last Compact applied here (0: none)."""
        return self.sm.compact_revision if self.sm is not None else 0

    @property
    def cluster_id(self) -> str:
        """The cluster's identity ("" until its first leader chose one, or for a cluster made
        by an earlier version until it is restored)."""
        return self.sm.cluster_id if self.sm is not None else ""

    def ids(self) -> tuple[int, int]:
        """(cluster id, member id) as etcd's API reports them: stable 64-bit numbers derived
        from the cluster's identity (its group's name until a leader has chosen one) and
        this node's id."""
        return etcd_id(self.cluster_id or self.config.group), etcd_id(self.config.id)

    # -- watch -----------------------------------------------------------------------------

    def _want_rich_changes(self, on: bool) -> None:
        self.sm.rich_changes = on  # (watches open only on a running node)

    def watch(
        self, prefix: str = "", start_index: int | None = None, *, buffer_bytes: int | None = None, resume_when_behind: bool = True, rich: bool = False
    ) -> Watch:
        """Every change under prefix in commit order, from start_index (default: the next
        one applied), as far back as this node's history goes (its ledger, for a plain
        watch, as DESIGN.md says); older raises WatchCompacted:
        scan_page the prefix, then watch from its index + 1. A watch more than buffer_bytes
        behind the live changes reads on from the history (resume_when_behind), or ends with
        SlowWatcher (for a stream whose client resumes)."""
        self._running()
        if start_index is not None and (type(start_index) is not int or start_index < 1):
            raise BadRequest(f"start_index must be a log index (an integer >= 1), not {start_index!r}")
        size = buffer_bytes if buffer_bytes is not None else self.config.watch_buffer_bytes
        return self.watches.open(prefix, start_index, size, resume_when_behind, rich)

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

    # -- administration (kv/server/members.py) ----------------------------------------------

    async def take_snapshot(self, *, timeout: float | None = None) -> tuple[object, int]:
        """A snapshot that holds every write acknowledged before the call, on any member:
        first a linearizable read barrier (a follower catches up with the leader's commit
        index, as a read does), then a snapshot of everything applied (snapshot.manager's
        take). Returns (the snapshot file's info, the commit index the barrier waited for)."""
        index = await self.read_barrier("linearizable", timeout)
        try:
            return await self.snapshots.take(), index
        except NodeStopped as e:
            raise public_error(e) from None

    async def transfer_leadership(self, to: str, *, timeout: float | None = None) -> str:
        """Hand leadership to member `to` (it is caught up first; writes are refused while
        the transfer runs). Returns the leader afterwards. Raises NotLeader on a follower."""
        return await self._members.transfer_leadership(to, timeout)

    async def hand_over_leadership(self, *, timeout: float | None = None) -> str | None:
        """Before a clean stop of the leader: hand leadership to the most caught-up voter,
        so that writes go on at once instead of after an election timeout (etcd does the
        same). Returns the new leader, or None: not the leader, no other voter, or the
        transfer did not finish within `timeout` (default: two election timeouts)."""
        return await self._members.hand_over_leadership(self.raft, timeout)

    async def add_member(
        self, member_id: str, peer: str, http: str = "", *, voter: bool = False, replace: bool = False, ledger: str = "", timeout: float | None = None
    ) -> list[dict]:
        """Add a member that listens for peers on `peer`. It always joins as a learner;
        with voter=True the leader promotes it once it has caught up (a voter that cannot
        be reached would count against the quorum). With replace=True an existing member's
        addresses change (a node moved). `ledger`: the ledger_id of the data dir joining
        as this member (kv serve --join gives it): another data dir is refused as that id."""
        return await self._members.add(member_id, peer, http, voter, replace, timeout, ledger)

    async def remove_member(self, member_id: str, *, timeout: float | None = None) -> list[dict]:
        return await self._members.remove(member_id, timeout)

    async def promote_member(self, member_id: str, *, timeout: float | None = None) -> list[dict]:
        """Make a learner a voter (refused with Conflict until it has caught up)."""
        return await self._members.promote(member_id, timeout)

    def members(self) -> list[dict]:
        return self._members.list()

    def membership_record(self) -> dict:
        """What add_member, remove_member and promote_member are answered with beside the
        members (the newest committed membership): "index", the log index of its entry,
        and "removed", the ids removed from the cluster, whose old data dirs are refused. A
        node that joins starts from them (it passes over older membership entries, and
        refuses what the cluster does)."""
        membership, index = self._running().committed_membership_at
        # (the state machine's removed ids are as of its applied index, which may be behind
        # the committed membership: members in it since are not removed, and ids it lists
        # that the committed one does not were removed since)
        applied = Membership.decode(self.sm.membership()).ids
        return {"index": index, "removed": sorted((self.sm.removed() | applied) - membership.ids)}

    def leader_url(self) -> str | None:
        """The leader's client URL, if this node knows it."""
        return self._running().leader_url()

    # -- status ----------------------------------------------------------------------------

    def status(self) -> dict:
        """This node's own view (never forwarded): the fields of GET /v1/status."""
        if self.raft is None:
            return {"id": self.config.id, "role": "stopped"}
        history = {"compact_revision": self.sm.compact_revision, "oldest_revision": self.sm.oldest_revision()}
        return {**self._members.status(self._running(), self._snapshot_index(), self.disk.alarms()), **history, "cluster_id": self.sm.cluster_id}
