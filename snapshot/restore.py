"""Offline restore: seed a node of a new cluster from a snapshot file (like `etcdctl
snapshot restore`). Every member restored from the same file with the same --peers starts
at the same (index, term) with the same fresh membership, so they agree from the start;
and with the same new cluster id, not the old cluster's (restored_cluster_id), so that a
member still running in the old cluster and a restored one never take each other for
peers (raft/transport.py)."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Collection

from ..raft.ledger import Ledger, LedgerWrite
from ..raft.membership import Member, Membership
from ..raft.messages import HardState
from ..statemachine.leveldb import LevelDBStateMachine
from .format import BLOCK_BYTES, SnapshotError, SnapshotFormatError, SnapshotHeader, Trailer, iter_records, new_header, read_header, verify
from .store import SnapshotStore


class RestoreError(SnapshotError):
    """A snapshot cannot seed this data dir (the file, --peers, a data dir not empty)."""


def check_file(snapshot_file: str) -> tuple[SnapshotHeader, Trailer]:
    """Verify every byte of a snapshot file (header fields, blocks, keys, checksums): done
    before any data dir is touched."""
    try:
        return verify(snapshot_file)
    except (SnapshotFormatError, OSError) as e:
        raise RestoreError(f"{snapshot_file} cannot be restored: {e}") from e


def restored_cluster_id(old: str, trailer: Trailer, group: str, peers: Collection[str]) -> str:
    """The new cluster's id: the same for each member restored from one file with one
    --peers (each restore computes it alone), another than the old cluster's."""
    seed = "|".join(("restore", old, str(trailer.crc), str(trailer.records), group, ",".join(sorted(peers))))
    return hashlib.blake2b(seed.encode(), digest_size=8).hexdigest()


def restore(
    snapshot_file: str,
    data_dir: str,
    node_id: str,
    peers: dict[str, str],
    *,
    group: str = "default",
    http_urls: dict[str, str] | None = None,
    progress: Callable[[str], None] | None = None,
    checked: tuple[SnapshotHeader, Trailer] | None = None,
) -> dict:
    """Create data_dir for node_id from snapshot_file; returns a summary. `checked`: what
    check_file(snapshot_file) returned, when the caller verified the file already."""
    say = progress or (lambda _m: None)
    if node_id not in peers:
        raise RestoreError(f"--peers must list the restored node {node_id!r}")
    # The caller may hold the data dir's lock (a file named LOCK in it): that is not content.
    if os.path.exists(data_dir) and set(os.listdir(data_dir)) - {"LOCK"}:
        raise RestoreError(f"{data_dir} is not empty: restore only seeds a new, empty data dir (pick another or remove it)")
    if checked is None:
        say(f"verifying {snapshot_file} ...")
        checked = check_file(snapshot_file)
    header, trailer = checked
    membership = Membership.of(Member(i, addr, (http_urls or {}).get(i, "")) for i, addr in peers.items())
    os.makedirs(data_dir, exist_ok=True)
    try:
        say(f"loading {trailer.records} records ...")
        sm = LevelDBStateMachine(os.path.join(data_dir, "state"))
        try:
            with open(snapshot_file, "rb") as f:
                _, offset = read_header(f)
                n = sm.restore(header.index, header.term, membership.encode(), iter_records(f, offset))
            sm.set_cluster_id(restored_cluster_id(sm.cluster_id, trailer, group, peers))
            # The new cluster's first snapshot: the same data under the new membership (it is
            # what a member added later receives).
            view = sm.capture()
            try:
                fresh = new_header(header.index, header.term, membership.encode(), group, node_id, sm.cluster_id)
                SnapshotStore(os.path.join(data_dir, "snapshots")).write(fresh, view.blocks(BLOCK_BYTES))
            finally:
                view.release()
        finally:
            sm.close()
        ledger = Ledger(os.path.join(data_dir, "ledger"), node_id, group)
        try:
            ledger.write([LedgerWrite(hard_state=HardState(header.term, None), reset_to=(header.index, header.term))])
        finally:
            ledger.close()
    except BaseException:
        shutil.rmtree(data_dir, ignore_errors=True)
        raise
    return {"index": header.index, "term": header.term, "keys": n, "members": sorted(peers), "data_dir": data_dir}
