"""Offline generation over the engine: prompts in, completions, timing and the
engine's counters out (bench/speculative.py). Every request is added at once and
continuous batching runs them to the end; nothing here runs the model itself."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from replica.engine.llm_engine import EngineStats, LLMEngine
from wire import protocol as P


@dataclass
class Generation:
    outputs: list[list[int]]  # generated ids per prompt
    stats: EngineStats  # the engine's counters over this run
    decode_s: float  # from the moment every request had its first token to the end
    decode_tokens: int  # tokens emitted in that time


def generate(engine: LLMEngine, prompts: list[list[int]], sampling: P.SamplingParams | list[P.SamplingParams],
             ) -> Generation:
    if isinstance(sampling, P.SamplingParams):
        sampling = [sampling] * len(prompts)
    before = dataclasses.replace(engine.stats)
    ids = [f"offline-{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, sampling):
        err = engine.add(P.Generate(id=rid, prompt_ids=p, sampling=sp))
        if err is not None:
            raise ValueError(f"request {rid} rejected: {err.message}")
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    waiting_first = set(ids)
    t_decode, decode_tokens = None, 0
    while engine.has_work():
        msgs = engine.step()
        for m in msgs:
            out[m.id].extend(m.ids)
            if t_decode is not None:
                decode_tokens += len(m.ids)
            elif m.ids:
                waiting_first.discard(m.id)
        if t_decode is None and not waiting_first:
            t_decode = time.perf_counter()
    t1 = time.perf_counter()
    t_decode = t_decode if t_decode is not None else t1
    stats = EngineStats(**{f.name: getattr(engine.stats, f.name) - getattr(before, f.name)
                           for f in dataclasses.fields(EngineStats)})
    return Generation([out[rid] for rid in ids], stats, t1 - t_decode, decode_tokens)
