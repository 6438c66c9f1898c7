"""HTTP clients for a ledgerkv cluster: kv.AsyncClient (aiohttp) and kv.Client (synchronous).

Any node answers any request (followers forward writes to the leader), so a client only
needs one reachable endpoint. When a node cannot be reached, answers 503 (no leader, no
quorum: nothing was done), or the connection fails, the client tries the next endpoint,
backing off, until its deadline. Writes are sent in client sessions (kv/common/sessions.py): every
copy of a write carries the same X-Kv-Session and X-Kv-Seq, so the cluster applies it once
and answers each copy with the first one's result; a write whose connection failed after it
was sent goes to the next endpoint like any request. kv.Timeout (outcome unknown) remains
for a write still unanswered at the deadline, a node's 504, and a write resent after its
session closed.
An endpoint that answers 404 without ledgerkv's error body, or a key's GET without an
ETag, is another server, not a node: kv.Unavailable names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from urllib.parse import quote

import aiohttp
import orjson
from multidict import CIMultiDict
from yarl import URL

from .. import errors
from ..common.arguments import lease_id, ttl_ms, value_bytes
from ..common.entry_stream import RecordReader
from ..common.results import BulkRefusal, BulkResult, DeleteResult, Event, Item, LeaseStatus, Page, PrefixDeleteResult, RevokeResult, TxnResult, WriteResult
from ..common.scan import Scan
from ..common.sessions import RequestId, SessionPool
from ..common.tls import client_context
from ..common.wire import bulk_body, checked_key_bytes, cond_fields, key_from, op_fields, value_from
from ..raft.backoff import Backoff
from ..raft.messages import Entry
from ..statemachine.commands import Cond, Put
from .endpoints import (
    ATTEMPT_TIMEOUT_S,
    CLUSTER_HEADER,
    NOT_A_NODE,
    NOT_CONNECTED,
    SEQ_HEADER,
    SESSION_HEADER,
    TIMEOUT_HEADER,
    Rotation,
    Unreachable,
    describe,
    error_for,
    is_ours,
    margin,
    parse_endpoints,
    with_query,
    raise_for,
    unreachable_hint,
)
from .recipes import AsyncRecipes
from .watch import watch

log = logging.getLogger("kv.client")

_JSON = {"Content-Type": "application/json"}


def _key_path(key: str) -> str:
    if not isinstance(key, str) or not key:
        raise errors.BadRequest("a key is a non-empty string")
    return "/v1/kv/" + quote(checked_key_bytes(key), safe="/")


# What the cluster answers a session's write with once it is applied (or refused by the
# state machine, as every copy is): the truth about the first copy too.
_APPLIED_ANSWERS = (errors.PreconditionFailed, errors.Conflict, errors.LeaseNotFound)


class AsyncClient(AsyncRecipes):
    """    async with kv.AsyncClient("http://127.0.0.1:8001,http://127.0.0.1:8002") as c:
            await c.put("a", b"1")
            item = await c.get("a")
    """

    def __init__(
        self,
        endpoints: str | Sequence[str] | None = None,
        *,
        token: str | None = None,
        timeout: float = 10.0,
        attempt_timeout: float = ATTEMPT_TIMEOUT_S,
        connections: int = 256,
        cacert: str | None = None,
    ) -> None:
        """`timeout`: the seconds a call may take in all. `attempt_timeout`: how long one
        node may take to answer a request that can be sent again (a read, a write in a
        session, a keepalive) before the next node is asked: a node that hangs (paused,
        stuck, cut off without a reset) costs that, not the whole call. `cacert`: a CA
        certificate (PEM) that https:// endpoints are verified with, in addition to the
        system's. `endpoints` left out: $KV_ENDPOINTS if it is set, else the local
        `kv cluster up` nodes (127.0.0.1:8001-8003), as on the command line."""
        self.endpoints = parse_endpoints(endpoints)
        self._ssl = client_context(cacert)
        for name, value in (("timeout", timeout), ("attempt_timeout", attempt_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise errors.BadRequest(f"{name} is a number of seconds, more than 0, not {value!r}")
        self.timeout, self.attempt_timeout = timeout, attempt_timeout
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._connections = connections
        self._session: aiohttp.ClientSession | None = None
        self.rotation = Rotation(self.endpoints)
        # The cluster the first node to answer belongs to (CLUSTER_HEADER): a node of
        # another, reached through a mistake in the endpoints, refuses what it is sent.
        self.cluster_id = ""
        self._sessions = SessionPool(self._open_session)  # one per write in flight

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def __del__(self) -> None:
        # A script that ends without close(): let the sockets go quietly instead of
        # aiohttp's "Unclosed client session" / "Unclosed connector" reports at exit.
        # (_close is the synchronous part of the connector's close, which aiohttp's own
        # __del__ calls; the public close() is a coroutine nobody could await here.)
        s = getattr(self, "_session", None)  # None too when __init__ refused its arguments
        if s is not None and not s.closed:
            connector = s.connector
            s.detach()
            if connector is not None:
                with contextlib.suppress(Exception):
                    connector._close()

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._connections, limit_per_host=self._connections, ssl=self._ssl or True),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=2.0),
                headers=self._headers,
            )
            # aiohttp sends a PUT or DELETE again by itself when its connection fails; this
            # client decides what is sent again (a write in a session: the same request, to
            # any node; without one: nothing that may have reached a node).
            self._session._retry_connection = False
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        *,
        data: bytes | None = None,
        headers: dict | None = None,
        params: dict | None = None,
        endpoint: str | None = None,
        ok: tuple[int, ...] = (200,),
        idempotent: bool | None = None,
        request_id: RequestId | None = None,
        deadline: float | None = None,
    ) -> tuple[int, CIMultiDict, bytes]:
        """One request with failover; returns (status, headers, body) for statuses in ok.
        A request that is not idempotent (by default: anything but GET and HEAD) is not
        sent again once it may have reached a node, unless it is a session's request
        (`request_id`): the cluster applies that once however often it is sent."""
        if deadline is None:
            deadline = time.monotonic() + self.timeout
        if idempotent is None:
            idempotent = method in ("GET", "HEAD") or request_id is not None
        reached: Exception | None = None  # why an earlier copy may have reached a node
        backoff = Backoff(0.05, 1.0)
        tries = 0
        last: Exception | None = None
        told: errors.KVError | None = None  # the last answer a node gave (a 503)
        unreachable = Unreachable(self.rotation, self.timeout)
        while True:
            ep = endpoint or self.rotation.pick()
            tries += 1
            try:
                left = max(deadline - time.monotonic(), 0.05)
                if idempotent:  # safe to send again elsewhere: one node gets only so long
                    left = min(left, self.attempt_timeout)
                # The node answers within what is left less a margin (X-Kv-Timeout), so
                # that a write no leader took comes back as such (NotLeader: not carried
                # out), not as this client's own time-out (outcome unknown).
                sent = {CLUSTER_HEADER: self.cluster_id, **(headers or {}), TIMEOUT_HEADER: f"{max(left - margin(left), 0.001):.3f}"}
                if request_id is not None:
                    sent[SESSION_HEADER], sent[SEQ_HEADER] = str(request_id.session), str(request_id.seq)
                async with self._sess().request(
                    # encoded: the path is quoted already, and yarl would drop "." and ".."
                    # segments of a key (dd/x/../y is a key, not the path dd/y)
                    method, URL(with_query(ep + path, params), encoded=True), data=data, headers=sent, timeout=aiohttp.ClientTimeout(total=left)
                ) as resp:
                    body = await resp.read()
                    if not self.cluster_id:
                        self.cluster_id = resp.headers.get(CLUSTER_HEADER, "")
                    if resp.status == 404 and not is_ours(body):
                        # Another web server at this URL: its 404 is not "no such key".
                        raise errors.Unavailable(f"{ep} answered 404 without ledgerkv's error body: {NOT_A_NODE}")
                    if resp.status in ok:
                        self.rotation.answered(ep)
                        return resp.status, resp.headers.copy(), body  # case-insensitive
                    last = told = error_for(resp.status, body, ep)  # a node's answer says more than another endpoint's silence
                    if resp.status == 504 and request_id is not None:
                        reached = told  # the node could not tell in its time: ask again while there is time
                    elif isinstance(told, errors.SessionExpired) and reached is not None:
                        raise errors.Timeout(
                            f"{ep}: the write was sent again after {describe(reached)}, and by then its session had closed: the "
                            "first copy may or may not have been applied; read the key before retrying"
                        ) from told
                    elif request_id is not None and reached is not None and resp.status != 503 and not isinstance(told, _APPLIED_ANSWERS):
                        # Refused by this node for reasons of its own (another cluster's, a token it does not
                        # take, a smaller limit): that says nothing of the copy that may have reached another.
                        raise errors.Timeout(
                            f"{ep}: the write was sent again after {describe(reached)}, and refused there ({told}): the first copy "
                            "may or may not have been applied; read the key before retrying"
                        ) from told
                    elif resp.status != 503:
                        raise told
            except errors.KVError:
                raise  # the node's answer (kv.Timeout is a TimeoutError too: not ours to wrap below)
            except aiohttp.ClientConnectorCertificateError as e:
                raise errors.Unavailable(
                    f"{ep}: the server's TLS certificate is not trusted ({e.certificate_error}); "
                    "give the CA that signed it: --cacert FILE, or kv.Client(cacert=FILE)"
                ) from e
            except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, asyncio.TimeoutError) as e:
                if not isinstance(e, NOT_CONNECTED) and not isinstance(reached, errors.Timeout):
                    reached = e  # (a node's own 504 says more)
                if not idempotent and not isinstance(e, NOT_CONNECTED):
                    # Connected: the request may have reached the node, which may have
                    # committed it before the connection reset, closed or timed out. Sent
                    # again, it could apply twice (or fail its own condition).
                    what = (
                        f"no answer in {self.timeout:g}s after the write was sent (a node answers by then even without a leader: this one may be overloaded or stuck; kv status)"
                        if isinstance(e, asyncio.TimeoutError) else f"the connection failed after the write may have reached the node ({describe(e)})"
                    )
                    raise errors.Timeout(f"{ep}: {what}; its outcome is unknown: read the key before retrying") from e
                last = e
            self.rotation.failed(ep)  # tried last for a while
            if endpoint is None:
                self.rotation.advance()
            delay = backoff.next()
            # A write is not sent again unless the node has time to answer it, margin and all.
            reserve = 0.0 if idempotent else 2 * margin(deadline - time.monotonic())
            if time.monotonic() + delay + reserve > deadline or (endpoint is not None and tries > 3):
                if request_id is not None and reached is not None:
                    if isinstance(reached, errors.Timeout):
                        raise reached  # a node's own 504, in its words
                    raise errors.Timeout(
                        f"{ep}: no answer in {self.timeout:g}s after the write was sent ({describe(reached)}; a node answers by then "
                        "even without a leader: one may be overloaded or stuck; kv status); its outcome is unknown: read the key before retrying"
                    ) from reached
                if told is not None:
                    raise told
                hint = unreachable_hint(last, ep)
                if endpoint is not None:  # one node asked for (kv status asks each)
                    raise errors.Unavailable(f"{endpoint} did not answer ({tries} tries): {describe(last)}{hint}")
                raise errors.Unavailable(f"no endpoint answered in {self.timeout:g}s ({', '.join(self.endpoints)}): {describe(last)}{hint}")
            unreachable.saw(ep, last, [endpoint] if endpoint else self.endpoints)
            await asyncio.sleep(delay)

    async def _json(self, method: str, path: str, **kw):
        _, _, body = await self.request(method, path, **kw)
        return orjson.loads(body)

    async def _write(self, method: str, path: str, **kw) -> tuple[int, CIMultiDict, bytes]:
        """A write, as the next request of one of this client's sessions (kv/common/sessions.py):
        every copy is the same request, which the cluster applies once."""
        deadline = time.monotonic() + self.timeout
        if self._sessions is None:  # the cluster predates sessions
            return await self.request(method, path, deadline=deadline, **kw)
        try:
            lane = await self._sessions.acquire(deadline)
        except errors.NotFound:  # no such route: a node from before sessions
            log.info("the cluster at %s opens no client sessions (an older version): writes are sent once", ", ".join(self.endpoints))
            self._sessions = None
            return await self.request(method, path, deadline=deadline, **kw)
        try:
            while True:
                try:
                    return await self.request(method, path, request_id=RequestId(lane.id, lane.next_seq()), deadline=deadline, **kw)
                except errors.SessionExpired:  # closed before this write reached it: applied nowhere
                    lane = None
                    lane = await self._sessions.acquire(deadline)
        finally:
            if lane is not None and self._sessions is not None:
                self._sessions.release(lane)

    async def _write_json(self, method: str, path: str, **kw):
        _, _, body = await self._write(method, path, **kw)
        return orjson.loads(body)

    async def _open_session(self, deadline: float) -> int:
        # An opening sent twice leaves an unused session behind, which expires: safe to resend.
        try:
            return (await self._json("POST", "/v1/sessions", idempotent=True, deadline=deadline))["id"]
        except errors.Unavailable as e:  # (the write itself was not sent: say so, not only "TimeoutError")
            raise errors.Unavailable(f"the write was not sent: opening its session failed: {e}") from e

    # -- the store API ---------------------------------------------------------------------

    async def put(self, key: str, value: bytes, *, if_mod_index: int | None = None, if_absent: bool = False, lease: int | None = None) -> WriteResult:
        """Write a value once a majority has it (fsynced) and the leader applied it.
        `if_mod_index=N` writes only if the key's mod_index is N, `if_absent` only if the
        key does not exist; otherwise PreconditionFailed (with the key's current mod_index).
        `lease` (an id or a Lease) attaches the key to it: LeaseNotFound if there is none."""
        headers = {}
        if if_mod_index is not None:
            headers["If-Match"] = f'"{if_mod_index}"'
        if if_absent:
            headers["If-None-Match"] = "*"
        params = {"lease": str(lease_id(lease))} if lease is not None else None
        d = await self._write_json("PUT", _key_path(key), data=value_bytes(value), headers=headers, params=params)
        return WriteResult(d["index"], d["term"])

    async def cas(self, key: str, expected_mod_index: int, value: bytes) -> WriteResult:
        """Compare-and-set: write only if the key's mod_index is still `expected_mod_index`
        (the one a get returned; 0: the key must not exist). PreconditionFailed otherwise."""
        return await self.put(key, value, if_mod_index=expected_mod_index)

    async def get(self, key: str, *, consistency: str = "linearizable", revision: int | None = None) -> Item | None:
        """The key's Item (value, mod_index), or None. consistency: linearizable (default),
        lease, or stale (the answering node's own state). revision: as it was then
        (RevisionCompacted below what the nodes keep, FutureRevision above their applied index)."""
        params = {"consistency": consistency, **({"revision": str(revision)} if revision is not None else {})}
        status, headers, body = await self.request("GET", _key_path(key), params=params, ok=(200, 404))
        if status == 404:
            return None
        etag = headers.get("ETag")
        if etag is None:  # every ledgerkv answer to a key's GET has one
            raise errors.Unavailable(f"the answer to GET {_key_path(key)} has no ETag: {NOT_A_NODE}")
        return Item(key, body, int(etag.strip('"')))

    async def delete(self, key: str, *, if_mod_index: int | None = None) -> DeleteResult:
        """Delete a key (`deleted` says whether it existed); conditional like put."""
        headers = {"If-Match": f'"{if_mod_index}"'} if if_mod_index is not None else None
        d = await self._write_json("DELETE", _key_path(key), headers=headers)
        return DeleteResult(d["index"], d["term"], d["deleted"])

    async def delete_prefix(self, prefix: str) -> PrefixDeleteResult:
        """Delete every key under `prefix` ("": every key) in one committed entry;
        `deleted`: how many there were."""
        if not isinstance(prefix, str):
            raise errors.BadRequest(f"a prefix is a string, not {type(prefix).__name__}")
        d = await self._write_json("DELETE", "/v1/kv", params={"prefix": prefix})
        return PrefixDeleteResult(d["index"], d["term"], d["deleted"])

    def scan(
        self, prefix: str = "", *, after: str | None = None, limit: int | None = None, consistency: str = "linearizable", page: int = 1000,
        revision: int | None = None,
    ) -> Scan:
        """Every key under a prefix in key order (strictly after `after`; at most `limit`),
        fetched `page` keys a request: `async for item in c.scan(p)`, or `await c.scan(p)`.
        Each page is read as the keys are then, or, with `revision`, as they were at it
        (one consistent cut while writes go on)."""

        async def fetch(after: str | None, n: int) -> tuple[list[Item], bool]:
            params = {"prefix": prefix, "limit": str(n), "consistency": consistency}
            if after is not None:
                params["after"] = after
            if revision is not None:
                params["revision"] = str(revision)
            d = await self._json("GET", "/v1/kv", params=params)
            return [Item(key_from(it), value_from(it), it["mod_index"]) for it in d["items"]], d["next"] is not None

        return Scan(fetch, after=after, limit=limit, page=page)

    async def scan_page(
        self, prefix: str = "", *, after: str | None = None, limit: int = 1000, consistency: str = "linearizable", revision: int | None = None
    ) -> Page:
        """One page of keys under prefix and the applied index it was read at: watch from
        index + 1 to see every later change, none twice. A page of large values holds fewer
        than `limit` keys (the node's --max-txn-read-bytes): read on after its last key
        until a page comes back empty, or use scan(), which does. revision: the keys as
        they were then (pass the first page's index to read every page at that one cut
        while writes go on; Compacted once the history no longer goes back that far)."""
        params = {"prefix": prefix, "limit": str(limit), "consistency": consistency, **({"after": after} if after is not None else {})}
        if revision is not None:
            params["revision"] = str(revision)
        d = await self._json("GET", "/v1/kv", params=params)
        return Page([Item(key_from(it), value_from(it), it["mod_index"]) for it in d["items"]], d["index"])

    def watch(self, prefix: str = "", start_index: int | None = None, *, end_index: int | None = None, idle_timeout: float = 15.0) -> AsyncIterator[Event]:
        """Every change under prefix from start_index (default: the next commit), as kv.Event;
        on a broken stream it resumes on another endpoint without gap or repeat. Raises
        Compacted when no endpoint still holds the start. end_index: stop after the changes
        of that index (a bounded range of the change feed). idle_timeout: seconds without a
        byte (the node sends progress every 5 s) before the node is taken for dead."""
        return watch(self.rotation, self._sess, self.timeout, prefix, start_index, idle_timeout, end_index, lambda: self.cluster_id)

    async def txn(self, conds: Sequence[Cond] = (), ops: Sequence = (), else_ops: Sequence = ()) -> TxnResult:
        """Atomically: if every kv.Cond holds run `ops`, else `else_ops` (kv.Put, kv.Delete,
        kv.Get). `succeeded` says which ran; results has one entry per op."""
        doc = {"compare": [cond_fields(c) for c in conds], "success": [op_fields(o) for o in ops], "failure": [op_fields(o) for o in else_ops]}
        status, _, body = await self._write("POST", "/v1/txn", data=orjson.dumps(doc), headers={"Content-Type": "application/json"}, ok=(200, 412))
        d = orjson.loads(body)
        results, omitted = [], []
        for r in d["results"]:
            if "deleted" in r:
                results.append(DeleteResult(r["index"], d["term"], r["deleted"]))
            elif "found" in r:
                results.append(Item(key_from(r), value_from(r), r["mod_index"]) if r["found"] else None)
            elif r.get("omitted"):
                omitted.append(key_from(r))
                results.append(None)
            else:
                results.append(WriteResult(r["index"], d["term"]))
        if "reads_omitted" in d:
            raise errors.ReadsOmitted(d["index"], d["term"], d["succeeded"], tuple(results), omitted, d["reads_omitted"]["message"])
        return TxnResult(d["index"], d["term"], d["succeeded"], tuple(results))

    async def put_many(self, items: dict[str, bytes] | Sequence[tuple[str, bytes]]) -> TxnResult:
        """Write many keys in one atomic transaction (at most the cluster's --max-txn-ops,
        default 128, and --max-request-bytes, default 1.5 MiB: 400/413 beyond)."""
        pairs = items.items() if isinstance(items, dict) else items
        return await self.txn(ops=[Put(k, v) for k, v in pairs])

    async def bulk_put(self, rows) -> BulkResult:
        """Put many keys in one committed entry (POST /v1/bulk): rows (key, value) or (key,
        value, if_mod_index) — values are bytes; None: no condition, 0: the key must not
        exist; `row` in answers and errors is the row's place in `rows`. Bounded by
        the cluster's --max-request-bytes (1.5 MiB by default), not --max-txn-ops. The rows
        whose condition holds are written at one index; the others are listed in `refused`
        with what their key holds, and nothing is written for them."""
        body = bulk_body(rows)
        try:
            d = await self._write_json("POST", "/v1/bulk", data=body.data, headers={"Content-Type": "application/octet-stream"})
        except errors.KVError as e:
            raise body.renumbered(e) from None
        refused = tuple(BulkRefusal(x["row"], key_from(x), x["mod_index"], x["held"]) for x in d["refused"])
        return body.result(BulkResult(d["index"], d["term"], d["written"], refused))

    # -- leases ----------------------------------------------------------------------------

    async def lease_grant(self, ttl: float) -> LeaseStatus:
        """A new lease of `ttl` seconds (more than 0, at most a year)."""
        ttl_ms(ttl)  # refused here as the node would (JSON has no inf or nan: they travel as null)
        d = await self._write_json("POST", "/v1/leases", data=orjson.dumps({"ttl": ttl}), headers=_JSON)
        return LeaseStatus(d["id"], d["ttl"], d["ttl"])

    async def lease_keepalive(self, lease: int) -> LeaseStatus:
        """Renew a lease to its full ttl (LeaseNotFound once it expired or was revoked)."""
        d = await self._json("POST", f"/v1/leases/{lease_id(lease)}/keepalive", idempotent=True)
        return LeaseStatus(d["id"], d["ttl"], d["ttl"])

    async def lease_keepalives(self, leases: Sequence[int]) -> list[LeaseStatus | None]:
        """Renew several leases in one request: for each, in order, its LeaseStatus, or
        None if it expired or was revoked (at most 10,000 at once)."""
        ids = [lease_id(x) for x in leases]
        d = await self._json("POST", "/v1/leases/keepalive", data=orjson.dumps({"ids": ids}), headers=_JSON, idempotent=True)
        renewed = {x["id"]: LeaseStatus(x["id"], x["ttl"], x["ttl"]) for x in d["leases"]}
        return [renewed.get(i) for i in ids]

    async def lease_revoke(self, lease: int) -> RevokeResult:
        """End a lease now; its keys are deleted in the same committed entry."""
        d = await self._write_json("DELETE", f"/v1/leases/{lease_id(lease)}")
        return RevokeResult(d["index"], tuple(d["keys"]))

    async def lease_info(self, lease: int) -> LeaseStatus:
        """A lease's ttl, the seconds it has left on the leader's clock, and its keys."""
        d = await self._json("GET", f"/v1/leases/{lease_id(lease)}")
        return LeaseStatus(d["id"], d["ttl"], d["remaining"], tuple(d["keys"]))

    async def lease_list(self) -> list[LeaseStatus]:
        """Every live lease (without its keys)."""
        d = await self._json("GET", "/v1/leases")
        return [LeaseStatus(x["id"], x["ttl"], x["remaining"]) for x in d["leases"]]

    # -- administration --------------------------------------------------------------------

    async def status(self, endpoint: str | None = None) -> dict:
        """One node's own view (GET /v1/status), whichever cluster it belongs to (its
        cluster_id says: kv status shows nodes, and says when they belong to two)."""
        return await self._json("GET", "/v1/status", endpoint=endpoint, headers={CLUSTER_HEADER: ""})

    async def status_all(self) -> list[tuple[str, dict | Exception]]:
        """(endpoint, status or the error) for every endpoint."""
        async def one(ep):
            try:
                return ep, await self.status(ep)
            except Exception as e:  # a node that is down is part of the answer
                return ep, e

        return list(await asyncio.gather(*(one(ep) for ep in self.endpoints)))

    async def transfer_leader(self, to: str) -> dict:
        """Hand leadership to member `to` (caught up first)."""
        return await self._json("POST", "/v1/leader/transfer", data=orjson.dumps({"to": to}), headers={"Content-Type": "application/json"})

    async def compact(self, revision: int) -> int:
        """Drop the history below `revision` on every node (reads below it are refused from
        then on); returns the compact revision."""
        d = await self._json("POST", "/v1/compact", data=orjson.dumps({"revision": revision}), headers={"Content-Type": "application/json"})
        return d["compact_revision"]

    async def take_snapshot(self, endpoint: str | None = None) -> dict:
        """Ask a node to take a snapshot now; {"index", "term"}."""
        return await self._json("POST", "/v1/snapshot", endpoint=endpoint)

    async def download_snapshot(self, path: str, *, endpoint: str | None = None, progress: Callable[[int, int], None] | None = None) -> dict:
        """Save the newest snapshot of a node to `path` (atomically: temp file, rename)."""
        ep = endpoint or self.rotation.pick()
        tmp = path + ".part"
        async with self._sess().get(ep + "/v1/snapshot", timeout=aiohttp.ClientTimeout(total=None, sock_read=60)) as resp:
            if resp.status != 200:
                raise_for(resp.status, await resp.read(), ep)
            total = int(resp.headers.get("Content-Length", 0))
            got = 0
            with open(tmp, "wb") as f:
                async for chunk in resp.content.iter_chunked(1 << 20):
                    f.write(chunk)
                    got += len(chunk)
                    if progress is not None:
                        progress(got, total)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            return {"index": int(resp.headers.get("X-Snapshot-Index", 0)), "term": int(resp.headers.get("X-Snapshot-Term", 0)), "bytes": got, "endpoint": ep}

    async def read_log(self, start: int, end: int, *, endpoint: str | None = None) -> AsyncIterator[list[Entry]]:
        """The committed entries [start, end] of one node's ledger, in batches as they
        arrive (GET /v1/log). Raises Compacted if start is below what the node keeps."""
        ep = endpoint or self.rotation.pick()
        params = {"from": str(start), "to": str(end)}
        async with self._sess().get(ep + "/v1/log", params=params, timeout=aiohttp.ClientTimeout(total=None, sock_read=60)) as resp:
            if resp.status != 200:
                raise_for(resp.status, await resp.read(), ep)
            reader, last = RecordReader(), start - 1
            async for chunk in resp.content.iter_chunked(1 << 20):
                entries = reader.feed(chunk)
                if entries:
                    last = entries[-1].index
                    yield entries
            reader.finish(last)

    async def members(self, *, consistency: str = "linearizable") -> list[dict]:
        """The cluster's members: id, peer, http, voter, leader. Read after a barrier, as a
        key is; consistency="stale": the answering node's own view, even without a leader."""
        return (await self._json("GET", "/v1/members", params={"consistency": consistency}))["members"]

    async def add_member(self, member_id: str, peer: str, http: str = "", *, voter: bool = False, replace: bool = False, ledger: str = "") -> list[dict]:
        """Add a member listening for peers on `peer` (a learner, promoted once caught up
        when voter=True); replace=True changes an existing member's addresses. `ledger`:
        the ledger id of the data dir that joins as it (kv serve --join sends it)."""
        return (await self._add_member({"id": member_id, "peer": peer, "http": http, "voter": voter, "replace": replace, **({"ledger": ledger} if ledger else {})}))["members"]

    async def join_member(self, member_id: str, peer: str, http: str, ledger: str) -> dict:
        """kv serve --join's request: add this node as a member (a learner, promoted once
        caught up) known by the data dir whose ledger id is `ledger`. Returns the whole
        answer, which the node starts from: "members" (the newest committed membership),
        "index" (the log index of its entry) and "removed" (the ids removed before)."""
        return await self._add_member({"id": member_id, "peer": peer, "http": http, "voter": True, "ledger": ledger})

    async def _add_member(self, doc: dict) -> dict:
        return await self._json("POST", "/v1/members", data=orjson.dumps(doc), headers={"Content-Type": "application/json"})

    async def remove_member(self, member_id: str) -> list[dict]:
        """Remove a member."""
        return (await self._json("DELETE", f"/v1/members/{quote(member_id, safe='')}"))["members"]

    async def promote_member(self, member_id: str) -> list[dict]:
        """Make a learner a voter (Conflict until it has caught up)."""
        return (await self._json("POST", f"/v1/members/{quote(member_id, safe='')}/promote"))["members"]
