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
_EXPOSED = "ETag, Retry-After, X-Kv-Cluster, X-Kv-Index, X-Kv-More, X-Snapshot-Index, X-Snapshot-Term"


class Cors:
    def __init__(self, spec: str) -> None:
        self.origins = parse_origins(spec)

    def allows(self, origin: str) -> bool:
        return "*" in self.origins or origin.lower() in self.origins

    def headers(self, origin: str) -> dict[str, str]:
        """What an answer to a listed origin carries (a preflight's: with PREFLIGHT too)."""
        return {"Access-Control-Allow-Origin": "*" if "*" in self.origins else origin, "Access-Control-Expose-Headers": _EXPOSED, "Vary": "Origin"}

    def refusal(self, origin: str) -> str:
        listed = "lists no web page's origin" if not self.origins else f"lists {', '.join(sorted(self.origins))}"
        return (
            f"a request from a web page of {origin[:100]!r} (its Origin header) is refused: a page's script may not use "
            f"this node unless its --cors lists the page's origin, and it {listed}. Clients that are not browsers send no Origin"
        )
