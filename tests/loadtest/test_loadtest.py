"""Load tests end to end: the driver against real servers, cancellation accounting, and the CLI
launching a two-region stub topology and writing a complete report (JSON, Markdown, PNG, HTML)."""

import json

import pytest

from loadtest import workloads as W
from loadtest.__main__ import main, parse_slos
from loadtest.driver import Location, Run, RunConfig, interarrivals

from tests.regions.inproc import region
from tests.regions.ports import free_block, stub_topology
from tests.regions.processes import cli_up

HI = [{"role": "user", "content": "hi"}]


def test_interarrivals_have_the_asked_mean_and_burstiness():
    import random
    import statistics

    for arrival, shape in (("poisson", 1.0), ("gamma", 0.25)):
        gen = interarrivals(random.Random(0), 4.0, arrival, shape)
        xs = [next(gen) for _ in range(20000)]
        assert abs(statistics.mean(xs) - 0.25) < 0.02
        cv = statistics.stdev(xs) / statistics.mean(xs)
        assert abs(cv - shape ** -0.5) < 0.15  # gamma CV = 1/sqrt(shape); 1 for Poisson


def test_config_and_slo_errors():
    with pytest.raises(ValueError, match="exactly one"):
        RunConfig({"chat": 1.0}, rate=1, concurrency=2, duration_s=1)
    with pytest.raises(ValueError, match="--duration or --requests"):
        RunConfig({"chat": 1.0}, rate=1)
    assert parse_slos(["ttft=500,itl=100", "e2e=9000"]) == {"ttft": 500.0, "itl": 100.0, "e2e": 9000.0}
    with pytest.raises(ValueError):
        parse_slos(["ttft"])


@pytest.mark.anyio
async def test_cancellations_match_what_the_driver_sent():
    knobs = W.Knobs(voice_barge_in=1.0, voice_deadline_ms=0, autocomplete_deadline_ms=0, scale=0.3)
    async with region("eu", step_s=0.01) as eu:
        cfg = RunConfig({"autocomplete": 1.0, "voice": 1.0}, concurrency=4, requests=60, seed=3, knobs=knobs,
                        progress=False, slos={"ttft": 1000})
        result = await Run(cfg, [Location("local", {"eu": eu.http})]).run()
        aborts = len(eu.stubs[0].aborts)
    tot = result["totals"]["all"]
    c = tot["cancellations"]
    assert result["requests_sent"] == tot["requests"] == 60
    assert c["sent"] >= 20 and c["sent"] == c["honoured"] + c["too_late"] + c["errored"]
    assert c["errored"] == 0 and not tot["errors"] and not tot["rejections"]
    assert aborts == c["honoured"]  # every honoured cancel stopped the replica's work
    assert c["ack_ms"]["n"] == c["honoured"] and c["ack_ms"]["p50"] < 100
    assert c["tokens_after_cancel"] <= c["sent"]  # at most the token already in flight
    per_workload = {g["workload"]: g for g in result["groups"]}
    assert per_workload["voice"]["cancellations"]["sent"] == per_workload["voice"]["requests"]  # barge-in always
    assert tot["goodput_fraction"] is not None and tot["ttft"]["n"] > 0


@pytest.mark.anyio
async def test_http_protocol_and_request_budget():
    async with region("eu") as eu:
        cfg = RunConfig({"random": 1.0}, rate=50, requests=8, protocol="http", progress=False,
                        knobs=W.Knobs(input_words=(3, 5), output_tokens=(4, 6)))
        result = await Run(cfg, [Location("local", {"eu": eu.http})]).run()
    tot = result["totals"]["all"]
    assert tot["requests"] == tot["completed"] == 8 and tot["output_tokens"] >= 32
    assert tot["ttft"]["n"] == 8 and tot["itl"]["n"] >= 8 * 3


