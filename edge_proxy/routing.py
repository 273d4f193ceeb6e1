"""Routing policy: which replica serves a request. Pure functions over plain data.

Order of preference (DESIGN.md: session -> prefix overlap -> load):

1. Sticky session. A session key maps to a replica by rendezvous (highest random
   weight) hashing, so every proxy worker and every proxy in the region agrees
   without sharing state, and only the sessions of a lost replica move. Loads are
   bounded (consistent hashing with bounded loads, Mirrokni et al. 2016): a
   replica takes a new request only while `load + 1 <= ceil(c * (L + 1) / n) +
   slack`, L being the total load; otherwise the next replica in the session's
   rendezvous order. A session stays where it is (`current`) while that replica
   is healthy and under the bound.
2. Load balance when imbalanced (in the spirit of SGLang's router): when
   `max - min > abs_threshold` and `max > rel_threshold * min`, the least loaded
   replica wins regardless of cache.
3. Prefix: otherwise the replica minimising
   `tokens to prefill + load_cost_tokens * load`, where tokens to prefill is the
   prompt length minus the leading blocks the replica is believed to hold.

`load` is the effective number of outstanding requests (running + waiting) as
the proxy best knows it; see `effective_load`.

`RouterConfig.mode` (`python -m edge_proxy --routing MODE`) picks the policy;
all but "auto" are reductions for comparisons (`loadtest --compare-routing`):

    auto          the order above: sticky when a session is given, else prefix-aware
    prefix        prefix-aware for every request (sessions ignored for placement)
    sticky        session stickiness only; no prefix knowledge: requests without a
                  session go to the least loaded replica
    round_robin   the next replica in turn, nothing else
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import xxhash

STICKY, PREFIX, LOAD, FAILOVER = "sticky", "prefix", "load", "failover"
REASONS = (STICKY, PREFIX, LOAD, FAILOVER)
MODES = ("auto", "prefix", "sticky", "round_robin")


@dataclass(frozen=True)
class RouterConfig:
    session_load_factor: float = 1.25  # c in the bound above
    session_slack: int = 4  # requests of headroom, so small absolute imbalances never move a session
    balance_abs_threshold: float = 16.0
    balance_rel_threshold: float = 1.5
    load_cost_tokens: float = 256.0  # one outstanding request weighs like this many prefill tokens
    mode: str = "auto"  # one of MODES

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"routing mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.session_load_factor < 1.0:
            raise ValueError(f"session_load_factor must be >= 1, got {self.session_load_factor}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")


@dataclass(slots=True)
class Candidate:
    id: str
    load: float  # effective outstanding requests
    cached_blocks: int = 0  # leading blocks of this prompt the replica is believed to hold


@dataclass(slots=True, frozen=True)
class Decision:
    replica: str
    reason: str  # one of REASONS
    cached_blocks: int = 0


def effective_load(reported: int, own_now: int, own_at_report: int) -> float:
    """Reported running + waiting, corrected by this proxy's requests since that report."""
    return float(max(own_now, reported + own_now - own_at_report))


def hrw_score(key: str, replica_id: str) -> int:
    return xxhash.xxh3_64_intdigest(f"{key}\x00{replica_id}".encode())


def rendezvous_order(key: str, ids: list[str]) -> list[str]:
    return sorted(ids, key=lambda r: hrw_score(key, r), reverse=True)


def load_bound(total_load: float, n: int, cfg: RouterConfig) -> float:
    return math.ceil(cfg.session_load_factor * (total_load + 1) / n) + cfg.session_slack


def pick_sticky(key: str, current: str | None, cands: list[Candidate], cfg: RouterConfig) -> Candidate:
    assert cands, "pick_sticky needs at least one candidate"
    bound = load_bound(sum(c.load for c in cands), len(cands), cfg)
    by_id = {c.id: c for c in cands}
    cur = by_id.get(current) if current is not None else None
    if cur is not None and cur.load + 1 <= bound:
        return cur
    for rid in rendezvous_order(key, list(by_id)):
        if by_id[rid].load + 1 <= bound:
            return by_id[rid]
    return min(cands, key=lambda c: c.load)  # unreachable for c >= 1; kept as a total function


