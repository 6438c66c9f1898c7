"""What a part of the node reports to its metrics: plain values with their names and docs,
read when Prometheus scrapes. Each part that has something to report has a `samples()`
method and the node registers it (kv/server/metrics.py turns samples into Prometheus
families); nothing here imports prometheus_client, so an embedded store that never serves
/metrics never loads it. The names follow what an etcd operator already graphs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class Sample(NamedTuple):
    name: str
    doc: str
    kind: str  # "gauge" or "counter"
    value: float = 0.0
    label: str = ""  # a labelled family: the label's name, and its series below
    series: tuple[tuple[str, float], ...] = ()


def gauge(name: str, doc: str, value: float) -> Sample:
    return Sample(name, doc, "gauge", float(value))


def counter(name: str, doc: str, value: float) -> Sample:
    return Sample(name, doc, "counter", float(value))


def labelled(kind: str, name: str, doc: str, label: str, series: Iterable[tuple[str, float]]) -> Sample:
    """A family with one label: (label value, value) for each series."""
    return Sample(name, doc, kind, label=label, series=tuple((k, float(v)) for k, v in series))
