"""A client that reads slowly gets tokens merged into fewer frames, never an unbounded queue."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from edge_proxy import protocol as pp
from edge_proxy.metrics import ProxyMetrics
from edge_proxy.ws_requests import ClientConnection

pytestmark = pytest.mark.anyio


class BlockingSocket:
    """ASGI send that takes one frame, then blocks every send until `gate` opens (a full TCP buffer)."""

    def __init__(self):
        self.frames: list[dict] = []
        self.gate = asyncio.Event()
        self.closed_with = None

    async def __call__(self, message):
        if message["type"] == "websocket.close":
            self.closed_with = (message["code"], message["reason"])
            return
        self.frames.append(json.loads(message["text"]))
        await self.gate.wait()


class FakeStream:
    def __init__(self, cid):
        self.cid = cid
        self.cancelled = False

    def cancel(self, notify):
        self.cancelled = True


def conn(ws, max_pending=1 << 20):
    cfg = SimpleNamespace(max_pending_bytes=max_pending, region="t", max_open_per_connection=16, cancel_rate_per_s=10.0)
    proxy = SimpleNamespace(cfg=cfg, metrics=ProxyMetrics(), cancel=lambda s, notify: s.cancel(notify))
    return ClientConnection(None, ws, proxy, key=None)


async def test_tokens_merge_while_the_client_is_behind():
    ws = BlockingSocket()
    c = conn(ws)
    a, b = FakeStream("a"), FakeStream("b")
    c.delta(a, "x", 1)
    await asyncio.sleep(0)  # the writer sends "x" and blocks
    for i in range(100):
        c.delta(a, str(i % 10), 1)
        c.delta(b, "y", 1)
    c.finish(a, pp.Done("a", "length", pp.Usage(), pp.Timing(), "t", "r"))
    ws.gate.set()
    while len(ws.frames) < 4:
        await asyncio.sleep(0)
    c.writer.stop()
    assert [f["type"] for f in ws.frames] == ["delta", "delta", "done", "delta"]
    assert ws.frames[1] == {"type": "delta", "id": "a", "text": "0123456789" * 10, "tokens": 100}
    assert ws.frames[3] == {"type": "delta", "id": "b", "text": "y" * 100, "tokens": 100}
    assert c.proxy.metrics.coalesced.get() == 2


async def blocked(max_pending: int):
    """A connection whose writer sent one delta of stream "a" and is blocked on the socket."""
    ws = BlockingSocket()
    c = conn(ws, max_pending=max_pending)
    s = FakeStream("a")
    c.active["a"] = s
    c.delta(s, "x", 1)
    await asyncio.sleep(0)  # the writer sends "x" and blocks
    return ws, c, s, c.writer


async def test_a_client_too_far_behind_is_cut_off():
    ws, c, s, writer = await blocked(1000)
    for _ in range(200):
        c.delta(s, "0123456789", 1)
    await asyncio.sleep(0)
    assert s.cancelled and ws.closed_with == (1008, pp.TOO_SLOW)
    assert c.out.pending_bytes == 0 and not c.out.entries
    writer.stop()


async def test_direct_frames_merge_while_the_transport_is_full():
    """Under uvicorn the connection writes frames into the socket itself; while the
    transport is over its high-water mark (uvicorn's pause_writing) tokens merge, and
    once it drains the client gets them in one frame, in order, nothing lost."""
    from conftest import proxy_for, stubs
    from edge_proxy.client import EdgeClient

    async with stubs("a", step_s=0.005) as reps, proxy_for(reps) as p:
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            req = await c.generate(prompt="abc", max_tokens=60, temperature=0.0)
            async for _ in req:
                break
            (stream,) = p.proxy.streams
            conn = stream.sink
            assert conn.writer.proto is not None  # frames bypass ASGI send
            conn.writer.proto.pause_writing()
            n = len(stream.ids)
            while len(stream.ids) < n + 10:  # the replica keeps producing; nothing reaches the client
                reps[0].token_event.clear()
                await asyncio.wait_for(reps[0].token_event.wait(), 5)
            frames = req.frames
            assert conn.out.entries[stream][1] >= 10  # ten tokens or more merged into one entry
            conn.writer.proto.resume_writing()
            text, done = await req.result()
    assert done.finish_reason == "length" and req.tokens == 60 == done.usage.completion_tokens
    assert req.frames < frames + 60 - n  # the paused tokens arrived merged
    assert p.proxy.metrics.coalesced.get() >= 1


async def test_error_frames_and_cancels_share_the_outbox_budget():
    """Item 6: a client that floods frames the proxy must answer (errors, cancels of
    unknown ids) while not reading is cut off like one that does not read its tokens."""
    ws, c, s, writer = await blocked(4000)
    for i in range(15):  # within the cancel burst (2 x 10/s)
        c._cancel(f"unknown-{i}")
    assert ws.closed_with is None and c.out.pending_bytes > 15 * 40
    for _ in range(100):
        c._error(None, pp.ProtocolError(pp.BAD_REQUEST, "invalid message: " + "x" * 60))
        if c._closing:
            break
    await asyncio.sleep(0)
    assert ws.closed_with == (1008, pp.TOO_SLOW) and s.cancelled
    assert c.out.pending_bytes == 0 and not c.out.loose and not c.out.entries
    writer.stop()


async def test_cancels_are_rate_limited_and_open_requests_capped():
    ws = BlockingSocket()
    ws.gate.set()
    c = conn(ws)  # 10 cancels/s, burst 20; 16 open requests
    for i in range(25):
        c._cancel(f"r{i}")
    while len(ws.frames) < 25:
        await asyncio.sleep(0)
    codes = [f["code"] for f in ws.frames]
    assert codes[:20] == [pp.NOT_FOUND] * 20 and codes[20:] == [pp.RATE_LIMITED] * 5
    assert all(f["id"] == f"r{i}" for i, f in enumerate(ws.frames))
    for i in range(16):
        c.active[f"o{i}"] = FakeStream(f"o{i}")
    c._generate(pp.Generate("one-more", prompt="x"))
    while len(ws.frames) < 26:
        await asyncio.sleep(0)
    assert ws.frames[-1]["code"] == pp.RATE_LIMITED and ws.frames[-1]["id"] == "one-more"
    c.writer.stop()


async def test_memory_is_bounded_per_connection_and_returned_when_it_goes():
    """Clients that never read, each holding streams with 128-character ids: the proxy
    holds at most `max_pending_bytes` for each (then cuts it off), and once the sockets
    are gone, every connection object and stream is freed and the stub has no work left."""
    import gc
    import socket
    import weakref

    from websockets.asyncio.client import connect

    from conftest import proxy_for, stubs

    budget = 8 << 10
    async with stubs("a", step_s=0.002) as reps, proxy_for(reps, max_pending_bytes=budget) as p:
        socks = []
        for k in range(10):
            raw = socket.socket()
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
            raw.connect(("127.0.0.1", p.port))
            ws = await connect(p.ws_url, sock=raw, additional_headers={"Authorization": "Bearer sk-alice"},
                               compression=None, proxy=None)
            for i in range(5):
                rid = f"{k}-{i}-".ljust(128, "i")
                await ws.send(json.dumps({"type": "generate", "id": rid, "prompt": "hello",
                                          "sampling": {"max_tokens": 3000}}))
            ws.transport.pause_reading()  # never read again
            socks.append(ws)
        await reps[0].token_event.wait()
        conns = {s.sink for s in p.proxy.streams}
        for sink in conns:  # small kernel buffers on the proxy's side too (no autotuning): the proxy feels it soon
            sink.writer.proto.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        refs = [weakref.ref(c) for c in conns]
        high = 0
        while p.proxy.streams:  # until every slow client has been cut off
            reps[0].token_event.clear()
            await asyncio.wait_for(reps[0].token_event.wait(), 5)
            high = max([high] + [x.out.pending_bytes for x in conns])
            assert high <= budget + 512  # one frame's worth over, at most, before the cut
        cut = p.proxy.metrics.requests.get("disconnect")
        assert cut >= 25, cut  # most were cut off (too_slow); the rest ran to their end
        del conns, sink  # the test's own references
        for ws in socks:
            ws.transport.abort()
        await reps[0].until_idle()
        tasks = set(p.server.server_state.tasks)  # the connections' ASGI tasks end once their sockets are gone
        assert tasks and not (await asyncio.wait(tasks, timeout=5))[1]
        assert len(p.server.config.app.guard) == 0
        gc.collect()
        assert all(r() is None for r in refs), "a client connection outlived its socket"
        assert not p.proxy.streams and p.proxy.pool.conns[0].own_inflight == 0
