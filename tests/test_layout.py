"""The repository layout and the layering rules of docs/design.md."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PURE = ["raft/core.py", "raft/config.py", "raft/ready.py", "raft/replication.py", "raft/log.py", "raft/progress.py", "raft/quorum.py", "raft/readindex.py", "raft/messages.py", "raft/membership.py", "raft/errors.py"]
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
    """http/ reaches the node through the public API; of the rest only what is shared with
    clients (kv.common) and the parts of the node's metrics and request context it serves."""
    allowed = {"kv", "kv.server.metrics", "kv.server.access", "kv.server.samples"}
    for name in os.listdir(os.path.join(ROOT, "http")):
        if name.endswith(".py"):
            tree = ast.parse(open(os.path.join(ROOT, "http", name)).read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("kv"):
                    assert node.module in allowed or node.module.startswith("kv.common"), f"http/{name} imports {node.module}; use the public kv API"


def test_the_etcd_front_uses_only_the_public_kv_api():
    """v3api/ reaches the node through the public API too; besides it, the etcd request
    and response types kv.Node.etcd_txn and etcd_range take and give (the command codec's),
    the token grants of the HTTP front, whose roles and prefixes it applies alike, and the
    snapshot format's constants for the suffix etcd's client wants after a snapshot, the
    node's metric samples (as http/ has), the raft node's bucketed deadlines (one timer
    for the grpc-timeout of every call), and the HTTP server's context, whose set of open
    watch streams the JSON gateway's join (the server ends them all as it stops)."""
    allowed = {"kv", "kv.statemachine.commands", "kv.http.auth", "kv.snapshot.format", "kv.server.samples", "kv.raft.deadlines", "kv.http.context.ctx"}
    for root, _dirs, files in os.walk(os.path.join(ROOT, "v3api")):
        for name in files:
            if name.endswith(".py") and "_pb2" not in name:
                tree = ast.parse(open(os.path.join(root, name)).read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("kv"):
                        names = {node.module} if node.module in allowed else {f"{node.module}.{a.name}" for a in node.names}
                        assert names <= allowed or node.module.startswith("kv.common"), f"v3api/{name} imports {node.module}; use the public kv API"


def test_mapped_folders_have_no_init_files():
    for d in ("raft", "statemachine", "snapshot", "http", "v3api"):
        assert not os.path.exists(os.path.join(ROOT, d, "__init__.py")), f"{d}/__init__.py would shadow the stdlib"


def test_stdlib_http_is_not_shadowed_from_the_repository_root():
    code = "import aiohttp, http, http.cookies, kv.http.app; print(http.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "site-packages" not in out and os.path.join(ROOT, "http") not in out
    assert out.strip().endswith(os.path.join("http", "__init__.py"))


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
    for must in ("kv/raft/core.py", "kv/statemachine/leveldb.py", "kv/snapshot/format.py", "kv/http/app.py", "kv/http/openapi.json", "kv/py.typed",
                 "kv/common/results.py", "kv/client/blocking.py", "kv/server/writes.py", "kv/spark/bulk.py", "kv/bench/harness.py", "kv/cli/serve.py",
                 "kv/v3api/server.py", "kv/v3api/proto/rpc_pb2.py", "kv/v3api/proto/rpc_pb2_grpc.py", "kv/v3api/proto/kv_pb2.py"):
        assert must in names
    (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE")]
    assert "Apache License" in zipfile.ZipFile(tmp_path / wheel).read(license_file).decode()
    meta = zipfile.ZipFile(tmp_path / wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta and "Project-URL:" in meta
    assert "Requires-Dist: prometheus_client" in meta.replace("prometheus-client", "prometheus_client")


# -- the seams between the layers --------------------------------------------------------

LAYERS = ("raft", "statemachine", "snapshot", "http", "v3api", "kv")
# `X.name` reaches that are allowed although `name` is private to another layer; each with
# the reason. Keep this short: a reach belongs behind a method of the layer that owns it.
ALLOWED_REACHES: set[tuple[str, str]] = set()


def _layer_files(layer: str) -> list[str]:
    out = []
    for root, _dirs, files in os.walk(os.path.join(ROOT, layer)):
        out += [os.path.relpath(os.path.join(root, f), ROOT) for f in files if f.endswith(".py")]
    return sorted(out)


def _private_names(layer: str) -> set[str]:
    """The private (`_name`, not dunder) attributes and methods a layer defines."""
    names = set()
    for path in _layer_files(layer):
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.endswith("__")}


def reaches_in(path: str, private_elsewhere: set[str]) -> list[str]:
    """`X.core` anywhere, and `X._name` where `_name` is private to another layer (X not
    self or cls), in the module at path."""
    found = []
    for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value.id if isinstance(node.value, ast.Name) else None
        if owner in ("self", "cls"):
            continue
        bad = node.attr == "core" or node.attr in private_elsewhere
        if bad and (path, node.attr) not in ALLOWED_REACHES:
            found.append(f"{path}:{node.lineno}: .{node.attr}")
    return found


def layer_reaches(layer: str, private_elsewhere: set[str]) -> list[str]:
    return [r for path in _layer_files(layer) for r in reaches_in(path, private_elsewhere)]


def test_no_layer_reaches_into_another():
    """Nothing outside raft/ touches the Raft core object, and no layer reads or writes a
    private attribute that another layer defines: each layer hands the one above it
    methods or a small protocol (docs/design.md, "One way through")."""
    private = {layer: _private_names(layer) for layer in LAYERS}
    found = []
    for layer in LAYERS:
        others = set().union(*(names for other, names in private.items() if other != layer)) - private[layer]
        reaches = layer_reaches(layer, others)
        if layer == "raft":
            reaches = [r for r in reaches if not r.endswith(": .core")]  # the driver owns the core
        found += reaches
    assert not found, "reaches across layers (add a method to the layer that owns it):\n" + "\n".join(found)


def test_the_in_process_cluster_uses_only_public_seams():
    """tests/inproc.py drives real nodes the way a user could: through kv.Node, RaftNode's
    methods and a loopback transport, never the core or any layer's private attributes."""
    private = set().union(*(_private_names(layer) for layer in LAYERS))
    found = reaches_in("tests/inproc.py", private)
    assert not found, "tests/inproc.py reaches into the package:\n" + "\n".join(found)


def test_the_layering_check_sees_a_planted_reach(tmp_path, monkeypatch):
    """The check above is not vacuous: a `.core` reach and a private reach are found."""
    plant = tmp_path / "kv"
    plant.mkdir()
    (plant / "planted.py").write_text("def f(node):\n    return node.raft.core.term, node.raft._inbox\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    got = layer_reaches("kv", {"_inbox"})
    assert sorted(got) == ["kv/planted.py:2: ._inbox", "kv/planted.py:2: .core"]


def core_imports(layer: str) -> list[str]:
    """Imports of kv.raft.core (absolute or relative) in the modules of `layer`."""
    found = []
    for path in _layer_files(layer):
        parts = path[:-3].split(os.sep)
        package = (["kv"] if layer != "kv" else []) + parts[:-1]  # the module's package
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                names = [module] + [f"{module}.{a.name}" for a in node.names]
            else:
                continue
            if "kv.raft.core" in names:
                found.append(f"{path}:{node.lineno}")
    return found


def test_nothing_outside_raft_imports_the_core():
    """The layers above reach Raft through raft/node.py (RaftNode and its CoreConfig),
    never through the core's module."""
    found = [hit for layer in LAYERS if layer != "raft" for hit in core_imports(layer)]
    assert not found, "imports of kv.raft.core outside raft/ (use kv.raft.node):\n" + "\n".join(found)


def test_the_core_import_check_sees_planted_imports(tmp_path, monkeypatch):
    (tmp_path / "kv" / "sub").mkdir(parents=True)
    (tmp_path / "http").mkdir()
    (tmp_path / "kv" / "a.py").write_text("from .raft.core import RaftCore\nfrom .raft import core\nfrom .raft.node import RaftNode\n")
    (tmp_path / "kv" / "sub" / "b.py").write_text("from ..raft.core import X\nimport kv.raft.core\n")
    (tmp_path / "http" / "c.py").write_text("from ..raft.core import X\nfrom kv.raft import core\nfrom .core import Y\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    assert core_imports("kv") == ["kv/a.py:1", "kv/a.py:2", "kv/sub/b.py:1", "kv/sub/b.py:2"]
    assert core_imports("http") == ["http/c.py:1", "http/c.py:2"]


# -- one error hierarchy -------------------------------------------------------------------

# Exceptions that are not KVErrors, and why no user ever sees one.
NOT_KV_ERRORS = {
    "kv.raft.failpoints.InjectedFailure",  # raised only by failpoints the crash tests arm
}


def _modules() -> list[str]:
    names = []
    for layer in LAYERS:
        for path in _layer_files(layer):
            mod = path[:-3].replace(os.sep, ".")
            names.append(mod if layer == "kv" else "kv." + mod)
    return [n.removesuffix(".__init__") for n in names if not n.endswith("__main__")]


def test_every_error_is_a_kv_error():
    import importlib
    import inspect

    import kv

    found = {}
    for mod in _modules():
        if mod.startswith("kv.spark"):
            continue  # needs pyspark at import; its errors are kv.errors' (tested there)
        m = importlib.import_module(mod)
        for name, cls in vars(m).items():
            if inspect.isclass(cls) and issubclass(cls, BaseException) and cls.__module__ == mod:
                found[f"{mod}.{name}"] = cls
    bad = [n for n, cls in found.items() if not issubclass(cls, kv.KVError) and not n.rsplit(".", 1)[1].startswith("_") and n not in NOT_KV_ERRORS]
    assert not bad, f"errors outside the kv.KVError hierarchy: {bad}"
    public = [n.rsplit(".", 1)[1] for n, cls in found.items() if not n.rsplit(".", 1)[1].startswith("_")]
    twice = {n for n in public if public.count(n) > 1}
    assert not twice, f"two error classes of one name: {twice}"
    assert kv.raft.errors.NotLeader is kv.NotLeader and kv.raft.errors.KVError is kv.KVError


STORE_API = (
    "get", "put", "delete", "delete_prefix", "cas", "txn", "scan", "scan_page", "watch", "put_many", "lease", "lock", "election",
    "lease_grant", "lease_keepalive", "lease_keepalives", "lease_revoke", "lease_info", "lease_list",
)


def test_the_store_api_is_one_api_on_every_face():
    """kv.open's store, kv.Client, kv.AsyncClient and kv.Node: the same methods, taking the
    same positional arguments (a newcomer's watch(prefix, page.index + 1) failed on kv.open,
    which had no scan_page either); each face may add keyword options of its own."""
    import inspect

    from kv.client import AsyncClient, Client
    from kv.node import Node
    from kv.store import Store

    for name in STORE_API:
        positional = {}
        for face in (Store, Client, AsyncClient, Node):
            params = list(inspect.signature(getattr(face, name)).parameters.values())[1:]
            positional[face.__name__] = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert len({tuple(v) for v in positional.values()}) == 1, (name, positional)


# -- the rooms of kv/ ----------------------------------------------------------------------

# Each room of kv/ imports only the rooms before it in this list (and itself): what a
# client needs never pulls in the server, and nothing below the front doors knows them.
ROOMS = (
    "kv.raft", "kv.statemachine", "kv.snapshot", "kv.errors", "kv.common", "kv.client", "kv.server", "kv.node", "kv.store",
    "kv", "kv.http", "kv.v3api", "kv.healthcheck", "kv.spark", "kv.bench", "kv.cli", "kv.__main__",
)


def _module_of(path: str) -> str:
    parts = path[:-3].split(os.sep)
    return ".".join(parts if parts[0] == "kv" else ["kv", *parts]).removesuffix(".__init__")


def _is_module(name: str) -> bool:
    rel = name.split(".")[1:]
    if rel and rel[0] in ("raft", "statemachine", "snapshot", "http", "v3api"):
        base = os.path.join(ROOT, *rel)
    else:
        base = os.path.join(ROOT, "kv", *rel)
    return os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py")) or (rel != [] and os.path.isdir(base))


def kv_imports(path: str) -> set[str]:
    """The kv modules the module at path imports, at its top or deferred in a function."""
    mod = _module_of(path)
    package = mod.split(".") if path.endswith("__init__.py") else mod.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "kv"}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) if node.level else node.module or ""
            if base.split(".")[0] != "kv":
                continue
            subs = [f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}")]
            out |= set(subs) if len(subs) == len(node.names) else {base, *subs}
    return out - {mod}


def _room(module: str) -> str:
    return max((r for r in ROOMS if module == r or module.startswith(r + ".")), key=len)


def _kv_files() -> list[str]:
    return [p for layer in LAYERS for p in _layer_files(layer)]


def test_rooms_import_only_the_rooms_below_them():
    found = []
    for path in _kv_files():
        room = _room(_module_of(path))
        below = ROOMS[: ROOMS.index(room) + 1]
        found += [f"{path} ({room}) imports {m}" for m in sorted(kv_imports(path)) if _room(m) not in below]
    assert not found, "imports against the order of kv's rooms (tests/test_layout.py ROOMS):\n" + "\n".join(found)


def import_cycles(paths: list[str]) -> list[list[str]]:
    """The cycles (strongly connected groups of more than one module) among the modules at
    paths, counting deferred imports too: a cycle hidden in a function is still a tangle."""
    graph = {_module_of(p): kv_imports(p) for p in paths}
    index, low, stack, on, groups = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_no_import_cycles():
    cycles = import_cycles([p for p in _kv_files() if not p.endswith("__init__.py")])
    assert not cycles, f"import cycles among kv's modules: {cycles}"


def test_the_room_and_cycle_checks_see_planted_faults(tmp_path, monkeypatch):
    for room in ("client", "server", "common"):
        (tmp_path / "kv" / room).mkdir(parents=True)
        (tmp_path / "kv" / room / "__init__.py").write_text("")
    (tmp_path / "kv" / "client" / "a.py").write_text("from ..server import b\n")
    (tmp_path / "kv" / "server" / "b.py").write_text("def f():\n    from ..client.a import x\n")
    (tmp_path / "kv" / "common" / "c.py").write_text("from kv.common import d\n")
    (tmp_path / "kv" / "common" / "d.py").write_text("import kv.common.c\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    monkeypatch.setattr(sys.modules[__name__], "LAYERS", ("kv",))
    assert kv_imports("kv/client/a.py") == {"kv.server.b"}
    with pytest.raises(AssertionError, match=r"kv/client/a.py \(kv.client\) imports kv.server.b"):
        test_rooms_import_only_the_rooms_below_them()
    assert import_cycles(_kv_files()) == [["kv.client.a", "kv.server.b"], ["kv.common.c", "kv.common.d"]]


def test_a_client_needs_neither_lmdb_nor_plyvel_nor_the_raft_driver():
    """`pip install ledgerkv` for a client: kv.Client, its recipes and the command line's
    client commands load without the storage engines or the Raft stack."""
    code = (
        "import sys\n"
        "for m in ('lmdb', 'plyvel', 'uvloop'):\n"
        "    sys.modules[m] = None  # an import of it fails\n"
        "import kv, kv.client, kv.client.recipes\n"
        "c = kv.Client('127.0.0.1:1')\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('kv.raft.node', 'kv.raft.ledger', 'kv.statemachine.leveldb', 'kv.server', 'kv.node', 'kv.store')))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    # And the command line's client commands (a newcomer's client-only install: `kv --help`
    # and `kv get` failed on `import lmdb`, the parser loading `kv serve`'s module).
    cli = "import sys\nfor m in ('lmdb', 'plyvel'):\n    sys.modules[m] = None\nfrom kv.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    for argv, rc, said in (
        (["--help"], 0, "COMMAND"),
        (["get", "k", "--endpoints", "http://127.0.0.1:1", "--timeout", "0.5"], 1, "kv get: no endpoint answered"),
        (["snapshot", "save", "--help"], 0, "usage: kv snapshot save"),
    ):
        out = subprocess.run([sys.executable, "-c", cli, *argv], cwd="/", capture_output=True, text=True, timeout=60)
        assert out.returncode == rc and said in out.stdout + out.stderr, (argv, out.stdout[-500:], out.stderr[-1000:])


MAPPED = ("raft", "statemachine", "snapshot", "http", "v3api")


def folder_name_imports(path: str) -> list[str]:
    """Imports of our mapped folders by their folder names (`import raft.core`, `from http
    import app`): run from the repository root they load a second copy of the module,
    whose classes are not kv.raft's. The standard library's http stays allowed."""
    ours = {d: {f[:-3] for f in os.listdir(os.path.join(ROOT, d)) if f.endswith(".py")} for d in MAPPED}
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            top, _, rest = name.partition(".")
            if top in MAPPED and (top != "http" or rest.split(".")[0] in ours["http"]):
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {name}")
                break
    return found


def test_nothing_imports_a_layer_by_its_folder_name():
    found = []
    for top in (*MAPPED, "kv", "tests", "benchmarks", "docs"):
        for root, _dirs, files in os.walk(os.path.join(ROOT, top)):
            found += [hit for f in files if f.endswith(".py") for hit in folder_name_imports(os.path.join(root, f))]
    assert not found, "import these as kv.raft, kv.http, ... (the folder name loads a second copy):\n" + "\n".join(found)


def test_the_folder_name_check_sees_planted_imports(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import raft.core\nfrom http import HTTPStatus\nfrom http import app\nfrom snapshot.format import X\nimport http.cookies\n")
    assert [h.rsplit(": ", 1)[1] for h in folder_name_imports(str(planted))] == ["raft.core", "http.app", "snapshot.format"]


def test_no_private_name_is_imported_from_another_module():
    """A `_name` is its module's own: another module that needs it gets a public name."""
    found = []
    for path in _kv_files():
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                found += [f"{path}:{node.lineno}: {a.name}" for a in node.names if a.name.startswith("_") and not a.name.endswith("__")]
    assert not found, "private names imported across modules:\n" + "\n".join(found)


def _private_defined(path: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.endswith("__")}


def private_reaches_across_modules(paths: list[str]) -> list[str]:
    """`x._name` where `_name` is private to another of our modules and not this one's:
    within a layer too, a module uses another's public names only (a private name that
    moved, or went, is then found here rather than by a user)."""
    own = {p: _private_defined(p) for p in paths}
    everyone = set().union(*own.values())
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
            if isinstance(node, ast.Attribute) and node.attr in everyone and node.attr not in own[path]:
                owner = node.value.id if isinstance(node.value, ast.Name) else None
                if owner not in ("self", "cls"):
                    found.append(f"{path}:{node.lineno}: .{node.attr}")
    return found


def test_no_module_reaches_into_another_modules_private_names():
    found = private_reaches_across_modules(_kv_files())
    assert not found, "private names of another module (give it a public name):\n" + "\n".join(found)


def test_the_private_reach_check_sees_a_planted_one(tmp_path, monkeypatch):
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "a.py").write_text("class A:\n    def _pick(self):\n        return self._turn\n")
    (tmp_path / "kv" / "b.py").write_text("def f(c):\n    return c._pick(), c._unknown_elsewhere\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    assert private_reaches_across_modules(["kv/a.py", "kv/b.py"]) == ["kv/b.py:2: ._pick"]
