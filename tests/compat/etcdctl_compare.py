"""The same etcdctl session against etcd 3.4 and against ledgerkv, answers compared field by
field (`-w json`, with revisions, ids and terms replaced by their order of appearance).

    .venv/bin/python tests/compat/etcdctl_compare.py        # needs Debian's etcd-server and etcd-client

Both run as 3-member clusters on loopback; every command goes to a follower. Prints each
command whose answers differ, with both; exit status 1 if any does (besides KNOWN below).
The members' order and their ports (all but pifpaf0's 2379) are normalised too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from python_etcd3 import EtcdCluster, LedgerkvCluster  # noqa: E402

# (arguments, stdin): what a user of etcdctl does every day
SESSION: list[tuple[list[str], str | None]] = [
    (["put", "app/a", "1"], None),
    (["put", "app/b", "2"], None),
    (["put", "app/a", "3", "--prev-kv", "-w", "json"], None),
    (["get", "app/a", "-w", "json"], None),
    (["get", "app/", "--prefix", "-w", "json"], None),
    (["get", "app/", "--prefix", "--limit", "1", "-w", "json"], None),
    (["get", "app/", "--prefix", "--sort-by", "MODIFY", "--order", "DESCEND", "-w", "json"], None),
    (["get", "app/", "--prefix", "--keys-only", "-w", "json"], None),
    (["get", "app/", "--prefix", "--count-only", "-w", "json"], None),
    (["get", "app/a", "app/c", "-w", "json"], None),
    (["get", "app/a", "--from-key", "-w", "json"], None),
    (["get", "missing", "-w", "json"], None),
    (["txn", "-w", "json"], 'value("app/a") = "3"\n\nput app/t yes\n\nput app/t no\n\n'),
    (["txn", "-w", "json"], 'mod("app/a") = "0"\n\nput app/t again\n\nget app/t\n\n'),
    (["del", "app/b", "--prev-kv", "-w", "json"], None),
    (["del", "app/", "--prefix", "-w", "json"], None),
    (["lease", "grant", "30", "-w", "json"], None),
    (["lease", "list", "-w", "json"], None),
    (["member", "list", "-w", "json"], None),
    (["alarm", "list", "-w", "json"], None),
    (["get", "app/", "--prefix", "--rev", "1", "-w", "json"], None),
    # The history: {rev@-N} is the revision in the answer of the command N before this one.
    (["put", "app/h", "1", "-w", "json"], None),
    (["put", "app/h", "2", "-w", "json"], None),
    (["get", "app/h", "--rev", "{rev@-2}", "-w", "json"], None),
    (["compaction", "{rev@-2}"], None),
    (["get", "app/h", "--rev", "{rev@-4}", "-w", "json"], None),
    (["get", "app/h", "--rev", "{rev@-4}", "-w", "json"], None),
    (["compaction", "{rev@-5}"], None),
]
KNOWN: set[str] = set()
# The second txn changes nothing: etcd's header then says the store's revision (that of the
# last change); ledgerkv's revisions are log indexes, and the transaction has an entry.
# A compaction has an entry too, so a read after it is at a revision of its own (etcd's
# header then says the last change's).
KNOWN_AT = {
    13: "a transaction that changes nothing has a revision of its own (its log index)",
    26: "a compaction has a revision of its own (its log index)",
}
_PORT = re.compile(r"127\.0\.0\.1:(?!2379\b)\d+")
_COMPACTED = re.compile(r"compacted revision \d+")
_REV_AT = re.compile(r"\{rev@-(\d+)\}")
_NUMBERS = re.compile(r'"(revision|create_revision|mod_revision|raft_term|cluster_id|member_id|ID|id|compact_revision|leader|raft_index)":\s*"?(\d+)"?')


def normalised(text: str) -> str:
    """Revisions, ids and terms as the order they first appear in, the rest as it is."""
    seen: dict[tuple[str, str], int] = {}

    def sub(m: re.Match) -> str:
        field = m.group(1)
        kind = "rev" if "revision" in field else field
        n = seen.setdefault((kind, m.group(2)), len([k for k in seen if k[0] == kind]))
        return f'"{field}": "<{kind} {n}>"'

    try:
        doc = json.loads(text)
        if isinstance(doc, dict) and "members" in doc:  # in no particular order, on ports of their own
            doc["members"].sort(key=lambda m: m.get("name", ""))
        text = json.dumps(doc, sort_keys=True)
    except ValueError:
        pass
    return _NUMBERS.sub(sub, _PORT.sub("127.0.0.1:<port>", _COMPACTED.sub("compacted revision <rev>", text)))


def _revision(stdout: str) -> int | None:
    try:
        return int(json.loads(stdout)["header"]["revision"])
    except (ValueError, KeyError, TypeError):
        return None


def session(cluster) -> list[str]:
    env = {**os.environ, "ETCDCTL_API": "3"}
    out, revisions = [], []
    for args, stdin in SESSION:
        args = [_REV_AT.sub(lambda m: str(revisions[-int(m.group(1))]), a) for a in args]
        r = subprocess.run(["etcdctl", "--endpoints", cluster.client["pifpaf0"], *args], input=stdin, capture_output=True, text=True, env=env, timeout=30)
        out.append(normalised(r.stdout.strip()) if r.returncode == 0 else f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}")
        revisions.append(_revision(r.stdout) if r.returncode == 0 else None)
    return out


def main() -> int:
    results = {}
    for kind in (EtcdCluster, LedgerkvCluster):
        root = tempfile.mkdtemp(prefix="kv-ctl-")
        c = kind(root)
        try:
            c.start()
            results[kind.__name__] = session(c)
        finally:
            c.stop()
            shutil.rmtree(root, ignore_errors=True)
    differ = known_n = 0
    for n, ((args, _), a, b) in enumerate(zip(SESSION, results["EtcdCluster"], results["LedgerkvCluster"])):
        name = " ".join(args)
        if a != b:
            known = name in KNOWN or n in KNOWN_AT
            differ += not known
            known_n += known
            print(f"{'known: ' if known else 'DIFFERS: '}etcdctl {name}\n  etcd 3.4: {a[:600]}\n  ledgerkv: {b[:600]}")
    print(f"{len(SESSION)} etcdctl commands: {len(SESSION) - differ - known_n} answered alike (revisions, ids and terms normalised), "
          f"{known_n} differ as known, {differ} differ otherwise")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
