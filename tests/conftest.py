import os
import sys

import pytest

# Test helpers (sim.py, cluster harness) are imported by name from this folder.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true", default=False, help="run the long soak / fault runs")
    parser.addoption("--sim-seeds", type=int, default=None, help="how many seeds the simulation tests run")


# Tests that wait on no clock of their own: the Spark pipeline (its JVM start-ups are most
# of the run's time) and the seeded simulators. With pytest-xdist (`-n 2 --dist loadgroup`,
# pyproject's addopts) they run in one worker while the other runs every test that starts
# real processes and waits on their timing, one at a time as before.
UNTIMED_MODULES = {"test_raft_sim.py", "test_lease_sim.py", "test_membership_sim.py"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        untimed = "spark" in item.keywords or item.path.name in UNTIMED_MODULES
        item.add_marker(pytest.mark.xdist_group("untimed" if untimed else "timed"))
    if config.getoption("--soak") or os.environ.get("KV_SOAK"):
        return
    skip = pytest.mark.skip(reason="soak run: enable with --soak or KV_SOAK=1")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)
