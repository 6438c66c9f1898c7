"""`python -m kv.healthcheck`: exit 0 when the local node's /healthz answers 200.

The container healthcheck. It reads the port from KV_HTTP, the variable `kv serve` reads
its --http from, so it follows the configured port. /healthz needs no token.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

from .server.config import check_hostport
from .errors import BadRequest


def main() -> int:
    try:
        host, port = check_hostport(os.environ.get("KV_HTTP", "127.0.0.1:8001"), "KV_HTTP")
    except BadRequest as e:
        print(f"kv healthcheck: {e}", file=sys.stderr)
        return 1
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    url = f"http://{host}:{port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return 0 if r.status == 200 else 1
    except (urllib.error.URLError, OSError) as e:
        print(f"kv healthcheck: {url}: {getattr(e, 'reason', e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
