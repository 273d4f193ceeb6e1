"""Metrics on prometheus_client (the registry, the families, the exposition), with a
per-token path of its own. No torch: the proxy (edge_proxy/metrics.py) and the
replica's API process (replica/api/metrics.py) build their metrics from these.

Two kinds of metric:

- `Counter`, `Histogram`, `Gauge`: prometheus_client's own, behind the call shape the
  code uses (`inc(*label_values, by=1)`, `get(*label_values)`), for what happens once
  per request. In multiprocess mode (`PROMETHEUS_MULTIPROC_DIR` set before the process
  imports prometheus_client, as `edge_proxy.server` does for its workers) their values
  live in prometheus_client's per-process files and `MultiProcessCollector` sums them.
- `HotCounter`, `HotHistogram`: what happens once per token. A prometheus_client
  `Histogram.observe` plus `Counter.inc` costs 1.1 µs a token in one process and
  3.2-3.8 µs in multiprocess mode (bench/metrics.py, 2 busy cores of an AMD EPYC),
  over the budget of 1 µs; these add into one array of doubles per process (`HotStore`:
  a memoryview over memory, or over an mmap'd file in the multiprocess folder) for
  0.3 µs (the hand-written path they replace: 0.24 µs), and `HotStore.collect` turns
  every process's array into prometheus_client families at scrape time.

A scrape renders with `exposition(...)` over collectors (`Scrape`), so families made at
scrape time (gauges read from live state) need no registration.
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import mmap
import os
import tempfile
from collections.abc import Callable, Iterable

import prometheus_client as pc
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.utils import floatToGoString

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what `exposition` writes

# Seconds; dense below 100 ms where latency budgets live.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 2.0, 5.0, 10.0, 30.0)


def multiprocess_dir() -> str | None:
    """The multiprocess folder of this process's prometheus_client, or None."""
    return os.environ.get(MULTIPROC_ENV) or None


# -- once per request: prometheus_client ----------------------------------------------------
class Counter:
    """A prometheus_client Counter, optionally labelled: `inc(*label_values, by=1)`. `values`
    holds this process's counts by label values (what `get` and tests read)."""

    def __init__(self, registry, name: str, help: str, labels: tuple[str, ...] = ()):
        self.metric = pc.Counter(name, help, labels, registry=registry)
        self.labelled = bool(labels)
        self.values: dict[tuple, float] = {}
        self._children: dict[tuple, object] = {}

    def _child(self, labels: tuple):
        child = self._children.get(labels)
        if child is None:
            child = self._children[labels] = self.metric.labels(*labels) if self.labelled else self.metric
        return child

    def inc(self, *labels, by: float = 1.0) -> None:
        self._child(labels).inc(by)
        self.values[labels] = self.values.get(labels, 0.0) + by

    def get(self, *labels) -> float:
        return self.values.get(labels, 0.0)


class Histogram:
    """A prometheus_client Histogram (fixed buckets, `le` inclusive)."""

    def __init__(self, registry, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.metric = pc.Histogram(name, help, buckets=buckets, registry=registry)
        self.observe = self.metric.observe


class Gauge:
    """A prometheus_client Gauge. `mode` says how one scrape of several processes combines
    theirs (prometheus_client's multiprocess_mode: "livesum" adds the live processes')."""

    def __init__(self, registry, name: str, help: str, mode: str = "livesum"):
        self.metric = pc.Gauge(name, help, registry=registry, multiprocess_mode=mode)
        self.set = self.metric.set


# -- once per token: the hot store -----------------------------------------------------------
class HotStore:
    """This process's per-token figures: `capacity` doubles that `HotCounter` and `HotHistogram`
    add into, read at scrape time by `collect()`.

    With a multiprocess folder the doubles are an mmap'd file there, `hot_<pid>_*.bin`, and
    `collect()` sums every process's file, those of workers that have exited too (their counts
    stay counted, as prometheus_client keeps a dead process's counters). Double 0 is the
    layout's tag (a digest of the metrics' names and buckets, 48 bits: exact in a double): a
    scrape sums only the files laid out as its own. A double written by one process and read
    by another is an aligned 8-byte store: a scrape sees each value whole, though a
    histogram's buckets and its sum may be one observation apart."""

    def __init__(self, capacity: int = 128, directory: str | None = None):
        self.capacity, self.directory = capacity, directory
        self.used = 1  # double 0: the layout's tag
        self.families: list[HotCounter | HotHistogram] = []
        self._layout = hashlib.sha256()
        if directory is None:
            self.mv = memoryview(bytearray(8 * capacity)).cast("d")
        else:
            fd, self.path = tempfile.mkstemp(prefix=f"hot_{os.getpid()}_", suffix=".bin", dir=directory)
            with os.fdopen(fd, "w+b") as f:
                f.truncate(8 * capacity)
                self._mmap = mmap.mmap(f.fileno(), 8 * capacity)  # the mapping outlives the descriptor
            self.mv = memoryview(self._mmap).cast("d")

    def _slots(self, metric, n: int, shape: str) -> int:
        if self.used + n > self.capacity:
            raise ValueError(f"HotStore of {self.capacity} doubles is full: make it larger")
        self._layout.update(shape.encode())
        self.mv[0] = float(int(self._layout.hexdigest()[:12], 16))
        base, self.used = self.used, self.used + n
        self.families.append(metric)
        return base

    def _arrays(self) -> list:
        if self.directory is None:
            return [self.mv]
        out = []
        for path in sorted(glob.glob(os.path.join(self.directory, "hot_*.bin"))):
            with open(path, "rb") as f:
                a = memoryview(f.read(8 * self.capacity)).cast("d")
            if len(a) == self.capacity and a[0] == self.mv[0]:
                out.append(a)
        return out

    def collect(self):
        arrays = self._arrays()
        for m in self.families:
            yield m.family(arrays)


class HotCounter:
    """A counter on the per-token path: `inc(by)` is one addition into the store."""

    def __init__(self, store: HotStore, name: str, help: str):
        self.name, self.help = name.removesuffix("_total"), help
        self.slot = store._slots(self, 1, f"c:{self.name};")
        self.mv = store.mv

    def inc(self, by: float = 1.0) -> None:
        self.mv[self.slot] += by

    def get(self) -> float:
        """This process's count."""
        return self.mv[self.slot]

    def family(self, arrays: list) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.help, value=sum(a[self.slot] for a in arrays))


