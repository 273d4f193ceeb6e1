"""A replica's start to ready from a Hugging Face folder on disk, as a GPU user starts one
(issue 41's GPU goal): the folder written first, then `python -m replica --model FOLDER`.

    python3 bench/gpu_load.py                                      # GPU: llama-3.1-8b shape, bf16
    .venv/bin/python bench/gpu_load.py --preset smollm2-135m --device cpu --dtype float32   # the dry run

The folder: the preset's config.json and byte-level tokenizer (replica.presets) and random
weights (std 0.02, norms 1) in safetensors files of at most --file-gb each with their index,
as Hugging Face shards a checkpoint; the weights are drawn on the device and written from
there, so writing it is quick. The write leaves the files in the page cache: the start is a
warm-cache start (what a second start on a node is; a first start from a network volume adds
its read time), and the table says so. Then the replica is started on a free port and timed
until /healthz answers, with its start-up stages (`stage: ...` lines: kernels, weights,
engine, graphs) and the engine process's peak host memory (VmHWM, the sharded loader's
figure), and one greedy completion of 8 tokens through its OpenAI route proves it serves.
Prints one markdown table; exits non-zero when the replica does not become ready or the
completion fails. Every process started here is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from replica.model.loader import PRESETS, weight_shapes  # noqa: E402
from replica.presets import write_preset_folder  # noqa: E402
from tests.replica.server import free_port, stop_group, wait_healthy  # noqa: E402  (shared process helpers)


SECRET = "gpu-load"  # the replica's secret, its API's bearer (replica.api.auth)


def write_folder(preset: str, folder: Path, device: str, dtype: torch.dtype, file_bytes: int) -> tuple[int, float]:
    """The preset's folder with random weights in shards of at most `file_bytes` (one shard's
    tensors on the host at a time); (tensor bytes, seconds to write)."""
    t0 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    write_preset_folder(preset, folder)
    gen = torch.Generator(device=device).manual_seed(0)
    shards: list[list[str]] = []  # tensor names per shard, in order
    part: dict[str, torch.Tensor] = {}
    total = 0

    def flush() -> None:
        save_file(part, str(folder / f"shard-{len(shards)}"))
        shards.append(list(part))
        part.clear()

    for name, shape in weight_shapes(PRESETS[preset]).items():
        t = (torch.ones(shape, dtype=dtype, device=device) if name.endswith("norm.weight")
             else torch.randn(shape, generator=gen, device=device, dtype=dtype) * 0.02)
        if part and sum(x.nbytes for x in part.values()) + t.nbytes > file_bytes:
            flush()
        part[name] = t.cpu()
        total += t.nbytes
    flush()
    n, weight_map = len(shards), {}
    for k, names in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        (folder / f"shard-{k}").rename(folder / file)
        weight_map.update(dict.fromkeys(names, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total, time.perf_counter() - t0


def peak_rss_gb(pid: int) -> float | None:
    """VmHWM of `pid`'s engine process (the replica's child running replica.engine.process)."""
    try:
        out = subprocess.run(["pgrep", "-f", "-P", str(pid), "replica.engine.process"], capture_output=True,
                             text=True).stdout.split()
        for child in out or [str(pid)]:
            m = re.search(r"^VmHWM:\s+(\d+) kB", Path(f"/proc/{child}/status").read_text(), re.M)
            if m:
                return int(m.group(1)) / 2**20
    except OSError:
        return None
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default=None, help="a PRESETS shape (default: llama-3.1-8b on CUDA, smollm2-135m on CPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on CPU by default")
    ap.add_argument("--file-gb", type=float, default=5.0, help="largest safetensors file (Hugging Face: ~5 GB)")
    ap.add_argument("--folder", type=Path, default=None, help="where to write it (default: a temporary folder)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds the replica may take to be ready")
    args = ap.parse_args()
    preset = args.preset or ("llama-3.1-8b" if args.device == "cuda" else "smollm2-135m")
    dtype_name = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    card = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (dry run: figures mean nothing)"
    with tempfile.TemporaryDirectory(prefix="edgechat-load-") as tmp:
        folder = args.folder or Path(tmp) / preset
        nbytes, write_s = write_folder(preset, folder, args.device, dtype, int(args.file_gb * 2**30))
        files = len(list(folder.glob("*.safetensors")))
        port = free_port()
        log = Path(tmp) / "replica.log"
        cmd = [sys.executable, "-m", "replica", "--port", str(port), "--model", str(folder), "--device", args.device,
               "--dtype", dtype_name]
        t0 = time.perf_counter()
        with log.open("w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                    stdin=subprocess.DEVNULL, env=os.environ | {"EDGECHAT_REPLICA_SECRET": SECRET})
        ready = None
        try:
            try:
                wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=args.timeout)
                ready = time.perf_counter() - t0
                base, auth = f"http://127.0.0.1:{port}/v1", {"Authorization": f"Bearer {SECRET}"}
                model = httpx.get(base + "/models", headers=auth, timeout=10).json()["data"][0]["id"]
                r = httpx.post(base + "/completions", headers=auth, timeout=60, json={
                    "model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
                served = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
                answer = f"{r.status_code}, {r.json()['usage']['completion_tokens']} tokens" if r.status_code == 200 \
                    else f"{r.status_code}: {r.text[:200]}"
            except (RuntimeError, TimeoutError, httpx.HTTPError, KeyError, ValueError) as e:
                served, answer = False, f"{type(e).__name__}: {e}"
            rss = peak_rss_gb(proc.pid)
        finally:
            stop_group(proc)
        stages = re.findall(r"stage: (.+? [\d.]+ s)$", log.read_text(errors="replace"), re.M)
        ok = ready is not None and served
        print(f"device: {card}, torch {torch.__version__}\n")
        print("| model | dtype | checkpoint | files | written in | start to ready | stages | engine peak RSS | "
              "8-token completion |")
        print("|---|---|---:|---:|---:|---:|---|---:|---|")
        print(f"| {preset} (random weights, safetensors on local disk, page cache warm) | {dtype_name} | "
              f"{nbytes / 1e9:.2f} GB | {files} | {write_s:.1f} s | "
              f"{f'{ready:.1f} s' if ready is not None else 'not ready'} | {'; '.join(stages) or '-'} | "
              f"{f'{rss:.2f} GB' if rss is not None else '-'} | {answer} |", flush=True)
        if not ok:
            print(log.read_text(errors="replace")[-3000:], file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
