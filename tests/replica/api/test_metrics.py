"""replica/api/metrics.py: what /metrics says from the engine's last Load."""

from __future__ import annotations

from wire import protocol as P
from replica.api.metrics import ReplicaMetrics
from tests.prom import samples as values


def test_the_cpu_pools_step_counts_are_counters_from_the_load():
    """The C++ step's steps and its solo ones (its helpers' cores busy elsewhere) are counters, typed as such,
    read from the last Load; before the engine's first Load they read 0."""
    load = None
    metrics = ReplicaMetrics(lambda: load)
    m = values(metrics.render().decode())
    assert m["edgechat_replica_cpu_steps_total"] == m["edgechat_replica_cpu_solo_steps_total"] == 0.0
    load = P.Load(running=2, waiting=0, free_blocks=3, total_blocks=4, step_ms=30.0, cpu_steps=120, cpu_solo_steps=7)
    text = metrics.render().decode()
    m = values(text)
    assert m["edgechat_replica_cpu_steps_total"] == 120.0 and m["edgechat_replica_cpu_solo_steps_total"] == 7.0
    assert "# TYPE edgechat_replica_cpu_solo_steps_total counter" in text
    assert m["edgechat_replica_kv_usage"] == 0.25 and m["edgechat_replica_running"] == 2.0


def test_the_step_times_are_a_histogram_of_the_loads_counts():
    """edgechat_replica_step_seconds: Load.step_counts per STEP_BUCKETS_S bound (not cumulative, the last over the
    largest) become cumulative buckets, le inclusive, with the count and the sum; zeros before the first Load."""
    load = None
    metrics = ReplicaMetrics(lambda: load)
    text = metrics.render().decode()
    assert 'edgechat_replica_step_seconds_bucket{le="+Inf"} 0.0' in text
    counts = [0] * (len(P.STEP_BUCKETS_S) + 1)
    counts[1], counts[5], counts[-1] = 3, 2, 1  # 3 steps <= 10 ms, 2 <= 50 ms, 1 over 1 s
    load = P.Load(running=1, waiting=0, free_blocks=4, total_blocks=4, step_counts=counts, step_seconds=1.25)
    text = metrics.render().decode()
    assert P.STEP_BUCKETS_S[1] == 0.01 and P.STEP_BUCKETS_S[5] == 0.05
    for le, n in (("0.005", 0), ("0.01", 3), ("0.04", 3), ("0.05", 5), ("1.0", 5), ("+Inf", 6)):
        assert f'edgechat_replica_step_seconds_bucket{{le="{le}"}} {float(n)}' in text, le
    m = values(text)
    assert m["edgechat_replica_step_seconds_count"] == 6.0 and m["edgechat_replica_step_seconds_sum"] == 1.25
