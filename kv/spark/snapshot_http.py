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
    def __init__(self, url: str, token: str | None = None, timeout: float = 60.0) -> None:
        super().__init__()
        self.url, self.timeout = url, timeout
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.pos = self.size = 0
        self.buf_start, self.buf = 0, b""
        self.size = self._fetch(0, 0)[1]

    def _fetch(self, start: int, end: int) -> tuple[bytes, int]:
        """Bytes [start, end] (inclusive, as HTTP counts) and the file's size."""
        req = urllib.request.Request(self.url, headers={**self.headers, "Range": f"bytes={start}-{end}"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                body = resp.read()
                m = _CONTENT_RANGE.fullmatch(resp.headers.get("Content-Range", ""))
                if resp.status != 206 or m is None:
                    raise KVError(f"{self.url} did not answer a byte range (HTTP {resp.status}): is it a ledgerkv node?")
                return body, int(m.group(3))
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise SnapshotGone(f"{self.url}: the node no longer has this snapshot (newer ones replaced it): run the export again") from None
            if e.code == 416:  # asked past the end
                return b"", self.size
            raise KVError(f"{self.url}: HTTP {e.code} {e.read()[:300]!r}") from None
        except OSError as e:
            raise KVError(f"{self.url}: {e}") from None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset
        return self.pos

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self.size - self.pos
        n = min(n, max(0, self.size - self.pos))
        if n == 0:
            return b""
        lo = self.pos - self.buf_start
        if not (0 <= lo and lo + n <= len(self.buf)):
            want = max(n, READ_AHEAD)
            self.buf, _ = self._fetch(self.pos, min(self.size, self.pos + want) - 1)
            self.buf_start, lo = self.pos, 0
        out = self.buf[lo : lo + n]
        self.pos += len(out)
        return out


def open_snapshot(location: str, token: str | None = None):
    """A snapshot to read: a node's (an http(s) URL) or a file's (a path)."""
    if location.startswith(("http://", "https://")):
        return HttpSnapshot(location, token)
    return open(location, "rb")
