"""The Kubernetes manifests, offline: every overlay renders (kustomize, as `kubectl kustomize`),
validates strictly against the Kubernetes API schemas (kubernetes-validate), and wires up:
Services, budgets, the NetworkPolicy and the ServiceMonitor select the right pods, probes and
scrape annotations name real ports, the containers' arguments parse with the real CLIs and agree
with the Services, the replicas' --model and the proxies' --tokenizer are the overlay's one model
value, on a read-only volume both mount; --tp equals the GPUs and divides the model's heads, KV
heads, FFN rows and vocabulary (its config.json from deploy/k8s/models, the volume's layout), the
memory limit covers deploy/sizing.py's formula (docs/deploy.md, "Sizing"); Prometheus scrapes
with the read-only metrics token, never the replica secret; grace periods cover the drains; the
regions, replica counts and peers are those of regions/builtin.toml."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from deploy.sizing import parameters, quantity, sizing, tp_problems
from edge_proxy.__main__ import parse_args as proxy_args
from regions.topology import load as load_topology
from replica.__main__ import parse_args as replica_args
from replica.config import ModelConfig
from replica.hf_checkpoint import config_from_hf, model_config
from replica.model.tp import local_config
from replica.presets import PRESETS
from tests.deploy.dockerfile import ROOT, stages

K8S = ROOT / "deploy" / "k8s"
MODELS = K8S / "models"  # the model volume's layout, config.json files only (its README)
VOLUME = "/models"  # where components/models mounts it
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
REGIONS = ("eu", "us")  # the overlays that are regions of regions/builtin.toml; cpu-demo is one of its own
GPU_OVERLAYS = tuple(o for o in OVERLAYS if o != "cpu-demo")  # eu-70b: region eu on the 70B, an example
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
        example = tree / "overlays" / o / "secrets.env.example"
        if example.exists():  # eu-70b has none: it builds on eu's
            shutil.copy(example, example.with_suffix(""))
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


def container_env(docs, c: dict, pod: str) -> dict[str, str]:
    """The container's variables as the kubelet sets them: values, ConfigMap keys (the rendered
    ConfigMaps'), the pod's name; Secret keys stay unresolved (their values are the examples')."""
    maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    env = {}
    for e in c.get("env", []):
        ref = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "configMapKeyRef" in ref:
            env[e["name"]] = maps[ref["configMapKeyRef"]["name"]][ref["configMapKeyRef"]["key"]]
        elif ref.get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[e["name"]] = pod
    return env


def args_of(docs, name: str, pod: str = "") -> list[str]:
    """A container's arguments with $(VAR) expanded as the kubelet does."""
    c = container(docs, name)
    return expand(c["args"], container_env(docs, c, pod or f"edgechat-{name}-7f9c-x2"))


def served_config(model: str) -> ModelConfig:
    """The config of what --model names: the image's default model, or a folder on the model volume,
    whose config.json deploy/k8s/models holds at the same path."""
    if model == "default":
        return model_config("default")  # the GGUF baked into the images
    assert model.startswith(VOLUME + "/"), f"--model={model}: a folder on the model volume ({VOLUME}) or default"
    folder = MODELS / model.removeprefix(VOLUME + "/")
    assert (folder / "config.json").is_file(), \
        f"--model={model}: add its config.json as {folder.relative_to(ROOT)}/config.json (deploy/k8s/models/README.md)"
    return config_from_hf(str(folder))


def serving_problems(docs) -> list[str]:
    """Why the replica pods of a rendered GPU overlay cannot serve: --tp not dividing the model
    (the replica's own rule, replica.model.tp.local_config, which stops it), or a memory limit
    below deploy/sizing.py's formula. Empty: they can."""
    rep = replica_args(args_of(docs, "replica"))
    cfg = served_config(rep.model)
    try:
        local_config(cfg, rep.tp)
        problems = []
    except ValueError:
        problems = tp_problems(cfg, rep.tp)  # every field, not only the first the replica names
    tpl = one(docs, "Deployment", "edgechat-replica")["spec"]["template"]["spec"]
    (shm,) = [v["emptyDir"] for v in tpl["volumes"] if v["name"] == "shm"]
    need = sizing(cfg, rep.tp, rep.dtype or "bfloat16", quantity(shm["sizeLimit"]))
    limit = quantity(tpl["containers"][0]["resources"]["limits"]["memory"])
    if limit < need.limit:
        problems.append(f"memory limit {limit / 2**30:.2f} GiB < {need.describe()}")
    return problems


def selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_validates_against_the_api_schemas(rendered, overlay, version):
    kinds = sorted(d["kind"] for d in rendered[overlay])
    gpu = ["PersistentVolumeClaim", "ServiceMonitor"] if overlay in GPU_OVERLAYS else []  # model volume, Prometheus
    assert kinds == sorted(["ConfigMap", "Deployment", "Deployment", "Namespace", "NetworkPolicy",
                            "PodDisruptionBudget", "PodDisruptionBudget", "Secret", "Service", "Service", *gpu])
    for d in rendered[overlay]:
        if d["apiVersion"] == "monitoring.coreos.com/v1":  # the operator's CRD: test_prometheus_scrapes_...
            continue
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
        ann = tpl["metadata"].get("annotations", {})
        # Only a /metrics that answers without credentials may invite annotation-based scrape jobs (which
        # send none): the proxies'. The replicas' needs the metrics token (the ServiceMonitor sends it).
        assert ("prometheus.io/scrape" in ann) == (name == "edgechat-proxy"), (name, ann)
        if name == "edgechat-proxy":
            assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) in ports.values()
            assert ann["prometheus.io/path"] == "/metrics" == c["livenessProbe"]["httpGet"]["path"]  # the kubelet's
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
    cfg = proxy_args(args_of(docs, "proxy"))
    headless = one(docs, "Service", "edgechat-replica")
    assert headless["spec"]["clusterIP"] == "None" and not headless["spec"]["publishNotReadyAddresses"]
    assert cfg.discovery.name == headless["metadata"]["name"] and not cfg.discovery.srv
    assert cfg.discovery.port == headless["spec"]["ports"][0]["port"] == rc["ports"][0]["containerPort"]
    assert cfg.host == "0.0.0.0" and cfg.port == pc["ports"][0]["containerPort"]
    public = one(docs, "Service", "edgechat-proxy")
    assert public["spec"]["type"] == "LoadBalancer" and public["spec"]["sessionAffinity"] == "None"
    assert cfg.otel_otlp == (overlay in GPU_OVERLAYS)  # the otel component: spans to the collector

    rep = replica_args(args_of(docs, "replica"))
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

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_model_is_one_value_both_read_from_a_read_only_volume(rendered, overlay):
    """The replicas serve and the proxies tokenize the same model: both read $(EDGECHAT_MODEL) from one
    key of the ConfigMap, whose hashed name rolls both Deployments when it changes; a folder is on the
    model volume, mounted read-only in both."""
    docs = rendered[overlay]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    model = cm["data"]["model"]
    assert replica_args(args_of(docs, "replica")).model == model == proxy_args(args_of(docs, "proxy")).tokenizer
    claims = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PersistentVolumeClaim"}
    for name in ("replica", "proxy"):
        c = container(docs, name)
        refs = [e["valueFrom"]["configMapKeyRef"] for e in c["env"] if "configMapKeyRef" in e.get("valueFrom", {})]
        assert refs == [{"name": cm["metadata"]["name"], "key": "model"}]
        if model == "default":
            assert overlay == "cpu-demo"  # the GPU overlays serve a real model
            continue
        spec = one(docs, "Deployment", f"edgechat-{name}")["spec"]["template"]["spec"]
        (mount,) = [m for m in c["volumeMounts"] if model.startswith(m["mountPath"].rstrip("/") + "/")]
        assert mount["mountPath"] == VOLUME and mount["readOnly"], mount
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        if "hostPath" in volume:  # a folder of the nodes (docs/deploy.md): it must be there
            assert volume["hostPath"]["type"] == "Directory"
        else:
            claim = volume["persistentVolumeClaim"]
            assert claim["readOnly"] and claims[claim["claimName"]]["spec"]["accessModes"] == ["ReadOnlyMany"]


