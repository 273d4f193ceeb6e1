"""`python -m replica`: serve one model replica (API process + engine process).

    python -m replica --model default --port 8000
    curl localhost:8000/v1/chat/completions -H "Authorization: Bearer $(cat SECRET_FILE)" \
        -d '{"messages":[{"role":"user","content":"Hi"}]}'

Every endpoint but /healthz needs the replica secret: $EDGECHAT_REPLICA_SECRET, or
--secret-file, or one generated for this launch (its file is printed at start-up).

The port is taken first: one already in use stops the replica at once, before the
model loads. Start-up stages are said on stderr as they end (`replica.stages`):
building kernels, loading weights, building engine, warming up (by the engine
process), then `stage: ready N s` once /healthz answers 200.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import socket
import sys
from time import perf_counter

from replica import stages
from replica.api.drain import DRAIN_TIMEOUT_S, Drain
from replica.config import SPEC_MAX_BATCH, EngineConfig
from wire.protocol import ROLES as P_ROLES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m replica", description="Serve one edgechat model replica.")
    ap.add_argument("--model", default="default",
                    help="'default' (SmolLM2-135M-Instruct GGUF), a .gguf file, a Hugging Face folder or hub id")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--replica-id", default=None, help="name reported to routers (default: host:port)")
    ap.add_argument("--role", default="both", choices=list(P_ROLES),
                    help="prefill/decode disaggregation (edge_proxy.disagg), said in its Hello: prefill (computes "
                         "prompts for decode replicas to pull; streams nothing), decode (streams; cold prompts "
                         "prefilled on a prefill replica) or both (default: serves everything itself)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: float32 on CPU, "
                                                  "bfloat16 on CUDA)")
    ap.add_argument("--quantization", default=None, choices=["none", "int8", "int4", "gguf"],
                    help="weight-only quantization on CPU (see replica/model/quant.py): gguf serves a GGUF file's own "
                         "Q4_0/Q4_1/Q8_0 blocks as stored; int8/int4 quantize the weights per block of 32 "
                         "(default: gguf for a .gguf model on CPU, else none)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-memory-gb", type=float, default=0.0,
                    help="KV pool budget (default: 1 GiB on CPU; on CUDA what --gpu-memory-utilization leaves)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float16", "float32", "int8"],
                    help="the KV pool's dtype under the C++ CPU step (auto: float16). int8 keeps a scale per "
                         "token and kv head: about half fp16's bytes, so long contexts decode faster "
                         "(docs/perf.md, long conversations); elsewhere the pool is in the model's dtype")
    ap.add_argument("--prefill-activations", default="auto", choices=["auto", "int16", "int8"],
                    help="the C++ CPU step's matmul activations for prompt tokens that sample nothing: int8 runs "
                         "their matmuls at twice int16's rate (a shorter first token) but moves the answer's logits "
                         "a little; every token that samples stays int16. auto: int8 for prompts of 128 tokens or "
                         "more (docs/perf.md, prefill)")
    ap.add_argument("--decode-activations", default="int16", choices=["int16", "int8"],
                    help="the same for decode rows (steps without drafts): int8, as llama.cpp does for every row, "
                         "shortens a busy step's matmuls by about a third (tails and tokens/s under load) but greedy "
                         "answers drift further from the fp32 model's than int16's do (docs/perf.md, decode rows on "
                         "int8 activations)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--graph-mode", default="auto", choices=["auto", "off", "buffers"],
                    help="CUDA graphs for decode steps (auto: on CUDA)")
    ap.add_argument("--fused-decode", action="store_true",
                    help="on CUDA, rotary and the KV store in one kernel and decode attention with its split merge "
                         "folded in (fewer launches a step; kernels/rope_store.py); opt-in: not yet measured on a GPU")
    ap.add_argument("--max-num-seqs", type=int, default=0,
                    help="sequences running at once (default: 64, or the step budget where it is smaller: each "
                         "decode takes a token of it; 32 on CPU)")
    ap.add_argument("--cpu-threads", type=int, default=0,
                    help="threads of the engine's math on CPU (default: every core). Replicas sharing a machine "
                         "should split its cores: spinning pools of several processes on the same cores slow "
                         "every one of them (docs/perf.md, routing)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=0,
                    help="per-step token budget while streams decode, decodes + prefill chunks (default: 512 on "
                         "CUDA; 32 on CPU, where a prefill token costs ~0.5 ms: the ITL and TTFT p99 of 16 streams, "
                         "docs/perf.md \"Tails under load\"; at least --max-num-seqs)")
    ap.add_argument("--prefill-only-tokens", type=int, default=0,
                    help="per-step token budget while nothing decodes (default: 512)")
    ap.add_argument("--max-model-len", type=int, default=0)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (one process per GPU; gloo on CPU)")
    ap.add_argument("--speculative", default="auto", choices=["auto", "off", "eagle3", "ngram"],
                    help="speculative decoding: eagle3 (a trained head, see --spec-head), ngram (prompt lookup), "
                         "or auto: eagle3 when a head for the model is there and its measured policy speculates "
                         "on this device type, else off")
    ap.add_argument("--spec-head", default="",
                    help="EAGLE-3 head folder: one trained here (`python -m speculative.train`), or one published "
                         "by SpecForge/SGLang/vLLM as it is (config.json with LlamaForCausalLMEagle3, "
                         "model.safetensors or pytorch_model.bin, d2t offsets; docs/structure.md) (default: "
                         "$EDGECHAT_EAGLE3_DIR or ~/.cache/edgechat/eagle3/<model>)")
    ap.add_argument("--spec-depth", type=int, default=4, help="draft tokens on the longest path at batch 1")
    ap.add_argument("--spec-top-k", type=int, default=1, help="EAGLE-3 tree: children per expanded node (1: chains)")
    ap.add_argument("--spec-budget", type=int, default=0, help="EAGLE-3 tree: draft tokens kept (0: --spec-depth)")
    ap.add_argument("--spec-max-batch", type=int, default=SPEC_MAX_BATCH,
                    help="without a measured policy: speculation off while more sequences decode (depth tapers "
                         "to 1 up to it)")
    ap.add_argument("--spec-policy", default="auto",
                    help="draft shape per batch size: auto (policy.json beside the head when measured on this "
                         "device type by bench/speculative.py --write-policy, else the taper), taper, or a folder")
    ap.add_argument("--spec-sample", action="store_true",
                    help="EAGLE-3 chains draw their drafts from the head at the request's temperature, verified by "
                         "rejection sampling (lossless; seeded outputs then differ from non-speculative ones)")
    ap.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S, metavar="S",
                    help="on SIGTERM or POST /v1/drain: admit nothing new, exit once the proxies moved the "
                         "running streams or after S seconds")
    ap.add_argument("--random-weights", action="store_true", help="random weights of the model's shape (timing)")
    ap.add_argument("--ssl-certfile", default="", metavar="PEM",
                    help="serve https:// and wss:// (proxies then connect with wss://; see the proxy's --replica-ca)")
    ap.add_argument("--ssl-keyfile", default="", metavar="PEM", help="the certificate's private key")
    ap.add_argument("--secret-env", default="EDGECHAT_REPLICA_SECRET",
                    help="env var holding the shared secret proxies and HTTP clients must present")
    ap.add_argument("--secret-file", default="",
                    help="without the env var: read the secret from this file, or write a generated one there "
                         "(default: a fresh one per launch in ~/.cache/edgechat/replica-secrets/HOST-PORT)")
    ap.add_argument("--metrics-token-env", default="EDGECHAT_METRICS_TOKEN",
                    help="env var holding a read-only token for scrapers: accepted for GET /metrics and refused "
                         "(403) everywhere else; must differ from the secret")
    ap.add_argument("--metrics-token-file", default="",
                    help="without the env var: read the metrics token from this file (default: none, /metrics "
                         "then needs the secret)")
    return ap.parse_args(argv)


def cuda_devices() -> int:
    """How many CUDA devices the driver sees, without importing torch (the API process
    never does): libcuda's cuInit and cuDeviceGetCount through ctypes. 0 without a
    driver, or where the installed torch is a CPU build (its version ends in +cpu)."""
    import ctypes
    from importlib import metadata

    try:
        if metadata.version("torch").endswith("+cpu"):
            return 0
        lib = ctypes.CDLL("libcuda.so.1")
    except (OSError, metadata.PackageNotFoundError):
        return 0
    n = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(n)) != 0:
        return 0
    return n.value


def gpus_given(env: dict[str, str]) -> str:
    """Why this process was handed GPUs, or "": a device list in CUDA_VISIBLE_DEVICES (a
    topology's `gpus`) or NVIDIA_VISIBLE_DEVICES (the NVIDIA container runtime and device
    plugin, i.e. a pod with nvidia.com/gpu), "" where it hides every device."""
    for var in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        value = env.get(var, "").strip()
        if value and value.lower() not in ("-1", "void", "none"):
            return f"{var}={value}"
    return ""


CUDA_FIX = ("install a CUDA build of torch into the replica's venv (`make install TORCH=torch==2.13.0` where pip "
            "reaches PyPI, whose Linux wheel is the CUDA 13 build; or the replica-cuda image, deploy/Dockerfile), "
            "or serve on the CPU with --device cpu")


def default_device(env: dict[str, str] | None = None) -> str:
    """Without --device: cuda where the driver sees a GPU or the environment hands GPUs over
    (then `check_device` holds the replica to it), else cpu."""
    return "cuda" if cuda_devices() > 0 or gpus_given(os.environ if env is None else env) else "cpu"


def check_device(device: str, requested: str | None, env: dict[str, str] | None = None) -> None:
    """A replica asked for CUDA (--device cuda, or GPUs handed over by the environment) where
    none can be used: a ValueError naming the fix, never a silent CPU replica."""
    if not device.startswith("cuda") or cuda_devices() > 0:
        return
    from importlib import metadata

    try:
        torch = f"the installed torch {metadata.version('torch')}"
    except metadata.PackageNotFoundError:
        torch = "no torch installed"
    asked = f"--device {requested}" if requested else gpus_given(os.environ if env is None else env)
    cause = f"{torch} is a CPU-only build" if torch.endswith("+cpu") else f"the CUDA driver sees no GPU ({torch})"
    raise ValueError(f"asked for CUDA ({asked}), but {cause}: {CUDA_FIX}")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    device = args.device or default_device()
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    quantization = args.quantization or default_quantization(args.model, device, args.tp, args.random_weights)
    # the step budget, at least one token a seat; the seats, at most a token of the budget each
    budget = args.max_num_batched_tokens or max(512 if device == "cuda" else 32, args.max_num_seqs)
    return EngineConfig(model=args.model, device=device, dtype=dtype, quantization=quantization,
                        block_size=args.block_size,
                        kv_memory_bytes=int(args.kv_memory_gb * (1 << 30)), kv_cache_dtype=args.kv_cache_dtype,
                        prefill_activations=args.prefill_activations, decode_activations=args.decode_activations,
                        max_num_seqs=args.max_num_seqs or min(64, budget), max_num_batched_tokens=budget,
                        prefill_only_tokens=args.prefill_only_tokens or 512,
                        max_model_len=args.max_model_len,
                        random_weights=args.random_weights, tp=args.tp,
                        gpu_memory_utilization=args.gpu_memory_utilization, graph_mode=args.graph_mode,
                        fused_decode=args.fused_decode,
                        speculative=args.speculative, spec_head=args.spec_head, spec_depth=args.spec_depth,
                        spec_top_k=args.spec_top_k, spec_budget=args.spec_budget, spec_max_batch=args.spec_max_batch,
                        spec_policy=args.spec_policy, spec_sample=args.spec_sample, cpu_threads=args.cpu_threads)


def speculation_said(cfg: EngineConfig, model: str) -> str:
    """The start line's word on speculative decoding: what the engine will run and, for
    `auto`, why (speculative.policy.auto_choice, the engine's own rule for this device type)."""
    if cfg.speculative != "auto":
        return f"speculative decoding {cfg.speculative}"
    if cfg.tp > 1:
        return "speculative decoding off: auto does not speculate with tensor parallelism yet"
    if cfg.spec_policy != "auto":
        return f"speculative decoding auto (policy: {cfg.spec_policy})"
    from speculative.cache import head_dir, model_name
    from speculative.policy import auto_choice

    kind, why = auto_choice(cfg.spec_head or head_dir(model_name(model)), cfg.device.split(":")[0])
    return f"speculative decoding {'on' if kind == 'eagle3' else 'off'}: {why}"


def default_quantization(model: str, device: str, tp: int, random_weights: bool) -> str:
    """The fastest setting that keeps quality (docs/perf.md): a GGUF file's own blocks,
    or int4 for other checkpoints, on CPU; unquantized on CUDA, with tensor
    parallelism and for random weights (the quantized kernels are CPU ones)."""
    if device != "cpu" or tp > 1 or random_weights:
        return "none"
    from replica.hf_checkpoint import resolve_model

    return "gguf" if resolve_model(model, config_only=True).endswith(".gguf") else "int4"


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound now (listening only once the engine is up, so until then
    connections are refused, as before); SO_REUSEADDR as uvicorn's own, so a restart is not
    refused by the last run's connections in TIME_WAIT. Exits naming the port if it is taken."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sys.exit(f"python -m replica: cannot listen on {host}:{port}: {e.strerror or e}; "
                 "another server there? choose another --port")
    return sock


