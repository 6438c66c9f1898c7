"""The event log of `kv serve` (what operators read; not the Raft log, not the ledger): one
line per event on stderr, as text or as JSON objects (`--log-format json`), each carrying
the node id and its current term.

Log lines that strangers can cause are short and few.

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
import sys
import time
from collections.abc import Callable

import orjson


class _NodeFilter(logging.Filter):
    """Stamps every record with the node id and the term (read when the record is made)."""

    def __init__(self, node_id: str) -> None:
        super().__init__()
        self.node_id = node_id
        self.term_of: Callable[[], int | None] = lambda: None

    def filter(self, record: logging.LogRecord) -> bool:
        record.node = self.node_id
        record.term = self.term_of()
        return True


def _utc(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        term = "-" if record.term is None else record.term
        line = f"{_utc(record)} {record.levelname} node={record.node} term={term} {record.name}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, node, term, logger, msg (+ exc, + http for the
    access log)."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": _utc(record), "level": record.levelname, "node": record.node, "term": record.term, "logger": record.name, "msg": record.getMessage()}
        http = getattr(record, "http", None)
        if http is not None:
            doc["http"] = http
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(doc).decode()


_filter: _NodeFilter | None = None


def setup_logging(node_id: str, level: str = "INFO", fmt: str = "text") -> None:
    """Route every logger of the process to stderr in the chosen format."""
    global _filter
    _filter = _NodeFilter(node_id)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_filter)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    guard()  # what strangers can make us log is cut short and rate-limited


def log_term_from(term_of: Callable[[], int | None]) -> None:
    """Once the node runs: where log lines read the current term from."""
    if _filter is not None:
        _filter.term_of = term_of

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
