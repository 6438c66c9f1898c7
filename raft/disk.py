"""The disk under a data dir: how much is free, and whether an error means it is full.

A full disk shows up as ENOSPC ("No space left on device"), and on a full tmpfs also as EIO
("Input/output error") from LMDB or LevelDB: told apart here, so that a node says what is
wrong and waits for space instead of stopping (kv/server/diskguard.py)."""

from __future__ import annotations

import errno
import os

DISK_RETRY_S = 1.0  # a write that found the disk full is tried again this often
EIO_AFTER_FULL_S = 30.0  # how long after a full disk an EIO is still taken for it (raft/node.py)


def free_bytes(path: str) -> int:
    """Bytes free for an unprivileged writer on the filesystem holding path."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _chain(exc: BaseException):
    """exc and what caused it, in turn."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _eio(e: BaseException) -> bool:
    return getattr(e, "errno", None) == errno.EIO or "Input/output error" in str(e)


def is_io_error(exc: BaseException) -> bool:
    """Whether exc (or what caused it) is EIO."""
    return any(_eio(e) for e in _chain(exc))


def is_disk_full(exc: BaseException, path: str) -> bool:
    """Whether exc (or what caused it) is the disk at path being full."""
    for e in _chain(exc):
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e):
            return True
        if _eio(e):
            try:
                return free_bytes(path) < 1 << 20  # EIO where nothing is left: a full tmpfs
            except OSError:
                return False
    return False