def test_the_models_config_files_are_the_presets_shapes():
    """deploy/k8s/models holds each model's config.json as the hub has it: where replica/presets.py has
    the shape too, they agree (a typo in either would size or split the model wrongly)."""
    eight = config_from_hf(str(MODELS / "meta-llama" / "Llama-3.1-8B-Instruct"))
    assert dataclasses.replace(eight, name=PRESETS["llama-3.1-8b"].name) == PRESETS["llama-3.1-8b"]
    assert round(parameters(eight) / 1e9, 2) == 8.03  # Meta's figure: 8.03 B
    seventy = config_from_hf(str(MODELS / "meta-llama" / "Llama-3.1-70B-Instruct"))
    assert round(parameters(seventy) / 1e9, 2) == 70.55  # 70.55 B
    assert (seventy.num_heads, seventy.num_kv_heads, seventy.vocab_size) == (64, 8, eight.vocab_size)


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_tp_divides_the_model_and_the_memory_limit_covers_it(rendered, overlay):
    assert serving_problems(rendered[overlay]) == []


def test_the_checks_catch_todays_eu_overlay(rendered, tmp_path, monkeypatch):
    """The eu overlay as it was (the default model at --tp 2: 9 heads, 3 KV heads) fails the split,
    naming each field; so do the 8B at --tp 3 (heads, KV heads, FFN rows) and an 8B of an odd
    vocabulary at --tp 2; a memory limit under the formula fails sizing."""
    def eu(model: str | None = None, tp: int | None = None, memory: str | None = None):
        docs = copy.deepcopy(rendered["eu"])
        if model:
            next(d for d in docs if d["kind"] == "ConfigMap")["data"]["model"] = model
        c = container(docs, "replica")
        if tp:
            c["args"] = [f"--tp={tp}" if a.startswith("--tp=") else a for a in c["args"]]
        if memory:
            c["resources"]["limits"]["memory"] = memory
        return serving_problems(docs)

    assert eu() == []
    old = eu(model="default")
    assert [p.split(" of ")[0] for p in old] == ["--tp 2 must divide num_heads = 9", "--tp 2 must divide num_kv_heads = 3"]
    assert [p.split(" of ")[0] for p in eu(tp=3, memory="40Gi")] == ["--tp 3 must divide num_heads = 32",
                                                                     "--tp 3 must divide num_kv_heads = 8",
                                                                     "--tp 3 must divide intermediate_size = 14336"]
    (short,) = eu(memory="29Gi")  # the formula says 29.96 GiB
    assert short.startswith("memory limit 29.00 GiB < weights 14.96 GiB") and short.endswith(">= 30Gi")
    assert eu(memory="30Gi") == []

    # the vocabulary too, from the config.json on the volume's path: an 8B whose vocabulary is odd
    models = tmp_path / "models"
    shutil.copytree(MODELS, models)
    config = models / "meta-llama" / "Llama-3.1-8B-Instruct" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "vocab_size": 128257}))
    monkeypatch.setattr(sys.modules[__name__], "MODELS", models)
    (odd,) = eu()
    assert odd.startswith("--tp 2 must divide vocab_size = 128257 of ")


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-70B-Instruct", *PRESETS])
def test_sizing_splits_as_the_replica_does(name):
    """deploy/sizing.py (torch-free, for operators) refuses exactly the --tp the replica refuses."""
    cfg = config_from_hf(str(MODELS / name)) if "/" in name else PRESETS[name]
    for tp in range(1, 9):
        try:
            local_config(cfg, tp)
            refused = False
        except ValueError:
            refused = True
        assert bool(tp_problems(cfg, tp)) == refused, (name, tp)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_scrapes_the_replicas_with_the_metrics_token(rendered, overlay):
    """The ServiceMonitor (components/prometheus) scrapes every ready replica's /metrics through the
    headless Service's port, presenting the Secret's metrics-token, which the replicas read as their
    metrics token (accepted on GET /metrics only) and which is not the replica secret; the
    NetworkPolicy lets the monitoring namespace reach that port."""
    docs = rendered[overlay]
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    if overlay == "cpu-demo":  # kind/minikube without the operator's CRDs: docs/deploy.md's scrape_configs
        assert monitors == []
        return
    (sm,) = monitors
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["metadata"]["namespace"] == "edgechat"
    services = [d for d in docs if d["kind"] == "Service" and selects(sm["spec"]["selector"]["matchLabels"],
                                                                         d["metadata"]["labels"])]
    assert [s["metadata"]["name"] for s in services] == ["edgechat-replica"]
    (ep,) = sm["spec"]["endpoints"]
    (port,) = [p for p in services[0]["spec"]["ports"] if p["name"] == ep["port"]]
    assert ep["path"] == "/metrics" and ep["scheme"] == "http" and set(ep) <= {
        "port", "path", "scheme", "interval", "authorization"}  # fields of the CRD's Endpoint, as spelled there
    assert ep["authorization"]["type"] == "Bearer"
    cred = ep["authorization"]["credentials"]
    secret = one(docs, "Secret")
    assert cred["name"] == secret["metadata"]["name"] and cred["key"] in secret["data"]  # the hashed name, renamed
    rc = container(docs, "replica")
    rep = replica_args(args_of(docs, "replica"))
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in rc["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs[rep.metrics_token_env] == {"name": secret["metadata"]["name"], "key": cred["key"]}
    assert refs[rep.secret_env]["key"] != cred["key"]  # never the secret that generates text
    assert not any(e["name"] == rep.metrics_token_env for e in container(docs, "proxy")["env"])
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    monitoring = [r for r in policy["spec"]["ingress"] if "namespaceSelector" in r["from"][0]]
    target = next(p["containerPort"] for p in rc["ports"] if p["name"] == port["targetPort"])
    assert any(p["port"] == target for r in monitoring for p in r["ports"])


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
        """How long the preStop may take: `sleep N`, or the replica's drain script's wait."""
        cmd = c["lifecycle"]["preStop"]["exec"]["command"]
        if cmd[0] == "sleep":
            return float(cmd[1])
        assert cmd[:2] == ["python", "-c"], cmd
        assert '"http://127.0.0.1:8000/v1/drain", method="POST"' in cmd[2] and "EDGECHAT_REPLICA_SECRET" in cmd[2]
        (bound,) = re.findall(r"end = time\.time\(\) \+ (\d+)", cmd[2])
        return float(bound) + 3  # + the drain request's own timeout

    def grace(name) -> float:
        return one(docs, "Deployment", f"edgechat-{name}")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]

    # Proxy: out of the Service's endpoints first, then SIGTERM: drain for up to --drain-timeout.
    assert 1 <= pre_stop(pc) and grace("proxy") >= pre_stop(pc) + cfg.drain_timeout_s + 5
    # Replica: drained (its streams handed on) or seen gone from DNS by every proxy before SIGTERM.
    assert pre_stop(rc) >= cfg.discovery.interval_s + COREDNS_TTL_S + 1
    assert grace("replica") >= pre_stop(rc) + REPLICA_SHUTDOWN_S + 5
    rolling = one(docs, "Deployment", "edgechat-replica")["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0  # a new replica is ready before an old one leaves
