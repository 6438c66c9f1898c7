"""Crash points for fault tests.

`KV_FAILPOINTS="ledger.before_commit,snapshot.mid_write@3"` makes the process die abruptly
(os._exit, like kill -9: no flush, no cleanup) when it reaches a named point — the first
time, or the N-th time with @N. Unset, `hit()` costs one set lookup.

Points: ledger.before_commit, ledger.after_commit, hardstate.before_save,
hardstate.after_save, snapshot.mid_write, snapshot.after_rename, install.mid_receive,
install.after_adopt, install.after_reset, start.before_membership (a node's first start: its
ledger made, the membership it starts from not recorded yet).

Failure points raise InjectedFailure instead (`raise_at()`), to test how the code around
them copes: apply.raise (the state machine fails to apply a batch of committed entries).

Delay points hold the code there for a while, every time (`delay()`: `name~SECONDS` in
KV_FAILPOINTS), to widen a window for a fault test: write.before_answer (the leader holds
the answer to a write that is applied, so that a kill there leaves it committed and
unacknowledged), snapshot.mid_write (a snapshot being written holds its view of the state
after each block).
"""

from __future__ import annotations

import os

EXIT_CODE = 86


def _parse(spec: str) -> tuple[dict[str, int], dict[str, float]]:
    armed, delays = {}, {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        if "~" in item:
            name, _, seconds = item.partition("~")
            delays[name] = float(seconds)
            continue
        name, _, nth = item.partition("@")
        armed[name] = int(nth) if nth else 1
    return armed, delays


_armed, _delays = _parse(os.environ.get("KV_FAILPOINTS", ""))


def delay(name: str) -> float:
    """The seconds to hold at this point (0 unless armed with name~SECONDS)."""
    return _delays.get(name, 0.0)


def hit(name: str) -> None:
    if name in _armed:
        _armed[name] -= 1
        if _armed[name] <= 0:
            os.write(2, f"failpoint {name}: crashing now\n".encode())
            os._exit(EXIT_CODE)


class InjectedFailure(RuntimeError):
    """Raised by an armed failure point."""


def raise_at(name: str) -> None:
    if name in _armed:
        _armed[name] -= 1
        if _armed[name] <= 0:
            raise InjectedFailure(f"failpoint {name}")
