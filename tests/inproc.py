"""In-process clusters of kv.Node on loopback (real ledger, LevelDB and TCP), with
partitions made by filtering what each node's transport sends and delivers."""

from __future__ import annotations

import asyncio
import os

from kv.harness import free_port

from kv import Node, NodeConfig
from kv.raft.messages import Role

FAST = {"heartbeat_ms": 50.0, "election_timeout_ms": 500.0}


class InprocCluster:
    def __init__(self, root: str, n: int = 3, **options) -> None:
        self.root = root
        self.ids = [f"n{i}" for i in range(1, n + 1)]
        self.peers = {i: f"127.0.0.1:{free_port()}" for i in self.ids}
        self.options = {**FAST, **options}
        self.nodes: dict[str, Node] = {}
        self.cut: set[tuple[str, str]] = set()  # (from, to) links that drop everything

    def config(self, nid: str) -> NodeConfig:
        return NodeConfig(id=nid, data_dir=os.path.join(self.root, nid), peers=self.peers, **self.options)

    async def start(self, *ids: str) -> None:
        for nid in ids or self.ids:
            node = Node(self.config(nid))
            await node.start()
            self._wrap(node)
            self.nodes[nid] = node

    def _wrap(self, node: Node) -> None:
        raft = node.raft
        t = raft.transport
        send, deliver = t.send, t._deliver

        def cut_send(msg):
            if (msg.src, msg.dst) in self.cut:
                return False
            return send(msg)

        def cut_deliver(msg):
            if (msg.src, msg.dst) not in self.cut:
                deliver(msg)

        t.send, t._deliver = cut_send, cut_deliver

    async def stop(self, *ids: str) -> None:
        for nid in ids or list(self.nodes):
            node = self.nodes.pop(nid, None)
            if node is not None:
                await node.stop()

    def isolate(self, nid: str) -> None:
        for o in self.ids:
            if o != nid:
                self.cut |= {(nid, o), (o, nid)}

    def heal(self) -> None:
        self.cut.clear()

    async def leader(self, timeout: float = 10.0, exclude: tuple = ()) -> Node:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            for nid, n in self.nodes.items():
                if nid not in exclude and n.raft.role == Role.LEADER and n.raft.core.committed_in_term():
                    return n
            await asyncio.sleep(0.02)
        raise AssertionError(f"no leader within {timeout}s")

    async def followers(self) -> list[Node]:
        lead = await self.leader()
        return [n for n in self.nodes.values() if n is not lead]

    async def wait_applied(self, index: int, timeout: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while any(n.raft.applied_index < index for n in self.nodes.values()):
            if loop.time() > deadline:
                raise AssertionError(f"not all nodes applied {index}: {[n.raft.applied_index for n in self.nodes.values()]}")
            await asyncio.sleep(0.02)

    def data(self, nid: str) -> list:
        return self.nodes[nid].sm.scan("", None, 1 << 30)
