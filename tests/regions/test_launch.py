"""The launcher brings a two-region topology (stub replicas) up and down: ready checks, one line
per component, latency relays in front, clean shutdown with no process left behind."""

import asyncio
import io
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from edge_proxy.client import EdgeClient
from regions.launch import LaunchError, PortsBusy, Stack, speculation_note
from regions.topology import parse
from speculative.cache import head_dir, model_name
from edge_proxy.select import ws_url

from tests.regions.ports import free_block, stub_topology
from tests.regions.processes import alive, cli_up

pytestmark = pytest.mark.anyio
HI = [{"role": "user", "content": "hi"}]


async def test_stack_up_serve_down(tmp_path):
    topo = parse(stub_topology(free_block(12)), "stub.toml")
    out = io.StringIO()
    stack = Stack(topo, log_dir=tmp_path, out=out)
    await stack.start()
    try:
        lines = out.getvalue().splitlines()
        assert sum(ln.startswith("replica ") for ln in lines) == 3
        assert sum(ln.startswith("proxy ") for ln in lines) == 2
        assert sum(ln.startswith("relay ") for ln in lines) == 6  # 2 clients x 2 regions + 2 link directions
        assert lines[-1].startswith("ready: 3 replicas, 2 proxies, 6 relays")
        t = stack.targets()
        # The replicas' secret, for scrapers of their /metrics: mode 600, named in the targets (the run
        # file), with the replicas' URLs and the command that scrapes one.
        secret = Path(t["replica_secret_file"])
        assert secret.read_text().strip() == stack.env["EDGECHAT_REPLICA_SECRET"] and secret.parent == tmp_path
        assert secret.stat().st_mode & 0o777 == 0o600
        assert sorted(t["replicas"]) == ["eu-0", "eu-1", "us-0"] and all(u.startswith("http://") for u in
                                                                         t["replicas"].values())
        assert f'curl -H "Authorization: Bearer $(cat {secret})" {t["replicas"]["eu-0"]}/metrics' in lines[-2]
        ttft = {}
        for region, url in t["clients"]["eu"].items():
            async with await EdgeClient.connect(ws_url(url)) as c:
                await c.complete(messages=HI, max_tokens=2)  # connection warm
                _, done = await c.complete(messages=HI, max_tokens=2)
                ttft[region] = done
        assert ttft["eu"].region == "eu" and ttft["us"].region == "us"
        assert ttft["eu"].replica.startswith("eu-") and ttft["us"].replica == "us-0"
        pids = [c.proc.pid for c in stack.replicas + stack.proxies]

        # us loses its only replica: its proxy forwards to eu through the us>eu link relay
        us0 = next(c for c in stack.replicas if c.name == "us-0")
        os.killpg(us0.proc.pid, signal.SIGKILL)
        await us0.proc.wait()
        async with httpx.AsyncClient(trust_env=False) as h:
            for _ in range(100):  # another process's state: poll its /healthz
                if (await h.get(stack.proxy_url("us") + "/healthz")).status_code == 503:
                    break
                await asyncio.sleep(0.05)
        async with await EdgeClient.connect(ws_url(t["clients"]["eu"]["us"])) as c:
            _, done = await c.complete(messages=HI, max_tokens=2)
        assert done.region == "eu" and done.forwarded_from == "us" and done.replica.startswith("eu-")
    finally:
        await stack.stop()
    assert not any(alive(p) for p in pids)
    assert all(c.proc.returncode is not None for c in stack.replicas + stack.proxies)
    assert not secret.exists()  # the launch's secret went with its replicas


async def test_restart_proxies_switches_routing(tmp_path):
    topo = parse(stub_topology(free_block(12)), "stub.toml")
    stack = Stack(topo, log_dir=tmp_path, out=io.StringIO(), relays=False)
    await stack.start()
    try:
        await stack.restart_proxies("round_robin")
        url = ws_url(stack.proxy_url("eu"))
        async with await EdgeClient.connect(url) as c:
            replicas = [(await c.complete(messages=HI, max_tokens=1, session="same"))[1].replica for _ in range(4)]
        assert replicas[0] != replicas[1] and replicas[0] == replicas[2]  # round robin ignores the session
        with pytest.raises(ValueError):
            await stack.restart_proxies("nope")
    finally:
        await stack.stop()


