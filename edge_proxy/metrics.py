"""The proxy's metrics, from wire/metrics.py's torch-free classes.

Small on purpose: an observation on the per-token path is one `bisect` and three
increments. Each worker process has its own registry; scrape every worker (or
run one) for whole-proxy figures.
"""

from __future__ import annotations

from wire.metrics import Counter, Gauge, Histogram, Registry

# Seconds; dense below 10 ms where inter-token latencies live.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)


class ProxyMetrics(Registry):
    """Every metric the proxy exports, created once per process."""

    def __init__(self):
        super().__init__()
        p, add = "edgechat_proxy_", self.add
        self.requests = add(Counter(p + "requests_total", "Requests by outcome.", ("outcome",)))
        self.rejected = add(Counter(p + "rejected_total", "Requests refused before routing, by error code.",
                                    ("code",)))
        self.routing = add(Counter(p + "routing_decisions_total", "Routing decisions by reason.", ("reason",)))
        self.prefix_blocks_hit = add(Counter(p + "prefix_blocks_hit_total",
                                             "Prompt blocks routed to a replica believed to hold them."))
        self.prefix_blocks = add(Counter(p + "prefix_blocks_total", "Full prompt blocks routed."))
        self.cached_tokens = add(Counter(p + "cached_tokens_total",
                                         "Prompt tokens the replicas reported served from cache."))
        self.retokenized = add(Counter(p + "retokenized_replies_total",
                                       "Chat replies the template re-renders into other ids than the replica "
                                       "generated: the next turn's cache match ends where they part."))
        self.failovers = add(Counter(p + "failovers_total", "Streams resumed on another replica, by cause.",
                                     ("cause",)))
        self.tokens = add(Counter(p + "tokens_relayed_total", "Generated tokens relayed to clients."))
        self.coalesced = add(Counter(p + "coalesced_frames_total",
                                     "Client frames that merged several replica messages (slow clients)."))
        self.ttft = add(Histogram(p + "ttft_seconds", "Proxy arrival to first token handed to the client.",
                                  LATENCY_BUCKETS))
        self.itl = add(Histogram(p + "itl_seconds",
                                 "Time between consecutive token messages of a stream, at the proxy.",
                                 LATENCY_BUCKETS))
        self.inflight = add(Gauge(p + "inflight", "Requests in flight."))
        self.replicas_ready = add(Gauge(p + "replicas_ready", "Replicas connected and healthy."))
        self.compute_groups = add(Gauge(p + "compute_groups",
                                        "Compute groups among the ready replicas: replicas sharing a GPU or one "
                                        "machine's cores are one (the routing valve weighs groups)."))
        self.dns_refreshes = add(Counter(p + "dns_refreshes_total",
                                         "Replica discovery refreshes (--replicas-dns) by outcome: ok, outage.",
                                         ("outcome",)))
        self.replica_load = add(Gauge(p + "replica_load", "Effective outstanding requests per replica.",
                                      ("replica",)))
