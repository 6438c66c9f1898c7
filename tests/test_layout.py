"""The repository layout and the layering rules of DESIGN.md."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PURE = ["raft/core.py", "raft/log.py", "raft/progress.py", "raft/quorum.py", "raft/messages.py", "raft/membership.py", "raft/errors.py"]
FORBIDDEN_IN_PURE = {"asyncio", "time", "socket", "lmdb", "plyvel", "aiohttp", "threading", "os", "select"}


def imports_of(path: str) -> set[str]:
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_pure_core_does_no_io():
    for path in PURE:
        bad = imports_of(path) & FORBIDDEN_IN_PURE
        assert not bad, f"{path} imports {bad}: the core must stay pure (no clock, no I/O)"


def test_raft_imports_nothing_of_ours_above_it():
    for name in os.listdir(os.path.join(ROOT, "raft")):
        if name.endswith(".py"):
            tree = ast.parse(open(os.path.join(ROOT, "raft", name)).read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    assert node.level <= 1, f"raft/{name} reaches above raft/ ({'.' * node.level}{node.module})"
                    assert node.module is None or not node.module.startswith("kv"), f"raft/{name} imports {node.module}"


def test_http_uses_only_the_public_kv_api():
    allowed = {"kv", "kv.metrics"}
    for name in os.listdir(os.path.join(ROOT, "http")):
        if name.endswith(".py"):
            tree = ast.parse(open(os.path.join(ROOT, "http", name)).read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("kv"):
                    assert node.module in allowed, f"http/{name} imports {node.module}; use the public kv API"


def test_mapped_folders_have_no_init_files():
    for d in ("raft", "statemachine", "snapshot", "http"):
        assert not os.path.exists(os.path.join(ROOT, d, "__init__.py")), f"{d}/__init__.py would shadow the stdlib"


def test_stdlib_http_is_not_shadowed_from_the_repository_root():
    code = "import aiohttp, http, http.cookies, kv.http.app; print(http.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "site-packages" not in out and os.path.join(ROOT, "http") not in out
    assert out.strip().endswith(os.path.join("http", "__init__.py"))


def test_public_api_is_pinned():
    import kv

    assert sorted(kv.__all__) == sorted(
        [
            "AsyncClient", "BadRequest", "Client", "Compacted", "Cond", "Conflict", "DataDirLocked", "Delete", "DeleteResult", "Event", "Forbidden", "Get", "Item", "KVError", "LeaseNotFound", "LeaseStatus",
            "MemberExists", "Node", "NodeConfig", "NoQuorum", "NotFound", "NotLeader", "Page", "PreconditionFailed", "Put", "RevokeResult", "SlowWatcher", "SnapshotError",
            "Store", "Timeout", "TxnResult", "Unauthorized", "Unavailable", "ValueTooLarge", "Watch", "WatchCompacted",
            "WriteResult", "open",
        ]
    )
    for name in kv.__all__:
        assert getattr(kv, name) is not None


def test_wheel_puts_only_kv_at_the_top(tmp_path):
    import zipfile

    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "-q", "-w", str(tmp_path)],
        check=True, capture_output=True,
    )
    (wheel,) = [p for p in os.listdir(tmp_path) if p.endswith(".whl")]
    names = zipfile.ZipFile(tmp_path / wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"kv"}
    for must in ("kv/raft/core.py", "kv/statemachine/leveldb.py", "kv/snapshot/format.py", "kv/http/app.py", "kv/http/openapi.json", "kv/py.typed"):
        assert must in names
    (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE")]
    assert "Apache License" in zipfile.ZipFile(tmp_path / wheel).read(license_file).decode()
    meta = zipfile.ZipFile(tmp_path / wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Classifier: License :: OSI Approved :: Apache Software License" in meta and "Project-URL:" in meta
    assert "Requires-Dist: prometheus_client" in meta.replace("prometheus-client", "prometheus_client")
