"""The engine process's loop (replica.engine.process.serve) answers a KV transfer command before
it runs the next step: a transfer's round trip is the wait for one step boundary, not that plus a
whole step (docs/perf.md, drain with hand-off). Over a socket pair, the tiny engine with its steps
gated: the answer must arrive while the step after the read is held."""

from __future__ import annotations

import socket
import threading

from wire import protocol as P
from wire.hashing import block_hashes
from replica.config import EngineConfig
from replica.engine.llm_engine import LLMEngine
from replica.engine.process import serve
from replica.kv_slots import SlotMap, new_segment
from tests.replica.engines import prompts, run
from tests.replica.tiny import tiny_config, tiny_weights

GREEDY = P.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class GatedEngine(LLMEngine):
    """Each step waits for a permit; `entered` counts the steps begun."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.permits = threading.Semaphore(0)
        self.entered = 0
        self.in_step = threading.Condition()

    def step(self, *args, **kw):
        with self.in_step:
            self.entered += 1
            self.in_step.notify_all()
        assert self.permits.acquire(timeout=60), "the test never let this step run"
        return super().step(*args, **kw)


def receive_until(sock: socket.socket, codec: P.FrameCodec, kind, timeout: float):
    sock.settimeout(timeout)
    while True:
        for msg in codec.feed(sock.recv(1 << 20)):
            if isinstance(msg, kind):
                return msg


def cached_engine(busy_tokens: int) -> tuple[GatedEngine, list[int]]:
    """The tiny engine, gated, with a 70-token prompt's 4 full blocks computed and cached, and a stream of
    `busy_tokens` queued (the loop's steps run it)."""
    cfg = tiny_config()
    engine = GatedEngine(EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=24, max_num_seqs=8),
                         cfg, tiny_weights(cfg))
    ids = prompts([70])["s0"]
    assert engine.add(P.Generate(id="p", prompt_ids=ids, sampling=GREEDY)) is None
    engine.permits.release(100)
    run(engine)
    engine.permits, engine.entered = threading.Semaphore(0), 0
    busy = P.SamplingParams(max_tokens=busy_tokens, temperature=0.0, ignore_eos=True)
    assert engine.add(P.Generate(id="busy", prompt_ids=prompts([20], seed=1)["s0"], sampling=busy)) is None
    return engine, ids


def test_a_kv_read_is_answered_before_the_next_step():
    engine, ids = cached_engine(500)
    ours, theirs = socket.socketpair()
    fd = new_segment()
    loop = threading.Thread(target=serve, args=(engine, theirs, "r", "m", 60.0, fd), daemon=True)
    loop.start()
    codec = P.FrameCodec()
    try:
        hello = receive_until(ours, codec, P.Hello, 30)
        slots = SlotMap(fd, hello.kv_slots, hello.kv_slot_bytes)  # as the API process maps them (KvSpec came too)
        with engine.in_step:  # the loop is inside its first step, held
            assert engine.in_step.wait_for(lambda: engine.entered == 1, 30)
        hashes = block_hashes(ids, 16)
        ours.sendall(codec.pack([P.KvRead(id="kv/0", hashes=hashes, slot=1)]))
        engine.permits.release()  # step 1 ends; the loop takes the read at this boundary
        got = receive_until(ours, codec, P.KvBlocks, 30)  # no permit for step 2: it came before step 2 ended
        with engine.in_step:  # and the loop went on into step 2, held
            assert engine.in_step.wait_for(lambda: engine.entered == 2, 30)
        assert got.id == "kv/0" and got.hashes == hashes and got.slot == 1 and not got.error
        direct = bytearray(4 * engine.runner.block_nbytes())
        engine.runner.read_blocks(engine.blocks.cached(hashes), direct)  # the step held: nothing moves meanwhile
        assert slots.view(1, len(direct)) == direct  # the blocks' bytes in the slot, none on the socket
    finally:
        engine.permits.release(1000)
        ours.shutdown(socket.SHUT_WR)  # the loop sees the API process gone and returns
        loop.join(30)
        ours.close()
        theirs.close()
    assert not loop.is_alive()


def pending(sock: socket.socket, codec: P.FrameCodec) -> list:
    """The messages already in the socket (none is on its way: the loop is held in a step)."""
    sock.setblocking(False)
    out = []
    try:
        while data := sock.recv(1 << 20):
            out += codec.feed(data)
    except BlockingIOError:
        pass
    finally:
        sock.setblocking(True)
    return out


def test_with_streams_running_a_boundary_answers_reads_up_to_its_byte_budget(monkeypatch):
    """Three reads taken at one boundary, a budget of one and a half reads' bytes: one answered at each of
    the next three boundaries (a second does not fit what the first left), the stream's steps between (its
    tokens are not held behind all three); idle, all at once."""
    import replica.engine.process as process

    engine, ids = cached_engine(6)
    monkeypatch.setattr(process, "KV_READ_BYTES", 6 * engine.runner.block_nbytes())  # 1.5 4-block reads
    ours, theirs = socket.socketpair()
    loop = threading.Thread(target=serve, args=(engine, theirs, "r", "m", 60.0, new_segment()), daemon=True)
    loop.start()
    codec = P.FrameCodec()
    hashes = block_hashes(ids, 16)
    try:
        receive_until(ours, codec, P.KvSpec, 30)
        with engine.in_step:
            assert engine.in_step.wait_for(lambda: engine.entered == 1, 30)
        ours.sendall(codec.pack([P.KvRead(id=f"kv/{i}", hashes=hashes, slot=i) for i in range(3)]))
        answered = []
        for step in range(2, 5):
            engine.permits.release()  # the step before ends; the loop answers what the budget allows
            with engine.in_step:
                assert engine.in_step.wait_for(lambda: engine.entered == step, 30)
            answered.append([m.id for m in pending(ours, codec) if isinstance(m, P.KvBlocks)])
        assert answered == [["kv/0"], ["kv/1"], ["kv/2"]]
        engine.permits.release(1000)  # the stream ends: idle, every read of a boundary at once
        receive_until(ours, codec, P.Finished, 30)
        ours.sendall(codec.pack([P.KvRead(id=f"idle/{i}", hashes=hashes, slot=i) for i in range(3)]))
        got = []
        ours.settimeout(30)
        while len(got) < 3:
            got += [m.id for m in codec.feed(ours.recv(1 << 20)) if isinstance(m, P.KvBlocks)]
        assert got == ["idle/0", "idle/1", "idle/2"]
    finally:
        engine.permits.release(1000)
        ours.shutdown(socket.SHUT_WR)
        loop.join(30)
        ours.close()
        theirs.close()
    assert not loop.is_alive()
