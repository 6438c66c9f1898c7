"""Log lines that strangers can cause are short and few.

Garbage on the HTTP port makes aiohttp log every bad request with a traceback whose message
quotes the whole buffer; running out of descriptors makes asyncio log one traceback per
failed accept(). A node under such an attack must not turn it into megabytes of log per
second. `guard(logger)` installs a filter on a logger that, per kind of record (the logger,
the message template and the exception type):

- lets through at most `burst` records, refilled at `per_second`, and counts the others
  (the next record that gets through says how many were left out);
- cuts every message to `max_chars`, and replaces a traceback by its last line, cut the
  same way, after the first one of each kind (a real bug still shows its traceback once);
- logs a client's bad request (an exception with a 4xx `code`, as aiohttp's parser errors
  have) as a one-line WARNING: it is the client's mistake, not the node's.
"""

from __future__ import annotations

import logging
import time

GUARDED = ("aiohttp.server", "aiohttp.web", "asyncio", "kv.raft.transport", "kv.http")


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


class RateLimit(logging.Filter):
    def __init__(self, per_second: float = 2.0, burst: int = 5, max_chars: int = 200) -> None:
        super().__init__()
        self.per_second, self.burst, self.max_chars = per_second, burst, max_chars
        self._kinds: dict[tuple, list] = {}  # kind -> [tokens, last refill, left out, tracebacks shown]

    def filter(self, record: logging.LogRecord) -> bool:
        exc_type = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        template = str(record.msg).split("\n", 1)[0][:80]
        kind = (record.name, template, exc_type)
        now = time.monotonic()
        state = self._kinds.get(kind)
        if state is None:
            if len(self._kinds) > 1000:  # kinds come from our code, but stay bounded anyway
                self._kinds.clear()
            state = self._kinds[kind] = [float(self.burst), now, 0, 0]
        state[0] = min(self.burst, state[0] + (now - state[1]) * self.per_second)
        state[1] = now
        if state[0] < 1.0:
            state[2] += 1
            return False
        state[0] -= 1.0
        message = _cut(record.getMessage(), self.max_chars)
        if state[2]:
            message += f" ({state[2]} more like this were not logged)"
            state[2] = 0
        if record.exc_info and record.exc_info[1] is not None:
            code = getattr(record.exc_info[1], "code", None)
            if isinstance(code, int) and 400 <= code < 500:
                record.levelno, record.levelname = logging.WARNING, "WARNING"
                state[3] = 1
            if state[3]:
                message += " | " + _cut(f"{exc_type}: {record.exc_info[1]}".replace("\n", " "), self.max_chars)
                record.exc_info = None
            else:
                state[3] = 1
                record.exc_text = _cut(logging.Formatter().formatException(record.exc_info), 40 * self.max_chars)
        record.msg, record.args = message, None
        return True


def guard(*names: str) -> None:
    """Install one rate limit on each of these loggers (default: the ones strangers reach)."""
    for name in names or GUARDED:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimit) for f in logger.filters):
            logger.addFilter(RateLimit())
