"""A node's snapshot read by byte ranges over HTTP (`GET /v1/snapshot?index=N` with a
`Range` header), as a read-only file: how executors on any host read their blocks of the
snapshot an export is taken from, with no file shared with the driver. The driver reads
the header, trailer and block index the same way.

The index pins the file: a node keeps its last few snapshots (--snapshot-keep), and one
that has been replaced since answers 404, which stops the export with what to do."""

from __future__ import annotations

import io
import re
import urllib.error
import urllib.request

from ..errors import KVError

READ_AHEAD = 4 << 20  # bytes fetched per request when reading on (the blocks are read in order)
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


class SnapshotGone(KVError):
    """The node no longer has the snapshot (newer ones replaced it)."""


class HttpSnapshot(io.RawIOBase):
    """Reads are served from the last range fetched, READ_AHEAD bytes at a time; the size
    comes with the first answer (an executor's first read is at its own blocks)."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 60.0) -> None:
        super().__init__()
        self.url, self.timeout = url, timeout
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.pos, self.size = 0, None
        self.buf_start, self.buf = 0, b""

    def _fetch(self, start: int, end: int) -> bytes:
        """Bytes [start, end] (inclusive, as HTTP counts; fewer at the end of the file)."""
        req = urllib.request.Request(self.url, headers={**self.headers, "Range": f"bytes={start}-{end}"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                body = resp.read()
                m = _CONTENT_RANGE.fullmatch(resp.headers.get("Content-Range", ""))
                if resp.status != 206 or m is None:
                    raise KVError(f"{self.url} did not answer a byte range (HTTP {resp.status}): is it a ledgerkv node?")
                self.size = int(m.group(3))
                return body
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise SnapshotGone(f"{self.url}: the node no longer has this snapshot (newer ones replaced it): run the export again") from None
            if e.code == 416:  # asked past the end
                return b""
            raise KVError(f"{self.url}: HTTP {e.code} {e.read()[:300]!r}") from None
        except OSError as e:
            raise KVError(f"{self.url}: {e}") from None

    def _size(self) -> int:
        if self.size is None:
            self._fetch(0, 0)
        return self.size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = (self._size() if whence == io.SEEK_END else self.pos if whence == io.SEEK_CUR else 0) + offset
        return self.pos

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self._size() - self.pos
        lo = self.pos - self.buf_start
        if n > 0 and not (0 <= lo and lo + n <= len(self.buf)):
            self.buf, self.buf_start, lo = self._fetch(self.pos, self.pos + max(n, READ_AHEAD) - 1), self.pos, 0
        out = self.buf[lo : lo + n] if n > 0 else b""
        self.pos += len(out)
        return out


def is_url(location: str) -> bool:
    return location.startswith(("http://", "https://"))


def open_snapshot(location: str, token: str | None = None):
    """A snapshot to read: a node's (an http(s) URL) or a file's (a path)."""
    if is_url(location):
        return HttpSnapshot(location, token)
    return open(location, "rb")
