"""The remote client: kv.AsyncClient (asyncio, aiohttp) and kv.Client (blocking), which
talk to any node of a cluster over its HTTP API, and the coordination recipes built on a
store (leases kept alive, locks, elections: kv.client.recipes) that kv.Node and kv.open
share with them.

    endpoints.py     the cluster's URLs, which to ask next, what a node's error means
    async_client.py  kv.AsyncClient: every call, with failover and exactly-once writes
    blocking.py      kv.Client: the same, blocking, on a loop thread of its own
    watch.py         a watch stream that resumes on another node without gap or repeat
    recipes.py       Lease, Lock, Election over any store (a client, kv.Node, kv.open)

Nothing here imports the server (kv.node, kv.server, lmdb, plyvel): a client-only program
needs neither the Raft stack nor the storage engines. kv.Client and kv.AsyncClient load
aiohttp on first use.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "AsyncClient":
        from .async_client import AsyncClient

        return AsyncClient
    if name == "Client":
        from .blocking import Client

        return Client
    raise AttributeError(f"module 'kv.client' has no attribute {name!r}")
