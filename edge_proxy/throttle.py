"""Failed-authentication throttling per source address.

Every handshake or HTTP request that presents a missing or unknown API key takes
one token from its source address's bucket (`rate_per_s`, `burst`); while the
bucket is empty, that address's requests are refused with `rate_limited` before
any key is looked at, so guessing keys costs a guesser `1 / rate_per_s` seconds
per guess after the first `burst`. Successful authentications cost nothing.
Buckets live in a bounded LRU table (`max_addresses`); a forgotten address
simply starts with a full bucket.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from edge_proxy.auth import TokenBucket


class FailedAuthThrottle:
    def __init__(self, rate_per_s: float = 1.0, burst: float = 20.0, max_addresses: int = 10_000):
        self.rate, self.burst, self.max_addresses = rate_per_s, burst, max_addresses
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()
        self.refused = 0  # requests refused while throttled (for logs and tests)

    def wait_s(self, addr: str | None, now: float | None = None) -> float:
        """Seconds until `addr` may try a key again; 0.0 when it may now."""
        b = self._buckets.get(addr or "")
        if b is None:
            return 0.0
        now = time.monotonic() if now is None else now
        b.tokens = min(b.burst, b.tokens + (now - b.t_last) * b.rate)
        b.t_last = now
        if b.tokens >= 1.0:
            return 0.0
        self.refused += 1
        return (1.0 - b.tokens) / b.rate

    def failed(self, addr: str | None, now: float | None = None) -> None:
        """Charge one failed authentication to `addr`."""
        key = addr or ""
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = TokenBucket(self.rate, self.burst, now)
            while len(self._buckets) > self.max_addresses:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        b.take(now)
