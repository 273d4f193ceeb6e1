"""What structured output costs on CPU: constrained against free decoding, the mask's
parts, and grammar compile time cold and cached.

    .venv/bin/python bench/structured.py                 # all three tables, default model
    .venv/bin/python bench/structured.py --steps 16 --rounds 3

Table 1: decode ms per step of the default model at batch 1 and 16, every request
free versus every request constrained by a JSON grammar (objects of a nested schema,
one per line, never complete, so every row decodes every step), side by side in one
run (interleaved rounds, the best of each), and the overhead per step and per token.
Table 2: the mask's parts at those batch sizes, timed alone: computing the rows'
masks (llguidance, the engine's mask thread; it overlaps the forward) and applying
them to the logits (unpack the bitmask, -inf where disallowed; on the sampling path).
Table 3: compiling a grammar -- the front door's check, the engine's cold compile
(matcher over the model's tokenizer + its first mask) and a cached one (a copy of the
compiled matcher + its first mask) -- for the schemas the tests use and a wide one.
The engine's very first grammar also builds llguidance's view of the tokenizer
(printed under the table).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import Future
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import decode_steps  # noqa: E402  (bench/engine.py: this script's folder is on sys.path)
from replica.config import EngineConfig  # noqa: E402
from replica.engine.llm_engine import LLMEngine  # noqa: E402
from replica.engine.grammar import Grammars, StepMask, _fill  # noqa: E402
from replica.model.loader import load_checkpoint  # noqa: E402
from replica.tokenizer import Tokenizer  # noqa: E402
from wire import structured as S  # noqa: E402
from wire import tools as T  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                "required": ["city", "country"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
    "required": ["name", "age", "address", "tags", "note"], "additionalProperties": False}
WIDE = {"type": "object", "properties": {f"field_{i}": [{"type": "string"}, {"type": "integer"}, {"type": "boolean"},
                                                         {"enum": ["x", "y", "z"]}][i % 4] for i in range(40)},
        "required": [f"field_{i}" for i in range(40)], "additionalProperties": False}
TOOLS = T.parse_tools([{"type": "function", "function": {"name": f"tool_{i}", "parameters": PERSON}}
                       for i in range(4)], "required", None)


def endless_json() -> str:
    """Objects valid against PERSON, one per line, and a sentinel no model writes: never
    complete, so a constrained row decodes as long as a free one."""
    lark = f'start: item+ "\\u2603\\u2603"\nitem: %json {json.dumps({**PERSON, "x-guidance": S.JSON_LAYOUT})} "\\n"\n'
    return S.check(S.cfg_grammar(lark), "bench")


def engine(ckpt, tok) -> LLMEngine:
    cfg = EngineConfig(num_blocks=1024, max_num_seqs=64, max_num_batched_tokens=2048, speculative="off")
    return LLMEngine(cfg, ckpt.config, ckpt.weights, tokenizer=tok)


def decode_ms(eng: LLMEngine, batch: int, steps: int, params: dict) -> float:
    return statistics.median(decode_steps(eng, batch, 64, steps, 0.8, **params)) * 1e3


def mask_parts(tok: Tokenizer, batch: int, repeats: int = 20) -> tuple[float, float]:
    """(ms to compute `batch` rows' masks, ms to apply them to (batch, V) logits), medians."""
    g = Grammars(tok, 49152, torch.device("cpu"))
    template = g.compile(endless_json()).result()
    text = json.dumps({"name": "Ada", "age": 36, "address": {"city": "London", "country": "UK"}, "tags": ["a"],
                       "note": None}) + "\n"
    ids = tok.encode(text, add_special_tokens=False)
    matchers = []
    for i in range(batch):  # rows at different points of the object
        m = template.deep_copy()
        assert m.consume_tokens(ids[: (i * 7) % len(ids)])
        matchers.append(m)
    logits = torch.randn(batch, 49152)
    compute, apply = [], []
    for _ in range(repeats):
        bitmask = torch.empty((batch, g.words), dtype=torch.int32)
        t0 = time.perf_counter()
        _fill([(m, []) for m in matchers], bitmask)
        t1 = time.perf_counter()
        done = Future()
        done.set_result(None)  # computed above: time the application alone
        g.apply(logits.clone(), StepMask(list(range(batch)), [], bitmask, done))
        t2 = time.perf_counter()
        compute.append(t1 - t0)
        apply.append(t2 - t1)
    g.close()
    return statistics.median(compute) * 1e3, statistics.median(apply) * 1e3


def compile_ms(lltok, grammar: str, repeats: int = 5) -> tuple[float, float, float]:
    """(front-door check, cold compile, cached compile) in ms; cold: an empty compile cache
    each time, over the engine's one llguidance tokenizer (built and warmed at its first grammar)."""
    check, cold, cached = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        S.check(grammar, "bench")
        check.append(time.perf_counter() - t0)
        g = Grammars(None, 49152, torch.device("cpu"))
        g._lltok = lltok
        t0 = time.perf_counter()
        template = g._compile(grammar)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        template.deep_copy().compute_bitmask()
        cached.append(time.perf_counter() - t0)
    return tuple(statistics.median(x) * 1e3 for x in (check, cold, cached))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    ckpt = load_checkpoint("default")
    tok = Tokenizer.from_spec("default")
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; default model on CPU, float32\n")
    eng = engine(ckpt, tok)
    grammar = endless_json()
    decode_ms(eng, 2, 4, {"grammar": grammar})  # warm-up (and the grammar compiled once)
    print(f"| batch | free ms/step | constrained ms/step | overhead ms/step | overhead ms/token | overhead "
          f"(best of {args.rounds}) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        best = {"free": float("inf"), "constrained": float("inf")}
        for _ in range(args.rounds):  # interleaved, best of the rounds: others' load hits both alike
            best["free"] = min(best["free"], decode_ms(eng, batch, args.steps, {}))
            best["constrained"] = min(best["constrained"], decode_ms(eng, batch, args.steps, {"grammar": grammar}))
        d = best["constrained"] - best["free"]
        print(f"| {batch} | {best['free']:.1f} | {best['constrained']:.1f} | {d:+.2f} | {d / batch:+.3f} | "
              f"{100 * d / best['free']:+.1f} % |")
    print("\n| batch | compute the masks, ms/step (mask thread) | apply them, ms/step | apply, ms/token |")
    print("|---:|---:|---:|---:|")
    for batch in args.batches:
        c, a = mask_parts(tok, batch)
        print(f"| {batch} | {c:.3f} | {a:.3f} | {a / batch:.3f} |")
    print("\n| grammar | front-door check ms | cold compile ms | cached ms |")
    print("|---|---:|---:|---:|")
    cases = {"json_object": S.json_object_grammar(), "nested schema (5 fields)": S.json_schema_grammar(PERSON),
             "wide schema (40 fields)": S.json_schema_grammar(WIDE), "regex": S.regex_grammar(r"[0-9]{3}-[a-z]{2,8}"),
             "tool_choice required (4 tools)": T.Hermes().grammar(TOOLS)}
    warm = Grammars(tok, 49152, torch.device("cpu"))
    warm.compile(S.regex_grammar("a")).result()  # the engine's first grammar: builds the tokenizer's tables
    for name, g in cases.items():
        check, cold, cached = compile_ms(warm._lltok, g)
        print(f"| {name} | {check:.2f} | {cold:.2f} | {cached:.3f} |")
    t0 = time.perf_counter()
    Grammars(tok, 49152, torch.device("cpu")).compile(S.regex_grammar("a")).result()
    print(f"\nOnce per engine, at its first grammar: the tokenizer's tables and that grammar, "
          f"{(time.perf_counter() - t0) * 1e3:.0f} ms.")


if __name__ == "__main__":
    main()
