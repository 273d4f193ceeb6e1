"""python -m loadtest: latency load tests against edgechat, per region and workload.

Where to send load (one of):
  --url [REGION=]URL       a proxy (or relay) base URL; repeat for several regions
                           (REGION=URL each: one client location per region, its own region first)
  --targets FILE           URLs written by `python -m regions up --targets FILE`
  --topology [TOML]        a topology that `python -m regions up` (or `make run`) is serving, found
                           in its run dir whatever --port moved it to (any one running launch if no
                           file; the file's own ports when none runs)
  --topology [TOML] --launch   bring the topology up here, run, take it down

How much: --rate R (open loop, sessions/s; Poisson or --arrival gamma --burstiness B)
or --concurrency N (closed loop); several comma-separated values run one level each.
--duration S and/or --requests N bound every level.

Examples:
  python -m loadtest --url http://127.0.0.1:8100 --rate 2 --duration 30
  python -m loadtest --topology --launch --workload chat,voice --rate 0.5,2 --duration 60 \\
      --slo ttft=1000 --slo itl=200 --out report/
  python -m loadtest --topology my.toml --launch --compare-routing --rate 1 --requests 100
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import replace

from loadtest import report as R
from loadtest import workloads as W
from loadtest.driver import Location, Run, RunConfig
from regions import running

COMPARE_MODES = ("round_robin", "sticky", "prefix")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", action="append", default=[], metavar="[REGION=]URL")
    where.add_argument("--targets", metavar="FILE")
    where.add_argument("--topology", nargs="?", const="", default=None, metavar="TOML")
    p.add_argument("--launch", action="store_true", help="launch the --topology here for the run")
    p.add_argument("--replica-kind", choices=("model", "stub"), help="override the topology's replica kind")
    p.add_argument("--location", action="append", default=[], help="only these client locations (repeat)")
    p.add_argument("--no-relays", action="store_true", help="with --launch: no latency relays")
    p.add_argument("--workload", default="chat,shared-prefix,voice,autocomplete,random",
                   help=f"comma list, optionally weighted (chat=3,voice=1); from {', '.join(W.WORKLOADS)}")
    p.add_argument("--rate", default="", help="sessions per second (open loop); comma list = levels")
    p.add_argument("--concurrency", default="", help="concurrent users (closed loop); comma list = levels")
    p.add_argument("--arrival", default="poisson", choices=("poisson", "gamma"))
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (< 1: burstier than Poisson)")
    p.add_argument("--duration", type=float, default=0.0, metavar="S")
    p.add_argument("--requests", type=int, default=0, metavar="N")
    p.add_argument("--protocol", default="ws", choices=("ws", "http"))
    p.add_argument("--api-key", default=os.environ.get("EDGECHAT_API_KEY"), help="(env EDGECHAT_API_KEY)")
    p.add_argument("--slo", action="append", default=[], metavar="NAME=MS",
                   help="ttft, tpot, itl (largest gap of a request) or e2e, in ms; repeat or comma-separate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--think-scale", type=float, default=1.0, help="multiply think times and pauses")
    p.add_argument("--input-words", default="20,200", help="random workload: min,max prompt words")
    p.add_argument("--output-tokens", default="16,128", help="random workload: min,max output tokens")
    p.add_argument("--barge-in", type=float, default=0.3, help="voice: probability a reply is interrupted")
    p.add_argument("--voice-deadline-ms", type=float, default=1500.0)
    p.add_argument("--autocomplete-deadline-ms", type=float, default=1000.0)
    p.add_argument("--drain", type=float, default=60.0, metavar="S", help="grace for requests in flight at the end")
    p.add_argument("--compare-routing", action="store_true",
                   help=f"run every level under each routing mode ({', '.join(COMPARE_MODES)}); needs --launch")
    p.add_argument("--routing", default="auto", help="with --launch: the proxies' routing mode")
    p.add_argument("--out", default="loadtest-report", help="report folder")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no live progress line")
    return p


def _pair(s: str, what: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in s.split(","))
    except ValueError:
        raise ValueError(f"{what} is MIN,MAX, got {s!r}") from None
    if not 0 < lo <= hi:
        raise ValueError(f"{what} needs 0 < MIN <= MAX, got {s!r}")
    return lo, hi


def parse_slos(items: list[str]) -> dict[str, float]:
    out = {}
    for item in (x for s in items for x in s.split(",") if x.strip()):
        name, sep, ms = item.partition("=")
        try:
            out[name.strip()] = float(ms)
        except ValueError:
            raise ValueError(f"--slo is NAME=MILLISECONDS, got {item!r}") from None
        if not sep:
            raise ValueError(f"--slo is NAME=MILLISECONDS, got {item!r}")
    return out


def _levels(a) -> list[tuple[str, float, int]]:
    if bool(a.rate) == bool(a.concurrency):
        raise ValueError("give exactly one of --rate and --concurrency")
    try:
        if a.rate:
            return [(f"rate {float(x):g}/s", float(x), 0) for x in a.rate.split(",")]
        return [(f"{int(x)} users", 0.0, int(x)) for x in a.concurrency.split(",")]
    except ValueError:
        raise ValueError("--rate and --concurrency take comma-separated numbers") from None


def _locations(a, targets: dict | None) -> list[Location]:
    if a.url:
        regions, named = {}, True
        for i, u in enumerate(a.url):
            name, sep, url = u.partition("=")
            if not sep or "://" in name:
                name, url, named = ("local" if len(a.url) == 1 else f"r{i}"), u, False
            regions[name] = url
        if named and len(regions) > 1:
            # One client population per region, each at its own region first (the others only when
            # it fails): a single location would send everything to whichever region answers first.
            return [Location(name, dict(regions), declared_rtt_ms={name: 0.0}) for name in regions]
        return [Location("local", regions)]
    declared = None if targets.get("relays", True) else targets.get("client_rtt_ms", {})
    locs = [Location(name, dict(regions), declared_rtt_ms=None if declared is None else declared.get(name, {}))
            for name, regions in targets["clients"].items()]
    if a.location:
        unknown = set(a.location) - {loc.name for loc in locs}
        if unknown:
            raise ValueError(f"unknown --location {', '.join(sorted(unknown))}")
        locs = [loc for loc in locs if loc.name in a.location]
    return locs


def running_targets(topology: str) -> tuple[dict | None, str]:
    """The targets of the running `python -m regions up` of `topology` ("": any one
    launch) and a title naming it, or (None, "") when none runs. Several: an error
    naming their files (pass one to --targets)."""
    launches = running.live()
    if topology:
        want = os.path.realpath(topology)
        launches = [x for x in launches if os.path.realpath(x.get("source", "")) == want]
    ready = [x for x in launches if x.get("state") == "ready"]
    if len(ready) > 1:
        files = ", ".join(f"--targets {x['file']}" for x in ready)
        raise ValueError(f"{len(ready)} launches of {topology or 'topologies'} are running; say which: {files}")
    if not ready and launches:
        x = launches[0]
        raise ValueError(f"the launch on port {x.get('port')} (pid {x.get('pid')}) is still starting: run this "
                         "again once it says ready")
    if not ready:
        return None, ""
    x = ready[0]
    return x, f"{x.get('source')} on port {x.get('port')}"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}")


async def main_async(a) -> int:
    from regions import topology as T
    from regions.launch import LaunchError, Stack, targets_for

    mix = W.parse_mix(a.workload)
    levels = _levels(a)
    knobs = W.Knobs(input_words=_pair(a.input_words, "--input-words"),
                    output_tokens=_pair(a.output_tokens, "--output-tokens"), voice_barge_in=a.barge_in,
                    voice_deadline_ms=a.voice_deadline_ms, autocomplete_deadline_ms=a.autocomplete_deadline_ms,
                    scale=a.think_scale)
    base = RunConfig(mix, rate=levels[0][1], concurrency=levels[0][2], arrival=a.arrival, burstiness=a.burstiness,
                     duration_s=a.duration, requests=a.requests, protocol=a.protocol, api_key=a.api_key,
                     seed=a.seed, slos=parse_slos(a.slo), drain_s=a.drain, knobs=knobs, progress=not a.quiet)
    if (a.compare_routing or a.launch) and a.topology is None:
        raise ValueError("--launch and --compare-routing need --topology [TOML]")
    if a.compare_routing and not a.launch:
        raise ValueError("--compare-routing switches the proxies' routing, so it needs --launch")
    stack = None
    targets = None
    topo = None
    title = ", ".join(a.url) or a.targets
    unlaunched = ""  # --topology whose launch was not found running: a hint if nothing answers
    if a.topology is not None and not a.launch:
        targets, title = running_targets(a.topology)
    if a.topology is not None and targets is None:
        topo = T.load(a.topology or None)
        if a.replica_kind:
            topo = replace(topo, replica_kind=a.replica_kind)
        targets = targets_for(topo, relays=not a.no_relays)
        title = topo.source
        if not a.launch:
            unlaunched = (f"; no `python -m regions up` of {topo.source} is running (none found in "
                          f"{running.run_dir()}): start one (make run), or add --launch")
    elif a.topology is not None:
        print(f"loadtest: the running launch of {title} (pid {targets.get('pid')}, logs in {targets.get('log_dir')})",
              file=sys.stderr)
    elif a.targets:
        with open(a.targets) as f:
            targets = json.load(f)
    elif not a.url:
        raise ValueError("say where to send load: --url, --targets or --topology")
    modes = list(COMPARE_MODES) if a.compare_routing else [a.routing]
    runs = []
    try:
        if a.launch:
            stack = Stack(topo, routing=modes[0], relays=not a.no_relays, out=sys.stderr)
            print(f"loadtest: launching {topo.source} ({topo.replica_kind} replicas)", file=sys.stderr)
            await stack.start()
        for mode in modes:
            if stack is not None and stack.routing != mode:
                print(f"loadtest: restarting the proxies with {mode} routing", file=sys.stderr)
                await stack.restart_proxies(mode)
            for label, rate, conc in levels:
                full = f"{mode} · {label}" if a.compare_routing else label
                cfg = replace(base, rate=rate, concurrency=conc,
                              knobs=replace(knobs, nonce=f"run {a.seed} {full}" if len(modes) * len(levels) > 1
                                            else ""))
                print(f"loadtest: {full}", file=sys.stderr)
                try:
                    result = await Run(cfg, _locations(a, targets)).run()
                except ConnectionError as e:
                    raise ConnectionError(f"{e}{unlaunched}") from None
                runs.append({"label": full, "routing": mode if a.compare_routing else None, "rate": rate,
                             "concurrency": conc, "result": result})
    except LaunchError as e:
        print(f"loadtest: {e}", file=sys.stderr)
        return 1
    finally:
        if stack is not None:
            await stack.stop()
    report = {"meta": {"title": title,
                       "command": "python -m loadtest " + " ".join(shlex.quote(x) for x in sys.argv[1:]),
                       "machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                       "workloads": a.workload, "slos_ms": base.slos, "protocol": a.protocol, "seed": a.seed},
              "runs": runs}
    files = R.write(report, a.out, with_plots=not a.no_plots)
    print(f"loadtest: report in {files['md']} and {files['html']}", file=sys.stderr)
    print(R.markdown(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        import uvloop

        return uvloop.run(main_async(a))
    except (ValueError, ConnectionError) as e:
        print(f"loadtest: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
