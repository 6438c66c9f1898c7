"""A member's own state at start: the state machine opened (or rebuilt when damaged), the
ledger and the state machine brought into agreement after a crash at any point, the client
sessions replayed, and the membership it starts from (the bootstrap record checked)."""

from __future__ import annotations

import logging
import os
import time

from .config import NodeConfig
from ..errors import BadRequest, DataDirLocked
from ..raft import failpoints
from ..raft.ledger import Ledger, LedgerWrite
from ..raft.membership import Member, Membership
from ..raft.messages import Entry, EntryKind
from ..snapshot.manager import SnapshotManager
from ..statemachine.leveldb import LevelDBStateMachine, StateCorrupt, StateLocked
from . import bootstrap
from .join import Joined

log = logging.getLogger("kv.node")


class Recovery:
    """Opens the state machine of a member whose ledger and snapshots are open already.
    `joined`: what a member that joins a running cluster was given (join.py)."""

    def __init__(self, config: NodeConfig, ledger: Ledger, snapshots: SnapshotManager, joined: Joined | None = None) -> None:
        self.config, self.ledger, self.snapshots = config, ledger, snapshots
        self._joined = joined
        self.sm: LevelDBStateMachine | None = None

    def open(self) -> tuple[LevelDBStateMachine, Membership]:
        """The state machine, in agreement with the ledger, and the membership to start
        from (blocking: run it off the event loop)."""
        c = self.config
        try:
            self.sm = LevelDBStateMachine(c.state_path, max_read_bytes=c.max_txn_read_bytes)
        except StateLocked as e:  # never damage: the data dir's lock makes this one owner's
            raise DataDirLocked(c.data_dir) from e
        except StateCorrupt as e:
            self.sm = self.rebuild_state(e)
        self.snapshots.set_aside_foreign(self.sm.cluster_id)
        self.reconcile()
        self.replay_sessions()
        if c.force_new_cluster:
            self.force_new_cluster()
        membership = self.membership()
        if not self.sm.membership() and self.ledger.last_index() == 0:
            if c.join and self._joined is None and not c.force_new_cluster:
                # (its --peers name it alone: it would begin a cluster of its own)
                raise BadRequest(
                    f"--join {c.join}: {c.data_dir} holds the start of a node that never recorded the membership it joined "
                    "with (a version before 2026-12-07 stopped first, or the answer it kept, joined.json, is gone): remove the "
                    "data dir and run the join again"
                )
            failpoints.hit("start.before_membership")  # (a first start: the ledger made, nothing recorded)
            bootstrap.record(c.data_dir, c.peers or membership.ids)
            j = self._joined
            self.sm.set_membership(membership.encode(), j.index if j else 0, j.removed if j else ())
        else:
            if c.join and not c.force_new_cluster and set(membership.ids) == {c.id}:
                # (a node that joined has the cluster's members: this one made a cluster of
                # its own, started once without --peers, say, where --join would be ignored)
                raise BadRequest(
                    f"--join {c.join}: this data dir ({c.data_dir}) already holds a cluster of its own, whose only member "
                    f"is {c.id}; a join starts from an empty data dir (give another --data-dir), or drop --join to run that cluster"
                )
            if c.peers:
                bootstrap.check_peers(c.data_dir, c.id, c.peers, membership.ids)
            self.say_if_moved(membership)
        return self.sm, membership

    def say_if_moved(self, membership: Membership) -> None:
        """A restart whose --peers gives this member another peer address than the
        membership it holds. Moved there with `kv member add ID PEER --replace` while it was
        down (cluster.md's way), it is reached there and learns so; otherwise the others
        dial the old address (and their own --peers entry for it), nothing reaches it, and
        it waits as a pre-candidate for ever. It listens where it is told, and says which."""
        c = self.config
        me, listen = membership.get(c.id), c.peers.get(c.id)
        if me is None or not me.peer_addr or not listen or listen == me.peer_addr:
            return
        held = f"the membership it holds (as of index {self.sm.membership_index})" if self.sm.membership_index else "the membership it began with"
        log.warning(
            "node %s: --peers gives its peer address as %s, but %s has %s. Unless the cluster was told it moved while it was "
            "down (kv member add %s %s --replace: then the leader reaches it shortly), the other members dial it there and "
            "nothing reaches it: tell the cluster so now, or start it again with %s=%s in --peers",
            c.id, listen, held, me.peer_addr, c.id, listen, c.id, me.peer_addr,
        )

    def rebuild_state(self, damage: StateCorrupt) -> LevelDBStateMachine:
        """The state machine is damaged: set it aside and start an empty one, which
        reconcile fills from the newest snapshot and the ledger — if they cover it."""
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

    def reconcile(self) -> None:
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

    def replay_sessions(self) -> None:
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

    def force_new_cluster(self) -> None:
        """`--force-new-cluster`: the majority is lost for good, so make this member the
        only one, keeping its data (etcd's flag of that name). A CONFIG entry naming only
        this node goes at the end of its log; alone, it elects itself and commits its whole
        log, that entry included. The old members count as removed from then on (their
        connections are refused): each is added back from an empty data dir."""
        c, ledger = self.config, self.ledger
        if ledger.last_index() == 0:
            raise BadRequest(f"--force-new-cluster recovers an existing member's data, and {c.data_dir} holds none")
        if ledger.last_index() < self.sm.membership_index:  # (its entry would be older than the membership it holds)
            raise BadRequest(
                f"--force-new-cluster: {c.id} joined the cluster at index {self.sm.membership_index} and its log ends at "
                f"{ledger.last_index()}: it never caught up. Force a member that did (kv status: the highest applied index)"
            )
        old = self.membership()
        me = old.get(c.id)
        peer = c.peers.get(c.id) or (me.peer_addr if me else "")
        alone = Membership.of([Member(c.id, peer, c.advertise_url or (me.http_url if me else ""), True)])
        last = ledger.last_index()
        ledger.write([LedgerWrite(entries_from=last + 1, entries=[Entry(last + 1, ledger.term(last), EntryKind.CONFIG, alone.encode())])])
        log.warning(
            "node %s: --force-new-cluster: now the only member of a new one-member cluster, with its data up to index "
            "%d (members before: %s). Restart this node without the flag, then add the others back from empty data "
            "dirs with kv serve --join <this node's URL> (docs/cluster.md, \"A majority lost for good\")",
            c.id, last, ", ".join(sorted(old.ids)) or "none",
        )

    def membership(self) -> Membership:
        stored = self.sm.membership()
        if stored:
            return Membership.decode(stored)
        if self._joined is not None:
            return self._joined.membership
        c = self.config
        me_url = c.advertise_url
        return Membership.of(Member(i, addr, me_url if i == c.id else "") for i, addr in (c.peers or {c.id: ""}).items())
