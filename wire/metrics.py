"""Prometheus text-format metrics (exposition 0.0.4) without a client library:
labelled counters and gauges, histograms with fixed buckets, a registry. No
torch: the edge proxy builds its metrics from the same classes
(edge_proxy/metrics.py). Each process has its own registry."""

from __future__ import annotations

import bisect
from collections.abc import Callable

# Seconds; dense below 100 ms where latency budgets live.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 2.0, 5.0, 10.0, 30.0)


def _labels(names: tuple[str, ...], values: tuple) -> str:
    if not names:
        return ""

    def esc(v) -> str:
        return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{n}="{esc(v)}"' for n, v in zip(names, values)) + "}"


class Counter:
    """A counter, optionally labelled: `inc(*label_values, by=1)`."""

    kind = "counter"

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()):
        self.name, self.help, self.label_names = name, help, tuple(labels)
        self.values: dict[tuple, float] = {} if labels else {(): 0.0}

    def inc(self, *labels, by: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + by

    def get(self, *labels) -> float:
        return self.values.get(labels, 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        for k, v in sorted(self.values.items()):
            lines.append(f"{self.name}{_labels(self.label_names, k)} {v:g}")
        return lines


class Gauge(Counter):
    """A gauge: `set(value, *label_values)`, or read from `fn()` at every scrape."""

    kind = "gauge"

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = (), fn: Callable[[], float] | None = None):
        super().__init__(name, help, labels)
        self.fn = fn

    def set(self, value: float, *labels) -> None:
        self.values[labels] = value

    def render(self) -> list[str]:
        if self.fn is not None:
            self.values[()] = float(self.fn())
        return super().render()


class Histogram:
    """Fixed buckets; an observation is one bisect and three increments."""

    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.help = name, help
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def quantile(self, q: float) -> float:
        """Upper bucket bound holding the q-quantile (coarse; for reports)."""
        target, acc = q * self.count, 0
        for bound, c in zip(self.buckets + (float("inf"),), self.counts):
            acc += c
            if acc >= target and self.count:
                return bound
        return 0.0

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        acc = 0
        for bound, c in zip(self.buckets, self.counts):
            acc += c
            lines.append(f'{self.name}_bucket{{le="{bound:g}"}} {acc}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {self.sum:.6f}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


class Registry:
    def __init__(self):
        self.metrics: list = []

    def add(self, metric):
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        return "\n".join(line for m in self.metrics for line in m.render()) + "\n"


class ReplicaMetrics(Registry):
    """What the replica's API process exports on GET /metrics."""

    def __init__(self, load: Callable[[], object]):
        super().__init__()
        self.ttft = self.add(Histogram("edgechat_replica_ttft_seconds", "Time to first token, API process view."))
        self.itl = self.add(Histogram("edgechat_replica_itl_seconds", "Inter-token latency, API process view."))
        self.requests = self.add(Counter("edgechat_replica_requests_total", "Finished requests.", ("finish_reason",)))
        self.errors = self.add(Counter("edgechat_replica_errors_total", "Rejected or failed requests.", ("code",)))
        self.prompt_tokens = self.add(Counter("edgechat_replica_prompt_tokens_total", "Prompt tokens."))
        self.cached_tokens = self.add(Counter("edgechat_replica_prefix_hit_tokens_total",
                                              "Prompt tokens served from the prefix cache."))
        self.generation_tokens = self.add(Counter("edgechat_replica_generation_tokens_total", "Generated tokens."))
        self.engine_restarts = self.add(Counter("edgechat_replica_engine_restarts_total",
                                                "Times the engine process died and was restarted."))

        def field(name, fn=None):
            def get():
                ld = load()
                return 0.0 if ld is None else (fn(ld) if fn else getattr(ld, name))
            return get

        self.add(Gauge("edgechat_replica_running", "Sequences running in the engine.", fn=field("running")))
        self.add(Gauge("edgechat_replica_waiting", "Sequences waiting in the engine.", fn=field("waiting")))
        self.add(Gauge("edgechat_replica_kv_usage", "Fraction of KV blocks in use.",
                       fn=field("", lambda ld: 1 - ld.free_blocks / max(1, ld.total_blocks))))
        self.add(Gauge("edgechat_replica_step_ms", "Recent engine step time (ms).", fn=field("step_ms")))
