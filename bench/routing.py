"""Prefix-aware routing on real replicas, side by side with SGLang's router.

    .venv/bin/python bench/routing.py                          # 3 default-model replicas, every run below
    .venv/bin/python bench/routing.py --runs edgechat:auto,sglang:cache_aware --workloads multi-turn
    .venv/bin/python bench/routing.py --replicas 6 --random-weights
    .venv/bin/python bench/routing.py --workloads multi-turn --runs region   # several proxies over the replicas
    .venv/bin/python bench/routing_sim.py                      # 1,000 conversations over 16 simulated replicas

Every run starts N fresh replicas (`python -m replica`; nobody starts warm), one
router in front of them, and drives a workload through the router's OpenAI API
with the official `openai` SDK (streaming, usage included; `--no-stream`: its plain
calls), then stops them all.

Workloads:
  multi-turn     12 conversations, each with its own 120-word system prompt, 4 turns,
                 6 at a time; replies of up to 48 tokens at temperature 1 (seeded)
  interleaved    the same 12 conversations, all open at once, with short answers (up to
                 16 tokens): each turn, not each conversation, waits for one of the 6
                 slots, so while 6 turns run the other conversations sit between turns
                 (invisible to any replica's load), and a replica holding 4 of them is
                 now and then running 3 of their turns while another runs none
  shared-prefix  48 users under one long system prompt, one turn each, 8 at a time

Runs (ROUTER:POLICY[:session][:pP[wW]][:random]):
  edgechat:MODE     `python -m edge_proxy --routing MODE` (auto, prefix, sticky, round_robin);
                    ":session" sends each conversation's id as `X-Session-ID`; ":p2" runs two
                    proxy processes over the same replicas (one region: `--region-proxies 2`),
                    ":p2w2" two of `--workers 2` each; a conversation's turn n goes to proxy
                    (k + n) mod P (alternating), ":random" to a seeded random one, and with
                    several processes each turn opens its own connection (no keep-alive: the
                    kernel's SO_REUSEPORT choice spreads turns over a proxy's workers, as a
                    load balancer would)
  sglang:POLICY     `sglang-router==0.3.2` (`--policy cache_aware|round_robin`), in its own venv
                    (`--sglang-venv`, created on first use); it adds SGLang-only fields
                    (`no_stop_trim`, ...) to request bodies, which our replicas reject, so each
                    worker URL is a small pass-through (this file, `--role passthrough`)
                    that keeps only the fields of the OpenAI schema
  pinned            the oracle: the client sends conversation k straight to replica k mod N
  edgechat:...@DIR  the proxies run from the checkout DIR (`git archive REV | tar -x -C DIR`): a commit
                    beside this tree's in one run (`--repeat` alternates them)
  edgechat:...@@DIR the replicas too (a replica-side change beside its parent); packages DIR
                    lacks (kernels/, speculative/: their built extensions) come from this tree

Columns: "cached" = cached prompt tokens / prompt tokens (replica usage) over turns
2-4 (multi-turn, interleaved) or all requests (shared-prefix); "oracle" = the same if
every turn had gone to the replica holding its conversation, computed from this run's
own prompts and replies with the model's tokenizer (a reply the template re-renders
into other ids makes it a slight overestimate); requests per replica from each
replica's /metrics; TTFT = the client's time to the first streamed chunk with text
(`--no-stream`: the whole request). `--json` keeps every turn (start, end, replica,
proxy and replica TTFT); `--proxy-log-level debug` logs each of edgechat's routing
decisions with the candidates it weighed (edgechat.log in `--log-dir`).

With 48 turns a run's "p99" is its slowest turn: in practice one of the six cold
first turns sent at once, whose time depends on how three engines share the
machine's cores while they prefill. `--repeat K` runs the whole list K times,
alternated (a noisy machine drifts alike for every router), and adds a pooled
table: p50 / p99 over all K x 48 turns of each run, each repeat's p99, and in how
many repeats each run's p99 was at or below SGLang cache_aware's of that repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.replica.server import free_port, stop_group  # noqa: E402  (process helpers shared with the tests)

PY = sys.executable
SECRET = "bench-routing-secret"
REPLICA_AUTH = {"Authorization": f"Bearer {SECRET}"}  # every replica endpoint but /healthz needs it
API_KEY = "sk-bench"  # the proxy's key for the bench: no practical rate limit
SGLANG_ROUTER = "sglang-router==0.3.2"
BLOCK = 16
CONVERSATIONS = ("multi-turn", "interleaved")  # workloads of conversations: cached over later turns, an oracle
DEFAULT_RUNS = {
    "multi-turn": ["pinned", "sglang:cache_aware", "edgechat:auto:session", "edgechat:auto", "edgechat:prefix",
                   "sglang:round_robin", "edgechat:round_robin"],
    "interleaved": ["pinned", "sglang:cache_aware", "edgechat:auto:session", "edgechat:auto", "edgechat:prefix",
                    "sglang:round_robin", "edgechat:round_robin"],
    "shared-prefix": ["sglang:cache_aware", "edgechat:auto", "sglang:round_robin", "edgechat:round_robin"],
}


REGION_RUNS = ["sglang:cache_aware", "edgechat:auto:session", "edgechat:auto",  # `--runs region`: issue 44's shape
               "edgechat:auto:session:p2", "edgechat:auto:p2", "edgechat:auto:session:p2w2", "edgechat:auto:p2w2",
               "edgechat:auto:session:p2:random", "edgechat:auto:p2:random"]


def proxy_tree(run: str) -> Path:
    """Where an edgechat run's proxies run from: "RUN@DIR" names another checkout (a commit to
    compare, e.g. `git archive`d), the replicas and this script staying this tree's."""
    return Path(run.partition("@")[2].removeprefix("@") or ROOT)


