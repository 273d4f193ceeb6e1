"""The replica's proxy socket (replica.api.app.ReplicaConnection) on the shared writer
(wire.ws_writer), through ASGI send: everything a loop turn produces leaves as one
binary frame under the proxy's ids, a lost engine closes the socket with 1013 after the
errors already queued, and nothing is written once the proxy has gone. (Straight into
uvicorn's transport it is what every real replica test runs.)"""

import asyncio

import pytest

from replica.api.app import ENGINE_RESTARTING, ReplicaConnection
from wire import protocol as P

pytestmark = pytest.mark.anyio


class Engine:
    """Stands in for the EngineClient: answers each request at once, in the same turn."""

    def __init__(self):
        self.aborted: list[str] = []

    def running(self, engine_id: str) -> bool:
        return False

    def submit(self, gen: P.Generate, sink) -> None:
        sink(P.Tokens(gen.id, [7], "a"))
        sink(P.Finished(gen.id, P.FINISH_LENGTH, P.Usage(2, 2), ids=[8], text="b"))

    def abort(self, engine_id: str) -> None:
        self.aborted.append(engine_id)


class Recorder:
    """An ASGI send (not uvicorn's, so the writer sends through it)."""

    def __init__(self):
        self.sent: list[dict] = []
        self.arrived = asyncio.Event()

    async def __call__(self, message):
        self.sent.append(message)
        self.arrived.set()

    async def until(self, n: int) -> None:
        while len(self.sent) < n:
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), 5)


async def test_a_turn_is_one_frame_under_the_proxys_ids():
    send, codec = Recorder(), P.Codec()
    conn = ReplicaConnection(Engine(), send)
    conn.handle(codec.encode([P.Generate("a", [1, 2]), P.Generate("b", [3])]))
    await send.until(1)
    (frame,) = send.sent
    msgs = codec.decode(frame["bytes"])
    assert [(type(m).__name__, m.id) for m in msgs] == [("Tokens", "a"), ("Finished", "a"), ("Tokens", "b"),
                                                         ("Finished", "b")]
    conn.handle(codec.encode([P.Generate("a", [1])]))  # the id is free again: a new request, a new frame
    await send.until(2)
    assert [m.id for m in codec.decode(send.sent[1]["bytes"])] == ["a", "a"]
    conn.close()


async def test_a_lost_engine_closes_after_the_queued_errors():
    send, codec = Recorder(), P.Codec()
    conn = ReplicaConnection(Engine(), send)
    conn.sink(P.Error(P.INTERNAL, "engine process died", "a"))
    conn.shut()
    await send.until(2)
    assert codec.decode(send.sent[0]["bytes"]) == [P.Error(P.INTERNAL, "engine process died", "a")]
    assert send.sent[1] == {"type": "websocket.close", "code": ENGINE_RESTARTING,
                            "reason": "engine process restarting"}
    conn.close()


async def test_nothing_is_written_once_the_proxy_is_gone():
    send, codec = Recorder(), P.Codec()
    engine = Engine()
    engine.submit = lambda gen, sink: None  # still running when the proxy goes
    conn = ReplicaConnection(engine, send)
    conn.handle(codec.encode([P.Generate("a", [1])]))
    conn.close()
    assert engine.aborted == [f"{conn.prefix}0"]  # its request is aborted
    conn.sink(P.Load(0, 0, 1, 1))
    await asyncio.sleep(0)  # a turn in which a write would happen
    assert send.sent == [] and not conn.out
