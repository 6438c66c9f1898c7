"""`kv cluster up`: a local cluster of `kv serve` processes in the foreground.

Node i (1-based) serves HTTP on base_port + i - 1, peers on base_port + 100 + i - 1 and etcd's
gRPC API on base_port + 200 + i - 1, with its data under DATA_DIR/n<i>. The command prints the endpoints, waits for a leader, then
reports leader changes and nodes that exit, until Ctrl-C stops them all.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shlex
import shutil
import signal
import sys
import time

from ..client.endpoints import DEFAULT_ENDPOINTS
from ..server.datadir import LOCK_NAME, DataDirLock, holds_a_node
from ..errors import BadRequest, DataDirLocked
from ..bench.harness import SERVE, statuses
from ..common.text import columns
from .options import at_least
from .output import silence_stdout
from .refusal import EXIT_REMOVED
from ..server.process import CannotListen, check_can_listen


def _base_port(raw: str) -> int:
    # n1..nN serve HTTP from here and peers from 100 higher: leave room below 65536.
    if not raw.isdigit() or not 1 <= int(raw) <= 65000:
        raise argparse.ArgumentTypeError(f"expected a port from 1 to 65000, not {raw!r}")
    return int(raw)


def add_parser(sub) -> None:
    p = sub.add_parser("cluster", help="local clusters")
    p.set_defaults(run=run, usage=p)
    c = p.add_subparsers(dest="cluster_cmd", metavar="ACTION")
    up = c.add_parser("up", help="run a local cluster in the foreground; Ctrl-C stops it")
    up.add_argument("--nodes", type=at_least(1), default=None, help="how many nodes (default 3; for a --data-dir made before, as many as then)")
    up.add_argument("--data-dir", default="./kvdata", help="where the nodes keep their data (default ./kvdata)")
    up.add_argument(
        "--base-port", type=_base_port, default=None,
        help="HTTP port of n1; peers listen 100 higher, etcd's gRPC API 200 higher (default 8001; for a --data-dir made before, the one it was made with)",
    )
    up.add_argument("--heartbeat-ms", type=float, default=None, help="each node's leader heartbeat interval (kv serve's; default 100)")
    up.add_argument("--election-timeout-ms", type=float, default=None, help="each node's election timeout (kv serve's; default 1000)")


def run(args: argparse.Namespace) -> int:
    if args.cluster_cmd != "up":
        args.usage.print_help(sys.stderr)
        return 2
    extra = []
    if args.heartbeat_ms:
        extra += ["--heartbeat-ms", str(args.heartbeat_ms)]
    if args.election_timeout_ms:
        extra += ["--election-timeout-ms", str(args.election_timeout_ms)]
    return asyncio.run(up(args.nodes, args.data_dir, args.base_port, extra))


def layout(nodes: int, base_port: int, host: str = "127.0.0.1") -> list[dict]:
    plan = [
        {"id": f"n{i + 1}", "http": f"{host}:{base_port + i}", "url": f"http://{host}:{base_port + i}", "peer": f"{host}:{base_port + 100 + i}", "grpc": f"{host}:{base_port + 200 + i}"}
        for i in range(nodes)
    ]
    peers = ",".join(f"{n['id']}={n['peer']}" for n in plan)
    return [{**n, "peers": peers} for n in plan]


GONE_AFTER_MISSES = 3  # status polls in a row (a second each) a node restarted by hand did not answer


class _Output:
    closed = False  # whoever read this command's output went away (kv cluster up | head)


def _kv_command() -> str:
    """How to run kv as this command was run: `kv` when that is what the shell's PATH finds,
    else the path it was run by (`.venv/bin/kv` from a venv that is not activated, where a
    bare `kv` is not found), or the interpreter with -m kv."""
    prog = sys.argv[0]
    if os.path.basename(prog) != "kv":
        return f"{shlex.quote(sys.executable)} -m kv"
    found = shutil.which("kv")
    if found is not None and os.path.realpath(found) == os.path.realpath(prog):
        return "kv"
    return shlex.quote(prog)


def _say(msg: str) -> None:
    try:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
    except BrokenPipeError:  # as at the table: the cluster stops (the nodes, then this command)
        silence_stdout()
        _Output.closed = True
    except OSError:  # the terminal is gone (SIGHUP): the nodes are still to be stopped
        pass


LAYOUT_FILE = "cluster.json"  # in DATA_DIR: the nodes and base port it was made with


async def up(nodes: int | None, data_dir: str, base_port: int | None, extra: list[str]) -> int:
    if nodes is not None and nodes < 1:
        raise BadRequest("--nodes must be at least 1")
    made = not os.path.exists(data_dir)
    lock = DataDirLock.acquire(data_dir, of_members=True)  # a second `cluster up` here stops at this line
    try:
        nodes, base_port = _same_layout(data_dir, nodes, base_port)
        plan = layout(nodes, base_port)
        running = _holders(data_dir, [n["id"] for n in plan])
        if running:  # nodes brought back by hand after an earlier run: they would refuse the new ones
            raise BadRequest(
                f"nodes of an earlier `kv cluster up` on {os.path.abspath(data_dir)} still run: "
                f"{', '.join(f'{i} (pid {pid})' for i, pid in running.items())}. Stop them first "
                f"(kill {' '.join(str(pid) for pid in running.values())}), or give another --data-dir",
            )
        try:  # all free, or nothing starts (another cluster's nodes would answer in their place)
            check_can_listen(*[pair for n in plan for pair in ((n["http"], f"{n['id']}'s --http "), (n["peer"], f"{n['id']}'s peer port "), (n["grpc"], f"{n['id']}'s --grpc "))])
        except CannotListen as e:
            if made and os.listdir(data_dir) == [LOCK_NAME]:  # made just for the lock: not left behind
                shutil.rmtree(data_dir, ignore_errors=True)
            k = nodes - 1
            raise CannotListen(f"{e} (for the whole cluster: --base-port N puts its nodes on ports N..N+{k}, N+100..N+{100 + k} and N+200..N+{200 + k})") from None
        with open(os.path.join(data_dir, LAYOUT_FILE), "w") as f:
            json.dump({"nodes": nodes, "base_port": base_port}, f)
        return await _run(plan, data_dir, extra)
    finally:
        lock.release()


def _same_layout(data_dir: str, nodes: int | None, base_port: int | None) -> tuple[int, int]:
    """The nodes and base port to run: those a data dir was made with (its members know each
    other by those addresses: other ones would run, listed under the old ones), else the
    ones given, else 3 and 8001."""
    try:
        with open(os.path.join(data_dir, LAYOUT_FILE)) as f:
            saved = json.load(f)
    except FileNotFoundError:  # new, or made before the layout was kept
        return nodes or 3, base_port or 8001
    except (OSError, ValueError) as e:
        raise BadRequest(f"{os.path.join(data_dir, LAYOUT_FILE)} cannot be read ({e}): remove it and give --nodes and --base-port") from None
    was = (saved["nodes"], saved["base_port"])
    if (nodes or was[0], base_port or was[1]) != was:
        raise BadRequest(
            f"{os.path.abspath(data_dir)} holds a cluster of {was[0]} nodes on --base-port {was[1]}, whose members know each other "
            f"by those addresses: run it without --nodes and --base-port (or with those), or give another --data-dir"
        )
    return was


async def _run(plan: list[dict], data_dir: str, extra: list[str]) -> int:
    nodes = len(plan)
    procs: dict[str, asyncio.subprocess.Process] = {}
    logs = {}
    # Ctrl-C, kill, and the terminal closing (SIGHUP: the nodes, in sessions of their own,
    # would run on without this command, holding the ports and their data dirs) stop all.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    kept = [n["id"] for n in plan if holds_a_node(os.path.join(data_dir, n["id"]))]
    _say(f"starting {nodes} node{'s' if nodes != 1 else ''} under {os.path.abspath(data_dir)} (logs: <node>/serve.log)")
    if kept:  # (a newcomer took a data dir left from an earlier run for a new cluster)
        _say(f"  with the data of an earlier run or a restore ({', '.join(kept)}), kept; to start an empty cluster instead, "
             f"stop this and delete {os.path.abspath(data_dir)} first")
    code = 0
    try:  # (from the first node started: whatever breaks, from a closed stdout up, stops them)
        for n in plan:
            ndir = os.path.join(data_dir, n["id"])
            os.makedirs(ndir, exist_ok=True)
            logs[n["id"]] = open(os.path.join(ndir, "serve.log"), "ab")
            n["args"] = ["--id", n["id"], "--data-dir", os.path.abspath(ndir), "--http", n["http"], "--grpc", n["grpc"], "--peers", n["peers"], *extra]
            procs[n["id"]] = await asyncio.create_subprocess_exec(
                *SERVE, *n["args"], stdout=logs[n["id"]], stderr=logs[n["id"]], start_new_session=True,
            )
        print()
        rows = [("node", "client endpoint", "etcd API (gRPC)", "pid"), *((n["id"], n["url"], n["grpc"], str(procs[n["id"]].pid)) for n in plan)]
        print("\n".join(columns(rows, right=(3,), indent="  ")))
        print()
        endpoints = ",".join(n["url"] for n in plan)
        kv = _kv_command()
        print(f"  try:  {kv} put hello world --endpoints {endpoints}")
        print(f"        {kv} get hello --endpoints {endpoints}")
        print(f"        {kv} status --endpoints {endpoints}")
        print(f"        etcdctl --endpoints {','.join(n['grpc'] for n in plan)} get hello")
        if endpoints != (os.environ.get("KV_ENDPOINTS") or ",".join(DEFAULT_ENDPOINTS)):  # where commands without --endpoints go
            print(f"  or, for every command and kv.Client() in a shell:  export KV_ENDPOINTS={endpoints}")
        if os.environ.get("KV_TOKEN") or os.environ.get("KV_TOKENS"):  # the nodes took them from this shell
            print("  tokens are on ($KV_TOKEN / $KV_TOKENS): in another shell, export KV_TOKEN=<a token> first;")
            print("        etcdctl takes one as --user root:<token>")
        print("  Ctrl-C stops the cluster.\n", flush=True)
        died = await _watch(plan, procs, stop, {nid: os.path.abspath(f.name) for nid, f in logs.items()})
        code = 141 if _Output.closed else 1 if died else 0
    finally:
        _say("stopping all nodes ...")
        for p in procs.values():
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
        for nid, p in procs.items():
            try:
                await asyncio.wait_for(p.wait(), 10)
            except (asyncio.TimeoutError, TimeoutError):
                p.kill()
                await p.wait()
                code = 1
            logs[nid].close()
        others = _holders(data_dir, list(procs))
        if others:  # restarted by hand, as the hint says: not this command's to stop
            _say(
                f"stopped the nodes this command started; still running, started by hand: "
                f"{', '.join(f'{i} (pid {pid})' for i, pid in others.items())}: stop them with kill {' '.join(str(pid) for pid in others.values())}"
            )
        else:
            _say("stopped")
    return code


class _Ours:
    """This cluster's id, as the nodes this command started first report it (a new
    cluster's first leader chooses it): a node started by hand on a member's ports with
    another cluster's data dir is not counted (said once)."""

    def __init__(self) -> None:
        self.cluster_id = ""
        self.strangers: set[str] = set()  # nodes answering at a member's address as another cluster's

    def only(self, seen: dict[str, dict]) -> dict[str, dict]:
        """The statuses of the nodes of this cluster."""
        if not self.cluster_id:
            ids = collections.Counter(st.get("cluster_id") for st in seen.values() if st.get("cluster_id"))
            if not ids:
                return seen
            self.cluster_id = ids.most_common(1)[0][0]
        ours = self.cluster_id
        theirs = {nid: st["cluster_id"] for nid, st in seen.items() if st.get("cluster_id", ours) not in (ours, "")}
        for nid in theirs.keys() - self.strangers:
            _say(f"{nid}'s address answers as a node of another cluster (id {theirs[nid]}, this one's {ours}): not counted; "
                 "was it started by hand with another data dir?")
        self.strangers = set(theirs)  # (said again if it comes back after a node of ours)
        return {nid: st for nid, st in seen.items() if nid not in theirs}


