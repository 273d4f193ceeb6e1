"""The HDR-style histogram: bucket math, percentiles within its precision, merge, JSON."""

import math
import random

from loadtest.histogram import SUB_BITS, Histogram, bucket, bucket_range


def test_buckets_are_contiguous_and_tight():
    prev_hi = -1
    for i in range(0, 40 * (1 << SUB_BITS)):
        lo, hi = bucket_range(i)
        assert lo == prev_hi + 1 and bucket(lo) == i and bucket(hi) == i
        assert (hi - lo) <= max(1, lo >> SUB_BITS)  # relative width <= 2**-SUB_BITS
        prev_hi = hi


def test_percentiles_match_exact_within_precision():
    rng = random.Random(7)
    xs = [rng.lognormvariate(3, 1.2) for _ in range(20000)]  # ms, long tail
    h = Histogram()
    for x in xs:
        h.record_ms(x)
    xs.sort()
    for q in (50, 90, 99, 99.9):
        exact = xs[max(0, math.ceil(q / 100 * len(xs)) - 1)]
        assert abs(h.percentile_ms(q) - exact) <= exact * 2 ** -SUB_BITS + 0.001, q
    assert h.percentile_ms(100) == round(xs[-1] * 1000) / 1000
    assert abs(h.mean_ms() - sum(xs) / len(xs)) < 0.001
    s = h.summary()
    assert s["n"] == 20000 and s["p50"] <= s["p90"] <= s["p99"] <= s["p99.9"] <= s["max"]


def test_empty_merge_and_json_roundtrip():
    h = Histogram()
    assert math.isnan(h.percentile_ms(50)) and h.summary()["p99"] is None
    a, b = Histogram(), Histogram()
    for v in range(1, 1001):
        (a if v % 2 else b).record_ms(v)
    a.merge(b)
    assert a.n == 1000 and abs(a.percentile_ms(50) - 500) <= 0.5
    c = Histogram.from_json(a.to_json())
    assert c.n == a.n and c.counts == a.counts
    assert abs(c.percentile_ms(99) - a.percentile_ms(99)) <= a.percentile_ms(99) * 2 ** -SUB_BITS
