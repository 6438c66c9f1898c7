"""Free loopback ports for tests."""

from __future__ import annotations

import socket

_handed: set[int] = set()


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed and port < 60000:
            _handed.add(port)
            return port
