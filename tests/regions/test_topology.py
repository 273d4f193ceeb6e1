"""Topology parsing: the built-in file, port assignment, and errors that point at the line."""

import pytest

from regions.topology import TopologyError, line_index, load, parse

GOOD = """\
replica_kind = "stub"
base_port = 20000

[regions.eu]
proxy_port = 20000
replicas = [{}, { port = 20005 }]

[regions.us]
replicas = [{ tp = 2, gpus = [0, 1] }]

[regions.ap]
replicas = [{}]

[clients.eu]
rtt_ms = { eu = 10, us = 90 }

[[links]]
regions = ["eu", "us"]
rtt_ms = 80

[[links]]
regions = ["eu", "ap"]
rtt_ms = 200
"""


def test_builtin_is_two_regions_on_the_default_model():
    t = load()
    assert [r.name for r in t.regions] == ["eu", "us"]
    assert t.model == "default" and t.replica_kind == "model"
    assert t.rtt("eu", "us") == t.rtt("us", "eu") == 80.0
    ports = [r.proxy_port for r in t.regions] + [x.port for r in t.regions for x in r.replicas]
    ports += list(t.relay_ports.values())
    assert len(ports) == len(set(ports))


def test_ports_are_assigned_around_explicit_ones():
    t = parse(GOOD, "good.toml")
    eu, us, ap = t.regions
    assert eu.proxy_port == 20000
    assert [r.port for r in eu.replicas] == [20001, 20005]  # 20000 taken by the proxy
    assert us.proxy_port == 20002 and us.replicas[0].tp == 2 and us.replicas[0].gpus == (0, 1)
    assert t.clients[0].rtt_ms == {"eu": 10.0, "us": 90.0}
    assert t.peers("eu") == ["us", "ap"]  # nearest first
    assert t.peers("us") == ["eu"]
    assert ("client", "eu", "us") in t.relay_ports and ("link", "ap", "eu") in t.relay_ports


def test_default_clients_sit_next_to_each_region():
    t = parse('[regions.a]\nreplicas = [{}]\n[regions.b]\nreplicas = [{}]\n')
    assert [(c.name, c.rtt_ms) for c in t.clients] == [("a", {"a": 2.0}), ("b", {"b": 2.0})]


@pytest.mark.parametrize("text, line, words", [
    ("model = 1\n[regions.a]\nreplicas=[{}]\n", 1, "model: expected a string"),
    ('replica_kind = "gpu"\n', 1, "must be one of model, stub"),
    ("[regions.a]\nreplicas = [\n  { port = 9001 },\n  { port = 9001 },\n]\n", 4,
     "regions.a.replicas.1.port: port 9001 is already used by regions.a.replicas.0.port"),
    ("[regions.a]\nreplicas = [{}]\ncolour = 1\n", 3, "regions.a.colour: unknown key"),
    ("[regions.a]\nreplicas = []\n", 1, "needs at least one replica"),
    ("[regions.a]\nreplicas = [{ tp = 2, gpus = [0] }]\n", 2, "tp = 2 needs 2 GPUs"),
    ("[regions.a]\nreplicas = [{}]\n\n[clients.x]\nrtt_ms = { a = 5, zz = 9 }\n", 5, "unknown region 'zz'"),
    ("[regions.a]\nreplicas = [{}]\n[regions.b]\nreplicas = [{}]\n\n[[links]]\nregions = [\"a\", \"b\"]\n"
     "rtt_ms = -3\n", 8, "links.0.rtt_ms: RTT must be 0..10000 ms"),
    ("[regions.a]\nreplicas = [{}]\n[regions.b]\nreplicas = [{}]\n[[links]]\nregions = [\"a\", \"b\"]\nrtt_ms = 1\n"
     "[[links]]\nregions = [\"b\", \"a\"]\nrtt_ms = 2\n", 8, "given twice"),
    ("[regions.EU]\nreplicas = [{}]\n", 1, "lowercase"),
    ("[regions.a]\nreplicas = [{ port = 70000 }]\n", 2, "port must be 0..65535"),
    ("jitter = 1.5\n[regions.a]\nreplicas = [{}]\n", 1, "jitter"),
    ('[regions.a]\nreplicas = [\n  { role = "decode" },\n  { role = "prefil" },\n]\n', 4,
     "regions.a.replicas.1.role: must be one of both, prefill, decode, got 'prefil'"),
    ('[regions.a]\nreplicas = [{ role = "prefill" }, { role = "both" }]\n', 2,
     "regions.a.replicas: a prefill replica computes prompts for decode replicas to pull: this region has none"),
    ('replica_kind = "stub"\n[regions.a]\nreplicas = [{ role = "decode" }]\n', 3,
     'regions.a.replicas.0.role: roles need replica_kind = "model"'),
    ('[regions.a]\nreplicas = [{ role = 1 }]\n', 2, "regions.a.replicas.0.role: expected a string"),
])
def test_errors_name_file_line_and_key(text, line, words):
    with pytest.raises(TopologyError) as e:
        parse(text, "t.toml")
    assert str(e.value).startswith(f"t.toml:{line}: ")
    assert words in str(e.value)


