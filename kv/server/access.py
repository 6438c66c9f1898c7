"""What a request's line in the access log says beyond the HTTP front's own view, set by the
layers that handled it."""

from __future__ import annotations

import contextvars

# Set when this node hands a client's request to the leader (kv/server/writes.py forwards
# writes; the HTTP front forwards what it cannot serve); the HTTP front resets it per request.
request_forwarded: contextvars.ContextVar[bool] = contextvars.ContextVar("kv_request_forwarded", default=False)
