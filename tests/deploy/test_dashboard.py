"""The Grafana dashboard (deploy/grafana/edgechat.json): every PromQL query in it, panels and
template variables alike, names only metrics that a real proxy's and a real replica's
/metrics export (a proxy process over the default-model replica, scraped after a request),
and it shows what an operator needs (requests by outcome, TTFT, ITL, end-to-end latency,
prompt, generated and cached tokens, queue and KV use per replica, failovers, refusals)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

from tests.edge_proxy.live import proxy
from tests.prom import declared
from tests.replica.server import AUTH

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "edgechat.json"
# Words of PromQL that are not metric names where they stand alone (functions and aggregations
# are told apart by the "(" after them).
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless",
            "inf", "nan"}
NEEDED = {"edgechat_proxy_" + n for n in (
    "requests_total", "rejected_total", "ttft_seconds_bucket", "itl_seconds_bucket", "e2e_seconds_bucket",
    "prompt_tokens_total", "generation_tokens_total", "cached_tokens_total", "replica_waiting", "replica_kv_usage",
    "failovers_total")}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: what stays of it once strings, label
    matchers, ranges, label lists (by, without, on, ignoring, group_*), offsets, numbers, functions,
    aggregations and keywords are set aside."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\boffset\s+-?[0-9smhdwy]+", " ", e)
    e = re.sub(r"(?<![\w:])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?", " ", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        if m.group() not in KEYWORDS and not e[m.end():].lstrip().startswith("("):
            names.add(m.group())
    return names


def queries(dash: dict) -> list[str]:
    """Every PromQL expression of the dashboard: its panels' (rows' panels too) and its variables'."""
    out = []

    def walk(panels):
        for p in panels:
            out.extend(t["expr"] for t in p.get("targets", ()))
            walk(p.get("panels", ()))
    walk(dash["panels"])
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"label_values\(\s*([^,]+),\s*\w+\s*\)", q)
            out.append(m.group(1) if m else q)
    return out


def test_metric_names_reads_promql():
    assert metric_names('histogram_quantile(0.99, sum by (le, instance) (rate(a_bucket{x=~"$p"}[$__rate_interval])))'
                        ) == {"a_bucket"}
    assert metric_names("sum(rate(a_total[5m])) by (code) / ignoring(code) group_left b_total offset 1h") == \
        {"a_total", "b_total"}
    assert metric_names('c{le="+Inf"} * 1e3 > bool 0.5 and on(x) d') == {"c", "d"}


def test_every_query_names_a_metric_the_proxy_or_a_replica_exports(default_replica):
    dash = json.loads(DASHBOARD.read_text())
    with proxy([default_replica], "--allow-anonymous") as (port, _):
        url = f"http://127.0.0.1:{port}"
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200
        proxy_text = httpx.get(url + "/metrics").text
    replica_text = httpx.get(default_replica + "/metrics", headers=AUTH).text
    exported = declared(proxy_text) | declared(replica_text)
    named = set()
    for expr in queries(dash):
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        assert names <= exported, f"{sorted(names - exported)} in {expr!r} are exported by neither"
        named |= names
    assert NEEDED <= named, sorted(NEEDED - named)
    assert any(n.startswith("edgechat_replica_") for n in named)  # the replicas' own /metrics too
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] == "edgechat"