def test_toml_syntax_errors_keep_tomllib_position():
    with pytest.raises(TopologyError, match=r"t.toml: .*\(at line 2, column 12\)"):
        parse("[regions.a]\nreplicas = }\n", "t.toml")


def test_missing_file(tmp_path):
    with pytest.raises(TopologyError, match="cannot read"):
        load(tmp_path / "nope.toml")


def test_line_index_covers_headers_dotted_keys_and_array_elements():
    idx = line_index('a.b = 1\n[x]\ny = [\n  { p = 1 },\n  { q = 2 }, { r = 3 },\n]\n[[z]]\nk = 1\n[[z]]\nk = 2\n')
    assert idx[("a", "b")] == 1
    assert idx[("x", "y", 0, "p")] == 4
    assert idx[("x", "y", 1, "q")] == 5 and idx[("x", "y", 2, "r")] == 5
    assert idx[("z", 0, "k")] == 8 and idx[("z", 1, "k")] == 10


def test_shift_ports_moves_everything_together():
    from regions.topology import shift_ports

    t = load()
    s = shift_ports(t, 9000)
    assert s.regions[0].proxy_port == 9000 and s.regions[0].replicas[0].port == 9001
    assert s.regions[1].proxy_port == 9100 and s.relay_ports[("link", "eu", "us")] == 8404 - 8100 + 9000
    with pytest.raises(TopologyError, match="out of 1..65535"):
        shift_ports(t, 65400)


def test_replica_and_proxy_args_are_arrays_of_strings():
    t = parse('replica_args = ["--max-num-seqs", "8"]\nproxy_args = ["--allowed-origin", "http://a.test"]\n'
              '[regions.eu]\nreplicas = [{}]\n', "args.toml")
    assert t.replica_args == ("--max-num-seqs", "8") and t.proxy_args == ("--allowed-origin", "http://a.test")
    with pytest.raises(TopologyError, match=r"^bad\.toml:1: proxy_args: expected an array, got str"):
        parse('proxy_args = "--allowed-origin x"\n[regions.eu]\nreplicas = [{}]\n', "bad.toml")
    with pytest.raises(TopologyError, match=r"^bad\.toml:1: proxy_args: must be an array of strings"):
        parse('proxy_args = [1]\n[regions.eu]\nreplicas = [{}]\n', "bad.toml")


def test_replica_roles_default_to_both():
    t = parse('[regions.eu]\nreplicas = [{ role = "prefill" }, { role = "decode" }, {}]\n', "roles.toml")
    assert [r.role for r in t.regions[0].replicas] == ["prefill", "decode", "both"]
