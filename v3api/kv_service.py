"""etcd's KV service: Range, Put, DeleteRange and Txn on kv.Node.

A Range is a read on this node after the read barrier its `serializable` flag asks for
(linearizable by default, as etcd's); Put and DeleteRange are transactions of one op; a
Txn is one committed entry (kv.Node.etcd_txn). What a request asks is checked here, before
anything is proposed: keys, duplicate keys among a transaction's writes, the op limit."""

from __future__ import annotations

import grpc

from kv.common.sessions import Slot
from kv.statemachine import commands as cmds

from . import wire
from .access import Access
from .proto import rpc_pb2, rpc_pb2_grpc
from .wire import Abort


def is_get(r: rpc_pb2.RangeRequest) -> bool:
    """A Range of one key as of now with every option at its default: etcd's get, the
    common call, answered without a range's machinery (KVService.get)."""
    return not (
        r.range_end or r.revision > 0 or r.keys_only or r.count_only or r.sort_order or r.sort_target
        or r.min_mod_revision or r.max_mod_revision or r.min_create_revision or r.max_create_revision
    )


def is_plain(p: rpc_pb2.PutRequest) -> bool:
    """A put with every option at its default: the common one, a plain Put of the state machine."""
    return not (p.prev_kv or p.lease or p.ignore_value or p.ignore_lease)


# Keys a transaction's compares may read, ranges counted key by key (~2 µs a key on every
# node, on its event loop): 20 ms of each node's time at most.
MAX_COMPARED_KEYS = 10_000


