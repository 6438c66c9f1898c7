"""What 64 Python threads blocking on their own writes cost before any storage is touched.

kv.open() with 64 threads each writing its own key is measured by `kv bench store`. This
measures the floor under it: the same hand-off with no ledger, no Raft and no LevelDB. Each
thread queues a request and blocks on a lock; a group commit answers everything queued
after a 1 ms sleep (standing in for an fsync, the GIL released) by releasing the locks.

    .venv/bin/python benchmarks/thread_handoff.py [--threads 64] [--seconds 4]

Two ways of doing the group commit are measured, side by side, alternating:

  loop    kv.open's way: the requests go to an event-loop thread (call_soon_threadsafe),
          which answers a batch at a time
  caller  no event loop: the request at the head of the queue writes for everyone
          queued and hands the role on, as LevelDB's own writers do

and, beside them, a busy-wait of N µs per request on the answering side (--work) for the
Python work a real put does. Printed per mode: requests/s, user and system CPU µs per
request, voluntary context switches per request. An answered request needs its thread to
wake and take the GIL back; on a 2-core machine that is the bound.
"""

from __future__ import annotations

import argparse
import collections
import resource
import threading
import time

from kv.common.loop import LoopThread


def _loop_mode(work_s: float):
    lt = LoopThread("handoff")  # kv.open's own loop thread (uvloop where installed)
    loop = lt.loop
    queued: collections.deque[threading.Lock] = collections.deque()
    scheduled = [False]
    writing = [False]

    def drain() -> None:  # on the loop, one commit at a time (kv.open's node: _writing)
        scheduled[0] = False
        if writing[0] or not queued:
            return
        batch = [queued.popleft() for _ in range(len(queued))]  # each popleft is atomic
        writing[0] = True
        loop.call_later(0.001, answer, batch)

    def answer(batch) -> None:
        _busy(work_s * len(batch))
        for lock in batch:
            lock.release()
        writing[0] = False
        drain()

    def put() -> None:
        lock = threading.Lock()
        lock.acquire()
        queued.append(lock)
        if not scheduled[0]:
            scheduled[0] = True
            loop.call_soon_threadsafe(drain)
        lock.acquire()

    return put, lt.close


class _Request:
    __slots__ = ("lock", "lead")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()
        self.lead = False  # set when the writer hands its role to this request's thread


def _caller_mode(work_s: float):
    """LevelDB's writers: the request at the head of the queue writes everything queued
    (its own included), answers the others, and hands the role to the new head."""
    queued: collections.deque[_Request] = collections.deque()
    mu = threading.Lock()

    def put() -> None:
        me = _Request()
        with mu:
            queued.append(me)
            me.lead = len(queued) == 1
        if not me.lead:
            me.lock.acquire()  # answered, or made the writer
            if not me.lead:
                return
        with mu:
            batch = list(queued)
        time.sleep(0.001)
        _busy(work_s * len(batch))
        with mu:
            for _ in batch:
                queued.popleft()
            head = queued[0] if queued else None
            if head is not None:
                head.lead = True
        for r in batch[1:]:
            r.lock.release()
        if head is not None:
            head.lock.release()

    return put, lambda: None


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def run(mode: str, threads: int, seconds: float, work_us: float) -> dict:
    put, close = {"loop": _loop_mode, "caller": _caller_mode}[mode](work_us * 1e-6)
    counts = [0] * threads
    stop = time.monotonic() + seconds

    def worker(w: int) -> None:
        n = 0
        while time.monotonic() < stop:
            put()
            n += 1
        counts[w] = n

    workers = [threading.Thread(target=worker, args=(w,)) for w in range(threads)]
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    close()
    n = max(sum(counts), 1)
    return {
        "mode": mode,
        "work_us": work_us,
        "per_s": n / (t1 - t0),
        "user_us": (r1.ru_utime - r0.ru_utime) / n * 1e6,
        "sys_us": (r1.ru_stime - r0.ru_stime) / n * 1e6,
        "vcsw": (r1.ru_nvcsw - r0.ru_nvcsw) / n,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=64)
    p.add_argument("--seconds", type=float, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--work", default="0,20", help="comma-separated µs of busy work per request")
    args = p.parse_args()
    print(f"{args.threads} threads, a 1 ms group commit, {args.seconds:g} s per run")
    print(f"{'mode':8} {'work µs':>8} {'requests/s':>11} {'user µs':>8} {'sys µs':>8} {'vcsw':>6}")
    for _ in range(args.rounds):
        for work in (float(w) for w in args.work.split(",")):
            for mode in ("loop", "caller"):
                r = run(mode, args.threads, args.seconds, work)
                print(f"{r['mode']:8} {r['work_us']:8g} {r['per_s']:11,.0f} {r['user_us']:8.1f} {r['sys_us']:8.1f} {r['vcsw']:6.2f}", flush=True)


if __name__ == "__main__":
    main()
