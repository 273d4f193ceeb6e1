"""Launch a whole topology on one machine: replicas, then proxies, then latency relays.

Every replica and proxy is a child process in its own process group (its engine
and workers with it), with its output in `log_dir/<name>.log`; on Linux each
child also gets SIGTERM if the launcher dies without cleaning up (PR_SET_PDEATHSIG).
Relays run inside the launcher's event loop. `stop()` closes the relays, then
SIGTERMs every proxy group (they drain), then every replica group, and SIGKILLs
whatever group is still there after `grace_s`. No orphans.

Before anything starts, every port the topology listens on is tried
(`check_ports`): one already in use stops the launch at once, naming the port, what
holds it and a free `--port` to use instead.

Ready checks: a replica is up when `GET /healthz` answers 200 (the model is
loaded); a proxy when its `/healthz` reports every one of its replicas ready; and
either only if the socket listening on its port is its own process's (or its
children's: `regions.listeners`), never another launch's answering on the same port.
While a replica starts, its start-up stages (`replica.stages` lines in its log) are
shown as they end: `  eu-0: loading weights 1.3 s`; a stage past two seconds says
so when it gets there (`  eu-0: building kernels ...`).
After `supervise()`, a replica or proxy that exits is restarted with backoff
(`regions.supervisor`) until `stop()`.

Metrics: every proxy's and replica's `/metrics`. A replica's takes the launch's replica
secret, which the launcher writes (mode 600) to `log_dir/replica-secret` and removes at
`stop()`; `targets()` (so the run file `regions.running` writes, and `--targets FILE`)
names it in "replica_secret_file" and lists the replicas' URLs under "replicas", and the
launcher prints the command that scrapes one before its "ready:" line.

Discovery: proxies get their replicas as `--replica` URLs ("static"), or ("dns")
find them as Kubernetes proxies do, by `--replicas-dns`: the launcher serves a
small DNS zone (`dns_zone.DnsZone`) where each replica's SRV record appears once
it is ready (`_ws._tcp.<region>.edgechat.test`).

    stack = Stack(topology.load(), routing="auto")
    await stack.start()          # prints where the logs go, stages, one line per component
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

from regions import listeners
from regions.dns_zone import DnsZone
from regions.relay import Relay
from regions.supervisor import Supervisor
from regions.topology import ROUTING_MODES, Topology, TopologyError, shift_ports
from replica import stages

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


class PortsBusy(LaunchError):
    """A port the topology needs is taken: nothing was started."""


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
    log_pos: int = 0  # how far the launcher has read its log (stage lines)
    log_rest: bytes = b""  # a last line not yet ended

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def log_tail(self, n: int = 15) -> str:
        if self.log is None or not self.log.exists():
            return ""
        lines = self.log.read_text(errors="replace").splitlines()[-n:]
        return "\n".join("    | " + x for x in lines)


def speculation_note(model: str, device: str = "cpu") -> str:
    """What the replicas (`--speculative auto`) on `device` ("cpu", "cuda") do about EAGLE-3
    for `model`, and how to change it (speculative.policy.auto_choice: the engine's rule)."""
    from speculative.cache import head_dir, model_name
    from speculative.policy import auto_choice

    try:
        kind, why = auto_choice(head_dir(model_name(model)), device)
    except Exception as e:  # noqa: BLE001 - a note, never a reason not to serve
        return f"speculative decoding: unknown ({e})"
    return f"speculative decoding: {'on' if kind == 'eagle3' else 'off'}, {why}"


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
        self.log_dir = Path(log_dir) if log_dir else None  # made by start(), once the ports are known to be free
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
        self.secret_file: Path | None = None  # the replicas' secret, for scrapers of their /metrics (start())

    # -- URLs ------------------------------------------------------------------

    def proxy_url(self, region: str) -> str:
        return f"http://{self.topo.host}:{self.topo.region(region).proxy_port}"

    def targets(self) -> dict:
        replicas = {rep.id: f"http://{self.topo.host}:{rep.port}" for r in self.topo.regions for rep in r.replicas}
        secret = {"replica_secret_file": str(self.secret_file)} if self.secret_file is not None else {}
        return {**targets_for(self.topo, self.with_relays), "routing": self.routing, "replicas": replicas, **secret}

    def _write_secret(self) -> None:
        """The replicas' secret in `log_dir/replica-secret`, mode 600 from its creation (written
        beside, then renamed over a previous launch's), so a scraper of their /metrics can present it."""
        path = self.log_dir / "replica-secret"
        tmp = path.with_name(f".replica-secret.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.env[SECRET_ENV] + "\n")
        os.replace(tmp, path)
        self.secret_file = path

    # -- start -----------------------------------------------------------------

    def _say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    async def _spawn(self, c: Component, argv: list[str], env: dict) -> None:
        c.argv, c.env = argv, env
        c.log = self.log_dir / f"{c.kind}-{c.name}.log"
        with open(c.log, "ab") as log:
            c.log_pos, c.log_rest = log.tell(), b""  # stages of this start only (a restart appends)
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
        if rep.role != "both":
            argv += ["--role", rep.role]
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
        # the replicas' own tokenizer ("default", a folder, a .gguf, a preset): a proxy refuses replicas of another
        argv += ["--tokenizer", "bytes" if t.replica_kind == "stub" else t.model]
        if self.anonymous:
            argv += ["--allow-anonymous"]
        return argv + list(t.proxy_args)

    async def start(self, on_up=None) -> None:
        """Bring everything up; on any failure stop what started and raise `LaunchError`
        (`PortsBusy`, before anything started, when a port is taken). `on_up()` runs once
        all is up, before the "ready:" line (so whatever it writes is there when that is read)."""
        check_ports(self.topo, self.with_relays)
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="edgechat-regions-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        n = sum(len(r.replicas) for r in self.topo.regions)
        slow = "" if self.topo.replica_kind == "stub" else \
            " (a first start compiles kernels and loads weights: minutes; each stage is shown as it ends)"
        self._say(f"regions: logs in {self.log_dir}; starting {n} replica{'s' if n != 1 else ''}{slow}")
        try:
            self._write_secret()
            if self.discovery == "dns":
                self.zone = await DnsZone().start(self.topo.host)
                self._say(f"dns      {DNS_DOMAIN:<10} udp+tcp {self.zone.server:<26} replicas listed once ready")
            await self._start_replicas()
            await self.start_proxies()
            if self.with_relays:
                await self._start_relays()
            if on_up is not None:
                on_up()
        except BaseException:
            await self.stop()
            raise
        for rep in list(self.targets()["replicas"].values())[:1]:
            self._say(f"metrics  proxies: {self.proxy_url(self.topo.regions[0].name)}/metrics; replicas take the "
                      f"launch's secret: curl -H \"Authorization: Bearer $(cat {self.secret_file})\" {rep}/metrics")
        keys = "anonymous access (set EDGECHAT_API_KEYS to require keys)" if self.anonymous else "API keys required"
        self._say(f"ready: {len(self.replicas)} replicas, {len(self.proxies)} proxies, {len(self.relays)} relays; "
                  f"{keys}; routing {self.routing}; logs in {self.log_dir}")
        if self.topo.replica_kind != "stub":
            gpus = any(rep.gpus for region in self.topo.regions for rep in region.replicas)
            self._say(speculation_note(self.topo.model, "cuda" if gpus or "cuda" in " ".join(
                self.topo.replica_args) else "cpu"))

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
        self._say(f"regions: starting {len(self.topo.regions)} proxies (routing {self.routing})")
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
            try:
                relay = await Relay(port, t.host, t.region(dst).proxy_port, rtt, t.jitter, host=t.host,
                                    name=label).start()
            except OSError as e:  # taken since check_ports
                raise LaunchError(f"relay {label}: cannot listen on port {port}: {e.strerror}; "
                                  f"{port_hint(t, self.with_relays)}") from None
            c = Component("relay", label, relay.url, dst, relay=relay)
            self.relays.append(c)
            ws = c.url.replace("http://", "ws://", 1) + "/v1/stream"
            self._say(f"relay    {label:<10} {ws:<34} rtt {rtt:g} ms{jit} -> proxy {dst}")

    async def _wait_http(self, c: Component, ok) -> None:
        deadline = perf_counter() + self.ready_timeout_s
        async with httpx.AsyncClient(trust_env=False, timeout=2.0) as http:
            while True:
                self._show_stages(c)
                if c.proc.returncode is not None:
                    self._show_stages(c)
                    raise LaunchError(f"{c.kind} {c.name} exited with code {c.proc.returncode} while starting; "
                                      f"log {c.log}:\n{c.log_tail()}")
                answered = False
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    answered = ok(await http.get(c.url + "/healthz"))
                if answered and self._listener_is_ours(c):
                    self._show_stages(c)
                    return
                if perf_counter() > deadline:
                    raise LaunchError(f"{c.kind} {c.name} not ready after {self.ready_timeout_s:g} s; "
                                      f"log {c.log}:\n{c.log_tail()}")
                await asyncio.sleep(0.1)  # polling an external process: there is no event to await

    def _listener_is_ours(self, c: Component) -> bool:
        """Whether what answered on c's port is c's process (or its children); raises
        `LaunchError` when it is another process's: never report another launch as ours."""
        owner = listeners.owner_check(c.proc.pid, c.port)
        if owner is None or owner[0]:
            return True
        if c.proc.returncode is not None:
            return False  # the caller reports the exit
        others = ", ".join(listeners.describe(p) for p in owner[1]) or "a process this user cannot see"
        raise LaunchError(f"{c.kind} {c.name}: port {c.port} is answered by {others}, not by this launch's "
                          f"{c.kind} (pid {c.proc.pid}); another stack serves there: stop it, or "
                          f"{port_hint(self.topo, self.with_relays)}")

    def _show_stages(self, c: Component) -> None:
        """Say the stage lines c wrote to its log since last read (replica.stages), as `  NAME: stage 1.3 s`."""
        if c.log is None or c.kind != "replica":
            return
        try:
            with open(c.log, "rb") as f:
                f.seek(c.log_pos)
                data = f.read()
        except OSError:
            return
        c.log_pos += len(data)
        *done, c.log_rest = (c.log_rest + data).split(b"\n")
        for raw in done:
            parsed = stages.parse(raw.decode(errors="replace"))
            if parsed is not None and parsed[0] != "ready":  # the launcher's own line says ready
                name, seconds, note = parsed
                self._say(f"  {c.name}: {name} {'...' if seconds is None else f'{seconds:.1f} s'}{note}")

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
        if self.secret_file is not None:
            self.secret_file.unlink(missing_ok=True)  # the launch's secret dies with its replicas
            self.secret_file = None
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


def planned_ports(topo: Topology, relays: bool = True) -> list[tuple[int, str]]:
    """(port, what listens there) for every port a launch of `topo` listens on."""
    out = [(r.proxy_port, f"proxy {r.name}") for r in topo.regions]
    out += [(x.port, f"replica {x.id}") for r in topo.regions for x in r.replicas]
    if relays:
        out += [(p, f"relay {kind} {a}>{b}") for (kind, a, b), p in topo.relay_ports.items()]
    return out


def check_ports(topo: Topology, relays: bool = True) -> None:
    """Raise `PortsBusy` naming the first port of the topology already in use, what
    holds it where /proc tells, and a `--port` whose ports are all free."""
    planned = planned_ports(topo, relays)
    taken = set(listeners.busy(topo.host, [p for p, _ in planned]))
    if not taken:
        return
    port, what = next((p, w) for p, w in planned if p in taken)
    holders = listeners.foreign_pids(listeners.listening_inodes(port) or set())
    by = f" by {', '.join(listeners.describe(p) for p in holders)}" if holders else ""
    more = f" (and {len(taken) - 1} more of its ports)" if len(taken) > 1 else ""
    hint = port_hint(topo, relays)
    raise PortsBusy(f"port {port} (for {what}) is already in use{by}{more}; nothing was started. "
                    f"Another stack serving there? {hint[0].upper()}{hint[1:]}")


def port_hint(topo: Topology, relays: bool = True) -> str:
    """"choose other ports: make run PORT=9000 (python -m regions up --port 9000)", with a
    port whose whole shifted topology is free right now where one is found."""
    first = topo.regions[0].proxy_port
    for k in range(1, 40):
        port = first + 1000 * k
        try:
            moved = shift_ports(topo, port)
        except TopologyError:
            break
        if not listeners.busy(topo.host, [p for p, _ in planned_ports(moved, relays)]):
            return f"choose other ports: make run PORT={port} (python -m regions up --port {port})"
    return "choose other ports: make run PORT=... (python -m regions up --port ...)"


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
