"""What the replica's API process exports on GET /metrics (wire.metrics: prometheus_client,
and the hot store for the per-token path).

Per request: finished requests by finish reason, errors by code, TTFT, prompt, cached and
generated tokens, engine restarts. Per token: inter-token latency. At scrape time, from
the engine's last `Load`: running and waiting requests, KV-cache use, step time (the recent
mean, and every step's time as a histogram), and on CPU the C++ step's steps and those it
ran on one thread (`cpu_solo_steps_total`: the node's other processes had the cores; such a
step takes up to twice as long).
The secret guards /metrics (replica.api.auth); under `make run` the launcher writes it
to a mode-600 file for scrapers (regions.launch, README "Metrics").
"""

from __future__ import annotations

from collections.abc import Callable

import prometheus_client as pc
from prometheus_client.core import CounterMetricFamily

from wire import protocol as P
from wire.metrics import Counter, Histogram, HotHistogram, HotStore, Scrape, exposition, gauge, histogram

R = "edgechat_replica_"


class ReplicaMetrics:
    """`load()`: the engine's last wire.protocol.Load, or None (starting, restarting)."""

    def __init__(self, load: Callable[[], object]):
        self.load = load
        self.registry = r = pc.CollectorRegistry(auto_describe=True)
        self.hot = HotStore()  # one process: in memory
        self.ttft = Histogram(r, R + "ttft_seconds", "Time to first token, API process view.")
        self.itl = HotHistogram(self.hot, R + "itl_seconds", "Inter-token latency, API process view.")
        self.requests = Counter(r, R + "requests_total", "Finished requests.", ("finish_reason",))
        self.errors = Counter(r, R + "errors_total", "Rejected or failed requests.", ("code",))
        self.prompt_tokens = Counter(r, R + "prompt_tokens_total", "Prompt tokens.")
        self.cached_tokens = Counter(r, R + "prefix_hit_tokens_total", "Prompt tokens served from the prefix cache.")
        self.generation_tokens = Counter(r, R + "generation_tokens_total", "Generated tokens.")
        self.engine_restarts = Counter(r, R + "engine_restarts_total",
                                       "Times the engine process died and was restarted.")

    def _load_families(self) -> list:
        ld = self.load()

        def field(fn) -> float:
            return 0.0 if ld is None else fn(ld)

        return [
            gauge(R + "running", "Sequences running in the engine.", field(lambda x: x.running)),
            gauge(R + "waiting", "Sequences waiting in the engine.", field(lambda x: x.waiting)),
            gauge(R + "kv_usage", "Fraction of KV blocks in use.",
                  field(lambda x: 1 - x.free_blocks / max(1, x.total_blocks))),
            gauge(R + "step_ms", "Recent engine step time (ms).", field(lambda x: x.step_ms)),
            # since the engine process started (a restart starts them again, as counters may)
            CounterMetricFamily(R + "cpu_steps", "Steps of the C++ CPU engine.", value=field(lambda x: x.cpu_steps)),
            CounterMetricFamily(R + "cpu_solo_steps", "Steps of the C++ CPU engine run on one thread: its other "
                                "threads' cores were busy with other processes.",
                                value=field(lambda x: x.cpu_solo_steps)),
            histogram(R + "step_seconds", "Engine step time: every step since the engine process started (what "
                      "a streaming request's tokens wait on, one step each).", P.STEP_BUCKETS_S,
                      ld.step_counts if ld is not None and ld.step_counts else [0] * (len(P.STEP_BUCKETS_S) + 1),
                      field(lambda x: x.step_seconds)),
        ]

    def render(self) -> bytes:
        return exposition(Scrape(self.registry, self.hot, self._load_families))
