"""The etcd API's watch streams against clients that do not read (tests/test_http2.py's raw
HTTP/2 client): a stream's answers, its watches and the node's watch budget are bounded.
(The untimed lane, tests/conftest.py: nothing here is timed, and one test opens 10,000
watches.)"""

from __future__ import annotations

import asyncio
import struct
import urllib.request
import time

import grpc
import pytest
from test_http2 import _Sender, _serves, one_node

from kv.v3api.proto import rpc_pb2, rpc_pb2_grpc

WATCH_BUDGET = 32 << 20  # --watch-budget-bytes: changes all watches of the node hold together


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    yield from one_node(str(tmp_path_factory.mktemp("watch-limits")), KV_WATCH_BUDGET_BYTES=str(WATCH_BUDGET))


def test_a_watch_stream_that_never_reads_its_answers_pins_bounded_memory(node):
    """Progress requests (7 bytes, each answered with a header of ~40) sent by a client
    that reads no answer: the stream's answers are bounded (--watch-buffer-bytes), then its
    requests are no longer read and flow control stops the client (after ~5 MB here, ~50 MB
    of the node's memory). Before, the node read all 12 MB, and 30 MB cost it 3.8 GB."""
    from kv.bench.harness import rss_mb

    pid = node.procs["n1"].pid
    before = rss_mb(pid)
    c = _Sender(node)
    c.call(1, "/etcdserverpb.Watch/Watch")
    body = rpc_pb2.WatchRequest(progress_request=rpc_pb2.WatchProgressRequest()).SerializeToString()
    chunk = (struct.pack(">BI", 0, len(body)) + body) * 10_000
    sent, deadline = 0, time.monotonic() + 60
    while sent < 12_000_000 and time.monotonic() < deadline and c.send(1, chunk, stall_s=3.0):
        sent += len(chunk)
    grown = rss_mb(pid) - before
    assert sent < 12_000_000, "the node read every request of a client that reads none of its answers"
    assert grown < 100, f"the node grew {grown:.0f} MB for {sent} bytes of progress requests"
    _serves(node)
    c.close()


def test_watches_whose_stream_is_never_read_hold_at_most_the_nodes_watch_budget(node):
    """50 watches on one stream that reads nothing, then 20 changes of 500 kB under them
    (500 MB of answers): the watches fall behind and are cut off within --watch-budget-bytes.
    Before, every answer was queued for the stream (a node grew by a GB for 100 watches)."""
    from kv.bench.harness import rss_mb

    pid = node.procs["n1"].pid
    before = rss_mb(pid)
    c = _Sender(node)
    c.call(1, "/etcdserverpb.Watch/Watch")
    create = rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=b"h2/slow/", range_end=b"h2/slow0")).SerializeToString()
    assert c.send(1, (struct.pack(">BI", 0, len(create)) + create) * 50, stall_s=10.0)
    time.sleep(1.0)  # (each watch is created after a read barrier)
    with grpc.insecure_channel(node.grpc["n1"]) as ch:
        kv = rpc_pb2_grpc.KVStub(ch)
        for i in range(20):
            kv.Put(rpc_pb2.PutRequest(key=b"h2/slow/%d" % i, value=b"s" * 500_000), timeout=10)
    time.sleep(1.0)
    grown = rss_mb(pid) - before
    assert grown < (WATCH_BUDGET >> 20) + 80, f"the node grew {grown:.0f} MB for watches nobody reads"
    _serves(node)
    c.close()


def test_a_watch_stream_holds_at_most_its_limit_of_watches(node):
    from kv.v3api.watch_service import MAX_WATCHES_PER_STREAM

    creates = [rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=b"h2/w%d" % i)) for i in range(MAX_WATCHES_PER_STREAM + 1)]
    with grpc.insecure_channel(node.grpc["n1"]) as ch:
        answers = rpc_pb2_grpc.WatchStub(ch).Watch(iter(creates), timeout=60)
        got = [next(answers) for _ in creates]
        answers.cancel()
    assert all(a.created and not a.canceled for a in got[:-1])
    assert len({a.watch_id for a in got[:-1]}) == MAX_WATCHES_PER_STREAM
    last = got[-1]
    assert last.created and last.canceled and last.watch_id == -1 and "open another stream" in last.cancel_reason
    _serves(node)


