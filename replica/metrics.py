"""Prometheus text-format metrics without a client library: counters, gauges and
histograms with fixed buckets. O(log buckets) per observation. No torch."""

from __future__ import annotations

import bisect
from collections.abc import Callable

# Seconds; dense below 100 ms where latency budgets live.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 2.0, 5.0, 10.0, 30.0)


def _labels(d: dict[str, str]) -> str:
    if not d:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in d.items()) + "}"


class Counter:
    def __init__(self, name: str, help: str, label: str | None = None):
        self.name, self.help, self.label = name, help, label
        self.values: dict[str, float] = {}

    def inc(self, label_value: str = "", value: float = 1.0) -> None:
        self.values[label_value] = self.values.get(label_value, 0.0) + value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for lv, v in sorted(self.values.items()) or [("", 0.0)]:
            lines.append(f"{self.name}{_labels({self.label: lv} if self.label else {})} {v:g}")
        return lines


class Gauge:
    def __init__(self, name: str, help: str, fn: Callable[[], float]):
        self.name, self.help, self.fn = name, help, fn

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge", f"{self.name} {self.fn():g}"]


class Histogram:
    def __init__(self, name: str, help: str, buckets=LATENCY_BUCKETS):
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
        lines.append(f"{self.name}_sum {self.sum:g}")
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
        self.requests = self.add(Counter("edgechat_replica_requests_total", "Finished requests.", "finish_reason"))
        self.errors = self.add(Counter("edgechat_replica_errors_total", "Rejected or failed requests.", "code"))
        self.prompt_tokens = self.add(Counter("edgechat_replica_prompt_tokens_total", "Prompt tokens."))
        self.cached_tokens = self.add(Counter("edgechat_replica_prefix_hit_tokens_total",
                                              "Prompt tokens served from the prefix cache."))
        self.generation_tokens = self.add(Counter("edgechat_replica_generation_tokens_total", "Generated tokens."))

        def field(name, fn=None):
            def get():
                ld = load()
                return 0.0 if ld is None else (fn(ld) if fn else getattr(ld, name))
            return get

        self.add(Gauge("edgechat_replica_running", "Sequences running in the engine.", field("running")))
        self.add(Gauge("edgechat_replica_waiting", "Sequences waiting in the engine.", field("waiting")))
        self.add(Gauge("edgechat_replica_kv_usage", "Fraction of KV blocks in use.",
                       field("", lambda ld: 1 - ld.free_blocks / max(1, ld.total_blocks))))
        self.add(Gauge("edgechat_replica_step_ms", "Recent engine step time (ms).", field("step_ms")))
