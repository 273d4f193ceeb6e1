"""The images and the manifests as an operator runs them on one machine, with podman: the
proxy and CPU replica images built from deploy/Dockerfile (deploy/images.py, cached layers
reused), the cpu-demo overlay played (deploy/podman_kube.py: a proxy and two replicas, the
replicas found through DNS, each scraped as the ServiceMonitor says, with the read-only
metrics token), the official openai SDK streaming through the proxy, every
replica replaced one at a time under continuous streaming load with no stream lost or
changed, and nothing left behind.

Minutes, so marked `podman` and left out of a plain run (tests/deploy/conftest.py):
    .venv/bin/python -m pytest -q -s -m podman tests/deploy/test_podman.py     (or deploy/podman-e2e.sh)
Skipped, saying why, where podman, runc, netavark, aardvark-dns, iptables, mmdebstrap or kubectl is
missing, or podman cannot start a container. A region deploy/podman_kube.py has up is taken
down first (the same names).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import yaml

from deploy import images, podman_kube
from tests.deploy.dockerfile import ROOT

pytestmark = [pytest.mark.podman, pytest.mark.timeout(5400)]

PROMPTS = ["What is the capital of France?", "Name three colours.", "Count from one to ten.",
           "Say hello in Spanish.", "What is two plus two?", "Name a large animal."]
MAX_TOKENS = 40
STREAMS_AT_ONCE = 4
# A stream with far to go, placed on each old replica before it is stopped (the short ones can all end during
# the drain, which then moves none: a run on a faster VM, 2026-12-03); each try its own words, so its own chain.
LONG = "Tell me a long story about a lighthouse keeper and a storm, part {k}."
LONG_TOKENS = 160
# The longest a stream may wait between two chunks while the replicas are replaced. A replica
# that stops with no FIN is let go within 3-4 s (keepalive 1 + 2 s, or its DNS record gone within
# --dns-interval 2 s), and its streams resume on another replica within about a second on two
# busy cores: runs here saw 0.3-3.4 s. A stall of the network itself (the bridge's MAC moving
# under the pods' ARP entries: deploy/podman_kube.py pin_bridge_mac) lasts 15-55 s.
MAX_GAP_S = 10.0


def _why_not() -> str:
    missing = images.missing_tools()
    if missing:
        return f"missing {' '.join(missing)} (Debian: {images.APT})"
    if not shutil.which("kubectl"):
        return "kubectl renders the overlay and is not installed"
    return ""


@pytest.fixture(scope="module")
def built():
    why = _why_not()
    if why:
        pytest.skip(why)
    base = images.base_image()
    r = images.podman("run", "--rm", "--network", "none", "--entrypoint", "true", base, check=False)
    if r.returncode != 0:
        pytest.skip(f"podman cannot start a container here: {r.stderr.strip()[-300:]}")
    return {t: images.build(t, base) for t in ("proxy", "replica-cpu")}


@pytest.fixture(scope="module")
def e2e(built, tmp_path_factory):
    """The cpu-demo overlay played, from a copy of deploy/k8s with a fresh replica secret; what the
    tests learn on the way (the model, the reference streams) is kept here for the next ones."""
    tree = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(ROOT / "deploy" / "k8s", tree, ignore=shutil.ignore_patterns("secrets.env"))
    secret, token = "e2e-" + time.strftime("%H%M%S"), "e2e-metrics-" + time.strftime("%H%M%S")
    (tree / "overlays" / "cpu-demo" / "secrets.env").write_text(f"replica-secret={secret}\nmetrics-token={token}\n")
    podman_kube.down()
    state = SimpleNamespace(secret=secret, metrics_token=token, before=_leftovers(), model="", expected={},
                            region=podman_kube.Region(podman_kube.render(tree / "overlays" / "cpu-demo")))
    try:
        state.started = state.region.up()
        yield state
    finally:
        podman_kube.down()


def _leftovers() -> dict[str, set[str]]:
    """What podman holds now: containers, pods, volumes, secrets, networks (by name)."""
    p = images.podman
    return {"containers": set(p("ps", "-a", "--format", "{{.Names}}").stdout.split()),
            "pods": set(p("pod", "ps", "--format", "{{.Name}}").stdout.split()),
            "volumes": set(p("volume", "ls", "--format", "{{.Name}}").stdout.split()),
            "secrets": set(p("secret", "ls", "--format", "{{.Name}}").stdout.split()),
            "networks": set(p("network", "ls", "--format", "{{.Name}}").stdout.split())}


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(edgechat_proxy_[^ ]+) (\S+)$", text, re.M)}


def _replica_loads(url: str) -> dict[str, float]:
    return {m.group(1): v for k, v in _metrics(url).items()
            if (m := re.fullmatch(r'edgechat_proxy_replica_load\{replica="([^"]+)"\}', k))}


def _failovers(url: str) -> dict[str, float]:
    return {m.group(1): v for k, v in _metrics(url).items()
            if (m := re.fullmatch(r'edgechat_proxy_failovers_total\{cause="([^"]+)"\}', k))}


def test_images_sizes_no_torch_in_the_proxy_kernels_built_in(built):
    proxy, replica = built["proxy"], built["replica-cpu"]
    print(f"\nproxy {proxy.size_mb:.0f} MB ({proxy.seconds:.0f} s), replica-cpu {replica.size_mb:.0f} MB "
          f"({replica.seconds:.0f} s)")
    assert not images.has_torch(proxy.tag) and images.has_torch(replica.tag)
    assert proxy.size_mb < replica.size_mb
    start = images.time_replica_start(replica.tag)
    print(f"replica container start to ready {start.seconds:.1f} s: {start.stages}")
    assert "did not build" not in start.log, start.log  # every C++ kernel loaded from the image
    kernels = [s for s in start.stages if s.startswith("stage: building kernels ") and s.endswith(" s")]
    assert kernels and all(float(s.split()[-2]) < 15 for s in kernels), start.stages  # loaded, not compiled
    assert any(s.startswith("stage: ready ") for s in start.stages)


def test_the_region_plays_with_probes_secret_resources_and_dns_discovery(e2e):
    region = e2e.region
    pods = region.pods()
    assert sorted(p.component for p in pods) == ["proxy", "replica", "replica"]
    replicas = [p for p in pods if p.component == "replica"]
    url = region.proxy_url()
    for p in pods:  # readiness (polled by up()) and liveness answer; the liveness as podman's healthcheck
        for probe in ("readinessProbe", "livenessProbe"):
            with urllib.request.urlopen(region.probe_url(p, probe), timeout=5) as r:
                assert r.status == 200, (p.name, probe)
        container = f"{p.name}-{p.component}"
        assert images.podman("healthcheck", "run", container, check=False).returncode == 0, container
        c = json.loads(images.podman("inspect", container).stdout)[0]
        env = dict(e.split("=", 1) for e in c["Config"]["Env"])
        assert env["EDGECHAT_REPLICA_SECRET"] == e2e.secret  # from the Secret, through secretKeyRef
        assert env["POD_NAME"] == p.name and env["EDGECHAT_MODEL"] == "default"  # the ConfigMap's one value
        if p.component == "replica":
            assert env["EDGECHAT_METRICS_TOKEN"] == e2e.metrics_token
        limit = region.deployment(p.component)["spec"]["template"]["spec"]["containers"][0]["resources"]
        assert limit["requests"]["cpu"] and limit["requests"]["memory"]  # requests stay in what was played
        assert c["HostConfig"]["Memory"] == _bytes(limit["limits"]["memory"])
        assert c["HostConfig"]["ReadonlyRootfs"] and c["Config"]["User"] == "10001:10001"
    # Prometheus' scrape of each replica, as components/prometheus's ServiceMonitor describes it
    monitor = yaml.safe_load(podman_kube.SERVICE_MONITOR.read_text())
    for p in replicas:
        target, headers = podman_kube.scrape_request(monitor, region.docs, p.ip)
        assert headers == {"Authorization": f"Bearer {e2e.metrics_token}"}
        with urllib.request.urlopen(urllib.request.Request(target, headers=headers), timeout=5) as r:
            assert r.status == 200 and "edgechat_replica_running" in r.read().decode()
        for path, code in (("/metrics", 401), ("/v1/models", 403)):  # no token; the token where it reads nothing
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(urllib.request.Request(
                    target.replace("/metrics", path), headers=headers if code == 403 else {}), timeout=5)
            refused.value.close()  # an HTTPError holds its response's socket: closed, not left to the GC
            assert refused.value.code == code, (p.name, path)
    # the proxy found both replicas by resolving the headless Service's name (the network alias)
    m = _metrics(url)
    assert m["edgechat_proxy_replicas_ready"] == 2
    assert m['edgechat_proxy_dns_refreshes_total{outcome="ok"}'] > 0
    assert set(_replica_loads(url)) == {p.name for p in replicas}  # --replica-id=$(POD_NAME)
    # the network's bridge keeps its MAC when pods leave (podman_kube.pin_bridge_mac): "3", set by hand
    # (where the bridge is in this network namespace, rootful podman; rootless podman's has its own)
    assign = Path("/sys/class/net", podman_kube.bridge_of(), "addr_assign_type")
    assert not assign.exists() or assign.read_text().strip() == "3"
    print(f"\nplayed: {e2e.started}")


def _bytes(q: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    return int(q[:-2]) * units[q[-2:]] if q[-2:] in units else int(q)


def _client(region) -> openai.AsyncOpenAI:  # async with: its connections closed
    return openai.AsyncOpenAI(base_url=region.proxy_url() + "/v1", api_key="EMPTY", max_retries=0, timeout=120)


async def _stream(client, model: str, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    """One chat completion streamed: its text, tokens, and the longest wait between chunks."""
    t0 = time.monotonic()
    last, gaps, text, usage = None, [], [], None
    stream = await client.chat.completions.create(
        model=model, stream=True, max_tokens=max_tokens, temperature=0, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": prompt}])
    async for chunk in stream:
        now = time.monotonic()
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
            if last is not None:
                gaps.append((now - last, now))
            last = now
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    gap, gap_end = max(gaps, default=(0.0, t0))
    return {"prompt": prompt, "text": "".join(text), "tokens": usage, "max_gap_s": gap, "gap_end": gap_end,
            "started": t0, "ended": time.monotonic()}


def _phase(t: float, steps: list[dict]) -> str:
    """Where in the roll the moment t lies: a new pod starting, an old one stopping, or between."""
    for st in steps:
        if st["started_at"] <= t < st["stop_at"]:
            return f"{st['new']} starting"
        if st["stop_at"] <= t <= st["stop_at"] + st["stop_s"] + 2.0:  # its streams' first tokens elsewhere too
            return f"{st['old']} stopping"
    return "between steps"


@pytest.mark.anyio
async def test_the_openai_sdk_streams_through_the_proxy(e2e):
    async with _client(e2e.region) as client:
        model = (await client.models.list()).data[0].id
        out = await _stream(client, model, PROMPTS[0])
        assert "Paris" in out["text"] and 0 < out["tokens"] <= MAX_TOKENS
        e2e.model = model
        e2e.expected = {p: (await _stream(client, model, p)) for p in PROMPTS}  # one at a time: the references


@pytest.mark.anyio
async def test_rolling_replacement_under_streaming_load_loses_no_stream(e2e):
    region = e2e.region
    assert e2e.expected, "the SDK test ran first and kept the reference streams"
    url, model = region.proxy_url(), e2e.model
    failovers_before = _failovers(url)
    done, errors, stop, go = [], [], asyncio.Event(), asyncio.Event()
    loop, longs = asyncio.get_running_loop(), []  # the long streams placed on old replicas (futures)
    go.set()

    async def streamer(k: int) -> None:
        i = k
        while not stop.is_set():
            await go.wait()  # paused while a long stream is placed
            prompt = PROMPTS[i % len(PROMPTS)]
            i += STREAMS_AT_ONCE
            try:
                done.append(await _stream(client, model, prompt))
            except openai.OpenAIError as e:  # a stream the roll broke: the test's failure
                errors.append(f"{prompt}: {e!r}")

    def until(what: str, ready) -> dict[str, float]:
        """The replicas' loads once `ready(loads)` says so."""
        deadline = time.monotonic() + 60
        while not ready(loads := _replica_loads(url)):
            assert time.monotonic() < deadline, f"never: {what}"
            time.sleep(0.05)  # another process's gauge: nothing to await
        return loads

    def busy(old) -> None:
        """The old replica holds a stream with far to go when it is stopped, so one has to move: the
        streamers pause; once nothing runs, long streams start one at a time until one lands on `old`
        (the router's choice; the gauge says where); the streamers go on, and the roll stops `old`."""
        loop.call_soon_threadsafe(go.clear)
        try:
            until("the streams ended", lambda loads: sum(loads.values()) == 0)
            for _ in range(4):
                long = _stream(client, model, LONG.format(k=len(longs)), LONG_TOKENS)
                longs.append(asyncio.run_coroutine_threadsafe(long, loop))
                loads = until(f"long stream {len(longs)} placed",  # every long one still running is counted somewhere
                              lambda loads: sum(loads.values()) == sum(not f.done() for f in longs))
                if loads.get(old.name, 0) >= 1:
                    return
            raise AssertionError(f"no long stream went to {old.name}")
        finally:
            loop.call_soon_threadsafe(go.set)

    async def roll() -> list[dict]:
        await asyncio.sleep(1)  # load is flowing
        try:
            return await asyncio.to_thread(region.roll, "replica", busy)
        finally:
            stop.set()

    old = {p.name for p in region.pods("replica")}
    t0 = time.monotonic()
    async with _client(region) as client:
        steps, *_ = await asyncio.gather(roll(), *(streamer(k) for k in range(STREAMS_AT_ONCE)))
        placed = [await asyncio.wrap_future(f) for f in longs]
        # their references: each again, undisturbed, on the new replicas (temperature 0: the same text)
        long_expected = {d["prompt"]: (await _stream(client, model, d["prompt"], LONG_TOKENS)) for d in placed}
    seconds = time.monotonic() - t0
    done += placed
    failovers = {c: v - failovers_before.get(c, 0) for c, v in _failovers(url).items()}
    expected = {p: (e["text"], e["tokens"]) for p, e in (e2e.expected | long_expected).items()}
    wrong = [(d["prompt"], d["text"], expected[d["prompt"]]) for d in done
             if (d["text"], d["tokens"]) != expected[d["prompt"]]]
    longest = sorted(done, key=lambda d: -d["max_gap_s"])
    gaps = [d["max_gap_s"] for d in longest]
    figures = {"streams": len(done), "failovers": failovers, "max_gap_ms": round(gaps[0] * 1000),
               "longest_gaps_ms": [[round(d["max_gap_s"] * 1000), _phase(d["gap_end"], steps)] for d in longest[:8]],
               "seconds": round(seconds), "steps": steps}
    print(f"\nrolling replacement: {json.dumps(figures)}")
    assert not errors, errors
    assert not wrong, wrong  # token-exact: every stream as it streams with no replica replaced
    assert len(done) >= 2 * STREAMS_AT_ONCE
    assert all(d["tokens"] == LONG_TOKENS for d in placed)  # no early end: each had far to go at the stop
    assert sum(failovers.values()) >= 2  # streams did move: each old replica was stopped holding a long one
    # handed on with their KV while the old replica drained, none resumed after a stall or a lost socket
    # (podman's pod stop once took the network away at SIGTERM: "stall", gaps of 2.1 s)
    assert {c for c, v in failovers.items() if v} == {"drain"}, figures
    assert gaps[0] < MAX_GAP_S, figures  # no stream froze while its replica was replaced
    now = {p.name for p in region.pods("replica")}
    assert len(now) == 2 and not now & old  # both replaced
    # the last new pod joins the proxy from DNS (--dns-interval 2 s): its old one may have drained sooner
    deadline = time.monotonic() + 15
    while _metrics(url)["edgechat_proxy_replicas_ready"] < 2 and time.monotonic() < deadline:
        time.sleep(0.2)  # another process's gauge: nothing to await
    assert _metrics(url)["edgechat_proxy_replicas_ready"] == 2 and now <= set(_replica_loads(url))


def test_teardown_leaves_no_container_pod_volume_or_secret(e2e):
    assert e2e.region.pods()
    podman_kube.down()
    after = _leftovers()
    for what, names in after.items():
        assert names <= e2e.before[what], (what, names - e2e.before[what])  # nothing the region made is left
