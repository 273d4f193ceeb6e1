"""Admission control: predict when a request would start on a replica, and refuse
at once what cannot meet its deadline (instead of letting it time out in a queue).

A replica reports (every ~0.5 s) its running and waiting requests, the prompt
tokens still to prefill (`waiting_tokens`), its recent step time and throughput.
Prefill is the queue's work, so the predicted time to first token is

    ttft ~= step_ms + (waiting_tokens + pending + prefill) / rate

where `pending` is the uncached prompt tokens (as the proxy's prefix index saw
them) this proxy sent since that report, `prefill` the new request's uncached
prompt tokens and `rate` the replica's measured prefill rate in tokens per ms
(`Load.tokens_per_s`; `default_tokens_per_s` before it has measured one).

A replica also runs at most `max_running` requests at once (its `max_num_seqs`,
reported in `Load`). When that many are ahead of a new request, it waits for a
slot: `slot_wait_ms` replays the queue, each request ahead holding its slot for
the steps it has left (`max_tokens` minus the tokens it has produced; an upper
bound, as a request may stop early, so the prediction errs late and admitted
requests keep their deadlines). Requests this proxy knows are counted exactly;
others the replica reports (another proxy's) are assumed to be like the average
of ours, or `default_remaining_steps`. The prediction adds that wait:

    ttft ~= slot_wait + step_ms + (waiting_tokens + pending + prefill) / rate

A request with a deadline is admitted where the prediction fits; batch-tier
requests are also shed once the predicted wait passes `batch_max_wait_ms`, so
interactive traffic keeps its headroom. Retry-After is how far the prediction
overshoots, in whole seconds (at least 1).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from wire import protocol as P


@dataclass(frozen=True)
class AdmissionConfig:
    default_tokens_per_s: float = 4000.0
    default_step_ms: float = 20.0
    batch_max_wait_ms: float = 5000.0
    max_inflight: int = 10_000  # per proxy worker
    default_remaining_steps: int = 256  # for requests ahead whose length this proxy does not know


@dataclass(slots=True)
class LoadView:
    step_ms: float = 0.0
    tokens_per_s: float = 0.0
    waiting_tokens: int = 0
    pending_tokens: int = 0  # uncached prompt tokens this proxy sent since the last report
    max_running: int = 0  # requests the replica runs at once; 0: unknown (no slot wait predicted)
    ahead: list[int] = field(default_factory=list)  # steps left of each request ahead, in the order they run
    unknown_ahead: int = 0  # further requests ahead (reported by the replica, not this proxy's)


def slot_wait_ms(max_running: int, ahead: list[int], step_ms: float) -> float:
    """When a slot frees for one more request, with `max_running` slots and `ahead[i]`
    steps left for the i-th request ahead (the first `max_running` hold slots now, the
    rest take each slot as it frees, in order)."""
    if max_running <= 0 or len(ahead) < max_running:
        return 0.0
    ends = sorted(ahead[:max_running])  # a sorted list is a heap
    for steps in ahead[max_running:]:
        heapq.heappush(ends, heapq.heappop(ends) + steps)
    return ends[0] * step_ms


def predict_ttft_ms(load: LoadView, prefill_tokens: int, cfg: AdmissionConfig) -> float:
    rate = (load.tokens_per_s if load.tokens_per_s > 0 else cfg.default_tokens_per_s) / 1000.0
    step = load.step_ms if load.step_ms > 0 else cfg.default_step_ms
    wait = 0.0
    if load.max_running > 0 and len(load.ahead) + load.unknown_ahead >= load.max_running:
        guess = round(sum(load.ahead) / len(load.ahead)) if load.ahead else cfg.default_remaining_steps
        wait = slot_wait_ms(load.max_running, [guess] * load.unknown_ahead + load.ahead, step)
    return wait + step + (load.waiting_tokens + load.pending_tokens + prefill_tokens) / rate


@dataclass(slots=True, frozen=True)
class Verdict:
    ok: bool
    predicted_ms: float
    retry_after_s: float = 0.0
    reason: str = ""


def admit(predicted_ms: float, deadline_ms: float, priority: int, cfg: AdmissionConfig) -> Verdict:
    if deadline_ms > 0 and predicted_ms > deadline_ms:
        return Verdict(False, predicted_ms, _retry_after(predicted_ms - deadline_ms),
                       f"predicted time to first token {predicted_ms:.0f} ms exceeds the deadline of {deadline_ms:.0f} ms")
    if priority >= P.BATCH and predicted_ms > cfg.batch_max_wait_ms:
        return Verdict(False, predicted_ms, _retry_after(predicted_ms - cfg.batch_max_wait_ms),
                       f"batch tier shed: predicted wait {predicted_ms:.0f} ms > {cfg.batch_max_wait_ms:.0f} ms")
    return Verdict(True, predicted_ms)


def _retry_after(over_ms: float) -> float:
    return float(max(1, math.ceil(over_ms / 1000.0)))
