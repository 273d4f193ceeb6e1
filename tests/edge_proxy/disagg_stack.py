"""A prefill replica and a decode replica (default model) behind one proxy, for test_disagg.py:
P (`--role prefill`) reached through a drain_stack.ExportCutter, disarmed (arm it: P's exports are
cut, so a pull from it fails), D (`--role decode`); `export` reads the blocks a replica's pool holds
for a prompt (its own /v1/kv/export, to the end)."""

from __future__ import annotations

import contextlib
import time

import httpx
import msgspec

from edge_proxy.auth import cache_salt
from tests.edge_proxy.drain_stack import ExportCutter
from tests.edge_proxy.live import proxy
from tests.replica.server import AUTH, SECRET, replica_server
from wire.kv_frames import KvEnd, KvExport, KvFrame, StreamCodec


def anonymous_salt() -> str:
    """The block-hash salt of the proxy's anonymous key (its salt secret is the replica secret)."""
    return cache_salt("anonymous", SECRET)


def export(url: str, ids: list[int], salt: str) -> bytes:
    """The bytes of the leading full blocks of `ids` (under `salt`) the replica at `url` holds, as its
    own export sends them (every layer's K and V a block, wire.kv_frames)."""
    codec, data, end = StreamCodec(), bytearray(), None
    body = msgspec.msgpack.encode(KvExport(token_ids=ids, cache_salt=salt))
    with httpx.stream("POST", url + "/v1/kv/export", content=body, timeout=30,
                      headers={**AUTH, "Content-Type": "application/msgpack"}) as r:
        assert r.status_code == 200, r.read()
        for chunk in r.iter_raw():
            for m in codec.feed(chunk):
                if isinstance(m, KvFrame):
                    data += m.data
                elif isinstance(m, KvEnd):
                    end = m
    assert end is not None, f"{url}'s export ended without its KvEnd"
    return bytes(data)


def roles_ready(proxy_url: str, timeout: float = 60.0) -> None:
    """Poll the proxy's /healthz until it has the decode replica and the prefill replica ready."""
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(proxy_url + "/healthz", timeout=5).json()
        if h["replicas_ready"] >= 1 and h["prefill_ready"] >= 1:
            return
        assert time.monotonic() < deadline, f"the proxy never had both roles ready: {h}"
        time.sleep(0.1)


@contextlib.contextmanager
def stack(replica_args: tuple[str, ...] = ("--kv-memory-gb", "0.25")):
    """Yields the proxy's http URL, {"P": (url, process), "D": (url, process)} and P's relay."""
    with contextlib.ExitStack() as es:
        p_url, p_proc = es.enter_context(replica_server("--replica-id", "P", "--role", "prefill", *replica_args))
        d_url, d_proc = es.enter_context(replica_server("--replica-id", "D", "--role", "decode", *replica_args))
        relay = ExportCutter(int(p_url.rsplit(":", 1)[1]))
        relay.armed = False
        es.callback(relay.close)
        port, _ = es.enter_context(proxy([f"http://127.0.0.1:{relay.port}", d_url], "--allow-anonymous",
                                         "--region", "test"))
        url = f"http://127.0.0.1:{port}"
        roles_ready(url)
        yield url, {"P": (p_url, p_proc), "D": (d_url, d_proc)}, relay
