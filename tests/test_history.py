"""The state machine's history (statemachine/history.py): reads at a past revision, the
changes of a range of revisions with prev_kv, Compact and the purge of what it made
unreachable, snapshots carrying it — checked against a model kept by the test."""

from __future__ import annotations

import random

import pytest

from kv.raft.messages import Entry, EntryKind
from kv.statemachine import commands as c
from kv.statemachine.leveldb import LevelDBStateMachine

KEYS = ["a", "a\x00", "a\x00b", "a\x01", "ab", "b", "b/1", "b/2", "ключ", "z"]


def _entry(index: int, cmd) -> Entry:
    return Entry(index, 1, EntryKind.NORMAL, c.encode(cmd))


def _random_cmd(rng: random.Random, index: int):
    pick = rng.random()
    key = rng.choice(KEYS)
    if pick < 0.45:
        return c.Put(key, b"v%d" % index)
    if pick < 0.57:
        return c.Delete(key)
    if pick < 0.65:
        return c.DeletePrefix(rng.choice(["a", "b/", "z"]))
    if pick < 0.78:  # a transaction writing two keys at one revision
        other = rng.choice(KEYS)
        return c.Txn(ops=(c.Put(key, b"t%d" % index), c.Delete(other) if other != key else c.Put(key, b"u%d" % index)))
    if pick < 0.9:  # one key deleted and created again, or created and deleted, at one revision
        pair = (c.Delete(key), c.Put(key, b"d%d" % index))
        return c.Txn(ops=pair if rng.random() < 0.5 else pair[::-1])
    return c.TxnReq((), (c.PutReq(key.encode(), b"e%d" % index), c.DeleteRangeReq(b"b/", b"b0")), ())


def _model_apply(state: dict, cmd, index: int, changes: list) -> None:
    """What each command does to {key: KeyValue} (the test's own model); each change is
    listed as (index, key, the key after or None, the key before or None)."""

    def put(key: str, value: bytes) -> None:
        before = state.get(key)
        after = c.KeyValue(key, before.create_revision if before else index, index, before.version + 1 if before else 1, value, 0)
        state[key] = after
        changes.append((index, key, after, before))

    def delete_where(inside) -> None:
        for key in sorted((k for k in state if inside(k)), key=str.encode):
            changes.append((index, key, None, state.pop(key)))

    t = type(cmd)
    if t is c.Put:
        put(cmd.key, cmd.value)
    elif t is c.Delete:
        delete_where(lambda k: k == cmd.key)
    elif t is c.DeletePrefix:
        delete_where(lambda k: k.startswith(cmd.prefix))
    elif t is c.Txn:
        for op in cmd.ops:
            _model_apply(state, op, index, changes)
    elif t is c.TxnReq:
        for op in cmd.success:
            if type(op) is c.PutReq:
                put(op.key.decode(), op.value)
            else:
                delete_where(lambda k: op.key <= k.encode() < op.range_end)


@pytest.fixture
def history(tmp_path):
    """A state machine that applied 300 random commands, in batches of 1 to 4 entries as the
    FSM caller hands them over; the model's state at every revision and its changes."""
    rng = random.Random(7)
    sm = LevelDBStateMachine(str(tmp_path / "sm"))
    state: dict = {}
    at = {0: {}}
    changes: list = []
    entries = []
    for index in range(1, 301):
        cmd = _random_cmd(rng, index)
        entries.append(_entry(index, cmd))
        _model_apply(state, cmd, index, changes)
        at[index] = dict(state)
    while entries:
        n = rng.randint(1, 4)
        sm.apply(entries[:n])
        entries = entries[n:]
    yield sm, at, changes
    sm.close()


def _sorted_kvs(state: dict) -> list:
    return sorted(state.values(), key=lambda kv: kv.key.encode())


def test_every_past_revision_reads_as_it_was(history):
    sm, at, _ = history
    for rev in range(0, 301):
        want = sorted((k, kv.value, kv.mod_revision) for k, kv in at[rev].items())
        assert sm.scan("", limit=100, revision=rev) == want
        assert sm.scan("b/", limit=100, revision=rev) == [x for x in want if x[0].startswith("b/")]
        for key in KEYS:
            got = sm.get_at(key, rev)
            kv = at[rev].get(key)
            assert got == (None if kv is None else (kv.mod_revision, kv.value)), (key, rev)
        # with create_revision and version, as etcd's API reports them
        assert list(sm.range(c.RangeReq(b"\x00", b"\x00"), revision=rev).kvs) == _sorted_kvs(at[rev]), rev
        rng = sm.range(c.RangeReq(b"a", b"b"), revision=rev)
        assert list(rng.kvs) == [kv for kv in _sorted_kvs(at[rev]) if b"a" <= kv.key.encode() < b"b"]
    assert list(sm.range(c.RangeReq(b"\x00", b"\x00")).kvs) == _sorted_kvs(at[300])
    # pages at one revision after `after` keys
    page = sm.scan("", after="a\x00", limit=3, revision=150)
    assert page == sorted((k, kv.value, kv.mod_revision) for k, kv in at[150].items() if k > "a\x00")[:3]


