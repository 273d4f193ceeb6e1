"""Speculation by batch size, from measurements.

A verify forward costs (batch x tree tokens) target tokens where plain decoding
costs batch tokens: once the step is compute-bound (a large batch, or any batch
on a CPU) the extra tokens stop being free and speculation loses. Where the
crossover lies depends on the device, the model and the head, so the policy is
built from bench/speculative.py's measured tokens/s: at each measured batch size
the fastest configuration, if it beats plain decoding by at least MIN_GAIN (a
draft head, extra KV and a verify step are not worth a gain inside the noise),
else none; between measured sizes the choice of the next smaller one. `bench/speculative.py --write-policy` saves it as
policy.json beside the head, tagged with the device type it was measured on; the
engine (replica/engine/speculation.py) follows it on that device type only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from speculative.cache import TRAIN_HINT, has_head
from speculative.tree_spec import TreeSpec

POLICY_FILE = "policy.json"
MIN_GAIN = 1.05  # speculation must be this much faster than plain decoding to be chosen


@dataclass(frozen=True)
class SpecPolicy:
    rules: tuple[tuple[int, TreeSpec | None], ...]  # (smallest batch size, spec from there on), ascending
    device: str = "cpu"  # device type measured on: "cpu" | "cuda"
    measured_on: str = ""  # the device's name, for people

    def for_batch(self, batch_size: int) -> TreeSpec | None:
        """The speculation a decode step of `batch_size` sequences runs (None: plain decoding)."""
        chosen = None
        for start, spec in self.rules:
            if batch_size >= start:
                chosen = spec
        return chosen

    def describe(self) -> str:
        """The policy in words, e.g. "on at batch 1-3 (chain of 3), off from 4", or "off at every
        batch size measured"."""
        if all(spec is None for _, spec in self.rules):
            return "off at every batch size measured"
        parts = []
        for i, (start, spec) in enumerate(self.rules):
            end = self.rules[i + 1][0] - 1 if i + 1 < len(self.rules) else None
            if spec is None:
                parts.append(f"off from {start}" if end is None else f"off at batch {_span(start, end)}")
            else:
                shape = f"chain of {spec.depth}" if spec.top_k == 1 else \
                    f"tree of {spec.budget}, depth {spec.depth}"
                where = f"from batch {start}" if end is None else f"at batch {_span(start, end)}"
                parts.append(f"on {where} ({shape}{', sampled drafts' if spec.sample else ''})")
        return ", ".join(parts)

    @classmethod
    def from_rates(cls, rates: dict[int, dict[TreeSpec | None, float]], device: str = "cpu",
                   measured_on: str = "", min_gain: float = MIN_GAIN) -> SpecPolicy:
        """rates[batch][spec] = measured decode tokens/s (spec None: no speculation)."""
        rules = []
        for b, r in sorted(rates.items()):
            best = max((s for s in r if s is not None), key=r.get, default=None)
            plain = r.get(None, 0.0)
            rules.append((b, best if best is not None and r[best] >= min_gain * plain else None))
        return cls(tuple(rules), device, measured_on)

    def save(self, folder: str | os.PathLike) -> Path:
        rows = [{"from_batch": b, "spec": None if s is None else vars(s)} for b, s in self.rules]
        path = Path(folder) / POLICY_FILE
        doc = {"device": self.device, "measured_on": self.measured_on, "rules": rows}
        path.write_text(json.dumps(doc, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, folder: str | os.PathLike) -> SpecPolicy | None:
        """The policy saved beside a head, or None when none was measured."""
        path = Path(folder) / POLICY_FILE
        if not path.is_file():
            return None
        doc = json.loads(path.read_text())
        rules = tuple((r["from_batch"], None if r["spec"] is None else TreeSpec(**r["spec"])) for r in doc["rules"])
        return cls(rules, doc["device"], doc.get("measured_on", ""))


def auto_choice(folder: str | os.PathLike, device: str) -> tuple[str, str]:
    """What `--speculative auto` runs with the head folder on a device type ("cpu", "cuda"):
    ("eagle3", why) only where a policy measured on that device type speculates at some
    batch size, else ("off", why). `why` is for the start line: what decided, and the fix."""
    if not has_head(folder):
        return "off", f"no EAGLE-3 head in {folder} (train one: {TRAIN_HINT})"
    measure = f"measure one here: python bench/speculative.py --write-policy --head {folder}"
    policy = SpecPolicy.load(folder)
    if policy is None:
        return "off", f"the EAGLE-3 head in {folder} has no measured policy ({measure})"
    where = policy.measured_on or policy.device
    if policy.device != device:
        return "off", f"the policy beside the EAGLE-3 head in {folder} was measured on {where}, not on {device} " \
                      f"({measure})"
    if all(spec is None for _, spec in policy.rules):
        return "off", f"the policy in {folder} (measured on {where}) never speculates"
    return "eagle3", f"EAGLE-3 head in {folder}: {policy.describe()} (measured on {where})"


def _span(a: int, b: int) -> str:
    return str(a) if a == b else f"{a}-{b}"
