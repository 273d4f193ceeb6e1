"""The proxy's one config, built once at the process edge (CLI or tests) and passed down.

Policy knobs live in the small configs of the pure modules (`RouterConfig`,
`AdmissionConfig`, `PoolConfig`); this holds them plus the serving limits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edge_proxy.admission import AdmissionConfig
from edge_proxy.connections import ConnectionLimits
from edge_proxy.limits import Limits
from edge_proxy.discovery import DiscoveryConfig
from edge_proxy.peering import Peer
from edge_proxy.pool import PoolConfig
from edge_proxy.routing import RouterConfig


@dataclass
class ProxyConfig:
    replicas: list[str]  # static replica URLs (--replica)
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1  # >1: that many processes share the port (SO_REUSEPORT)
    region: str = "local"
    tokenizer: str = "default"  # prompt.load_tokenizer spec; "bytes" for the stub
    api_keys_file: str = ""
    api_keys_env: str = ""  # value of EDGECHAT_API_KEYS
    allow_anonymous: bool = False
    allowed_origins: tuple[str, ...] = ()  # browser Origins besides the proxy's own (WebSocket, CORS); "*": any
    ssl_certfile: str = ""  # TLS: serve https:// and wss:// with this certificate chain (PEM) ...
    ssl_keyfile: str = ""  # ... and its private key
    max_frame_bytes: int = 1 << 20  # client WebSocket message / HTTP body
    max_prompt_tokens: int = 0  # 0 -> the replicas' max_model_len
    max_tokens_limit: int = 8192
    max_pending_bytes: int = 1 << 20  # undelivered frames per client connection before it is cut off
    max_open_per_connection: int = 256  # requests in flight on one client socket
    cancel_rate_per_s: float = 100.0  # cancels per client socket (token bucket, burst twice this)
    auth_failures_per_s: float = 1.0  # failed authentications per source address, after a burst of
    auth_failure_burst: float = 20.0  # ... this many; then `rate_limited` before any key is checked
    failover_attempts: int = 3
    failover_wait_s: float = 5.0  # how long a stream waits for any replica to come back
    drain_timeout_s: float = 60.0
    handoff_budget_s: float = 4.0  # a draining replica's streams: from its drain seen to the last moved (handoff)
    handoff_hot_blocks: int = 128  # blocks of a draining replica's hot chains (cached conversations) placed; 0: none
    disagg_min_blocks: int = 4  # a decode replica's cold prompt lacking this many full blocks is prefilled elsewhere (disagg)
    otel_console: bool = False
    otel_otlp: bool = False  # export spans to OTEL_EXPORTER_OTLP_ENDPOINT (set when that variable is)
    log_level: str = "info"
    peers: tuple[Peer, ...] = ()  # other regions' proxies, nearest first: forwarded to with no replica ready here
    peer_key: str = ""  # API key presented to peers (EDGECHAT_PEER_KEY); "" when they allow anonymous access
    discovery: DiscoveryConfig | None = None  # replicas found live by DNS (--replicas-dns), besides `replicas`
    region_proxies: int = 1  # proxy pods of the region sharing each key's limits (--region-proxies) ...
    proxies_dns: DiscoveryConfig | None = None  # ... or counted live from their headless Service (--proxies-dns)
    pool: PoolConfig = field(default_factory=PoolConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    limits: Limits = field(default_factory=Limits)
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)

    def __post_init__(self):
        if not self.replicas and self.discovery is None:
            raise ValueError("give replicas: --replica ws://host:port/v1/replica (repeat) and/or "
                             "--replicas-dns NAME[:PORT]")
        if self.region_proxies < 1:
            raise ValueError(f"region_proxies must be >= 1, got {self.region_proxies}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.handoff_budget_s <= 0:
            raise ValueError(f"--handoff-budget must be > 0 seconds, got {self.handoff_budget_s}")
        if not 0 <= self.handoff_hot_blocks <= 4096:
            raise ValueError(f"--handoff-hot-blocks must be 0..4096, got {self.handoff_hot_blocks}")
        if self.disagg_min_blocks < 1:
            raise ValueError(f"--disagg-min-blocks must be >= 1, got {self.disagg_min_blocks}")
        if self.workers > 1 and self.port == 0:
            raise ValueError("several workers need a fixed --port to share")
        if len({p.region for p in self.peers} | {self.region}) != len(self.peers) + 1:
            raise ValueError(f"peers must be other regions than {self.region!r}, each given once")
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("TLS needs both --ssl-certfile and --ssl-keyfile")
        if self.max_frame_bytes < 1024:
            raise ValueError(f"max_frame_bytes must be >= 1024, got {self.max_frame_bytes}")
