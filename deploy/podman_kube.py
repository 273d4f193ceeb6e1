"""One region of deploy/k8s/overlays/cpu-demo on this machine: `podman kube play`, no cluster.

    python deploy/podman_kube.py up [--port 8080]   # a proxy and two CPU replicas, ready; prints the URL
    python deploy/podman_kube.py roll               # replace each replica in turn (maxSurge 1, maxUnavailable 0)
    python deploy/podman_kube.py down               # remove every pod, volume, secret and the network

What is played is the overlay as `kubectl kustomize` renders it (images from `make images`;
secrets from the overlay's secrets.env). podman 4.3 (Debian bookworm) plays Pods, Deployments,
ConfigMaps and PersistentVolumeClaims; what it lacks is filled in here, each in one place:

- Deployment: its `replicas` played as Pods named <deployment>-<n> from its template, one by one,
  as a ReplicaSet would make them (podman gives every pod of a Deployment the same emptyDir
  volumes, and replaces all of them at once).
- emptyDir: a volume per pod (podman makes an emptyDir a named volume; named per pod here);
  removed with its pod.
- `$(VAR)` in args and env values (--replica-id=$(POD_NAME), --model=$(EDGECHAT_MODEL)):
  expanded here, as the kubelet does (podman passes them on as written); fieldRef
  metadata.namespace and spec.nodeName (podman 4.3 refuses a pod naming them) and
  configMapKeyRef (the overlay's ConfigMap edgechat-model, which podman is not given) as values.
- containerPort: dropped (podman 4.3 publishes each on the host, so two replicas collide);
  probes' named ports resolved first. The proxy's port is published on --port (its
  LoadBalancer Service).
- Secret: created as a podman secret in the JSON form podman's secretKeyRef reads (4.3 stores
  a played Secret as YAML, which its secretKeyRef then refuses).
- The headless Service edgechat-replica: a podman network with DNS (netavark, aardvark-dns);
  replica pods join it with the network alias edgechat-replica, so the proxy's
  --replicas-dns=edgechat-replica:8000 resolves to every replica pod, as it does on a cluster.
  Unlike a Service's endpoints, a pod is listed from its start (the proxy connects once it
  answers) until its containers stop (not from the moment it starts terminating).
  The network's bridge keeps one MAC address (`pin_bridge_mac`, once a pod made it): the
  kernel gives a bridge whose address was never set the lowest of its ports' addresses, so
  removing the pod whose port that was moves it, and a pod that has nothing from the host to
  answer keeps sending to the old address (the proxy's answers to clients, its DNS queries),
  lost until its ARP entry expires and TCP's backed-off retransmission comes: every client's
  stream silent for up to a minute (53 s measured here). netavark sets one itself from 1.9
  (containers/netavark#833); Debian bookworm has 1.4.
- readinessProbe, startupProbe: podman 4.3 runs neither; `up` and `roll` poll the readiness
  probe's httpGet as the kubelet would, and count a pod ready once it answers 200.
  livenessProbe becomes a podman healthcheck (run by systemd timers where there are any;
  `podman healthcheck run POD-CONTAINER` anywhere); podman runs an httpGet probe as curl in
  the container, which the images lack, so it is given as the same GET made by python.
- preStop: podman runs none. A pod is removed as the kubelet does after it: SIGTERM, then
  SIGKILL after terminationGracePeriodSeconds.
- resources: podman applies limits (memory); requests are for a scheduler, and stay in the
  played YAML.
- Namespace, NetworkPolicy, PodDisruptionBudget, the Services themselves: nothing in podman
  to apply them to; left out. The ServiceMonitor (components/prometheus, not in cpu-demo):
  `scrape_request` is the GET Prometheus makes from it, for a pod's address.
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

try:  # deploy/images.py: podman with the project's containers.conf, waiting on /healthz
    from deploy import images  # imported from the repository root (the tests)
except ImportError:
    import images  # run as a script: deploy/ is sys.path[0]

ROOT = images.ROOT
K8S = ROOT / "deploy" / "k8s"
OVERLAY = K8S / "overlays" / "cpu-demo"
SERVICE_MONITOR = K8S / "components" / "prometheus" / "service-monitor.yaml"
NETWORK = "edgechat"
PART_OF = "app.kubernetes.io/part-of=edgechat"
REPLICAS_ALIAS = "edgechat-replica"  # the headless Service's name: --replicas-dns
UNSUPPORTED_FIELDS = ("metadata.namespace", "spec.nodeName")  # fieldRef paths podman 4.3 cannot fill
READY_TIMEOUT_S = 600


def render(overlay: Path = OVERLAY) -> list[dict]:
    """The overlay as `kubectl kustomize` renders it (its secrets.env must exist)."""
    if not (overlay / "secrets.env").exists():
        raise SystemExit(f"{overlay / 'secrets.env'} is missing: cp secrets.env.example secrets.env there "
                         "and set replica-secret and metrics-token, each its own (e.g. openssl rand -hex 32)")
    kubectl, kustomize = shutil.which("kubectl"), shutil.which("kustomize")
    if not (kubectl or kustomize):
        raise SystemExit("kubectl (or kustomize) renders the overlay; neither is installed")
    argv = [kubectl, "kustomize", str(overlay)] if kubectl else [kustomize, "build", str(overlay)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    (d,) = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    return d


# -- what podman is given -----------------------------------------------------------------------

def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) in args and env values: a defined variable's value; $$ is a literal $."""
    return re.sub(r"\$\$|\$\((\w+)\)", lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
                  text)


