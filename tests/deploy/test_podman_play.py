"""What deploy/podman_kube.py gives `podman kube play`, and what deploy/images.py gives
`podman build`, checked without podman: each replica a Pod of its own with its own emptyDir
volumes, $(POD_NAME) and $(EDGECHAT_MODEL) expanded (the ConfigMap's value given), no
containerPort for podman 4.3 to publish but the proxy's, the probes' named ports resolved, the
Secret in the JSON form podman's secretKeyRef reads; a replica started as played answers the
scrape the ServiceMonitor describes (the metrics token) and refuses that token anything else; the
images tagged as the cpu-demo overlay runs them; the build's pip sees this machine's package
sources; the replica entry point copies the kernels built into the image where torch loads them.
The podman run itself: tests/deploy/test_podman.py (-m podman)."""

from __future__ import annotations

import base64
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from deploy import images, podman_kube
from edge_proxy.__main__ import parse_args as proxy_args
from replica.__main__ import parse_args as replica_args
from tests.deploy.dockerfile import ROOT, stages
from tests.prom import samples
from tests.replica.server import replica_server

SECRETS = {"replica-secret": "s3cret", "metrics-token": "m3trics"}


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> list[dict]:
    if not shutil.which("kubectl"):
        pytest.skip("kubectl renders the overlay")
    tree = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(ROOT / "deploy" / "k8s", tree, ignore=shutil.ignore_patterns("secrets.env"))
    (tree / "overlays" / "cpu-demo" / "secrets.env").write_text("".join(f"{k}={v}\n" for k, v in SECRETS.items()))
    return podman_kube.render(tree / "overlays" / "cpu-demo")


