"""The Kubernetes manifests, offline: every overlay renders (kustomize, as `kubectl kustomize`),
validates strictly against the Kubernetes API schemas (kubernetes-validate), and wires up:
Services, budgets and the NetworkPolicy select the right pods, probes and scrape annotations
name real ports, the containers' arguments parse with the real CLIs and agree with the
Services, GPUs equal --tp, grace periods cover the drains, the regions, replica counts and
peers are those of regions/builtin.toml."""

from __future__ import annotations

import re
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from edge_proxy.__main__ import parse_args as proxy_args
from regions.topology import load as load_topology
from replica.__main__ import parse_args as replica_args
from tests.deploy.dockerfile import ROOT, stages

K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
REGIONS = ("eu", "us")  # the overlays that are regions of regions/builtin.toml; cpu-demo is one of its own
VERSIONS = ("1.29.0", kubernetes_validate.utils.latest_version())  # oldest supported, newest known
COREDNS_TTL_S = 5  # the kubernetes plugin's default TTL for Service records
REPLICA_SHUTDOWN_S = 5  # python -m replica: uvicorn's timeout_graceful_shutdown


def test_there_is_an_overlay_per_region():
    assert {r.name for r in load_topology().regions} == set(REGIONS) <= set(OVERLAYS)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """Each overlay rendered from a copy of deploy/k8s whose secrets.env are the examples."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with its built-in kustomize) renders the manifests; it ships with this machine image"
    tree = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("secrets.env"))
    out = {}
    for o in OVERLAYS:
        shutil.copy(tree / "overlays" / o / "secrets.env.example", tree / "overlays" / o / "secrets.env")
        r = subprocess.run([kubectl, "kustomize", str(tree / "overlays" / o)], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, f"{o}: {r.stderr}"
        out[o] = [d for d in yaml.safe_load_all(r.stdout) if d]
    return out


def one(docs, kind: str, name: str | None = None) -> dict:
    (d,) = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    return d


def container(docs, name: str) -> dict:
    return one(docs, "Deployment", f"edgechat-{name}")["spec"]["template"]["spec"]["containers"][0]


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion in container args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


def selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_validates_against_the_api_schemas(rendered, overlay, version):
    kinds = sorted(d["kind"] for d in rendered[overlay])
    assert kinds == ["Deployment", "Deployment", "Namespace", "NetworkPolicy", "PodDisruptionBudget",
                     "PodDisruptionBudget", "Secret", "Service", "Service"]
    for d in rendered[overlay]:
        kubernetes_validate.validate(d, version, strict=True)  # raises ValidationError naming the field


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_budgets_and_policy_select_the_right_pods(rendered, overlay):
    docs = rendered[overlay]
    pods = {d["metadata"]["name"]: d["spec"]["template"] for d in docs if d["kind"] == "Deployment"}
    for name, tpl in pods.items():
        dep = one(docs, "Deployment", name)
        assert selects(dep["spec"]["selector"]["matchLabels"], tpl["metadata"]["labels"])
        c = tpl["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in c:
                assert c[probe]["httpGet"]["port"] in ports
        ann = tpl["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) in ports.values()
        assert ann["prometheus.io/path"] == "/metrics"
        sec = tpl["spec"]["securityContext"]
        assert sec["runAsNonRoot"] and sec["runAsUser"] == 10001  # the images' USER
        assert not c["securityContext"]["allowPrivilegeEscalation"]
    for kind in ("Service", "PodDisruptionBudget"):
        for d in (d for d in docs if d["kind"] == kind):
            sel = d["spec"]["selector"] if kind == "Service" else d["spec"]["selector"]["matchLabels"]
            matched = [n for n, tpl in pods.items() if selects(sel, tpl["metadata"]["labels"])]
            assert matched == [d["metadata"]["name"]], f"{kind} {d['metadata']['name']} selects {matched}"
            if kind == "Service":
                names = {p["name"] for p in pods[matched[0]]["spec"]["containers"][0]["ports"]}
                assert all(p["targetPort"] in names for p in d["spec"]["ports"])
        if kind == "PodDisruptionBudget":
            assert all(d["spec"]["maxUnavailable"] == 1 for d in docs if d["kind"] == kind)

    proxy, replica = pods["edgechat-proxy"]["metadata"]["labels"], pods["edgechat-replica"]["metadata"]["labels"]
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert selects(policy["spec"]["podSelector"]["matchLabels"], replica)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    in_namespace = [r for r in policy["spec"]["ingress"] if "podSelector" in r["from"][0]]
    assert [selects(r["from"][0]["podSelector"]["matchLabels"], proxy) for r in in_namespace] == [True]
    assert not selects(in_namespace[0]["from"][0]["podSelector"]["matchLabels"], replica)
    others = [r for r in policy["spec"]["ingress"] if r not in in_namespace]
    assert all("namespaceSelector" in r["from"][0] for r in others)  # monitoring only

    secret = one(docs, "Secret")
    for c in (tpl["spec"]["containers"][0] for tpl in pods.values()):
        for e in c["env"]:
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == secret["metadata"]["name"]  # the generated (hashed) name
                assert ref["key"] in secret["data"] or ref.get("optional")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_arguments_parse_and_agree_with_the_services(rendered, overlay, monkeypatch):
    docs = rendered[overlay]
    pc, rc = container(docs, "proxy"), container(docs, "replica")
    proxy_env = {e["name"]: e.get("value", "") for e in pc["env"]}
    for k, v in proxy_env.items():
        if k.startswith("OTEL_"):
            monkeypatch.setenv(k, v)
    cfg = proxy_args(expand(pc["args"], {"POD_NAME": "edgechat-proxy-0"}))
    headless = one(docs, "Service", "edgechat-replica")
    assert headless["spec"]["clusterIP"] == "None" and not headless["spec"]["publishNotReadyAddresses"]
    assert cfg.discovery.name == headless["metadata"]["name"] and not cfg.discovery.srv
    assert cfg.discovery.port == headless["spec"]["ports"][0]["port"] == rc["ports"][0]["containerPort"]
    assert cfg.host == "0.0.0.0" and cfg.port == pc["ports"][0]["containerPort"]
    public = one(docs, "Service", "edgechat-proxy")
    assert public["spec"]["type"] == "LoadBalancer" and public["spec"]["sessionAffinity"] == "None"
    assert cfg.otel_otlp == (overlay in REGIONS)  # the otel component: spans to the collector

    rep = replica_args(expand(rc["args"], {"POD_NAME": "edgechat-replica-7f9c-x2"}))
    assert rep.replica_id == "edgechat-replica-7f9c-x2"  # unique per pod: the proxies key replicas by it
    assert (rep.host, rep.port) == ("0.0.0.0", rc["ports"][0]["containerPort"])
    gpus = rc["resources"].get("limits", {}).get("nvidia.com/gpu")
    if overlay == "cpu-demo":
        assert gpus is None and rep.device == "cpu" and rc["image"].endswith("-cpu")
        assert cfg.allow_anonymous and not cfg.peers
    else:
        assert gpus == rep.tp and rep.tp >= 1 and rc["image"].endswith("-cuda")  # one NVLink node per replica
        assert not cfg.allow_anonymous

    assert pc["image"].startswith("edgechat-proxy:") and rc["image"].startswith("edgechat-replica:")
    assert "replica-" + rc["image"].rsplit("-", 1)[1] in stages()  # the tag names a Dockerfile target

@pytest.mark.parametrize("overlay", REGIONS)
def test_regions_replicas_and_peers_are_the_topologys(rendered, overlay):
    topo = load_topology()
    docs = rendered[overlay]
    cfg = proxy_args(container(docs, "proxy")["args"])
    assert cfg.region == overlay
    assert one(docs, "Deployment", "edgechat-replica")["spec"]["replicas"] == len(topo.region(overlay).replicas)
    assert [(p.region, p.rtt_ms) for p in cfg.peers] == [(r, topo.rtt(overlay, r)) for r in topo.peers(overlay)]
    for p in cfg.peers:  # through the peer region's public proxy Service (port 80 of its load balancer)
        assert re.fullmatch(rf"wss?://{p.region}\.[a-z0-9.-]+(:80)?/v1/stream", p.url), p.url


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_periods_cover_the_drains(rendered, overlay):
    docs = rendered[overlay]
    pc, rc = container(docs, "proxy"), container(docs, "replica")
    cfg = proxy_args(pc["args"])

    def pre_stop(c) -> float:
        cmd = c["lifecycle"]["preStop"]["exec"]["command"]
        assert cmd[0] == "sleep"
        return float(cmd[1])

    def grace(name) -> float:
        return one(docs, "Deployment", f"edgechat-{name}")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]

    # Proxy: out of the Service's endpoints first, then SIGTERM: drain for up to --drain-timeout.
    assert 1 <= pre_stop(pc) and grace("proxy") >= pre_stop(pc) + cfg.drain_timeout_s + 5
    # Replica: every proxy has seen it leave DNS (and moved its streams) before SIGTERM.
    assert pre_stop(rc) >= cfg.discovery.interval_s + COREDNS_TTL_S + 1
    assert grace("replica") >= pre_stop(rc) + REPLICA_SHUTDOWN_S + 5
    rolling = one(docs, "Deployment", "edgechat-replica")["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0  # a new replica is ready before an old one leaves
