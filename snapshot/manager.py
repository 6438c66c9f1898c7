"""Snapshots of a running node: when to take them, compaction behind them, and streaming
them to followers that fell behind ledgerBeforeBeginIndex (install-snapshot).

Taking a snapshot pins a LevelDB snapshot in the event loop (cheap, consistent with the
applied index) and writes the file in a worker thread, so applying and replication go on.
Then LevelDB is synced and the ledger compacted up to the snapshot index minus a trailing
window (etcd keeps 5,000 entries, hashicorp TrailingLogs; DLedger keeps none, so any slow
follower needs a whole snapshot) — in the ledger writer thread, between group commits.

Install-snapshot (Raft Figure 13, not DLedger's one JSON message): the leader streams the
newest file in chunks with a window of unacknowledged bytes; the follower appends them to a
partial file, acknowledging how much it holds, so a broken connection resumes where it
stopped. The follower verifies the whole file before its core sees the install; a file that
fails is discarded and the node keeps its state.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..raft import failpoints
from ..raft.messages import InstallSnapshotRequest, Role, SnapshotChunk, SnapshotChunkAck, SnapshotMeta
from ..raft.node import NodeStopped
from .format import BLOCK_BYTES, SnapshotFormatError, iter_records, new_header, read_header, verify
from .store import SnapshotFile, SnapshotStore

log = logging.getLogger("kv.snapshot")

# A snapshot rewrites the whole state (seconds a GiB, with the leader's writes slowed
# meanwhile), where the threshold counts entries: with a large state every 100,000 small
# writes paid for a rewrite of all of it (1M keys: 3-5 s of CPU, every node at once). Past
# this size the next one also waits until the entries applied since add up to half its size,
# which keeps the rewriting in proportion to the writing (the ledger holds that much more).
LARGE_SNAPSHOT_BYTES = 64 << 20
CHUNK_BYTES = 1 << 20
WINDOW_BYTES = 8 << 20
ACK_TIMEOUT_S = 5.0
MAX_STALLS = 5


class SnapshotDriver(Protocol):
    """What the snapshot layer uses of the Raft driver (kv.raft.node.RaftNode): who it is,
    its term, role, membership and applied index; sending and stepping messages, compacting
    the ledger, and hearing how a snapshot stream to a peer ended."""

    id: str
    term: int
    role: Role
    applied_index: int
    membership: Any

    def send(self, msg: Any) -> bool: ...

    def step_local(self, msg: Any) -> None: ...

    def report_snapshot(self, peer: str, seq: int, ok: bool) -> None: ...

    async def compact(self, upto: int, before: Any = None) -> tuple[int, int] | None: ...


class SnapshotHost(Protocol):
    """What the snapshot layer needs from the node it runs in (kv.Node gives one): who it
    is, when to take a snapshot, and the state machine's side of taking and loading one."""

    @property
    def node_id(self) -> str: ...

    @property
    def group(self) -> str: ...

    @property
    def cluster_id(self) -> str:
        """The id of the cluster whose state this is ("" until its first entry is applied)."""

    @property
    def snapshot_threshold(self) -> int:
        """Entries applied since the newest snapshot before the next is taken."""

    @property
    def snapshot_trailing(self) -> int:
        """Entries kept in the ledger behind a snapshot (for followers a little behind)."""

    def capture(self) -> Any:
        """A consistent view of the state (index, term, membership, removed, items(), release())."""

    def not_capturable(self) -> str | None:
        """Why the state is not snapshotted at the threshold now (its membership is newer
        than its index: a node that joined, still catching up), or None. (An explicit
        take() reads after a barrier, which waits past that.)"""

    def sync_state(self) -> None:
        """Make everything applied durable (before the ledger drops it); any thread."""

    def load_state(self, index: int, term: int, membership: bytes, records: Iterable[tuple[bytes, bytes, int]], removed: Iterable[str] = ()) -> int:
        """Replace the state with a snapshot's records and the ids removed from the cluster
        as of it (a worker thread); returns how many records."""