class HotHistogram:
    """A histogram on the per-token path: `observe(v)` is a bisect and two additions
    (v's bucket, `le` inclusive, and the sum); the count is the buckets' total."""

    def __init__(self, store: HotStore, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.help, self.bounds = name, help, list(buckets)
        n = len(buckets) + 1  # + the +Inf bucket
        self.base = store._slots(self, n + 1, f"h:{name}:{','.join(map(repr, buckets))};")
        self.sum_slot = self.base + n
        self.mv = store.mv

    def observe(self, v: float) -> None:
        mv = self.mv
        mv[self.base + bisect.bisect_left(self.bounds, v)] += 1.0
        mv[self.sum_slot] += v

    def counts(self) -> list[float]:
        """This process's count per bucket (not cumulative; the last is +Inf)."""
        return list(self.mv[self.base:self.sum_slot])

    def family(self, arrays: list) -> HistogramMetricFamily:
        counts = [sum(a[self.base + i] for a in arrays) for i in range(len(self.bounds) + 1)]
        return histogram(self.name, self.help, self.bounds, counts, sum(a[self.sum_slot] for a in arrays))


# -- a scrape ----------------------------------------------------------------------------------
def histogram(name: str, help: str, bounds, counts, sum_value: float) -> HistogramMetricFamily:
    """A histogram family made at scrape time from counts per bucket (not cumulative: one per bound, `le`
    inclusive, then the count over the largest)."""
    acc, buckets = 0.0, []
    for bound, n in zip([*bounds, float("inf")], counts):
        acc += n
        buckets.append((floatToGoString(bound), acc))
    return HistogramMetricFamily(name, help, buckets=buckets, sum_value=sum_value)


def gauge(name: str, help: str, values: dict[tuple, float] | float, labels: tuple[str, ...] = ()):
    """A gauge family made at scrape time: one value, or a value per tuple of label values."""
    if not labels:
        return GaugeMetricFamily(name, help, value=float(values))
    fam = GaugeMetricFamily(name, help, labels=list(labels))
    for key, v in sorted(values.items()):
        fam.add_metric(list(key), float(v))
    return fam


class Scrape:
    """Collectors rendered as one exposition: prometheus_client's registry (or, with the
    hot store's multiprocess folder, every process's files there), the hot store, and
    families made now (`extra()` -> families)."""

    def __init__(self, registry: pc.CollectorRegistry, hot: HotStore,
                 extra: Callable[[], Iterable] | None = None):
        self.sources: list = [MultiProcessCollector(None, hot.directory) if hot.directory else registry, hot]
        self.extra = extra

    def collect(self):
        for source in self.sources:
            for family in source.collect():
                # No `_created` series: multiprocess mode has none, so one process renders as many do.
                family.samples = [s for s in family.samples if not s.name.endswith("_created")]
                yield family
        if self.extra is not None:
            yield from self.extra()


def exposition(scrape: Scrape) -> bytes:
    """Prometheus text format (0.0.4)."""
    return pc.generate_latest(scrape)
