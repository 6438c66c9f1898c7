"""What a client knows of a cluster's endpoints: their URLs, which to ask next (those that
failed recently last), what a node's error answer means, and how to say that no node can be
reached. kv.AsyncClient and its watch streams share it."""

from __future__ import annotations

import logging
import os
import random
import socket
import ssl
import time
from collections.abc import Sequence
from urllib.parse import quote, urlencode, urlsplit

import aiohttp
import orjson

from .. import errors
from ..common.wire import checked_key_bytes, key_from

log = logging.getLogger("kv.client")

DEFAULT_ENDPOINTS = ("http://127.0.0.1:8001", "http://127.0.0.1:8002", "http://127.0.0.1:8003")

# The server's error code picks the class where the status alone is ambiguous.
_ERRORS_BY_CODE = {c.code: c for c in (errors.MemberExists, errors.NoQuorum, errors.Unavailable, errors.NotLeader, errors.FutureRevision, errors.WrongCluster)}
_ERRORS = {
    400: errors.BadRequest,
    401: errors.Unauthorized,
    403: errors.Forbidden,
    404: errors.NotFound,
    409: errors.Conflict,
    410: errors.Compacted,
    413: errors.ValueTooLarge,
    507: errors.NoSpace,
    504: errors.Timeout,
}


def parse_endpoints(spec: str | Sequence[str] | None) -> list[str]:
    """A client's endpoints as URLs; None: $KV_ENDPOINTS if it is set (as the CLI reads
    it: a cluster `kv cluster up --base-port` started elsewhere prints it), else the local
    `kv cluster up` nodes' defaults."""
    env = os.environ.get("KV_ENDPOINTS")
    if spec is None:
        spec = env or None
        if spec is None:
            return list(DEFAULT_ENDPOINTS)
    try:
        return _urls(spec)
    except errors.BadRequest as e:
        if spec == env:  # (the CLI's --endpoints defaults to it too)
            raise errors.BadRequest(f"$KV_ENDPOINTS={env!r}: {e}") from None
        raise


def _urls(spec: str | Sequence[str]) -> list[str]:
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = []
    for e in (x.strip().rstrip("/") for x in items):
        if not e:
            continue
        url = e if "://" in e else f"http://{e}"
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
            raise errors.BadRequest(f"endpoint {e!r} is not a client URL: give http://HOST:PORT or https://HOST:PORT, comma-separated")
        if parts.path or parts.query or parts.fragment:  # /v1/kv/... is added to it: it would miss every route
            rest = url[len(f"{parts.scheme}://{parts.netloc}"):]
            raise errors.BadRequest(f"endpoint {e!r} has more than a host and port ({rest!r}): give {parts.scheme}://{parts.netloc}")
        out.append(url)
    if not out:
        raise errors.BadRequest("no endpoints given: e.g. --endpoints http://127.0.0.1:8001")
    return out


NOT_A_NODE = "is it a ledgerkv node's client URL (kv serve --http; kv.Client's endpoints, the CLI's --endpoints or $KV_ENDPOINTS)?"


def is_ours(body: bytes) -> bool:
    """Whether an error's body is ledgerkv's error model ({"error": {"code": ...}})."""
    try:
        return isinstance(orjson.loads(body)["error"]["code"], str)
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return False


def with_query(url: str, params: dict | None) -> str:
    """url?params, percent-encoded here: a key whose bytes are not UTF-8 (held as lone
    surrogates, see kv.statemachine.commands.key_bytes) goes as those bytes, where yarl would
    refuse it."""
    if not params:
        return url
    return url + "?" + urlencode({k: checked_key_bytes(v) if isinstance(v, str) else v for k, v in params.items()}, quote_via=quote)


def raise_for(status: int, body: bytes, endpoint: str):
    raise error_for(status, body, endpoint)


