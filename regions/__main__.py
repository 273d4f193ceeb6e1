"""python -m regions up [topology.toml]     launch a topology (built-in two-region one by default)
python -m regions check [topology.toml]  validate a topology and print its resolved ports

`up` prints one line per component with its URL, then serves until Ctrl-C or
SIGTERM, when it stops everything (relays, then proxies, which drain, then
replicas); a second signal kills at once. Until then a replica or proxy that
exits is restarted with backoff (a line says so, and when it is ready again);
the proxies fail its streams over meanwhile, or forward to a peer region.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from regions.launch import DISCOVERY, LaunchError, Stack
from regions.topology import ROUTING_MODES, TopologyError, load, shift_ports


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m regions", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="launch a topology and serve until Ctrl-C")
    up.add_argument("topology", nargs="?", help="topology TOML (default: the built-in two-region topology)")
    up.add_argument("--port", type=int, default=None,
                    help="move every port so the first region's proxy listens here (the rest keep their offsets)")
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


async def _up(a) -> int:
    topo = load(a.topology)
    if a.port is not None:
        topo = shift_ports(topo, a.port)
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
    start = loop.create_task(stack.start())
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
    if a.targets:
        with open(a.targets, "w") as f:
            json.dump(stack.targets(), f, indent=1)
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
        if a.port is not None:
            shift_ports(load(a.topology), a.port)  # report a bad --port before anything starts
        import uvloop

        return uvloop.run(_up(a))
    except TopologyError as e:
        print(f"regions: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