def test_cli_launches_a_stub_topology_and_writes_a_complete_report(tmp_path, capsys):
    topo = tmp_path / "t.toml"
    topo.write_text(stub_topology(free_block(12)))
    out = tmp_path / "report"
    code = main(["--topology", str(topo), "--launch", "--rate", "6,12", "--duration", "2", "--think-scale", "0.1",
                 "--slo", "ttft=500", "--slo", "itl=100", "--out", str(out), "--quiet", "--seed", "1"])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert [r["label"] for r in report["runs"]] == ["rate 6/s", "rate 12/s"]
    for run in report["runs"]:
        r = run["result"]
        assert {loc: v["order"][0] for loc, v in r["locations"].items()} == {"eu": "eu", "us": "us"}
        assert {g["region"] for g in r["groups"]} == {"eu", "us"}
        for g in r["groups"]:
            for m in ("ttft", "itl", "tpot", "e2e"):
                assert set(g[m]) >= {"p50", "p90", "p99", "p99.9"}
            assert {"goodput_rps", "cached_token_ratio", "accepted_draft_tokens", "rejections", "errors",
                    "cancellations"} <= set(g)
        assert r["totals"]["all"]["requests"] == r["requests_sent"] > 0
        assert not r["notes"], r["notes"]
    md = (out / "report.md").read_text()
    assert "## Per region and workload, by run" in md and "| eu | chat |" in md
    for png in ("ttft_cdf.png", "itl_cdf.png", "itl_over_time.png", "throughput_latency.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 4 and "<table>" in html and "src=\"http" not in html
    assert "| region | workload |" in capsys.readouterr().out


def test_cli_compare_routing(tmp_path, capsys):
    topo = tmp_path / "t.toml"
    topo.write_text(stub_topology(free_block(12)))
    out = tmp_path / "report"
    code = main(["--topology", str(topo), "--launch", "--compare-routing", "--workload", "shared-prefix",
                 "--rate", "20", "--requests", "24", "--location", "eu", "--no-relays", "--think-scale", "0",
                 "--out", str(out), "--quiet", "--no-plots"])
    assert code == 0
    runs = json.loads((out / "report.json").read_text())["runs"]
    assert [r["routing"] for r in runs] == ["round_robin", "sticky", "prefix"]
    spread = {r["routing"]: r["result"]["totals"]["region:eu"]["replicas"] for r in runs}
    assert abs(spread["round_robin"].get("eu-0", 0) - spread["round_robin"].get("eu-1", 0)) <= 2
    assert "## Routing comparison" in (out / "report.md").read_text()


def test_cli_finds_the_running_launch_at_any_port_and_loads_every_region(tmp_path, monkeypatch, capsys):
    """As the README says after `make run` (which moves the ports with PORT): `--topology` finds
    the launch `regions up` is serving, and each region's clients reach their own region."""
    port = free_block(12)
    monkeypatch.setenv("EDGECHAT_RUN_DIR", str(tmp_path / "run"))
    with cli_up(tmp_path, "--port", str(port)):
        for which in (str(tmp_path / "t.toml"), None):  # that file's launch; any one launch
            out = tmp_path / f"report-{which is None}"
            args = ["--topology"] + ([which] if which else []) + [
                "--rate", "10", "--duration", "2", "--think-scale", "0.1", "--out", str(out), "--quiet", "--no-plots"]
            assert main(args) == 0
            assert f"the running launch of {tmp_path / 't.toml'} on port {port}" in capsys.readouterr().err
            r = json.loads((out / "report.json").read_text())["runs"][0]["result"]
            assert {loc: v["order"][0] for loc, v in r["locations"].items()} == {"eu": "eu", "us": "us"}
            assert {g["region"] for g in r["groups"]} == {"eu", "us"}
            assert {k for k in r["totals"] if k.startswith("region:")} == {"region:eu", "region:us"}
            assert all(r["totals"][f"region:{x}"]["requests"] > 0 for x in ("eu", "us")) and not r["notes"]
    # Stopped: nothing found, and the error says what to do.
    assert main(["--topology", "--rate", "1", "--requests", "1", "--out", str(tmp_path / "none"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "no healthy region" in err and "no `python -m regions up` of" in err and "start one (make run)" in err


@pytest.mark.anyio
async def test_named_urls_give_each_region_its_own_clients():
    """--url eu=... --url us=...: one client location per region, so both regions get load,
    even though one answers faster (a single location would send everything there)."""
    async with region("eu", step_s=0.002) as eu, region("us", step_s=0.02) as us:
        from loadtest.__main__ import _locations, _parser

        a = _parser().parse_args(["--url", f"eu={eu.http}", "--url", f"us={us.http}", "--rate", "1"])
        locs = _locations(a, None)
        assert [loc.name for loc in locs] == ["eu", "us"]
        cfg = RunConfig({"random": 1.0}, rate=50, requests=8, progress=False,
                        knobs=W.Knobs(input_words=(3, 5), output_tokens=(2, 3)))
        result = await Run(cfg, locs).run()
    assert {loc: v["order"] for loc, v in result["locations"].items()} == {"eu": ["eu", "us"], "us": ["us", "eu"]}
    assert result["totals"]["region:eu"]["requests"] == result["totals"]["region:us"]["requests"] == 4


def test_cli_errors(capsys):
    assert main(["--rate", "1", "--duration", "1"]) == 2
    assert "say where to send load" in capsys.readouterr().err
    assert main(["--url", "http://127.0.0.1:1", "--compare-routing", "--rate", "1", "--duration", "1"]) == 2
    assert main(["--topology", "--rate", "1"]) == 2
