"""Membership changes on real processes: grow 3 -> 5 under load, remove a follower, remove
the leader, replace a dead node with a new one on a new address (--join), bad requests.
Nothing acknowledged may be lost meanwhile."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time

import orjson
import pytest
from cluster import ProcCluster, wait_until
from kv.bench.harness import free_port
from kv.cli.refusal import EXIT_REMOVED
from kv.raft.failpoints import EXIT_CODE

pytestmark = pytest.mark.slow


class Writer:
    """Writes unique keys through live nodes in the background; remembers what was acked."""

    def __init__(self, c: ProcCluster) -> None:
        self.c, self.acked, self.stop = c, {}, False
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        n = 0
        while not self.stop:
            n += 1
            nodes = [i for i in self.c.ids if self.c.alive(i)]
            try:
                code, body = self.c.put(nodes[n % len(nodes)], f"w/{n}", b"x" * 64, timeout=3)
            except OSError:
                continue
            if code == 200:
                self.acked[f"w/{n}"] = body["index"]

    def __enter__(self) -> Writer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop = True
        self.thread.join(10)


def voters(c: ProcCluster, via: str) -> set[str]:
    return {m["id"] for m in c.members(via) if m["voter"]}


def stop_a_follower(c: ProcCluster) -> tuple[str, str]:
    """Start the cluster, write through the leader, and stop a follower: (leader, follower)."""
    c.start()
    lead = c.leader()
    follower = next(i for i in c.ids if i != lead)
    assert c.put(lead, "before", b"1")[0] == 200
    c.stop(follower)
    return lead, follower


def check_acked(c: ProcCluster, acked: dict, nodes: list[str]) -> None:
    for nid in nodes:
        data = {k: m for k, _, m in c.dump(nid)}
        missing = [k for k, idx in acked.items() if data.get(k) != idx]
        assert not missing, f"{nid} lacks {len(missing)} acknowledged writes, e.g. {missing[:3]}"


def test_grow_three_to_five_under_load_then_remove_a_follower_and_the_leader(tmp_path):
    c = ProcCluster(str(tmp_path))
    try:
        c.start()
        with Writer(c) as w:
            for new in ("n4", "n5"):
                c.add_node(new)
                c.start(new)  # joins as a learner, promotes itself once caught up
                wait_until(lambda: new in voters(c, c.leader()), what=f"{new} a voter")
            assert voters(c, c.leader()) == {"n1", "n2", "n3", "n4", "n5"}
            time.sleep(1)  # writes go on with five voters
            lead = c.leader()
            follower = next(i for i in c.ids if i != lead)
            code, _, body = c.request(lead, "DELETE", f"/v1/members/{follower}")
            assert code == 200 and follower not in {m["id"] for m in orjson.loads(body)["members"]}
            code, _, _ = c.request(lead, "DELETE", f"/v1/members/{lead}")  # the leader removes itself
            assert code == 200
            rest = [i for i in c.ids if i not in (lead, follower)]
            new_lead = c.leader(among=rest)
            assert new_lead != lead and voters(c, new_lead) == set(rest)
            time.sleep(1)  # writes go on after the removals
        assert len(w.acked) > 50
        c.wait_converged(rest)
        check_acked(c, w.acked, rest)
        # Both removed members learn it from the others and stop, saying so (they ran on
        # as pre-candidates, answering every request "no leader").
        said = "this node as a member removed from the cluster"
        for gone in (follower, lead):
            wait_until(lambda: not c.alive(gone), timeout=30, what=f"{gone} stopped")
            assert said in c.log(gone) and "start it from an empty data dir with --join URL" in c.log(gone)
        # the leader that removed itself said so when it stepped down (it said only "follower in term N")
        assert "(no longer a member: the membership change that removed it took effect)" in c.log(lead)
        # One that comes back is refused by the others, stops again, and changes nothing.
        term = c.status(new_lead)["term"]
        c.start(follower, wait=False)
        wait_until(lambda: not c.alive(follower) and c.log(follower).count(said) == 2, timeout=30, what="the removed member stopped again")
        assert c.procs[follower].returncode == EXIT_REMOVED  # (kv cluster up tells it from other exits by it)
        assert c.leader(among=rest) == new_lead and c.status(new_lead)["term"] == term
    finally:
        c.close()


def test_replace_a_dead_node_with_a_new_one_on_a_new_address(tmp_path):
    c = ProcCluster(str(tmp_path), extra=["--snapshot-threshold", "300", "--snapshot-trailing", "20"])
    try:
        c.start()
        lead = c.leader()
        dead = next(i for i in c.ids if i != lead)
        c.kill(dead)
        with Writer(c) as w:
            # Enough writes that the leader compacts: the newcomer needs a snapshot.
            wait_until(lambda: c.status(c.leader())["ledger_begin_index"] > 0, timeout=60, what="the leader compacted")
            code, _, _ = c.request(c.leader(), "DELETE", f"/v1/members/{dead}")
            assert code == 200
            c.ids.remove(dead)
            c.add_node("n4")
            c.start("n4")
            wait_until(lambda: "n4" in voters(c, c.leader()), what="n4 a voter")
            time.sleep(1)  # writes go on with the newcomer a voter
        c.wait_converged()
        st = c.status("n4")
        assert st["snapshot_index"] > 0  # it caught up by install-snapshot
        assert b"kv_snapshot_installs_total 1.0" in c.request("n4", "GET", "/metrics")[2]
        check_acked(c, w.acked, c.ids)
    finally:
        c.close()


def test_bad_membership_requests_get_clear_errors(tmp_path):
    c = ProcCluster(str(tmp_path))
    try:
        c.start()
        lead = c.leader()
        follower = next(i for i in c.ids if i != lead)

        def post(path, doc=None, method="POST", node=follower):  # via a follower: forwarded
            deadline = time.monotonic() + 20
            while True:  # 503: no leader to forward to just then (an election on a loaded machine); nothing was done
                code, _, body = c.request(node, method, path, orjson.dumps(doc) if doc is not None else None, {"Content-Type": "application/json"})
                if code != 503 or time.monotonic() > deadline:
                    return code, orjson.loads(body) if body else {}
                time.sleep(0.2)

        assert post("/v1/members/nope", method="DELETE")[0] == 404
        assert post("/v1/members/nope/promote")[0] == 404
        code, body = post("/v1/members", {"id": lead, "peer": "127.0.0.1:1"})
        assert code == 409 and "already a member" in body["error"]["message"]
        assert post("/v1/members", {"id": "n9"})[0] == 400  # no peer address
        assert post("/v1/members", {"id": "n 9", "peer": "127.0.0.1:1"})[0] == 400
        assert post("/v1/members", {"id": "n9", "peer": "nowhere"})[0] == 400
        # a client URL without its scheme was kept as given, and the member's --join then
        # refused as another member with the "same" addresses (a newcomer's run)
        code, body = post("/v1/members", {"id": "n9", "peer": "127.0.0.1:9", "http": "127.0.0.1:8"})
        assert code == 400 and "such as http://" in body["error"]["message"], body
        # "ledger" is what a join sends: a ledger id, and never to rebind a member in place
        assert post("/v1/members", {"id": "n9", "peer": "127.0.0.1:9", "ledger": "zz"})[0] == 400
        assert post("/v1/members", {"id": "n9", "peer": "127.0.0.1:9", "ledger": 7})[0] == 400
        code, body = post("/v1/members", {"id": follower, "peer": c.listen[follower], "replace": True, "ledger": "11" * 8})
        assert code == 400 and "not with \"replace\"" in body["error"]["message"], body
        # A learner far behind (it is not even running) is not promoted.
        assert post("/v1/members", {"id": "n9", "peer": "127.0.0.1:9"})[0] == 200
        code, body = post("/v1/members/n9/promote")
        assert code == 409 and "behind" in body["error"]["message"]
        assert {m["id"]: m["voter"] for m in c.members(lead)}["n9"] is False
        assert post("/v1/members/n9", method="DELETE")[0] == 200
    finally:
        c.close()


def test_a_node_started_alone_is_not_taken_over_by_a_cluster_that_adds_it(tmp_path):
    """A newcomer's run: `kv member add n7`, then n7 started with only its own --peers entry
    and no --join, from a data dir that held a one-node cluster with a write. The cluster's
    leader pushed to it and n7 followed, its state keeping a write the cluster never had
    (entries of the same index and term, other contents), and no node said a thing. A node
    whose cluster is itself alone now lets no other node in, and its log says why."""
    c = ProcCluster(str(tmp_path), proxies=False)
    try:
        c.start()
        lead = c.leader()
        assert c.put(lead, "a", b"cluster")[0] == 200
        c.add_node("n7")
        c.procs.start(
            "n7", ["--id", "n7", "--data-dir", c.data_dir("n7"), "--http", c.http["n7"], "--peers", f"n7={c.listen['n7']}", *c.extra],
            os.path.join(c.root, "n7.log"), env={**os.environ, **c.env},
        )
        c.wait_http("n7")
        wait_until(lambda: c.status("n7").get("role") == "leader", 20, "n7 leading its own cluster")
        assert c.put("n7", "a", b"LONELY")[0] == 200
        doc = orjson.dumps({"id": "n7", "peer": c.listen["n7"], "http": c.url("n7")})
        assert c.request(lead, "POST", "/v1/members", doc, {"Content-Type": "application/json"})[0] == 200
        said = f"'{lead}' is not a member: this node's cluster is 'n7' alone; a node added with kv member add starts from an empty data dir with --join URL"
        wait_until(lambda: said in c.log("n7"), 20, "n7 saying why it lets the leader not in")
        time.sleep(1.0)  # twenty heartbeats: none of them reached n7
        s = c.status("n7")
        assert (s["role"], s["leader"]) == ("leader", "n7"), s
        assert c.get("n7", "a", "stale")[:2] == (200, b"LONELY") and c.get(lead, "a")[:2] == (200, b"cluster")
        assert c.status(lead)["peers"]["n7"]["match_index"] == 0
    finally:
        c.close()


def test_a_member_added_back_is_not_let_in_from_its_old_data_dir(tmp_path):
    """n3 is removed and joins again from an empty data dir; later the old data dir is
    started as n3 (a machine taken out comes back). It lacks what n3 acknowledged since and
    the votes n3 cast, and a vote cast twice in a term can elect two leaders: the others
    refuse it as removed, and it stops; the n3 that joined again runs on, and catches up by
    a snapshot whose membership records the data dir it joined from."""
    c = ProcCluster(str(tmp_path), proxies=False, extra=["--snapshot-threshold", "100", "--snapshot-trailing", "10"])
    try:
        lead, gone = stop_a_follower(c)
        old_dir = c.data_dir(gone) + "-old"
        os.rename(c.data_dir(gone), old_dir)
        assert c.request(lead, "DELETE", f"/v1/members/{gone}")[0] == 200
        c.joining[gone] = True  # from an empty data dir, with --join, at the same addresses
        c.start(gone, join_via=lead)
        wait_until(lambda: gone in voters(c, c.leader()), what=f"{gone} a voter again")
        assert c.put(c.leader(), "after", b"2")[0] == 200
        c.stop(gone)
        lead = c.leader()
        for i in range(150):  # enough that the leader compacts past where it stopped
            assert c.put(lead, f"w/{i}", b"x")[0] == 200
        wait_until(lambda: c.status(lead)["ledger_begin_index"] > 0, timeout=30, what="the leader compacted")
        term = c.status(lead)["term"]
        # the old data dir, started as it was before the removal
        old_log = os.path.join(c.root, f"{gone}-old.log")
        c.procs.start(
            gone, ["--id", gone, "--data-dir", old_dir, "--http", c.http[gone], "--peers", ",".join(f"{i}={c.listen[i]}" for i in c.ids), *c.extra],
            old_log, env={**os.environ, **c.env},
        )
        wait_until(lambda: not c.alive(gone), timeout=30, what="the old data dir's node stopped")
        assert c.procs[gone].returncode == EXIT_REMOVED
        with open(old_log) as f:
            assert "this node as a member removed from the cluster" in f.read()
        said = f"'{gone}' joined from another data dir than this one (ledger "
        assert said in c.log(lead), c.log(lead)[-2000:]
        assert c.leader() == lead and c.status(lead)["term"] == term
        # the n3 that joined again comes back and catches up, from the leader's snapshot
        c.start(gone)
        assert c.put(lead, "later", b"3")[0] == 200
        c.wait_converged()
        assert c.get(gone, "later", "stale")[:2] == (200, b"3")
        assert b"kv_snapshot_installs_total 1.0" in c.request(gone, "GET", "/metrics")[2]
    finally:
        c.close()


def rejoin_from_an_empty_dir(c: ProcCluster, member: str, crash_at: str = "") -> None:
    """Stop a member, remove it, and let it join again from an empty data dir (a new ledger
    id: the membership entries name the data dir each join came from). With crash_at, it
    first dies at that crash point (KV_FAILPOINTS) once, and is started again."""
    c.stop(member)
    shutil.rmtree(c.data_dir(member))
    lead = c.leader(among=[i for i in c.ids if i != member])
    assert c.request(lead, "DELETE", f"/v1/members/{member}")[0] == 200
    c.joining[member] = True
    if crash_at:
        c.node_env[member] = {"KV_FAILPOINTS": crash_at}
        c.start(member, join_via=lead, wait=False)
        wait_until(lambda: not c.alive(member), timeout=30, what=f"{member} dying at {crash_at}")
        assert c.procs[member].returncode == EXIT_CODE, c.log(member)[-2000:]
        c.node_env[member] = {}
    c.start(member, join_via=lead)
    wait_until(lambda: member in voters(c, c.leader()), timeout=30, what=f"{member} a voter again")


def test_a_node_joining_passes_over_membership_entries_older_than_its_join(tmp_path):
    """A node joins with the committed membership, then replays the log from its start: the
    membership entries there are older. Taken as newer (a fault review), they named the
    leader's earlier data dir: the joiner, restarted while it caught up, refused the leader
    as "joined from another data dir" and never caught up. Here the leader's id joined
    again twice, then the joiner joins and dies with part of the log."""
    c = ProcCluster(str(tmp_path), proxies=False)
    try:
        c.start()
        lead = c.leader()
        moved, joiner = [i for i in c.ids if i != lead]
        rejoin_from_an_empty_dir(c, moved)
        for i in range(64):  # four pushes' worth (4 MiB each): the joiner gets the log in parts
            assert c.put(c.leader(), f"big/{i}", b"x" * (256 << 10))[0] == 200
        rejoin_from_an_empty_dir(c, moved)
        code, _, got = c.request(c.leader(), "POST", "/v1/leader/transfer", orjson.dumps({"to": moved}), {"Content-Type": "application/json"})
        assert code == 200, got
        wait_until(lambda: c.leader() == moved, what=f"{moved} leading")
        # dies once its ledger holds the first part (the leader's earlier joins), not the rest
        rejoin_from_an_empty_dir(c, joiner, crash_at="ledger.after_commit@2")
        assert c.put(moved, "after", b"2")[0] == 200
        c.wait_converged()  # (without the fix: never, the leader refused for good)
        assert c.get(joiner, "after", "stale")[:2] == (200, b"2")
        assert "joined from another data dir" not in c.log(joiner)
    finally:
        c.close()


def test_a_lagging_node_lists_the_members_a_change_acknowledged_before_made(tmp_path):
    """GET /v1/members (kv member list, Client.members) reads after a barrier, like a key:
    a node restarted behind the log listed the members it knew, without n4 whose addition
    had been acknowledged (a fault review: 2 of 2; a script chose what to remove from it).
    consistency=stale still answers this node's own view."""
    c = ProcCluster(str(tmp_path), proxies=False)
    try:
        lead, follower = stop_a_follower(c)
        body = orjson.dumps({"id": "n4", "peer": f"127.0.0.1:{free_port()}"})
        assert c.request(lead, "POST", "/v1/members", body, {"Content-Type": "application/json"})[0] == 200
        for i in range(3000):  # (the follower has some way to go once it is back)
            assert c.put(lead, f"w/{i}", b"x" * 200)[0] == 200
        c.start(follower)
        code, _, got = c.request(follower, "GET", "/v1/members")
        assert code == 200 and "n4" in {m["id"] for m in orjson.loads(got)["members"]}, got
        code, _, got = c.request(follower, "GET", "/v1/members?consistency=stale")
        assert code == 200 and follower in {m["id"] for m in orjson.loads(got)["members"]}
        assert c.request(follower, "GET", "/v1/members?consistency=fresh")[0] == 400
        # Without a quorum: refused within the caller's timeout (kv.Client gives an attempt
        # 2 s; the barrier waited the node's 5, and the CLI blamed an endpoint that was down)
        c.stop(*[i for i in c.ids if i != follower and c.alive(i)])
        t0 = time.monotonic()
        code, _, got = c.request(follower, "GET", "/v1/members", headers={"X-Kv-Timeout": "1"}, timeout=10)
        assert code == 503 and time.monotonic() - t0 < 3, (code, got)
        assert c.request(follower, "GET", "/v1/members?consistency=stale")[0] == 200
        # and so from the command line, as an operator runs it during the outage
        def member_list(*flags: str) -> subprocess.CompletedProcess:
            argv = [sys.executable, "-m", "kv", "member", "list", *flags, "--endpoints", c.url(follower), "--timeout", "3"]
            return subprocess.run(argv, capture_output=True, text=True, timeout=60)

        said = member_list()
        assert said.returncode == 1 and "no leader could take the request" in said.stderr and "is the cluster running" not in said.stderr, said.stderr
        said = member_list("--stale")
        assert said.returncode == 0 and f"{follower}\tvoter" in said.stdout and "n4\tlearner" in said.stdout, said
    finally:
        c.close()


