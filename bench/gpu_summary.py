"""The GPU call's figures in one file: $OUT/summary.json from the stages' tables.

    python bench/gpu_summary.py OUT_DIR        # bench/gpu.sh runs it last

Reads what the stages wrote (decode.md and peer.md from bench/decode.py, spec.md from
bench/spec_gpu.py) and writes summary.json:

  card                     the device decode.md names ("CPU (dry run ...)" on a dry run)
  decode_ms_b1             the engine's decode step at batch 1, CUDA graphs + overlap
  roofline_ms_b1           the bytes that step must read over the copy bandwidth measured in
                           the same call; decode_over_roofline_b1 their ratio
  graphs_vs_eager          every graph bucket's logits against eager decoding's: buckets,
                           max_abs_logit_diff, top1_equal of rows ({"error": ...} if it failed)
  peer_ms_b1               transformers' static-cache decode step at batch 1
  host_syncs_per_spec_step the most synchronizing calls one speculative step made
                           (torch.cuda.set_sync_debug_mode), over every configuration
  spec_step_over_plain     {"chain3": {"1": r, "4": r, "16": r}, "tree16": ..., "tree32": ...}:
                           a speculative step's time over a plain step's at that batch size
  spec_implied_speedup     {"best": x, "at": ..., "tau_source": ...}: tau x t_plain / t_spec
  start_from_disk          a replica of the 8B shape from safetensors on disk: model,
                           checkpoint_gb, start_to_ready_s, stages, engine_peak_rss_gb, served
  stages                   each stage's exit status and seconds (gpu.sh's summary lines)

A figure a stage did not produce is null (its stage failed, timed out or was not run).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

SPEC_KEYS = {"chain 3": "chain3", "tree 16": "tree16", "tree 32": "tree32", "chain 5": "chain5"}
TAU_SOURCE = ("tau of SmolLM2-135M's EAGLE-3 head trained on CPU (bench/spec_gpu.py TAU_CPU, docs/perf.md), "
              "not measured on this target: implied, not measured")


def rows(text: str) -> list[list[str]]:
    """The cells of every markdown table row (header and rule rows included)."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.lstrip().startswith("|")]


def number(cell: str) -> float | None:
    try:
        x = float(cell.rstrip("x"))
    except ValueError:
        return None
    return None if x != x else x  # nan: no figure


def decode_figures(text: str) -> dict:
    """decode.md: the graphs + overlap row at batch 1 of the first model, and the device."""
    card = re.search(r"^device: (.*?), torch", text, re.M)
    out = {"card": card.group(1) if card else None, "decode_ms_b1": None, "roofline_ms_b1": None}
    check = re.search(r"^graphs vs eager: (\d+) buckets, max abs logit diff (\S+), top-1 equal (\d+)/(\d+)$", text, re.M)
    failed = re.search(r"^graphs vs eager: (FAILED.*)$", text, re.M)
    out["graphs_vs_eager"] = ({"buckets": int(check.group(1)), "max_abs_logit_diff": number(check.group(2)),
                               "top1_equal": int(check.group(3)), "rows": int(check.group(4))} if check
                              else {"error": failed.group(1)} if failed else None)
    for r in rows(text):
        if len(r) >= 7 and r[1] == "1" and r[2] == "graphs + overlap":
            out["decode_ms_b1"], out["roofline_ms_b1"] = number(r[3]), number(r[5])
            break
    return out


def peer_figure(text: str) -> float | None:
    for r in rows(text):
        if len(r) >= 4 and r[1] == "1" and r[2].startswith("transformers"):
            return number(r[3])
    return None


def load_figures(text: str) -> dict:
    """load.md (bench/gpu_load.py): a replica's start to ready from safetensors on disk."""
    for r in rows(text):
        if len(r) >= 9 and "safetensors" in r[0]:
            return {"model": r[0].split(" (")[0], "checkpoint_gb": number(r[2].removesuffix(" GB")),
                    "start_to_ready_s": number(r[5].removesuffix(" s")), "stages": r[6],
                    "engine_peak_rss_gb": number(r[7].removesuffix(" GB")), "served": r[8]}
    return {}


def spec_figures(text: str) -> dict:
    """spec.md: per configuration and batch size, t_spec / t_plain and the implied speed-up;
    the host syncs a step made."""
    table = rows(text)
    header = next((r for r in table if r and r[0] == "step"), None)
    ratios: dict[str, dict[str, float]] = {}
    best = None
    if header is not None:
        batches = [re.match(r"batch (\d+): ms/step", h).group(1) for h in header if h.endswith("ms/step")]
        plain = next((r for r in table if r[0].startswith("plain decode")), None)
        for r in table:
            if r[0] not in SPEC_KEYS or plain is None:
                continue
            for i, b in enumerate(batches):
                t_spec, t_plain, implied = number(r[3 + 2 * i]), number(plain[3 + 2 * i]), number(r[4 + 2 * i])
                if t_spec and t_plain:
                    ratios.setdefault(SPEC_KEYS[r[0]], {})[b] = round(t_spec / t_plain, 3)
                if implied is not None and (best is None or implied > best[0]):
                    best = (implied, f"{r[0]} at batch {b}")
    syncs = [int(n) for n in re.findall(r"^host syncs per step: .*?: (\d+)$", text, re.M)]
    return {"host_syncs_per_spec_step": max(syncs) if syncs else None, "spec_step_over_plain": ratios,
            "spec_implied_speedup": {"best": best[0] if best else None, "at": best[1] if best else None,
                                     "tau_source": TAU_SOURCE}}


def summarize(out: Path, stages: list[str] = ()) -> dict:
    def read(name: str) -> str:
        p = out / name
        return p.read_text(errors="replace") if p.is_file() else ""

    s = decode_figures(read("decode.md"))
    s["decode_over_roofline_b1"] = round(s["decode_ms_b1"] / s["roofline_ms_b1"], 3) \
        if s["decode_ms_b1"] and s["roofline_ms_b1"] else None
    s["peer_ms_b1"] = peer_figure(read("peer.md"))
    s |= spec_figures(read("spec.md"))
    s["start_from_disk"] = load_figures(read("load.md")) or None
    s["stages"] = list(stages)
    return s


def main() -> None:
    out = Path(sys.argv[1])
    stages = sys.argv[2:]  # gpu.sh's "stage: rc=N in Ts" lines
    summary = summarize(out, stages)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