def test_a_client_that_reads_keeps_its_watch_while_unread_streams_hold_the_budget(node):
    """Changes that do not fit the node's budget wait for their stream to drain: a watch whose
    client reads every answer gets every change, while 50 watches nobody reads fill the
    budget with the same changes (the review of the first bound: it canceled the reader)."""
    idle = _Sender(node)
    idle.call(1, "/etcdserverpb.Watch/Watch")
    create = rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=b"h2/both/", range_end=b"h2/both0")).SerializeToString()
    assert idle.send(1, (struct.pack(">BI", 0, len(create)) + create) * 50, stall_s=10.0)
    with grpc.insecure_channel(node.grpc["n1"]) as ch:
        requests = iter([rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=b"h2/both/", range_end=b"h2/both0"))])
        answers = rpc_pb2_grpc.WatchStub(ch).Watch(requests, timeout=120)
        assert next(answers).created
        time.sleep(1.0)  # (the idle stream's watches are created)
        kv = rpc_pb2_grpc.KVStub(ch)
        for i in range(30):
            kv.Put(rpc_pb2.PutRequest(key=b"h2/both/%d" % i, value=b"b" * 500_000), timeout=10)
        seen = []
        while len(seen) < 30:
            a = next(answers)
            assert not a.canceled, a.cancel_reason
            seen += [ev.kv.key for ev in a.events]
        answers.cancel()
    assert seen == [b"h2/both/%d" % i for i in range(30)]
    _serves(node)
    idle.close()


def _open_watches(node) -> int:
    with urllib.request.urlopen(node.url("n1") + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("kv_watches "):
                return int(float(line.split()[1]))
    raise AssertionError("no kv_watches in /metrics")


def test_a_watch_canceled_in_the_same_breath_as_its_create_is_closed(node):
    """Creates and cancels of the same watches in one write: the node reads them in one go,
    so a cancel can come before the watch's task has taken its first step (which then runs
    no `finally`): each watch is still closed, and the stream's count of live watches
    goes down (done callbacks). (Before, such a watch was closed only once the garbage
    collector took the task: this passed then too, a few seconds later.)"""
    deadline = time.monotonic() + 10
    while _open_watches(node) and time.monotonic() < deadline:  # the earlier tests' streams, closed, let go of theirs
        time.sleep(0.1)
    before = _open_watches(node)
    assert before == 0
    s = _Sender(node)
    s.call(1, "/etcdserverpb.Watch/Watch")
    msgs = []
    for i in range(1, 201):
        for m in (rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=b"h2/brief", watch_id=i)),
                  rpc_pb2.WatchRequest(cancel_request=rpc_pb2.WatchCancelRequest(watch_id=i))):
            body = m.SerializeToString()
            msgs.append(struct.pack(">BI", 0, len(body)) + body)
    assert s.send(1, b"".join(msgs), stall_s=10.0)
    deadline = time.monotonic() + 60
    while s.answers.get(1, 0) < 400 and time.monotonic() < deadline:  # every create and cancel answered
        time.sleep(0.1)
    assert s.answers.get(1, 0) == 400
    deadline = time.monotonic() + 5
    while _open_watches(node) != before and time.monotonic() < deadline:  # (the done callbacks run soon after)
        time.sleep(0.1)
    assert _open_watches(node) == before
    s.close()


async def test_watches_waiting_for_a_full_stream_to_drain_wait_in_turn(tmp_path):
    """A stream whose client reads slowly, its queue full, with many watches waiting for
    room: each answer the client reads wakes one of them, not all (a stream of 5,000 stalled
    watches cost the node 6 ms of its loop per answer read; one token holder reading slowly
    kept a node's loop busy for minutes). Wakeups are counted by the stream's event."""
    from kv import Node, NodeConfig
    from kv.v3api.watch_service import WatchService, _Stream

    class Counted(asyncio.Event):
        woken = 0

        async def wait(self):
            await super().wait()
            Counted.woken += 1

    node = Node(NodeConfig(id="n1", data_dir=str(tmp_path / "n1"), watch_buffer_bytes=1000))
    await node.start()
    try:
        stream = _Stream(WatchService(node, None), None)
        stream._changed = Counted()
        answer = rpc_pb2.WatchResponse(watch_id=1, events=[{"kv": {"key": b"k", "value": b"v" * 500}}])
        for _ in range(40):  # past the stream's limit (4 x 1,000 bytes)
            stream.put(answer)
        waiting = [asyncio.ensure_future(stream.room()) for _ in range(500)]
        await asyncio.sleep(0.1)
        for _ in range(20):  # the client reads 20 answers: the queue stays full
            await stream.get()
            await asyncio.sleep(0)
        assert not any(t.done() for t in waiting)
        assert Counted.woken <= 2 * 20, f"{Counted.woken} wakeups for 20 answers read"
        while stream.out:  # the client reads the rest: every watch gets its turn
            await stream.get()
        await asyncio.wait_for(asyncio.gather(*waiting), 10)
    finally:
        await node.stop()
