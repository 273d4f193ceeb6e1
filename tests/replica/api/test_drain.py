"""A real replica's drain (replica.api.drain), seen from a proxy's side of its WebSocket: POST
/v1/drain needs the secret; from then on every Load says `draining`, a new Generate is refused
`overloaded`, /healthz stays 200 and says draining, the running stream goes on, and the replica
exits by itself once that stream is aborted (as a proxy that moved it does). SIGTERM drains the
same way (tests/edge_proxy/test_drain_handoff.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from websockets.asyncio.client import connect

from wire import protocol as P
from tests.replica.server import AUTH, engine_pid, replica_server
from tests.replica.ws_client import ReplicaWS, ws_url

pytestmark = pytest.mark.timeout(300)
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 28, 2, 198, 1, 520, 9531, 198]
LONG = P.SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)


async def until(c: ReplicaWS, pred):
    """Messages until one satisfies `pred`; returns it."""
    while True:
        for m in await c.recv():
            if pred(m):
                return m


async def drain_with_a_stream(url: str, proc) -> dict:
    seen = {}
    async with connect(ws_url(url), max_size=None, additional_headers=AUTH) as ws:
        c = ReplicaWS(ws)
        await c.send(P.Generate("long", PROMPT, LONG))
        await until(c, lambda m: isinstance(m, P.Tokens) and m.id == "long")
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            seen["unauthenticated"] = (await http.post("/v1/drain")).status_code
            r = await http.post("/v1/drain", headers=AUTH)
            seen["drain"] = r.status_code, r.json()
            # (Loads sent before the drain may still be unread here: the first that says so, within 10 s)
            seen["load"] = await asyncio.wait_for(until(c, lambda m: isinstance(m, P.Load) and m.draining), 10)
            await c.send(P.Generate("new", PROMPT, LONG))
            seen["new"] = await until(c, lambda m: isinstance(m, P.Error) and m.id == "new")
            seen["still streaming"] = await until(c, lambda m: isinstance(m, P.Tokens) and m.id == "long")
            h = await http.get("/healthz")
            seen["healthz"] = h.status_code, h.json()
            assert proc.poll() is None, "the replica exited with a stream still running"
            await c.send(P.Abort("long"))
        seen["code"] = await asyncio.to_thread(proc.wait, 30)
    return seen


def test_a_drained_replica_admits_nothing_new_and_exits_once_its_streams_are_gone():
    with replica_server("--kv-memory-gb", "0.25") as (url, proc):
        seen = asyncio.run(drain_with_a_stream(url, proc))
    assert seen["unauthenticated"] == 401
    assert seen["drain"] == (202, {"draining": True, "streams": 1})
    assert seen["load"].draining and seen["load"].total_blocks > 0  # the engine's last Load, re-sent so
    assert seen["new"].code == P.OVERLOADED and "draining" in seen["new"].message
    assert seen["healthz"][0] == 200 and seen["healthz"][1]["draining"] is True
    assert seen["code"] == 0  # drained: an ordinary exit


async def group_signalled_with_a_stream(url: str, proc) -> dict:
    """SIGTERM to the replica's whole process group (systemd's control-group stop, a terminal's Ctrl-C
    reaches a group too) with a stream running."""
    seen = {}
    async with connect(ws_url(url), max_size=None, additional_headers=AUTH) as ws:
        c = ReplicaWS(ws)
        await c.send(P.Generate("long", PROMPT, LONG))
        await until(c, lambda m: isinstance(m, P.Tokens) and m.id == "long")
        engine = engine_pid(proc.pid)
        os.killpg(proc.pid, signal.SIGTERM)
        seen["load"] = await asyncio.wait_for(until(c, lambda m: isinstance(m, P.Load) and m.draining), 10)
        seen["tokens after"] = sum([len(m.ids) for m in await c.recv() if isinstance(m, P.Tokens)])
        while seen["tokens after"] < 20:  # the engine goes on computing the stream
            seen["tokens after"] += sum(len(m.ids) for m in await c.recv() if isinstance(m, P.Tokens))
        seen["engine alive"] = proc.poll() is None and os.path.exists(f"/proc/{engine}")
        await c.send(P.Abort("long"))
        seen["code"] = await asyncio.to_thread(proc.wait, 30)
        seen["engine gone"] = await asyncio.to_thread(gone, engine)
    return seen


def gone(pid: int, timeout: float = 10.0) -> bool:
    """`pid` exits within `timeout` (it is the replica's grandchild here: polled, not waited for)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_signal_to_the_whole_group_drains_and_leaves_the_engine_to_its_api_process():
    """The engine ignores the group's SIGTERM: the stream goes on through the drain (it used to die
    with its engine at once, 'engine process exited (code -15)'), and ends with the API process."""
    with replica_server("--kv-memory-gb", "0.25") as (url, proc):
        seen = asyncio.run(group_signalled_with_a_stream(url, proc))
    assert seen["load"].draining and seen["tokens after"] >= 20 and seen["engine alive"], seen
    assert seen["code"] == -signal.SIGTERM and seen["engine gone"], seen
