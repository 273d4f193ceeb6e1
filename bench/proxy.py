"""Latency the edge proxy adds per token, against nginx and a naive Python relay.

    .venv/bin/python bench/proxy.py                          # 1, 100, 1000 streams x 20 tok/s
    .venv/bin/python bench/proxy.py --streams 100 --duration 20 --workers 2

Processes (all on 127.0.0.1): the replica stub (`python -m stub_replica`,
one token per stream every 50 ms, each stream at a random phase, every token's
text = the stub's send time), the path under test, and one client process per
run. Latency of a token = the client's receive time (taken in `data_received`,
before any parsing) minus the stub's send time; both clocks are
CLOCK_MONOTONIC, so they compare across processes. Paths:

  direct   client -> stub                (internal protocol, a socket per stream)
  nginx    client -> nginx -> stub       (Debian nginx as a plain WebSocket proxy, 1 worker)
  naive    client -> relay -> stub       (websockets + uvloop, an upstream socket per client)
  proxy    client -> edge_proxy -> stub  (public JSON protocol; one multiplexed socket to the stub)

"added" = the path's percentile minus direct's. `recv` = tokens received / tokens
the stub was due to send in the window (below 1.00: the path fell behind);
`tok/frame` > 1 means tokens were coalesced for a client that fell behind.
`hop CPU us/tok` is the CPU time of the middle process (and its children) per
token relayed: unlike latency, it hardly depends on what else the machine runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PY = sys.executable
STEP_MS = 50.0  # 20 tokens/s per stream
PROMPT = list(b"benchmark prompt")
BENCH_KEY = "sk-bench"  # an API key without a practical rate limit


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- clients (their own process) ----------------------------------------------------------


class WsClient(asyncio.Protocol):
    """Minimal WebSocket client: websockets' sans-I/O protocol for the handshake, then a
    hand-rolled parser for the server's (unmasked, unfragmented) frames, so that the
    client process costs less than what it measures. The receive time of a frame is
    taken as its bytes arrive, before any parsing or task switch."""

    def __init__(self, url: str, on_message, headers: dict | None = None):
        from websockets.client import ClientProtocol
        from websockets.uri import parse_uri

        self.proto = ClientProtocol(parse_uri(url))
        self.req = self.proto.connect()
        for k, v in (headers or {}).items():
            self.req.headers[k] = v
        self.on_message = on_message
        self.open = asyncio.get_running_loop().create_future()
        self.transport = None
        self.buf = bytearray()
        self.fast = False  # past the handshake: parse frames by hand

    def connection_made(self, transport):
        self.transport = transport
        self.proto.send_request(self.req)
        self._flush()

    def data_received(self, data):
        now = time.perf_counter_ns()
        if self.fast:
            self._frames(data, now)
            return
        from websockets.frames import Frame, Opcode
        from websockets.http11 import Response

        self.proto.receive_data(data)
        for ev in self.proto.events_received():
            if isinstance(ev, Frame):
                if ev.opcode in (Opcode.TEXT, Opcode.BINARY):
                    self.on_message(ev.data, now)
            elif isinstance(ev, Response) and not self.open.done():
                self.open.set_result(ev.status_code)
                self.fast = ev.status_code == 101
        self._flush()

    def _frames(self, data, now):
        buf = self.buf
        buf += data
        pos, n = 0, len(buf)
        while n - pos >= 2:
            b0, ln = buf[pos], buf[pos + 1] & 0x7F
            hdr = 2
            if ln == 126:
                if n - pos < 4:
                    break
                ln, hdr = int.from_bytes(buf[pos + 2:pos + 4], "big"), 4
            elif ln == 127:
                if n - pos < 10:
                    break
                ln, hdr = int.from_bytes(buf[pos + 2:pos + 10], "big"), 10
            if n - pos < hdr + ln:
                break
            op = b0 & 0x0F
            payload = bytes(buf[pos + hdr:pos + hdr + ln])
            pos += hdr + ln
            if op == 1 or op == 2:
                self.on_message(payload, now)
            elif op == 9:  # ping -> pong (client frames are masked; a zero key leaves the payload as is)
                self.transport.write(bytes([0x8A, 0x80 | len(payload)]) + b"\0\0\0\0" + payload)
            elif op == 8:
                self.transport.close()
                break
        del buf[:pos]

    def connection_lost(self, exc):
        if not self.open.done():
            self.open.set_exception(ConnectionError("closed during the handshake"))

    def _flush(self):
        out = self.proto.data_to_send()
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))

    def send_text(self, data: bytes):
        self.proto.send_text(data)
        self._flush()

    def send_binary(self, data: bytes):
        self.proto.send_binary(data)
        self._flush()


class Recorder:
    def __init__(self, t_start: int, t_end: int):
        self.t_start, self.t_end = t_start, t_end
        self.lat = array("d")  # ms
        self.tokens = 0
        self.outside = 0  # tokens received outside the window (ramp, warm-up)
        self.frames = 0
        self.errors: list[str] = []

    def stamps(self, text: str, now: int) -> None:
        if not self.t_start <= now < self.t_end:
            self.outside += text.count(";")
            return
        self.frames += 1
        for s in text.split(";"):
            if s:
                self.tokens += 1
                self.lat.append((now - int(s)) / 1e6)


async def run_clients(a) -> dict:
    import msgspec

    from wire import protocol as P

    loop = asyncio.get_running_loop()
    now = time.perf_counter_ns()
    # Connections open during the ramp; the window starts after every stream has warmed up.
    t_start = now + int((a.ramp + a.warmup) * 1e9)
    t_end = t_start + int(a.duration * 1e9)
    rec = Recorder(t_start, t_end)
    max_tokens = int((a.ramp + a.warmup + a.duration + 5) * 1000 / STEP_MS)
    host, port = "127.0.0.1", int(a.url.split(":")[2].split("/")[0])
    clients = []
    if a.path == "proxy":
        dec = msgspec.json.Decoder()

        def on_message(data, t, dec=dec, rec=rec):
            m = dec.decode(data)
            if m["type"] == "delta":
                rec.stamps(m["text"], t)
            elif m["type"] == "error":
                rec.errors.append(m["code"])

        gen = msgspec.json.encode({"type": "generate", "id": "s", "prompt": "benchmark prompt",
                                   "sampling": {"max_tokens": max_tokens, "temperature": 0}})
    else:
        codec = P.Codec()

        def on_message(data, t, codec=codec, rec=rec):
            for m in codec.decode(data):
                if type(m) is P.Tokens:
                    rec.stamps(m.text, t)

    headers = {"Authorization": f"Bearer {BENCH_KEY}"} if a.path == "proxy" else None
    for i in range(a.streams):
        _, c = await loop.create_connection(lambda: WsClient(a.url, on_message, headers), host, port)
        status = await c.open
        assert status == 101, f"handshake answered {status}"
        if a.path == "proxy":
            c.send_text(gen)
        else:
            c.send_binary(codec.encode([P.Generate(f"s{i}", PROMPT, P.SamplingParams(max_tokens=max_tokens,
                                                                                         temperature=0))]))
        clients.append(c)
        # Spread connection set-up over the ramp.
        await asyncio.sleep(max(0.0, (a.ramp * (i + 1) / a.streams) - (time.perf_counter_ns() - now) / 1e9))
    await asyncio.sleep(max(0.0, (t_end - time.perf_counter_ns()) / 1e9) + 0.2)
    for c in clients:
        c.transport.abort()
    lat = sorted(rec.lat)
    due = a.streams * a.duration * 1000 / STEP_MS

    def pct(p):
        return lat[min(len(lat) - 1, int(p / 100 * len(lat)))] if lat else float("nan")

    if rec.errors:
        raise SystemExit(f"{len(rec.errors)} requests failed: {sorted(set(rec.errors))}")
    return {"path": a.path, "streams": a.streams, "p50": pct(50), "p99": pct(99), "tokens": rec.tokens,
            "all_tokens": rec.tokens + rec.outside,
            "recv": rec.tokens / due if due else 0.0, "tok_per_frame": rec.tokens / max(rec.frames, 1)}


# -- the naive relay (its own process) -----------------------------------------------------


async def run_relay(a) -> None:
    from websockets.asyncio.client import connect
    from websockets.asyncio.server import serve
    from websockets.exceptions import ConnectionClosed

    async def pump(src, dst):
        try:
            async for msg in src:
                await dst.send(msg)
        except ConnectionClosed:
            pass
        finally:
            await dst.close()

    async def handler(client):
        async with connect(a.upstream, compression=None, proxy=None, max_queue=None) as up:
            await asyncio.gather(pump(client, up), pump(up, client))

    async with serve(handler, "127.0.0.1", a.port, compression=None, max_queue=None, ping_interval=None):
        print("READY", flush=True)
        await asyncio.Future()


# -- orchestration -----------------------------------------------------------------------------

NGINX_CONF = """
worker_processes 1;
worker_rlimit_nofile 20000;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {dir}/body;
  proxy_temp_path {dir}/proxy;
  fastcgi_temp_path {dir}/fastcgi;
  uwsgi_temp_path {dir}/uwsgi;
  scgi_temp_path {dir}/scgi;
  map $http_upgrade $connection_upgrade {{ default upgrade; '' close; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://127.0.0.1:{upstream};
      proxy_http_version 1.1;
      proxy_set_header Upgrade $http_upgrade;
      proxy_set_header Connection $connection_upgrade;
      proxy_buffering off;
      proxy_read_timeout 3600s;
    }}
  }}
}}
"""


def start(cmd: list[str], ready: str, env=None, timeout: float = 30.0) -> subprocess.Popen:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    t0 = time.time()
    for line in p.stdout:
        if ready in line:
            return p
        if time.time() - t0 > timeout:
            break
    p.kill()
    raise RuntimeError(f"{cmd[:3]} did not print {ready!r}")


def wait_http_ok(url: str, timeout: float = 20.0) -> None:
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            if httpx.get(url, trust_env=False, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} never answered 200")


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its descendants (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except OSError:
        return 0.0
    return total + sum(cpu_seconds(k) for k in kids)


def run_path(path: str, url: str, streams: int, a, hop_pid: int | None) -> dict:
    cmd = [PY, str(Path(__file__).resolve()), "--role", "clients", "--path", path, "--url", url, "--streams",
           str(streams), "--duration", str(a.duration), "--warmup", str(a.warmup), "--ramp", str(ramp(streams))]
    cpu0 = cpu_seconds(hop_pid) if hop_pid else 0.0
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=a.duration + 120)
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise RuntimeError(f"clients for {path} failed:\n{out.stderr[-2000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    cpu = cpu_seconds(hop_pid) - cpu0 if hop_pid else 0.0
    r["cpu_us_per_tok"] = cpu / r["all_tokens"] * 1e6 if hop_pid and r["all_tokens"] else float("nan")
    client_cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    r["client_us_per_tok"] = client_cpu / max(r["all_tokens"], 1) * 1e6
    return r


def ramp(streams: int) -> float:
    return min(5.0, 0.5 + streams / 400)


def orchestrate(a) -> None:
    raise_fd_limit()
    tmp = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    procs: list[subprocess.Popen] = []
    try:
        stub_port = free_port()
        procs.append(start([PY, "-m", "stub_replica", "--port", str(stub_port), "--id", "stub", "--step-ms",
                            str(STEP_MS), "--stamp", "--jitter"], "READY"))
        stub_url = f"ws://127.0.0.1:{stub_port}/v1/replica"
        urls = {"direct": stub_url}
        hops: dict[str, int | None] = {"direct": None}  # the process between client and stub
        if "nginx" in a.paths:
            if shutil.which("nginx") is None:
                raise SystemExit("nginx not found: apt-get install nginx-light (or drop it from --paths)")
            nport = free_port()
            for d in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
                (tmp / d).mkdir()
            (tmp / "nginx.conf").write_text(NGINX_CONF.format(dir=tmp, port=nport, upstream=stub_port))
            procs.append(subprocess.Popen(["nginx", "-c", str(tmp / "nginx.conf"), "-p", str(tmp)],
                                          stderr=subprocess.DEVNULL))
            hops["nginx"] = procs[-1].pid
            wait_http_ok(f"http://127.0.0.1:{nport}/healthz")
            urls["nginx"] = f"ws://127.0.0.1:{nport}/v1/replica"
        if "naive" in a.paths:
            rport = free_port()
            procs.append(start([PY, str(Path(__file__).resolve()), "--role", "relay", "--port", str(rport),
                                "--upstream", stub_url], "READY"))
            hops["naive"] = procs[-1].pid
            urls["naive"] = f"ws://127.0.0.1:{rport}/v1/replica"
        if "proxy" in a.paths:
            pport = free_port()
            env = {**os.environ, "EDGECHAT_REPLICA_SECRET": "", "EDGECHAT_API_KEYS": f"{BENCH_KEY}=bench:interactive:1e9:1e9"}
            procs.append(start([PY, "-m", "edge_proxy", "--replica", stub_url, "--port", str(pport), "--tokenizer",
                                "bytes", "--workers", str(a.workers), "--log-level", "warning",
                                "--max-inflight", "100000", "--max-connections-per-address", "100000"],
                               "listening", env=env))
            hops["proxy"] = procs[-1].pid
            wait_http_ok(f"http://127.0.0.1:{pport}/healthz")
            urls["proxy"] = f"ws://127.0.0.1:{pport}/v1/stream"

        rows = []
        load0 = os.getloadavg()[0]
        for n in a.streams:
            base = None
            for path in ["direct"] + [p for p in a.paths if p != "direct"]:
                r = run_path(path, urls[path], n, a, hops[path])
                if path == "direct":
                    base = r
                r["add50"] = r["p50"] - base["p50"]
                r["add99"] = r["p99"] - base["p99"]
                rows.append(r)
                print(f"  {n:>5} streams  {path:<7} p50 {r['p50']:7.3f} ms  p99 {r['p99']:7.3f} ms  "
                      f"recv {r['recv']:.2f}  client CPU {r['client_us_per_tok']:.1f} us/tok", file=sys.stderr,
                      flush=True)
        print_table(rows, a, (load0, os.getloadavg()[0]))
    finally:
        for p in reversed(procs):
            stop(p)
        shutil.rmtree(tmp, ignore_errors=True)


def print_table(rows: list[dict], a, load: tuple) -> None:
    print(f"\nedge proxy added latency per token — {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, {platform.system()} {platform.release()}; {1000 / STEP_MS:g} tok/s per stream, "
          f"{a.duration:g} s window, proxy workers={a.workers}; 1-min load average {load[0]:.1f} before, "
          f"{load[1]:.1f} after")
    print(f"{'streams':>7} | {'path':<7} | {'p50 ms':>7} | {'p99 ms':>7} | {'added p50':>9} | {'added p99':>9} | "
          f"{'recv':>5} | {'tok/frame':>9} | {'hop CPU us/tok':>14}")
    print("-" * 101)
    for r in rows:
        direct = r["path"] == "direct"
        add = ("" if direct else f"{r['add50']:9.3f}", "" if direct else f"{r['add99']:9.3f}")
        cpu = "" if direct else f"{r['cpu_us_per_tok']:14.1f}"
        print(f"{r['streams']:>7} | {r['path']:<7} | {r['p50']:7.3f} | {r['p99']:7.3f} | {add[0]:>9} | {add[1]:>9} | "
              f"{r['recv']:5.2f} | {r['tok_per_frame']:9.2f} | {cpu:>14}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", default="1,100,1000", help="comma-separated concurrency levels")
    p.add_argument("--paths", default="direct,nginx,naive,proxy")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--workers", type=int, default=1, help="edge proxy worker processes")
    p.add_argument("--role", default="main", choices=["main", "clients", "relay"], help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--ramp", type=float, default=1.0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--upstream", help=argparse.SUPPRESS)
    a = p.parse_args()
    import uvloop

    if a.role == "clients":
        raise_fd_limit()
        a.streams = int(a.streams)
        print(json.dumps(uvloop.run(run_clients(a))))
    elif a.role == "relay":
        raise_fd_limit()
        uvloop.run(run_relay(a))
    else:
        a.streams = [int(x) for x in a.streams.split(",")]
        a.paths = [x for x in a.paths.split(",") if x]
        orchestrate(a)


if __name__ == "__main__":
    main()