def replica_tree(run: str) -> Path:
    """Where a run's replicas run from: "RUN@@DIR" names another checkout for them too (the
    working directory, first on the path; what DIR lacks comes from this tree's install)."""
    return proxy_tree(run) if "@@" in run else ROOT


def run_shape(run: str) -> tuple[str, str, bool, int, int, bool]:
    """ROUTER:POLICY[:session][:pP[wW]][:random][@DIR] -> (router, policy, session, proxies, workers, random)."""
    run = run.partition("@")[0]
    router, policy, *mods = run.split(":") + ([""] if ":" not in run else [])
    session, proxies, workers, spread = False, 1, 1, False
    for m in mods:
        if m == "session":
            session = True
        elif m == "random":
            spread = True
        elif m.startswith("p") and m[1:].replace("w", "", 1).isdigit():
            p, _, w = m[1:].partition("w")
            proxies, workers = int(p), int(w or 1)
        else:
            raise ValueError(f"run {run!r}: unknown part {m!r} (session, pP[wW], random)")
    return router, policy, session, proxies, workers, spread


# -- processes ---------------------------------------------------------------------------------


def spawn(cmd: list[str], log: Path, env: dict | None = None, cwd: Path = ROOT) -> subprocess.Popen:
    f = open(log, "ab")
    return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            start_new_session=True, cwd=cwd)


def wait_http(url: str, procs: list[subprocess.Popen], timeout: float, what: str) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what} exited with {p.returncode} (see the logs in --log-dir)")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2, trust_env=False).status_code == 200:
                return
        time.sleep(0.3)
    raise TimeoutError(f"{what} not ready at {url} after {timeout:g} s")


