"""Text for a terminal: aligned columns (kv status, kv cluster up, the benchmarks' tables)
and a one-line progress bar on stderr (snapshot downloads)."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence


def columns(rows: Sequence[Sequence[str]], *, right: Sequence[int] = (), indent: str = "") -> list[str]:
    """Rows of cells as lines of aligned columns two spaces apart; the columns at the
    indexes in `right` are aligned right (numbers), the rest left."""
    widths = [max(len(r[i]) for r in rows) for i in range(max(map(len, rows), default=0))]
    return [
        indent + "  ".join(cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths))).rstrip()
        for r in rows
    ]


class Progress:
    """A one-line progress bar on stderr (a plain line per 10% when not a terminal):
    call it with (done, total) bytes as they come, then done()."""

    def __init__(self, label: str) -> None:
        self.label, self.t0, self.last = label, time.monotonic(), -1
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        pct = int(done * 100 / total) if total else 0
        if self.tty:
            bar = "#" * (pct // 4)
            scale, unit = (1e6, "MB") if max(done, total) >= 1e6 else (1e3, "KB")  # (a small file: not 0.0/0.0 MB)
            rate = done / max(time.monotonic() - self.t0, 1e-6) / scale
            sys.stderr.write(f"\r{self.label} [{bar:<25}] {pct:3d}% {done / scale:8.1f}/{total / scale:.1f} {unit} {rate:6.1f} {unit}/s")
            sys.stderr.flush()
        elif pct // 10 != self.last // 10:
            print(f"{self.label}: {pct}% ({done} of {total} bytes)", file=sys.stderr)
        self.last = pct

    def done(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
