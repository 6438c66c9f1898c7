"""The OpenAPI document: valid OpenAPI 3, a named schema for every JSON body and for the
error model, bearer security, and real answers of a node that match their schemas."""

from __future__ import annotations

import json
import re
import os

import pytest
from aiohttp.test_utils import TestClient, TestServer
from openapi_schema_validator import OAS30Validator, validate
from openapi_spec_validator import validate as validate_spec

from kv import Node, NodeConfig
from kv.http.app import create_app

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

with open(os.path.join(ROOT, "http", "openapi.json")) as f:
    SPEC = json.load(f)


def operations():
    for path, ops in SPEC["paths"].items():
        for method, op in ops.items():
            yield path, method, op


def test_the_document_is_valid_openapi():
    validate_spec(SPEC)


def test_every_json_body_is_a_named_schema():
    schemas = SPEC["components"]["schemas"]
    bodies = 0
    for path, method, op in operations():
        contents = [("request", op["requestBody"]["content"])] if "requestBody" in op else []
        contents += [(code, r["content"]) for code, r in op["responses"].items() if "content" in r]
        for where, content in contents:
            if "application/json" in content:
                schema = content["application/json"]["schema"]
                assert set(schema) == {"$ref"}, f"{method.upper()} {path} {where}: inline schema; name it under components.schemas"
                assert schema["$ref"].removeprefix("#/components/schemas/") in schemas
                bodies += 1
    assert bodies >= 20
    errors = [r for _, _, op in operations() for r in op["responses"].values() if r.get("$ref", "").endswith(("/Error", "/Unavailable"))]
    assert errors and SPEC["components"]["responses"]["Error"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}


def test_bearer_security_everywhere_but_the_probes():
    bearer = SPEC["components"]["securitySchemes"]["bearer"]
    assert bearer["type"] == "http" and bearer["scheme"] == "bearer"
    assert SPEC["security"] == [{"bearer": []}]
    for path, _, op in operations():
        if path in ("/healthz", "/readyz"):
            assert op["security"] == []
        else:
            assert op.get("security", SPEC["security"]) != []


def check(instance, schema_name: str) -> None:
    validate(instance, {"$ref": f"#/components/schemas/{schema_name}", "components": SPEC["components"]}, cls=OAS30Validator)


@pytest.fixture
async def api(tmp_path):
    node = Node(NodeConfig(id="n1", data_dir=str(tmp_path / "n1"), peers={"n1": "127.0.0.1:1"}))
    await node.start()
    while node.raft.leader_id is None:
        await node.raft.leader_changed.wait()
    client = TestClient(TestServer(create_app(node)))
    await client.start_server()
    yield client
    await client.close()
    await node.stop()


async def test_answers_match_their_schemas(api):
    async def body(method: str, path: str, status: int = 200, **kw):
        r = await api.request(method, path, **kw)
        assert r.status == status, await r.text()
        return await r.json()

    check(await body("PUT", "/v1/kv/a", data=b"1"), "WriteResult")
    await api.put("/v1/kv/b", data=b"\xff")
    check(await body("GET", "/v1/kv", params={"prefix": ""}), "ScanResult")
    check(await body("DELETE", "/v1/kv/b"), "DeleteResult")
    txn = {"compare": [{"key": "a", "exists": True}], "success": [{"op": "get", "key": "a"}, {"op": "put", "key": "c", "value": "x"}], "failure": []}
    check(txn, "TxnRequest")
    check(await body("POST", "/v1/txn", json=txn), "TxnResult")
    check(await body("POST", "/v1/txn", 412, json={"compare": [{"key": "zz", "exists": True}]}), "TxnResult")
    check(await body("GET", "/v1/status"), "Status")
    check(await body("GET", "/v1/members"), "MemberList")
    check(await body("POST", "/v1/leader/transfer", json={"to": "n1"}), "Leader")
    check(await body("POST", "/v1/snapshot"), "SnapshotTaken")
    check(await body("GET", "/healthz"), "Health")
    check(await body("GET", "/readyz"), "Ready")
    lease = await body("POST", "/v1/leases", json={"ttl": 30})
    check(lease, "Lease")
    await api.put("/v1/kv/leased", data=b"1", params={"lease": str(lease["id"])})
    check(await body("GET", f"/v1/leases/{lease['id']}"), "LeaseInfo")
    check(await body("GET", "/v1/leases"), "LeaseList")
    check(await body("POST", f"/v1/leases/{lease['id']}/keepalive"), "Lease")
    batch = {"ids": [lease["id"], 999999]}
    check(batch, "LeaseKeepAlives")
    renewed = await body("POST", "/v1/leases/keepalive", json=batch)
    check(renewed, "LeaseKeepAlivesResult")
    assert [x["id"] for x in renewed["leases"]] == [lease["id"]] and renewed["not_found"] == [999999]
    check(await body("DELETE", f"/v1/leases/{lease['id']}"), "LeaseRevoked")
    check(await body("POST", "/v1/leases", 400, json={"ttl": 0}), "Error")
    check(await body("GET", "/v1/kv/missing", 404), "Error")
    check(await body("PUT", "/v1/kv/a", 412, data=b"2", headers={"If-Match": '"999"'}), "Error")


async def test_every_route_is_documented(api):
    """Each route the app serves is in the document, with its method (so a new route
    cannot ship undocumented)."""
    served = set()
    for route in api.server.app.router.routes():
        info = route.resource.get_info()
        path = info.get("path") or info.get("formatter")
        if route.method not in ("HEAD", "*") and path != "/":
            served.add((re.sub(r"\{(\w+)(:[^}]*)?\}", r"{\1}", path), route.method.lower()))
    documented = {(path, method) for path, method, _ in operations()}
    assert served - documented == set()
    assert ("/v1/leases/keepalive", "post") in served
