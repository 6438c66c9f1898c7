"""Who may do what: bearer tokens with a role, optionally limited to a key prefix.

`--tokens FILE` (TOML or JSON) maps each token to a role, or to a table with a role and a
prefix:

    "r-9f2c..." = "read"
    "w-77ab..." = { role = "write", prefix = "app/" }
    "a-0c1d..." = "admin"

- `read`: GET a key, scan, watch, status, readiness, the API document;
- `write`: read, plus put, delete, transactions and leases;
- `admin`: everything (membership, leader transfer, snapshots, the log, metrics).

A token with a prefix reaches only keys that start with it: a key route, every key of a
transaction and the prefix of a scan or a watch outside it get 403 FORBIDDEN. The single
`--token` is an admin token. `/healthz` and `/readyz` need none (nor `/metrics` with --metrics-public).

A follower checks the caller before it forwards: writes travel to the leader over the
authenticated peer link as commands (no token needed there), admin requests over HTTP
with the caller's Authorization header, which the leader checks again.
"""

from __future__ import annotations

import hmac
import json
import tomllib
from dataclasses import dataclass

from aiohttp import web

from kv import BadRequest, Forbidden, Unauthorized

from .keys import key_from_raw_path, key_param

ROLES = ("read", "write", "admin")
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/health"})  # answered without a token: probes cannot send one, and these reveal nothing
OWN_CHECKS = ("/v3/", "/v3beta/", "/version", "/v2/")  # routes that check their callers themselves (/v2/: only says it is not served)
_READ_PATHS = frozenset({"/v1/kv", "/v1/watch", "/v1/status", "/readyz", "/v1/openapi.json"})
_PREFIX_PATHS = frozenset({"/v1/kv", "/v1/watch"})  # ?prefix= says which keys they reach
GRANT = web.RequestKey("grant", object)


@dataclass(frozen=True)
class Grant:
    role: str
    prefix: str = ""

    def may(self, role: str) -> bool:
        return ROLES.index(self.role) >= ROLES.index(role)


ADMIN = Grant("admin")


def load_tokens(path: str) -> dict[str, Grant]:
    """Read a tokens file; one clear line for anything wrong in it."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise BadRequest(f"cannot read --tokens {path}: {e}") from e
    try:
        doc = json.loads(raw) if raw.lstrip()[:1] == b"{" else tomllib.loads(raw.decode())
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise BadRequest(f"--tokens {path} is neither JSON nor TOML: {e}") from e
    grants = {}
    for token, spec in doc.items():
        where = f"--tokens {path}, token {token[:4]}..."
        if not token or token != token.strip():
            raise BadRequest(f"--tokens {path}: a token is empty or has spaces around it")
        if isinstance(spec, str):
            spec = {"role": spec}
        if not isinstance(spec, dict) or set(spec) - {"role", "prefix"}:
            unknown = sorted(set(spec) - {"role", "prefix"}) if isinstance(spec, dict) else []
            said = f" ({', '.join(map(repr, unknown))}: {'not one of them' if len(unknown) == 1 else 'not among them'})" if unknown else ""
            raise BadRequest(f'{where}: give a role ("read", "write", "admin") or {{role = "...", prefix = "..."}}{said}')
        role, prefix = spec.get("role"), spec.get("prefix", "")
        if role not in ROLES or not isinstance(prefix, str):
            raise BadRequest(f"{where}: role must be one of {', '.join(ROLES)} and prefix a string, not {role!r}, {prefix!r}")
        grants[token] = Grant(role, prefix)
    if not grants:
        raise BadRequest(f"--tokens {path} lists no tokens")
    return grants


def grant_of(grants: dict[str, Grant], header: str) -> Grant | None:
    """The grant of the bearer token in an Authorization header (every token is compared,
    in constant time, so the time taken says nothing about which one nearly matched)."""
    given = header[7:].encode() if header.startswith("Bearer ") else b""
    found = None
    for token, grant in grants.items():
        if hmac.compare_digest(given, token.encode()) and given:
            found = grant
    return found


def a_role(role: str) -> str:
    """'a read', 'an admin': the role with its article, for error texts."""
    return ("an " if role[0] in "aeiou" else "a ") + role


def _needed(request: web.Request) -> str:
    path = request.path
    if path.startswith("/v1/kv/"):
        return "read" if request.method in ("GET", "HEAD") else "write"
    if path in _READ_PATHS:
        return "read" if request.method in ("GET", "HEAD") else "write"  # DELETE /v1/kv?prefix= writes
    if path in ("/v1/txn", "/v1/bulk", "/v1/leases", "/v1/sessions") or path.startswith("/v1/leases/"):
        return "write"
    return "admin"  # membership, leadership, snapshots, the log, metrics, and any new route


def authorize(request: web.Request, grants: dict[str, Grant]) -> None:
    """Raise Unauthorized (no or unknown token) or Forbidden (the role or the prefix does
    not allow it); remember the caller's grant for handlers that check more keys."""
    if request.path in OPEN_PATHS or request.path.startswith(OWN_CHECKS):
        return  # etcd's gateway takes the token as etcd's clients send it (v3api/access.py)
    grant = grant_of(grants, request.headers.get("Authorization", ""))
    if grant is None:
        raise Unauthorized("missing or wrong token: send Authorization: Bearer <token> (the node's --token, or one from its --tokens file)")
    need = _needed(request)
    if not grant.may(need):
        raise Forbidden(f"{a_role(grant.role)} token may not {request.method} {request.path}: that needs {a_role(need)} token")
    request[GRANT] = grant
    if grant.prefix:
        if request.path.startswith("/v1/kv/"):
            check_keys(request, [key_from_raw_path(request.raw_path, "/v1/kv/")])
        elif request.path in _PREFIX_PATHS:
            prefix = key_param(request, "prefix", "")
            if not prefix.startswith(grant.prefix):
                raise Forbidden(f"this token reaches only keys under {grant.prefix!r}: ask for ?prefix= starting with it, not {prefix!r}")


def lease_prefix(request: web.Request) -> str:
    """The key prefix the caller's token is scoped to ("" for any)."""
    grant = request.get(GRANT)
    return grant.prefix if grant is not None else ""


async def hidden_leases(request: web.Request, node, leases) -> set[int]:
    """The leases a token scoped to a key prefix may not see, renew, revoke or attach keys
    to: one may reach a lease whose keys all lie under its prefix, or that holds none and
    was granted by a token of that prefix (or a narrower one). Read after a linearizable
    read barrier: a follower's view may lag a key just attached. Leases that do not exist
    are left to the route (404, as for a lease of another tenant)."""
    prefix = lease_prefix(request)
    if not prefix:
        return set()
    await node.read_barrier("linearizable")
    scopes = {lease: node.lease_scope(lease) for lease in leases}
    hidden = set()
    for lease, scope in scopes.items():
        if scope is not None:
            owner, keys = scope
            if not (all(k.startswith(prefix) for k in keys) if keys else owner.startswith(prefix)):
                hidden.add(lease)
    return hidden


def check_keys(request: web.Request, keys) -> None:
    """403 unless the caller may reach every one of these keys (a no-op without tokens)."""
    grant = request.get(GRANT)
    if grant is None or not grant.prefix:
        return
    for key in keys:
        if not key.startswith(grant.prefix):
            raise Forbidden(f"this token reaches only keys under {grant.prefix!r}, not {key[:200]!r}")
