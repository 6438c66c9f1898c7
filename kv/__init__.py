"""ledgerkv: an embedded key-value store on a Raft replicated log.

Layering, bottom up (each layer imports only the ones below it):

- ``kv.raft``         the pure Raft core (no I/O), the LMDB ledger, the TCP transport and
                      the asyncio driver that ties them together.
- ``kv.statemachine`` KV commands, the LevelDB state machine and the FSM caller.
- ``kv.snapshot``     snapshot files, the snapshot directory, install-snapshot, restore.
- ``kv.common``       what both sides share: result types, arguments, the JSON wire form, sessions.
- ``kv.server``       a member's machinery: write path, lessor, watch hub, metrics, recovery.
- ``kv``              the public face: ``kv.open``, ``kv.Node``; ``kv.store``, ``kv.node``.
- ``kv.client``       the HTTP clients and their recipes (lease, lock, election).
- ``kv.http``         the aiohttp application; it uses the public ``kv`` API only.
- ``kv.spark``, ``kv.cli``, ``kv.bench``  the pipeline, the command line, the benchmarks.
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

from .errors import (  # noqa: E402
    BadRequest,
    Compacted,
    Conflict,
    DataDirLocked,
    Forbidden,
    FutureRevision,
    KeyNotFound,
    KVError,
    LeaseExists,
    LeaseNotFound,
    MemberExists,
    NoQuorum,
    NoSpace,
    NotFound,
    NotLeader,
    PreconditionFailed,
    ReadsOmitted,
    RevisionCompacted,
    SessionExpired,
    SnapshotError,
    Timeout,
    Unauthorized,
    Unavailable,
    ValueTooLarge,
    WrongCluster,
)
from .common.results import BulkRefusal, BulkResult, DeleteResult, Event, Item, LeaseStatus, Page, PrefixDeleteResult, RevokeResult, TxnResult, WriteResult  # noqa: E402
from .common.sessions import RequestId  # noqa: E402
from .errors import SlowWatcher, WatchCompacted  # noqa: E402
from .statemachine.commands import Cond, Delete, Get, Put  # noqa: E402

__all__ = [
    "AsyncClient",
    "BadRequest",
    "BulkRefusal",
    "BulkResult",
    "Client",
    "Compacted",
    "Cond",
    "Conflict",
    "DataDirLocked",
    "Delete",
    "DeleteResult",
    "Event",
    "Forbidden",
    "FutureRevision",
    "Get",
    "Item",
    "KeyNotFound",
    "KVError",
    "LeaseExists",
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
    "RevisionCompacted",
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
    "WrongCluster",
    "WriteResult",
    "open",
]


# Imported on first use: the server's names load lmdb, plyvel and the Raft stack, which a
# client-only user neither needs nor may have installed; the clients load aiohttp, which an
# embedded kv.open() user need not pay for.
_LAZY = {
    "AsyncClient": "kv.client",
    "Client": "kv.client",
    "Node": "kv.node",
    "NodeConfig": "kv.server.config",
    "Store": "kv.store",
    "open": "kv.store",
    "Watch": "kv.server.watch",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
