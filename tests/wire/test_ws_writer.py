"""The one WebSocket writer (wire.ws_writer): what a turn queues leaves as one write,
what queues behind a full transport or a blocked send coalesces, and a close comes
after what was queued (drain) or instead of it. Straight into uvicorn's transport on a
real server, and through ASGI send with a fake one."""

import asyncio
import contextlib
import socket

import msgspec
import pytest
import uvicorn
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from wire.ws_frames import BINARY, TEXT
from wire.ws_writer import Batch, FrameWriter

pytestmark = pytest.mark.anyio

encode, decode = msgspec.msgpack.encode, msgspec.msgpack.decode


@contextlib.asynccontextmanager
async def served():
    """A uvicorn server (sans-I/O websockets, as the proxy and the replica run) whose one
    socket gets a FrameWriter of a Batch; yields (the writer, the client's socket)."""
    opened: asyncio.Future = asyncio.get_running_loop().create_future()

    async def app(scope, receive, send):
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        writer = FrameWriter(send, Batch(encode), BINARY)
        opened.set_result(writer)
        while (await receive())["type"] != "websocket.disconnect":
            pass
        writer.stop()

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    server = uvicorn.Server(uvicorn.Config(app, ws="websockets-sansio", lifespan="off", log_level="warning"))
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    try:
        async with connect(f"ws://127.0.0.1:{sock.getsockname()[1]}/", compression=None, proxy=None) as ws:
            writer = await asyncio.wait_for(opened, 5)
            assert writer.proto is not None  # frames go straight into uvicorn's transport
            yield writer, ws
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


def queue(writer: FrameWriter, *msgs) -> None:
    for m in msgs:
        writer.box.append(m)
        writer.wake()


async def test_a_turn_leaves_as_one_frame():
    async with served() as (writer, ws):
        queue(writer, "a", "b", "c")
        await asyncio.sleep(0)  # the next turn: one frame on its own
        queue(writer, "d")
        assert decode(await ws.recv()) == ["a", "b", "c"]
        assert decode(await ws.recv()) == ["d"]


async def test_messages_merge_while_the_transport_is_full_and_leave_once_it_drains():
    """While uvicorn's transport is over its high-water mark nothing is written; once it
    drains, everything queued meanwhile leaves in one frame, without waiting for another
    message to be queued."""
    async with served() as (writer, ws):
        writer.proto.pause_writing()
        for i in range(5):
            queue(writer, i)
            await asyncio.sleep(0)  # five turns
        assert writer.box.messages == [0, 1, 2, 3, 4]  # held, in order
        writer.proto.resume_writing()
        assert decode(await asyncio.wait_for(ws.recv(), 5)) == [0, 1, 2, 3, 4]
        queue(writer, "next")
        assert decode(await ws.recv()) == ["next"]


async def test_a_draining_close_comes_after_what_was_queued():
    async with served() as (writer, ws):
        writer.proto.pause_writing()
        queue(writer, "last words")
        await asyncio.sleep(0)
        writer.close(1013, "engine process restarting", drain=True)
        writer.proto.resume_writing()
        assert decode(await asyncio.wait_for(ws.recv(), 5)) == ["last words"]
        with pytest.raises(ConnectionClosed) as e:
            await asyncio.wait_for(ws.recv(), 5)
        assert e.value.rcvd.code == 1013 and e.value.rcvd.reason == "engine process restarting"


async def test_nothing_is_written_to_a_closed_socket():
    async with served() as (writer, ws):
        writer.close(1008, "too_slow")
        queue(writer, "dropped")
        with pytest.raises(ConnectionClosed) as e:
            await asyncio.wait_for(ws.recv(), 5)
        assert e.value.rcvd.code == 1008 and not writer.box


class GatedSend:
    """An ASGI send (not uvicorn's: the writer falls back to it) that records every
    message and blocks each data message until `gate` opens (a slow client)."""

    def __init__(self):
        self.sent: list[dict] = []
        self.gate = asyncio.Event()
        self.arrived = asyncio.Event()

    async def __call__(self, message):
        self.sent.append(message)
        self.arrived.set()
        if message["type"] == "websocket.send":
            await self.gate.wait()


class Texts:
    """A box of text messages, one payload each."""

    def __init__(self):
        self.items: list[str] = []

    def __bool__(self):
        return bool(self.items)

    def take(self):
        items, self.items = self.items, []
        return [t.encode() for t in items]

    def clear(self):
        self.items = []


async def test_through_asgi_send_messages_queue_behind_a_blocked_send():
    send = GatedSend()
    batch = FrameWriter(send, Batch(encode), BINARY)
    assert batch.proto is None
    queue(batch, 1, 2)
    await send.arrived.wait()
    queue(batch, 3)
    await asyncio.sleep(0)
    queue(batch, 4)  # behind the blocked send, across turns
    send.gate.set()
    while len(send.sent) < 2:
        send.arrived.clear()
        await send.arrived.wait()
    assert [decode(m["bytes"]) for m in send.sent] == [[1, 2], [3, 4]]

    send, box = GatedSend(), Texts()
    texts = FrameWriter(send, box, TEXT)
    box.items += ["x", "y"]  # a text box: one ASGI message per payload
    texts.wake()
    send.gate.set()
    while len(send.sent) < 2:
        send.arrived.clear()
        await send.arrived.wait()
    assert send.sent == [{"type": "websocket.send", "text": "x"}, {"type": "websocket.send", "text": "y"}]


async def test_through_asgi_send_close_drains_or_drops():
    send = GatedSend()
    w = FrameWriter(send, Batch(encode), BINARY)
    queue(w, "a")
    await send.arrived.wait()  # "a" is being sent, blocked
    queue(w, "b")
    w.close(1013, "restarting", drain=True)
    send.gate.set()
    while not send.sent or send.sent[-1]["type"] != "websocket.close":
        send.arrived.clear()
        await send.arrived.wait()
    assert [decode(m["bytes"]) for m in send.sent[:-1]] == [["a"], ["b"]]
    assert send.sent[-1] == {"type": "websocket.close", "code": 1013, "reason": "restarting"}

    send = GatedSend()
    w = FrameWriter(send, Batch(encode), BINARY)
    queue(w, "a")
    await send.arrived.wait()
    queue(w, "b")
    w.close(1008, "too_slow")  # at once: "b" is dropped
    send.arrived.clear()
    await send.arrived.wait()
    send.gate.set()
    assert [m["type"] for m in send.sent] == ["websocket.send", "websocket.close"] and not w.box
    w.stop()
