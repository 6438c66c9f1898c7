"""Backoff: how long to wait before trying again, for everything that retries (the peer
transport's reconnects, the clients' failover, a joining node, a watch going round its
endpoints).

Delays double from `first` up to `cap`, and each is drawn between half of it and all of it
("equal jitter"): clients cut off together (a node died under all of them) do not come back
together, and none waits less than half the nominal delay. Pure: the random source is a
parameter, so a simulation can fix it.
"""

from __future__ import annotations

import random
from collections.abc import Callable


class Backoff:
    def __init__(self, first: float, cap: float, rand: Callable[[], float] = random.random) -> None:
        if not 0 < first <= cap:
            raise ValueError(f"backoff from {first} to {cap}: need 0 < first <= cap")
        self.first, self.cap, self._rand = first, cap, rand
        self._nominal = first

    def next(self) -> float:
        """The delay before the next try (the nominal delay doubles for the one after)."""
        nominal = self._nominal
        self._nominal = min(nominal * 2, self.cap)
        return nominal * (0.5 + 0.5 * self._rand())

    def reset(self) -> None:
        """It worked: the next failure starts again from `first`."""
        self._nominal = self.first