def test_a_member_moved_to_new_addresses_is_reached_there(tmp_path):
    """`kv member add n3 NEW_PEER --http URL --replace` for a node moved to another machine:
    the others keep the old address in their --peers (where they dial a peer, for a proxy or
    a NAT). They dialled it for ever and the moved node never heard from the leader; an
    address that cannot be reached now gives way to the membership's."""
    c = ProcCluster(str(tmp_path), proxies=False)
    try:
        lead, moved = stop_a_follower(c)
        c.listen[moved], c.http[moved] = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        doc = orjson.dumps({"id": moved, "peer": c.listen[moved], "http": c.url(moved), "replace": True})
        assert c.request(lead, "POST", "/v1/members", doc, {"Content-Type": "application/json"})[0] == 200
        c.start(moved)  # its own --peers entry is the new address; the others' are not
        assert c.put(lead, "b", b"2")[0] == 200
        wait_until(lambda: c.get(moved, "b", "stale")[:2] == (200, b"2"), timeout=20, what=f"{moved} caught up at its new address")
        assert c.status(lead)["peers"][moved]["address"] == c.listen[moved]
    finally:
        c.close()


def test_a_joined_member_wiped_and_started_with_stale_peers_stops_on_the_leaders_word(tmp_path):
    """A newcomer's run: a member that had joined with --join, its data dir wiped, started
    with --peers naming members at addresses they had left. The others refuse its new data
    dir, but it stopped only once most voters it could reach said so: it ran on, empty,
    refused, its writes failing with "the leader cannot be reached". The leader's word,
    which has every committed change, is enough."""
    c = ProcCluster(str(tmp_path), proxies=False)
    try:
        c.start()
        c.add_node("n4")
        c.start("n4")
        wait_until(lambda: "n4" in voters(c, c.leader()), what="n4 a voter")
        lead = c.leader()
        if lead == "n4":
            body = orjson.dumps({"to": "n1"})
            assert c.request("n4", "POST", "/v1/leader/transfer", body, {"Content-Type": "application/json"})[0] == 200
            lead = c.leader(among=["n1", "n2", "n3"])
        c.stop("n4")
        shutil.rmtree(c.data_dir("n4"))
        stale = ",".join(f"{i}={c.listen[i] if i in ('n4', lead) else f'127.0.0.1:{free_port()}'}" for i in c.ids)
        c.procs.start(
            "n4", ["--id", "n4", "--data-dir", c.data_dir("n4"), "--http", c.http["n4"], "--peers", stale, *c.extra],
            os.path.join(c.root, "n4-wiped.log"), env={**os.environ, **c.env},
        )
        wait_until(lambda: not c.alive("n4"), timeout=30, what="the wiped n4 stopped")
        assert c.procs["n4"].returncode == EXIT_REMOVED
        with open(os.path.join(c.root, "n4-wiped.log")) as f:
            said = f.read()
        assert re.search(rf"{lead}(, n\d)* refuses? this node as a member removed from the cluster", said) and "remove it first" in said, said[-1500:]
    finally:
        c.close()


