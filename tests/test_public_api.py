"""The public API, pinned: kv's exported names and the signatures of the store's faces
(kv.open's Store, kv.Node, kv.Client, kv.AsyncClient) and of what they return, compared
with tests/public_api.txt. A change to the API shows up here as a diff to review; when it
is meant, regenerate the file:

    python tests/test_public_api.py > tests/public_api.txt
"""

from __future__ import annotations

import inspect
import os
import sys

PINNED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "public_api.txt")
FACES = ("Store", "Node", "Client", "AsyncClient", "Watch", "Item", "WriteResult", "Page", "Event", "LeaseStatus", "NodeConfig")


def _signature(obj) -> str:
    try:
        return str(inspect.signature(obj)).replace("'", "")
    except (TypeError, ValueError):
        return "(...)"


def describe() -> list[str]:
    import kv

    lines = [f"kv.{name}{_signature(getattr(kv, name)) if callable(getattr(kv, name)) and not inspect.isclass(getattr(kv, name)) else ''}" for name in sorted(kv.__all__)]
    for face in FACES:
        cls = getattr(kv, face)
        lines.append(f"{face}{_signature(cls)}")
        members = {}
        for klass in reversed(cls.__mro__):  # inherited methods too, but not object's or tuple's
            if klass.__module__.startswith("kv"):
                members.update(vars(klass))
        for name, member in sorted(members.items()):
            if name.startswith("_") and name not in ("__aenter__", "__aexit__", "__enter__", "__exit__", "__aiter__", "__iter__"):
                continue
            if isinstance(member, property):
                lines.append(f"{face}.{name} (property)")
            elif isinstance(member, (staticmethod, classmethod)) or inspect.isfunction(member):
                lines.append(f"{face}.{name}{_signature(getattr(cls, name))}")
    return lines


def test_public_api_matches_the_pinned_file():
    want = open(PINNED).read().splitlines()
    got = describe()
    missing = [x for x in want if x not in got]
    added = [x for x in got if x not in want]
    assert not missing and not added, (
        "the public API changed (regenerate tests/public_api.txt if that is meant):\n"
        + "\n".join([f"- {x}" for x in missing] + [f"+ {x}" for x in added])
    )


if __name__ == "__main__":
    sys.stdout.write("\n".join(describe()) + "\n")
