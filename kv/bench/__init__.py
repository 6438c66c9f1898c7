"""The benchmarks behind `kv bench` (kv/cli/bench.py): measure.py drives and reports,
runs.py, watch.py and lease.py are the benchmarks; clusters come from kv.bench.harness."""
