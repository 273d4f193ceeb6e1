"""API keys, per-key token buckets and per-tenant cache salts.

Keys come from the environment variable `EDGECHAT_API_KEYS`
(`key=tenant[:tier[:rate_per_s[:burst[:max_inflight]]]]`, comma-separated) or a JSON
file (a list of `{"key", "tenant", "tier", "rate_per_s", "burst", "max_inflight"}`
objects). A key's rate, burst and in-flight cap are the region's: each proxy process
enforces its share (`set_share`, `limits.RegionShare`). The proxy keeps only
SHA-256 digests: a presented key is hashed, looked up by digest, and the digests
are compared with `hmac.compare_digest`, so neither the lookup nor the comparison
depends on how many leading characters of a guess are right.

Each tenant's cache salt is a keyed BLAKE2b of its name (key: the replica secret),
the same on every proxy of a region, so prefixes are shared within a tenant and
never across tenants. Salts are never unkeyed: a proxy without a replica secret
(only replica stubs run without one) keys them with a random per-process key.

Tier `peer` marks the key other regions' proxies present when they forward a
request (`--peer`): only such a key may name the tenant a request runs for
(`generate.tenant`), so a forwarded request keeps its tenant's cache salt, and
no client key can borrow another tenant's salt.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass, field

from edge_proxy.limits import shared_cap, shared_rate
from wire import protocol as P

ENV_VAR = "EDGECHAT_API_KEYS"
TIERS = {"interactive": P.INTERACTIVE, "batch": P.BATCH, "peer": P.INTERACTIVE}


class TokenBucket:
    """`rate` tokens per second, at most `burst` banked; starts full."""

    __slots__ = ("rate", "burst", "tokens", "t_last")

    def __init__(self, rate: float, burst: float, now: float | None = None):
        assert rate > 0 and burst >= 1, "a bucket needs rate > 0 and burst >= 1"
        self.rate, self.burst = rate, burst
        self.tokens = burst
        self.t_last = time.monotonic() if now is None else now

    def take(self, now: float | None = None, n: float = 1.0) -> float:
        """Take `n` tokens; return 0.0 on success, else the seconds until they would be there."""
        now = time.monotonic() if now is None else now
        self.tokens = min(self.burst, self.tokens + (now - self.t_last) * self.rate)
        self.t_last = now
        if self.tokens >= n:
            self.tokens -= n
            return 0.0
        return (n - self.tokens) / self.rate

    def rescale(self, rate: float, burst: float) -> None:
        """A new share of the key's limit: what was banked is kept up to the new burst."""
        assert rate > 0 and burst >= 1, "a bucket needs rate > 0 and burst >= 1"
        self.rate, self.burst = rate, burst
        self.tokens = min(self.tokens, burst)


@dataclass
class ApiKey:
    key_id: str  # short digest prefix: safe for logs, sessions and metrics
    tenant: str
    priority: int = P.INTERACTIVE  # best priority this key may ask for
    cache_salt: str = ""
    bucket: TokenBucket | None = field(default=None, repr=False)
    peer: bool = False  # another region's proxy: may run requests for the tenant they name
    rate: float = 0.0  # the region's limits as configured (requests a second, burst, in flight: 0 none) ...
    burst: float = 0.0
    max_inflight: int = 0
    inflight_cap: int = 0  # ... and this process's share of the in-flight cap (`set_share`)


