"""`python -m regions.proxy --routing MODE <edge_proxy arguments>`: the edge proxy with
one of `regions.routing_modes` in place of its own router (one worker).

An interim shim for `--compare-routing`: once `python -m edge_proxy` accepts
`--routing`, the launcher calls it directly and this file goes away.
"""

from __future__ import annotations

import argparse
import logging
import sys

from edge_proxy.__main__ import parse_args
from edge_proxy.app import build_proxy, create_app
from edge_proxy.server import DrainingServer, bind, uvicorn_config
from regions.routing_modes import make_router


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m regions.proxy", add_help=False)
    ap.add_argument("--routing", required=True)
    a, rest = ap.parse_known_args(argv)
    try:
        cfg = parse_args(rest)
        router = make_router(a.routing, cfg.router)
        if cfg.workers != 1:
            raise ValueError("regions.proxy runs one worker")
        proxy = build_proxy(cfg)
    except ValueError as e:
        print(f"regions.proxy: {e}", file=sys.stderr)
        return 2
    proxy.router = router  # the one seam: Proxy consults self.router for every placement
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = DrainingServer(uvicorn_config(create_app(proxy), cfg), proxy)
    sock = bind(cfg.host, cfg.port)
    print(f"edge_proxy ({a.routing} routing) listening on http://{cfg.host}:{sock.getsockname()[1]}", flush=True)
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