@dataclass
class Stack:
    """N replicas and one router in front of them, as separate processes."""

    a: argparse.Namespace
    run: str
    procs: list = field(default_factory=list)
    replicas: list[str] = field(default_factory=list)  # http base URLs
    base_url: str = ""  # the router's OpenAI base (…/v1); "" for pinned
    base_urls: list[str] = field(default_factory=list)  # every proxy's (edgechat with :pP), base_url first

    def __enter__(self) -> Stack:
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for p in reversed(self.procs):
            stop_group(p)

    def _start(self) -> None:
        a, logs = self.a, Path(self.a.log_dir)
        reps = []
        for i in range(a.replicas):
            port = free_port()
            cmd = [PY, "-m", "replica", "--port", str(port), "--replica-id", f"r{i}", "--kv-memory-gb",
                   str(a.kv_memory_gb), "--speculative", "off", "--cpu-threads",
                   str(a.cpu_threads or max(1, (os.cpu_count() or 1) // a.replicas))]
            if a.random_weights:
                cmd.append("--random-weights")
            reps.append(spawn(cmd, logs / f"replica-r{i}.log", {"EDGECHAT_REPLICA_SECRET": SECRET},
                              replica_tree(self.run)))
            self.replicas.append(f"http://127.0.0.1:{port}")
        self.procs += reps
        for url in self.replicas:
            wait_http(url + "/healthz", reps, 600, "a replica")
        router, policy, _, proxies, workers, _ = run_shape(self.run)
        port = free_port()
        if router == "edgechat":
            for i in range(proxies):
                port = port if i == 0 else free_port()
                cmd = [PY, "-m", "edge_proxy", "--port", str(port), "--routing", policy, "--workers", str(workers),
                       "--region-proxies", str(proxies), "--stall-timeout", "30", "--log-level", a.proxy_log_level]
                for url in self.replicas:
                    cmd += ["--replica", url.replace("http://", "ws://") + "/v1/replica"]
                env = {"EDGECHAT_REPLICA_SECRET": SECRET,
                       "EDGECHAT_API_KEYS": f"{API_KEY}=bench:interactive:1e9:1e9"}
                self.procs.append(p := spawn(cmd, logs / f"edgechat{'' if i == 0 else i}.log", env,
                                             proxy_tree(self.run)))
                wait_http(f"http://127.0.0.1:{port}/healthz", [p], 120, "edge_proxy")
                self.base_urls.append(f"http://127.0.0.1:{port}/v1")
            self.base_url = self.base_urls[0]
        elif router == "sglang":
            relay_ports = [free_port() for _ in self.replicas]
            spec = [f"{rp}={url}" for rp, url in zip(relay_ports, self.replicas)]
            self.procs.append(r := spawn([PY, __file__, "--role", "passthrough", *spec], logs / "passthrough.log"))
            for rp in relay_ports:
                wait_http(f"http://127.0.0.1:{rp}/health", [r], 60, "the pass-through")
            cmd = [str(sglang_python(a)), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                   str(port), "--policy", policy, "--log-level", "warn", "--worker-urls",
                   *[f"http://127.0.0.1:{rp}" for rp in relay_ports]]
            self.procs.append(p := spawn(cmd, logs / "sglang-router.log"))
            wait_http(f"http://127.0.0.1:{port}/v1/models", [p], 180, "sglang-router")
            self.base_url = f"http://127.0.0.1:{port}/v1"
            self.base_urls = [self.base_url]
        elif router != "pinned":
            raise ValueError(f"unknown router in run {self.run!r}")

    def served(self) -> list[int]:
        """Finished requests per replica (its /metrics)."""
        import httpx

        out = []
        for url in self.replicas:
            text = httpx.get(url + "/metrics", timeout=10, trust_env=False, headers=REPLICA_AUTH).text
            out.append(round(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                 if line.startswith("edgechat_replica_requests_total"))))
        return out

    def proxy_metric(self, name: str) -> float | None:
        import httpx

        if not self.run.startswith("edgechat"):
            return None
        total = 0.0
        for base in self.base_urls:  # each proxy's /metrics sums its workers'
            text = httpx.get(base.removesuffix("/v1") + "/metrics", timeout=10, trust_env=False).text
            total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))
        return total

    def client_for(self, clients: list, k: int, n: int, rng: random.Random):
        """The client of conversation k's turn n: pinned, replica k mod N; several proxies, (k + n) mod P
        (":random": a seeded random one); else the one router."""
        if self.run == "pinned":
            return clients[k % len(clients)]
        return rng.choice(clients) if run_shape(self.run)[5] else clients[(k + n) % len(clients)]