class KVService(rpc_pb2_grpc.KVServicer):
    def __init__(self, node, access: Access) -> None:
        self.node, self.access = node, access
        self.header = wire.Headers(node)
        self.max_ops = node.config.max_txn_ops
        self.after_barrier = {"Range": GetsAfterOneBarrier(self)}  # (rpc.RpcServer)
        self.at_once = {"Put": PutsAtOnce(self)}

    async def Range(self, request, context):
        async with self.access(context, "read", [(request.key, request.range_end)]):
            consistency = "stale" if request.serializable else "linearizable"
            if is_get(request):
                key = wire.range_start(request.key, b"")
                return self.get(key, await self.node.read_barrier(consistency))
            req = wire.range_req(request)
            revision = request.revision if request.revision > 0 else None
            if request.limit > 0 and wire.reads_whole(request) and not (request.keys_only or request.count_only) and request.sort_target != rpc_pb2.RangeRequest.VALUE:
                return await self._sorted_page(request, req, consistency, revision)
            got, index = await self.node.etcd_range(req, consistency=consistency, revision=revision)
            self.check_whole(req, got)
            return wire.finish_range(request, got, self.header(index))

    def get(self, key: bytes, index: int) -> rpc_pb2.RangeResponse:
        """etcd's answer to a get of key, read after a barrier that returned `index`."""
        kv = self.node.etcd_key(key)
        return rpc_pb2.RangeResponse(header=self.header(index), kvs=(wire.kv_message(kv),) if kv else (), count=1 if kv else 0)

    async def _sorted_page(self, request, req: cmds.RangeReq, consistency: str, revision: int | None) -> rpc_pb2.RangeResponse:
        """A limited range sorted (by anything but the value) or filtered: every key's
        revisions first, without values (the read budget counts the keys alone), then the
        values of the keys chosen, read at the same revision: "the 10 keys changed last"
        under a prefix of gigabytes costs its keys and 10 values."""
        got, index = await self.node.etcd_range(req._replace(keys_only=True), consistency=consistency, revision=revision)
        self.check_whole(req, got)
        chosen, more = wire.select(request, got.kvs, got.more)
        kvs, budget = [], self.node.config.max_txn_read_bytes
        for kv in chosen:
            full, _ = await self.node.etcd_range(cmds.RangeReq(cmds.key_bytes(kv.key)), consistency="stale", revision=revision or index)
            kvs += full.kvs
            budget -= len(kv.key) + sum(len(x.value) for x in full.kvs)
            if budget < 0:
                raise self._over_budget()
        return rpc_pb2.RangeResponse(header=self.header(index), kvs=[wire.kv_message(kv) for kv in kvs], more=more, count=got.count)

    async def Put(self, request, context):
        # A put to a lease takes the Lease service's role: a token scoped to a prefix would
        # otherwise attach its keys to leases it cannot see (ledgerkv's HTTP API hides them).
        async with self.access(context, "lease" if request.lease else "write", [(request.key, b"")]):
            if is_plain(request):
                # The common put as a plain Put: the state machine's hot path, with the same
                # effect as a TxnReq of one PutReq (revision, version, the lease detached).
                # (On the leader, PutsAtOnce serves it without this task.)
                return await self.answer_put(await self.node.put(wire.key_of(request.key), request.value))
            req = self.put_req(request)
            if request.lease and request.ignore_value:
                # A Put checks its lease before its key (a Txn's puts, which the state
                # machine checks, the other way round): as etcd's, whose two differ.
                await self.node.read_barrier("linearizable")
                if self.node.lease_scope(request.lease) is None:
                    raise Abort(grpc.StatusCode.NOT_FOUND, wire.ERR_LEASE_NOT_FOUND)
            r = await self.node.etcd_txn(cmds.TxnReq((), (req,), ()))
            (put,) = r.responses
            return rpc_pb2.PutResponse(header=self.header(r.index), prev_kv=wire.kv_message(put.prev_kv) if put.prev_kv else None)

    async def answer_put(self, w) -> rpc_pb2.PutResponse:
        """A plain put's answer, once this node has applied it (a follower forwarded it)."""
        await self.node.wait_applied(w.index, timeout=self.node.config.write_timeout_s)
        return rpc_pb2.PutResponse(header=self.header(w.index))

    async def DeleteRange(self, request, context):
        async with self.access(context, "write", [(request.key, request.range_end)]):
            r = await self.node.etcd_txn(cmds.TxnReq((), (delete_req(request),), ()))
            (d,) = r.responses
            return rpc_pb2.DeleteRangeResponse(header=self.header(r.index), deleted=d.deleted, prev_kvs=[wire.kv_message(kv) for kv in d.prev_kvs])

    async def Txn(self, request, context):
        # A transaction that writes nothing is a read (etcd's read-only Txn): a read token
        # may send it, and it is answered after a read barrier, not through the log.
        reads_only = not _writes(request)
        role = "read" if reads_only else "lease" if _puts_to_a_lease(request) else "write"
        async with self.access(context, role, list(txn_keys(request))):
            txn = self.txn_req(request)
            if reads_only:
                r = await self.node.etcd_read_txn(txn)
                self._check_reads(txn, r)
                r = await self._at_revisions(request, r, r.index)
            else:
                if _reads_at_a_revision(request):
                    raise Abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "etcdserver: a Range at a past revision inside a Txn is served only in a transaction that writes nothing "
                        "(ledgerkv): read it on its own, or in a Txn of reads",
                    )
                r = await self.node.etcd_txn(txn)
            return txn_response(request, r, self.header)

    async def _at_revisions(self, request: rpc_pb2.TxnRequest, r: cmds.TxnResp, index: int, left: list[int] | None = None) -> cmds.TxnResp:
        """A transaction of reads whose Ranges ask for a past revision: those read at it (the
        state machine evaluated every range as of `index`, the transaction's revision), as
        etcd's do; a revision after `index` is a future one for the transaction. `left`:
        [the bytes its ranges may still return] (--max-txn-read-bytes, for them all)."""
        if left is None:
            left = [self.node.config.max_txn_read_bytes - cmds.read_bytes(r)]
        responses = list(r.responses)
        for i, op in enumerate(request.success if r.succeeded else request.failure):
            which = op.WhichOneof("request")
            if which == "request_range" and op.request_range.revision > 0:
                rev = op.request_range.revision
                if rev > index:
                    raise Abort(grpc.StatusCode.OUT_OF_RANGE, wire.ERR_FUTURE_REV)
                req = wire.range_req(op.request_range)
                left[0] += cmds.read_bytes(responses[i])  # (what it read as of `index`, replaced)
                if left[0] <= 0:
                    raise self._over_budget(txn=True)
                got, _ = await self.node.etcd_range(req, consistency="stale", revision=rev)
                self.check_whole(req, got)
                left[0] -= cmds.read_bytes(got)
                if left[0] < 0:
                    raise self._over_budget(txn=True)
                responses[i] = got
            elif which == "request_txn":
                responses[i] = await self._at_revisions(op.request_txn, responses[i], index, left)
        return r._replace(responses=tuple(responses))

    async def Compact(self, request, context):
        """Through the log: every node drops the history below the revision, and refuses
        reads and watches there from then on."""
        async with self.access(context, "admin", []):  # every member's history, as etcd's root alone may
            if request.revision <= 0:
                # etcd's compact revision starts at -1: compacting at 0 before any
                # compaction does nothing, and is answered so
                if request.revision == 0 and self.node.compact_revision() == 0:
                    return rpc_pb2.CompactionResponse(header=self.header.now())
                raise Abort(grpc.StatusCode.OUT_OF_RANGE, wire.ERR_COMPACTED)
            await self.node.compact(request.revision)
            return rpc_pb2.CompactionResponse(header=self.header.now())

    def check_whole(self, req: cmds.RangeReq, got: cmds.RangeResp, txn: bool = False) -> None:
        """Refuse a range the node cut short at --max-txn-read-bytes: etcd answers every key
        asked for, and its clients (etcdctl get --prefix) print what they get without paging
        on `more`, so a partial answer would pass for the whole range. (A transaction that
        writes keeps its cut-short ranges, marked `more`: it has been committed by then.)"""
        if not req.count_only and len(got.kvs) < (min(req.limit, got.count) if req.limit > 0 else got.count):
            raise self._over_budget(txn)

    def _over_budget(self, txn: bool = False) -> Abort:
        if txn:
            return Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"etcdserver: the transaction's ranges together hold more than {self.node.config.max_txn_read_bytes} bytes of keys "
                "and values, this node's --max-txn-read-bytes: split it into smaller transactions or ranges (--limit), or raise the limit",
            )
        return Abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"etcdserver: the range holds more than {self.node.config.max_txn_read_bytes} bytes of keys and values, "
            "this node's --max-txn-read-bytes: read it in pages (--limit, or a smaller range), or raise the limit",
        )

    def _check_reads(self, txn: cmds.TxnReq, r: cmds.TxnResp) -> None:
        for op, got in zip(txn.success if r.succeeded else txn.failure, r.responses):
            if type(op) is cmds.RangeReq:
                self.check_whole(op, got, txn=True)
            elif type(op) is cmds.TxnReq:
                self._check_reads(op, got)

    def txn_req(self, request: rpc_pb2.TxnRequest) -> cmds.TxnReq:
        """The transaction to propose, checked as etcd checks it (checkTxnRequest, then
        checkIntervals): every compare and op first — at most --max-txn-ops compares or ops
        per branch, a nested transaction's within what its parent leaves — then that no key
        is written twice along one path."""
        txn = self._checked_txn(request, self.max_ops)
        ops = list(cmds.txn_ops(txn))
        all_of = [txn, *(op for op in ops if type(op) is cmds.TxnReq)]
        if sum(len(t.compares) for t in all_of) > self.max_ops or len(ops) > 2 * self.max_ops:
            # etcd lets each nested transaction hold what its parent leaves: 32 of 32
            # compares each, a request of 30 kB, evaluated 1,024 compares on every node
            # (etcd's text alone: Go's clientv3 knows its errors by their text; docs/etcd.md says why)
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, wire.ERR_TOO_MANY_OPS)
        for branch in (request.success, request.failure):
            check_unique_writes(branch)
        self._weigh_compares(c for t in all_of for c in t.compares)
        return txn

    def _weigh_compares(self, compares) -> None:
        """Refuse a transaction whose compares would read more than MAX_COMPARED_KEYS keys
        (counted on this node's state before it is proposed): each node evaluates every
        compare of a range key by key, on its event loop, as it applies the entry."""
        left = MAX_COMPARED_KEYS
        for c in compares:
            if c.range_end:
                left -= self.node.etcd_keys_in(c.key, c.range_end, left)
                if left < 0:
                    raise Abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"etcdserver: the transaction's compares cover more than {MAX_COMPARED_KEYS} keys (ledgerkv): "
                        "compare fewer or narrower ranges",
                    )

    def _checked_txn(self, request: rpc_pb2.TxnRequest, max_ops: int) -> cmds.TxnReq:
        ops = max(len(request.compare), len(request.success), len(request.failure))
        if ops > max_ops:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, wire.ERR_TOO_MANY_OPS)
        compares = []
        for c in request.compare:
            start = wire.range_start(c.key, c.range_end)
            field = _COMPARED.get(c.target)
            if field is None or not 0 <= c.result <= rpc_pb2.Compare.NOT_EQUAL:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"etcdserver: a compare's target is 0-4 and its result 0-3, not {c.target} and {c.result}")
            # A value given for another target is not this one's (etcd: 0, or "" for VALUE)
            arg = getattr(c, field) if c.WhichOneof("target_union") == field else (b"" if c.target == rpc_pb2.Compare.VALUE else 0)
            compares.append(cmds.Compare(c.target, c.result, start, arg, c.range_end))
        success = tuple(self._op(op, max_ops - ops) for op in request.success)
        failure = tuple(self._op(op, max_ops - ops) for op in request.failure)
        return cmds.TxnReq(tuple(compares), success, failure)

    def _op(self, op: rpc_pb2.RequestOp, max_ops: int):
        which = op.WhichOneof("request")
        if which == "request_range":
            return wire.range_req(op.request_range)
        if which == "request_put":
            return self.put_req(op.request_put)
        if which == "request_delete_range":
            return delete_req(op.request_delete_range)
        if which == "request_txn":
            return self._checked_txn(op.request_txn, max_ops)
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, wire.ERR_KEY_NOT_FOUND)  # (etcd's answer to an empty op)

    def put_req(self, p: rpc_pb2.PutRequest) -> cmds.PutReq:
        """A put, checked: its key, and its value against --max-value-bytes."""
        wire.key_of(p.key)
        if len(p.value) > self.node.config.max_value_bytes:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, wire.ERR_TOO_LARGE)
        return put_req(p)


