import os
import sys

# Test helpers (sim.py, cluster harness) are imported by name from this folder.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true", default=False, help="run the long soak / fault runs")
    parser.addoption("--sim-seeds", type=int, default=None, help="how many seeds the simulation tests run")


def pytest_collection_modifyitems(config, items):
    import pytest

    if config.getoption("--soak") or os.environ.get("KV_SOAK"):
        return
    skip = pytest.mark.skip(reason="soak run: enable with --soak or KV_SOAK=1")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)