def sglang_python(a) -> Path:
    """The venv holding sglang-router (created with `pip install sglang-router==0.3.2` on first use)."""
    venv = Path(a.sglang_venv)
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", SGLANG_ROUTER], check=True)
    return py


# -- the pass-through in front of each replica for SGLang's router (its own process) -------------


def passthrough_app(upstream: str):
    """An ASGI app relaying every request to `upstream`, keeping only the body fields of
    the OpenAI schema our replicas accept (SGLang's router adds its own)."""
    import httpx
    import msgspec

    from wire import openai as O

    allowed = {"/v1/chat/completions": set(O.ChatCompletionRequest.__struct_fields__),
               "/v1/completions": set(O.CompletionRequest.__struct_fields__)}
    hop = {b"host", b"content-length", b"connection", b"transfer-encoding", b"keep-alive"}
    client = httpx.AsyncClient(base_url=upstream, timeout=None, trust_env=False)
    dropped: set[str] = set()

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (msg := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await client.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        keep = allowed.get(scope["path"])
        if keep is not None and body:
            obj = msgspec.json.decode(body)
            extra = set(obj) - keep
            if extra - dropped:
                dropped.update(extra)
                print(f"pass-through drops body fields {sorted(extra)}", flush=True)
            body = msgspec.json.encode({k: v for k, v in obj.items() if k in keep})
        # Replicas take their secret, not the client's key (`replica.api.auth`).
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in hop and k.lower() != b"authorization"]
        headers.append((b"authorization", REPLICA_AUTH["Authorization"].encode()))
        path = scope["path"] + (("?" + scope["query_string"].decode()) if scope["query_string"] else "")
        req = client.build_request(scope["method"], path, content=body, headers=headers)
        resp = await client.send(req, stream=True)
        try:
            await send({"type": "http.response.start", "status": resp.status_code,
                        "headers": [(k, v) for k, v in resp.headers.raw if k.lower() not in hop]})
            async for chunk in resp.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await resp.aclose()

    return app


async def run_passthrough(specs: list[str]) -> None:
    import uvicorn

    servers = []
    for spec in specs:
        port, _, upstream = spec.partition("=")
        cfg = uvicorn.Config(passthrough_app(upstream), host="127.0.0.1", port=int(port), log_level="warning",
                             loop="uvloop", http="httptools")
        servers.append(uvicorn.Server(cfg))
    await asyncio.gather(*(s.serve() for s in servers))


# -- workloads (the client: this process, the official openai SDK) --------------------------------


@dataclass
class Turn:
    conv: int
    turn: int
    messages: list[dict]
    reply: str = ""
    finish: str = ""
    prompt_tokens: int = 0
    cached: int = 0
    ttft_ms: float = 0.0
    start_s: float = 0.0  # since the workload began
    end_s: float = 0.0
    replica: str = ""  # edgechat only: the replica that served it, and its own queue + prefill time
    replica_ttft_ms: float = 0.0
    proxy_ttft_ms: float = 0.0


def corpus():
    from loadtest.workloads import load_corpus

    return load_corpus()


def own_system_prompt(k: int, c, words: int = 120) -> str:
    """A 120-word system prompt of its own for conversation k (no full block shared with another)."""
    rng = random.Random(k)
    sentences = [s.strip() for p in c.system_prompts for s in p.split(". ") if s.strip()]
    rng.shuffle(sentences)
    out = f"You staff help desk number {k} of the {rng.choice(['north', 'south', 'east', 'west'])} office.".split()
    for s in sentences:
        out += (s.rstrip(".") + ".").split()
        if len(out) >= words:
            break
    return " ".join(out[:words])



