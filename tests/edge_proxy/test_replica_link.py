"""The replica link's own WebSocket framing, driven byte by byte without sockets."""

import struct

import pytest
from websockets.utils import accept_key, apply_mask

from edge_proxy.replica_link import OP_BINARY, OP_CLOSE, OP_PING, OP_PONG, LinkClosed, LinkRefused, ReplicaLink, \
    encode_frame

pytestmark = pytest.mark.anyio


class FakeTransport:
    def __init__(self):
        self.written = bytearray()
        self.closing = False
        self.aborted = False

    def write(self, data):
        self.written += data

    def is_closing(self):
        return self.closing

    def close(self):
        self.closing = True

    def abort(self):
        self.closing = self.aborted = True


def server_frame(opcode: int, payload: bytes, fin: bool = True) -> bytes:
    n = len(payload)
    b0 = (0x80 if fin else 0) | opcode
    if n < 126:
        return bytes((b0, n)) + payload
    if n < 1 << 16:
        return bytes((b0, 126)) + struct.pack("!H", n) + payload
    return bytes((b0, 127)) + struct.pack("!Q", n) + payload


def client_frames(data: bytes) -> list[tuple[int, bytes]]:
    """Unmask what the link wrote (after the HTTP request)."""
    out, pos = [], data.index(b"\r\n\r\n") + 4 if data.startswith(b"GET") else 0
    while pos < len(data):
        b0, b1 = data[pos], data[pos + 1]
        assert b1 & 0x80, "client frames must be masked"
        n, hdr = b1 & 0x7F, 2
        if n == 126:
            n, hdr = struct.unpack_from("!H", data, pos + 2)[0], 4
        elif n == 127:
            n, hdr = struct.unpack_from("!Q", data, pos + 2)[0], 10
        mask = data[pos + hdr:pos + hdr + 4]
        out.append((b0 & 0x0F, apply_mask(data[pos + hdr + 4:pos + hdr + 4 + n], mask)))
        pos += hdr + 4 + n
    return out


def opened_link(max_size=1 << 20, status=101, good_accept=True):
    got = []
    link = ReplicaLink("ws://127.0.0.1:9/v1/replica", {"Authorization": "Bearer s"}, lambda d, t: got.append(d),
                       max_size)
    t = FakeTransport()
    link.connection_made(t)
    request = bytes(t.written).decode()
    assert request.startswith("GET /v1/replica HTTP/1.1\r\n") and "Authorization: Bearer s\r\n" in request
    key = next(line.split(": ")[1] for line in request.split("\r\n") if line.startswith("Sec-WebSocket-Key"))
    accept = accept_key(key) if good_accept else "nope"
    response = (f"HTTP/1.1 {status} X\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Accept: {accept}\r\n\r\n").encode()
    t.written.clear()
    return link, t, got, response


async def test_handshake_and_frames_in_one_chunk_and_split_anywhere():
    frames = server_frame(OP_BINARY, b"hello") + server_frame(OP_BINARY, b"x" * 300) + \
        server_frame(OP_BINARY, b"y" * 70_000)
    link, t, got, response = opened_link()
    link.data_received(response + frames)
    assert link.opened.done() and got == [b"hello", b"x" * 300, b"y" * 70_000]
    link, t, got, response = opened_link()
    for i in range(len(response + frames)):  # one byte at a time
        link.data_received((response + frames)[i:i + 1])
    assert got == [b"hello", b"x" * 300, b"y" * 70_000]


async def test_refused_handshakes():
    link, t, got, response = opened_link(status=403)
    link.data_received(response)
    with pytest.raises(LinkRefused) as e:
        link.opened.result()
    assert e.value.status == 403 and t.aborted
    link, t, got, response = opened_link(good_accept=False)
    link.data_received(response)
    with pytest.raises(LinkRefused):
        link.opened.result()


async def test_fragments_ping_pong_close():
    link, t, got, response = opened_link()
    link.data_received(response)
    link.data_received(server_frame(OP_BINARY, b"ab", fin=False) + server_frame(0, b"cd", fin=False)
                       + server_frame(OP_PING, b"pp") + server_frame(0, b"ef"))
    assert got == [b"abcdef"]
    assert client_frames(bytes(t.written)) == [(OP_PONG, b"pp")]
    t.written.clear()
    link.last_pong = 0.0
    link.data_received(server_frame(OP_PONG, b"x"))
    assert link.last_pong > 0
    link.data_received(server_frame(OP_CLOSE, struct.pack("!H", 4401) + b"unauthorized"))
    assert client_frames(bytes(t.written)) == [(OP_CLOSE, struct.pack("!H", 4401))] and t.closing
    link.connection_lost(None)
    closed = link.closed.result()
    assert isinstance(closed, LinkClosed) and (closed.code, closed.reason) == (4401, "unauthorized")


async def test_protocol_violations_close_the_link():
    link, t, got, response = opened_link(max_size=100)
    link.data_received(response + server_frame(OP_BINARY, b"z" * 101))
    assert t.aborted and not got and client_frames(bytes(t.written))[0][1][:2] == struct.pack("!H", 1009)
    link, t, got, response = opened_link()
    link.data_received(response + bytes((0x82, 0x81, 0, 0, 0, 0, 1)))  # a masked frame from the server
    assert t.aborted and client_frames(bytes(t.written))[0][1][:2] == struct.pack("!H", 1002)


def test_encode_frame_masks_every_size():
    for n in (0, 125, 126, 65535, 65536):
        payload = bytes(range(256)) * (n // 256) + bytes(range(n % 256))
        (op, data), = client_frames(encode_frame(OP_BINARY, payload))
        assert op == OP_BINARY and data == payload