def test_a_joiner_killed_before_it_recorded_the_membership_resumes_the_join(tmp_path):
    """A joiner killed after its ledger was made and before it recorded the membership it
    was given came back, with the same command, as a cluster of its own whose only member
    it was: it took writes the cluster never saw and turned the leader away (a fault
    review, 2 of 2). The cluster's answer is kept in the data dir until it is recorded."""
    c = ProcCluster(str(tmp_path), proxies=False)
    try:
        c.start()
        lead = c.leader()
        assert c.put(lead, "before", b"1")[0] == 200
        c.add_node("n4")
        c.node_env["n4"] = {"KV_FAILPOINTS": "start.before_membership"}
        c.start("n4", join_via=lead, wait=False)
        wait_until(lambda: not c.alive("n4"), timeout=30, what="n4 dying before it recorded the membership")
        assert c.procs["n4"].returncode == EXIT_CODE, c.log("n4")[-2000:]
        assert os.path.exists(os.path.join(c.data_dir("n4"), "ledger"))
        c.node_env["n4"] = {}
        c.start("n4", join_via=lead)
        wait_until(lambda: "n4" in voters(c, c.leader()), timeout=30, what="n4 a voter")
        s = c.status("n4")
        assert s["leader"] == c.leader() and s["cluster_id"] == c.status(lead)["cluster_id"], s
        c.wait_converged()
        assert c.get("n4", "before", "stale")[:2] == (200, b"1")
        assert not os.path.exists(os.path.join(c.data_dir("n4"), "joined.json"))
    finally:
        c.close()


