"""Admission control: predict when a request would start on a replica, and refuse
at once what cannot meet its deadline (instead of letting it time out in a queue).

A replica reports (every ~0.5 s) its running and waiting requests, the prompt
tokens still to prefill (`waiting_tokens`), its recent step time and throughput.
Prefill is the queue's work, so the predicted time to first token is

    ttft ~= step_ms + (waiting_tokens + pending + prefill) / rate

where `pending` is the prompt tokens this proxy sent since that report, `prefill`
the new request's uncached prompt tokens and `rate` the replica's reported tokens
per ms (or `default_tokens_per_s` before it reports any). A request with a
deadline is admitted where the prediction fits; batch-tier requests are also
shed once the predicted wait passes `batch_max_wait_ms`, so interactive traffic
keeps its headroom. Retry-After is how far the prediction overshoots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from wire import protocol as rp


@dataclass(frozen=True)
class AdmissionConfig:
    default_tokens_per_s: float = 4000.0
    default_step_ms: float = 20.0
    batch_max_wait_ms: float = 5000.0
    max_inflight: int = 10_000  # per proxy worker


@dataclass(slots=True)
class LoadView:
    step_ms: float = 0.0
    tokens_per_s: float = 0.0
    waiting_tokens: int = 0
    pending_tokens: int = 0  # prompt tokens this proxy sent since the last report


def predict_ttft_ms(load: LoadView, prefill_tokens: int, cfg: AdmissionConfig) -> float:
    rate = (load.tokens_per_s if load.tokens_per_s > 0 else cfg.default_tokens_per_s) / 1000.0
    step = load.step_ms if load.step_ms > 0 else cfg.default_step_ms
    return step + (load.waiting_tokens + load.pending_tokens + prefill_tokens) / rate


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
    if priority >= rp.BATCH and predicted_ms > cfg.batch_max_wait_ms:
        return Verdict(False, predicted_ms, _retry_after(predicted_ms - cfg.batch_max_wait_ms),
                       f"batch tier shed: predicted wait {predicted_ms:.0f} ms > {cfg.batch_max_wait_ms:.0f} ms")
    return Verdict(True, predicted_ms)


def _retry_after(over_ms: float) -> float:
    return float(max(1, math.ceil(over_ms / 1000.0)))
