"""A small authoritative DNS server in the event loop (dnslib's wire codec): the
records a Kubernetes headless Service publishes, for `regions up --discovery dns`
and the tests of the proxy's `--replicas-dns`.

    zone = await DnsZone().start("127.0.0.1")           # UDP and TCP on one free port
    zone.set("replicas.eu.test", ["127.0.0.2", "::1"])  # A and AAAA records of a name
    zone.set_srv("_ws._tcp.replicas.eu.test", [("eu-0.eu.test", 8101)])  # targets need their own set()
    zone.mode = "servfail"                              # or "silent" (no answer): an outage
    await zone.stop()

Answers are authoritative: a name without records is NXDOMAIN, a name without
records of the asked type is an empty NOERROR, SRV answers carry their targets'
addresses in the additional section (as CoreDNS does). A UDP answer larger than
the client's buffer (512 bytes, or its EDNS size) is truncated, and the client
asks again over TCP, as a resolver must for a Service with many endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import struct

from dnslib import AAAA, QTYPE, RCODE, RR, SRV, A, DNSError, DNSRecord

log = logging.getLogger("regions.dns_zone")

MODES = ("up", "servfail", "silent")
_LEN = struct.Struct("!H")


def _key(name) -> str:
    return str(name).rstrip(".").lower()


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, zone: DnsZone):
        self.zone = zone
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        out = self.zone.answer(data, udp=True)
        if out is not None:
            self.transport.sendto(out, addr)


class DnsZone:
    def __init__(self, ttl: int = 1):
        self.ttl = ttl
        self.mode = "up"
        self.glue = True  # SRV answers carry their targets' addresses
        self.queries = 0
        self._records: dict[str, list[RR]] = {}  # name -> its A, AAAA and SRV records
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self.host, self.port = "", 0

    @property
    def server(self) -> str:
        """The `--dns-server` value that reaches this zone."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    # -- records ---------------------------------------------------------------

    def set(self, name: str, addresses: list[str]) -> None:
        """A and AAAA records of `name` (replacing its A/AAAA); [] leaves it without addresses."""
        rrs = [r for r in self._records.get(_key(name), []) if r.rtype == QTYPE.SRV]
        for a in addresses:
            v6 = ipaddress.ip_address(a).version == 6
            rrs.append(RR(name, QTYPE.AAAA if v6 else QTYPE.A, rdata=AAAA(a) if v6 else A(a), ttl=self.ttl))
        self._store(name, rrs)

    def set_srv(self, name: str, targets: list[tuple[str, int]]) -> None:
        """SRV records of `name` (replacing its SRV): (target host name, port) each."""
        rrs = [r for r in self._records.get(_key(name), []) if r.rtype != QTYPE.SRV]
        rrs += [RR(name, QTYPE.SRV, rdata=SRV(0, 100, port, target), ttl=self.ttl) for target, port in targets]
        self._store(name, rrs)

    def _store(self, name: str, rrs: list[RR]) -> None:
        if rrs:
            self._records[_key(name)] = rrs
        else:
            self._records.pop(_key(name), None)

    # -- answering ---------------------------------------------------------------

    def answer(self, data: bytes, udp: bool) -> bytes | None:
        """The wire answer to one query; None to stay silent."""
        self.queries += 1
        if self.mode == "silent":
            return None
        try:
            q = DNSRecord.parse(data)
        except DNSError as e:
            log.warning("undecodable DNS query: %s", e)
            return None
        reply = q.reply()  # aa=1, ra=1, same id and question
        if self.mode == "servfail":
            reply.header.rcode = RCODE.SERVFAIL
            return reply.pack()
        name, qtype = _key(q.q.qname), q.q.qtype
        rrs = self._records.get(name)
        if rrs is None:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply.pack()
        for rr in rrs:
            if rr.rtype == qtype or qtype == QTYPE.ANY:
                reply.add_answer(rr)
                if rr.rtype == QTYPE.SRV and self.glue:
                    for glue in self._records.get(_key(rr.rdata.target), []):
                        if glue.rtype in (QTYPE.A, QTYPE.AAAA):
                            reply.add_ar(glue)
        out = reply.pack()
        if udp:
            limit = max([512] + [r.rclass for r in q.ar if r.rtype == QTYPE.OPT])  # EDNS: the client's buffer
            if len(out) > limit:
                short = q.reply()  # the question, no records, TC set: the client asks again over TCP
                short.header.tc = 1
                out = short.pack()
        return out

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        try:
            while True:
                n = _LEN.unpack(await reader.readexactly(2))[0]
                out = self.answer(await reader.readexactly(n), udp=False)
                if out is not None:
                    writer.write(_LEN.pack(len(out)) + out)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._conns.discard(writer)
            writer.close()

    # -- lifecycle ---------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> DnsZone:
        """Listen on UDP and TCP at one port (a free one when `port` is 0)."""
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        for _ in range(20):
            self._udp, _ = await loop.create_datagram_endpoint(lambda: _Udp(self), local_addr=(host, port),
                                                               family=family)
            chosen = self._udp.get_extra_info("sockname")[1]
            try:
                self._tcp = await asyncio.start_server(self._serve_tcp, host, chosen, family=family)
            except OSError:
                self._udp.close()
                if port:
                    raise
                continue  # that UDP port's TCP twin is taken: another free port
            self.host, self.port = host, chosen
            return self
        raise OSError(f"no port free for both UDP and TCP on {host}")

    async def stop(self) -> None:
        if self._udp is not None:
            self._udp.close()
            self._udp = None
        if self._tcp is not None:
            self._tcp.close()
            for w in list(self._conns):
                w.close()
            with contextlib.suppress(ConnectionError):
                await self._tcp.wait_closed()
            self._tcp = None
