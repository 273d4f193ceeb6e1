"""replica/api/metrics.py: what /metrics says from the engine's last Load."""

from __future__ import annotations

from wire import protocol as P
from replica.api.metrics import ReplicaMetrics
from tests.replica.server import metric_values as values


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
