"""Per-request measurements folded into per-(region, workload) groups.

For each finished request (a `client.Call`):

  TTFT  first delta's arrival - send
  ITL   gap between consecutive delta frames (a coalesced frame is one gap)
  TPOT  (last arrival - first arrival) / (tokens - 1), completed requests only
  E2E   end - send, completed requests only

A request the driver cancelled counts for TTFT (if a token came) and for the
cancellation figures, never for TPOT, E2E or goodput. Goodput counts completed
requests meeting every SLO given (`ttft`, `tpot`, `e2e` in ms; `itl`: the
request's largest gap), as requests per second and as a fraction of the requests
that were not cancelled by the driver.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edge_proxy import protocol as pp
from loadtest.histogram import Histogram

REJECTIONS = frozenset({pp.OVERLOADED, pp.RATE_LIMITED, pp.UNAVAILABLE, pp.SHUTTING_DOWN, pp.TOO_LARGE,
                        pp.PROMPT_TOO_LONG})
SLO_KEYS = ("ttft", "tpot", "itl", "e2e")
METRICS = ("ttft", "itl", "tpot", "e2e")


@dataclass
class Group:
    ttft: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)
    cancel_ack: Histogram = field(default_factory=Histogram)  # cancel sent -> done(abort) received
    requests: int = 0
    completed: int = 0
    good: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    accepted_draft_tokens: int = 0
    cancels_sent: int = 0
    cancels_honoured: int = 0  # answered done(abort)
    cancels_too_late: int = 0  # the request had already finished
    cancels_errored: int = 0  # the request ended in an error (e.g. rejected) before the cancel took effect
    tokens_after_cancel: int = 0
    unfinished: int = 0  # still running when the run was cut off
    deadline_misses: int = 0  # first token later than the request's deadline
    errors: dict[str, int] = field(default_factory=dict)
    failovers: int = 0
    forwarded: int = 0  # served by another region than the one contacted
    replicas: dict[str, int] = field(default_factory=dict)

    def merge(self, o: Group) -> Group:
        for m in (*METRICS, "cancel_ack"):
            getattr(self, m).merge(getattr(o, m))
        for f in ("requests", "completed", "good", "prompt_tokens", "cached_tokens", "output_tokens",
                  "accepted_draft_tokens", "cancels_sent", "cancels_honoured", "cancels_too_late", "cancels_errored",
                  "tokens_after_cancel", "unfinished", "deadline_misses", "failovers", "forwarded"):
            setattr(self, f, getattr(self, f) + getattr(o, f))
        for d in ("errors", "replicas"):
            mine = getattr(self, d)
            for k, v in getattr(o, d).items():
                mine[k] = mine.get(k, 0) + v
        return self

    def summary(self, duration_s: float) -> dict:
        rejections = {k: v for k, v in self.errors.items() if k in REJECTIONS}
        considered = self.requests - self.cancels_honoured - self.cancels_too_late - self.unfinished
        return {
            "requests": self.requests, "completed": self.completed, "unfinished": self.unfinished,
            **{m: getattr(self, m).summary() for m in METRICS},
            "goodput_rps": round(self.good / duration_s, 4) if duration_s > 0 else None,
            "goodput_fraction": round(self.good / considered, 4) if considered > 0 else None,
            "throughput_tokens_per_s": round(self.output_tokens / duration_s, 2) if duration_s > 0 else None,
            "request_rate_rps": round(self.requests / duration_s, 4) if duration_s > 0 else None,
            "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_token_ratio": round(self.cached_tokens / self.prompt_tokens, 4) if self.prompt_tokens else None,
            "accepted_draft_tokens": self.accepted_draft_tokens,
            "rejections": rejections, "errors": {k: v for k, v in self.errors.items() if k not in REJECTIONS},
            "deadline_misses": self.deadline_misses,
            "cancellations": {"sent": self.cancels_sent, "honoured": self.cancels_honoured,
                              "too_late": self.cancels_too_late, "errored": self.cancels_errored,
                              "tokens_after_cancel": self.tokens_after_cancel,
                              "ack_ms": self.cancel_ack.summary()},
            "failovers": self.failovers, "forwarded": self.forwarded, "replicas": dict(sorted(self.replicas.items())),
        }


class Recorder:
    """Everything one run measured."""

    def __init__(self, slos: dict[str, float] | None = None, t0: float = 0.0, timeline_cap: int = 20000):
        self.slos = dict(slos or {})
        for k in self.slos:
            if k not in SLO_KEYS:
                raise ValueError(f"unknown SLO {k!r}; use {', '.join(SLO_KEYS)} (milliseconds)")
        self.t0 = t0
        self.groups: dict[tuple[str, str], Group] = {}
        self.timeline: list[tuple[float, float, str]] = []  # (seconds since t0, ITL ms, region)
        self.timeline_cap = timeline_cap

    def record(self, workload: str, region: str, call, deadline_ms: float = 0.0, cut: bool = False) -> None:
        done, target = call.done, region  # the region contacted; `done` names the one that served
        region = (done.region if done is not None and done.region else target) or "?"
        g = self.groups.setdefault((region, workload), Group())
        if done is not None and done.region and target and done.region != target:
            g.forwarded += 1
        g.requests += 1
        arr = call.arrivals
        ttft = (arr[0][0] - call.t_send) * 1e3 if arr else None
        if ttft is not None:
            g.ttft.record_ms(ttft)
            if deadline_ms and ttft > deadline_ms:
                g.deadline_misses += 1
        gaps = []
        for (t1, _), (t2, _) in zip(arr, arr[1:]):
            gap = (t2 - t1) * 1e3
            gaps.append(gap)
            g.itl.record_ms(gap)
            if len(self.timeline) < self.timeline_cap:
                self.timeline.append((round(t2 - self.t0, 4), round(gap, 3), region))
        g.output_tokens += call.tokens
        if call.t_cancel:
            g.cancels_sent += 1
            g.tokens_after_cancel += call.tokens_after_cancel
            if done is not None and done.finish_reason == "abort":
                g.cancels_honoured += 1
                g.cancel_ack.record_ms((call.t_end - call.t_cancel) * 1e3)
            elif done is not None:
                g.cancels_too_late += 1
            else:
                g.cancels_errored += 1
        if done is not None:
            u = done.usage
            g.prompt_tokens += u.prompt_tokens
            g.cached_tokens += u.cached_tokens
            g.accepted_draft_tokens += u.accepted_draft_tokens
            g.failovers += done.failovers
            if done.replica:
                g.replicas[done.replica] = g.replicas.get(done.replica, 0) + 1
        if cut and done is None:
            g.unfinished += 1
            return
        if call.error is not None:
            g.errors[call.error] = g.errors.get(call.error, 0) + 1
            return
        if done is None or call.t_cancel or done.finish_reason not in ("stop", "length"):
            return
        g.completed += 1
        e2e = (call.t_end - call.t_send) * 1e3
        g.e2e.record_ms(e2e)
        tpot = (arr[-1][0] - arr[0][0]) * 1e3 / (call.tokens - 1) if len(arr) > 1 and call.tokens > 1 else None
        if tpot is not None:
            g.tpot.record_ms(tpot)
        if self._meets(ttft, tpot, max(gaps, default=0.0), e2e):
            g.good += 1

    def _meets(self, ttft, tpot, itl_max, e2e) -> bool:
        s = self.slos
        return ((ttft is not None and ttft <= s["ttft"] if "ttft" in s else True)
                and (tpot is None or tpot <= s["tpot"] if "tpot" in s else True)
                and (itl_max <= s["itl"] if "itl" in s else True)
                and (e2e <= s["e2e"] if "e2e" in s else True))

    def totals(self) -> dict[str, Group]:
        """Per region (all workloads), per workload (all regions) and overall."""
        out: dict[str, Group] = {}
        for (region, workload), g in self.groups.items():
            for key in (f"region:{region}", f"workload:{workload}", "all"):
                out.setdefault(key, Group()).merge(g)
        return out

    def summary(self, duration_s: float) -> dict:
        return {
            "slos_ms": self.slos,
            "groups": [{"region": r, "workload": w, **g.summary(duration_s)}
                       for (r, w), g in sorted(self.groups.items())],
            "totals": {k: g.summary(duration_s) for k, g in sorted(self.totals().items())},
            "timeline": self.timeline,
            "histograms": {f"{r}/{w}": {m: getattr(g, m).to_json() for m in METRICS}
                           for (r, w), g in sorted(self.groups.items())},
        }
