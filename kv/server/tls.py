"""A node's TLS contexts from PEM files: the HTTP server's (--tls-cert/--tls-key) and mutual
TLS between peers (--peer-cert/--peer-key/--peer-ca). A client's trust is kv/common/tls.py."""

from __future__ import annotations

import ssl

from ..common.tls import load_pem
from ..errors import BadRequest
from ..raft.transport import PeerTLS


def server_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The HTTP API's context, or None without --tls-cert/--tls-key."""
    if not cert and not key:
        return None
    if not (cert and key):
        raise BadRequest("--tls-cert and --tls-key go together: give both")
    return load_pem(ssl.create_default_context(ssl.Purpose.CLIENT_AUTH), "--tls-cert/--tls-key", cert, key)


def peer_tls(cert: str | None, key: str | None, ca: str | None) -> PeerTLS | None:
    """Mutual TLS for the peer port, or None without the --peer-* files. Both directions
    present this node's certificate and require one signed by the CA. Host names are not
    checked: peers are known by id, and the address dialled may be a proxy or a NAT."""
    if not (cert or key or ca):
        return None
    if not (cert and key and ca):
        raise BadRequest("peer TLS needs all three of --peer-cert, --peer-key and --peer-ca")
    server = load_pem(ssl.create_default_context(ssl.Purpose.CLIENT_AUTH), "the peer certificate", cert, key, ca)
    server.verify_mode = ssl.CERT_REQUIRED
    client = load_pem(ssl.create_default_context(ssl.Purpose.SERVER_AUTH), "the peer certificate", cert, key, ca)
    client.check_hostname = False
    client.verify_mode = ssl.CERT_REQUIRED
    return PeerTLS(server, client)