def put_req(p: rpc_pb2.PutRequest) -> cmds.PutReq:
    if p.ignore_value and p.value:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: value is provided")
    if p.ignore_lease and p.lease:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: lease is provided")
    return cmds.PutReq(p.key, p.value, p.lease, p.prev_kv, p.ignore_value, p.ignore_lease)


def delete_req(d: rpc_pb2.DeleteRangeRequest) -> cmds.DeleteRangeReq:
    return cmds.DeleteRangeReq(wire.range_start(d.key, d.range_end), d.range_end, d.prev_kv)


def check_unique_writes(ops) -> tuple[set[bytes], list[tuple[bytes, bytes]]]:
    """etcd's checkIntervals: no key is put twice along one path of a transaction, nor put
    where a delete of the same path reaches; returns the path's (puts, deletes)."""
    dels = [(op.request_delete_range.key, op.request_delete_range.range_end) for op in ops if op.WhichOneof("request") == "request_delete_range"]
    puts: set[bytes] = set()

    def add(key: bytes) -> None:
        if key in puts or any(cmds.in_range(key, k, end) for k, end in dels):
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, wire.ERR_DUPLICATE_KEY)
        puts.add(key)

    for op in ops:
        if op.WhichOneof("request") == "request_txn":
            then_puts, then_dels = check_unique_writes(op.request_txn.success)
            else_puts, else_dels = check_unique_writes(op.request_txn.failure)
            for key in then_puts | else_puts:  # one of the two branches runs
                add(key)
            dels += then_dels + else_dels
    for op in ops:
        if op.WhichOneof("request") == "request_put":
            add(op.request_put.key)
    return puts, dels


