"""Prometheus text exposition without a client library: counters, gauges, histograms."""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Iterable

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


def _labels(names: tuple[str, ...], values: tuple) -> str:
    if not names:
        return ""
    inner = ",".join(f'{n}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"' for n, v in zip(names, values))
    return "{" + inner + "}"


class Counter:
    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.label_names = name, help, labels
        self.values: dict[tuple, float] = defaultdict(float)

    def inc(self, *labels, by: float = 1.0) -> None:
        self.values[labels] += by

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} counter"
        for lv, v in sorted(self.values.items()):
            yield f"{self.name}{_labels(self.label_names, lv)} {v:g}"


class Gauge:
    """A gauge whose values are read when scraped."""

    def __init__(self, name: str, help: str, read: Callable[[], Iterable[tuple[tuple, float]]], labels: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.read, self.label_names = name, help, read, labels

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} gauge"
        for lv, v in self.read():
            yield f"{self.name}{_labels(self.label_names, lv)} {v:g}"


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        acc = 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            yield f'{self.name}_bucket{{le="{b:g}"}} {acc}'
        yield f'{self.name}_bucket{{le="+Inf"}} {self.count}'
        yield f"{self.name}_sum {self.sum:g}"
        yield f"{self.name}_count {self.count}"


class Registry:
    def __init__(self) -> None:
        self.metrics: list = []

    def add(self, metric):
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        return "\n".join(line for m in self.metrics for line in m.render()) + "\n"
