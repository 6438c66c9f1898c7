"""The key-value routes: /v1/kv/{key}, /v1/kv (listing), /v1/txn and /v1/bulk."""

from __future__ import annotations

import re

import orjson
from aiohttp import web

from kv import BadRequest, Cond, Delete, Get, LeaseNotFound, NotFound, PreconditionFailed, Put, ReadsOmitted
from kv.common.wire import key_bytes, key_fields, key_from, rows_body, shown_key, value_fields, value_from

from .answer import Answer
from .auth import check_keys, hidden_leases, lease_prefix
from .context import ctx
from .errors import json_response
from .keys import key_from_raw_path, key_param
from .params import MAX_INDEX, consistency_param, read_body, read_timeout, request_id, revision_param, write_timeout

KV_PREFIX = "/v1/kv/"
MAX_LIST = 10_000


_ETAG = re.compile(r'(?:W/)?"([0-9]{1,19})"')  # one quoted mod_index, ASCII digits


async def put_key(request: web.Request) -> Answer:
    c = ctx(request)
    key = key_from_raw_path(request.raw_path, KV_PREFIX)
    value = await read_body(request, c.node.config.max_value_bytes, "the value", "--max-value-bytes")
    if_match = request.headers.get("If-Match")
    if_none = request.headers.get("If-None-Match")
    if if_none is not None and if_none.strip() != "*":
        raise BadRequest('only If-None-Match: * is supported (write only if the key does not exist)')
    lease = request.query.get("lease")
    if lease is not None and not (lease.isascii() and lease.isdigit() and len(lease) <= 19):
        raise BadRequest(f"lease must be a lease id (a positive integer), not {lease!r}")
    if_mod_index, if_exists = _if_match(if_match)
    if if_exists and if_none is not None:
        raise BadRequest("If-Match: * and If-None-Match: * cannot both hold")
    if lease is not None and await hidden_leases(request, c.node, [int(lease)]):
        raise LeaseNotFound(int(lease))  # another tenant's: nothing written, nothing told
    r = await c.node.put(
        key,
        value,
        if_mod_index=if_mod_index,
        if_absent=if_none is not None,
        if_exists=if_exists,
        lease=int(lease) if lease is not None else None,
        timeout=write_timeout(request),
        request_id=request_id(request),
    )
    return json_response({"index": r.index, "term": r.term}, headers={"ETag": f'"{r.index}"'})


def _if_match(value: str | None) -> tuple[int | None, bool]:
    """If-Match as (if_mod_index, if_exists): "<mod_index>", or * (RFC 9110: the key
    exists, whatever its mod_index)."""
    if value is None:
        return None, False
    if value.strip() == "*":
        return None, True
    m = _ETAG.fullmatch(value.strip())
    if m is None or int(m.group(1)) > MAX_INDEX:
        raise BadRequest(f'If-Match must be one quoted mod_index from 0 to {MAX_INDEX} (or *: the key exists), e.g. If-Match: "42"')
    return int(m.group(1)), False


async def get_key(request: web.Request) -> Answer:
    c = ctx(request)
    key = key_from_raw_path(request.raw_path, KV_PREFIX)
    item, index = await c.node.get_at(key, consistency=consistency_param(request), timeout=read_timeout(request), revision=revision_param(request))
    if item is None:
        raise NotFound(f"key {shown_key(key)} does not exist")
    c.room_for(len(item.value))
    return Answer(item.value, 200, "application/octet-stream", {"ETag": f'"{item.mod_index}"', "X-Kv-Index": str(index)})


async def delete_key(request: web.Request) -> Answer:
    c = ctx(request)
    key = key_from_raw_path(request.raw_path, KV_PREFIX)
    if "If-None-Match" in request.headers:
        raise BadRequest("DELETE is conditional on If-Match only (a key that does not exist needs no delete)")
    if_match = request.headers.get("If-Match")
    if_mod_index, if_exists = _if_match(if_match)
    r = await c.node.delete(key, if_mod_index=if_mod_index, if_exists=if_exists, timeout=write_timeout(request), request_id=request_id(request))
    return json_response({"index": r.index, "term": r.term, "deleted": r.deleted})


async def delete_prefix(request: web.Request) -> Answer:
    """DELETE /v1/kv?prefix=P: every key under P, in one committed entry ("prefix=" with
    nothing after it: every key; no prefix at all is refused, as a slip)."""
    c = ctx(request)
    if "prefix" not in request.query:
        raise BadRequest("give ?prefix=P to delete every key under P (?prefix= with nothing after it deletes every key)")
    r = await c.node.delete_prefix(key_param(request, "prefix"), timeout=write_timeout(request), request_id=request_id(request))
    return json_response({"index": r.index, "term": r.term, "deleted": r.deleted})