_COMPARED = {
    rpc_pb2.Compare.VERSION: "version",
    rpc_pb2.Compare.CREATE: "create_revision",
    rpc_pb2.Compare.MOD: "mod_revision",
    rpc_pb2.Compare.VALUE: "value",
    rpc_pb2.Compare.LEASE: "lease",
}  # a compare's target -> the field of its target_union that holds what it is compared with


def _any_op(request: rpc_pb2.TxnRequest, holds) -> bool:
    """Whether holds(op) for an op of the transaction, in either branch or a nested one."""
    for op in list(request.success) + list(request.failure):
        if holds(op) or (op.WhichOneof("request") == "request_txn" and _any_op(op.request_txn, holds)):
            return True
    return False


def _reads_at_a_revision(request: rpc_pb2.TxnRequest) -> bool:
    return _any_op(request, lambda op: op.WhichOneof("request") == "request_range" and op.request_range.revision > 0)


def _writes(request: rpc_pb2.TxnRequest) -> bool:
    return _any_op(request, lambda op: op.WhichOneof("request") in ("request_put", "request_delete_range"))


def _puts_to_a_lease(request: rpc_pb2.TxnRequest) -> bool:
    return _any_op(request, lambda op: op.WhichOneof("request") == "request_put" and op.request_put.lease != 0)