def _holders(data_dir: str, ids: list[str]) -> dict[str, int | None]:
    """The nodes whose data dir under data_dir a process holds (kv serve locks it), with its pid."""
    held = {}
    for i in ids:
        ndir = os.path.join(data_dir, i)
        if not os.path.isfile(os.path.join(ndir, LOCK_NAME)):
            continue
        try:
            DataDirLock.acquire(ndir).release()
        except DataDirLocked as e:
            held[i] = e.pid
    return held


_LAST_LINES = 8  # how far back from its end a node's log is searched for the error it stopped on


def _last_line(path: str) -> str:
    """What a node that exited said last: its last error among its last lines (not the
    "stopping ... after the error above" that follows it, nor what it logged as it
    stopped), else its last line."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 16384))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    if not lines:
        return ""
    tail = lines[:-1] if "after the error above" in lines[-1] else lines[-_LAST_LINES:]
    errors = [ln for ln in tail if " ERROR " in ln]
    return errors[-1] if errors else lines[-1]


def _rejoin_line(nid: str, args: list[str], plan: list[dict]) -> str:
    """The command that brings a removed node back as a new member: from an empty data dir,
    with --join a member's client URL, and only its own --peers entry (docs/cluster.md)."""
    at = args.index("--peers") + 1
    peer = next(p for p in args[at].split(",") if p.startswith(nid + "="))
    other = next(n["url"] for n in plan if n["id"] != nid)
    return _restart_line([*args[:at], peer, *args[at + 1 :], "--join", other])