def error_for(status: int, body: bytes, endpoint: str) -> errors.KVError:
    """The error a node's answer stands for, in the node's words."""
    try:
        err = orjson.loads(body).get("error", {})
    except (orjson.JSONDecodeError, AttributeError):
        err = {}
    if not isinstance(err, dict) or not isinstance(err.get("code", ""), str):
        err = {}  # not ledgerkv's error model (a proxy's 503, say)
    text = " ".join(body[:200].decode(errors="replace").split())  # one line, whatever it was
    msg = f"{endpoint}: {err.get('message') or (f'HTTP {status}: {text}' if text else status)}"
    if status == 401:  # the server's words are for HTTP; say where a client's token goes
        msg += " — with kv: --token or $KV_TOKEN, or kv.Client(token=...)"
    if status == 412:
        return errors.PreconditionFailed(key_from(err) if "key" in err else "", int(err.get("mod_index") or 0), msg)
    if err.get("code") == errors.LeaseNotFound.code:
        return errors.LeaseNotFound(int(err.get("lease") or 0), msg)
    if err.get("code") == errors.SessionExpired.code:
        return errors.SessionExpired(int(err.get("session") or 0), msg)
    if err.get("code") == errors.RevisionCompacted.code and "compact_revision" in err:
        return errors.RevisionCompacted(msg, int(err["compact_revision"] or 0))
    cls = _ERRORS_BY_CODE.get(err.get("code")) or _ERRORS.get(status)
    if cls is not None:
        return cls(msg)
    if status == 503:
        return errors.NotLeader(msg)
    return errors.KVError(msg)


NOTHING_LISTENS = "is the cluster running (kv cluster up), and are these its client URLs (kv.Client's endpoints; the CLI's --endpoints or $KV_ENDPOINTS)?"
NO_SUCH_HOST = "is the name spelled right, and are these the cluster's client URLs (kv.Client's endpoints; the CLI's --endpoints or $KV_ENDPOINTS)?"
UNREACHABLE_NOTICE_S = 2.0  # every endpoint unreachable this long: say so while waiting
UNREACHABLE_REPEAT_S = 60.0  # and not again from the same client sooner (a loop of calls)


def why_unreachable(e: Exception | None) -> str | None:
    """Why no node can answer at an endpoint, where that is worth saying before the
    timeout ends the wait: nothing listens, the host name does not resolve (a typo, or a
    container not started yet), or an https:// URL reached a server without TLS. None for
    anything else (a slow node, a reset)."""
    if isinstance(e, aiohttp.ClientConnectorError):
        if isinstance(e.os_error, ConnectionRefusedError):
            return "connection refused"
        # The threaded resolver raises socket.gaierror; aiodns's (aiohttp[speedups]) a
        # plain OSError inside aiohttp's DNS error (aiohttp 3.10 and later).
        if isinstance(e.os_error, socket.gaierror) or isinstance(e, _DNS_ERROR):
            return "the host name does not resolve"
        if isinstance(e.os_error, ssl.SSLError) and any(w in str(e.os_error) for w in _NOT_TLS):
            return "no TLS at this address"
    return None


_DNS_ERROR = getattr(aiohttp, "ClientConnectorDNSError", ())
# What OpenSSL says of an answer that is not TLS (before 3.2; 3.2 and later)
_NOT_TLS = ("WRONG_VERSION_NUMBER", "record layer failure")
# Failures before a connection existed, after which a write is sent again safely: it
# cannot have reached a node. (aiohttp 3.10 and later tell a connect timeout apart.)
NOT_CONNECTED = (aiohttp.ClientConnectorError, *(getattr(aiohttp, n) for n in ("ConnectionTimeoutError",) if hasattr(aiohttp, n)))


def describe(e: BaseException) -> str:
    return str(e) or type(e).__name__  # ServerDisconnectedError and timeouts say nothing


class Unreachable:
    """Endpoints where no node can answer (why_unreachable: nothing listens, the name does
    not resolve, no TLS) since anything else happened there. A node restarting, or a cluster still starting,
    answers again within seconds; all of them unreachable for longer is worth saying, once,
    on the kv.client logger, while the caller waits on until its timeout (an operator's
    first mistake: nothing is running, or a URL is mistyped)."""

    def __init__(self, rotation: Rotation, timeout: float) -> None:
        self.rotation = rotation  # it keeps when it last said so, across calls
        self.timeout = timeout
        self.whys: dict[str, str] = {}
        self.since = 0.0
        self.noticed = False

    def saw(self, ep: str, error: Exception | None, endpoints: Sequence[str]) -> None:
        why = why_unreachable(error)
        if why is None:
            self.whys.clear()
            return
        if self.noticed:
            return
        if not self.whys:
            self.since = time.monotonic()
        self.whys[ep] = why
        now = time.monotonic()
        if self.whys.keys() >= set(endpoints) and now - self.since >= UNREACHABLE_NOTICE_S:
            self.noticed = True
            if now - self.rotation.unreachable_told < UNREACHABLE_REPEAT_S:
                return
            self.rotation.unreachable_told = now
            whys = sorted(set(self.whys.values()))
            log.warning(
                "%s at %s (%s); still trying until the %gs timeout: %s",
                "nothing listens" if whys == ["connection refused"] else "no node can answer",
                ", ".join(sorted(self.whys)), "; ".join(whys), self.timeout, " ".join(_ASK[w] for w in whys),
            )


