"""What becomes of a command's outcome for its caller: the layers' own errors turned into
the public ones (kv/errors.py), and the state machine's results into the store API's
(kv/common/results.py). One place, so that every face answers alike."""

from __future__ import annotations

from ..common.results import BulkRefusal, BulkResult, DeleteResult, Item, LeaseStatus, PrefixDeleteResult, TxnResult, WriteResult
from ..errors import BadRequest, Conflict, KVError, LeaseNotFound, NoSpace, PreconditionFailed, ReadsOmitted, SessionExpired, Timeout, Unavailable
from ..raft.errors import ConfigChangeRefused, TransferInProgress
from ..raft.node import Applied, DeadlineExceeded, NodeStopped, OutcomeUnknown, Overloaded
from ..statemachine import commands as cmds
from ..statemachine.leveldb import StateUnreadable


def public_error(
    e: KVError, *, written: bool = False, wait: float = 0.0, fix: str = "read from another member meanwhile", check: str = "read the key"
) -> KVError:
    """The one place where the layers' own errors become the public ones of kv/errors.py.
    `written`: the request may have been appended, so a stop or a missed deadline leaves its
    outcome unknown (Timeout) rather than refused (Unavailable), and `check` says how to find
    it out; `fix`: what a reader of a state machine it cannot read (damaged, or loading a
    snapshot) should do."""
    if written and isinstance(e, (OutcomeUnknown, NodeStopped)):
        return unknown_outcome(e, wait, check)
    if isinstance(e, (Overloaded, NodeStopped)):
        return Unavailable(str(e))
    if isinstance(e, (ConfigChangeRefused, TransferInProgress)):
        return Conflict(str(e))
    if isinstance(e, cmds.CommandError):
        return BadRequest(str(e))
    if isinstance(e, StateUnreadable):  # (damaged, or a snapshot being loaded into it)
        return Unavailable(f"{e}; {fix}")
    return e


def session_answer(applied: Applied, session: int, seq: int, unknown: Exception | None, resent: bool) -> Applied:
    """A session request's answer, or the error that says why it was not applied."""
    r = applied.result
    if type(r) is cmds.SessionExpired:
        if resent or unknown is not None:  # an earlier copy may have been applied before it closed
            raise Timeout(
                f"the write was sent again after its outcome was unknown ({unknown or 'the caller resent it'}), and by then its "
                f"session {session} had closed (idle longer than --session-ttl-s, or evicted beyond --max-sessions): "
                "the first copy may or may not have been applied; read the key before retrying"
            )
        raise SessionExpired(session)
    if type(r) is cmds.StaleRequest:
        raise Conflict(
            f"request {r.seq} of session {r.session} is numbered below its last one ({r.last_seq}), and was not applied: "
            "a session carries one request at a time, numbered upwards (a copy of the last one gets its answer again)"
        )
    if type(r) is cmds.RequestMismatch:
        raise Conflict(
            f"request {r.seq} of session {r.session} was a different write, applied before; this one was not applied: "
            "number each new write with the next number (the same number is for sending the same write again)"
        )
    return applied


def encode_command(cmd: cmds.Command) -> bytes:
    try:
        return cmds.encode(cmd)
    except cmds.CommandError as e:
        raise public_error(e) from e


def unknown_outcome(e: Exception, wait: float, check: str = "read the key") -> Timeout:
    """The error for a write whose outcome cannot be known any more (`check`: how to find
    it out)."""
    if isinstance(e, DeadlineExceeded):
        return Timeout(f"the write was not confirmed within {wait:.1f}s; it may or may not have been committed: {check} before retrying")
    if isinstance(e, OutcomeUnknown):
        return Timeout(f"{e}: {check} before retrying")
    return Timeout(f"the node stopped before the write was confirmed; it may or may not have been committed ({e})")


def lease_status(r: cmds.LeaseInfo) -> LeaseStatus:
    return LeaseStatus(r.lease, r.ttl_ms / 1000, r.remaining_ms / 1000, r.keys)


NOSPACE_ALARM = "a NOSPACE alarm is raised on the cluster (etcd's Alarm API): writes that add data are refused until it is cleared"


def raise_failed(result):
    if isinstance(result, cmds.NoSuchLease):
        raise LeaseNotFound(result.lease)
    if isinstance(result, cmds.ConditionFailed):
        raise PreconditionFailed(result.key, result.mod_index)
    if isinstance(result, cmds.CommandError):
        raise public_error(result)
    if isinstance(result, cmds.SpaceExceeded):
        raise NoSpace(NOSPACE_ALARM)
    return result


def prefix_delete_result(applied: Applied) -> PrefixDeleteResult:
    r = raise_failed(applied.result)
    return PrefixDeleteResult(r.index, applied.term, len(r.keys))


def write_result(applied: Applied) -> WriteResult:
    return WriteResult(raise_failed(applied.result).index, applied.term)


def bulk_result(applied: Applied, cmd: cmds.Bulk) -> BulkResult:
    r = raise_failed(applied.result)
    keys = cmd.rows.keys() if r.refused else ()
    refused = tuple(BulkRefusal(i, cmds.key_text(keys[i]), m, bool(h)) for i, m, h in zip(r.refused, r.mod_indexes, r.held))
    return BulkResult(r.index, applied.term, cmd.rows.n - len(refused), refused)


def delete_result(applied: Applied) -> DeleteResult:
    r = raise_failed(applied.result)
    return DeleteResult(r.index, applied.term, r.deleted)


def txn_result(applied: Applied) -> TxnResult:
    r = raise_failed(applied.result)
    out = []
    written = WriteResult(r.index, applied.term)  # every put of a txn has the txn's index
    omitted = []
    for x in r.results:
        if isinstance(x, cmds.PutResult):
            out.append(written)
        elif isinstance(x, cmds.DeleteApplied):
            out.append(DeleteResult(x.index, applied.term, x.deleted))
        elif isinstance(x, cmds.GetOmitted):
            omitted.append(x.key)
            out.append(None)
        else:
            out.append(Item(x.key, x.value, x.mod_index) if x.value is not None else None)
    if omitted:
        raise ReadsOmitted(r.index, applied.term, r.succeeded, tuple(out), omitted)
    return TxnResult(r.index, applied.term, r.succeeded, tuple(out))


def validate_key(key: str) -> str:
    """Raise BadRequest unless key is a non-empty UTF-8 string within the length limit."""
    try:
        cmds.check_key(key)
    except cmds.CommandError as e:
        raise public_error(e) from None
    return key


def condition(key: str, if_mod_index: int | None, if_absent: bool, if_exists: bool = False) -> cmds.Cond | None:
    if if_absent + if_exists + (if_mod_index is not None) > 1:
        raise BadRequest("give at most one of if_mod_index, if_absent and if_exists")
    if if_exists:
        return cmds.Cond(key, "exists", True)
    if if_absent:
        return cmds.Cond(key, "mod", 0)
    if if_mod_index is not None:
        if if_mod_index < 0:
            raise BadRequest("if_mod_index must be >= 0")
        return cmds.Cond(key, "mod", int(if_mod_index))
    return None