def txn_keys(request: rpc_pb2.TxnRequest):
    """(key, range_end) of everything a transaction compares, reads or writes."""
    for c in request.compare:
        yield c.key, c.range_end
    for op in list(request.success) + list(request.failure):
        which = op.WhichOneof("request")
        if which == "request_range":
            yield op.request_range.key, op.request_range.range_end
        elif which == "request_put":
            yield op.request_put.key, b""
        elif which == "request_delete_range":
            yield op.request_delete_range.key, op.request_delete_range.range_end
        elif which == "request_txn":
            yield from txn_keys(op.request_txn)


def txn_response(request: rpc_pb2.TxnRequest, r: cmds.TxnResp, header) -> rpc_pb2.TxnResponse:
    ops = request.success if r.succeeded else request.failure
    responses = []
    for op, got in zip(ops, r.responses):
        which = op.WhichOneof("request")
        h = rpc_pb2.ResponseHeader(revision=r.index)  # (etcd's inner responses carry the revision alone)
        if which == "request_range":
            responses.append(rpc_pb2.ResponseOp(response_range=wire.finish_range(op.request_range, got, h)))
        elif which == "request_put":
            responses.append(rpc_pb2.ResponseOp(response_put=rpc_pb2.PutResponse(header=h, prev_kv=wire.kv_message(got.prev_kv) if got.prev_kv else None)))
        elif which == "request_delete_range":
            responses.append(
                rpc_pb2.ResponseOp(
                    response_delete_range=rpc_pb2.DeleteRangeResponse(header=h, deleted=got.deleted, prev_kvs=[wire.kv_message(kv) for kv in got.prev_kvs])
                )
            )
        else:
            responses.append(rpc_pb2.ResponseOp(response_txn=txn_response(op.request_txn, got, header)))
    return rpc_pb2.TxnResponse(header=header(r.index), succeeded=r.succeeded, responses=responses)


