"""The members a data dir's cluster began with, and the check that --peers still names them.

--peers describes a new cluster: once a data dir holds one, its members are what the
cluster's log says (kv member add/remove, --join), and --peers only gives addresses. So a
node started alone by mistake, then restarted with the full --peers, went on as a cluster of
one while the others, new, formed a second cluster with the same name: both took writes.
The ids --peers named when the data dir began its cluster are kept in DATA_DIR/bootstrap.json;
a later start whose --peers names other members than those, and other than the cluster has
now, is refused. (A data dir from before this file, or one restored from a snapshot, has no
record: there a mismatch is only logged.)
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection

from ..errors import BadRequest
from ..snapshot.format import fsync_dir

FILE = "bootstrap.json"

log = logging.getLogger("kv.node")


def record(data_dir: str, members: Collection[str]) -> None:
    """Keep the member ids a new cluster begins with (written whole, then fsynced)."""
    path = os.path.join(data_dir, FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"members": sorted(members)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(data_dir)


def recorded(data_dir: str) -> set[str] | None:
    try:
        with open(os.path.join(data_dir, FILE)) as f:
            return set(json.load(f)["members"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as e:
        raise BadRequest(f"{os.path.join(data_dir, FILE)} is damaged ({e}): it should hold the member ids --peers named when this data dir began, as {{\"members\": [\"n1\", \"n2\", \"n3\"]}}") from None


def check_peers(data_dir: str, node_id: str, given: Collection[str], members: Collection[str]) -> None:
    """Refuse a restart whose --peers (`given`) names neither the members this data dir's
    cluster began with nor the ones it has now (`members`)."""
    given, members = set(given), set(members)
    began = recorded(data_dir)
    if given == members or given == began:
        return
    ids = ", ".join
    if began is None:
        log.warning(
            "node %s: --peers names %s, but its cluster's members are %s: --peers only describes a new cluster; "
            "change members with kv member add/remove", node_id, ids(sorted(given)), ids(sorted(members)),
        )
        return
    raise BadRequest(
        f"the data dir {data_dir} holds a cluster that began with {ids(sorted(began))} and has the members "
        f"{ids(sorted(members))} now, but --peers names {ids(sorted(given))}. --peers only describes a new cluster: "
        "give the one this data dir began with (or its members now). If this node was started with other --peers "
        "by mistake and holds nothing you need, remove its data dir and start it again; to change the members of a "
        "running cluster, use kv member add/remove or kv serve --join"
    )
