"""TLS contexts from PEM files: the HTTP server's (--tls-cert/--tls-key), mutual TLS
between peers (--peer-cert/--peer-key/--peer-ca) and a client's trust (--cacert)."""

from __future__ import annotations

import ssl

from .errors import BadRequest
from .raft.transport import PeerTLS


def _load(ctx: ssl.SSLContext, what: str, cert: str | None = None, key: str | None = None, ca: str | None = None) -> ssl.SSLContext:
    try:
        if cert:
            ctx.load_cert_chain(cert, key)
        if ca:
            ctx.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as e:
        files = ", ".join(f for f in (cert, key, ca) if f)
        raise BadRequest(f"cannot load {what} from {files}: {e}; give PEM files (certificate, its private key, the CA)") from e
    return ctx


def server_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The HTTP API's context, or None without --tls-cert/--tls-key."""
    if not cert and not key:
        return None
    if not (cert and key):
        raise BadRequest("--tls-cert and --tls-key go together: give both")
    return _load(ssl.create_default_context(ssl.Purpose.CLIENT_AUTH), "--tls-cert/--tls-key", cert, key)


def peer_tls(cert: str | None, key: str | None, ca: str | None) -> PeerTLS | None:
    """Mutual TLS for the peer port, or None without the --peer-* files. Both directions
    present this node's certificate and require one signed by the CA. Host names are not
    checked: peers are known by id, and the address dialled may be a proxy or a NAT."""
    if not (cert or key or ca):
        return None
    if not (cert and key and ca):
        raise BadRequest("peer TLS needs all three of --peer-cert, --peer-key and --peer-ca")
    server = _load(ssl.create_default_context(ssl.Purpose.CLIENT_AUTH), "the peer certificate", cert, key, ca)
    server.verify_mode = ssl.CERT_REQUIRED
    client = _load(ssl.create_default_context(ssl.Purpose.SERVER_AUTH), "the peer certificate", cert, key, ca)
    client.check_hostname = False
    client.verify_mode = ssl.CERT_REQUIRED
    return PeerTLS(server, client)


def client_context(cacert: str | None) -> ssl.SSLContext | None:
    """What a client trusts for https:// endpoints: the system's CAs, plus `cacert`."""
    if not cacert:
        return None
    return _load(ssl.create_default_context(), "the CA certificate", ca=cacert)