class GetsAfterOneBarrier:
    """etcd's gets (is_get) over gRPC without a task each: every get arriving in one turn
    of the loop awaits one read barrier, then all are answered at once (rpc.RpcServer runs
    this; a get its caller may not make goes to Range, which refuses it with the reason).
    What a get reads is as fresh as its own barrier would have made it: the shared one is
    asked for after the last of them has arrived."""

    def __init__(self, kv: KVService) -> None:
        self.kv = kv

    def barrier_for(self, request: rpc_pb2.RangeRequest, context) -> str | None:
        """The barrier this request needs (linearizable, stale), or None: Range serves it."""
        if not is_get(request):
            return None
        try:  # (a key or a caller Range refuses is refused there, without waiting for a barrier)
            wire.range_start(request.key, b"")
            self.kv.access.check(context, "read", [(request.key, b"")])
        except Exception:
            return None
        self.kv.access.count()
        return "stale" if request.serializable else "linearizable"

    async def barrier(self, consistency: str) -> int:
        return await self.kv.node.read_barrier(consistency)

    def answer(self, request: rpc_pb2.RangeRequest, index: int) -> rpc_pb2.RangeResponse:
        return self.kv.get(request.key, index)  # (checked by barrier_for)

    def status(self, e: Exception):
        return self.kv.access.status(e)


class PutsAtOnce:
    """Plain puts on the leader, served without a task each (rpc.AtOnce): the puts that
    arrive in one turn of the loop are proposed together once it is over (kv.Node's
    propose_now: one Ready, one fsync), each answered from its slot once applied. Any
    other put, or one this way cannot take (a follower, a refusal, no free session, a
    leader change), goes the handler's way: a slot already sent in a session goes again
    as the same session request, so it is applied once."""

    def __init__(self, kv: KVService) -> None:
        self.kv = kv
        self._slots: list[_PutSlot] = []

    def take(self, call, request: rpc_pb2.PutRequest) -> bool:
        kv = self.kv
        node = kv.node
        if not is_plain(request) or not node.leads():
            return False
        try:
            kv.access.check(call.context, "write", [(request.key, b"")])
            cmd = node.put_command(wire.key_of(request.key), request.value)
            slot = _PutSlot(self, call, cmd, node.encode_request(cmd))
        except Exception:
            return False  # the handler refuses it, with etcd's code and text
        kv.access.count()
        if not self._slots:
            call.stream.conn.loop.call_soon(self._propose)
        self._slots.append(slot)
        return True

    def _propose(self) -> None:
        slots, self._slots = self._slots, []
        self.kv.node.propose_now(slots)

    def settled(self, slot: _PutSlot) -> None:
        call, kv = slot.call, self.kv
        try:
            applied = kv.node.settle(slot)
            w = kv.node.put_result(applied) if applied is not None else None
        except Exception as e:
            if not call.stream.closed:
                call.finish(*kv.access.status(e))
            return
        if call.stream.closed:  # expired, or reset by its client
            kv.node.abandon(slot)
        elif w is None:
            call.stream.conn.server.run(call, lambda: self._resubmitted(slot))
            # (a task cancelled before its first step never runs: its slot's session is freed here)
            call.task.add_done_callback(lambda _: kv.node.abandon(slot))
        else:
            call.answer_encoded(kv.header.put_response(w.index))

    async def _resubmitted(self, slot: _PutSlot) -> rpc_pb2.PutResponse:
        kv = self.kv
        async with kv.access.guarded(slot.call.context, "write", []):
            return await kv.answer_put(kv.node.put_result(await kv.node.resubmit(slot)))


class _PutSlot(Slot):
    __slots__ = ("puts", "call")

    def __init__(self, puts: PutsAtOnce, call, cmd, payload: bytes) -> None:
        super().__init__(cmd, payload)
        self.puts, self.call = puts, call

    def resolved(self) -> None:
        self.puts.settled(self)
