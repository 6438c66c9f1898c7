"""A member's machinery, behind kv.Node: the write path (writes.py), recovery at start
(recovery.py), the lease clock (lessor.py), the client-session sweeper, the watch hub
(watch.py), membership administration (members.py), joining a running cluster (join.py),
metrics (metrics.py, samples.py, layer_metrics.py), the free-space reserve, the data dir's
lock and bootstrap record, limits, TLS and the process settings of `kv serve`.

Nothing here is public API: kv.Node and kv.open are. It imports kv.common and the layers
below (kv.raft, kv.statemachine, kv.snapshot), and kv.client only to join a cluster."""
