"""What a directory takes on disk (metrics, etcd's Status, the benchmarks)."""

from __future__ import annotations

import os


def dir_bytes(path: str) -> int:
    """Bytes of every file under path; a file removed while it is walked (a compaction, a
    snapshot rotation) counts as nothing."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total
