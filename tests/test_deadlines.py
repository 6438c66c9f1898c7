"""raft/deadlines: requests fail at their deadline, never before it, and not once answered."""

import asyncio

from raft.deadlines import GRAIN, AllOf, Deadlines


class Expired(Exception):
    pass


async def test_a_request_fails_at_its_deadline_never_before_and_an_answered_one_is_left_alone():
    loop = asyncio.get_running_loop()
    d = Deadlines(Expired)
    start = loop.time()
    late = loop.create_future()
    answered = loop.create_future()
    d.add(start + 0.3, late)
    d.add(start + 0.3, answered)
    # added after, due before: the timer is moved up for it
    early = loop.create_future()
    d.add(start + 0.05, early)
    answered.set_result("ok")

    await asyncio.wait([early], timeout=5)
    assert loop.time() >= start + 0.05
    assert isinstance(early.exception(), Expired)
    assert not late.done()

    await asyncio.wait([late], timeout=5)
    assert loop.time() >= start + 0.3
    assert loop.time() < start + 0.3 + GRAIN + 0.5  # at most a grain late, plus scheduling
    assert isinstance(late.exception(), Expired)
    assert answered.result() == "ok"
    assert late.exception() is not early.exception()  # each gets its own error


async def test_a_batch_under_one_deadline_fails_only_its_unanswered_members_and_close_stops_all():
    loop = asyncio.get_running_loop()
    d = Deadlines(Expired)
    a, b = loop.create_future(), loop.create_future()
    d.add(loop.time() + 0.02, AllOf([a, b]))
    a.set_result(1)
    await asyncio.wait([b], timeout=5)
    assert a.result() == 1 and isinstance(b.exception(), Expired)

    c = loop.create_future()
    d.add(loop.time() + 0.02, c)
    d.close()
    await asyncio.sleep(0.1)
    assert not c.done()
