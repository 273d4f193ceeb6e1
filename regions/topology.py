"""Topology file: regions, their proxy and replicas, and the round-trip times between
client locations and regions and between regions.

    model = "default"          # replica --model (ignored by stub replicas)
    replica_kind = "model"     # "model": python -m replica; "stub": stub_replica (no model, fast)
    replica_args = ["--max-num-seqs", "32"]     # more `python -m replica` flags (model replicas)
    proxy_args = ["--allowed-origin", "http://localhost:3000"]  # more `python -m edge_proxy` flags
    base_port = 8100           # ports left out are assigned from here, in file order
    jitter = 0.1               # relay jitter, a fraction of each one-way delay

    [regions.eu]
    proxy_port = 8100          # optional
    replicas = [{ port = 8101 }, { tp = 1, gpus = [] }]
    # roles (opt-in prefill/decode disaggregation, edge_proxy.disagg): "both" (the default),
    # "prefill" or "decode", passed as `python -m replica --role`; a prefill replica needs a
    # decode one in its region, e.g. replicas = [{ role = "prefill" }, { role = "decode" }]

    [regions.us]
    replicas = [{}]

    [clients.eu]               # a client population and its RTT to each region (ms)
    rtt_ms = { eu = 10, us = 90 }

    [[links]]                  # RTT between two regions' proxies (cross-region failover)
    regions = ["eu", "us"]
    rtt_ms = 80

`load(path)` returns a frozen `Topology` with every port resolved; mistakes raise
`TopologyError` naming the file and line of the offending key.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from edge_proxy.routing import MODES
from wire.protocol import ROLES

REPLICA_KINDS = ("model", "stub")
ROUTING_MODES = MODES  # edge_proxy --routing
NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,31}$")
BUILTIN = Path(__file__).with_name("builtin.toml")


class TopologyError(ValueError):
    """A topology file mistake, with `file:line:` where the line is known."""


@dataclass(frozen=True)
class ReplicaSpec:
    id: str  # "<region>-<index>"
    port: int
    tp: int = 1
    gpus: tuple[int, ...] = ()  # CUDA_VISIBLE_DEVICES for this replica; () = inherit
    role: str = "both"  # python -m replica --role: "both", "prefill" or "decode" (edge_proxy.disagg)


@dataclass(frozen=True)
class RegionSpec:
    name: str
    proxy_port: int
    replicas: tuple[ReplicaSpec, ...]
    proxy_workers: int = 1


@dataclass(frozen=True)
class ClientSpec:
    name: str
    rtt_ms: dict[str, float]  # region -> round trip


@dataclass(frozen=True)
class Topology:
    regions: tuple[RegionSpec, ...]
    clients: tuple[ClientSpec, ...]
    links: dict[frozenset, float]  # {region a, region b} -> RTT ms
    model: str = "default"
    replica_kind: str = "model"
    host: str = "127.0.0.1"
    base_port: int = 8100
    jitter: float = 0.1
    stub_step_ms: float = 20.0
    replica_args: tuple[str, ...] = ()  # extra `python -m replica` arguments
    proxy_args: tuple[str, ...] = ()  # extra `python -m edge_proxy` arguments
    source: str = "<memory>"
    # ("client", client, region) and ("link", from_region, to_region) -> relay port
    relay_ports: dict[tuple[str, str, str], int] = field(default_factory=dict)

    def region(self, name: str) -> RegionSpec:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)

    def rtt(self, a: str, b: str) -> float:
        """RTT between two regions (0 for a region and itself)."""
        return 0.0 if a == b else self.links[frozenset((a, b))]

    def peers(self, region: str) -> list[str]:
        """Other regions, nearest first."""
        others = [r.name for r in self.regions if r.name != region and frozenset((region, r.name)) in self.links]
        return sorted(others, key=lambda o: (self.rtt(region, o), o))


def shift_ports(t: Topology, first_proxy_port: int) -> Topology:
    """The same topology with every port moved so the first region's proxy listens on
    `first_proxy_port` (`python -m regions up --port P`; `make run PORT=P`)."""
    d = first_proxy_port - t.regions[0].proxy_port
    ports = [r.proxy_port for r in t.regions] + [x.port for r in t.regions for x in r.replicas]
    ports += list(t.relay_ports.values())
    if min(ports) + d < 1 or max(ports) + d > 65535:
        raise TopologyError(f"--port {first_proxy_port} moves the topology's ports out of 1..65535 "
                            f"(they span {min(ports)}..{max(ports)})")
    regions = tuple(replace(r, proxy_port=r.proxy_port + d,
                            replicas=tuple(replace(x, port=x.port + d) for x in r.replicas)) for r in t.regions)
    return replace(t, regions=regions, base_port=t.base_port + d,
                   relay_ports={k: p + d for k, p in t.relay_ports.items()})


# -- line index ----------------------------------------------------------------

_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]\]?")
_KEY = re.compile(r'^\s*("[^"]*"|[A-Za-z0-9_.-]+)\s*=')


def _split_dotted(s: str) -> list[str]:
    return [p.strip().strip('"') for p in re.findall(r'"[^"]*"|[^.]+', s)]


def line_index(text: str) -> dict[tuple, int]:
    """Map key paths (tuples; array entries by index) to 1-based line numbers.

    Covers table headers, `[[arrays]]`, `key = value` lines (dotted keys too) and
    the inline tables of an array value, one or several per line
    (`replicas = [{ port = 8101 }, { tp = 2 }]`).
    """
    index: dict[tuple, int] = {}
    counts: dict[tuple, int] = {}
    current: tuple = ()
    array: tuple | None = None  # key path of a multi-line array value being read
    elem = 0
    for no, line in enumerate(text.splitlines(), 1):
        code = line.split("#", 1)[0] if '"' not in line else line
        if array is not None:
            elem = _inline_tables(code, array, elem, no, index)
            if code.strip().startswith("]"):
                array = None
            continue
        m = _HEADER.match(code)
        if m:
            path = tuple(_split_dotted(m.group(2)))
            if m.group(1) == "[[":
                i = counts.get(path, 0)
                counts[path] = i + 1
                path = path + (i,)
            current = path
            index.setdefault(current, no)
            continue
        m = _KEY.match(code)
        if m:
            key = current + tuple(_split_dotted(m.group(1)))
            index.setdefault(key, no)
            value = code[m.end():].strip()
            if value.startswith("["):
                elem = _inline_tables(value[1:], key, 0, no, index)
                if value.count("[") > value.count("]"):
                    array = key
            elif value.startswith("{"):
                for k in _INNER_KEY.findall(value):
                    index.setdefault(key + (k.strip('"'),), no)
    return index


_INNER_KEY = re.compile(r'([A-Za-z0-9_-]+|"[^"]*")\s*=')


def _inline_tables(code: str, key: tuple, elem: int, no: int, index: dict) -> int:
    """Record each `{ ... }` element of an array value on this line; return the next index."""
    for group in re.findall(r"\{[^}]*\}?", code):
        index.setdefault(key + (elem,), no)
        for k in _INNER_KEY.findall(group):
            index.setdefault(key + (elem, k.strip('"')), no)
        elem += 1
    return elem


class _Where:
    """Error helper: `path` -> "file:line: message"."""

    def __init__(self, source: str, text: str):
        self.source, self.index = source, line_index(text)

    def line(self, path: tuple) -> int | None:
        while path:
            if path in self.index:
                return self.index[path]
            path = path[:-1]
        return None

    def error(self, path: tuple, message: str) -> TopologyError:
        no = self.line(path)
        dotted = ".".join(str(p) for p in path)
        loc = f"{self.source}:{no}" if no else self.source
        return TopologyError(f"{loc}: {dotted}: {message}" if dotted else f"{loc}: {message}")


# -- parsing -------------------------------------------------------------------

def load(path: str | Path | None = None) -> Topology:
    """Parse and validate a topology file (the built-in two-region one when None)."""
    p = Path(path) if path is not None else BUILTIN
    try:
        text = p.read_text()
    except OSError as e:
        raise TopologyError(f"{p}: cannot read: {e.strerror}") from None
    return parse(text, str(p))


def parse(text: str, source: str = "<topology>") -> Topology:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TopologyError(f"{source}: {e}") from None
    return _build(doc, _Where(source, text), source)


_TOP_KEYS = {"model", "replica_kind", "host", "base_port", "jitter", "stub_step_ms", "replica_args", "proxy_args",
             "regions", "clients", "links"}
_REGION_KEYS = {"proxy_port", "proxy_workers", "replicas"}
_REPLICA_KEYS = {"port", "tp", "gpus", "role"}


def _check_keys(d: dict, allowed: set, path: tuple, w: _Where) -> None:
    for k in d:
        if k not in allowed:
            raise w.error(path + (k,), f"unknown key (expected one of {', '.join(sorted(allowed))})")


def _typed(d: dict, key: str, types, default, path: tuple, w: _Where):
    v = d.get(key, default)
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise w.error(path + (key,), f"expected {_tname(types)}, got a boolean")
    if not isinstance(v, types):
        raise w.error(path + (key,), f"expected {_tname(types)}, got {type(v).__name__} {v!r}")
    return v


def _tname(types) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join({int: "an integer", float: "a number", str: "a string", list: "an array",
                        dict: "a table"}.get(t, t.__name__) for t in types)


def _port(v: int, path: tuple, w: _Where) -> int:
    if not 0 <= v <= 65535:
        raise w.error(path, f"port must be 0..65535, got {v}")
    return v


def _build(doc: dict, w: _Where, source: str) -> Topology:
    _check_keys(doc, _TOP_KEYS, (), w)
    model = _typed(doc, "model", str, "default", (), w)
    kind = _typed(doc, "replica_kind", str, "model", (), w)
    if kind not in REPLICA_KINDS:
        raise w.error(("replica_kind",), f"must be one of {', '.join(REPLICA_KINDS)}, got {kind!r}")
    host = _typed(doc, "host", str, "127.0.0.1", (), w)
    base = _port(_typed(doc, "base_port", int, 8100, (), w), ("base_port",), w)
    jitter = float(_typed(doc, "jitter", (int, float), 0.1, (), w))
    if not 0 <= jitter < 1:
        raise w.error(("jitter",), f"must be a fraction in [0, 1), got {jitter}")
    step = float(_typed(doc, "stub_step_ms", (int, float), 20.0, (), w))
    if step <= 0:
        raise w.error(("stub_step_ms",), f"must be > 0, got {step}")
    extra = _typed(doc, "replica_args", list, [], (), w)
    if not all(isinstance(a, str) for a in extra):
        raise w.error(("replica_args",), "must be an array of strings")
    proxy_extra = _typed(doc, "proxy_args", list, [], (), w)
    if not all(isinstance(a, str) for a in proxy_extra):
        raise w.error(("proxy_args",), "must be an array of strings")

    regions_doc = _typed(doc, "regions", dict, None, (), w) if "regions" in doc else None
    if not regions_doc:
        raise w.error(("regions",), "at least one [regions.NAME] table is needed")
    used: dict[int, tuple] = {}
    next_port = [base]

    def claim(port: int, path: tuple) -> int:
        if port == 0:
            while next_port[0] in used:
                next_port[0] += 1
            port = next_port[0]
            if port > 65535:
                raise w.error(path, f"ran out of ports above base_port {base}")
        elif port in used:
            raise w.error(path, f"port {port} is already used by {'.'.join(map(str, used[port]))}")
        used[port] = path
        return port

    explicit = []  # claim explicit ports first, so automatic ones never take them
    for name, r in regions_doc.items():
        path = ("regions", name)
        if not NAME_RE.match(name):
            raise w.error(path, "region names are lowercase letters, digits and '-', starting with a letter")
        if not isinstance(r, dict):
            raise w.error(path, "expected a table")
        _check_keys(r, _REGION_KEYS, path, w)
        if r.get("proxy_port"):
            explicit.append((_port(_typed(r, "proxy_port", int, 0, path, w), path + ("proxy_port",), w),
                             path + ("proxy_port",)))
        reps = _typed(r, "replicas", list, None, path, w) if "replicas" in r else None
        if not reps:
            raise w.error(path, "a region needs at least one replica: replicas = [{}]")
        for i, rep in enumerate(reps):
            rp_ = path + ("replicas", i)
            if not isinstance(rep, dict):
                raise w.error(rp_, "each replica is a table, e.g. { port = 8101 }")
            _check_keys(rep, _REPLICA_KEYS, rp_, w)
            if rep.get("port"):
                explicit.append((_port(_typed(rep, "port", int, 0, rp_, w), rp_ + ("port",), w), rp_ + ("port",)))
    for port, path in explicit:
        claim(port, path)

    regions = []
    for name, r in regions_doc.items():
        path = ("regions", name)
        workers = _typed(r, "proxy_workers", int, 1, path, w)
        if workers < 1:
            raise w.error(path + ("proxy_workers",), f"must be >= 1, got {workers}")
        pport = r.get("proxy_port") or claim(0, path + ("proxy_port",))
        reps = []
        for i, rep in enumerate(r["replicas"]):
            rp_ = path + ("replicas", i)
            tp = _typed(rep, "tp", int, 1, rp_, w)
            if tp < 1:
                raise w.error(rp_ + ("tp",), f"must be >= 1, got {tp}")
            gpus = _typed(rep, "gpus", list, [], rp_, w)
            if not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus):
                raise w.error(rp_ + ("gpus",), "must be an array of GPU indices (integers >= 0)")
            if gpus and len(gpus) != tp:
                raise w.error(rp_ + ("gpus",), f"tp = {tp} needs {tp} GPUs, got {len(gpus)}")
            role = _typed(rep, "role", str, "both", rp_, w)
            if role not in ROLES:
                raise w.error(rp_ + ("role",), f"must be one of {', '.join(ROLES)}, got {role!r}")
            if role != "both" and kind != "model":
                raise w.error(rp_ + ("role",), f"roles need replica_kind = \"model\" (a {kind} replica computes no KV)")
            port = rep.get("port") or claim(0, rp_ + ("port",))
            reps.append(ReplicaSpec(f"{name}-{i}", port, tp, tuple(gpus), role))
        roles = [x.role for x in reps]
        if "prefill" in roles and "decode" not in roles:
            raise w.error(path + ("replicas",), "a prefill replica computes prompts for decode replicas to pull: "
                                                "this region has none (give one role = \"decode\")")
        regions.append(RegionSpec(name, pport, tuple(reps), workers))
    names = [r.name for r in regions]

    clients = []
    clients_doc = _typed(doc, "clients", dict, {}, (), w)
    for cname, c in clients_doc.items():
        path = ("clients", cname)
        if not NAME_RE.match(cname):
            raise w.error(path, "client names are lowercase letters, digits and '-', starting with a letter")
        if not isinstance(c, dict):
            raise w.error(path, "expected a table with rtt_ms = { region = ms, ... }")
        _check_keys(c, {"rtt_ms"}, path, w)
        rtts = _typed(c, "rtt_ms", dict, None, path, w) if "rtt_ms" in c else None
        if not rtts:
            raise w.error(path, "needs rtt_ms = { region = ms, ... }")
        out = {}
        for region, ms in rtts.items():
            if region not in names:
                raise w.error(path + ("rtt_ms",), f"unknown region {region!r} (regions: {', '.join(names)})")
            out[region] = _rtt(ms, path + ("rtt_ms",), w)
        clients.append(ClientSpec(cname, out))
    if not clients:  # one client population next to each region, 2 ms away
        clients = [ClientSpec(n, {n: 2.0}) for n in names]

    links: dict[frozenset, float] = {}
    links_doc = _typed(doc, "links", list, [], (), w)
    for i, link in enumerate(links_doc):
        path = ("links", i)
        if not isinstance(link, dict):
            raise w.error(path, 'each link is a table: { regions = ["a", "b"], rtt_ms = 80 }')
        _check_keys(link, {"regions", "rtt_ms"}, path, w)
        pair = _typed(link, "regions", list, None, path, w) if "regions" in link else None
        if not pair or len(pair) != 2 or pair[0] == pair[1]:
            raise w.error(path + ("regions",), "needs two different region names")
        for region in pair:
            if region not in names:
                raise w.error(path + ("regions",), f"unknown region {region!r} (regions: {', '.join(names)})")
        key = frozenset(pair)
        if key in links:
            raise w.error(path, f"link {pair[0]}-{pair[1]} is given twice")
        if "rtt_ms" not in link:
            raise w.error(path, "needs rtt_ms")
        links[key] = _rtt(link["rtt_ms"], path + ("rtt_ms",), w)

    # Relays: one per (client, region) pair and per ordered region pair with a link.
    relay_ports = {}
    for c in clients:
        for region in c.rtt_ms:
            relay_ports[("client", c.name, region)] = claim(0, ("clients", c.name, "rtt_ms"))
    for key in links:
        a, b = sorted(key)
        relay_ports[("link", a, b)] = claim(0, ("links",))
        relay_ports[("link", b, a)] = claim(0, ("links",))
    return Topology(tuple(regions), tuple(clients), links, model, kind, host, base, jitter, step, tuple(extra),
                    tuple(proxy_extra), source, relay_ports)


def _rtt(v, path: tuple, w: _Where) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise w.error(path, f"RTT must be a number of milliseconds, got {v!r}")
    if not 0 <= v <= 10_000:
        raise w.error(path, f"RTT must be 0..10000 ms, got {v}")
    return float(v)
