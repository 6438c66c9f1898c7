"""One owner per data dir: an exclusive `fcntl.flock` on DIR/LOCK, held for the owner's life.

kv.open, kv.Node, `kv serve`, `kv cluster up` and `kv snapshot restore` take it before they
read or create anything else in the directory. The lock is on an open file description, so a
second opener is refused whether it is another process or the same one; the kernel drops the
lock when the owner exits, even by kill -9, so there is never a stale lock to clean up. The
holder's pid is written in the file only to name it in the refusal.
"""

from __future__ import annotations

import errno
import fcntl
import os

from ..errors import BadRequest, DataDirLocked

LOCK_NAME = "LOCK"
LEDGER_NAME = "ledger"  # the node's log (LMDB): a data dir without it holds no node yet


def holds_a_node(data_dir: str) -> bool:
    """Whether a node has run in this data dir (its ledger exists): a --join starts only
    from one that has not, and `kv cluster up` says when it resumes one that has."""
    return os.path.exists(os.path.join(data_dir, LEDGER_NAME))


def members_within(data_dir: str) -> list[str]:
    """The subdirectories of data_dir a node has run in, by name (kv cluster up's layout:
    one data dir a member, named by its id)."""
    try:
        names = sorted(os.listdir(data_dir))
    except OSError:
        return []
    return [n for n in names if holds_a_node(os.path.join(data_dir, n))]


class DataDirLock:
    """Held from acquire() until release() (or the end of the process)."""

    def __init__(self, data_dir: str, fd: int) -> None:
        self.data_dir, self._fd = data_dir, fd

    @classmethod
    def acquire(cls, data_dir: str, *, of_members: bool = False) -> DataDirLock:
        """Create data_dir if needed and lock it; raise DataDirLocked, changing nothing,
        when another owner holds it. A member's data dir (of_members False) must not be
        kv cluster up's, which holds members' dirs (of_members True), nor the other way
        round: a store opened on the parent of three stopped members came up empty beside
        them (and a cluster made inside a member's dir mixed its files with theirs)."""
        try:
            os.makedirs(data_dir, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            what = "it is a file" if os.path.isfile(data_dir) else "a directory on its path is a file"
            raise BadRequest(f"cannot use {data_dir} as the data dir: {what}; give a directory (it is made if absent)") from None
        fd = os.open(os.path.join(data_dir, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_pid(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise DataDirLocked(data_dir, holder) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        lock = cls(data_dir, fd)
        try:
            _check_layout(data_dir, of_members)
        except BaseException:
            lock.release()
            raise
        return lock

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        # The file stays: unlinking it would let a third opener lock a new inode while a
        # second one still waits on the old.
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _check_layout(data_dir: str, of_members: bool) -> None:
    if holds_a_node(data_dir):
        if of_members:
            raise BadRequest(
                f"{data_dir} is a member's data dir (it holds a ledger), not one for kv cluster up, which makes a dir "
                "for each member inside its --data-dir: give another"
            )
        return
    members = [] if of_members else members_within(data_dir)
    if members:
        raise BadRequest(
            f"{data_dir} is not a member's data dir: it holds those of {', '.join(members)} (kv cluster up's layout). "
            f"Give one of them, {os.path.join(data_dir, members[0])} say, while its member is stopped; "
            "or reach the running cluster with kv.Client or the CLI's --endpoints"
        )


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
