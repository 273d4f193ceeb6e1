"""The service through its whole path on one device: a real replica (`python -m replica`)
behind a real proxy (`python -m edge_proxy`), driven by the official `openai` SDK.

    python3 bench/gpu_service.py                                  # GPU: llama-3.1-8b shape, 1 and 16 streams
    python3 bench/gpu_service.py --model llama-3.2-1b             # GPU: a smaller shape
    .venv/bin/python bench/gpu_service.py --model smollm2-135m --device cpu --max-tokens 16 --streams 1,4

Workload: bench/peers.py's (`session`, one turn): streaming chat completions through
the proxy, greedy, EOS ignored, exactly --max-tokens new tokens per stream; at each
stream count, one short warm-up round, then --rounds rounds of that many concurrent
streams. Printed: one markdown row per stream count, TTFT p50/p99 (request sent to
first content chunk), client ITL p50/p99 (gaps between content chunks as the SDK
yields them) and total tokens/s (the round's tokens over its wall time, averaged over
rounds), under a header naming the device (torch.cuda.get_device_name, or cpu).

--model: a shape preset of replica/presets.py (random weights: nothing to download or
carry; the replica and the proxy read the preset's byte-level tokenizer from
replica.presets) or any model the replica takes (a .gguf, a Hugging Face folder,
"default"). On an H200 (2026-11-26) llama-3.1-8b's replica took 240 s to start while
the engine drew its random weights on the CPU in bfloat16 (~37 M values/s on 16
cores; on the GPU: 1 G in 12 ms); replica/model/loader.py's load_model_for now draws them
on the engine's device. Prompts tokenize to bytes (no merges): ~720 tokens each, the
system prompt shared (prefix-cached after the first stream).

Every process started here is stopped at the end (its whole process group), also on
errors and SIGTERM; the exit status is non-zero when any stream failed (an error, or
fewer or more tokens than --max-tokens). Logs: --log-dir (default: a temporary
folder, whose tails are printed when a start fails).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import peers  # noqa: E402  (workload and API key of the CPU peers bench)
from tests.replica.server import free_port, stop_group, wait_healthy  # noqa: E402  (shared process helpers)

WARMUP_TOKENS = 8


def log(msg: str) -> None:
    peers.log(msg)


# -- processes -------------------------------------------------------------------------------


def spawn(cmd: list[str], logfile: Path, env: dict) -> subprocess.Popen:
    with open(logfile, "ab") as f:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                    [p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p]), **env})


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# -- workload ---------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


async def measure(base_url: str, streams: list[int], rounds: int, max_tokens: int, timeout: float):
    """(model, rows, failures): per stream count, TTFT / ITL percentiles in ms and tokens/s."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=peers.API_KEY, max_retries=0, timeout=timeout)
    model = (await client.models.list()).data[0].id
    rows, failures, index = [], [], 0

    async def one_round(n: int, tokens: int):
        nonlocal index
        peers.NEW_TOKENS = tokens  # peers.session's per-turn max_tokens
        t0 = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(
            *(peers.session(client, model, 1, index + i) for i in range(n)), return_exceptions=True), timeout)
        wall = time.perf_counter() - t0
        index += n
        turns = []
        for r in results:
            if isinstance(r, BaseException):
                failures.append(f"{n} streams: {type(r).__name__}: {r}")
            elif r[0].tokens != tokens:
                failures.append(f"{n} streams: {r[0].tokens} tokens, not {tokens}")
            else:
                turns.append(r[0])
        return turns, wall

    try:
        for n in streams:
            log(f"{n} stream(s): warm-up, then {rounds} rounds of {max_tokens} tokens ...")
            await one_round(n, min(WARMUP_TOKENS, max_tokens))
            ttft, gaps, rates = [], [], []
            for _ in range(rounds):
                turns, wall = await one_round(n, max_tokens)
                ttft += [t.ttft for t in turns]
                gaps += [g for t in turns for g in t.gaps]
                rates.append(sum(t.tokens for t in turns) / wall)
            if not ttft or not gaps:
                failures.append(f"{n} streams: no stream completed with two content chunks")
                continue
            rows.append({"streams": n, "ttft_p50": pct(ttft, 0.5) * 1e3, "ttft_p99": pct(ttft, 0.99) * 1e3,
                         "itl_p50": pct(gaps, 0.5) * 1e3, "itl_p99": pct(gaps, 0.99) * 1e3,
                         "tok_s": sum(rates) / len(rates)})
    finally:
        await client.close()
    return model, rows, failures