def took(t, usage, extra: dict | None) -> None:
    """What an answer (or a streamed chunk) says of a turn: prompt and cached tokens from its usage
    (a chunk may have none), the replica and TTFTs from edgechat's extension."""
    if usage is not None:
        t.prompt_tokens = usage.prompt_tokens
        d = usage.prompt_tokens_details
        t.cached = (d.cached_tokens or 0) if d is not None else 0
    ext = (extra or {}).get("edgechat")
    if ext:
        t.replica, t.replica_ttft_ms = ext["replica"], ext["timing"]["replica_ttft_ms"]
        t.proxy_ttft_ms = ext["timing"]["ttft_ms"]

async def one_turn(client, model: str, t: Turn, a, headers: dict, max_tokens: int) -> None:
    t0 = time.perf_counter()
    t.start_s = t0 - a.began
    if not a.stream:  # one answer at the end: "TTFT" is the whole request
        r = await client.chat.completions.create(
            model=model, messages=t.messages, max_tokens=max_tokens, temperature=a.temperature,
            seed=1000 * t.conv + t.turn, extra_headers=headers)
        t.ttft_ms = (time.perf_counter() - t0) * 1e3
        t.reply, t.finish = r.choices[0].message.content or "", r.choices[0].finish_reason
        took(t, r.usage, r.model_extra)
        t.end_s = time.perf_counter() - a.began
        return
    stream = await client.chat.completions.create(
        model=model, messages=t.messages, max_tokens=max_tokens, temperature=a.temperature,
        seed=1000 * t.conv + t.turn, stream=True, stream_options={"include_usage": True}, extra_headers=headers)
    parts = []
    async for chunk in stream:
        if chunk.choices:
            ch = chunk.choices[0]
            if ch.delta.content and not t.ttft_ms:  # a proxy may send the role before any token
                t.ttft_ms = (time.perf_counter() - t0) * 1e3
            parts.append(ch.delta.content or "")
            t.finish = ch.finish_reason or t.finish
        took(t, chunk.usage, chunk.model_extra)
    t.reply = "".join(parts)
    t.end_s = time.perf_counter() - a.began


def clients_for(stack: Stack):
    import httpx
    from openai import AsyncOpenAI

    kw = dict(api_key=API_KEY, max_retries=0, timeout=900)
    if stack.base_url:
        if len(stack.base_urls) > 1 or run_shape(stack.run)[4] > 1:  # a connection per turn: spread as an LB would
            return [AsyncOpenAI(base_url=u, http_client=httpx.AsyncClient(
                limits=httpx.Limits(max_keepalive_connections=0), timeout=900, trust_env=False), **kw)
                for u in stack.base_urls]
        return [AsyncOpenAI(base_url=stack.base_url, **kw)]
    kw["api_key"] = SECRET  # straight to the replicas: their secret
    return [AsyncOpenAI(base_url=url + "/v1", **kw) for url in stack.replicas]  # pinned


async def multi_turn(stack: Stack, model: str, a, interleaved: bool = False) -> list[Turn]:
    """Conversations of `a.turns` turns, `a.concurrency` at a time; `interleaved`: all
    open at once, `a.concurrency` turns at a time (FIFO), replies of `a.short_tokens`."""
    c = corpus()
    clients = clients_for(stack)
    session = stack.run != "pinned" and run_shape(stack.run)[2]
    gate = asyncio.Semaphore(a.concurrency)
    turns: list[Turn] = []

    async def conversation(k: int) -> None:
        rng = random.Random(10_000 + k)
        spread = random.Random(20_000 + k)
        msgs = [{"role": "system", "content": own_system_prompt(k, c)}]
        headers = {"X-Session-ID": f"bench-conv-{k}"} if session else {}
        async with contextlib.nullcontext() if interleaved else gate:
            for n in range(1, a.turns + 1):
                msgs = msgs + [{"role": "user", "content": rng.choice(c.openers if n == 1 else c.followups)}]
                t = Turn(k, n, msgs)
                async with gate if interleaved else contextlib.nullcontext():
                    await one_turn(stack.client_for(clients, k, n, spread), model, t, a, headers,
                                   a.short_tokens if interleaved else a.max_tokens)
                turns.append(t)
                msgs = msgs + [{"role": "assistant", "content": t.reply}]

    await asyncio.gather(*(conversation(k) for k in range(a.conversations)))
    for cl in clients:
        await cl.close()
    return turns


