"""A progress line for long imports and exports: rows done, rows/s and the time left, on the
driver's terminal (nothing when stderr is not one).

The rows are done in Spark's tasks, on executors that may be other hosts: each task sends
the driver a UDP datagram as it finishes a chunk (rows, and the units the total is counted
in: rows for an import, snapshot blocks for an export). Best effort by design: a datagram
lost only makes the line lag, and a task that Spark runs again counts again (the line
never passes 100 %; the summary at the end counts each row once). A datagram without this
run's random tag is ignored.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time

_DATAGRAM = struct.Struct(">8sQQQ")  # tag, rows, units, units more in the total
REDRAW_S = 0.5


class ProgressLine:
    """The driver's side: `with ProgressLine(spark, total, "imported") as p:` and hand
    `p.address` to the tasks (a Reporter each)."""

    def __init__(self, spark, total: int, verb: str, out=None, of: str = "") -> None:
        # total: in units, which may be rows or not (`of` says what the share is of); it may
        # be set once known
        self.total, self.verb, self.out, self.of = total, verb, out or sys.stderr, of
        self.rows = self.units = 0
        self.tag = os.urandom(8)
        master = spark.sparkContext.master if spark is not None else "local"  # (None: the tasks run in this process)
        host = "127.0.0.1" if master.startswith("local") else spark.sparkContext.getConf().get("spark.driver.host", "127.0.0.1")
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((socket.gethostbyname(host), 0))
        self.sock.settimeout(REDRAW_S)
        self.address = (*self.sock.getsockname(), self.tag)
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-spark-progress", daemon=True)

    def __enter__(self) -> ProgressLine:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()
        self.out.write("\r\x1b[K")  # the summary takes the line
        self.out.flush()

    def _run(self) -> None:
        drawn = 0.0
        while not self._stop.is_set():
            try:
                data = self.sock.recv(64)
                if len(data) == _DATAGRAM.size:
                    tag, rows, units, total = _DATAGRAM.unpack(data)
                    if tag == self.tag:
                        self.rows += rows
                        self.units += units
                        self.total += total
            except OSError:  # (a time-out: redraw all the same)
                pass
            now = time.monotonic()
            if now - drawn >= REDRAW_S:
                drawn = now
                self.out.write("\r\x1b[K" + self.line(now - self.started))
                self.out.flush()

    def line(self, elapsed: float) -> str:
        done = min(self.units / self.total, 1.0) if self.total > 0 else 0.0
        rate = self.rows / elapsed if elapsed > 0 else 0.0
        left = f"{_clock(elapsed * (1 - done) / done)} left" if done > 0 else "time left not known yet"
        return f"{self.verb} {self.rows:,} rows ({done:.0%}{self.of}), {rate:,.0f} rows/s, {left}"


def _clock(seconds: float) -> str:
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Reporter:
    """A task's side: add(rows, units) after each chunk; silent if the driver is out of reach."""

    def __init__(self, address: tuple[str, int, bytes] | None) -> None:
        self.address, self.sock = address, None
        if address is not None:
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.sock.setblocking(False)

    def add(self, rows: int, units: int, total: int = 0) -> None:
        """rows and units done; `total`: units the driver's total did not count yet (a task
        that counts its rows itself)."""
        if self.sock is None:
            return
        try:
            self.sock.sendto(_DATAGRAM.pack(self.address[2], rows, units, total), self.address[:2])
        except OSError:
            pass

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