@pytest.mark.parametrize("snapshots", [False, True], ids=["log", "snapshots"])
def test_a_removed_members_old_data_dir_is_refused_after_every_member_joined_again(tmp_path, snapshots):
    """The ids removed from the cluster are part of what a node that joins is given, and of
    snapshots: n4 is removed and its data dir kept; then every other member is removed and
    joins again from an empty data dir, one at a time, so none of them saw n4's removal in
    its log. Started again from its old data dir, n4 ran on for good, served stale reads
    and was told nothing (a fault review, with and without snapshots); it is refused as
    removed and stops (exit 3)."""
    extra = ["--snapshot-threshold", "30", "--snapshot-trailing", "5"] if snapshots else []
    c = ProcCluster(str(tmp_path), 4, proxies=False, extra=extra)
    try:
        c.start()
        assert c.put(c.leader(), "before", b"1")[0] == 200
        c.stop("n4")
        assert c.request(c.leader(among=["n1", "n2", "n3"]), "DELETE", "/v1/members/n4")[0] == 200
        c.ids.remove("n4")
        for member in ("n1", "n2", "n3"):
            rejoin_from_an_empty_dir(c, member)
            for i in range(40):  # (with snapshots: each joiner installs one)
                assert c.put(c.leader(), f"{member}/{i}", b"x")[0] == 200
        lead = c.leader()
        assert all(not m["id"] == "n4" for m in c.members(lead))
        c.ids.append("n4")
        c.joining.clear()  # (n4's command as before: --peers names the four)
        c.start("n4", wait=False)
        wait_until(lambda: not c.alive("n4"), timeout=30, what="n4, removed, stopping")
        assert c.procs["n4"].returncode == EXIT_REMOVED, c.log("n4")[-2000:]
        assert c.leader() == lead
    finally:
        c.close()
