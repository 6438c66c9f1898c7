"""The log of `kv serve`: one line per event on stderr, as text or as JSON objects
(`--log-format json`), each carrying the node id and its current term."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

import orjson

from . import logguard


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
    logguard.guard()  # what strangers can make us log is cut short and rate-limited


def log_term_from(term_of: Callable[[], int | None]) -> None:
    """Once the node runs: where log lines read the current term from."""
    if _filter is not None:
        _filter.term_of = term_of
