"""python -m edge_proxy --replica ws://127.0.0.1:9001/v1/replica --replica ws://... --port 8000
python -m edge_proxy --replicas-dns edgechat-replica:8000 --host 0.0.0.0     (Kubernetes headless Service)

Secrets come from the environment, never the command line:
  EDGECHAT_API_KEYS       key=tenant[:tier[:rate_per_s[:burst[:max_inflight]]]],...   (or --api-keys FILE);
                          the limits are the region's (--region-proxies / --proxies-dns, x --workers)
  EDGECHAT_REPLICA_SECRET shared secret for the replicas' /v1/replica endpoint
  EDGECHAT_PEER_KEY       API key this proxy presents to --peer proxies that require keys; a key of tier
                          "peer" there, so forwarded requests keep their tenant (cache salt)
Tracing: OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) sends spans to that OTLP/HTTP
collector; the other OTEL_* variables (headers, OTEL_RESOURCE_ATTRIBUTES, OTEL_BSP_*) apply as usual.
"""

from __future__ import annotations

import argparse
import os
import sys

from edge_proxy.admission import AdmissionConfig
from edge_proxy.config import ProxyConfig
from edge_proxy.connections import ConnectionLimits
from edge_proxy.limits import Limits
from edge_proxy.discovery import DiscoveryConfig
from edge_proxy.pool import PoolConfig
from edge_proxy.peering import parse_peer
from edge_proxy.routing import MODES, RouterConfig
from edge_proxy.server import serve_workers

SECRET_ENV = "EDGECHAT_REPLICA_SECRET"
PEER_KEY_ENV = "EDGECHAT_PEER_KEY"
OTLP_TRACES_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"


