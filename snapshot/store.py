"""The snapshot directory of a node: snap-<index>-<term>.lkvs files, newest kept.

A snapshot is written under a temporary name, fsynced, renamed and the directory fsynced
(hashicorp's FileSnapshotStore), so a crash leaves either the old set or the new one. The
newest `keep` files are kept; a corrupt newest file is skipped for an older valid one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .format import Block, SnapshotFormatError, SnapshotHeader, fsync_dir, verify, write_snapshot

log = logging.getLogger("kv.snapshot")

_NAME = re.compile(r"^snap-(\d{20})-(\d{20})\.lkvs$")


@dataclass(frozen=True, slots=True)
class SnapshotFile:
    path: str
    index: int
    term: int


class SnapshotStore:
    def __init__(self, path: str, keep: int = 3) -> None:
        self.path = path
        self.keep = keep
        # A snapshot taken (a worker thread) and one received from the leader (the ledger
        # writer's) can land at once: each prunes, and one unlinked what the other had
        # listed (FileNotFoundError: the node stopped on it).
        self._pruning = threading.Lock()
        os.makedirs(path, exist_ok=True)
        for name in os.listdir(path):
            if name.startswith("tmp-"):  # left over by a crash while writing
                os.unlink(os.path.join(path, name))

    def file_name(self, index: int, term: int) -> str:
        return os.path.join(self.path, f"snap-{index:020d}-{term:020d}.lkvs")

    def list(self) -> list[SnapshotFile]:
        """Snapshot files, newest first."""
        out = []
        for name in os.listdir(self.path):
            m = _NAME.match(name)
            if m:
                out.append(SnapshotFile(os.path.join(self.path, name), int(m.group(1)), int(m.group(2))))
        out.sort(key=lambda s: (s.index, s.term), reverse=True)
        return out

    def newest(self) -> SnapshotFile | None:
        files = self.list()
        return files[0] if files else None

    def newest_valid(self, min_index: int = 0) -> tuple[SnapshotFile, SnapshotHeader] | None:
        """The newest snapshot that verifies, with index >= min_index; corrupt ones are
        renamed *.corrupt so they are not tried again, and reported."""
        for s in self.list():
            if s.index < min_index:
                break
            try:
                header, _ = verify(s.path)
                return s, header
            except (SnapshotFormatError, OSError) as e:
                log.error("snapshot %s is unusable (%s); falling back to an older one", s.path, e)
                os.replace(s.path, s.path + ".corrupt")
        return None

    def write(
        self,
        header: SnapshotHeader,
        blocks: Iterable[Block],
        progress: Callable[[int, int], None] | None = None,
    ) -> SnapshotFile:
        final = self.file_name(header.index, header.term)
        tmp = os.path.join(self.path, f"tmp-{os.getpid()}-{os.path.basename(final)}")
        try:
            with open(tmp, "wb", buffering=1 << 20) as f:
                write_snapshot(f, header, blocks, progress)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            fsync_dir(self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        self.prune()
        return SnapshotFile(final, header.index, header.term)

    def adopt(self, received: str, index: int, term: int) -> SnapshotFile:
        """Make a verified file received from the leader one of ours (the newest)."""
        final = self.file_name(index, term)
        os.replace(received, final)
        fsync_dir(self.path)
        self.prune()
        return SnapshotFile(final, index, term)

    def prune(self) -> None:
        with self._pruning:
            for s in self.list()[self.keep :]:
                with contextlib.suppress(FileNotFoundError):  # (removed by hand, say)
                    os.unlink(s.path)
