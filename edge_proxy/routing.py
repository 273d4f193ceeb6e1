"""Routing policy: which replica serves a request. Pure functions over plain data.

The proxy's rule (`pick_prefix`), for every request in mode "auto" and "prefix":

1. Safety valve (in the spirit of SGLang's router): when the loads of the compute
   groups are far apart (`max - min > balance_abs_threshold` and
   `max > balance_rel_threshold * min`), the least loaded replica of the least
   loaded group, whatever it holds (loads as `weighed_load` counts them, summed
   over a group). A group is the replicas that share compute (the same GPU, cores
   of one machine: `Hello.compute`, `compute_groups`); a replica computing alone
   is its own. Moving work to another replica of the same group frees no compute
   and costs a cold prefill, so a pool that is one group (several replicas on one
   machine's cores) has no valve: the bounded-load and spill rules below spread it.
2. A conversation stays home. `prefill(r)` is the prompt length minus the leading
   blocks replica r is believed to hold (`prefix_index`). The replicas that could
   prefill the prompt nearly as cheaply as the cheapest one (within
   `max(near_tokens, near_frac * prompt)` tokens) are its candidates. A later turn
   of a conversation (`later_turn`: the request carries an earlier reply) has a home
   among them (`conversation_home`, `mark_home`): the one replica whose match of the
   prompt runs deepest, past what any other holds. Its previous turn's prompt and
   reply are there (an engine stores the blocks it decodes as it does a prompt's,
   and says so in its KV events to every proxy), so every proxy and worker of the
   region that receives the turn finds the same home, with or without a session id
   (a session's home is found the same way: no proxy keeps where a session ran). Home
   takes the turn while it holds fewer than the spill bound (`load_bound`:
   `ceil(session_load_factor * (L + 1) / n) + session_slack` requests, L: the total
   outstanding requests, n: replicas). A conversation is placed for good: its
   replica being the busiest this instant (a few of its conversations in a turn at
   once, while the other replicas' conversations are between turns, which no load
   shows) is no reason to prefill its history again elsewhere; it moves past the
   spill bound, priced by rule 4, or by the valve.
3. Bounded-load placement, for everything else (new conversations, prompts
   sharing a system prompt, a conversation past its spill bound): of the
   candidates, a replica already at its bound `ceil((1 + load_eps) * (L + 1) / n)`
   (at least `min_bound`) takes nothing new (consistent hashing with bounded
   loads, Mirrokni et al. 2016). Among the rest: the least loaded, then the
   cheaper prefill, then the one holding the fewest blocks in all, then a
   rendezvous draw on the request's key (its session, else its first block), so
   ties spread and every proxy worker breaks them alike. A prompt that only
   shares a system prompt held everywhere has several candidates and goes to the
   least loaded. A prompt no replica holds any of (a new conversation, its own
   system prompt) goes where fewer blocks are held (SGLang's "smallest tree": the
   fewest conversations), not by load alone: load counts only the turns running
   this instant, and a replica whose conversations are all between turns looks
   idle, so by load alone new conversations pile onto it (12 conversations placed
   2/4/6) and, kept home, stay piled. "Fewer" (`fewest_held`) counts conversations:
   each replica reports the chains its prefix cache holds (`Load.chains`: cached
   blocks no cached block extends, one a conversation, since each turn's prompt
   extends the last turn's blocks), and a proxy adds its own new conversations
   sent there that no Load has counted yet; the replicas holding the fewest tie,
   and among them the least loaded, then the rendezvous draw, takes it. Block
   counts told conversations apart only to within a conversation's progress (a
   replica whose 4 conversations are short holds fewer blocks than one with 3
   long ones), so the four processes of two proxies of two workers each placing
   12 conversations over three replicas left them 5/4/3 in 5 of 18 runs. A
   replica that reports no chains (an older one) is compared by blocks: those
   holding less than one prompt's worth more than the fewest tie.
   Simultaneous placements through several processes see the same reports (none
   shows the others' new prompts until the replica's next step); where the band's
   loads tie their keys draw different replicas of it, where the one smallest
   would take them all, and the next placements, a report later, even it out.
4. Spill, when every such replica is at its bound: the replica with the least
   `cost = (prefill + queued prefill + load_cost_tokens * decoding) / speed`, where
   `queued prefill` is the uncached prompt tokens of this proxy's requests there
   that have no first token yet (a new request waits for them), `decoding` the rest
   of its load (each outstanding request weighs like `load_cost_tokens` prefill
   tokens) and `speed` its measured prefill rate against the others' (replicas
   report it; 1 when unknown), divided among the busy replicas of its compute
   group when with it they would want more than the group has (a share is the
   fraction of the group's units a replica computes on at once: three one-thread
   engines on two cores have a half each, so a third busy one slows all three).
   A replica holding the prefix keeps the request while
   its cost is within the near margin of the cheapest: a conversation's history
   moves only when its queue costs more than prefilling it again, and a prompt
   being prefilled right now gets no second cold copy while queueing behind the
   first costs no more than making one (a cold start's burst of users of one long
   system prompt fills one replica while it computes the prompt, then spreads).

`load` is the effective number of outstanding requests (running + waiting) as
the proxy best knows it; see `effective_load`.

One region, many proxies. A region runs several proxy processes (pods, `--workers`),
and a load balancer spreads a conversation's turns over them, so a decision is a
function of what all of them see alike: the request (its block hashes, its session's
placement key, whether it carries an earlier reply) and the replicas' reports (KV
events, Load, Hello), which every proxy receives on its own connection. What is
local, and why that is safe:

- blocks a proxy expects but no KV event has confirmed yet (`BlockIndex.expect`: a
  prompt just sent, a reply just finished): the replica's events confirm them within
  a step, or they age out in `expect_s`; they bridge that step (and count in a replica's
  `held_blocks` for it), and another proxy learns the same blocks from the same events
  before the client's next turn reaches it;
- its own requests a replica's last Load does not count (`effective_load`: the Load names
  the last of this proxy's it counted, `Load.seen_id`) and their prompts still prefilling
  (`queued_prefill`): corrections of a report one network hop old (a replica publishes its
  Load the loop turn it accepts a request), replaced by the next one; they weigh load,
  never decide a conversation's home;
- its own new conversations a replica's last Load does not count in `chains` yet
  (`ReplicaConn.fresh_chains`: sent after the request that Load names, `seen_id`; a
  replica counts a new one from the moment it has it): the same one-hop correction,
  gone at the next Load; it spreads one process's own placements, never decides a
  later turn's home;
- the rendezvous tie-breaks draw on the request's key (a session's placement key, else
  its first block): alike everywhere. Two new conversations placed through two
  processes within one network hop (before the replica's Load shows the first to the
  other; before its KV events do, one engine step) see the same reports; the tie band of rule 3 spreads them over the replicas within
  a prompt of the fewest blocks, by their keys, when their loads tie too. Where one
  replica alone is in the band, or the band's loads differ, both still go to the same
  one: no rule over reports a step old can tell them apart (docs/perf.md, "One region,
  several proxies").

No proxy keeps where a session or a conversation last ran (`sessions`: an id is its
key's, no table; `BlockIndex.history`, a process's marks of the streams it finished,
no longer decides anything here).

`RouterConfig.mode` (`python -m edge_proxy --routing MODE`) picks the policy;
all but "auto" are reductions for comparisons (`bench/routing.py`,
`loadtest --compare-routing`):

    auto          the rule above; a session's home is found from KV events like any conversation's
    prefix        the rule above, session ids ignored (home: the replica holding its reply)
    sticky        session stickiness only, by rendezvous hashing with bounded loads
                  (`pick_sticky`); no prefix knowledge: requests without a session
                  go to the least loaded replica
    round_robin   the next replica in turn, nothing else
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import xxhash

STICKY, PREFIX, LOAD, SPILL, FAILOVER = "sticky", "prefix", "load", "spill", "failover"
REASONS = (STICKY, PREFIX, LOAD, SPILL, FAILOVER)
MODES = ("auto", "prefix", "sticky", "round_robin")


@dataclass(frozen=True)
class RouterConfig:
    load_eps: float = 0.1  # bounded load: no new work above ceil((1 + eps) * mean) where another is nearly as cheap
    min_bound: int = 2  # ... but a replica is never over its bound below this many requests (tiny loads)
    near_tokens: int = 32  # "nearly as cheaply": within this many prefill tokens of the cheapest replica ...
    near_frac: float = 0.125  # ... or this fraction of the prompt, whichever is more
    load_cost_tokens: float = 256.0  # spill: one outstanding request weighs like this many prefill tokens
    balance_abs_threshold: float = 4.0  # between compute groups (a pool on shared cores has one: no valve)
    balance_rel_threshold: float = 1.5
    session_load_factor: float = 1.25  # a conversation's replica keeps it up to ceil(c * mean) ... (`load_bound`)
    session_slack: int = 4  # ... + this many requests (the spill bound; mode "sticky": its rendezvous bound)
    mode: str = "auto"  # one of MODES

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"routing mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.load_eps < 0.0:
            raise ValueError(f"load_eps must be >= 0, got {self.load_eps}")
        if self.session_load_factor < 1.0:
            raise ValueError(f"session_load_factor must be >= 1, got {self.session_load_factor}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")


@dataclass(slots=True)
class Candidate:
    id: str
    load: float  # effective outstanding requests
    cached_blocks: int = 0  # leading blocks of this prompt the replica is believed to hold
    queued_prefill: int = 0  # uncached prompt tokens of this proxy's requests there still without a first token
    queued_requests: int = 0  # how many requests those are (part of `load`)
    speed: float = 1.0  # its measured prefill rate over the candidates' mean (1: unknown)
    group: str = ""  # its compute group (`compute_groups`); "": computes alone
    share: float = 1.0  # the fraction of its group's compute it can use at once
    held_blocks: int = 0  # blocks it is believed to hold in all (the tie-break of equally loaded cold choices)
    history: bool = False  # it holds this later turn's conversation, deeper than any other (`mark_home`): its home
    chains: int = -1  # conversations it holds (Load.chains, and this proxy's new ones it has not counted); -1: unknown


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
    """The spill bound: the most a replica may hold and still take a request of a
    conversation it holds (modes "auto" and "prefix"; mode "sticky": of a session)."""
    return math.ceil(cfg.session_load_factor * (total_load + 1) / n) + cfg.session_slack


def bounded_load(total_load: float, n: int, cfg: RouterConfig) -> int:
    """The most outstanding requests a replica may have after taking one more, when
    another replica could serve it nearly as cheaply: ceil((1 + eps) * mean), at least
    `min_bound` (with one request in flight the mean says nothing)."""
    return max(math.ceil((1.0 + cfg.load_eps) * (total_load + 1) / n - 1e-9), cfg.min_bound)


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


def weighed_load(c: Candidate, cfg: RouterConfig) -> float:
    """A replica's load as the valve and the spill price see it: requests past their first
    token count one each; those still waiting to prefill count their uncached tokens in
    units of `load_cost_tokens` (ten users queued behind one prefill of a shared prompt
    are not ten requests of work)."""
    return max(c.load - c.queued_requests, 0.0) + c.queued_prefill / cfg.load_cost_tokens


def group_of(c: Candidate) -> str:
    """The compute group `c` is weighed in (its own id when it computes alone)."""
    return c.group or c.id


def compute_groups(units: dict[str, list[str]], uses: dict[str, int] | None = None) -> dict[str, tuple[str, float]]:
    """Replica id -> (its compute group's name, its share): replicas whose compute units
    meet, directly or through others, are one group, named by its first member in
    `units`' order; a replica's share is the fraction of the group's units it computes
    on at once (`uses[id]` of its own units, 0 or absent: all of them). A replica that
    names no units is its own group, with all of it."""
    parent = {rid: rid for rid in units}
    order = {rid: i for i, rid in enumerate(units)}

    def find(r: str) -> str:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    owner: dict[str, str] = {}  # unit -> the first replica naming it
    for rid, us in units.items():
        for u in us:
            a, b = sorted((find(owner.setdefault(u, rid)), find(rid)), key=order.__getitem__)
            parent[b] = a
    size: dict[str, int] = {}  # group -> its distinct units
    for u, rid in owner.items():
        g = find(rid)
        size[g] = size.get(g, 0) + 1
    out = {}
    for rid, us in units.items():
        g, n = find(rid), len(set(us))
        at_once = min((uses or {}).get(rid) or n, n)
        out[rid] = (g, at_once / size[g] if n else 1.0)
    return out


def valve_pick(cands: list[Candidate], cfg: RouterConfig, key: str) -> Candidate | None:
    """Rule 1: when the compute groups' loads are far apart, the least loaded replica
    of the least loaded group; None when they are not (or there is one group)."""
    loads: dict[str, float] = {}
    for c in cands:
        g = group_of(c)
        loads[g] = loads.get(g, 0.0) + weighed_load(c, cfg)
    if len(loads) < 2:
        return None
    lo, hi = min(loads.values()), max(loads.values())
    if not (hi - lo > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo):
        return None
    idle = [c for c in cands if loads[group_of(c)] == lo]
    return min(idle, key=lambda c: (weighed_load(c, cfg), -c.cached_blocks, -hrw_score(key, c.id)))


def later_turn(messages: list[dict] | None, session: str | None) -> bool:
    """Does the request go on from an earlier reply of its conversation: a chat that carries
    an assistant message, or a plain prompt that names its session? (The request alone
    says so: the same answer on every proxy.)"""
    if messages is not None:
        return any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages)
    return session is not None


def mark_home(cands: list[Candidate], later: bool) -> None:
    """Set `Candidate.history` on the replica a later turn's conversation lives on, from
    what every proxy of the region sees alike (the replicas' KV events, the request): the
    one candidate whose match of the prompt runs deeper than every other's. Its previous
    turn's prompt and reply are there (a replica stores the blocks it decodes, as it does
    the prompt's), so its match runs past the shared part (a system prompt) that others may
    hold too. A first turn, a prompt several replicas hold as deeply (a shared prompt, a
    conversation copied by a spill), or one no replica holds any of: no home."""
    if not later or not cands:
        return
    deepest = max(c.cached_blocks for c in cands)
    holders = [c for c in cands if c.cached_blocks == deepest]
    if deepest > 0 and len(holders) == 1:
        holders[0].history = True


def fewest_held(cands: list[Candidate], prompt_blocks: int) -> list[Candidate]:
    """Rule 3's tie band for a prompt no replica holds: the candidates holding the fewest
    conversations (`chains`), where every one reports them; else those holding fewer than
    `prompt_blocks` (at least one) blocks more than the one holding the fewest."""
    if all(c.chains >= 0 for c in cands):
        least = min(c.chains for c in cands)
        return [c for c in cands if c.chains == least]
    least = min(c.held_blocks for c in cands)
    return [c for c in cands if c.held_blocks < least + max(prompt_blocks, 1)]


def conversation_home(close: list[Candidate], prefill: dict[str, int], prefer: str | None) -> Candidate | None:
    """The replica a later turn of a conversation belongs on, among those that can
    prefill it nearly as cheaply as the cheapest (`close`): the session's (`prefer`, when
    the caller knows it), else the cheapest one holding its history (`Candidate.history`,
    `mark_home`); None for a new conversation, or a prompt that only shares a system
    prompt with others."""
    for c in close:
        if c.id == prefer:
            return c
    own = [c for c in close if c.history]
    return min(own, key=lambda c: (prefill[c.id], c.load, c.id)) if own else None


def pick_prefix(prompt_tokens: int, block_size: int, cands: list[Candidate], cfg: RouterConfig, key: str = "",
                prefer: str | None = None, new: bool = False) -> Decision:
    """The bounded-load prefix rule of the module docstring. `prefer`: the session's
    replica (its conversation's home), `key`: the rendezvous tie-break, `new`: the
    request starts a conversation (no earlier reply: `later_turn` is false)."""
    assert cands, "pick_prefix needs at least one candidate"
    c = valve_pick(cands, cfg, key) if len(cands) > 1 else None
    if c is not None:
        return Decision(c.id, LOAD, c.cached_blocks)
    prefill = {c.id: max(prompt_tokens - c.cached_blocks * block_size, 0) for c in cands}
    cheapest = min(prefill.values())
    if prefer in prefill:
        prefill[prefer] = min(prefill[prefer], cheapest)  # the session's replica holds its history
    near = cheapest + max(cfg.near_tokens, cfg.near_frac * prompt_tokens)
    total = sum(c.load for c in cands)
    bound = bounded_load(total, len(cands), cfg)
    close = [c for c in cands if prefill[c.id] <= near]
    home = conversation_home(close, prefill, prefer)
    if home is not None and home.load + 1 <= load_bound(total, len(cands), cfg):
        return Decision(home.id, STICKY if home.id == prefer else PREFIX, home.cached_blocks)
    ok = [c for c in close if c.load + 1 <= bound]
    if ok and cheapest == prompt_tokens:  # a prompt of its own (a new conversation): where fewer conversations are
        c = min(fewest_held(ok, prompt_tokens // block_size), key=lambda c: (c.load, -hrw_score(key, c.id)))
        return Decision(c.id, LOAD, 0)
    if ok and new and all(c.chains >= 0 for c in ok):  # a new one past a shared prefix: so too, among its holders
        least = min(c.chains for c in ok)
        c = min((c for c in ok if c.chains == least), key=lambda c: (c.load, prefill[c.id], -hrw_score(key, c.id)))
        return Decision(c.id, PREFIX if c.cached_blocks else LOAD, c.cached_blocks)
    if ok:
        c = min(ok, key=lambda c: (c.load, prefill[c.id], c.held_blocks, -hrw_score(key, c.id)))
        reason = PREFIX if c.cached_blocks else LOAD  # (a session's replica is home: rule 2 or not in `ok`)
        return Decision(c.id, reason, c.cached_blocks)

    busy: dict[str, float] = {}  # compute group -> the shares of its replicas with work
    for c in cands:
        if c.load > 0:
            busy[group_of(c)] = busy.get(group_of(c), 0.0) + c.share

    def rate(c: Candidate) -> float:
        """Its prefill rate if it takes the request: its measured speed, divided among the
        busy replicas of its group once they would want more compute than the group has."""
        return c.speed / max(busy.get(group_of(c), 0.0) + (0.0 if c.load > 0 else c.share), 1.0)

    def cost(c: Candidate) -> float:
        return (prefill[c.id] + cfg.load_cost_tokens * weighed_load(c, cfg)) / rate(c)

    def order(c: Candidate):
        return cost(c), c.load, -hrw_score(key, c.id)

    # Several holders, all full (a shared system prompt): one more copy, on a replica under its bound ...
    others = [c for c in cands if c.load + 1 <= bound] if len(close) > 1 else cands
    best = min(others or cands, key=order)
    holder = min(close, key=order)
    if cost(holder) <= cost(best) + (near - cheapest) / rate(best):  # ... unless waiting at a holder costs no more
        best = holder
    reason = (SPILL if prefill[best.id] > near else STICKY if best.id == prefer else PREFIX if best.cached_blocks
              else LOAD)
    return Decision(best.id, reason, best.cached_blocks)


class Router:
    """mode "auto": `pick_prefix` for every request; a session's home is preferred
    (`session_current`: the core gives the one `mark_home` found)."""

    def __init__(self, cfg: RouterConfig | None = None):
        self.cfg = cfg or RouterConfig()

    def route(self, cands: list[Candidate], prompt_tokens: int, block_size: int, *, key: str = "",
              session_key: str | None = None, session_current: str | None = None,
              failover: bool = False, new: bool = False) -> Decision | None:
        """Pick among healthy `cands`; None when there is none. `key` names the
        request for tie-breaks (its first block hash); a session key replaces it;
        `new`: it starts a conversation."""
        if not cands:
            return None
        if failover:
            d = pick_prefix(prompt_tokens, block_size, cands, self.cfg, session_key or key)
            return Decision(d.replica, FAILOVER, d.cached_blocks)
        return pick_prefix(prompt_tokens, block_size, cands, self.cfg, session_key or key,
                           session_current if session_key is not None else None, new)


class PrefixRouter(Router):
    """mode "prefix": `pick_prefix` for every request, session ids ignored."""

    def route(self, cands: list[Candidate], prompt_tokens: int, block_size: int, *, key: str = "",
              session_key=None, session_current=None, failover: bool = False, new: bool = False) -> Decision | None:
        return super().route(cands, prompt_tokens, block_size, key=key, failover=failover, new=new)


class StickyRouter(Router):
    """mode "sticky": sessions by bounded-load rendezvous, everything else by least load."""

    def route(self, cands: list[Candidate], prompt_tokens: int, block_size: int, *, key: str = "",
              session_key=None, session_current=None, failover: bool = False, new: bool = False) -> Decision | None:
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

    def route(self, cands: list[Candidate], prompt_tokens: int, block_size: int, *, key: str = "",
              session_key=None, session_current=None, failover: bool = False, new: bool = False) -> Decision | None:
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