def _restart_line(args: list[str]) -> str:
    """The command that starts a node again as this one started it: its arguments, and the
    KV_* settings it inherited from this shell (secrets named, not shown)."""
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("KV_") and k != "KV_ENDPOINTS"}
    shown = [f"{k}={v}" for k, v in env.items() if not any(w in k for w in ("TOKEN", "SECRET"))]
    hidden = [f"{k}=\"${k}\"" for k in env if any(w in k for w in ("TOKEN", "SECRET"))]
    line = shlex.join([*(["env", *shown] if shown else []), *SERVE, *args])
    return line.replace(shlex.join(SERVE), " ".join([*hidden, shlex.join(SERVE)]), 1) if hidden else line


def _status_token() -> str | None:
    """A token the nodes' /v1/status takes (any role's: a read), as they took theirs from
    this shell: $KV_TOKEN, or the first token of the $KV_TOKENS file (None: tokens are off,
    or the file cannot be read, which the nodes refuse too)."""
    if os.environ.get("KV_TOKEN"):
        return os.environ["KV_TOKEN"]
    if os.environ.get("KV_TOKENS"):
        from ..http.auth import load_tokens

        try:
            return next((t for t, g in load_tokens(os.environ["KV_TOKENS"]).items() if g.may("read")), None)
        except BadRequest:
            return None
    return None


