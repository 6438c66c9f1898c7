"""Scan: the one meaning of `scan(prefix)` on kv.Node and kv.AsyncClient (kv.open and
kv.Client iterate the same way, blocking): every key under the prefix in key order, fetched
a page at a time, unless `limit` caps the total."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from typing import Any

from ..errors import BadRequest

# fetch(after, n) -> (up to n items strictly after `after`, whether more may follow)
FetchPage = Callable[[str | None, int], Awaitable[tuple[list, bool]]]


class Scan:
    """`async for item in scan` streams the items; `await scan` collects them in a list.

    Each page is read at or after the index the first one was read at: a scan of a prefix
    that changes meanwhile sees each key once, with a value at least that fresh."""

    def __init__(self, fetch: FetchPage, *, after: str | None = None, limit: int | None = None, page: int = 1000) -> None:
        if limit is not None and limit <= 0:
            raise BadRequest("limit must be positive (leave it out to read every key under the prefix)")
        if page <= 0:
            raise BadRequest("page must be positive")
        self._fetch, self._after, self._limit, self._page = fetch, after, limit, page

    async def __aiter__(self) -> AsyncIterator:
        left = self._limit if self._limit is not None else float("inf")
        after = self._after
        while left > 0:
            items, more = await self._fetch(after, int(min(self._page, left)))
            for item in items:
                yield item
            left -= len(items)
            if not more or not items:
                return
            after = items[-1].key

    async def _collect(self) -> list:
        return [item async for item in self]

    def __await__(self) -> Generator[Any, None, list]:
        return self._collect().__await__()
