"""A task that runs a step every so often on the node's loop until stopped: the leader's
clocks for leases (kv/server/lessor.py) and client sessions (kv/common/sessions.py and kv/server/writes.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable


class Sweep:
    def __init__(self, every_s: float, step: Callable[[float], Awaitable[None]], name: str) -> None:
        """step(now) runs every `every_s` seconds, now being the loop's clock."""
        self.every_s, self._step, self._name = every_s, step, name
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self._name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.every_s)
            await self._step(loop.time())