async def list_keys(request: web.Request) -> Answer:
    c = ctx(request)
    q = request.query
    try:
        limit = int(q.get("limit", "1000"))
    except ValueError:
        raise BadRequest("limit must be an integer") from None
    if not 0 < limit <= MAX_LIST:
        raise BadRequest(f"limit must be between 1 and {MAX_LIST}")
    force_b64 = q.get("encoding") == "base64"
    fmt = q.get("format", "json")
    if fmt not in ("json", "rows"):
        raise BadRequest(f"format is json (the default) or rows (binary: the bulk format), not {fmt!r}")
    # A page holds at most --max-txn-read-bytes of keys and values (with one key at least):
    # 10,000 values of 1 MiB would otherwise be one answer of 13 GiB built in memory.
    cap = c.node.config.max_txn_read_bytes
    prefix, after, revision = key_param(request, "prefix", ""), key_param(request, "after"), revision_param(request)
    if fmt == "rows" and revision is None:  # for bulk readers (kv.spark's import reads back this way): no JSON, no base64
        body, _, size, more, index = await c.node.scan_rows(prefix, after=after, limit=limit, consistency=consistency_param(request), timeout=read_timeout(request), max_bytes=cap)
        c.room_for(size)
        return _rows_answer(body, index, more)
    items, index = await c.node.scan_page(
        prefix, after=after, limit=limit + 1, consistency=consistency_param(request), timeout=read_timeout(request), max_bytes=cap, revision=revision,
    )
    size = sum(len(key_bytes(it.key)) + len(it.value) for it in items)  # as the state machine counts
    more = len(items) > limit or size >= cap  # cut short by its size: the client reads on from `next`
    items = items[:limit]
    c.room_for(size)
    if fmt == "rows":
        return _rows_answer(rows_body(items), index, more)
    out = [{**key_fields(it.key), **value_fields(it.value, force_b64), "mod_index": it.mod_index} for it in items]
    return json_response({"items": out, **(key_fields(items[-1].key, "next") if more else {"next": None}), "index": index})


def _rows_answer(body: bytes, index: int, more: bool) -> Answer:
    """A page in the bulk format: the index it was read at, and whether to read on."""
    return Answer(body, 200, "application/octet-stream", {"X-Kv-Index": str(index), "X-Kv-More": "true" if more else "false"})


# -- transactions -----------------------------------------------------------------------------


def _fields(d: dict, where: str, allowed: set[str]) -> None:
    """Refuse fields a part of the transaction does not take (rather than ignore them: a
    "mod_index" on an operation would otherwise write unconditionally)."""
    unknown = set(d) - allowed
    if unknown:
        raise BadRequest(
            f"{where}: unknown field(s) {sorted(unknown)}; it takes {sorted(allowed)} "
            '(conditions go in "compare")'
        )


def _key_of(d, where: str) -> str:
    if not isinstance(d, dict):
        raise BadRequest(f"{where} must be an object")
    k = d.get("key")
    if not isinstance(k, str) or not k:
        raise BadRequest(f'{where} needs "key", a non-empty string (base64 with "key_encoding": "base64" for bytes that are not UTF-8)')
    if "key_encoding" in d:
        if d["key_encoding"] != "base64":
            raise BadRequest(f'{where}: "key_encoding" must be "base64" (or left out for UTF-8 text)')
        return key_from(d, where=where)
    return k


_COND_FIELDS = {"mod_index", "exists", "value", "encoding", "value_base64"}
_VALUE_FIELDS = {"value", "encoding", "value_base64"}


def _parse_cond(d, where: str) -> Cond:
    key = _key_of(d, where)
    _fields(d, where, {"key", "key_encoding"} | _COND_FIELDS)
    if len({"value" if f in _VALUE_FIELDS else f for f in _COND_FIELDS & set(d)}) != 1:
        raise BadRequest(f'{where}: compare on exactly one of "mod_index", "exists" or "value"')
    if "mod_index" in d:
        m = d["mod_index"]
        if type(m) is not int or not 0 <= m <= MAX_INDEX:
            raise BadRequest(f"{where}: mod_index must be an integer from 0 to {MAX_INDEX} (0: the key must not exist)")
        return Cond(key, "mod", m)
    if "exists" in d:
        if not isinstance(d["exists"], bool):
            raise BadRequest(f"{where}: exists must be true or false")
        return Cond(key, "exists", d["exists"])
    if _VALUE_FIELDS & set(d):
        return Cond(key, "value", value_from(d, where))
    raise BadRequest(f'{where}: compare on "mod_index", "exists" or "value"')


def _parse_op(d, where: str):
    key = _key_of(d, where)
    op = d.get("op")
    if op == "put":
        _fields(d, where, {"op", "key", "key_encoding"} | _VALUE_FIELDS)
        return Put(key, value_from(d, where))
    if op in ("delete", "get"):
        _fields(d, where, {"op", "key", "key_encoding"})
        return Delete(key) if op == "delete" else Get(key)
    raise BadRequest(f'{where}: "op" must be "put", "delete" or "get"')