def device_name(device: str) -> str:
    if not device.startswith("cuda"):
        return "cpu"
    import torch

    return torch.cuda.get_device_name(torch.device(device))


# -- main ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b",
                    help="a PRESETS shape (random weights), or a model the replica takes (.gguf, folder, 'default')")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--dtype", default=None, help="the replica's --dtype (default: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--streams", default="1,16", help="concurrent streams per measurement, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per stream (EOS ignored)")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds per stream count")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds the replica and proxy may take to be ready, and each round")
    ap.add_argument("--kv-memory-gb", type=float, default=None,
                    help="the replica's KV pool (default: 0.25 on CPU; on CUDA what it leaves of the GPU)")
    ap.add_argument("--log-dir", default="", help="the servers' logs (default: a temporary folder)")
    args = ap.parse_args(argv)
    args.streams = [int(s) for s in args.streams.split(",") if s.strip()]
    if not args.streams or min(args.streams) < 1 or args.max_tokens < 2 or args.rounds < 1:
        ap.error("--streams needs counts >= 1, --max-tokens >= 2, --rounds >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # finally: stop the servers
    from replica.model.loader import PRESETS

    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")  # the replica's own defaults
    work = tempfile.TemporaryDirectory(prefix="edgechat-gpu-service-")
    logs = Path(args.log_dir or work.name)
    logs.mkdir(parents=True, exist_ok=True)
    procs, failures, rows, model = [], [], [], args.model
    try:
        preset = args.model in PRESETS
        spec = args.model  # a preset: its tokenizer and config from replica.presets, in both processes
        rport, pport = free_port(), free_port()
        cmd = [sys.executable, "-m", "replica", "--port", str(rport), "--model", spec, "--device", device,
               "--dtype", dtype, "--speculative", "off", "--max-num-seqs", str(max(args.streams))]
        cmd += ["--random-weights"] if preset else []
        kv = args.kv_memory_gb if args.kv_memory_gb is not None else (0.25 if device == "cpu" else None)
        cmd += ["--kv-memory-gb", str(kv)] if kv else []
        t0 = time.perf_counter()
        log(f"starting the replica on :{rport} ({' '.join(cmd[3:])}) and the proxy on :{pport}; logs in {logs}")
        procs.append(spawn(cmd, logs / "replica.log", peers.REPLICA_ENV))
        procs.append(spawn([sys.executable, "-m", "edge_proxy", "--port", str(pport), "--tokenizer", spec,
                            "--replica", f"ws://127.0.0.1:{rport}/v1/replica", "--log-level", "warning"],
                           logs / "proxy.log",
                           {"EDGECHAT_API_KEYS": f"{peers.API_KEY}=bench:interactive:1e9:1e9", **peers.REPLICA_ENV}))
        try:
            wait_healthy(f"http://127.0.0.1:{rport}", procs[0], timeout=args.timeout)
            ready = time.perf_counter() - t0
            # the proxy's /healthz is 200 once a replica is ready behind it
            wait_healthy(f"http://127.0.0.1:{pport}", procs[1], timeout=args.timeout)
        except (RuntimeError, TimeoutError) as e:
            for name in ("replica", "proxy"):
                log(f"--- {name}.log (tail) ---\n{tail(logs / f'{name}.log')}")
            raise SystemExit(f"gpu_service: not ready: {e}") from None
        log(f"replica ready after {ready:.1f} s, proxy after {time.perf_counter() - t0:.1f} s")
        model, rows, failures = asyncio.run(measure(f"http://127.0.0.1:{pport}/v1", args.streams, args.rounds,
                                                    args.max_tokens, args.timeout))
    finally:
        for p in reversed(procs):
            stop_group(p)
        work.cleanup()
    weights = "random weights" if args.model in PRESETS else "weights"
    print(f"\nedgechat service on {device_name(device)}: {model} ({weights}, {dtype}), "
          f"replica + proxy, openai SDK streaming, {args.max_tokens} tokens per stream, greedy, EOS ignored, "
          f"{args.rounds} rounds per row; {time.strftime('%Y-%m-%d')}\n")
    print("| streams | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | tokens/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['streams']} | {r['ttft_p50']:.1f} | {r['ttft_p99']:.1f} | {r['itl_p50']:.2f} | "
              f"{r['itl_p99']:.2f} | {r['tok_s']:.1f} |")
    for f in failures:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failures or len(rows) != len(args.streams) else 0


if __name__ == "__main__":
    sys.exit(main())
