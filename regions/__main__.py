"""python -m regions up [topology.toml]     launch a topology (built-in two-region one by default)
python -m regions check [topology.toml]  validate a topology and print its resolved ports

`up` refuses at once, before starting anything, a port already in use (naming
it, and a --port that is free). Then it says where the logs go, each replica's
start-up stages as they end (building kernels, loading weights, building engine,
warming up), one line per component with its URL once ready, and serves until
Ctrl-C or SIGTERM, when it stops everything (relays, then proxies, which drain, then
replicas); a second signal kills at once. Until then a replica or proxy that
exits is restarted with backoff (a line says so, and when it is ready again);
the proxies fail its streams over meanwhile, or forward to a peer region.

While it runs, its URLs are in the run dir (`regions.running`), where
`python -m loadtest --topology` finds them whatever --port moved them to.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import sys
from dataclasses import replace

from regions import running
from regions.launch import DISCOVERY, LaunchError, Stack, check_ports, port_hint
from regions.topology import ROUTING_MODES, Topology, TopologyError, load, shift_ports


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m regions", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="launch a topology and serve until Ctrl-C")
    up.add_argument("topology", nargs="?", help="topology TOML (default: the built-in two-region topology)")
    up.add_argument("--port", type=int, default=None,
                    help="move every port so the first region's proxy listens here (the rest keep their offsets)")
    up.add_argument("--model", default=None,
                    help="what the replicas serve (python -m replica --model: 'default', a .gguf file, a Hugging Face "
                         "folder or hub id, a preset name); the proxies tokenize with the same. Default: the "
                         "topology's model")
    up.add_argument("--replica-args", default="", metavar="'ARGS'",
                    help="more python -m replica flags, one shell-quoted string (--replica-args='--max-num-seqs 16')")
    up.add_argument("--proxy-args", default="", metavar="'ARGS'",
                    help="more python -m edge_proxy flags, one shell-quoted string "
                         "(--proxy-args='--allowed-origin http://localhost:3000')")
    up.add_argument("--routing", default="auto", choices=ROUTING_MODES, help="proxy routing mode")
    up.add_argument("--discovery", default="static", choices=DISCOVERY,
                    help="how proxies find replicas: static --replica URLs, or dns: --replicas-dns against a zone "
                         "the launcher serves, as on Kubernetes")
    up.add_argument("--no-relays", action="store_true", help="no latency relays (clients talk to proxies directly)")
    up.add_argument("--log-dir", default=None, help="component logs (default: a fresh temporary folder)")
    up.add_argument("--targets", default=None, metavar="FILE",
                    help="write the URLs (regions, client relays) as JSON here, for python -m loadtest --targets")
    chk = sub.add_parser("check", help="validate a topology and print its resolved ports")
    chk.add_argument("topology", nargs="?")
    return p


def topology_of(a) -> Topology:
    """The topology `up` launches: the file (or built-in), moved by --port, with --model and the extra flags."""
    topo = load(a.topology)
    if a.port is not None:
        topo = shift_ports(topo, a.port)
    try:
        extra_replica, extra_proxy = shlex.split(a.replica_args), shlex.split(a.proxy_args)
    except ValueError as e:
        raise TopologyError(f"--replica-args / --proxy-args: {e}") from None
    return replace(topo, model=a.model or topo.model, replica_args=topo.replica_args + tuple(extra_replica),
                   proxy_args=topo.proxy_args + tuple(extra_proxy))


async def _up(a, topo: Topology) -> int:
    port = topo.regions[0].proxy_port
    reg = running.Registration(port, topo.source)
    try:
        reg.claim()
    except running.Held as e:
        state = e.info.get("state", "starting")
        print(f"regions: port {port}: another `python -m regions up` (pid {e.info.get('pid', '?')}, {state}) holds "
              f"it; nothing was started. Stop it, or {port_hint(topo, not a.no_relays)}", file=sys.stderr)
        return 1
    try:
        return await _serve(a, topo, reg)
    finally:
        reg.release()


async def _serve(a, topo: Topology, reg: running.Registration) -> int:
    try:
        check_ports(topo, relays=not a.no_relays)  # before the log folder or anything else
    except LaunchError as e:
        print(f"regions: {e}", file=sys.stderr)
        return 1
    stack = Stack(topo, routing=a.routing, log_dir=a.log_dir, relays=not a.no_relays, discovery=a.discovery)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = [0]

    def on_signal() -> None:
        signals[0] += 1
        if signals[0] == 1:
            stop.set()
        else:
            loop.create_task(stack.kill())

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    def on_up() -> None:  # before the "ready:" line: whoever reads it finds the URLs
        if a.targets:
            with open(a.targets, "w") as f:
                json.dump(stack.targets(), f, indent=1)
        reg.ready({**stack.targets(), "log_dir": str(stack.log_dir)})

    start = loop.create_task(stack.start(on_up))
    stopped = loop.create_task(stop.wait())
    await asyncio.wait([start, stopped], return_when=asyncio.FIRST_COMPLETED)
    if not start.done():  # a signal while starting: start() cleans up after itself
        start.cancel()
        await asyncio.gather(start, return_exceptions=True)
        return 130
    stopped.cancel()
    try:
        start.result()
    except LaunchError as e:
        print(f"regions: {e}", file=sys.stderr)
        return 1
    stack.supervise()
    await stop.wait()
    print("regions: stopping", flush=True)
    await stack.stop()
    print("regions: stopped", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        if a.cmd == "check":
            t = load(a.topology)
            print(f"{t.source}: {len(t.regions)} regions, replica kind {t.replica_kind}, model {t.model}")
            for r in t.regions:
                reps = ", ".join(f"{x.id}:{x.port}" + (f" tp{x.tp}" if x.tp > 1 else "") for x in r.replicas)
                print(f"  region {r.name}: proxy :{r.proxy_port}; replicas {reps}; peers {', '.join(t.peers(r.name))}")
            for (kind, src, dst), port in t.relay_ports.items():
                rtt = t.rtt(src, dst) if kind == "link" else next(c for c in t.clients if c.name == src).rtt_ms[dst]
                print(f"  relay {kind} {src}>{dst}: :{port} rtt {rtt:g} ms")
            return 0
        topo = topology_of(a)  # a bad file, --port or flags: reported before anything starts
        import uvloop

        return uvloop.run(_up(a, topo))
    except TopologyError as e:
        print(f"regions: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