def test_a_replica_pod_is_its_own_with_its_name_expanded(docs):
    dep = podman_kube.one(docs, "Deployment", "edgechat-replica")
    maps = podman_kube.config_maps(docs)
    pods = [podman_kube.pod_of(dep, f"edgechat-replica-{i}", maps=maps) for i in range(2)]
    for i, pod in enumerate(pods):
        name = f"edgechat-replica-{i}"
        assert pod["kind"] == "Pod" and pod["metadata"]["name"] == name
        assert pod["metadata"]["labels"] == dep["spec"]["template"]["metadata"]["labels"]
        (c,) = pod["spec"]["containers"]
        assert replica_args(c["args"]).replica_id == name  # --replica-id=$(POD_NAME), as the kubelet expands it
        assert replica_args(c["args"]).model == "default"  # --model=$(EDGECHAT_MODEL), from the ConfigMap
        (model,) = [e for e in c["env"] if e["name"] == "EDGECHAT_MODEL"]
        assert model == {"name": "EDGECHAT_MODEL", "value": "default"}  # podman is not given the ConfigMap
        assert "ports" not in c  # podman 4.3 would publish 8000 on the host for each: the second collides
        assert c["readinessProbe"]["httpGet"]["port"] == 8000  # named port resolved: "ws" is gone with ports
        (line,) = c["livenessProbe"]["exec"]["command"]  # one shell line (podman joins the words), not curl
        assert shlex.split(line) == podman_kube.http_check(8000, "/healthz")
        empty = [v["name"] for v in pod["spec"]["volumes"] if "emptyDir" in v]
        assert empty and all(v.startswith(name + "-") for v in empty)  # a volume per pod, removed with it
        assert {m["name"] for m in c["volumeMounts"]} == {v["name"] for v in pod["spec"]["volumes"]}
        assert c["resources"] == dep["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert dep["spec"]["template"]["spec"]["containers"][0]["args"][3] == "--replica-id=$(POD_NAME)"  # untouched


def test_the_proxy_pod_publishes_its_port_only_when_asked(docs):
    dep = podman_kube.one(docs, "Deployment", "edgechat-proxy")
    maps = podman_kube.config_maps(docs)
    (c,) = podman_kube.pod_of(dep, "edgechat-proxy-0", host_port=8080, maps=maps)["spec"]["containers"]
    assert c["ports"] == [{"containerPort": 8000, "hostPort": 8080}]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert "k8s.pod.name=edgechat-proxy-0" in env["OTEL_RESOURCE_ATTRIBUTES"]
    assert proxy_args(c["args"]).discovery.name == podman_kube.REPLICAS_ALIAS  # the alias the replicas join
    assert proxy_args(c["args"]).tokenizer == "default"  # the replicas' model, the same ConfigMap key
    assert "ports" not in podman_kube.pod_of(dep, "edgechat-proxy-0", maps=maps)["spec"]["containers"][0]
    with pytest.raises(ValueError, match="configMapKeyRef edgechat-model-"):
        podman_kube.pod_of(dep, "edgechat-proxy-0")  # no ConfigMaps given: said, never played unresolved


def test_the_secret_is_given_as_podman_reads_it(docs):
    secret = podman_kube.one(docs, "Secret")
    data = json.loads(podman_kube.secret_json(secret))
    assert {k: base64.b64decode(v).decode() for k, v in data.items()} == SECRETS
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for d in docs if d["kind"] == "Deployment"
            for e in d["spec"]["template"]["spec"]["containers"][0]["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs == {secret["metadata"]["name"]}  # the podman secret is created under the generated name


def test_a_replica_as_played_answers_the_service_monitors_scrape(docs):
    """components/prometheus's ServiceMonitor (left out of cpu-demo: kind and minikube lack the
    operator) against a real replica started with the played pod's arguments and environment, its
    Secret's keys resolved as podman's secretKeyRef does: the scrape it describes answers with the
    replica's metrics; its token generates nothing; no token, no metrics."""
    monitor = yaml.safe_load(podman_kube.SERVICE_MONITOR.read_text())
    url, headers = podman_kube.scrape_request(monitor, docs, "127.0.0.1")
    assert url == "http://127.0.0.1:8000/metrics" and headers == {"Authorization": "Bearer m3trics"}
    dep = podman_kube.one(docs, "Deployment", "edgechat-replica")
    (c,) = podman_kube.pod_of(dep, "edgechat-replica-0", maps=podman_kube.config_maps(docs))["spec"]["containers"]
    secret = json.loads(podman_kube.secret_json(podman_kube.one(docs, "Secret")))
    env = {e["name"]: e["value"] if "value" in e else base64.b64decode(secret[e["valueFrom"]["secretKeyRef"]["key"]]).decode()
           for e in c["env"] if "value" in e or "secretKeyRef" in e.get("valueFrom", {})}
    assert replica_args(c["args"]).port == 8000
    cmd = [sys.executable, "-m", "replica", *c["args"], "--host", "127.0.0.1", "--port", "{port}", "--kv-memory-gb", "0.1"]
    with replica_server(cmd=cmd, env=env) as (base, _):
        local = url.replace("127.0.0.1:8000", base.removeprefix("http://"))
        r = httpx.get(local, headers=headers, timeout=10)
        assert r.status_code == 200 and "edgechat_replica_running" in samples(r.text)
        assert httpx.get(local, timeout=10).status_code == 401
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(base + "/v1/chat/completions", json=chat, headers=headers, timeout=60).status_code == 403
        secret_auth = {"Authorization": f"Bearer {env['EDGECHAT_REPLICA_SECRET']}"}
        assert httpx.post(base + "/v1/chat/completions", json=chat, headers=secret_auth, timeout=120).status_code == 200


def test_the_replicas_pre_stop_drains_it_and_waits_for_its_exit(docs):
    """The pod's preStop, run as the kubelet runs it (the container's environment) against a real
    replica: it asks for the drain with the secret, the replica (no stream left) exits 0, and the
    hook ends with it, well inside its 10 s wait."""
    dep = podman_kube.one(docs, "Deployment", "edgechat-replica")
    (c,) = podman_kube.pod_of(dep, "edgechat-replica-0", maps=podman_kube.config_maps(docs))["spec"]["containers"]
    secret = json.loads(podman_kube.secret_json(podman_kube.one(docs, "Secret")))
    env = {e["name"]: e["value"] if "value" in e else base64.b64decode(secret[e["valueFrom"]["secretKeyRef"]["key"]]).decode()
           for e in c["env"] if "value" in e or "secretKeyRef" in e.get("valueFrom", {})}
    hook = c["lifecycle"]["preStop"]["exec"]["command"]
    cmd = [sys.executable, "-m", "replica", *c["args"], "--host", "127.0.0.1", "--port", "{port}", "--kv-memory-gb", "0.1"]
    with replica_server(cmd=cmd, env=env) as (base, proc):
        script = hook[2].replace("127.0.0.1:8000", base.removeprefix("http://"))
        r = subprocess.run([sys.executable, *hook[1:2], script], env={**os.environ, **env}, timeout=30,
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert proc.wait(timeout=30) == 0  # drained by the hook's request: a clean exit, not a signal


def test_the_liveness_command_tells_200_from_anything_else():
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/ok" else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port = server.server_address[1]
        run = lambda path: subprocess.run(podman_kube.http_check(port, path), capture_output=True,  # noqa: E731
                                          env={**os.environ, "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"})
        assert run("/ok").returncode == 0 and run("/down").returncode != 0
        server.shutdown()


def test_expand_follows_kubernetes():
    env = {"A": "x", "B": "y"}
    assert podman_kube.expand("$(A)-$(B)-$(C)-$$(A)", env) == "x-y-$(C)-$(A)"


def test_images_are_tagged_as_the_cpu_demo_overlay_runs_them(docs):
    ran = {c["image"] for d in docs if d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"]}
    assert {"localhost/" + i for i in ran} == set(images.tags().values())  # short names find localhost/ images
    assert set(images.tags()) <= set(stages())


def test_the_build_sees_this_machines_package_sources(tmp_path, monkeypatch):
    wheels, index = tmp_path / "wheels", tmp_path / "mirror" / "simple"
    wheels.mkdir()
    index.mkdir(parents=True)
    settings = {"find-links": str(wheels), "extra-index-url": f"file://{index} https://example.org/simple",
                "cert": "/nonexistent/ca.pem"}
    monkeypatch.setattr(images, "pip_settings", lambda: settings)
    args = images.pip_build_args(tmp_path)
    conf = (tmp_path / "pip.conf").read_text()
    assert all(f"{k} = {v}" in conf for k, v in settings.items())
    mounts = [args[i + 1] for i, a in enumerate(args) if a == "--volume"]
    assert f"{tmp_path}:{images.PIP_MOUNT}:ro" in mounts
    assert f"{wheels}:{wheels}:ro" in mounts and f"{index.parent}:{index.parent}:ro" in mounts  # an index's files
    assert len(mounts) == 3  # no path that is not there
    assert f"PIP_CONFIG_FILE={images.PIP_MOUNT}/pip.conf" in args
    st = stages()
    assert all("PIP_CONFIG_FILE" in st[s].all("ARG") for s in ("build-proxy", "build-replica"))


def test_the_replica_entrypoint_copies_the_built_kernels_then_runs_the_replica(tmp_path):
    st = stages()
    assert json.loads(st["replica-cpu"].all("ENTRYPOINT")[-1]) == ["edgechat-replica"]
    assert "deploy/replica-entrypoint.sh /usr/local/bin/edgechat-replica" in st["replica-cpu"].all("COPY")
    built_env = dict(w.split("=", 1) for w in " ".join(st["build-replica"].all("ENV")).split())
    run_env = dict(w.split("=", 1) for w in " ".join(st["replica-cpu"].all("ENV")).split())
    assert built_env["TORCH_EXTENSIONS_DIR"] == run_env["EDGECHAT_KERNELS"]  # where they were built
    assert "!deploy/replica-entrypoint.sh" in (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().split()

    kernels, home, bin_ = tmp_path / "kernels", tmp_path / "home", tmp_path / "bin"
    (kernels / "edgechat_cpu_ops_0123456789").mkdir(parents=True)
    so = kernels / "edgechat_cpu_ops_0123456789" / "edgechat_cpu_ops_0123456789.so"
    so.write_bytes(b"built")
    os.utime(so, (1_000_000_000, 1_000_000_000))
    bin_.mkdir()
    (bin_ / "python").write_text('#!/bin/sh\necho "$TORCH_EXTENSIONS_DIR" "$@"\n')
    (bin_ / "python").chmod(0o755)
    env = {"PATH": f"{bin_}:/usr/bin:/bin", "HOME": str(home), "EDGECHAT_KERNELS": str(kernels)}
    entry = str(ROOT / "deploy" / "replica-entrypoint.sh")
    out = subprocess.run([entry, "--port", "8000"], env=env, capture_output=True, text=True, check=True).stdout
    dest = home / ".cache" / "torch_extensions"
    assert out.split() == [str(dest), "-m", "replica", "--port", "8000"]
    copied = dest / "edgechat_cpu_ops_0123456789" / so.name
    assert copied.read_bytes() == b"built" and copied.stat().st_mtime == 1_000_000_000  # ninja: up to date
    copied.write_bytes(b"kept")  # a second start keeps what is there
    subprocess.run([entry], env=env, capture_output=True, check=True)
    assert copied.read_bytes() == b"kept" and not list(dest.glob("*.part.*"))


# A script run in a network namespace of its own (unshare -rn): a bridge with two ports, the
# lower MAC first, then that port removed; what the bridge's address was before and after.
_BRIDGE_SCRIPT = """
import json, re, subprocess, sys
from deploy import podman_kube

def ip(*a):
    return subprocess.run(["ip", *a], check=True, capture_output=True, text=True).stdout

def mac():
    return re.search(r"link/ether (\\S+)", ip("-o", "link", "show", "dev", "br0")).group(1)

ip("link", "add", "br0", "type", "bridge")
for port, address in (("p1", "02:00:00:00:00:01"), ("p2", "02:00:00:00:00:02")):
    ip("link", "add", port, "address", address, "type", "veth", "peer", "name", port + "x")
    ip("link", "set", port, "master", "br0")
if sys.argv[1] == "pin":
    podman_kube.pin_bridge_mac("br0", ["ip"])
before = mac()
ip("link", "del", "p1")  # its pod removed
print(json.dumps([before, mac()]))
"""


def _in_own_netns(mode: str) -> list[str]:
    if not (shutil.which("unshare") and shutil.which("ip")):
        pytest.skip("needs unshare and ip (util-linux, iproute2)")
    probe = ["unshare", "-rn", "ip", "link", "add", "name", "br0", "type", "bridge"]
    if subprocess.run(probe, capture_output=True).returncode:
        pytest.skip("cannot make a bridge in a network namespace of its own here (unshare -rn)")
    r = subprocess.run(["unshare", "-rn", sys.executable, "-c", _BRIDGE_SCRIPT, mode], capture_output=True,
                       text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_pinned_bridge_keeps_its_mac_when_the_pod_that_lent_it_leaves():
    """The kernel gives a bridge the lowest of its ports' MACs until one is set: the pod whose port
    lent it leaves, the address moves, and every other pod's ARP entry for the host points at
    nothing until it expires (the proxy's answers to clients lost for up to a minute). Pinned, it stays."""
    assert _in_own_netns("kernel") == ["02:00:00:00:00:01", "02:00:00:00:00:02"]  # the hazard, as the kernel has it
    assert _in_own_netns("pin") == ["02:00:00:00:00:01", "02:00:00:00:00:01"]


def test_every_play_pins_the_networks_bridge(monkeypatch):
    calls, pinned = [], []

    def podman(*args, check=True, **kw):
        calls.append(args)
        out = {"network": json.dumps([{"name": podman_kube.NETWORK, "network_interface": "podman7"}]),
               "pod": "infra", "inspect": "{}", "ps": ""}.get(args[0], "")
        return subprocess.CompletedProcess(["podman", *args], 0, out, "")

    monkeypatch.setattr(images, "podman", podman)
    monkeypatch.setattr(podman_kube, "pin_bridge_mac", lambda bridge, ip=None: pinned.append(bridge))
    dep = {"metadata": {"name": "edgechat-replica"}, "spec": {"template": {
        "metadata": {"labels": {}}, "spec": {"containers": [{"name": "replica", "image": "x"}]}}}}
    region = podman_kube.Region([{"kind": "Deployment", **dep}], log=lambda _: None)
    region.play("replica", "edgechat-replica-0")
    assert any(a[:2] == ("kube", "play") for a in calls) and pinned == ["podman7"]
