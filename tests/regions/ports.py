"""Free loopback ports for topologies under test."""

from tests.replica.server import free_port_range


def free_block(n: int) -> int:
    """A base port with `n` consecutive ports free right now, below the kernel's ephemeral
    range: a block taken from it (bind to port 0) lost races to the topology's own outgoing
    connections (CI: "address already in use" on a relay port)."""
    return free_port_range(n)


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
