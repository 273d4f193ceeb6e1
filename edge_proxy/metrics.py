"""Counters, gauges and histograms rendered as Prometheus text (exposition 0.0.4).

Small on purpose: an observation on the per-token path is one `bisect` and two
increments. Each worker process has its own registry; scrape every worker (or
run one) for whole-proxy figures.
"""

from __future__ import annotations

from bisect import bisect_left

# Seconds; dense below 10 ms where inter-token latencies live.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)


def _labels(names: tuple[str, ...], values: tuple) -> str:
    if not names:
        return ""
    inner = ",".join(f'{n}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                     for n, v in zip(names, values))
    return "{" + inner + "}"


class Counter:
    kind = "counter"

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()):
        self.name, self.help, self.label_names = name, help, labels
        self.values: dict[tuple, float] = {} if labels else {(): 0.0}

    def inc(self, *labels, by: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + by

    def get(self, *labels) -> float:
        return self.values.get(labels, 0.0)

    def render(self) -> list[str]:
        return [f"{self.name}{_labels(self.label_names, k)} {v:g}" for k, v in self.values.items()]


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, *labels) -> None:
        self.values[labels] = value


class Histogram:
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.help = name, help
        self.bounds = buckets
        self.counts = [0] * (len(buckets) + 1)  # last slot: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.count += 1

    def render(self) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.bounds, self.counts):
            acc += c
            out.append(f'{self.name}_bucket{{le="{b:g}"}} {acc}')
        out.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{self.name}_sum {self.sum:.6f}")
        out.append(f"{self.name}_count {self.count}")
        return out


class ProxyMetrics:
    """Every metric the proxy exports, created once per process."""

    def __init__(self):
        p = "edgechat_proxy_"
        self.requests = Counter(p + "requests_total", "Requests by outcome.", ("outcome",))
        self.rejected = Counter(p + "rejected_total", "Requests refused before routing, by error code.", ("code",))
        self.routing = Counter(p + "routing_decisions_total", "Routing decisions by reason.", ("reason",))
        self.prefix_blocks_hit = Counter(p + "prefix_blocks_hit_total", "Prompt blocks routed to a replica believed to hold them.")
        self.prefix_blocks = Counter(p + "prefix_blocks_total", "Full prompt blocks routed.")
        self.cached_tokens = Counter(p + "cached_tokens_total", "Prompt tokens the replicas reported served from cache.")
        self.failovers = Counter(p + "failovers_total", "Streams resumed on another replica, by cause.", ("cause",))
        self.tokens = Counter(p + "tokens_relayed_total", "Generated tokens relayed to clients.")
        self.coalesced = Counter(p + "coalesced_frames_total", "Client frames that merged several replica messages (slow clients).")
        self.ttft = Histogram(p + "ttft_seconds", "Proxy arrival to first token handed to the client.")
        self.itl = Histogram(p + "itl_seconds", "Time between consecutive token messages of a stream, at the proxy.")
        self.inflight = Gauge(p + "inflight", "Requests in flight.")
        self.replicas_ready = Gauge(p + "replicas_ready", "Replicas connected and healthy.")
        self.replica_load = Gauge(p + "replica_load", "Effective outstanding requests per replica.", ("replica",))

    def all(self):
        return [v for v in vars(self).values() if hasattr(v, "render")]

    def render(self) -> str:
        lines = []
        for m in self.all():
            lines.append(f"# HELP {m.name} {m.help}")
            lines.append(f"# TYPE {m.name} {m.kind}")
            lines.extend(m.render())
        return "\n".join(lines) + "\n"
