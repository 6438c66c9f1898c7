"""Seeded chaos runs of the pure core: crashes, partitions (one-way too), drops, duplicates,
reordering, snapshots with compaction and install-snapshot. Every step is checked for
election safety, leader completeness, state machine safety and monotonic commit; each run
ends by healing and checking that the cluster agrees and commits again.

Membership changes (members added as learners or voters, promoted, removed, through
whichever node leads) run in their own case.

Default: 750 schedules (about 20 s). `--soak` (or KV_SOAK=1) runs 20,000 more."""

from __future__ import annotations

import pytest
from chaos_sim import chaos_run

SEEDS_PER_CASE = 150


def seeds(request, base: int) -> range:
    n = request.config.getoption("--sim-seeds") or SEEDS_PER_CASE
    return range(base, base + n)


@pytest.mark.parametrize(
    "nodes, snapshots, membership, base",
    [(3, False, False, 0), (3, True, False, 10_000), (5, False, False, 20_000), (5, True, False, 30_000), (3, True, True, 40_000)],
)
def test_chaos_schedules(request, nodes, snapshots, membership, base):
    totals = {"crashes": 0, "terms_with_leader": 0, "snapshots_installed": 0, "acked": 0, "config_changes": 0}
    for seed in seeds(request, base):
        sim = chaos_run(seed, n=nodes, snapshots=snapshots, membership=membership)
        for k in totals:
            totals[k] += sim.stats()[k]
    # The schedules must actually have exercised what they claim to.
    assert totals["crashes"] > 0 and totals["terms_with_leader"] > len(seeds(request, base))
    assert totals["acked"] > 0
    if snapshots:
        assert totals["snapshots_installed"] > 0
    if membership:
        assert totals["config_changes"] > len(seeds(request, base))  # members were added, removed, promoted


@pytest.mark.soak
@pytest.mark.timeout(0)
@pytest.mark.parametrize("nodes, snapshots, membership", [(3, False, False), (3, True, False), (5, True, False), (3, True, True)])
def test_chaos_soak(nodes, snapshots, membership):
    for seed in range(100_000, 100_000 + 20_000 // 4):
        chaos_run(seed, n=nodes, snapshots=snapshots, membership=membership, duration=10_000)