def test_proxies_get_routing_and_peers(tmp_path):
    topo = parse(stub_topology(free_block(12)), "stub.toml")
    argv = Stack(topo, routing="sticky", log_dir=tmp_path, out=io.StringIO())._proxy_argv(topo.region("eu"))
    assert argv[1:5] == ["-m", "edge_proxy", "--routing", "sticky"]
    link = topo.relay_ports[("link", "eu", "us")]
    assert argv[argv.index("--peer") + 1] == f"us=ws://{topo.host}:{link}/v1/stream@{topo.rtt('eu', 'us'):g}"
    argv = Stack(topo, log_dir=tmp_path, out=io.StringIO(), relays=False)._proxy_argv(topo.region("eu"))
    assert argv[argv.index("--peer") + 1].startswith(f"us=ws://{topo.host}:{topo.region('us').proxy_port}/")


def test_cpu_replicas_on_one_machine_split_its_cores(tmp_path, monkeypatch):
    """Each model replica without GPUs gets cores // (CPU replicas) engine threads, at least one;
    a --cpu-threads the topology gives its replicas wins."""
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    base = free_block(12)
    regions = '[regions.eu]\nreplicas = [{}, {}]\n[regions.us]\nreplicas = [{}]\n'
    clients = '[clients.here]\nrtt_ms = { eu = 5, us = 80 }\n'
    topo = parse(f"base_port = {base}\n{regions}{clients}", "three.toml")
    stack = Stack(topo, log_dir=tmp_path, out=io.StringIO())
    for region in topo.regions:
        for rep in region.replicas:
            argv = stack._replica_argv(rep, region.name)
            assert argv[argv.index("--cpu-threads") + 1] == "2"  # 8 cores over 3 replicas
    topo = parse(f'base_port = {base}\nreplica_args = ["--cpu-threads", "4"]\n{regions}{clients}', "own.toml")
    argv = Stack(topo, log_dir=tmp_path, out=io.StringIO())._replica_argv(topo.regions[0].replicas[0], "eu")
    assert argv.count("--cpu-threads") == 1 and argv[argv.index("--cpu-threads") + 1] == "4"


def test_a_replica_role_reaches_its_command_line(tmp_path):
    regions = '[regions.eu]\nreplicas = [{ role = "prefill" }, { role = "decode" }, {}]\n'
    topo = parse(f"base_port = {free_block(6)}\n{regions}", "roles.toml")
    stack = Stack(topo, log_dir=tmp_path, out=io.StringIO())
    argvs = [stack._replica_argv(rep, "eu") for rep in topo.regions[0].replicas]
    roles = [argv[argv.index("--role") + 1] if "--role" in argv else None for argv in argvs]
    assert roles == ["prefill", "decode", None]  # "both" is the replica's default


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_stops_everything_on_signal(tmp_path, sig):
    with cli_up(tmp_path) as (proc, lines, pids):
        assert len(pids) == 3 and all(alive(p) for p in pids)
        assert any("ws://127.0.0.1:" in ln and ln.startswith("proxy") for ln in lines)
        proc.send_signal(sig)
        rest, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, rest
        assert "regions: stopped" in rest
        assert not any(alive(p) for p in pids)


