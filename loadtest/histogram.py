"""An HDR-style latency histogram: log-linear buckets with a fixed relative error.

Values are recorded as integer microseconds. Below 2 * 2**SUB_BITS every value
has its own bucket; above, each power-of-two range is split into 2**SUB_BITS
equal buckets, so a value is known to within 1 / 2**SUB_BITS (0.1 %, three
significant digits) at any magnitude, from 1 us to hours, in a few KiB.

    index(v) = v                                   for v < 2S      (S = 2**SUB_BITS)
             = (e + 1) * S + (v >> e) - S          e = bit_length(v) - SUB_BITS - 1

Counts are kept sparse (a dict), so merging histograms and writing them as JSON is
cheap. Percentiles report the midpoint of the bucket holding that rank; min, max
and mean are exact.
"""

from __future__ import annotations

import math

SUB_BITS = 10
S = 1 << SUB_BITS


def bucket(v: int) -> int:
    if v < 2 * S:
        return v
    e = v.bit_length() - SUB_BITS - 1
    return (e + 1) * S + (v >> e) - S


def bucket_range(i: int) -> tuple[int, int]:
    """Lowest and highest value of bucket `i`."""
    if i < 2 * S:
        return i, i
    e = i // S - 1
    m = i % S + S
    return m << e, ((m + 1) << e) - 1


class Histogram:
    __slots__ = ("counts", "n", "total", "lo", "hi")

    def __init__(self):
        self.counts: dict[int, int] = {}
        self.n = 0
        self.total = 0  # sum of recorded microseconds
        self.lo = math.inf
        self.hi = 0

    def record_ms(self, ms: float) -> None:
        self.record_us(max(int(round(ms * 1000.0)), 0))

    def record_us(self, us: int) -> None:
        i = bucket(us)
        self.counts[i] = self.counts.get(i, 0) + 1
        self.n += 1
        self.total += us
        if us < self.lo:
            self.lo = us
        if us > self.hi:
            self.hi = us

    def merge(self, other: Histogram) -> Histogram:
        for i, c in other.counts.items():
            self.counts[i] = self.counts.get(i, 0) + c
        self.n += other.n
        self.total += other.total
        self.lo = min(self.lo, other.lo)
        self.hi = max(self.hi, other.hi)
        return self

    def percentile_ms(self, q: float) -> float:
        """Value at percentile `q` (0..100) in ms; NaN when empty."""
        if self.n == 0:
            return math.nan
        if q >= 100:
            return self.hi / 1000.0
        rank = max(1, math.ceil(q / 100.0 * self.n))
        seen = 0
        for i in sorted(self.counts):
            seen += self.counts[i]
            if seen >= rank:
                lo, hi = bucket_range(i)
                return min(max((lo + hi) / 2.0, self.lo), self.hi) / 1000.0
        return self.hi / 1000.0

    def mean_ms(self) -> float:
        return self.total / self.n / 1000.0 if self.n else math.nan

    def cdf_ms(self) -> tuple[list[float], list[float]]:
        """(bucket midpoints in ms, cumulative fraction) for plotting."""
        xs, ys, seen = [], [], 0
        for i in sorted(self.counts):
            seen += self.counts[i]
            lo, hi = bucket_range(i)
            xs.append((lo + hi) / 2000.0)
            ys.append(seen / self.n)
        return xs, ys

    def summary(self) -> dict:
        def r(x: float) -> float | None:
            return None if math.isnan(x) else round(x, 3)

        return {"n": self.n, "mean": r(self.mean_ms()), "min": r(self.lo / 1000.0 if self.n else math.nan),
                "p50": r(self.percentile_ms(50)), "p90": r(self.percentile_ms(90)),
                "p99": r(self.percentile_ms(99)), "p99.9": r(self.percentile_ms(99.9)),
                "max": r(self.hi / 1000.0 if self.n else math.nan)}

    @classmethod
    def from_json(cls, d: dict) -> Histogram:
        """Rebuild from `to_json` (bucket midpoints stand in for the exact sum, min and max)."""
        assert d.get("sub_bits", SUB_BITS) == SUB_BITS, "histogram written with another precision"
        h = cls()
        for k, c in d["counts"].items():
            i = int(k)
            lo, hi = bucket_range(i)
            h.counts[i] = c
            h.n += c
            h.total += c * (lo + hi) // 2
            h.lo = min(h.lo, lo)
            h.hi = max(h.hi, hi)
        return h

    def to_json(self) -> dict:
        """Sparse counts (bucket index -> count), enough to rebuild or merge the histogram."""
        return {"sub_bits": SUB_BITS, "unit": "us", "counts": {str(i): c for i, c in sorted(self.counts.items())}}
