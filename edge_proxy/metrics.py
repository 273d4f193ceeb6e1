"""The proxy's metrics: what an operator's dashboard needs (deploy/grafana/edgechat.json).

Per request, prometheus_client (wire.metrics.Counter/Histogram/Gauge): requests by outcome,
refusals by code, routing decisions, TTFT, end-to-end latency, prompt and cached tokens,
failovers, requests in flight. Per token, the hot store (wire.metrics.HotStore: additions
into an array of doubles, 0.3 µs a token where prometheus_client's calls cost 1.1 µs, 3.2-3.8 µs
across worker processes; bench/metrics.py): inter-token latency, generated tokens, coalesced frames. At scrape time,
from this worker's replica pool: replicas ready, compute groups, and per replica its load,
running and waiting requests, KV-cache use and step time (the replica's own `Load` reports;
every worker holds the same replicas' reports).

Workers (`--workers N`): `edge_proxy.server` gives them one multiprocess folder
(`PROMETHEUS_MULTIPROC_DIR`), so one scrape of any worker answers for the whole proxy:
prometheus_client sums the per-request files, the hot store sums the per-token files,
and in-flight requests are each live worker's added up.
"""

from __future__ import annotations

import prometheus_client as pc

from wire.metrics import Counter, Gauge, Histogram, HotCounter, HotHistogram, HotStore, Scrape, exposition, gauge, \
    multiprocess_dir

# Seconds; dense below 10 ms where inter-token latencies live.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)
# Seconds; a request's whole life, up to minutes of generation.
E2E_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
P = "edgechat_proxy_"


class ProxyMetrics:
    """Every metric the proxy exports, created once per worker process."""

    def __init__(self):
        self.registry = r = pc.CollectorRegistry(auto_describe=True)
        self.hot = hot = HotStore(directory=multiprocess_dir())
        self.requests = Counter(r, P + "requests_total", "Requests by outcome: a finish reason (stop, length, "
                                "tool_calls, abort), error, or disconnect (the client went away).", ("outcome",))
        self.rejected = Counter(r, P + "rejected_total", "Requests refused before routing, by error code.", ("code",))
        self.routing = Counter(r, P + "routing_decisions_total", "Routing decisions by reason.", ("reason",))
        self.prefix_blocks_hit = Counter(r, P + "prefix_blocks_hit_total",
                                         "Prompt blocks routed to a replica believed to hold them.")
        self.prefix_blocks = Counter(r, P + "prefix_blocks_total", "Full prompt blocks routed.")
        self.prompt_tokens = Counter(r, P + "prompt_tokens_total", "Prompt tokens of the requests routed to replicas.")
        self.cached_tokens = Counter(r, P + "cached_tokens_total",
                                     "Prompt tokens the replicas reported served from their prefix cache.")
        self.retokenized = Counter(r, P + "retokenized_replies_total",
                                   "Chat replies the template re-renders into other ids than the replica "
                                   "generated: the next turn's cache match ends where they part.")
        self.failovers = Counter(r, P + "failovers_total", "Streams resumed on another replica, by cause.",
                                 ("cause",))
        self.handoff_tokens = Counter(r, P + "handoff_tokens_total",
                                      "Tokens (prompt and generated) of the streams a drain moved, when they moved: "
                                      "beside the successors' cached tokens, what the hand-off left to recompute.")
        self.handoff_hot_blocks = Counter(r, P + "handoff_hot_blocks_total",
                                          "Blocks of draining replicas' hot chains (cached conversations no stream "
                                          "held) that successors pulled (edge_proxy.handoff).")
        self.disagg = Counter(r, P + "disagg_total", "Cold prompts of decode replicas prefilled on a prefill "
                              "replica (edge_proxy.disagg), by outcome: pulled (every usable block), fallback "
                              "(computed on the decode replica, all or in part).", ("outcome",))
        self.disagg_blocks = Counter(r, P + "disagg_blocks_total",
                                     "Prompt blocks decode replicas pulled from prefill replicas (times "
                                     "KvSpec.block_bytes: the KV moved).")
        self.dns_refreshes = Counter(r, P + "dns_refreshes_total",
                                     "Replica discovery refreshes (--replicas-dns) by outcome: ok, outage.",
                                     ("outcome",))
        self.ttft = Histogram(r, P + "ttft_seconds", "Proxy arrival to first token handed to the client.",
                              LATENCY_BUCKETS)
        self.e2e = Histogram(r, P + "e2e_seconds", "Proxy arrival to the request's end (done), for requests that "
                             "finished (any finish reason, abort included).", E2E_BUCKETS)
        self.inflight = Gauge(r, P + "inflight", "Requests in flight (all workers).")
        # The per-token path.
        self.itl = HotHistogram(hot, P + "itl_seconds", "Time between consecutive token messages of a stream, "
                                "at the proxy.", LATENCY_BUCKETS)
        self.generation_tokens = HotCounter(hot, P + "generation_tokens_total", "Generated tokens relayed to clients.")
        self.coalesced = HotCounter(hot, P + "coalesced_frames_total",
                                    "Client frames that merged several replica messages (slow clients).")

    def render(self, conns=()) -> bytes:
        """The exposition, with the replica gauges of `conns` (this worker's pool.ReplicaConn's)."""
        return exposition(Scrape(self.registry, self.hot, lambda: pool_families(conns)))


def pool_families(conns) -> list:
    """Scrape-time gauges from a replica pool: what it knows of each replica."""
    ready = [c for c in conns if c.ready]
    loads = {c.id: c.load for c in conns if c.load is not None}

    def per(fn) -> dict:
        return {(rid,): fn(ld) for rid, ld in loads.items()}

    return [
        gauge(P + "replicas_ready", "Replicas connected and healthy.", len(ready)),
        gauge(P + "compute_groups", "Compute groups among the ready replicas: replicas sharing a GPU or one "
              "machine's cores are one (the routing valve weighs groups).", len({c.group or c.id for c in ready})),
        gauge(P + "replica_ready", "1 while the replica is connected and healthy.",
              {(c.id,): float(c.ready) for c in conns}, ("replica",)),
        gauge(P + "replica_load", "Effective outstanding requests per replica (its Load and this worker's "
              "requests since).", {(c.id,): c.effective_load() for c in conns}, ("replica",)),
        gauge(P + "replica_running", "Requests running in the replica's engine (its last Load).",
              per(lambda ld: ld.running), ("replica",)),
        gauge(P + "replica_waiting", "Requests queued in the replica's engine (its last Load).",
              per(lambda ld: ld.waiting), ("replica",)),
        gauge(P + "replica_waiting_tokens", "Prompt tokens still to prefill in the replica (its last Load).",
              per(lambda ld: ld.waiting_tokens), ("replica",)),
        gauge(P + "replica_kv_usage", "Fraction of the replica's KV-cache blocks in use (its last Load).",
              per(lambda ld: 1 - ld.free_blocks / max(1, ld.total_blocks)), ("replica",)),
        gauge(P + "replica_step_seconds", "The replica's recent engine step time (its last Load).",
              per(lambda ld: ld.step_ms / 1e3), ("replica",)),
    ]
