"""Routing modes for `--compare-routing`: the proxy's own policy and three reductions.

    auto          the proxy's Router: sticky when a session is given, else prefix-aware
    prefix        prefix-aware for every request (sessions ignored for placement)
    sticky        session stickiness only (rendezvous with bounded load); no prefix
                  knowledge: requests without a session go to the least loaded replica
    round_robin   the next replica in turn, nothing else

Each has the proxy Router's `route` signature (edge_proxy.routing.Router.route), so a
proxy can be built with any of them. Until the proxy takes a routing mode itself
(hook: `RouterConfig.mode` / `--routing`), `regions.proxy` installs them.
"""

from __future__ import annotations

import itertools

from edge_proxy.routing import FAILOVER, LOAD, STICKY, Candidate, Decision, Router, RouterConfig, pick_sticky


class PrefixRouter(Router):
    def route(self, cands: list[Candidate], prompt_tokens: int, block_size: int, *, session_key=None,
              session_current=None, failover: bool = False) -> Decision | None:
        return super().route(cands, prompt_tokens, block_size, failover=failover)


class StickyRouter(Router):
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
    def __init__(self, cfg: RouterConfig | None = None):
        super().__init__(cfg)
        self._turn = itertools.count()

    def route(self, cands: list[Candidate], prompt_tokens: int, block_size: int, *, session_key=None,
              session_current=None, failover: bool = False) -> Decision | None:
        if not cands:
            return None
        ordered = sorted(cands, key=lambda c: c.id)  # a stable ring whatever order the pool lists them in
        c = ordered[next(self._turn) % len(ordered)]
        return Decision(c.id, FAILOVER if failover else LOAD, c.cached_blocks)


def make_router(mode: str, cfg: RouterConfig | None = None) -> Router:
    routers = {"auto": Router, "prefix": PrefixRouter, "sticky": StickyRouter, "round_robin": RoundRobinRouter}
    if mode not in routers:
        raise ValueError(f"routing mode must be one of {', '.join(routers)}, got {mode!r}")
    return routers[mode](cfg)