def _list(doc: dict, name: str, parse, max_items: int) -> list:
    items = doc.get(name, [])
    if not isinstance(items, list):
        raise BadRequest(f'"{name}" must be a list')
    if len(items) > max_items:  # before parsing them all
        raise BadRequest(f'"{name}" has {len(items)} entries; the limit is {max_items} (--max-txn-ops): split the transaction')
    return [parse(x, f"{name}[{i}]") for i, x in enumerate(items)]


def _op_result(r, force_b64: bool):
    if r is None:
        return {"found": False}
    if hasattr(r, "deleted"):
        return {"index": r.index, "deleted": r.deleted}
    if hasattr(r, "value"):
        return {"found": True, **key_fields(r.key), **value_fields(r.value, force_b64), "mod_index": r.mod_index}
    return {"index": r.index}


async def txn(request: web.Request) -> Answer:
    """{"compare": [...], "success": [...], "failure": [...]}: 200 when the comparisons held
    (success ran), 412 when they did not (failure ran)."""
    c = ctx(request)
    raw = await read_body(request, c.max_json_bytes, "the transaction document")
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise BadRequest('the body must be a JSON object: {"compare": [...], "success": [...], "failure": [...]}')
    unknown = set(doc) - {"compare", "success", "failure"}
    if unknown:
        raise BadRequest(f"unknown fields in the transaction: {sorted(unknown)}")
    max_ops = c.node.config.max_txn_ops
    conds = _list(doc, "compare", _parse_cond, max_ops)
    ops = _list(doc, "success", _parse_op, max_ops)
    else_ops = _list(doc, "failure", _parse_op, max_ops)
    check_keys(request, [x.key for x in (*conds, *ops, *else_ops)])
    try:
        r = await c.node.txn(conds, ops, else_ops, timeout=write_timeout(request), request_id=request_id(request))
        omitted = None
    except ReadsOmitted as e:  # applied: the answer says so, and which gets it leaves out
        r, omitted = e, e
    force_b64 = request.query.get("encoding") == "base64"
    branch = ops if r.succeeded else else_ops
    body = {
        "succeeded": r.succeeded,
        "index": r.index,
        "term": r.term,
        "results": [
            {"omitted": True, **key_fields(op.key)} if omitted is not None and type(op) is Get and x is None else _op_result(x, force_b64)
            for op, x in zip(branch, r.results)
        ],
    }
    if omitted is not None:
        body["reads_omitted"] = {"code": omitted.code, "message": str(omitted)}
    if not r.succeeded:
        body["error"] = {"code": PreconditionFailed.code, "message": "a comparison did not hold; the failure operations ran"}
        return json_response(body, 412)
    return json_response(body)


async def bulk(request: web.Request) -> Answer:
    """Many puts in one entry: the body is rows in kv/statemachine/rows.py's columnar
    format, each with its own condition; 200 with the rows whose condition did not hold
    (nothing written for them), each with what its key holds."""
    c = ctx(request)
    data = await read_body(request, c.node.config.max_request_bytes, "the bulk body", "--max-request-bytes")
    r = await c.node.bulk_put(data, within=lease_prefix(request), timeout=write_timeout(request), request_id=request_id(request))
    return json_response({
        "index": r.index,
        "term": r.term,
        "written": r.written,
        "refused": [{"row": x.row, **key_fields(x.key), "mod_index": x.mod_index, "held": x.held} for x in r.refused],
    })


ANY = r"[\s\S]+"  # a key is any text, newlines too (".+" would not match them)
ROUTES = (  # method, path, handler, name (http/fastpath.py serves some of these too)
    ("PUT", f"/v1/kv/{{key:{ANY}}}", put_key, "kv_put"),
    ("GET", f"/v1/kv/{{key:{ANY}}}", get_key, "kv_get"),
    ("DELETE", f"/v1/kv/{{key:{ANY}}}", delete_key, "kv_delete"),
    ("GET", "/v1/kv", list_keys, "kv_list"),
    ("DELETE", "/v1/kv", delete_prefix, "kv_delete_prefix"),
    ("POST", "/v1/txn", txn, "txn"),
    ("POST", "/v1/bulk", bulk, "bulk"),
)


def add_routes(app: web.Application) -> None:
    for method, path, handler, name in ROUTES:
        app.router.add_route(method, path, handler, name=name)
        if method == "GET":  # HEAD wherever GET (RFC 9110 9.3.2): the same headers, no body (aiohttp drops it)
            app.router.add_route("HEAD", path, handler, name=name)  # (the GET's resource: named alike, counted alike)