def is_imbalanced(cands: list[Candidate], cfg: RouterConfig) -> bool:
    lo = min(c.load for c in cands)
    hi = max(c.load for c in cands)
    return hi - lo > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo


def pick_prefix(prompt_tokens: int, block_size: int, cands: list[Candidate], cfg: RouterConfig) -> Decision:
    assert cands, "pick_prefix needs at least one candidate"
    if len(cands) > 1 and is_imbalanced(cands, cfg):
        c = min(cands, key=lambda c: (c.load, -c.cached_blocks, c.id))
        return Decision(c.id, LOAD, c.cached_blocks)

    def cost(c: Candidate):
        prefill = max(prompt_tokens - c.cached_blocks * block_size, 0)
        return (prefill + cfg.load_cost_tokens * c.load, c.load, c.id)

    c = min(cands, key=cost)
    return Decision(c.id, PREFIX if c.cached_blocks > 0 else LOAD, c.cached_blocks)


class Router:
    def __init__(self, cfg: RouterConfig | None = None):
        self.cfg = cfg or RouterConfig()

    def route(self, cands: list[Candidate], prompt_tokens: int, block_size: int, *,
              session_key: str | None = None, session_current: str | None = None,
              failover: bool = False) -> Decision | None:
        """Pick among healthy `cands`; None when there is none."""
        if not cands:
            return None
        if session_key is not None and not failover:
            c = pick_sticky(session_key, session_current, cands, self.cfg)
            return Decision(c.id, STICKY, c.cached_blocks)
        d = pick_prefix(prompt_tokens, block_size, cands, self.cfg)
        return Decision(d.replica, FAILOVER, d.cached_blocks) if failover else d


class PrefixRouter(Router):
    """mode "prefix": prefix-aware (with load balancing) for every request."""

    def route(self, cands: list[Candidate], prompt_tokens: int, block_size: int, *, session_key=None,
              session_current=None, failover: bool = False) -> Decision | None:
        return super().route(cands, prompt_tokens, block_size, failover=failover)


class StickyRouter(Router):
    """mode "sticky": sessions by bounded-load rendezvous, everything else by least load."""

    def route(self, cands: list[Candidate], prompt_tokens: int, block_size: int, *, session_key=None,
              session_current=None, failover: bool = False) -> Decision | None:
        if not cands:
            return None
        if session_key is not None and not failover:
            c = pick_sticky(session_key, session_current, cands, self.cfg)
            return Decision(c.id, STICKY, c.cached_blocks)
        c = min(cands, key=lambda c: (c.load, c.id))
        return Decision(c.id, FAILOVER if failover else LOAD, c.cached_blocks)


class RoundRobinRouter(Router):
    """mode "round_robin": the next replica in a stable ring (by id), whatever the pool's order."""

    def __init__(self, cfg: RouterConfig | None = None):
        super().__init__(cfg)
        self._turn = itertools.count()

    def route(self, cands: list[Candidate], prompt_tokens: int, block_size: int, *, session_key=None,
              session_current=None, failover: bool = False) -> Decision | None:
        if not cands:
            return None
        ordered = sorted(cands, key=lambda c: c.id)
        c = ordered[next(self._turn) % len(ordered)]
        return Decision(c.id, FAILOVER if failover else LOAD, c.cached_blocks)


_ROUTERS = {"auto": Router, "prefix": PrefixRouter, "sticky": StickyRouter, "round_robin": RoundRobinRouter}


def make_router(cfg: RouterConfig | None = None) -> Router:
    """The router for `cfg.mode` (the config is validated when built)."""
    cfg = cfg or RouterConfig()
    return _ROUTERS[cfg.mode](cfg)
