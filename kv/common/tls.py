"""TLS contexts from PEM files: what a client trusts for https:// endpoints (--cacert), and
the loading that the node's own contexts (kv/server/tls.py) share."""

from __future__ import annotations

import ssl

from ..errors import BadRequest


def load_pem(ctx: ssl.SSLContext, what: str, cert: str | None = None, key: str | None = None, ca: str | None = None) -> ssl.SSLContext:
    """ctx with the certificate chain and the CA loaded, or BadRequest naming the files."""
    try:
        if cert:
            ctx.load_cert_chain(cert, key)
        if ca:
            ctx.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as e:
        files = ", ".join(f for f in (cert, key, ca) if f)
        raise BadRequest(f"cannot load {what} from {files}: {e}; give PEM files (certificate, its private key, the CA)") from e
    return ctx


def client_context(cacert: str | None) -> ssl.SSLContext | None:
    """What a client trusts for https:// endpoints: the system's CAs, plus `cacert`."""
    if not cacert:
        return None
    return load_pem(ssl.create_default_context(), "the CA certificate", ca=cacert)