def pod_fields(pod: str, namespace: str) -> dict[str, str]:
    """The fieldRef paths the manifests use, as the kubelet would fill them in here."""
    return {"metadata.name": pod, "metadata.namespace": namespace, "spec.nodeName": socket.gethostname()}


def config_maps(docs: list[dict]) -> dict[str, dict[str, str]]:
    """The rendered ConfigMaps' data by their (generated) names."""
    return {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}


def config_map_value(ref: dict, maps: dict[str, dict[str, str]]) -> str:
    try:
        return maps[ref["name"]][ref["key"]]
    except KeyError:
        raise ValueError(f"configMapKeyRef {ref['name']}/{ref['key']}: no such ConfigMap key in the render") from None


def container_env(c: dict, pod: str, namespace: str, maps: dict[str, dict[str, str]] | None = None) -> dict[str, str]:
    """The variables $(VAR) may name: plain values, ConfigMap keys and the pod's own fields (in
    order, as the kubelet)."""
    fields = pod_fields(pod, namespace)
    env: dict[str, str] = {}
    for e in c.get("env", []):
        ref = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
        elif "configMapKeyRef" in ref:
            env[e["name"]] = config_map_value(ref["configMapKeyRef"], maps or {})
        elif ref.get("fieldRef", {}).get("fieldPath") in fields:
            env[e["name"]] = fields[ref["fieldRef"]["fieldPath"]]
    return env