def test_cli_reports_topology_errors_with_the_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[regions.eu]\nreplicas = [{ port = "x" }]\n')
    r = subprocess.run([sys.executable, "-m", "regions", "up", str(path)], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and f"{path}:2: regions.eu.replicas.0.port: expected an integer" in r.stderr


def test_check_prints_the_resolved_plan():
    r = subprocess.run([sys.executable, "-m", "regions", "check"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "region eu: proxy :8100" in r.stdout and "relay link eu>us" in r.stdout


async def test_a_busy_port_stops_the_launch_before_anything_starts(tmp_path):
    base = free_block(12)
    topo = parse(stub_topology(base), "stub.toml")
    port = topo.regions[0].replicas[0].port
    blocker = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
    try:
        stack = Stack(topo, log_dir=tmp_path / "logs", out=io.StringIO(), ready_timeout_s=10)
        with pytest.raises(PortsBusy, match=f"port {port} \\(for replica eu-0\\) is already in use by pid {os.getpid()}"
                           ) as e:
            await stack.start()
        assert "nothing was started" in str(e.value) and "make run PORT=" in str(e.value)
        assert stack.replicas == stack.proxies == stack.relays == [] and not (tmp_path / "logs").exists()
    finally:
        blocker.close()
        await blocker.wait_closed()


async def test_a_replica_that_fails_to_start_is_reported(tmp_path, monkeypatch):
    topo = parse(stub_topology(free_block(12)), "stub.toml")
    argv = Stack._replica_argv

    def failing(self, rep, region):
        if rep.id == "eu-0":
            return [sys.executable, "-c", "import sys; sys.exit('no model here')"]
        return argv(self, rep, region)

    monkeypatch.setattr(Stack, "_replica_argv", failing)
    stack = Stack(topo, log_dir=tmp_path, out=io.StringIO(), ready_timeout_s=10)
    with pytest.raises(LaunchError, match="replica eu-0 exited with code 1 while starting") as e:
        await stack.start()
    assert "no model here" in str(e.value)  # the log's tail
    assert len(stack.replicas) == 3 and all(c.proc.returncode is not None for c in stack.replicas)


async def test_a_listener_this_launch_did_not_start_is_never_reported_ready(tmp_path, monkeypatch):
    """Another stack's replica answers /healthz on eu-0's port (it took the port after the
    launch checked it): the launch fails naming it, and never says eu-0 is ready."""
    topo = parse(stub_topology(free_block(12)), "stub.toml")
    port = topo.regions[0].replicas[0].port
    argv = Stack._replica_argv

    def silent(self, rep, region):  # eu-0 starts, slowly: it never listens
        if rep.id == "eu-0":
            return [sys.executable, "-c", "import time; time.sleep(120)"]
        return argv(self, rep, region)

    async def healthy(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n\r\n"
                     b'{"status":"ok"}')
        await writer.drain()
        writer.close()

    monkeypatch.setattr(Stack, "_replica_argv", silent)
    monkeypatch.setattr("regions.launch.check_ports", lambda topo, relays: None)  # the port was free then
    foreign = await asyncio.start_server(healthy, "127.0.0.1", port)
    out = io.StringIO()
    try:
        stack = Stack(topo, log_dir=tmp_path, out=out, ready_timeout_s=60)
        with pytest.raises(LaunchError, match=f"replica eu-0: port {port} is answered by pid {os.getpid()}") as e:
            await stack.start()
        assert "not by this launch's replica" in str(e.value) and "make run PORT=" in str(e.value)
    finally:
        foreign.close()
        await foreign.wait_closed()
    assert not any("eu-0" in ln and "ready" in ln for ln in out.getvalue().splitlines())
    assert all(c.proc.returncode is not None for c in stack.replicas)


def test_cli_refuses_a_busy_port_at_once_with_a_hint(tmp_path):
    """A second `regions up` on the same ports: refused before anything starts, naming the
    port and what holds it, with a PORT= that is free; the first one serves on."""
    with cli_up(tmp_path) as (first, lines, pids):
        path = tmp_path / "t.toml"
        env = {**os.environ, "EDGECHAT_RUN_DIR": str(tmp_path / "run")}
        again = subprocess.run([sys.executable, "-m", "regions", "up", str(path), "--log-dir", str(tmp_path / "again")],
                               capture_output=True, text=True, timeout=60, env=env)
        port = parse(path.read_text(), "t.toml").regions[0].proxy_port
        assert again.returncode == 1 and not again.stdout
        assert f"regions: port {port}: another `python -m regions up` (pid {first.pid}, ready) holds it" in again.stderr
        assert re.search(r"make run PORT=\d+ \(python -m regions up --port \d+\)", again.stderr)
        # Under another run dir (another user's launch, say): the busy port itself is named, with its holder.
        env["EDGECHAT_RUN_DIR"] = str(tmp_path / "elsewhere")
        moved = subprocess.run([sys.executable, "-m", "regions", "up", str(path), "--port", str(port + 1),
                                "--log-dir", str(tmp_path / "again")], capture_output=True, text=True, timeout=60,
                               env=env)
        assert moved.returncode == 1
        eu0 = next(int(m.group(1)) for ln in lines if (m := re.search(r"replica +eu-0 .*\(pid (\d+)", ln)))
        assert f"regions: port {port + 1} (for proxy eu) is already in use by pid {eu0}" in moved.stderr
        assert "nothing was started" in moved.stderr and "make run PORT=" in moved.stderr
        assert not (tmp_path / "again").exists() and first.poll() is None and all(alive(p) for p in pids)


def test_cli_flags_reach_the_processes(tmp_path):
    """--model, --replica-args and --proxy-args (make run MODEL_PATH=, REPLICA_ARGS=, PROXY_ARGS=)."""
    from regions.__main__ import _parser, topology_of

    a = _parser().parse_args(["up", "--port", "9000", "--model", "/models/x.gguf",
                              "--replica-args=--max-num-seqs 8 --kv-memory-gb 0.5",
                              "--proxy-args=--allowed-origin 'http://a.test' --log-level info"])
    topo = topology_of(a)
    stack = Stack(topo, log_dir=tmp_path, out=io.StringIO())
    rep = stack._replica_argv(topo.regions[0].replicas[0], "eu")
    assert rep[rep.index("--model") + 1] == "/models/x.gguf" and rep[-4:] == ["--max-num-seqs", "8", "--kv-memory-gb",
                                                                              "0.5"]
    proxy = stack._proxy_argv(topo.regions[1])
    assert proxy[proxy.index("--tokenizer") + 1] == "/models/x.gguf"  # the replicas' tokenizer
    assert proxy[-4:] == ["--allowed-origin", "http://a.test", "--log-level", "info"]  # last: they win
    assert topo.regions[0].proxy_port == 9000


def test_cli_proxy_args_reach_a_running_proxy(tmp_path):
    with cli_up(tmp_path, "--proxy-args=--allowed-origin http://app.test") as (_, lines, _):
        url = next(m.group(1) for ln in lines if (m := re.search(r"proxy +eu .*\(OpenAI (\S+)/v1/chat/", ln)))
        r = httpx.get(url + "/v1/models", headers={"Origin": "http://app.test"}, timeout=10, trust_env=False)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.test"


def test_with_api_keys_the_proxies_get_a_generated_peer_key(tmp_path, monkeypatch):
    """Forwarded requests must keep their tenant: the launch adds a key of tier "peer" for the proxies."""
    from edge_proxy.auth import KeyStore, parse_env

    monkeypatch.setenv("EDGECHAT_API_KEYS", "sk-a=alice")
    monkeypatch.delenv("EDGECHAT_PEER_KEY", raising=False)
    stack = Stack(parse(stub_topology(free_block(12)), "stub.toml"), log_dir=tmp_path, out=io.StringIO())
    peer_key = stack.env["EDGECHAT_PEER_KEY"]
    keys = KeyStore(parse_env(stack.env["EDGECHAT_API_KEYS"]))
    assert keys.check(peer_key).peer and not keys.check("sk-a").peer
    assert keys.on_behalf_of(keys.check(peer_key), "alice").cache_salt == keys.check("sk-a").cache_salt


async def test_proxies_can_find_their_replicas_by_dns(tmp_path):
    topo = parse(stub_topology(free_block(12)), "stub.toml")
    out = io.StringIO()
    stack = Stack(topo, log_dir=tmp_path, out=out, relays=False, discovery="dns")
    await stack.start()  # proxies are ready only once they resolved and connected all their replicas
    try:
        assert any(ln.startswith("dns ") for ln in out.getvalue().splitlines())
        argv = stack._proxy_argv(topo.region("eu"))
        assert "--replica" not in argv and argv[argv.index("--replicas-dns") + 1] == "_ws._tcp.eu.edgechat.test"
        async with await EdgeClient.connect(ws_url(stack.proxy_url("eu"))) as c:
            _, done = await c.complete(messages=HI, max_tokens=2)
        assert done.region == "eu" and done.replica.startswith("eu-")
    finally:
        await stack.stop()
    assert stack.zone is None


HEAD = {"config.json": "{}", "model.safetensors": ""}
CPU_CHAIN = (
        '{"device": "cpu", "measured_on": "AMD EPYC", "rules": [{"from_batch": 1, "spec": {"depth": 3, "top_k": 1, '
        '"budget": 3, "sample": false}}, {"from_batch": 2, "spec": null}]}')


@pytest.mark.parametrize("device, files, says", [
    ("cpu", {}, ("off, no EAGLE-3 head in", "train one: python -m speculative.train")),
    ("cpu", HEAD, ("off, the EAGLE-3 head in", "has no measured policy", "bench/speculative.py --write-policy")),
    ("cpu", {**HEAD, "policy.json": CPU_CHAIN},
     ("on, EAGLE-3 head in", "on at batch 1 (chain of 3), off from 2 (measured on AMD EPYC)")),
    ("cuda", {**HEAD, "policy.json": CPU_CHAIN}, ("off, the policy beside", "measured on AMD EPYC, not on cuda")),
    ("cpu", {**HEAD, "policy.json": (
        '{"device": "cpu", "measured_on": "AMD EPYC", "rules": [{"from_batch": 1, "spec": null}]}')},
     ("off, the policy in", "never speculates")),
])
def test_make_run_says_whether_speculation_is_on_and_why(tmp_path, monkeypatch, device, files, says):
    monkeypatch.setenv("EDGECHAT_EAGLE3_DIR", str(tmp_path))
    folder = head_dir(model_name("default"))
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    note = speculation_note("default", device)
    assert note.startswith("speculative decoding: " + says[0]) and all(s in note for s in says[1:]), note
