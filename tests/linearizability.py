"""A linearizability checker for key-value register histories (Wing & Gong's search with
Lowe's memoization, as in Porcupine).

The model is one register per key; histories are checked per key (a KV store is
linearizable iff each key's history is, since operations on different keys commute).
Every write stores a unique value, so a CAS that names the version it read (If-Match) is
a CAS on that value.

Operations (`Op`):
    read        output: the value read (None: absent)
    write       input: the value
    cas         input: (expected, new); output: True (applied) or False (412: mismatch)
    delete      sets the register to None

`status` is "ok" (the outcome is known), or "unknown" (a timeout or a broken connection:
the operation may have taken effect at any point after its call, or never). Failed reads
are simply not recorded. Unknown operations get a return time after everything else and
accept any output, so leaving them for last is the same as "never happened".
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

INF = float("inf")


@dataclass
class Op:
    client: int
    kind: str  # read | write | cas | delete
    key: str
    call: float
    ret: float
    input: Any = None
    output: Any = None
    status: str = "ok"  # ok | unknown


def _step(state, op: Op):
    """Apply op to the register state: (legal, new state)."""
    unknown = op.status == "unknown"
    if op.kind == "read":
        return (unknown or op.output == state), state
    if op.kind == "write":
        return True, op.input
    if op.kind == "delete":
        return True, None
    if op.kind == "cas":
        expected, new = op.input
        applies = state == expected
        if unknown:
            return True, (new if applies else state)
        return applies == op.output, (new if applies else state)
    raise ValueError(op.kind)


@dataclass
class Result:
    ok: bool
    key: str | None = None  # the first key whose history is not linearizable
    explored: int = 0


def check(ops: list[Op], initial=None, max_states: int = 5_000_000) -> Result:
    """Whether the history is linearizable (per key)."""
    by_key: dict[str, list[Op]] = defaultdict(list)
    for op in ops:
        by_key[op.key].append(op)
    explored = 0
    for key, kops in sorted(by_key.items()):
        ok, n = _check_key(kops, initial, max_states)
        explored += n
        if not ok:
            return Result(False, key, explored)
    return Result(True, None, explored)


class _Event:
    __slots__ = ("op", "is_call", "prev", "next", "match")

    def __init__(self, op: int, is_call: bool) -> None:
        self.op, self.is_call = op, is_call
        self.prev = self.next = self.match = None


# The value of every write that no read returns and no CAS expects. Such values behave
# alike (each differs from everything compared against), so the search treats them as one.
UNSEEN = object()


def _canonical(ops: list[Op]) -> list[Op]:
    seen = {o.output for o in ops if o.kind == "read"} | {o.input[0] for o in ops if o.kind == "cas"}
    out = []
    for o in ops:
        if o.kind == "write" and o.input not in seen:
            o = replace(o, input=UNSEEN)
        elif o.kind == "cas" and o.input[1] not in seen:
            o = replace(o, input=(o.input[0], UNSEEN))
        out.append(o)
    return out


def _check_key(ops: list[Op], initial, max_states: int) -> tuple[bool, int]:
    """Wing & Gong's search over one key's history, with two reductions for unknown writes
    of unseen values ("phantoms": they may happen any time after their call, or never, and
    nobody can tell them apart):
    - a phantom is only ever linearized when it is the earliest-called one not yet used
      (any linearization using a later one works with the earliest instead: it was called
      earlier still), so the used phantoms are a prefix and the cache sees them as a count;
    - a phantom is not linearized when the register already holds an unseen value (it
      would change nothing and use up a choice).
    The search succeeds once every op with a known outcome is linearized: the unknown ones
    left may never have happened."""
    ops = _canonical(ops)
    rets = [INF if o.status == "unknown" else o.ret for o in ops]
    phantoms = sorted((o.call, i) for i, o in enumerate(ops) if o.status == "unknown" and o.kind == "write" and o.input is UNSEEN)
    rank = {i: r for r, (_, i) in enumerate(phantoms)}
    # Events in time order; at equal times calls come first (touching ops overlap).
    order = sorted([(o.call, 0, i) for i, o in enumerate(ops)] + [(rets[i], 1, i) for i in range(len(ops))])
    head = _Event(-1, False)
    calls: dict[int, _Event] = {}
    last = head
    for _, is_ret, i in order:
        ev = _Event(i, not is_ret)
        if is_ret:
            ev.match = calls[i]
            calls[i].match = ev
        else:
            calls[i] = ev
        last.next, ev.prev = ev, last
        last = ev

    def lift(call: _Event) -> None:  # take an op (its call and its return) out of the list
        for ev in (call, call.match):
            ev.prev.next = ev.next
            if ev.next is not None:
                ev.next.prev = ev.prev

    def unlift(call: _Event) -> None:  # put it back, in the reverse order
        for ev in (call.match, call):
            ev.prev.next = ev
            if ev.next is not None:
                ev.next.prev = ev

    cache: set[tuple[int, Any]] = set()
    stack: list[tuple[_Event, Any]] = []
    linearized = 0
    known_left = sum(1 for o in ops if o.status != "unknown")
    used_phantoms = 0
    state = initial
    entry = head.next
    explored = 0
    while known_left:
        if entry.is_call:
            r = rank.get(entry.op)
            if r is not None and (r != used_phantoms or state is UNSEEN):
                entry = entry.next
                continue
            legal, new_state = _step(state, ops[entry.op])
            explored += 1
            if explored > max_states:
                raise RuntimeError("linearizability search exceeded its budget")
            if legal:
                bits = linearized | (1 << entry.op)
                if (bits, new_state) not in cache:
                    cache.add((bits, new_state))
                    stack.append((entry, state))
                    state, linearized = new_state, bits
                    known_left -= rets[entry.op] != INF
                    used_phantoms += r is not None
                    lift(entry)
                    entry = head.next
                    continue
            entry = entry.next
        else:
            # We reached an op's return without linearizing it: undo the last choice.
            if not stack:
                return False, explored
            entry, state = stack.pop()
            linearized &= ~(1 << entry.op)
            known_left += rets[entry.op] != INF
            used_phantoms -= entry.op in rank
            unlift(entry)
            entry = entry.next
    return True, explored


def brute_force(ops: list[Op], initial=None) -> bool:
    """The oracle for small histories: try every order that respects real time."""
    by_key: dict[str, list[Op]] = defaultdict(list)
    for op in ops:
        by_key[op.key].append(op)
    return all(_brute_key(k, initial) for k in by_key.values())


def _brute_key(ops: list[Op], initial) -> bool:
    known = [o for o in ops if o.status == "ok"]
    unknown = [o for o in ops if o.status != "ok"]
    # Each unknown op either happened (somewhere after its call) or did not.
    for keep in itertools.product([False, True], repeat=len(unknown)):
        cand = known + [o for o, k in zip(unknown, keep) if k]
        for order in itertools.permutations(cand):
            if not _respects_real_time(order):
                continue
            state, good = initial, True
            for o in order:
                legal, state = _step(state, o)
                if not legal:
                    good = False
                    break
            if good:
                return True
    return False


def _respects_real_time(order) -> bool:
    for a in range(len(order)):
        for b in range(a + 1, len(order)):
            later, earlier = order[a], order[b]
            # order[b] comes after order[a]; that is wrong if b returned before a was called
            if earlier.status == "ok" and earlier.ret < later.call:
                return False
    return True
