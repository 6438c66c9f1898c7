"""`python -m kv.cli.supervise PARENT GRACE COMMAND ARGS...`: how `kv lock` runs a command so
that it never outlives the lock.

The command runs in its own process group (so that a signal reaches whatever it started,
a shell's children too). This process stays beside it:

- SIGTERM or SIGINT (from `kv lock`, which was told to stop) is passed to the whole group;
  what is still running GRACE seconds later gets SIGKILL; SIGUSR1 (the lock was lost, so
  another holder may have it already) kills the group at once;
- if `kv lock` (PARENT) dies — even by SIGKILL — the kernel sends this process SIGTERM
  (Linux's PR_SET_PDEATHSIG), and the same happens. `kv lock` passes half the lock's ttl as
  GRACE: the group is gone before the lease can expire and the next waiter start;
- otherwise it exits with the command's status.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the lease's expiry is the only guard
        pass
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str]) -> int:
    parent, grace, command = int(argv[0]), float(argv[1]), argv[2:]
    got: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, lambda s, _f: got.append(s))
    _die_with_parent(parent)
    if got:
        return 128 + got[0]
    try:
        child = subprocess.Popen(command, start_new_session=True)
    except OSError as e:
        print(f"kv lock: cannot run {command[0]}: {e.strerror}", file=sys.stderr)
        return 127
    while child.poll() is None and not got:
        try:
            child.wait(0.1)
        except subprocess.TimeoutExpired:
            pass
    if not got:
        return child.returncode if child.returncode >= 0 else 128 - child.returncode  # killed by a signal: 128 + it
    if got[0] == signal.SIGUSR1:
        _stop_group(child, signal.SIGKILL, 0.0)
        return 128 + signal.SIGKILL
    _stop_group(child, got[0], grace)
    return 128 + got[0]


def _stop_group(child: subprocess.Popen, sig: int, grace: float) -> None:
    """Signal the command's whole group; SIGKILL it after `grace` seconds if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, sig)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if child.poll() is not None and not _group_alive(child.pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
