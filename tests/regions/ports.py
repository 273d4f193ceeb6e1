"""Free loopback ports for topologies under test."""

import contextlib
import socket


def free_block(n: int) -> int:
    """A base port with `n` consecutive ports free right now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s, contextlib.suppress(OSError):
                s.bind(("127.0.0.1", p))
                continue
            ok = False
            break
        if ok:
            return base
    raise RuntimeError(f"no block of {n} free ports")


def stub_topology(base: int, step_ms: float = 5.0) -> str:
    """Two regions of stub replicas (eu: 2, us: 1), clients in both, one link; 12 ports from `base`."""
    return f"""
replica_kind = "stub"
base_port = {base}
stub_step_ms = {step_ms}
jitter = 0.0

[regions.eu]
replicas = [{{}}, {{}}]

[regions.us]
replicas = [{{}}]

[clients.eu]
rtt_ms = {{ eu = 4, us = 60 }}

[clients.us]
rtt_ms = {{ us = 4, eu = 60 }}

[[links]]
regions = ["eu", "us"]
rtt_ms = 50
"""
