"""Web pages and the client API (kv serve --cors).

A browser sends the Origin of the page whose script makes a request; other clients (curl,
ledgerkv's and etcd's clients, etcdctl) send none. A page of any site may send a "simple"
POST (a text/plain body) without asking first, and etcd's JSON gateway takes JSON whatever
the content type: any page its user visited could write to, or empty, a node on localhost
that has no token. So a request with an Origin the node does not list is refused before
anything runs. A listed one gets the CORS headers etcd's gateway sends (etcd allows every
origin unless told otherwise; ledgerkv none), and a preflight (OPTIONS) its answer.

A page can also rebind its own name to 127.0.0.1 (DNS rebinding): its requests are then
same-origin, and a GET carries no Origin. They do carry the page's name in Host, a domain
its site registered, which no client of a node on this machine has reason to send: a
request from this machine whose Host is such a name is refused too (an address, a name
without a dot, this machine's own, and the local-only suffixes are not such names)."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable

from kv.common.addresses import host_of
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


# Names no site can register, to rebind (RFC 6761, 6762, 8375; ICANN's .internal)
_LOCAL_SUFFIXES = (".localhost", ".local", ".internal", ".home.arpa", ".lan")


class LocalNames:
    """Which Host headers a request from this machine may carry: an address, a name without
    a dot (localhost, this machine's), one under a local-only suffix, one the hosts file
    gives a loopback address (Debian's full name for the machine, on 127.0.1.1), the
    advertised host."""

    def __init__(self, more: tuple[str, ...] = (), hosts_file: str = "/etc/hosts") -> None:
        # (not getfqdn: a DNS lookup at start; Debian's own full name is in /etc/hosts, on 127.0.1.1)
        self.names = {socket.gethostname().lower(), *(n.lower() for n in more if n), *_loopback_names(hosts_file)}
        self._seen: dict[str, bool] = {}  # Host header -> allowed (clients send one or two)

    def allows(self, host: str | None, remote: Callable[[], str | None]) -> bool:
        """remote(): the client's address, asked for only when the name is not one of these."""
        if host is None:
            return True
        ok = self._seen.get(host)
        if ok is None:
            ok = self._name_allowed(host)
            if len(self._seen) < 256:  # (a stranger's many names are each worked out again)
                self._seen[host] = ok
        return ok or not _loopback(remote())

    def _name_allowed(self, host: str) -> bool:
        name = host_of(host).lower().rstrip(".")
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            return "." not in name or name in self.names or name.endswith(_LOCAL_SUFFIXES)

    @staticmethod
    def refusal(host: str) -> str:
        return (
            f"a request from this machine for the host {host[:100]!r} (its Host header) is refused: a web page whose name "
            "was made to point here (DNS rebinding) sends such a request. Reach the node as localhost, by its address, "
            "or by this machine's name"
        )


def _loopback_names(path: str) -> set[str]:
    """The names a hosts file gives loopback addresses (only root can change it)."""
    names: set[str] = set()
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.partition("#")[0].split()
                if len(fields) > 1 and _loopback(fields[0]):
                    names.update(n.lower().rstrip(".") for n in fields[1:])
    except OSError:
        pass
    return names


def _loopback(remote: str | None) -> bool:
    try:
        ip = ipaddress.ip_address((remote or "").partition("%")[0])
    except ValueError:
        return False  # (none, or a Unix socket's: not served)
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback  # (::ffff:127.0.0.1 on a dual-stack socket)