def test_changes_of_past_revisions_carry_what_the_key_held_before(history):
    sm, at, model = history
    changes, after = sm.history_changes(1, "", 10_000)
    assert after == 301
    chunk, after = sm.history_changes(1, "", 10)  # a chunk ends with a whole revision
    assert after == chunk[-1][0] + 1 and chunk == changes[: len(chunk)]
    assert sm.history_changes(1, "b/", 10_000)[0] == [ch for ch in changes if ch[1].startswith("b/")]
    # each change (a ledgerkv transaction may change a key twice: each is listed), with
    # the key after it (a delete: at the change's revision, version 0) and before it
    want = [(i, key, kv.value if kv else None, kv or c.KeyValue(key, 0, i, 0, b"", 0), prev) for i, key, kv, prev in model]
    assert changes == want
    # every key whose record moved from one revision to the next is listed
    listed = {(ch[0], ch[1]) for ch in changes}
    for index in range(1, 301):
        for key in set(at[index - 1]) | set(at[index]):
            if at[index - 1].get(key) != at[index].get(key):
                assert (index, key) in listed, (index, key)


def test_compact_keeps_reads_at_and_after_it_and_purges_the_rest(history, tmp_path):
    sm, at, _ = history
    assert sm.apply([_entry(301, c.Compact(301))])[0] == c.CompactAnswer(0, "future")  # at most what was applied before it
    r = sm.apply([_entry(302, c.Compact(200))])[0]
    assert r == c.CompactAnswer(200, "") and sm.compacted_at == 302
    assert sm.oldest_revision() == 200
    left = sm.purge_history(max_changes=50)
    assert left == 50
    while sm.purge_history(max_changes=50):
        pass
    assert sm.watch_floor() == 200
    assert min(ch[0] for ch in sm.history_changes(1, "", 10_000)[0]) >= 200
    for rev in (200, 250, 300):
        assert sm.scan("", limit=100, revision=rev) == sorted((k, kv.value, kv.mod_revision) for k, kv in at[rev].items())
    # a snapshot carries the history that is left, and its start
    view = sm.capture()
    other = LevelDBStateMachine(str(tmp_path / "other"))
    try:
        other.restore(view.index, view.term, view.membership, view.items())
        assert other.compact_revision == 200 and other.history_from == sm.history_from
        for rev in (200, 275):
            assert other.scan("", limit=100, revision=rev) == sm.scan("", limit=100, revision=rev)
        assert other.history_changes(200, "", 10_000) == sm.history_changes(200, "", 10_000)
        assert other.compacted_at == 302
    finally:
        view.release()
        other.close()


def test_a_state_from_before_the_history_starts_it_at_the_next_entry(tmp_path):
    sm = LevelDBStateMachine(str(tmp_path / "sm"))
    sm.apply([_entry(1, c.Put("a", b"1"))])
    assert sm.history_from == 1 and sm.oldest_revision() == 0
    sm.close()
    sm = LevelDBStateMachine(str(tmp_path / "sm"))
    try:
        assert sm.history_from == 1
        assert sm.get_at("a", 0) is None and sm.get_at("a", 1) == (1, b"1")
    finally:
        sm.close()


def test_retention_by_revisions_and_by_time():
    from kv.errors import BadRequest
    from kv.server.compactor import Retention, parse_retention

    assert parse_retention("0") == ("off", 0.0) and parse_retention("1h") == ("time", 3600.0) and parse_retention("250") == ("revisions", 250)
    for bad in ("abc", "-5", "1.5", "10d"):
        with pytest.raises(BadRequest, match="auto-compaction-retention"):
            parse_retention(bad)
    r = Retention("100")
    assert r.target(True, 1, 0.0, 105, 0) is None  # less than a tenth over what it keeps
    assert r.target(True, 1, 1.0, 110, 0) == 10
    assert r.target(True, 1, 2.0, 115, 10) is None and r.target(False, 1, 3.0, 500, 10) is None  # only the leader
    t = Retention("60s")
    assert t.target(True, 2, 0.0, 10, 0) is None
    assert t.target(True, 2, 30.0, 40, 0) is None
    assert t.target(True, 2, 61.0, 70, 0) == 10  # what was applied a minute ago
    assert t.target(True, 3, 62.0, 71, 10) is None  # a new term: its notes start anew
    assert Retention("0").target(True, 1, 0.0, 10**6, 0) is None
    idle = Retention("5s")  # nothing written but its own compactions: it stops compacting
    assert idle.target(True, 1, 0.0, 40, 30, 31) is None and idle.target(True, 1, 6.0, 40, 30, 31) == 40
    idle = Retention("5s")
    assert idle.target(True, 1, 0.0, 41, 40, 41) is None and idle.target(True, 1, 6.0, 41, 40, 41) is None