@dataclass
class _Receiving:
    leader: str
    index: int
    term: int
    path: str
    size: int = 0
    total: int = 0
    f: object = None
    verifying: bool = False


@dataclass
class SnapshotStats:
    taken: int = 0
    take_seconds: float = 0.0
    last_take_seconds: float = 0.0
    sent: int = 0
    send_failures: int = 0
    installed: int = 0
    install_rejected: int = 0
    compactions: int = 0
    by_peer_progress: dict = field(default_factory=dict)


class SnapshotManager:
    def __init__(self, host: SnapshotHost, path: str, keep: int = 3) -> None:
        self.host = host
        self.store = SnapshotStore(path, keep)
        self.raft: SnapshotDriver | None = None  # bound by the driver (bind)
        self.stats = SnapshotStats()
        self._taking: asyncio.Future | None = None
        self._stopped = False  # none is taken after stop(): the state closes soon after
        self._state_open = asyncio.Event()  # cleared while the state's database is closed (quiesce)
        self._state_open.set()
        self._reading = False  # the snapshot being taken has passed _state_open: it reads the state
        self._newest_lock = threading.Lock()  # _newest: installs set it in the ledger writer's thread
        self._newest: SnapshotFile | None = self.store.newest()
        self._newest_bytes = 0  # the newest snapshot's size if LARGE_SNAPSHOT_BYTES or more
        self._applied_bytes = 0  # of the entries applied since it was taken (since this start)
        self._note_size()
        self._senders: dict[str, asyncio.Task] = {}
        self._acks: dict[str, asyncio.Queue] = {}
        self._recv: _Receiving | None = None
        self._verified: dict[tuple[int, int], str] = {}

    def bind(self, driver: SnapshotDriver) -> None:
        """The driver this manager streams through and compacts (a kv.raft.node.RaftNode
        made with this manager as its `snapshots` hooks binds itself here)."""
        self.raft = driver

    async def stop(self) -> None:
        # Entries are still applied after this (the FSM caller stops later): a snapshot its
        # threshold started then would read the state in a thread as the node closes it.
        self._stopped = True
        self._state_open.set()  # (a snapshot waiting for the state goes on, and fails on a closed one)
        tasks = list(self._senders.values())
        if self._taking is not None:
            tasks.append(self._taking)
        for t in self._senders.values():
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._recv is not None and self._recv.f is not None:
            self._recv.f.close()

    # -- taking snapshots ------------------------------------------------------------------

    def set_aside_foreign(self, cluster_id: str) -> None:
        """Rename the snapshot files of another cluster than cluster_id (copied in by
        hand) *.foreign, so that nothing sends, saves or loads them as this node's: one
        was taken for this node's newest, with an index beyond its log, handed to `kv
        snapshot save` as a backup, installed on a node that joined, and no snapshot was
        taken after it. Files from before cluster ids name none and are kept."""
        if not cluster_id:
            return
        for s in self.store.list():
            try:
                with open(s.path, "rb") as f:
                    theirs = read_header(f)[0].cluster
            except (SnapshotFormatError, OSError):
                continue  # (a damaged file: newest_valid sets it aside when it is needed)
            if theirs and theirs != cluster_id:
                os.replace(s.path, s.path + ".foreign")
                log.error(
                    "snapshot %s is of another cluster (%s, not this node's %s): set aside as %s.foreign",
                    s.path, theirs, cluster_id, os.path.basename(s.path),
                )
        self._newest = self.store.newest()
        self._note_size()

    def newest_meta(self) -> SnapshotFile | None:
        return self._newest

    def file_at(self, index: int) -> SnapshotFile | None:
        """The snapshot of this index, while this node keeps it."""
        return next((s for s in self.store.list() if s.index == index), None)

    def after_apply(self, applied: int, size: int) -> None:
        """The FSM caller's hook: take a snapshot once enough was applied since the last
        (`size`: the bytes of the entries just applied)."""
        self._applied_bytes += size
        base = self._newest.index if self._newest else 0
        if applied - base >= self.host.snapshot_threshold and self._taking is None and not self._stopped and self.host.not_capturable() is None and self._applied_bytes >= self._newest_bytes // 2:
            self._taking = asyncio.ensure_future(self._take_once())

    async def take(self) -> SnapshotFile:
        """Snapshot the state machine now, then compact the ledger behind it: the snapshot
        returned covers everything applied when this was called. One is written at a time;
        one already running (the threshold's, say) is waited for, and taken again after it
        if it stopped short of that."""
        wanted = self.raft.applied_index
        while True:
            if self._stopped:
                raise NodeStopped("the node is stopping: no snapshot is taken now; take it from another member")
            if self._taking is None:
                self._taking = asyncio.ensure_future(self._take_once())
            snap = await asyncio.shield(self._taking)
            if snap.index >= wanted:
                return snap

    async def quiesce(self) -> None:
        """Before the state machine's database is closed (a snapshot loaded into it, or it
        opened again after a full disk): the snapshot being written from it, if any, is
        finished first, and none starts until resume(). Its thread reads the database:
        closed under it, the process died (SIGSEGV), a follower that fell behind while it
        wrote one."""
        self._state_open.clear()
        if self._taking is not None and self._reading:  # (one still before the gate waits at it)
            await asyncio.wait([self._taking])

    def resume(self, *_: object) -> None:
        """The state machine's database is open again (FSMCaller's after_load and
        after_reopen hooks)."""
        self._state_open.set()

    def _note_size(self) -> None:
        try:
            size = os.path.getsize(self._newest.path) if self._newest is not None else 0
        except OSError:
            size = 0
        self._newest_bytes = size if size >= LARGE_SNAPSHOT_BYTES else 0

    async def _take_once(self) -> SnapshotFile:
        try:
            return await self._take()
        finally:
            self._taking = None

    async def _take(self) -> SnapshotFile:
        host = self.host
        loop = asyncio.get_running_loop()
        await self._state_open.wait()
        self._reading = True
        try:
            return await self._take_open(host, loop)
        finally:
            self._reading = False

    async def _take_open(self, host: SnapshotHost, loop: asyncio.AbstractEventLoop) -> SnapshotFile:
        view = host.capture()
        self._applied_bytes = 0
        t0 = time.monotonic()
        try:
            if self._newest is not None and self._newest.index >= view.index:
                return self._newest
            membership = view.membership or self.raft.membership.encode()
            header = new_header(view.index, view.term, membership, host.group, host.node_id, host.cluster_id, view.removed)
            snap = await loop.run_in_executor(None, self.store.write, header, view.blocks(BLOCK_BYTES))
        finally:
            view.release()
        took = time.monotonic() - t0
        with self._newest_lock:
            if self._newest is None or snap.index > self._newest.index:  # (one installed meanwhile is newer)
                self._newest = snap
        self._note_size()
        self.stats.taken += 1
        self.stats.take_seconds += took
        self.stats.last_take_seconds = took
        log.info("node %s: snapshot at %d/%d written in %.2fs", host.node_id, snap.index, snap.term, took)
        failpoints.hit("snapshot.after_rename")
        await self._compact(snap.index - host.snapshot_trailing)
        return snap

    async def _compact(self, upto: int) -> None:
        # What the ledger drops must be durable in the state first.
        done = await self.raft.compact(upto, before=self.host.sync_state)
        if done is None:
            return
        self.stats.compactions += 1

    # -- loading ---------------------------------------------------------------------------

    def newest_covering(self, min_index: int) -> SnapshotMeta:
        found = self.store.newest_valid(min_index)
        if found is None:
            raise SnapshotFormatError(
                f"the ledger starts after index {min_index} but no valid snapshot covers it: this data dir is "
                "incomplete. Remove it and restart the node so it catches up from the cluster (or, if kv snapshot restore "
                "was seeding it and stopped, remove it and run the restore again)"
            )
        s, header = found
        return SnapshotMeta(s.index, s.term, header.membership)

    def load_into_state_machine(self, meta: SnapshotMeta) -> None:
        """Replace the state machine's contents with the snapshot (worker thread)."""
        path = self.store.file_name(meta.index, meta.term)
        with open(path, "rb") as f:
            header, offset = read_header(f)
            n = self.host.load_state(header.index, header.term, header.membership, iter_records(f, offset), header.removed)
        log.info("node %s: state machine loaded from snapshot %d/%d (%d keys)", self.host.node_id, meta.index, meta.term, n)

    # -- sending (leader) ------------------------------------------------------------------

    def start_send(self, peer: str, seq: int, term: int) -> None:
        task = self._senders.get(peer)
        if task is not None and not task.done():
            task.cancel()
        self._acks[peer] = asyncio.Queue()
        self._senders[peer] = asyncio.get_running_loop().create_task(self._send(peer, seq, term))

    async def _send(self, peer: str, seq: int, term: int) -> None:
        raft = self.raft
        ok = False
        try:
            outcome = await self._stream(peer, seq, term)
            ok = outcome == "ok"
            if outcome == "rejected":
                await self._check_own_snapshot()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("node %s: sending a snapshot to %s failed", self.host.node_id, peer)
        finally:
            if ok:
                self.stats.sent += 1
            else:
                self.stats.send_failures += 1
            if raft.role == Role.LEADER and raft.term == term:
                raft.report_snapshot(peer, seq, ok)

    async def _stream(self, peer: str, seq: int, term: int) -> str:
        """Stream the newest snapshot; "ok", "rejected" (the follower found it damaged) or
        "failed" (no leader any more, no answers, no snapshot)."""
        snap = self._newest
        if snap is None:
            return "failed"
        raft, acks = self.raft, self._acks[peer]
        size = os.path.getsize(snap.path)
        acked = sent = stalls = 0  # acked: bytes the follower holds; sent: next byte to send
        last_resend = time.monotonic()
        log.info("node %s: sending snapshot %d/%d (%d bytes) to %s", self.host.node_id, snap.index, snap.term, size, peer)
        with open(snap.path, "rb") as f:
            while raft.role == Role.LEADER and raft.term == term:
                while sent < size and sent - acked < WINDOW_BYTES:
                    f.seek(sent)
                    data = f.read(CHUNK_BYTES)
                    done = sent + len(data) >= size
                    raft.send(SnapshotChunk(raft.id, peer, term, seq, snap.index, snap.term, sent, size, data, done))
                    sent += len(data)
                try:
                    ack = await asyncio.wait_for(acks.get(), ACK_TIMEOUT_S)
                except (asyncio.TimeoutError, TimeoutError):
                    stalls += 1
                    if stalls > MAX_STALLS:
                        log.info("node %s: %s did not acknowledge snapshot %d/%d for %.0f s; it is sent again later", self.host.node_id, peer, snap.index, snap.term, stalls * ACK_TIMEOUT_S)
                        return "failed"
                    sent = acked  # nothing came back: resend from what the follower holds
                    continue
                if ack.snapshot_index != snap.index:
                    continue
                if not ack.ok:
                    return "rejected"
                stalls = 0
                self.stats.by_peer_progress[peer] = (ack.next_offset, size)
                if ack.next_offset >= size:
                    return "ok"
                if ack.next_offset > acked:
                    acked = ack.next_offset
                    sent = max(sent, acked)  # a follower resuming a partial file jumps ahead
                elif acked < sent and time.monotonic() - last_resend > 1.0:
                    # No progress although more is in flight: a chunk was lost on a broken
                    # connection. Resend from the follower's end.
                    sent, last_resend = acked, time.monotonic()
        return "failed"

    async def _check_own_snapshot(self) -> None:
        """A follower rejected our snapshot: if our file is the damaged one, set it aside
        and take a new snapshot, or no follower could ever catch up from it."""
        snap = self._newest
        if snap is None:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(None, verify, snap.path)
        except (SnapshotFormatError, OSError) as e:
            log.error("node %s: our snapshot %s is damaged (%s); taking a new one", self.host.node_id, snap.path, e)
            os.replace(snap.path, snap.path + ".corrupt")
            self._newest = self.store.newest()
            await self.take()

    # -- receiving (follower) --------------------------------------------------------------

    def on_message(self, msg) -> None:
        if isinstance(msg, SnapshotChunkAck):
            q = self._acks.get(msg.src)
            if q is not None:
                q.put_nowait(msg)
            return
        self._on_chunk(msg)

    def _ack(self, msg: SnapshotChunk, next_offset: int, ok: bool) -> None:
        raft = self.raft
        raft.send(SnapshotChunkAck(raft.id, msg.src, raft.term, msg.snapshot_index, next_offset, ok))

    def _on_chunk(self, msg: SnapshotChunk) -> None:
        if msg.term < self.raft.term:
            self._ack(msg, 0, False)  # a deposed leader: its snapshot is not for us
            return
        r = self._recv
        if r is None or (r.index, r.term) != (msg.snapshot_index, msg.snapshot_term):
            if r is not None and r.f is not None:
                r.f.close()
                if os.path.exists(r.path):
                    os.unlink(r.path)
            path = os.path.join(self.store.path, f"recv-{msg.snapshot_index:020d}-{msg.snapshot_term:020d}.part")
            for name in os.listdir(self.store.path):  # partial files of other snapshots
                if name.startswith("recv-") and os.path.join(self.store.path, name) != path:
                    os.unlink(os.path.join(self.store.path, name))
            r = self._recv = _Receiving(msg.src, msg.snapshot_index, msg.snapshot_term, path, total=msg.total_size)
            # A partial file of the same snapshot from a broken transfer: resume after it.
            r.size = os.path.getsize(path) if os.path.exists(path) else 0
            if r.size:
                log.info("node %s: resuming snapshot %d/%d from %s at byte %d", self.host.node_id, r.index, r.term, msg.src, r.size)
            r.f = open(path, "ab")
        if r.verifying:
            return
        if msg.offset == r.size and r.size < msg.total_size:
            r.f.write(msg.data)
            r.size += len(msg.data)
            r.f.flush()
            failpoints.hit("install.mid_receive")
        if r.size >= msg.total_size and msg.total_size > 0:
            r.f.flush()
            os.fsync(r.f.fileno())
            r.verifying = True
            asyncio.get_running_loop().create_task(self._finish(msg, r))
            return
        self._ack(msg, r.size, True)

    async def _finish(self, msg: SnapshotChunk, r: _Receiving) -> None:
        r.f.close()
        r.f = None
        try:
            header, _ = await asyncio.get_running_loop().run_in_executor(None, verify, r.path)
            if (header.index, header.term) != (r.index, r.term):
                raise SnapshotFormatError("the snapshot's header does not match what the leader announced")
        except (SnapshotFormatError, OSError) as e:
            log.error("node %s: snapshot %d/%d from %s rejected: %s", self.host.node_id, r.index, r.term, r.leader, e)
            self.stats.install_rejected += 1
            os.unlink(r.path)
            self._recv = None
            self._ack(msg, 0, False)
            return
        self._recv = None
        self._ack(msg, r.size, True)
        meta = SnapshotMeta(r.index, r.term, header.membership)
        for old in self._verified.values():  # verified but never installed (not needed)
            if os.path.exists(old):
                os.unlink(old)
        self._verified = {(r.index, r.term): r.path}
        self.raft.step_local(InstallSnapshotRequest(msg.src, self.raft.id, msg.term, msg.seq, meta))

    def install(self, meta: SnapshotMeta) -> None:
        """Ledger writer thread, before the ledger is reset to the snapshot."""
        path = self._verified.pop((meta.index, meta.term))
        with self._newest_lock:
            self._newest = self.store.adopt(path, meta.index, meta.term)
        self._note_size()
        self._applied_bytes = 0
        self.stats.installed += 1
        failpoints.hit("install.after_adopt")
