import os
import signal
import sys

import pytest

# Test helpers (sim.py, cluster harness) are imported by name from this folder.
sys.path.insert(0, os.path.dirname(__file__))

# Ctrl-C (SIGINT) acts on the tests' children as at a terminal. A run started in the
# background by a shell without job control (CI) ignores SIGINT, and an ignored signal stays
# ignored across exec, where a handler is reset to the default: with Python's handler here,
# every child starts with the default. (A preexec_fn did it in each child, and its fork ran
# Python there beside grpcio's threads: `etcdctl lock` once died before its exec, its stderr
# only grpcio's "Epoll1Poller ... epoll_wait error: Bad file descriptor".)
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true", default=False, help="run the long soak / fault runs")
    parser.addoption("--sim-seeds", type=int, default=None, help="how many seeds the simulation tests run")


# Two lanes, one per pytest-xdist worker (pyproject's addopts: -n 2). "untimed": the Spark
# pipeline (its JVM start-ups are most of the run's time), the seeded simulators and the
# modules below, whose tests assert nothing about time. "timed": everything else, one test at a time as in a
# single process: the real-process tests that wait on elections, ttls and timeouts. The
# Spark tests' cluster and JVM do load the machine beside the timed lane.
SIM_MODULES = ("test_raft_sim.py", "test_lease_sim.py", "test_membership_sim.py")
# Also untimed: the benchmarks' smoke runs (they check that reports come out, not figures),
# the docs (their examples, the site's build), the layout checks (a wheel build) and the
# crash points (each waits for a failpoint's exit and then for convergence, with bounds of
# 20-30 s; nothing in them is timed), the etcd API's watch limits (memory, counts) and the
# history on a cluster (a paged list, a watch from far behind, compact: waits of 20-60 s):
# the timed lane is the run's longer one.
UNTIMED_MODULES = (
    "test_bench_smoke.py", "test_docs.py", "test_layout.py", "test_public_api.py", "test_compat_python_etcd3.py", "test_crash_points.py",
    "test_etcd_watch_limits.py", "test_history_cluster.py", "test_etcd_stm.py",
)


def lane(nodeid: str) -> str:
    module = nodeid.partition("::")[0]
    return "untimed" if "spark" in nodeid or module.endswith(SIM_MODULES + UNTIMED_MODULES) else "timed"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Each lane is one unit of work: a worker runs one lane whole, in collection order."""
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane(nodeid)

    return Lanes(config, log)


_lanes_here: set[str] = set()


def pytest_runtest_setup(item):
    # A worker given tests of both lanes would run timed tests beside each other.
    if hasattr(item.config, "workerinput"):
        _lanes_here.add(lane(item.nodeid))
        if len(_lanes_here) > 1:
            pytest.fail(f"this xdist worker was given tests of both lanes ({item.nodeid}); see tests/conftest.py")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--soak") or os.environ.get("KV_SOAK"):
        return
    skip = pytest.mark.skip(reason="soak run: enable with --soak or KV_SOAK=1")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
async def inproc_cluster(tmp_path):
    """Three kv.Node members in this process, on a loopback network (tests/inproc.py)."""
    from inproc import InprocCluster

    c = InprocCluster(str(tmp_path))
    await c.start()
    yield c
    await c.stop()