def cache_salt(tenant: str, secret: str) -> str:
    return hashlib.blake2b(tenant.encode(), key=secret.encode()[:64], digest_size=12).hexdigest()


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyStore:
    """Known API keys. `anonymous=True` admits requests without a key (development only)."""

    def __init__(self, entries: list[dict], salt_secret: str = "", anonymous: bool = False,
                 default_rate: float = 50.0, default_burst: float = 100.0):
        self._by_digest: dict[bytes, tuple[bytes, ApiKey]] = {}
        self._salt_secret = salt_secret = salt_secret or secrets.token_hex(32)
        self._delegated: dict[tuple[str, str], ApiKey] = {}
        for e in entries:
            key, tenant = e.get("key"), e.get("tenant")
            if not key or not tenant:
                raise ValueError(f"API key entry needs 'key' and 'tenant': {sorted(e)}")
            tier = e.get("tier", "interactive")
            if tier not in TIERS:
                raise ValueError(f"API key tier must be one of {sorted(TIERS)}, got {tier!r}")
            d = _digest(key)
            rate, burst = float(e.get("rate_per_s", default_rate)), float(e.get("burst", default_burst))
            inflight = int(e.get("max_inflight", 0))
            if inflight < 0:
                raise ValueError(f"API key max_inflight must be >= 0 (0: no cap), got {inflight}")
            self._by_digest[d] = (d, ApiKey(d.hex()[:12], tenant, TIERS[tier], cache_salt(tenant, salt_secret),
                                            TokenBucket(rate, burst), peer=tier == "peer", rate=rate, burst=burst,
                                            max_inflight=inflight, inflight_cap=inflight))
        self.anonymous = (ApiKey("anonymous", "anonymous", P.INTERACTIVE, cache_salt("anonymous", salt_secret),
                                 TokenBucket(default_rate, default_burst), rate=default_rate, burst=default_burst)
                          if anonymous else None)
        if not self._by_digest and not anonymous:
            raise ValueError(f"no API keys configured: set {ENV_VAR}, pass --api-keys FILE, or --allow-anonymous")

    def __len__(self) -> int:
        return len(self._by_digest)

    def check(self, presented: str | None) -> ApiKey | None:
        """The key's entry; the anonymous principal when allowed and no key was given, or when
        no keys are configured at all (any presented key then, as vLLM and SGLang do without
        --api-key: OpenAI SDKs always send one); else None (an unknown key: 401)."""
        if not presented or not self._by_digest:
            return self.anonymous
        d = _digest(presented)
        hit = self._by_digest.get(d)
        if hit is None or not hmac.compare_digest(hit[0], d):
            return None
        return hit[1]

    def set_share(self, share: float) -> None:
        """Every key's limits become this process's `share` of the region's (`limits.shared_rate`,
        `shared_cap`); called at start and whenever the count of the region's proxies changes."""
        keys = [k for _, k in self._by_digest.values()] + ([self.anonymous] if self.anonymous else [])
        for k in keys + list(self._delegated.values()):  # (a peer's delegates share its bucket: rescaled alike)
            k.bucket.rescale(*shared_rate(k.rate, k.burst, share))
            k.inflight_cap = shared_cap(k.max_inflight, share)

    def on_behalf_of(self, peer: ApiKey, tenant: str) -> ApiKey:
        """The principal a peer region's request runs as: the named tenant's salt, the
        peer key's tier and rate limit, its own session namespace."""
        if not peer.peer:
            raise PermissionError(f"API key {peer.key_id} is not a peer key: it cannot act for a tenant")
        k = self._delegated.get((peer.key_id, tenant))
        if k is None:
            k = self._delegated[(peer.key_id, tenant)] = ApiKey(
                f"{peer.key_id}/{tenant}", tenant, peer.priority, cache_salt(tenant, self._salt_secret), peer.bucket,
                rate=peer.rate, burst=peer.burst, max_inflight=peer.max_inflight, inflight_cap=peer.inflight_cap)
        return k


def parse_env(value: str) -> list[dict]:
    """`key=tenant[:tier[:rate_per_s[:burst[:max_inflight]]]]`, comma-separated."""
    out = []
    for item in filter(None, (s.strip() for s in value.split(","))):
        key, sep, rest = item.partition("=")
        if not sep or not key or not rest:
            raise ValueError(f"{ENV_VAR} entries look like key=tenant[:tier[:rate[:burst[:inflight]]]], "
                             f"got {item[:4]}...")
        parts = rest.split(":")
        e: dict = {"key": key, "tenant": parts[0]}
        for name, val in zip(("tier", "rate_per_s", "burst", "max_inflight"), parts[1:]):
            e[name] = val
        out.append(e)
    return out


def load_entries(path: str | None, env_value: str | None) -> list[dict]:
    entries = parse_env(env_value) if env_value else []
    if path:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of key objects")
        entries += data
    return entries


def bearer(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None