def main(argv: list[str] | None = None) -> None:
    t0 = perf_counter()
    args = parse_args(argv)
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        sys.exit("python -m replica: TLS needs both --ssl-certfile and --ssl-keyfile")
    sock = bind(args.host, args.port)
    try:  # before anything heavy: a replica that cannot serve says so at once
        cfg = engine_config(args)
        check_device(cfg.device, args.device)
    except ValueError as e:
        sys.exit(f"python -m replica: {e}")

    import uvicorn

    from replica.api.app import create_app
    from replica.api.auth import launch_secret, metrics_token
    from replica.tokenizer import Tokenizer

    drain = Drain(args.drain_timeout)

    class Server(uvicorn.Server):
        """uvicorn's server, but a first SIGTERM drains (replica.api.drain) before it shuts down."""

        loop = None

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                self.loop = asyncio.get_running_loop()
                drain.on_drained = self.drained
                stages.say("ready", perf_counter() - t0)

        def drained(self) -> None:
            self.should_exit = True

        def handle_exit(self, sig, frame) -> None:  # a signal handler: only hand the drain to the loop
            if sig == signal.SIGTERM and self.loop is not None and not drain.started and not self.should_exit:
                self._captured_signals.append(sig)  # re-raised after the shutdown: the exit status stays SIGTERM's
                self.loop.call_soon_threadsafe(drain.start)
                return
            super().handle_exit(sig, frame)

    tokenizer = Tokenizer.from_spec(args.model)
    replica_id = args.replica_id or f"{args.host}:{args.port}"
    name = "SmolLM2-135M-Instruct" if args.model == "default" else os.path.basename(args.model.rstrip("/"))
    try:
        secret, where = launch_secret(os.environ.get(args.secret_env), args.secret_file, args.host, args.port)
    except (OSError, ValueError) as e:
        sys.exit(f"replica: no secret: {e}")
    try:
        token, token_where = metrics_token(os.environ.get(args.metrics_token_env), args.metrics_token_file)
    except (OSError, ValueError) as e:
        sys.exit(f"replica: no metrics token: {e}")
    if token == secret:
        sys.exit("replica: the metrics token must differ from the replica secret (scrapers are given it)")
    where += f"; {token_where}"
    app = create_app(cfg, tokenizer, model_name=name, replica_id=replica_id, secret=secret, metrics_token=token,
                     drain=drain, role=args.role)
    gc.freeze()  # start-up objects (tokenizer, app) are never garbage: collections skip them
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    opt_in = "".join(f", {what} {value}" for what, value, default in (
        ("decode activations", cfg.decode_activations, "int16"), ("KV cache", cfg.kv_cache_dtype, "auto"))
        if value != default)  # the opt-in numerics that change answers, said once at start
    print(f"edgechat replica {replica_id}: model {name} on {cfg.device}/{cfg.dtype}/{cfg.quantization}{opt_in}, "
          f"{'https' if args.ssl_certfile else 'http'}://{args.host}:{args.port}; {speculation_said(cfg, args.model)}; "
          f"{where}", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, loop=loop, ws="websockets-sansio",
                            log_level="warning", timeout_graceful_shutdown=5, ssl_certfile=args.ssl_certfile or None,
                            ssl_keyfile=args.ssl_keyfile or None)
    server = Server(config)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # as uvicorn.run: Ctrl-C during start-up ends quietly
        pass
    if not server.started:
        sys.exit(3)  # uvicorn's STARTUP_FAILURE, as uvicorn.run exits


if __name__ == "__main__":
    main()
