"""What 8-bit activations would cost the default model in quality, before any kernel is written.

    .venv/bin/python bench/activations.py                    # every scheme, 12 held-out prompts
    .venv/bin/python bench/activations.py --prompts 24 --tokens 32 --schemes a8 a8-exact

This is how the served scheme was chosen (kernels/qgemm_cpu.py's narrow rows, `--prefill-activations`:
a8-exact-b16-static until 2026-11-28, a8-exact-static since, two instructions a block fewer): the GEMM quantized each activation row per block of 32 to int16; int8
codes run at twice the multiply-adds an instruction (`vpdpbusd`, bench/prefill.py) but move the
logits. This runs the model op by op with its GGUF weights (dequantized exactly, so only
the activations' rounding differs between schemes) and a PyTorch GEMM that rounds activations as
each scheme says:

  a16          int16 codes per 32-block: what the C++ kernel does (the reference here);
  a8           int8 codes per 32-block, every row (llama.cpp's q8_0 activations);
  a8-b16       int8 codes per 16-block;
  a8-outliers  int8, but the K columns with the 8 largest |x| in the call kept in fp32
               (LLM.int8()'s decomposition: x W^T = x_rest W^T + x_out W_out^T);
  a8-exact     int8 only for prompt rows that sample nothing (their only output is the KV
               they leave), int16 for every row that samples a token (a prompt's last row,
               every decode row): the first token and every later one see their own row exact;
  a8-exact-outliers   both.
  a8-exact-b16 int8 per 16-block for the prompt rows that sample nothing, int16 for sampling rows;
  a8-exact-static     as a8-exact, with the 8 outlier columns of each matmul fixed once per model
               (the largest |x| over `--calibration` training prompts run with a16), so a row's
               result never depends on the other rows of its call (what `--prefill-activations` serves);
  a8-exact-b16-static both (served until 2026-11-28);
  a8-exact-row-static as a8-exact-static with one int8 scale per row (per token) instead of per block.
  a8-exact-p2-static  as a8-exact-b16-static with each 16-block's scale the row's scale over a power of two
                      (2^-e, e <= 15): a block's codes then meet the others' in integers (a shift).

Per scheme: greedy answers (`--tokens` new tokens, each a full forward, so "a8-exact" marks
exactly the rows a replica's prefill would send through int8) identical to a16's, tokens before
the first divergence, the mean over answer positions of the largest |logit change| (teacher
forced on a16's conversations), and the margin of 'The' over 'L' for the README's "What is the
capital of France?" (a16: 0.08 logits: the answer the golden tests check hangs on it).
Prints a table; not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
from kernels import qgemm_cpu  # noqa: E402
from replica.config import EngineConfig  # noqa: E402
from replica.engine.llm_engine import LLMEngine  # noqa: E402
from replica.model.loader import load_checkpoint  # noqa: E402
from bench.quality import forward_logits as logits  # noqa: E402

SCHEMES = ["a16", "a8", "a8-b16", "a8-outliers", "a8-exact", "a8-exact-outliers", "a8-exact-b16", "a8-exact-static",
           "a8-exact-b16-static", "a8-exact-row-static", "a8-exact-p2-static"]
OUTLIERS = 8


class Gemm:
    """Stands in for qgemm_cpu.qgemm_ref: y = round(x) W^T with W the exact dequantized weight.
    `exact_from`: rows from this index on use int16 codes (the rows that sample)."""

    def __init__(self):
        self.weights: dict[int, torch.Tensor] = {}
        self.scheme = "a16"
        self.exact_from: int | None = None
        self.col_amax: dict[int, torch.Tensor] = {}  # per weight: the largest |x| of each input column seen (a16)
        self.static: dict[int, torch.Tensor] = {}  # per weight: its fixed outlier columns

    def weight(self, qs, d, m, bits) -> torch.Tensor:
        w = self.weights.get(id(qs))
        if w is None:
            u = qgemm_cpu.unpack_codes(qs, bits).float()
            n, k = u.shape
            w = self.weights[id(qs)] = (u.reshape(n, k // 32, 32) * d[..., None] + m[..., None]).reshape(n, k)
        return w

    @staticmethod
    def rounded(x: torch.Tensor, levels: int, block: int, pow2: bool = False) -> torch.Tensor:
        g = x.reshape(x.shape[0], -1, block)
        dx = g.abs().amax(-1, keepdim=True) / levels
        if pow2:  # the row's scale over a power of two per block: 2^-e, e = floor(log2(row max / block max)) <= 15
            row = dx.amax(1, keepdim=True)
            e = torch.floor(torch.log2(row / dx.clamp_min(1e-30))).clamp(0, 15)
            dx = torch.where(dx > 0, row * torch.exp2(-e), dx)
        q = torch.round(g / torch.where(dx > 0, dx, torch.ones_like(dx))).clamp(-levels, levels)
        return (q * dx).reshape(x.shape)

    def int8(self, x: torch.Tensor, w: torch.Tensor, key: int) -> torch.Tensor:
        block = 16 if ("b16" in self.scheme or "p2" in self.scheme) else x.shape[1] if "-row" in self.scheme else 32
        if not self.scheme.endswith(("outliers", "static")) or x.shape[0] == 0:
            return self.rounded(x, 127, block) @ w.T
        if self.scheme.endswith("static"):
            out = self.static[key]
        else:
            out = torch.zeros(x.shape[1], dtype=torch.bool)
            out[x.abs().amax(0).topk(OUTLIERS).indices] = True
        rest = x.masked_fill(out, 0.0)
        return self.rounded(rest, 127, block, "p2" in self.scheme) @ w.T + x[:, out] @ w[:, out].T

    def calibrate(self) -> None:
        """Fix each weight's outlier columns from the column maxima the a16 runs so far saw."""
        for key, amax in self.col_amax.items():
            out = torch.zeros(amax.shape[0], dtype=torch.bool)
            out[amax.topk(OUTLIERS).indices] = True
            self.static[key] = out

    def __call__(self, x, qs, d, m, bits):
        w, x = self.weight(qs, d, m, bits), x.float()
        if self.scheme == "calibrate":
            seen = x.abs().amax(0)
            self.col_amax[id(qs)] = torch.maximum(self.col_amax.get(id(qs), seen), seen)
        if self.scheme in ("a16", "calibrate"):
            return self.rounded(x, 32767, 32) @ w.T
        if "exact" not in self.scheme:
            return self.int8(x, w, id(qs))
        e0 = x.shape[0] if self.exact_from is None else self.exact_from
        return torch.cat([self.int8(x[:e0], w, id(qs)), self.rounded(x[e0:], 32767, 32) @ w.T])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", nargs="+", default=SCHEMES, choices=SCHEMES)
    ap.add_argument("--prompts", type=int, default=12, help="held-out prompts (speculative/data/prompts.json)")
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens per answer")
    ap.add_argument("--calibration", type=int, default=8, help="training prompts that fix the static outliers")
    args = ap.parse_args()
    ckpt = load_checkpoint("default", dtype=torch.float32)
    tok = ckpt.tokenizer
    heldout = json.loads((ROOT / "speculative" / "data" / "prompts.json").read_text())["heldout"][: args.prompts]
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in heldout]
    france = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    the, l_ = (tok.encode(w, add_special_tokens=False)[0] for w in ("The", "L"))
    gemm = Gemm()
    qgemm_cpu.qgemm_ref = gemm  # QLinear's unpacked path looks it up per call
    ops = dataclasses.replace(kernels.ops("cpu"), packed_qgemm=False, cpu_step=False)
    engine = LLMEngine(EngineConfig(quantization="gguf", num_blocks=1024, max_num_seqs=4, max_num_batched_tokens=4096),
                       ckpt.config, ckpt.weights, ops=ops)

    def answer(ids: list[int]) -> list[int]:
        ids, n = list(ids), len(ids)
        for _ in range(args.tokens):
            gemm.exact_from = n - 1  # the prompt's last row and every answer row sample
            ids.append(int(logits(engine, ids)[-1].argmax()))
        return ids

    if any(s.endswith("static") for s in args.schemes):
        gemm.scheme = "calibrate"
        for p in json.loads((ROOT / "speculative" / "data" / "prompts.json").read_text())["train"][: args.calibration]:
            logits(engine, tok.encode_chat([{"role": "user", "content": p}]))
        gemm.calibrate()
    gemm.scheme = "a16"
    ref = [answer(p) for p in prompts]
    ref_logits = [logits(engine, ids)[len(p) - 1:] for ids, p in zip(ref, prompts)]
    print(f"machine: {platform.machine()}; {time.strftime('%Y-%m-%d')}; {len(prompts)} held-out prompts, "
          f"{args.tokens} greedy tokens each; a16 (the served kernel's rounding) as the reference\n")
    print("| scheme | identical answers | tokens before first divergence | mean max abs logit change | "
          "France: 'The' - 'L' |")
    print("|---|---:|---:|---:|---:|")
    for scheme in args.schemes:
        gemm.scheme = scheme
        got = [answer(p) for p in prompts]
        same = sum(a == b for a, b in zip(got, ref))
        prefix = sum(next((i for i, (x, y) in enumerate(zip(a[len(p):], b[len(p):])) if x != y), args.tokens)
                     for a, b, p in zip(got, ref, prompts))
        change = []
        for ids, p, rl in zip(ref, prompts, ref_logits):
            gemm.exact_from = len(p) - 1
            change.append((logits(engine, ids)[len(p) - 1:] - rl).abs().amax(-1).mean())
        gemm.exact_from = len(france) - 1
        f = logits(engine, france)[-1]
        print(f"| {scheme} | {same}/{len(prompts)} | {prefix / (len(prompts) * args.tokens):.1%} | "
              f"{float(torch.stack(change).mean()):.3f} | {float(f[the] - f[l_]):+.3f} |", flush=True)


if __name__ == "__main__":
    main()
