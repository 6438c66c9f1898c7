"""HOST:PORT as people write it (an IPv6 address in brackets: [::1]:8001) and as a URL
names it."""

from __future__ import annotations


def split_hostport(addr: str) -> tuple[str, str]:
    """(host, port) of HOST:PORT, an IPv6 host without its brackets ("" and "" when there
    is no colon)."""
    host, _, port = addr.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


def host_of(hostport: str) -> str:
    """The host of HOST or HOST:PORT (an HTTP Host header), an IPv6 one without its brackets."""
    if hostport.startswith("["):
        return hostport[1 : hostport.find("]")]
    return split_hostport(hostport)[0] if ":" in hostport else hostport


def url_of(scheme: str, host: str, port: int | str) -> str:
    """scheme://host:port, an IPv6 host in brackets."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