async def shared_prefix(stack: Stack, model: str, a) -> list[Turn]:
    c = corpus()
    clients = clients_for(stack)
    system = {"role": "system", "content": "\n\n".join(c.system_prompts)}
    questions = c.shared_questions + c.openers
    gate = asyncio.Semaphore(a.shared_concurrency)
    turns: list[Turn] = []

    session = run_shape(stack.run)[2]

    async def user(k: int) -> None:
        t = Turn(k, 1, [system, {"role": "user", "content": questions[k % len(questions)]}])
        async with gate:
            headers = {"X-Session-ID": f"bench-user-{k}"} if session else {}
            await one_turn(clients[k % len(clients)], model, t, a, headers, a.max_tokens)
        turns.append(t)

    await asyncio.gather(*(user(k) for k in range(a.users)))
    for cl in clients:
        await cl.close()
    return turns


# -- figures -----------------------------------------------------------------------------------


def oracle_cached(turns: list[Turn], tok) -> dict[tuple[int, int], int]:
    """Per later turn: the cached tokens had it gone to the replica that served the
    conversation's previous turn (full blocks of the common prefix of its prompt and
    the previous prompt + reply; one prompt token is always computed)."""
    by = {(t.conv, t.turn): t for t in turns}
    out = {}
    for (k, n), t in by.items():
        prev = by.get((k, n - 1))
        if prev is None:
            continue
        held = tok.encode_chat(prev.messages) + tok.encode(prev.reply, add_special_tokens=False)
        if prev.finish == "stop":
            held += list(tok.eos_token_ids[:1])
        held = held[:-1]  # the last generated id is never computed
        now = tok.encode_chat(t.messages)
        common = next((i for i, (x, y) in enumerate(zip(held, now)) if x != y), min(len(held), len(now)))
        out[(k, n)] = min(common // BLOCK, (len(now) - 1) // BLOCK) * BLOCK
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarize(run: str, workload: str, turns: list[Turn], served: list[int], tok, retok: float | None) -> dict:
    later = [t for t in turns if t.turn > 1] if workload in CONVERSATIONS else turns
    prompt = sum(t.prompt_tokens for t in later)
    row = {"run": run, "workload": workload, "cached": sum(t.cached for t in later) / max(prompt, 1),
           "hits": sum(t.cached > 0 for t in later), "later": len(later), "served": served,
           "p50": pct([t.ttft_ms for t in turns], 0.5), "p99": pct([t.ttft_ms for t in turns], 0.99),
           "retokenized": retok, "turns": [dataclasses.asdict(t) | {"messages": len(t.messages)} for t in turns]}
    if workload in CONVERSATIONS:
        row["oracle"] = sum(oracle_cached(turns, tok).values()) / max(prompt, 1)
    mean = sum(served) / len(served)
    row["dev"] = max(abs(s - mean) for s in served) / mean if mean else 0.0
    return row


def label(run: str) -> tuple[str, str]:
    if run == "pinned":
        return "pinned: conversation k on replica k mod N (oracle)", "-"
    router, policy, session, proxies, workers, spread = run_shape(run)
    name = f"SGLang router 0.3.2 `{policy}`" if router == "sglang" else f"edgechat `--routing {policy}`"
    if "@" in run:
        tree = proxy_tree(run)
        name += f" (replicas and proxies from {tree})" if "@@" in run else f" ({tree})"
    if proxies > 1 or workers > 1:
        name += (f", {proxies} proxies" + (f" x {workers} workers" if workers > 1 else "")
                 + (", turns at random" if spread else ", turns alternating"))
    return name, ("yes" if session else "no") if router == "edgechat" else "no"


def print_tables(rows: list[dict], a) -> None:
    print(f"\nrouting on real replicas — {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{platform.system()} {platform.release()}, {time.strftime('%Y-%m-%d')}; {a.replicas} replicas "
          f"({'random weights' if a.random_weights else 'default model'}, CPU), replies <= {a.max_tokens} tokens "
          f"(interleaved: {a.short_tokens}) "
          f"at temperature {a.temperature:g} (seeded)")
    for workload in a.workloads:
        part = [r for r in rows if r["workload"] == workload]
        if not part:
            continue
        if workload in CONVERSATIONS:
            if workload == "multi-turn":
                print(f"\nmulti-turn: {a.conversations} conversations x {a.turns} turns, {a.concurrency} at a "
                      f"time, own 120-word system prompt each; cached over turns 2-{a.turns}")
            else:
                print(f"\ninterleaved: {a.conversations} conversations x {a.turns} turns, all open, {a.concurrency} "
                      f"turns at a time, replies <= {a.short_tokens} tokens, own 120-word system prompt each; "
                      f"cached over turns 2-{a.turns}")
            print(f"| router | session id | cached | oracle | of oracle | later turns with a hit | "
                  f"requests per replica | TTFT p50 / p99 ms |")
            print("|---|---|---:|---:|---:|---:|---|---:|")
        else:
            print(f"\nshared-prefix: {a.users} users, one ~800-token system prompt, one turn each, "
                  f"{a.shared_concurrency} at a time")
            print("| router | session id | cached | requests with a hit | requests per replica | TTFT p50 / p99 ms |")
            print("|---|---|---:|---:|---|---:|")
        for r in part:
            name, session = label(r["run"])
            served = " / ".join(map(str, r["served"])) + f" (±{r['dev']:.0%})"
            ttft = f"{r['p50']:.0f} / {r['p99']:.0f}"
            if workload in CONVERSATIONS:
                print(f"| {name} | {session} | {r['cached']:.3f} | {r['oracle']:.3f} | {r['cached'] / r['oracle']:.1%} "
                      f"| {r['hits']}/{r['later']} | {served} | {ttft} |")
            else:
                print(f"| {name} | {session} | {r['cached']:.3f} | {r['hits']}/{r['later']} | {served} | {ttft} |")
        retok = [f"{label(r['run'])[0]} {label(r['run'])[1]}: {r['retokenized']:g}" for r in part
                 if r["retokenized"] is not None]
        if retok:
            print("replies the template re-rendered into other ids (edgechat_proxy_retokenized_replies_total): "
                  + "; ".join(retok))


def print_pooled(rows: list[dict], a) -> None:
    """Per run: p50 / p99 over the turns of all its repeats, each repeat's p99, and the
    repeats whose p99 was at or below that of SGLang cache_aware in the same repeat."""
    for workload in a.workloads:
        part = [r for r in rows if r["workload"] == workload]
        names = list(dict.fromkeys(r["run"] for r in part))
        reps = {n: [r for r in part if r["run"] == n] for n in names}
        ref = reps.get("sglang:cache_aware", [])
        print(f"\n{workload}, pooled over {a.repeat} alternated repeats")
        print("| router | session id | turns | TTFT p50 / p99 ms (pooled) | p99 per repeat | "
              "repeats with p99 <= SGLang cache_aware's |")
        print("|---|---|---:|---:|---|---:|")
        for n in names:
            turns = [t["ttft_ms"] for r in reps[n] for t in r["turns"]]
            each = [r["p99"] for r in reps[n]]
            wins = sum(p <= q["p99"] for p, q in zip(each, ref))
            name, session = label(n)
            print(f"| {name} | {session} | {len(turns)} | {pct(turns, 0.5):.0f} / {pct(turns, 0.99):.0f} | "
                  f"{', '.join(f'{p:.0f}' for p in each)} | {wins}/{min(len(each), len(ref))} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--random-weights", action="store_true", help="replicas on random weights (larger N)")
    p.add_argument("--kv-memory-gb", type=float, default=0.5)
    p.add_argument("--cpu-threads", type=int, default=0,
                   help="each replica's engine threads (default: this machine's cores split over --replicas; "
                        "spinning pools of several replicas on the same cores slow every one of them)")
    p.add_argument("--workloads", default="multi-turn,interleaved,shared-prefix")
    p.add_argument("--runs", default="", help="comma-separated runs (default: the table's, per workload); \"region\": "
                                                 "SGLang, one proxy and several, alternating and random (issue 44)")
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--users", type=int, default=48)
    p.add_argument("--shared-concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48, help="replies (multi-turn, shared-prefix)")
    p.add_argument("--short-tokens", type=int, default=16, help="replies (interleaved)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--proxy-log-level", default="warning", help="edge_proxy's --log-level (debug: every "
                   "routing decision with its candidates, in edgechat.log under --log-dir)")
    p.add_argument("--no-stream", dest="stream", action="store_false",
                   help="non-streaming calls (TTFT columns are then the whole request)")
    p.add_argument("--sglang-venv", default=str(ROOT / ".cache" / "sglang-router-venv"))
    p.add_argument("--log-dir", default="", help="process logs (default: a fresh temporary folder)")
    p.add_argument("--repeat", type=int, default=1, help="run the list this many times, alternated; "
                   "adds a table pooled over the repeats")
    p.add_argument("--json", default="", help="also write the rows (with every turn) here")
    p.add_argument("--role", default="main", choices=["main", "passthrough"], help=argparse.SUPPRESS)
    p.add_argument("specs", nargs="*", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role == "passthrough":
        import uvloop

        uvloop.run(run_passthrough(a.specs))
        return
    a.workloads = [w for w in a.workloads.split(",") if w]
    for w in a.workloads:
        if w not in DEFAULT_RUNS:
            raise SystemExit(f"--workloads: {w!r} is not one of {', '.join(DEFAULT_RUNS)}")
    if not a.log_dir:
        import tempfile

        a.log_dir = tempfile.mkdtemp(prefix="bench-routing-")
    Path(a.log_dir).mkdir(parents=True, exist_ok=True)
    print(f"logs in {a.log_dir}", flush=True)
    from edge_proxy.prompt import load_tokenizer

    tok = load_tokenizer("default")
    rows = []
    for workload in a.workloads:
        runs = (REGION_RUNS if a.runs == "region" else [r for r in a.runs.split(",") if r]
                or DEFAULT_RUNS[workload]) * max(a.repeat, 1)
        for run in runs:
            if run == "pinned" and workload not in CONVERSATIONS:
                continue
            t0 = time.monotonic()
            with Stack(a, run) as st:
                import httpx

                models = httpx.get(st.replicas[0] + "/v1/models", trust_env=False, headers=REPLICA_AUTH).json()
                model = models["data"][0]["id"]
                a.began = time.perf_counter()
                turns = asyncio.run(multi_turn(st, model, a, workload == "interleaved") if workload in CONVERSATIONS
                                    else shared_prefix(st, model, a))
                row = summarize(run, workload, turns, st.served(), tok,
                                st.proxy_metric("edgechat_proxy_retokenized_replies_total"))
            rows.append(row)
            print(f"{workload} {run}: cached {row['cached']:.3f}"
                  + (f" (oracle {row['oracle']:.3f})" if "oracle" in row else "")
                  + f", served {row['served']}, TTFT p50/p99 {row['p50']:.0f}/{row['p99']:.0f} ms "
                    f"[{time.monotonic() - t0:.0f} s]", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print_tables(rows, a)
    if a.repeat > 1:
        print_pooled(rows, a)


if __name__ == "__main__":
    main()
