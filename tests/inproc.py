"""In-process clusters of kv.Node (real ledger and LevelDB) on a loopback network, whose
faults (cut, isolate, partition, drop, delay) the tests set through `net`."""

from __future__ import annotations

import asyncio
import os

from kv.bench.harness import free_port

import kv
from kv import Node, NodeConfig
from kv.raft.loopback import LoopbackNetwork
from kv.raft.messages import Role

FAST = {"heartbeat_ms": 50.0, "election_timeout_ms": 500.0}


class InprocCluster:
    def __init__(self, root: str, n: int = 3, net: LoopbackNetwork | None = None, **options) -> None:
        self.root = root
        self.ids = [f"n{i}" for i in range(1, n + 1)]
        # Addresses for the membership only: the nodes talk through `net`.
        self.peers = {i: f"127.0.0.1:{free_port()}" for i in self.ids}
        self.options = {**FAST, **options}
        self.net = net or LoopbackNetwork()
        self.nodes: dict[str, Node] = {}

    def config(self, nid: str) -> NodeConfig:
        return NodeConfig(id=nid, data_dir=os.path.join(self.root, nid), peers=self.peers, **self.options)

    def node(self, config: NodeConfig, **kw) -> Node:
        """A node on this cluster's network (not started)."""
        return Node(config, transport=self.net.transport(config.id), **kw)

    async def start(self, *ids: str) -> None:
        for nid in ids or self.ids:
            node = self.node(self.config(nid))
            await node.start()
            self.nodes[nid] = node

    async def stop(self, *ids: str) -> None:
        for nid in ids or list(self.nodes):
            node = self.nodes.pop(nid, None)
            if node is not None:
                await node.stop()

    async def leader(self, timeout: float = 10.0, exclude: tuple = ()) -> Node:
        """The node that leads and has committed an entry of its term (woken by the nodes'
        leader changes, not by polling)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            nodes = [n for nid, n in self.nodes.items() if nid not in exclude]
            for n in nodes:
                if n.raft.role == Role.LEADER and n.raft.committed_in_term():
                    return n
            left = deadline - loop.time()
            if left <= 0:
                raise AssertionError(f"no leader within {timeout}s")
            # Any node's next change of leader, or a new leader's first commit.
            waits = [loop.create_task(n.raft.leader_changed.wait()) for n in nodes]
            waits += [loop.create_task(n.wait_leader()) for n in nodes if n.raft.role == Role.LEADER]
            done, pending = await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            for t in pending:
                t.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def followers(self) -> list[Node]:
        lead = await self.leader()
        return [n for n in self.nodes.values() if n is not lead]

    async def wait_applied(self, index: int, timeout: float = 10.0) -> None:
        try:
            await asyncio.gather(*(n.wait_applied(index, timeout=timeout) for n in self.nodes.values()))
        except kv.Timeout:
            raise AssertionError(f"not all nodes applied {index}: {[n.raft.applied_index for n in self.nodes.values()]}") from None

    def data(self, nid: str) -> list:
        return self.nodes[nid].sm.scan("", None, 1 << 30)
