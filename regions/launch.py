"""Launch a whole topology on one machine: replicas, then proxies, then latency relays.

Every replica and proxy is a child process in its own process group (its engine
and workers with it), with its output in `log_dir/<name>.log`; on Linux each
child also gets SIGTERM if the launcher dies without cleaning up (PR_SET_PDEATHSIG).
Relays run inside the launcher's event loop. `stop()` closes the relays, then
SIGTERMs every proxy group (they drain), then every replica group, and SIGKILLs
whatever group is still there after `grace_s`. No orphans.

Ready checks: a replica is up when `GET /healthz` answers 200 (the model is
loaded); a proxy when its `/healthz` reports every one of its replicas ready.
After `supervise()`, a replica or proxy that exits is restarted with backoff
(`regions.supervisor`) until `stop()`.

Discovery: proxies get their replicas as `--replica` URLs ("static"), or ("dns")
find them as Kubernetes proxies do, by `--replicas-dns`: the launcher serves a
small DNS zone (`dns_zone.DnsZone`) where each replica's SRV record appears once
it is ready (`_ws._tcp.<region>.edgechat.test`).

    stack = Stack(topology.load(), routing="auto")
    await stack.start()          # prints one line per component
    ...
    await stack.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import secrets
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter

import httpx

from regions.dns_zone import DnsZone
from regions.relay import Relay
from regions.supervisor import Supervisor
from regions.topology import ROUTING_MODES, Topology

SECRET_ENV = "EDGECHAT_REPLICA_SECRET"
API_KEYS_ENV = "EDGECHAT_API_KEYS"
PEER_KEY_ENV = "EDGECHAT_PEER_KEY"
_PR_SET_PDEATHSIG = 1
DISCOVERY = ("static", "dns")
DNS_DOMAIN = "edgechat.test"  # RFC 6761: never a real name


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class LaunchError(RuntimeError):
    """A component failed to start or died; the message names it and ends with its log tail."""


@dataclass
class Component:
    kind: str  # replica | proxy | relay
    name: str
    url: str
    region: str = ""
    proc: asyncio.subprocess.Process | None = None
    relay: Relay | None = None
    log: Path | None = None
    note: str = ""
    argv: list[str] | None = None  # how it was started (a restart runs the same)
    env: dict | None = None

    def log_tail(self, n: int = 15) -> str:
        if self.log is None or not self.log.exists():
            return ""
        lines = self.log.read_text(errors="replace").splitlines()[-n:]
        return "\n".join("    | " + x for x in lines)


def speculation_note(model: str) -> str:
    """What the replicas (`--speculative auto`) do about EAGLE-3 for `model`, and how to change it."""
    from speculative.cache import TRAIN_HINT, has_head, head_dir, model_name

    try:
        folder = head_dir(model_name(model))
    except Exception as e:  # noqa: BLE001 - a note, never a reason not to serve
        return f"speculative decoding: unknown ({e})"
    if has_head(folder):
        return f"speculative decoding: EAGLE-3 head in {folder} (used where its measured policy speculates)"
    return f"speculative decoding: off, no EAGLE-3 head for this model yet; train one with {TRAIN_HINT}"


class Stack:
    def __init__(self, topo: Topology, routing: str = "auto", log_dir: str | Path | None = None,
                 out=None, python: str = sys.executable, ready_timeout_s: float | None = None,
                 relays: bool = True, grace_s: float = 10.0, discovery: str = "static"):
        if routing not in ROUTING_MODES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_MODES)}, got {routing!r}")
        if discovery not in DISCOVERY:
            raise ValueError(f"discovery must be one of {', '.join(DISCOVERY)}, got {discovery!r}")
        self.discovery = discovery
        self.zone: DnsZone | None = None
        self.topo, self.routing, self.python = topo, routing, python
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="edgechat-regions-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.out = out if out is not None else sys.stdout
        stub = topo.replica_kind == "stub"
        self.ready_timeout_s = ready_timeout_s or (30.0 if stub else 600.0)
        self.with_relays, self.grace_s = relays, grace_s
        self.replicas: list[Component] = []
        self.proxies: list[Component] = []
        self.relays: list[Component] = []
        self.env = dict(os.environ)
        self.env.setdefault(SECRET_ENV, secrets.token_hex(16))  # the replicas refuse any proxy without it
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.anonymous = not self.env.get(API_KEYS_ENV)
        if not self.anonymous and not self.env.get(PEER_KEY_ENV):
            # Proxies forward to each other with a key of tier "peer", which may name the tenant a
            # forwarded request runs for (its cache salt): one generated for this launch.
            key = "sk-peer-" + secrets.token_urlsafe(18)
            self.env[API_KEYS_ENV] += f",{key}=regions-peer:peer"
            self.env[PEER_KEY_ENV] = key
        self._stopping = False
        self.supervisor: Supervisor | None = None

    # -- URLs ------------------------------------------------------------------

    def proxy_url(self, region: str) -> str:
        return f"http://{self.topo.host}:{self.topo.region(region).proxy_port}"

    def targets(self) -> dict:
        return {**targets_for(self.topo, self.with_relays), "routing": self.routing}

    # -- start -----------------------------------------------------------------

    def _say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    async def _spawn(self, c: Component, argv: list[str], env: dict) -> None:
        c.argv, c.env = argv, env
        c.log = self.log_dir / f"{c.kind}-{c.name}.log"
        with open(c.log, "ab") as log:
            c.proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL, stdout=log,
                                                          stderr=asyncio.subprocess.STDOUT, env=env,
                                                          start_new_session=True, preexec_fn=_die_with_parent)

    def _replica_argv(self, rep, region: str) -> list[str]:
        t = self.topo
        if t.replica_kind == "stub":
            return [self.python, "-m", "stub_replica", "--host", t.host, "--port", str(rep.port), "--id", rep.id,
                    "--secret", self.env[SECRET_ENV], "--step-ms", str(t.stub_step_ms), "--jitter"]
        argv = [self.python, "-m", "replica", "--model", t.model, "--host", t.host, "--port", str(rep.port),
                "--replica-id", rep.id]
        if rep.tp > 1:
            argv += ["--tp", str(rep.tp)]
        if not rep.gpus and "--cpu-threads" not in t.replica_args:
            # CPU replicas on this one machine split its cores: several spinning pools on the same cores
            # slow every one of them (docs/perf.md, routing).
            on_cpu = sum(not r.gpus for region in t.regions for r in region.replicas)
            argv += ["--cpu-threads", str(max(1, (os.cpu_count() or 1) // max(1, on_cpu)))]
        return argv + list(t.replica_args)

    def _proxy_argv(self, region) -> list[str]:
        t = self.topo
        argv = [self.python, "-m", "edge_proxy", "--routing", self.routing, "--host", t.host,
                "--port", str(region.proxy_port), "--region", region.name, "--workers", str(region.proxy_workers),
                "--drain-timeout", "5", "--log-level", "warning"]
        if self.zone is not None:
            argv += ["--replicas-dns", srv_name(region.name), "--dns-server", self.zone.server, "--dns-interval", "1"]
        for rep in region.replicas if self.zone is None else ():
            argv += ["--replica", f"ws://{t.host}:{rep.port}/v1/replica"]
        for peer in t.peers(region.name):  # cross-region failover, through the inter-region link relay
            port = t.relay_ports[("link", region.name, peer)] if self.with_relays else t.region(peer).proxy_port
            argv += ["--peer", f"{peer}=ws://{t.host}:{port}/v1/stream@{t.rtt(region.name, peer):g}"]
        if t.replica_kind == "stub":
            argv += ["--tokenizer", "bytes"]
        if self.anonymous:
            argv += ["--allow-anonymous"]
        return argv

    async def start(self) -> None:
        """Bring everything up; on any failure stop what started and raise `LaunchError`."""
        try:
            if self.discovery == "dns":
                self.zone = await DnsZone().start(self.topo.host)
                self._say(f"dns      {DNS_DOMAIN:<10} udp+tcp {self.zone.server:<26} replicas listed once ready")
            await self._start_replicas()
            await self.start_proxies()
            if self.with_relays:
                await self._start_relays()
        except BaseException:
            await self.stop()
            raise
        keys = "anonymous access (set EDGECHAT_API_KEYS to require keys)" if self.anonymous else "API keys required"
        self._say(f"ready: {len(self.replicas)} replicas, {len(self.proxies)} proxies, {len(self.relays)} relays; "
                  f"{keys}; routing {self.routing}; logs in {self.log_dir}")
        if self.topo.replica_kind != "stub":
            self._say(speculation_note(self.topo.model))

    async def _start_replicas(self) -> None:
        t0 = perf_counter()
        for region in self.topo.regions:
            for rep in region.replicas:
                c = Component("replica", rep.id, f"http://{self.topo.host}:{rep.port}", region.name)
                env = dict(self.env)
                if rep.gpus:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, rep.gpus))
                    c.note = f"gpus {','.join(map(str, rep.gpus))}"
                await self._spawn(c, self._replica_argv(rep, region.name), env)
                self.replicas.append(c)

        listed: dict[str, list[tuple[str, int]]] = {}

        async def ready(c: Component) -> None:
            await self._wait_http(c, lambda r: r.status_code == 200)
            if self.zone is not None:  # listed once ready, as a headless Service lists ready pods
                host = f"{c.name}.{c.region}.{DNS_DOMAIN}"
                self.zone.set(host, [self.topo.host])
                listed.setdefault(c.region, []).append((host, int(c.url.rsplit(":", 1)[1])))
                self.zone.set_srv(srv_name(c.region), listed[c.region])
            self._say(f"replica  {c.name:<10} {c.url:<34} ready in {perf_counter() - t0:5.1f} s  "
                      f"(pid {c.proc.pid}{', ' + c.note if c.note else ''})")

        await asyncio.gather(*(ready(c) for c in self.replicas))

    async def start_proxies(self) -> None:
        t0 = perf_counter()
        comps = []
        for region in self.topo.regions:
            c = Component("proxy", region.name, self.proxy_url(region.name), region.name)
            await self._spawn(c, self._proxy_argv(region), self.env)
            comps.append((c, len(region.replicas)))
            self.proxies.append(c)

        async def ready(c: Component, n: int) -> None:
            await self._wait_http(c, lambda r: r.status_code == 200 and r.json().get("replicas_ready", 0) >= n)
            ws = c.url.replace("http://", "ws://", 1) + "/v1/stream"
            self._say(f"proxy    {c.name:<10} {ws:<34} ready in {perf_counter() - t0:5.1f} s  "
                      f"(OpenAI {c.url}/v1/chat/completions, {n} replicas, routing {self.routing})")

        await asyncio.gather(*(ready(c, n) for c, n in comps))
        if self.supervisor is not None:
            for c, _ in comps:
                self.supervisor.watch(c)

    async def _start_relays(self) -> None:
        t = self.topo
        jit = f" ±{t.jitter * 100:g}%" if t.jitter else ""
        for (kind, src, dst), port in t.relay_ports.items():
            if kind == "client":
                rtt = next(c for c in t.clients if c.name == src).rtt_ms[dst]
                label = f"client {src}>{dst}"
            else:
                rtt = t.rtt(src, dst)
                label = f"link {src}>{dst}"
            relay = await Relay(port, t.host, t.region(dst).proxy_port, rtt, t.jitter, host=t.host,
                                name=label).start()
            c = Component("relay", label, relay.url, dst, relay=relay)
            self.relays.append(c)
            ws = c.url.replace("http://", "ws://", 1) + "/v1/stream"
            self._say(f"relay    {label:<10} {ws:<34} rtt {rtt:g} ms{jit} -> proxy {dst}")

    async def _wait_http(self, c: Component, ok) -> None:
        deadline = perf_counter() + self.ready_timeout_s
        async with httpx.AsyncClient(trust_env=False, timeout=2.0) as http:
            while True:
                if c.proc.returncode is not None:
                    raise LaunchError(f"{c.kind} {c.name} exited with code {c.proc.returncode} while starting; "
                                      f"log {c.log}:\n{c.log_tail()}")
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    if ok(await http.get(c.url + "/healthz")):
                        return
                if perf_counter() > deadline:
                    raise LaunchError(f"{c.kind} {c.name} not ready after {self.ready_timeout_s:g} s; "
                                      f"log {c.log}:\n{c.log_tail()}")
                await asyncio.sleep(0.1)  # polling an external process: there is no event to await

    # -- run / stop ------------------------------------------------------------

    def supervise(self, **backoff) -> Supervisor:
        """From now until stop(), restart any replica or proxy that exits (regions.supervisor)."""
        if self.supervisor is None:
            self.supervisor = Supervisor(self._respawn, self._wait_ready, lambda c: _signal_group(c, signal.SIGKILL),
                                         self._say, **backoff)
            for c in self.replicas + self.proxies:
                self.supervisor.watch(c)
        return self.supervisor

    async def _respawn(self, c: Component) -> None:
        await self._spawn(c, c.argv, c.env)

    async def _wait_ready(self, c: Component) -> None:
        if c.kind == "replica":
            await self._wait_http(c, lambda r: r.status_code == 200)
        else:  # a proxy serves once any replica of its region is ready (or it forwards)
            await self._wait_http(c, lambda r: r.status_code in (200, 503) and "replicas_ready" in r.json())

    async def restart_proxies(self, routing: str) -> None:
        """Swap every proxy for one with another routing mode (replicas and relays stay)."""
        if routing not in ROUTING_MODES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_MODES)}, got {routing!r}")
        await self._terminate(self.proxies)
        self.proxies = []
        self.routing = routing
        await self.start_proxies()

    async def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        for c in self.relays:
            await c.relay.stop()
        await self._terminate(self.proxies)
        await self._terminate(self.replicas)
        if self.zone is not None:
            await self.zone.stop()
            self.zone = None
        self._stopping = False

    async def kill(self) -> None:
        """Second Ctrl-C: no waiting."""
        if self.supervisor is not None:
            await self.supervisor.release(self.proxies + self.replicas)
        for c in self.proxies + self.replicas:
            _signal_group(c, signal.SIGKILL)

    async def _terminate(self, comps: list[Component]) -> None:
        if self.supervisor is not None:
            await self.supervisor.release(comps)  # stopping on purpose: no restarts
        live = [c for c in comps if c.proc is not None]
        for c in live:
            _signal_group(c, signal.SIGTERM)

        async def reap(c: Component) -> None:
            try:
                await asyncio.wait_for(c.proc.wait(), self.grace_s)
            except TimeoutError:
                self._say(f"{c.kind} {c.name} ignored SIGTERM for {self.grace_s:g} s; killing its process group")
            _signal_group(c, signal.SIGKILL)  # whatever of the group is left (engine, workers)
            await c.proc.wait()

        await asyncio.gather(*(reap(c) for c in live))


def srv_name(region: str) -> str:
    """The SRV name of a region's replicas under `--discovery dns`."""
    return f"_ws._tcp.{region}.{DNS_DOMAIN}"


def targets_for(topo: Topology, relays: bool = True) -> dict:
    """The URLs of a topology (launched here or by `python -m regions up`), JSON-ready:
    each region's proxy, and for each client location the URL it reaches each region at
    (its relay, or the proxy itself without relays)."""
    h = topo.host

    def client_url(client: str, region: str) -> str:
        port = topo.relay_ports[("client", client, region)] if relays else topo.region(region).proxy_port
        return f"http://{h}:{port}"

    return {
        "regions": {r.name: f"http://{h}:{r.proxy_port}" for r in topo.regions},
        "clients": {c.name: {r: client_url(c.name, r) for r in c.rtt_ms} for c in topo.clients},
        "client_rtt_ms": {c.name: dict(c.rtt_ms) for c in topo.clients},
        "relays": relays,  # False: client URLs are the proxies, so measured RTTs say nothing about distance
        "links": {f"{a}>{b}": f"http://{h}:{p}" for (kind, a, b), p in topo.relay_ports.items() if kind == "link"},
    }


def _signal_group(c: Component, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(c.proc.pid, sig)
