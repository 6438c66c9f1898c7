"""ledgerkv: an embedded key-value store on a Raft replicated log.

Layering, bottom up (each layer imports only the ones below it):

- ``kv.raft``         the pure Raft core (no I/O), the LMDB ledger, the TCP transport and
                      the asyncio driver that ties them together.
- ``kv.statemachine`` KV commands, the LevelDB state machine and the FSM caller.
- ``kv.snapshot``     snapshot files, the snapshot directory, install-snapshot, restore.
- ``kv``              the public face: ``kv.open``, ``kv.Node``, ``kv.Client``; ``kv.cli`` the command line.
- ``kv.http``         the aiohttp application; it uses the public ``kv`` API only.
"""

from __future__ import annotations

import os as _os

# In a source checkout the sub-packages live in folders beside this one (raft/, http/, ...),
# without __init__.py files so that a top-level `http` never shadows the standard library.
# Appending the repository root to our own __path__ makes `kv.raft` find `raft/`. An
# installed wheel has them copied under kv/ already, so this only runs from a checkout.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isdir(
    _os.path.join(_root, "raft")
):
    if _root not in __path__:
        __path__.append(_root)

__version__ = "0.1.0"

import logging as _logging  # noqa: E402

# A library is quiet unless its user configures logging (the kv command line does): without
# this, Python printed ledgerkv's warnings, CLI hints and all, on the program's stderr.
_logging.getLogger("kv").addHandler(_logging.NullHandler())

from .config import NodeConfig  # noqa: E402
from .errors import (  # noqa: E402
    BadRequest,
    Compacted,
    Conflict,
    DataDirLocked,
    Forbidden,
    KVError,
    LeaseNotFound,
    MemberExists,
    NoQuorum,
    NoSpace,
    NotFound,
    NotLeader,
    PreconditionFailed,
    ReadsOmitted,
    SessionExpired,
    SnapshotError,
    Timeout,
    Unauthorized,
    Unavailable,
    ValueTooLarge,
)
from .node import DeleteResult, Item, LeaseStatus, Node, Page, PrefixDeleteResult, RevokeResult, TxnResult, WriteResult  # noqa: E402
from .sessions import RequestId  # noqa: E402
from .statemachine.commands import Cond, Delete, Get, Put  # noqa: E402
from .store import Store, open  # noqa: E402,A004
from .watch import Event, SlowWatcher, Watch, WatchCompacted  # noqa: E402

__all__ = [
    "AsyncClient",
    "BadRequest",
    "Client",
    "Compacted",
    "Cond",
    "Conflict",
    "DataDirLocked",
    "Delete",
    "DeleteResult",
    "Event",
    "Forbidden",
    "Get",
    "Item",
    "KVError",
    "LeaseNotFound",
    "LeaseStatus",
    "MemberExists",
    "Node",
    "NodeConfig",
    "NoQuorum",
    "NoSpace",
    "NotFound",
    "NotLeader",
    "Page",
    "PreconditionFailed",
    "PrefixDeleteResult",
    "Put",
    "ReadsOmitted",
    "RequestId",
    "RevokeResult",
    "SessionExpired",
    "SlowWatcher",
    "SnapshotError",
    "Store",
    "Timeout",
    "TxnResult",
    "Unauthorized",
    "Unavailable",
    "ValueTooLarge",
    "Watch",
    "WatchCompacted",
    "WriteResult",
    "open",
]


def __getattr__(name: str):
    # The HTTP clients pull in aiohttp; an embedded kv.open() user need not pay for that.
    if name in ("Client", "AsyncClient"):
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module 'kv' has no attribute {name!r}")
