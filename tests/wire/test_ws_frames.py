"""Server frames written straight to the transport parse as RFC 6455 frames."""

import pytest
from websockets.frames import Frame, Opcode
from websockets.streams import StreamReader

from wire.ws_frames import binary_frame, text_frame


@pytest.mark.parametrize("n", [0, 1, 125, 126, 65535, 65536, 70000])
@pytest.mark.parametrize("make, opcode", [(text_frame, Opcode.TEXT), (binary_frame, Opcode.BINARY)])
def test_frames_parse_as_rfc6455(n, make, opcode):
    """Our server frames, read by websockets' own parser (as a client reads them)."""
    payload = ("é" * n).encode()[:n] if opcode == Opcode.TEXT else bytes(range(256)) * (n // 256) + bytes(n % 256)
    reader = StreamReader()
    reader.feed_data(make(payload))
    parser = Frame.parse(reader.read_exact, mask=False)
    try:
        next(parser)
    except StopIteration as done:
        frame = done.value
    assert frame.opcode == opcode and frame.fin and frame.data == payload