async def _watch(plan: list[dict], procs: dict, stop: asyncio.Event, log_paths: dict[str, str]) -> list[str]:
    """Report leader changes and nodes that exit until `stop` is set or every node has
    exited; returns the ids of the nodes that exited on their own."""
    import aiohttp

    leader = None
    exited: list[str] = []
    back: set[str] = set()  # of those, the ones answering again
    missed: dict[str, int] = {}  # of those, status polls in a row each did not answer
    told_restarted = False
    ours = _Ours()
    token = _status_token()
    headers = {"Authorization": f"Bearer {token}"} if token else None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1), headers=headers) as s:
        while not stop.is_set() and not _Output.closed:
            for nid, p in procs.items():  # first: the nodes asked below have not exited since
                if p.returncode is not None and nid not in exited:
                    exited.append(nid)
                    last = _last_line(log_paths[nid])
                    _say(f"node {nid} exited with code {p.returncode}; its log is {log_paths[nid]}" + (f": {last}" if last else ""))
                    args = next(n["args"] for n in plan if n["id"] == nid)
                    # (a removed node's mkdir: its data dir, where the log goes, is made anew)
                    log_dir = shlex.quote(os.path.dirname(log_paths[nid]))
                    to_log = f">> {shlex.quote(log_paths[nid])} 2>&1"
                    if p.returncode == EXIT_REMOVED:  # its old data dir is refused: it comes back as a new member
                        _say(f"  it was removed (kv member remove); to add it back as a new member, from an empty data dir, in another shell: "
                             f"rm -rf {log_dir} && mkdir -p {log_dir} && {_rejoin_line(nid, args, plan)} {to_log}")
                    else:  # (not with a data dir made anew: an empty one would come back as a founding member)
                        _say(f"  to bring {nid} back, in another shell: {_restart_line(args)} {to_log}")
                        _say(f"  (if {log_dir} is gone, a lost disk: kv member remove {nid}, then join it afresh from an empty "
                             "data dir with --join, as docs/cluster.md says)")
            seen = ours.only(await statuses(s, {n["id"]: n["url"] for n in plan}))
            for nid in exited:  # brought back by hand, as the hint says
                missed[nid] = 0 if nid in seen else missed.get(nid, 0) + 1
                if nid in seen and nid not in back:
                    back.add(nid)
                    _say(f"{nid} answers again (restarted by hand); {len(seen)}/{len(plan)} nodes answering")
                elif missed[nid] == GONE_AFTER_MISSES and nid in back:  # (not one slow answer: a busy node)
                    back.discard(nid)
                    _say(f"{nid} (restarted by hand) stopped answering; {len(seen)}/{len(plan)} nodes answering")
            leaders = {st["leader"] for st in seen.values() if st.get("leader")}
            now = next(iter(leaders)) if len(leaders) == 1 else None
            if now != leader:
                answering = f"{len(seen)}/{len(plan)} nodes answering"
                if now:
                    _say(f"leader: {now} (term {max(st.get('term', 0) for st in seen.values())}); {answering}")
                elif len(seen) > len(plan) // 2:
                    _say(f"no leader yet; {answering}")
                else:
                    _say(f"no leader: {answering}, and {len(plan) // 2 + 1} are needed to elect one and commit; bring nodes back")
                leader = now
            if len(exited) == len(procs):
                if not seen:
                    _say("every node has exited; see their logs above")
                    return exited
                if not told_restarted:  # nodes brought back by hand, as the hint above says
                    told_restarted = True
                    alive = ", ".join(sorted(seen)) + (" answers" if len(seen) == 1 else " answer")
                    _say(f"every node this command started has exited, but {alive} (restarted by hand?); watching until Ctrl-C")
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except (asyncio.TimeoutError, TimeoutError):
                pass
    return exited
