"""raft/deadlines: requests fail at their deadline, never before it, at most a bucket late,
and not once answered; on asyncio's loop and on uvloop (whose clock is in milliseconds)."""

import asyncio
import math
import random

import pytest
import uvloop

from kv.raft.deadlines import PER_S, AllOf, Deadlines

LATE_S = 1 / PER_S + 0.5  # a bucket, plus room for a loaded machine's scheduling


class Expired(Exception):
    def __init__(self, at: float) -> None:
        self.at = at


def _loops():
    return pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])


def _run(loop_factory, coro):
    loop = loop_factory()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


@_loops()
def test_requests_fail_at_their_deadline_never_before_and_answered_ones_are_left_alone(loop_factory):
    async def main():
        loop = asyncio.get_running_loop()
        d = Deadlines(lambda: Expired(loop.time()))
        rng = random.Random(7)
        start = loop.time()
        waiting = []
        for _ in range(300):  # deadlines out of order, many sharing a bucket, some past
            deadline = start + rng.uniform(-0.05, 0.4)
            fut = loop.create_future()
            d.add(deadline, fut)
            waiting.append((deadline, fut))
        answered = waiting[::3]
        for _, fut in answered:
            fut.set_result("ok")
        await asyncio.wait([f for _, f in waiting if not f.done()], timeout=10)
        for deadline, fut in waiting:
            if (deadline, fut) in answered:
                assert fut.result() == "ok"
                continue
            err = fut.exception()
            assert isinstance(err, Expired), err
            assert err.at >= deadline, f"failed {deadline - err.at:.9f}s early"
            assert err.at < max(deadline, start) + LATE_S

    _run(loop_factory, main())


@_loops()
def test_a_bucket_is_looked_at_once_not_again_and_again_until_it_is_due(loop_factory):
    """uvloop's clock is whole milliseconds: a bucket time one float step above it made
    the timer find nothing due and call itself back at once, until the next millisecond."""

    async def main():
        loop = asyncio.get_running_loop()
        d = Deadlines(lambda: Expired(loop.time()))
        fires = 0
        fire = d._fire

        def counted():
            nonlocal fires
            fires += 1
            fire()

        d._fire = counted
        futs = []
        for i in range(40):  # one bucket every 10 ms
            fut = loop.create_future()
            d.add(loop.time() + 0.01 * (i + 1), fut)
            futs.append(fut)
        await asyncio.wait(futs, timeout=10)
        assert all(isinstance(f.exception(), Expired) for f in futs)
        assert fires <= 2 * len(futs), f"{fires} timer calls for {len(futs)} buckets"

    _run(loop_factory, main())


async def test_an_infinite_deadline_never_fails_and_raises_nothing():
    loop = asyncio.get_running_loop()
    d = Deadlines(lambda: Expired(loop.time()))
    never, also_never, at_once = loop.create_future(), loop.create_future(), loop.create_future()
    d.add(math.inf, never)  # a caller's timeout=math.inf
    d.add(math.nan, also_never)
    d.add(-math.inf, at_once)
    await asyncio.wait([at_once], timeout=5)
    assert isinstance(at_once.exception(), Expired)
    await asyncio.sleep(0.05)
    assert not never.done() and not also_never.done()


async def test_a_batch_under_one_deadline_fails_only_its_unanswered_members_and_close_stops_all():
    loop = asyncio.get_running_loop()
    d = Deadlines(lambda: Expired(loop.time()))
    a, b = loop.create_future(), loop.create_future()
    d.add(loop.time() + 0.02, AllOf([a, b]))
    a.set_result(1)
    await asyncio.wait([b], timeout=5)
    assert a.result() == 1 and isinstance(b.exception(), Expired)
    assert a.exception() is None

    c = loop.create_future()
    d.add(loop.time() + 0.02, c)
    d.close()
    await asyncio.sleep(0.1)
    assert not c.done()
    # close() is final: what is filed after it arms no timer (the owner fails what it
    # holds: RaftNode.stop fails every waiter).
    late = loop.create_future()
    d.add(loop.time() + 0.01, late)
    assert d._timer is None and not d._buckets
    await asyncio.sleep(0.05)
    assert not late.done()


@_loops()
def test_a_discarded_request_is_let_go_at_once_and_never_failed(loop_factory):
    """discard: what is done long before its deadline is not held until then."""
    import gc
    import weakref

    class Request:
        def __init__(self) -> None:
            self.failed = False

        def done(self) -> bool:
            return False  # (it would be failed, were it still filed)

        def set_exception(self, exc) -> None:
            self.failed = True

    async def main():
        loop = asyncio.get_running_loop()
        d = Deadlines(lambda: Expired(loop.time()))
        kept, let_go = Request(), Request()
        at = loop.time() + 0.05
        bucket = d.add(at, kept)
        assert d.add(at, let_go) == bucket is not None
        gone = weakref.ref(let_go)
        d.discard(bucket, let_go)
        del let_go
        gc.collect()
        assert gone() is None  # no longer referenced by the deadlines
        await asyncio.sleep(0.05 + LATE_S)
        assert kept.failed
        d.discard(bucket, kept)  # (after its bucket fired: nothing to do)
        d.close()

    _run(loop_factory, main())


async def test_a_request_held_for_a_block_is_let_go_when_it_ends_answered_or_not():
    """Deadlines.held: filed while the block runs, out of its bucket once the block ends
    (an answer, an exception, a cancel), so nothing it holds waits for the deadline; and
    failed at the deadline if it comes first."""
    loop = asyncio.get_running_loop()
    d = Deadlines(lambda: Expired(loop.time()))
    answered = loop.create_future()
    with d.held(loop.time() + 60, answered):
        assert any(answered in b for b in d._buckets.values())
        answered.set_result(1)
    assert not any(d._buckets.values())
    with pytest.raises(RuntimeError), d.held(loop.time() + 60, loop.create_future()):
        raise RuntimeError("the caller gave up")
    assert not any(d._buckets.values())
    with d.held(None, loop.create_future()):  # no deadline: nothing filed
        assert not any(d._buckets.values())
    late = loop.create_future()
    with pytest.raises(Expired), d.held(loop.time() + 0.05, late):
        await late
    d.close()