def pod_of(deployment: dict, name: str, host_port: int = 0, maps: dict[str, dict[str, str]] | None = None) -> dict:
    """The Pod a ReplicaSet would make from `deployment`'s template, as podman 4.3 can play it
    (`maps`: the rendered ConfigMaps, `config_maps(docs)`, for configMapKeyRef)."""
    tpl = copy.deepcopy(deployment["spec"]["template"])
    spec = tpl["spec"]
    renamed = {v["name"]: f"{name}-{v['name']}" for v in spec.get("volumes", []) if "emptyDir" in v}
    for v in spec.get("volumes", []):
        v["name"] = renamed.get(v["name"], v["name"])
    namespace = deployment["metadata"].get("namespace", "default")
    for c in spec["containers"]:
        env = container_env(c, name, namespace, maps)
        for key in ("command", "args"):
            if key in c:
                c[key] = [expand(a, env) for a in c[key]]
        for e in c.get("env", []):
            if "value" in e:
                e["value"] = env[e["name"]]  # expanded in order: only variables defined above it
            if "configMapKeyRef" in e.get("valueFrom", {}):  # the ConfigMap is not played: its value
                e.pop("valueFrom")
                e["value"] = env[e["name"]]
            path = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            if path in UNSUPPORTED_FIELDS:  # podman 4.3 refuses the pod: the value itself instead
                e.pop("valueFrom")
                e["value"] = pod_fields(name, namespace)[path]
        for m in c.get("volumeMounts", []):
            m["name"] = renamed.get(m["name"], m["name"])
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if "httpGet" in c.get(probe, {}):
                port = c[probe]["httpGet"]["port"]
                c[probe]["httpGet"]["port"] = ports.get(port, port)
        if "httpGet" in c.get("livenessProbe", {}):  # podman's healthcheck: the same GET, made by python
            get = c["livenessProbe"].pop("httpGet")
            # podman 4.3 joins an exec probe's words with spaces into one shell line: one word, quoted
            c["livenessProbe"]["exec"] = {"command": [shlex.join(http_check(get["port"], get["path"]))]}
        published = [p for p in c.pop("ports", []) if host_port and p.get("name") == "http"]
        if published:
            c["ports"] = [{"containerPort": published[0]["containerPort"], "hostPort": host_port}]
    meta = {"name": name, "labels": tpl["metadata"].get("labels", {}),
            "annotations": tpl["metadata"].get("annotations", {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def http_check(port: int, path: str) -> list[str]:
    """A command exiting 0 when GET `path` on `port` answers 200: podman 4.3 runs an httpGet probe
    as curl inside the container, and the images carry python, not curl (deploy/Dockerfile's
    HEALTHCHECK is this same command)."""
    return ["python", "-c", "import sys, urllib.request as u; "
            f"sys.exit(u.urlopen('http://127.0.0.1:{port}{path}', timeout=2).status != 200)"]


def scrape_request(monitor: dict, docs: list[dict], pod_ip: str) -> tuple[str, dict[str, str]]:
    """The GET Prometheus makes of a replica pod from the ServiceMonitor `monitor` (`SERVICE_MONITOR`):
    its endpoint's port is the selected Service's port of that name, whose targetPort names the
    container's port; its path; its bearer credentials the key of the rendered Secret (the monitor's
    `edgechat-secrets` is the generator's name, which kustomize hashes). (URL, headers)."""
    (ep,) = monitor["spec"]["endpoints"]
    want = monitor["spec"]["selector"]["matchLabels"]
    (service,) = [d for d in docs if d["kind"] == "Service" and want.items() <= d["metadata"]["labels"].items()]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == ep["port"]]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"
              and service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    target = next(p["containerPort"] for p in c["ports"] if p["name"] == port["targetPort"])
    secret = one(docs, "Secret")
    cred = ep["authorization"]["credentials"]
    if not secret["metadata"]["name"].startswith(cred["name"] + "-"):
        raise ValueError(f"the ServiceMonitor's Secret {cred['name']} is not the overlay's {secret['metadata']['name']}")
    token = base64.b64decode(secret["data"][cred["key"]]).decode()
    return (f"{ep.get('scheme', 'http')}://{pod_ip}:{target}{ep['path']}",
            {"Authorization": f"{ep['authorization'].get('type', 'Bearer')} {token}"})


def secret_json(secret: dict) -> str:
    """A Secret's data as podman 4.3's secretKeyRef reads it: {"key": "<base64>"}."""
    data = dict(secret.get("data", {}))
    data.update({k: base64.b64encode(v.encode()).decode() for k, v in secret.get("stringData", {}).items()})
    return json.dumps(data)


def bridge_of(network: str = NETWORK) -> str:
    """The Linux bridge of a podman network ("" when podman does not say)."""
    r = images.podman("network", "inspect", network, check=False)
    nets = json.loads(r.stdout or "[]") if r.returncode == 0 else []
    return nets[0].get("network_interface", "") if nets else ""


def ip_command() -> list[str]:
    """`ip` where podman's bridges live: the host's network namespace, or rootless podman's own."""
    rootless = images.podman("info", "--format", "{{.Host.Security.Rootless}}", check=False).stdout.strip()
    return ["podman", "unshare", "--rootless-netns", "ip"] if rootless == "true" else ["ip"]


def pin_bridge_mac(bridge: str, ip: list[str] | None = None) -> str:
    """Set `bridge`'s MAC address to the one it has now, so that the kernel no longer moves it to
    the lowest of its ports' (a bridge whose address was set keeps it): with the address moving,
    removing the pod whose port lent it leaves the other pods' ARP entries for the host (the
    gateway) pointing at an address nobody answers to until they expire (tens of seconds), and
    what they send the host meanwhile (the proxy's answers) is lost. Returns the address."""
    ip = ip or ip_command()
    run = lambda *a: subprocess.run([*ip, *a], capture_output=True, text=True, check=True,  # noqa: E731
                                    env=images.podman_env(), timeout=60).stdout
    m = re.search(r"link/ether ([0-9a-f:]{17})", run("-o", "link", "show", "dev", bridge))
    if m is None:
        raise RuntimeError(f"{bridge} has no Ethernet address")
    run("link", "set", "dev", bridge, "address", m.group(1))
    return m.group(1)


# -- the region ----------------------------------------------------------------------------------

@dataclass
class Pod:
    name: str
    component: str  # proxy or replica
    ip: str
    volumes: list[str] = field(default_factory=list)


@dataclass
class Region:
    docs: list[dict]
    host_port: int = 0
    log: object = print

    # -- reading podman --
    def pods(self, component: str | None = None) -> list[Pod]:
        """This region's pods podman runs now (oldest first)."""
        r = images.podman("pod", "ps", "--filter", f"label={PART_OF}", "--format", "json")
        out = []
        for p in sorted(json.loads(r.stdout or "[]"), key=lambda p: p["Created"]):
            comp = p.get("Labels", {}).get("app.kubernetes.io/component", "")
            if component is None or comp == component:
                out.append(Pod(p["Name"], comp, self.ip(p["Name"]), self.volumes(p["Name"])))
        return out

    def ip(self, pod: str) -> str:
        infra = images.podman("pod", "inspect", "--format", "{{.InfraContainerID}}", pod).stdout.strip()
        nets = json.loads(images.podman("inspect", "--format", "{{json .NetworkSettings.Networks}}", infra).stdout)
        return nets.get(NETWORK, {}).get("IPAddress", "")

    def volumes(self, pod: str) -> list[str]:
        ids = images.podman("ps", "-a", "--filter", f"pod={pod}", "--format", "{{.ID}}").stdout.split()
        names = set()
        for cid in ids:
            for m in json.loads(images.podman("inspect", "--format", "{{json .Mounts}}", cid).stdout or "[]"):
                if m.get("Type") == "volume":
                    names.add(m["Name"])
        return sorted(names)

    def deployment(self, component: str) -> dict:
        return one(self.docs, "Deployment", f"edgechat-{component}")

    # -- probes, as the kubelet asks them --
    def probe_url(self, pod: Pod, probe: str = "readinessProbe") -> str:
        c = self.deployment(pod.component)["spec"]["template"]["spec"]["containers"][0]
        get = c[probe]["httpGet"]
        port = get["port"]
        if isinstance(port, str):
            port = next(p["containerPort"] for p in c["ports"] if p.get("name") == port)
        return f"http://{pod.ip}:{port}{get['path']}"

    def wait_ready(self, pod: Pod, timeout_s: float = READY_TIMEOUT_S) -> float:
        """Seconds until the pod's readiness probe answers 200 (the pod's containers must keep running)."""
        t0 = time.monotonic()
        try:
            images.wait_healthz(self.probe_url(pod), timeout_s, alive=lambda: self.running(pod.name))
        except (RuntimeError, TimeoutError) as e:
            log = images.logs(f"{pod.name}-{pod.component}")[-3000:]
            raise RuntimeError(f"{pod.name}: {e}; its log ends:\n{log}") from None
        return time.monotonic() - t0

    def running(self, pod: str) -> bool:
        r = images.podman("pod", "inspect", "--format", "{{.State}}", pod, check=False)
        return r.returncode == 0 and r.stdout.strip() == "Running"

    # -- changing it --
    def play(self, component: str, name: str) -> Pod:
        """One pod of the component's Deployment, started; replicas join the headless Service's alias."""
        doc = pod_of(self.deployment(component), name, self.host_port if component == "proxy" else 0,
                     config_maps(self.docs))
        net = f"{NETWORK}:alias={REPLICAS_ALIAS}" if component == "replica" else NETWORK
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix=f"{name}-") as f:
            yaml.safe_dump(doc, f)
            f.flush()
            r = images.podman("kube", "play", "--network", net, "--start=true", f.name, check=False)
        if r.returncode != 0:
            if images.podman("pod", "exists", name, check=False).returncode == 0:
                self.delete(Pod(name, component, "", self.volumes(name)), grace=0)  # nothing half made stays
            raise RuntimeError(f"podman kube play {name}: {r.stderr.strip() or r.stdout.strip()}")
        self.pin_bridge()
        return Pod(name, component, self.ip(name), self.volumes(name))

    def pin_bridge(self) -> None:
        """The network's bridge (netavark makes it for the first pod) keeps its MAC from now on
        (`pin_bridge_mac`; again after every play, as cheap as asking); said, not raised, where
        it cannot be set (a pod's removal may then stall every client's stream)."""
        bridge = bridge_of()
        try:
            if bridge:
                pin_bridge_mac(bridge)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            self.log(f"warning: cannot pin the MAC of bridge {bridge} ({getattr(e, 'stderr', '') or e}): "
                     "removing a pod may stall every client's stream for up to a minute")

    def delete(self, pod: Pod, grace: int | None = None) -> float:
        """Remove a pod as the kubelet does (SIGTERM, SIGKILL after the grace period: the manifest's
        terminationGracePeriodSeconds), and its volumes. Returns the seconds it took to stop.
        The pod's own containers stop first, its infra container (which holds the network) after
        them, as the kubelet tears a pod's sandbox down only once its containers exited: `podman
        pod stop` stops the infra container at once beside them, and netavark takes the pod off
        the network while a drained replica still hands its streams on (the proxy then saw it
        stall 2 s later and resumed them by recompute; the pulls from it found no route)."""
        if grace is None:
            grace = self.deployment(pod.component)["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        t0 = time.monotonic()
        listed = images.podman("ps", "-a", "--filter", f"pod={pod.name}", "--format", "{{.Names}} {{.IsInfra}}",
                               check=False).stdout.split("\n")
        own = [name for name, infra in (line.split() for line in listed if line.strip()) if infra != "true"]
        if own:
            images.podman("stop", "-t", str(grace), *own, check=False)
        images.podman("pod", "stop", "-t", str(grace), pod.name, check=False)
        stopped = time.monotonic() - t0
        images.podman("pod", "rm", "-f", pod.name, check=False)
        if pod.volumes:
            images.podman("volume", "rm", "-f", *pod.volumes, check=False)
        return stopped

    def next_name(self, component: str) -> str:
        taken = [int(m.group(1)) for p in self.pods(component)
                 if (m := re.fullmatch(rf"edgechat-{component}-(\d+)", p.name))]
        return f"edgechat-{component}-{max(taken, default=-1) + 1}"

    def up(self) -> dict[str, float]:
        """The network, the Secret, the replicas, then the proxy; seconds until each was ready."""
        if images.podman("network", "exists", NETWORK, check=False).returncode != 0:
            images.podman("network", "create", NETWORK)
        secret = one(self.docs, "Secret")
        name = secret["metadata"]["name"]
        if images.podman("secret", "inspect", name, check=False).returncode != 0:
            images.podman("secret", "create", name, "-", input=secret_json(secret))
        started = {}
        for component in ("replica", "proxy"):
            want = self.deployment(component)["spec"].get("replicas", 1)
            new = [self.play(component, self.next_name(component)) for _ in range(want - len(self.pods(component)))]
            t0 = time.monotonic()
            for pod in new:
                self.wait_ready(pod)
                started[pod.name] = time.monotonic() - t0
                self.log(f"{pod.name} ready ({pod.ip}) {started[pod.name]:.1f} s after play")
        return started

    def roll(self, component: str = "replica", before_delete=None) -> list[dict]:
        """Replace each pod in turn as a RollingUpdate with maxSurge 1, maxUnavailable 0 does: a new
        pod, ready, then the oldest one removed. `before_delete(old)` runs in between. Each step's
        figures, with its start and the old pod's stop on the monotonic clock (`started_at`, `stop_at`)."""
        steps = []
        for old in self.pods(component):
            t0 = time.monotonic()
            new = self.play(component, self.next_name(component))
            ready = self.wait_ready(new)
            if before_delete is not None:
                before_delete(old)
            t_stop = time.monotonic()
            stopped = self.delete(old)
            steps.append({"old": old.name, "new": new.name, "ready_s": ready, "stop_s": stopped,
                          "step_s": time.monotonic() - t0, "started_at": t0, "stop_at": t_stop})
            self.log(f"{old.name} -> {new.name}: new ready in {ready:.1f} s, old stopped in {stopped:.1f} s")
        return steps

    def proxy_url(self) -> str:
        (proxy, *_) = self.pods("proxy")
        return f"http://{proxy.ip}:8000"


def down(log=print) -> list[str]:
    """Remove every pod of the region, their volumes, its secrets and the network; what was removed."""
    region = Region([], log=log)
    gone = []
    for pod in region.pods():
        images.podman("pod", "rm", "-f", "-t", "5", pod.name, check=False)
        if pod.volumes:
            images.podman("volume", "rm", "-f", *pod.volumes, check=False)
        gone += [pod.name, *pod.volumes]
    for name in images.podman("secret", "ls", "--format", "{{.Name}}").stdout.split():
        if name.startswith("edgechat-secrets-"):  # the overlay's Secret, by its generated name
            images.podman("secret", "rm", name, check=False)
            gone.append(name)
    if images.podman("network", "exists", NETWORK, check=False).returncode == 0:
        images.podman("network", "rm", "-f", NETWORK, check=False)
        gone.append(NETWORK)
    return gone


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="deploy/podman_kube.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["up", "roll", "down", "status"])
    ap.add_argument("--overlay", type=Path, default=OVERLAY, help="a kustomize overlay (default: cpu-demo)")
    ap.add_argument("--port", type=int, default=8080, help="host port for the proxy (0: none; its pod IP only)")
    a = ap.parse_args(argv)
    if a.command == "down":
        print("removed:", " ".join(down()) or "nothing")
        return 0
    region = Region(render(a.overlay), host_port=a.port)
    if a.command == "up":
        region.up()
        where = f"http://127.0.0.1:{a.port}" if a.port else region.proxy_url()
        print(f"ready: {where}/v1 (OpenAI), {where.replace('http', 'ws')}/v1/stream, {where}/ (chat page)")
    elif a.command == "roll":
        region.roll()
    for p in region.pods():
        print(f"{p.name:<24} {p.component:<8} {p.ip:<15} {'running' if region.running(p.name) else 'not running'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
