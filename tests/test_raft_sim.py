"""Seeded chaos runs of the pure core: crashes, partitions (one-way too), drops, duplicates,
reordering, snapshots with compaction and install-snapshot. Every step is checked for
election safety, leader completeness, state machine safety and monotonic commit; each run
ends by healing and checking that the cluster agrees and commits again.

Default: 600 schedules (about 10 s). `--soak` (or KV_SOAK=1) runs 20,000 more."""

from __future__ import annotations

import pytest
from chaos_sim import chaos_run

SEEDS_PER_CASE = 150


def seeds(request, base: int) -> range:
    n = request.config.getoption("--sim-seeds") or SEEDS_PER_CASE
    return range(base, base + n)


@pytest.mark.parametrize("nodes, snapshots, base", [(3, False, 0), (3, True, 10_000), (5, False, 20_000), (5, True, 30_000)])
def test_chaos_schedules(request, nodes, snapshots, base):
    totals = {"crashes": 0, "terms_with_leader": 0, "snapshots_installed": 0, "acked": 0}
    for seed in seeds(request, base):
        sim = chaos_run(seed, n=nodes, snapshots=snapshots)
        for k in totals:
            totals[k] += sim.stats()[k]
    # The schedules must actually have exercised what they claim to.
    assert totals["crashes"] > 0 and totals["terms_with_leader"] > len(seeds(request, base))
    assert totals["acked"] > 0
    if snapshots:
        assert totals["snapshots_installed"] > 0


@pytest.mark.soak
@pytest.mark.parametrize("nodes, snapshots", [(3, False), (3, True), (5, True)])
def test_chaos_soak(nodes, snapshots):
    for seed in range(100_000, 100_000 + 20_000 // 3):
        chaos_run(seed, n=nodes, snapshots=snapshots, duration=10_000)