NOT_TLS = "a node started without --tls-cert serves http://, not https://"
_ASK = {"connection refused": NOTHING_LISTENS, "the host name does not resolve": NO_SUCH_HOST, "no TLS at this address": NOT_TLS}  # what to check, by why_unreachable()


TIMEOUT_HEADER = "X-Kv-Timeout"  # the seconds this client waits for an answer (http/errors.py)
CLUSTER_HEADER = "X-Kv-Cluster"  # the cluster this client reached first (http/params.py)
# One node's share of a request that may be sent again: above an election (a node waiting
# for a leader answers 503 within it), far below a call's timeout and a lease's ttl.
ATTEMPT_TIMEOUT_S = 2.0
RECENT_FAILURE_S = 10.0  # an endpoint that failed this recently is tried after the others
SESSION_HEADER, SEQ_HEADER = "X-Kv-Session", "X-Kv-Seq"  # a write's request id (http/routes_sessions.py)


def margin(left: float) -> float:
    """Time kept back from the node's share of `left` for connecting and the answer's way back."""
    return max(0.1 * left, 0.1)


HINT = " — "  # between what failed and what to check (kv status shows only the first part)


def unreachable_hint(e: Exception | None, endpoint: str = "") -> str:
    why = why_unreachable(e)
    if why:
        return f"{HINT}{why}: {_ASK[why]}"
    if isinstance(e, aiohttp.ServerDisconnectedError) and endpoint.startswith("http://"):
        # (what a TLS server does with plain HTTP; a node restarting does it too, briefly)
        return f"{HINT}if the node serves TLS (kv serve --tls-cert), its URL is https://"
    return ""


def none_answered(what: str, answers) -> str:
    """`what`, then why each (endpoint, error) of `answers` failed; the hint they all end
    with (unreachable_hint's) said once, at the end, rather than once per endpoint."""
    texts = [str(e) if str(e).startswith(ep) else f"{ep}: {e}" for ep, e in answers]
    hints = {t.partition(HINT)[2] for t in texts}
    if len(hints) == 1 and "" not in hints:
        return f"{what}: {'; '.join(t.partition(HINT)[0] for t in texts)}{HINT}{hints.pop()}"
    return f"{what}: {'; '.join(texts)}"


class Rotation:
    """The endpoints in turn, starting at a random one (clients spread over the nodes),
    passing over those that failed in the last RECENT_FAILURE_S."""

    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints
        self.turn = random.randrange(len(endpoints))
        self._failed: dict[str, float] = {}  # endpoint -> when a request to it last failed
        self.unreachable_told = -UNREACHABLE_REPEAT_S  # when Unreachable last said so

    def pick(self) -> str:
        """The next endpoint in turn, passing over those that failed recently (all did:
        the one that failed longest ago)."""
        n, now = len(self.endpoints), time.monotonic()
        order = [self.endpoints[(self.turn + i) % n] for i in range(n)]
        for ep in order:
            if now - self._failed.get(ep, -RECENT_FAILURE_S) >= RECENT_FAILURE_S:
                return ep
        return min(order, key=self._failed.__getitem__)

    def prefer(self, ep: str) -> None:
        """Start with ep (say, the leader, where writes need no forwarding)."""
        self.turn = self.endpoints.index(ep)

    def current(self) -> str:
        """The endpoint whose turn it is, failed or not (a watch goes round them all)."""
        return self.endpoints[self.turn % len(self.endpoints)]

    def failed(self, ep: str) -> None:
        """A request to ep failed: it is tried after the others for a while."""
        self._failed[ep] = time.monotonic()

    def answered(self, ep: str) -> None:
        self._failed.pop(ep, None)

    def advance(self) -> None:
        self.turn += 1

    def start_at(self, endpoint: str) -> None:
        """Try `endpoint` next, and forget past failures (a caller that knows better, a test)."""
        self.turn = self.endpoints.index(endpoint)
        self._failed.clear()