def test_after_a_purge_replays_and_past_reads_of_keys_unchanged_since_seek_no_history(tmp_path, monkeypatch):
    """A compaction's purge leaves long runs of deleted records, and a LevelDB iterator that
    finds no live record where it is sought goes on over all of them: a watch from a past
    revision took milliseconds an event, blocking the node's loop long enough to lose its
    leadership. What a change left, or a key as of a revision, when nothing changed the key
    since is its record: no seek for a later history record is made, and the answers are
    those of a seek (the same replay, page by page and whole, and the same reads)."""
    from kv.statemachine import history as H

    sm = LevelDBStateMachine(str(tmp_path / "state"))
    index = 0

    def apply(cmds):
        nonlocal index
        sm.apply([_entry(index + 1 + j, cmd) for j, cmd in enumerate(cmds)])
        index += len(cmds)

    try:
        for _ in range(2):
            apply([c.Put(f"b/{i:04d}", b"old") for i in range(2000)])
        apply([c.Compact(index)])
        while sm.purge_history(1000):
            pass
        start = index + 1
        apply([c.Put(f"w/{i:03d}", b"new") for i in range(100)])  # created since, unchanged
        apply([c.Put(f"a/{i:03d}", b"one") for i in range(100)])
        apply([c.Put(f"a/{i:03d}", b"two") for i in range(50)])  # changed again
        apply([c.Delete(f"a/{i:03d}") for i in range(80, 100)])  # gone: their last change
        apply([c.Txn(ops=(c.Put("t", b"1"), c.Put("t", b"2")))])  # changed twice in one revision
        whole, after = sm.history_changes(start, "", 10_000)
        assert after == index + 1 and len(whole) == 100 + 100 + 50 + 20 + 2
        want = {("w/%03d" % i): b"new" for i in range(100)} | {("a/%03d" % i): (b"two" if i < 50 else b"one") for i in range(80)}
        final = {}
        for rev, key, value, kv, prev in whole:
            final[key] = value
            assert kv.mod_revision == rev and (value is None) == (kv.version == 0)
        assert {k: v for k, v in final.items() if v is not None and k != "t"} == want and final["t"] == b"2"
        assert [ch[2] for ch in whole if ch[1] == "t"] == [b"1", b"2"]
        assert all(ch[4] is not None and ch[4].value == b"one" for ch in whole if ch[1] == "a/010" and ch[2] == b"two")

        seeks = []
        for name in ("change_of", "at"):
            real = getattr(H, name)
            monkeypatch.setattr(H, name, lambda *a, _real=real, _name=name: seeks.append((_name, a[1], a[2])) or _real(*a))
        assert sm.history_changes(start, "", 10_000) == (whole, after)
        created = {key: rev for rev, key, value, kv, prev in whole if kv.version == 1}
        # only a change of a key changed again since is sought (a live record follows it):
        # not the keys unchanged since, nor the deletes that were a key's last change
        firsts = [(b"a/%03d" % i, created["a/%03d" % i]) for i in range(100) if i < 50 or i >= 80] + [(b"t", index)]  # ("t": its first put)
        assert sorted((raw, rev) for _, raw, rev in seeks) == sorted(firsts)
        seeks.clear()
        pages, at = [], start
        while at <= index:
            got, at = sm.history_changes(at, "", 7)
            pages += got
        assert pages == whole
        assert not any(raw.startswith(b"w/") for _, raw, _ in seeks)
        # (A page that does not reach the applied index cannot tell a key's last change by
        # itself: a deleted key's changes there are still sought.)
        seeks.clear()
        assert sm.get_at("w/005", index) == (start + 5, b"new") and sm.get_at("b/0005", start - 1) == (2006, b"old")
        assert sm.get_at("a/000", start + 100) == (start + 100, b"one")  # changed since: a seek
        assert [raw for _, raw, _ in seeks] == [b"a/000"]
    finally:
        sm.close()