def _peer(spec: str):
    try:
        return parse_peer(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_args(argv: list[str] | None = None) -> ProxyConfig:
    p = argparse.ArgumentParser(prog="python -m edge_proxy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="replica WebSocket URL (repeat for each replica)")
    p.add_argument("--replicas-dns", default="", metavar="NAME[:PORT]",
                   help="find replicas live by DNS: a headless Service's A/AAAA records (port 8000 unless given) "
                        "or SRV records (_port._proto.NAME); added and removed while serving")
    p.add_argument("--dns-interval", type=float, default=2.0, metavar="S", help="--replicas-dns refresh period")
    p.add_argument("--dns-server", default="", metavar="IP[:PORT]",
                   help="DNS server for --replicas-dns (default: the system's /etc/resolv.conf)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--workers", type=int, default=1, help="processes sharing the port (SO_REUSEPORT)")
    p.add_argument("--region", default="local")
    p.add_argument("--region-proxies", type=int, default=1, metavar="N",
                   help="proxy pods (or hosts) of this region, each of --workers processes: every key's rate, "
                        "burst and in-flight cap are the region's, and each process enforces its share")
    p.add_argument("--proxies-dns", default="", metavar="NAME",
                   help="count the region's proxy pods live from their headless Service's records instead "
                        "(refreshed every --dns-interval; the last count stays through a DNS outage)")
    p.add_argument("--tokenizer", default="default", help='tokenizer spec ("default": the default model; '
                                                          '"bytes": the stub\'s byte tokenizer)')
    p.add_argument("--api-keys", default="", metavar="FILE", help="JSON list of {key, tenant, tier, rate_per_s, burst}")
    p.add_argument("--allow-anonymous", action="store_true", help="accept requests without an API key (development)")
    p.add_argument("--allowed-origin", action="append", default=[], metavar="ORIGIN",
                   help='browser Origin (scheme://host[:port]) allowed on the WebSocket and by CORS on the HTTP API, '
                        'besides the proxy\'s own page (repeat; "*" for any)')
    p.add_argument("--ssl-certfile", default="", metavar="PEM", help="serve HTTPS and wss:// with this certificate")
    p.add_argument("--ssl-keyfile", default="", metavar="PEM", help="the certificate's private key")
    p.add_argument("--replica-ca", default="", metavar="PEM",
                   help="CA bundle to verify wss:// replicas with (default: the system's CAs)")
    p.add_argument("--max-frame-bytes", type=int, default=1 << 20)
    p.add_argument("--max-prompt-tokens", type=int, default=0)
    p.add_argument("--failover-attempts", type=int, default=3)
    p.add_argument("--drain-timeout", type=float, default=60.0, metavar="S")
    p.add_argument("--handoff-budget", type=float, default=4.0, metavar="S",
                   help="a draining replica's streams move with their KV within this long from its drain seen; "
                        "a pull still running then is given up and its stream resumed by recompute (keep it well "
                        "inside the replica's drain bound and the pod's grace period)")
    p.add_argument("--handoff-hot-blocks", type=int, default=128, metavar="N",
                   help="besides its streams, a draining replica's most recently used cached conversations, up to "
                        "N blocks, are pulled by the replicas their next turns will go to (0: none)")
    p.add_argument("--disagg-min-blocks", type=int, default=4, metavar="N",
                   help="with prefill-role replicas ready, a new prompt whose decode replica lacks at least N full "
                        "blocks of it is prefilled on one of them and its KV pulled (edge_proxy/disagg.py); fewer: "
                        "computed where it streams")
    p.add_argument("--stall-timeout", type=float, default=2.0, metavar="S",
                   help="lose a replica after this long without any frame")
    p.add_argument("--ping-interval", type=float, default=1.0, metavar="S")
    p.add_argument("--healthz-interval", type=float, default=2.0, metavar="S", help="0 disables /healthz polling")
    p.add_argument("--max-inflight", type=int, default=10_000)
    p.add_argument("--max-prompt-bytes", type=int, default=Limits.max_prompt_bytes,
                   help="UTF-8 bytes of a prompt (or of all messages), refused before tokenizing")
    p.add_argument("--max-connections", type=int, default=ConnectionLimits.max_connections,
                   help="client connections per worker (lowered to the file limit minus a reserve)")
    p.add_argument("--max-connections-per-address", type=int, default=ConnectionLimits.max_per_address)
    p.add_argument("--header-timeout", type=float, default=ConnectionLimits.header_timeout_s, metavar="S",
                   help="a request's headers must arrive within this long")
    p.add_argument("--routing", default="auto", choices=MODES,
                   help="replica choice: auto (session -> prefix -> load), or a reduction for comparisons")
    p.add_argument("--peer", action="append", default=[], type=_peer, metavar="REGION=URL@RTT_MS",
                   help="another region's proxy (ws://host:port/v1/stream) to forward to when no replica here "
                        "is ready; repeat for each region (nearest first by RTT)")
    p.add_argument("--otel-console", action="store_true", help="print finished spans to stdout")
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    discovery = DiscoveryConfig.parse(a.replicas_dns, a.dns_interval, a.dns_server) if a.replicas_dns else None
    census = DiscoveryConfig.parse(a.proxies_dns, a.dns_interval, a.dns_server) if a.proxies_dns else None
    return ProxyConfig(
        replicas=a.replica, discovery=discovery, region_proxies=a.region_proxies, proxies_dns=census, host=a.host, port=a.port, workers=a.workers, region=a.region, tokenizer=a.tokenizer,
        api_keys_file=a.api_keys, allow_anonymous=a.allow_anonymous, allowed_origins=tuple(a.allowed_origin),
        ssl_certfile=a.ssl_certfile, ssl_keyfile=a.ssl_keyfile,
        max_frame_bytes=a.max_frame_bytes, max_prompt_tokens=a.max_prompt_tokens,
        failover_attempts=a.failover_attempts, drain_timeout_s=a.drain_timeout,
        handoff_budget_s=a.handoff_budget, handoff_hot_blocks=a.handoff_hot_blocks, disagg_min_blocks=a.disagg_min_blocks, otel_console=a.otel_console,
        otel_otlp=bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(OTLP_TRACES_ENV)),
        log_level=a.log_level, peers=tuple(sorted(a.peer, key=lambda q: (q.rtt_ms, q.region))),
        peer_key=os.environ.get(PEER_KEY_ENV, ""),
        pool=PoolConfig(secret=os.environ.get(SECRET_ENV, ""), ca_file=a.replica_ca, stall_timeout_s=a.stall_timeout,
                        ping_interval_s=a.ping_interval, healthz_interval_s=a.healthz_interval),
        router=RouterConfig(mode=a.routing), admission=AdmissionConfig(max_inflight=a.max_inflight),
        limits=Limits(max_prompt_bytes=a.max_prompt_bytes),
        connections=ConnectionLimits(max_connections=a.max_connections, max_per_address=a.max_connections_per_address,
                                     header_timeout_s=a.header_timeout))


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_args(argv)
    except ValueError as e:
        print(f"edge_proxy: {e}", file=sys.stderr)
        return 2
    try:
        return serve_workers(cfg)
    except ValueError as e:  # bad key file, no keys, bad replica URL
        print(f"edge_proxy: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
