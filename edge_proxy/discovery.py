"""Live replica discovery by DNS: the replicas behind a Kubernetes headless Service.

    --replicas-dns edgechat-replica:8000       A and AAAA records: every address, on port 8000
    --replicas-dns _ws._tcp.edgechat-replica   SRV records: each target's address and port

Every `interval_s` the name is asked again (no cache in between: the answer is
the Service's ready endpoints now, give or take the server's own TTL). The set
of replica URLs is compared with the last one:

- a new URL joins the pool (`ReplicaPool.add`): it connects, says Hello (the
  tokenizer fingerprint and block size are checked), sends its KV snapshot, and
  routing may use it from its first Load;
- a URL that is gone leaves the pool (`ReplicaPool.remove`): no new request goes
  there; a replica still up and streaming is a planned removal (a pod terminating,
  a roll), its streams handed on with their KV as a drain's are, and it goes once
  they have; an idle or unreachable one goes at once;
- an outage (timeout, SERVFAIL, REFUSED, no server answering) changes nothing:
  the last known set stays, and is reported once per outage; an answer that the
  name has no address (NXDOMAIN or no records) is a real answer, the empty set
  (a headless Service with no ready endpoint).

URLs given with `--replica` are never removed; a discovered URL equal to one of
them is not added twice. With `server` unset the system resolver's settings
apply (/etc/resolv.conf: name servers, search domains, ndots), so a Service's
short name resolves inside its namespace as it does for any pod.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.name
import dns.rdatatype
import dns.resolver

log = logging.getLogger("edge_proxy.discovery")

REPLICA_PATH = "/v1/replica"
DEFAULT_PORT = 8000  # python -m replica's


class DnsOutage(Exception):
    """No usable answer (timeout, SERVFAIL, REFUSED, unreachable server): keep the last set."""


@dataclass(frozen=True)
class DiscoveryConfig:
    name: str  # a headless Service's name (A/AAAA), or an SRV name "_port._proto.service..."
    port: int = DEFAULT_PORT  # the replicas' port for A/AAAA answers; SRV records carry their own
    interval_s: float = 2.0
    server: str = ""  # "host[:port]" of the DNS server to ask; "" = the system resolver's configuration

    def __post_init__(self):
        if not self.name or self.name.startswith(".") or ":" in self.name:
            raise ValueError(f"--replicas-dns needs a DNS name (NAME[:PORT]), got {self.name!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--replicas-dns port must be 1..65535, got {self.port}")
        if self.interval_s <= 0:
            raise ValueError(f"--dns-interval must be > 0, got {self.interval_s}")
        if self.server:
            server_address(self.server)

    @property
    def srv(self) -> bool:
        return self.name.startswith("_")

    @classmethod
    def parse(cls, spec: str, interval_s: float = 2.0, server: str = "") -> DiscoveryConfig:
        """`NAME[:PORT]` (A/AAAA) or `_port._proto.NAME` (SRV, no port)."""
        name, sep, port = spec.rpartition(":")
        if not sep:
            return cls(spec, interval_s=interval_s, server=server)
        if not port.isdigit():
            raise ValueError(f"--replicas-dns {spec!r}: the port after ':' must be a number")
        if name.startswith("_"):
            raise ValueError(f"--replicas-dns {spec!r}: an SRV name carries its own ports; drop ':{port}'")
        return cls(name, int(port), interval_s, server)


def server_address(spec: str) -> tuple[str, int]:
    """"host[:port]" or "[v6]:port" -> (address, port); port 53 by default."""
    host, port = spec, 53
    if spec.startswith("["):
        host, _, rest = spec[1:].partition("]")
        if rest:
            port = int(rest.removeprefix(":"))
    elif spec.count(":") == 1:
        host, p = spec.split(":")
        port = int(p)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"--dns-server must be an IP address [and port], got {spec!r}") from None
    return host, port


def replica_url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"ws://{host}:{port}{REPLICA_PATH}"


class Polling:
    """`refresh()` every `interval_s`, from `start()` (in the running loop) until `stop()`."""

    interval_s: float
    _task: asyncio.Task | None = None

    async def refresh(self) -> None:
        raise NotImplementedError

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


class DnsDiscovery(Polling):
    """Keeps a `ReplicaPool` in step with what a DNS name resolves to."""

    def __init__(self, cfg: DiscoveryConfig, pool, metrics=None):
        self.cfg, self.pool, self.metrics = cfg, pool, metrics
        self.interval_s = cfg.interval_s
        self.resolver = self._resolver()
        self.known: set[str] = set()  # URLs this discovery added (and may remove)
        self.outage: str = ""  # why the last refresh failed; "" after a good one
        self.refreshed = asyncio.Event()  # set after every refresh, good or not (watchers clear it)

    def _resolver(self) -> dns.asyncresolver.Resolver:
        cfg = self.cfg
        if cfg.server:
            r = dns.asyncresolver.Resolver(configure=False)
            r.nameservers, r.port = [server_address(cfg.server)[0]], server_address(cfg.server)[1]
        else:
            r = dns.asyncresolver.Resolver()  # /etc/resolv.conf: servers, search list, ndots
        # One refresh never outlives the next one's turn by much, nor gives up within a lost packet.
        r.timeout = min(max(cfg.interval_s, 0.2), 2.0)
        r.lifetime = max(cfg.interval_s, 1.0)
        return r

    # -- resolution ------------------------------------------------------------

    async def _query(self, name, rdtype: str) -> dns.resolver.Answer | None:
        """One query; None when the name or the type has no records; `DnsOutage` when no answer."""
        try:
            # The system's search list and ndots apply, as for any pod ("edgechat-replica" -> in-namespace).
            return await self.resolver.resolve(name, rdtype, search=not self.cfg.server, raise_on_no_answer=False)
        except dns.resolver.NXDOMAIN:
            return None
        except dns.exception.DNSException as e:  # Timeout, NoNameservers (SERVFAIL, REFUSED, unreachable), ...
            raise DnsOutage(f"{rdtype} {name}: {e}") from None

    async def _addresses(self, name) -> list[str]:
        a, aaaa = await asyncio.gather(self._query(name, "A"), self._query(name, "AAAA"))
        return [r.address for ans in (a, aaaa) if ans is not None and ans.rrset is not None for r in ans.rrset]

    async def resolve(self) -> set[str]:
        """The replica URLs the name stands for now; raises `DnsOutage`."""
        cfg = self.cfg
        if not cfg.srv:
            return {replica_url(a, cfg.port) for a in await self._addresses(cfg.name)}
        ans = await self._query(cfg.name, "SRV")
        if ans is None or ans.rrset is None:
            return set()
        glue: dict[dns.name.Name, list[str]] = {}  # the targets' addresses sent along (CoreDNS does)
        for rrset in ans.response.additional:
            if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
                glue.setdefault(rrset.name, []).extend(r.address for r in rrset)
        targets = {(r.target, r.port) for r in ans.rrset if r.target != dns.name.root}  # "." = no service
        missing = sorted({t for t, _ in targets if t not in glue})
        for t, addrs in zip(missing, await asyncio.gather(*(self._addresses(t) for t in missing))):
            glue[t] = addrs
        return {replica_url(a, port) for t, port in targets for a in glue[t]}

    # -- keeping the pool in step ------------------------------------------------

    def apply(self, urls: set[str]) -> None:
        """Make the discovered part of the pool equal `urls`."""
        present = {c.url for c in self.pool.conns if not c.leaving_since}  # (one leaving comes back by `add`)
        added = sorted(u for u in urls - self.known if u not in present)
        removed = sorted(self.known - urls)
        for u in removed:
            self.pool.remove(u)
        for u in added:
            self.pool.add(u)
        self.known = (self.known - set(removed)) | set(added)
        if added or removed:
            log.info("replicas from %s: %d (+%s -%s)", self.cfg.name, len(self.known), added, removed)
            if not self.known:
                log.warning("%s resolves to no address: no discovered replica left", self.cfg.name)

    async def refresh(self) -> None:
        try:
            urls = await self.resolve()
        except DnsOutage as e:
            if not self.outage:
                log.warning("DNS for %s failed (%s): keeping the last %d replicas until it answers",
                            self.cfg.name, e, len(self.known))
            self.outage = str(e)
            self._count("outage")
        else:
            if self.outage:
                log.info("DNS for %s answers again", self.cfg.name)
            self.outage = ""
            self._count("ok")
            self.apply(urls)
        self.refreshed.set()

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.dns_refreshes.inc(outcome)



class ProxyCensus(Polling):
    """How many proxy pods the region runs now (`--proxies-dns`: the A/AAAA or SRV records of
    the proxies' own headless Service, asked every `interval_s`): `on_count(n)` on each change,
    so every process re-takes its share of each key's limits (`limits.RegionShare`). An outage
    or an empty answer (this pod not yet, or no longer, a ready endpoint) keeps the last count."""

    def __init__(self, cfg: DiscoveryConfig, on_count, count: int = 1):
        self.dns = DnsDiscovery(cfg, pool=None)
        self.interval_s = cfg.interval_s
        self.on_count, self.count = on_count, count

    async def refresh(self) -> None:
        try:
            n = len(await self.dns.resolve())
        except DnsOutage as e:
            log.debug("DNS for %s failed (%s): keeping %d proxies", self.dns.cfg.name, e, self.count)
            return
        if n and n != self.count:
            log.info("proxies of the region from %s: %d (were %d)", self.dns.cfg.name, n, self.count)
            self.count = n
            self.on_count(n)

