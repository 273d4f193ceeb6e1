"""The latency relay: configured delay each way (within tolerance), order kept under jitter,
handshake cost, backpressure-free bulk transfer, clean stop."""

import asyncio
import contextlib
import statistics
from time import perf_counter

import pytest

from regions.relay import Relay

pytestmark = pytest.mark.anyio


async def echo_server():
    async def handle(r, w):
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()
        await w.wait_closed()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


@contextlib.asynccontextmanager
async def relayed(srv, **kw):
    """A started Relay in front of `srv`; relay and server are stopped after."""
    relay = await Relay(0, "127.0.0.1", srv.sockets[0].getsockname()[1], **kw).start()
    try:
        yield relay
    finally:
        await relay.stop()
        srv.close()
        await srv.wait_closed()


async def round_trips(port: int, n: int, size: int = 16) -> tuple[float, list[float]]:
    t0 = perf_counter()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    rtts = []
    first = None
    for _ in range(n):
        t = perf_counter()
        w.write(b"x" * size)
        await r.readexactly(size)
        rtts.append((perf_counter() - t) * 1e3)
        if first is None:
            first = (perf_counter() - t0) * 1e3
    w.close()
    await w.wait_closed()
    return first, rtts


async def test_relay_adds_the_configured_rtt():
    srv = await echo_server()
    port = srv.sockets[0].getsockname()[1]
    _, direct = await round_trips(port, 5)
    async with relayed(srv, rtt_ms=40.0) as relay:
        first, rtts = await round_trips(relay.port, 8)
        med = statistics.median(rtts[1:])
        assert 40.0 <= med <= 40.0 + 15.0, rtts  # timer granularity and a busy 2-core machine
        assert min(rtts) >= 39.0
        # the first exchange also pays the emulated TCP handshake: ~2 RTT from connect
        assert 80.0 <= first <= 80.0 + 30.0, first
        assert statistics.median(direct) < 5.0


async def test_jitter_spreads_delays_but_keeps_order():
    async with relayed(await echo_server(), rtt_ms=20.0, jitter=0.5, seed=1, handshake=False) as relay:
        r, w = await asyncio.open_connection("127.0.0.1", relay.port)
        payload = b"".join(i.to_bytes(4, "big") for i in range(2000))
        for i in range(0, len(payload), 40):  # many small writes, each delayed by its own jittered amount
            w.write(payload[i:i + 40])
            await w.drain()
            if i % 800 == 0:
                await asyncio.sleep(0.001)
        got = await asyncio.wait_for(r.readexactly(len(payload)), 10)
        assert got == payload
        _, rtts = await round_trips(relay.port, 12)
        assert 10.0 <= min(rtts) and max(rtts) <= 30.0 + 15.0
        assert max(rtts) - min(rtts) > 2.0  # jitter is there
        w.close()
        await w.wait_closed()


async def test_bulk_transfer_through_a_small_buffer():
    async with relayed(await echo_server(), rtt_ms=2.0, handshake=False) as relay:
        r, w = await asyncio.open_connection("127.0.0.1", relay.port)
        blob = bytes(range(256)) * 16384  # 4 MiB, over the relay's 1 MiB per-direction buffer

        async def send():
            w.write(blob)
            await w.drain()
            w.write_eof()

        sender = asyncio.create_task(send())
        got = await asyncio.wait_for(r.readexactly(len(blob)), 20)
        await sender
        assert got == blob
        assert await r.read() == b""  # EOF crosses the relay too
        w.close()
        await w.wait_closed()


async def test_upstream_down_resets_the_client_and_stop_is_clean():
    relay = await Relay(0, "127.0.0.1", 1, rtt_ms=1.0).start()  # nothing listens on port 1
    r, w = await asyncio.open_connection("127.0.0.1", relay.port)
    assert await asyncio.wait_for(r.read(), 5) == b""
    w.close()
    await w.wait_closed()
    await relay.stop()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", relay.port)
