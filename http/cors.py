"""Web pages and the client API (kv serve --cors).

A browser sends the Origin of the page whose script makes a request; other clients (curl,
ledgerkv's and etcd's clients, etcdctl) send none. A page of any site may send a "simple"
POST (a text/plain body) without asking first, and etcd's JSON gateway takes JSON whatever
the content type: any page its user visited could write to, or empty, a node on localhost
that has no token. So a request with an Origin the node does not list is refused before
anything runs. A listed one gets the CORS headers etcd's gateway sends (etcd allows every
origin unless told otherwise; ledgerkv none), and a preflight (OPTIONS) its answer."""

from __future__ import annotations

from kv.common.origins import parse_origins

PREFLIGHT = {
    "Access-Control-Allow-Methods": "POST, GET, OPTIONS, PUT, DELETE",
    "Access-Control-Allow-Headers": "accept, content-type, authorization, if-match, if-none-match, x-kv-cluster, x-kv-session, x-kv-seq, x-kv-timeout",
    "Access-Control-Max-Age": "600",
}
_EXPOSED = "ETag, Retry-After, X-Kv-Cluster, X-Kv-Index, X-Kv-More, X-Kv-From, X-Kv-To, X-Snapshot-Index, X-Snapshot-Term"
# Chrome asks before a public page calls a private address (localhost, 10.x): a listed one may.
PRIVATE_NETWORK = "Access-Control-Request-Private-Network"


class Cors:
    def __init__(self, spec: str) -> None:
        self.origins = parse_origins(spec)

    def allows(self, origin: str) -> bool:
        return "*" in self.origins or origin.lower() in self.origins

    def headers(self, origin: str) -> dict[str, str]:
        """What an answer to a listed origin carries (a preflight's: PREFLIGHT's too)."""
        return {"Access-Control-Allow-Origin": "*" if "*" in self.origins else origin, "Access-Control-Expose-Headers": _EXPOSED, "Vary": "Origin"}

    def refusal(self, origin: str) -> str:
        # (not the origins it lists: a stranger's page would learn the admins' host names)
        return (
            f"a request from a web page of {origin[:100]!r} (its Origin header) is refused: a page's script may not use "
            "this node unless its --cors lists the page's origin. Clients that are not browsers send no Origin"
        )

    def preflight(self, request_headers) -> dict[str, str]:
        """The answer's headers to a listed page's preflight (OPTIONS)."""
        if request_headers.get(PRIVATE_NETWORK) == "true":
            return {**PREFLIGHT, "Access-Control-Allow-Private-Network": "true"}
        return dict(PREFLIGHT)
