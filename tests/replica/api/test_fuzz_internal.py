"""Seeded fuzz of the internal protocol against a real replica (default model).

Thousands of mutated valid Generate and Abort messages (wrong types, boundary and
out-of-range integers 2**31 / 2**63 / 2**64 - 1 / -1 / -2**63, NaN and infinities,
huge strings, deep nesting, unknown fields and tags, missing fields, dict forms),
a few to eight per frame, plus broken frames, on the socket a proxy would use,
while bystander streams run on that socket and on another one. Asserts:

  * neither process dies (the API process and the same engine process serve to the
    end; no engine restart);
  * every mutated Generate whose id survived gets exactly one answer (Finished or
    Error) within ANSWER_BOUND_S;
  * every bystander stream finishes token for token as it did alone;
  * afterwards /metrics shows nothing running and no KV block in use.

Reproduce a failure with the seed in its message: EDGECHAT_FUZZ_SEED=<seed>.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import msgspec
import pytest
from websockets.asyncio.client import connect

from wire import protocol as P
from tests.replica.server import AUTH, engine_pid, idle_within, replica_server, scrape
from tests.replica.ws_client import ReplicaWS, ws_url

SEED = int(os.environ.get("EDGECHAT_FUZZ_SEED", "20240611"))
N_MESSAGES = 3000
ANSWER_BOUND_S = 30.0
MAX_OUTSTANDING = 64
BYSTANDER = P.Generate(id="", prompt_ids=[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198],
                       sampling=P.SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True))


def deep(n: int) -> msgspec.Raw:
    """[[[...]]] n levels deep, pre-encoded (msgspec would refuse to encode it)."""
    return msgspec.Raw(b"\x91" * n + b"\x90")


POISON = [0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -2**63, float("nan"), float("inf"),
          float("-inf"), 1e308, -0.0, 0.5, "", "x" * 100_000, "\x00", "ü" * 300, None, True, False, [], [[]], {},
          {"a": 1}, b"\x00" * 8, list(range(5000)), [2**64 - 1] * 3, [-1], ["x" * 300] * 20, [0.5], "generate"]


def base_generate(rng: random.Random, rid: str) -> list:
    """A valid Generate with every field present (non-default last fields keep them all on the wire)."""
    sp = P.SamplingParams(max_tokens=rng.choice([1, 2, 3]), temperature=rng.choice([0.0, 0.7]), top_p=0.9,
                          top_k=rng.choice([0, 5]), seed=rng.randrange(2**63), stop=rng.choice([[], ["\n\n"]]),
                          stop_token_ids=rng.choice([[], [2]]), ignore_eos=True)
    g = P.Generate(id=rid, prompt_ids=[rng.randrange(1, 49152) for _ in range(rng.randrange(1, 20))], sampling=sp,
                   cache_salt=rng.choice(["t1", "t2"]), priority=rng.choice([0, 1]), deadline_ms=5000.0,
                   resume_ids=[], traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    return msgspec.msgpack.decode(msgspec.msgpack.encode(g))


def slots(msg: list) -> list[tuple[list, int]]:
    """Every (container, index) inside a message but its tag and id."""
    out, todo = [], [msg]
    while todo:
        c = todo.pop()
        for i in range(2 if c is msg else 0, len(c)):
            out.append((c, i))
            if isinstance(c[i], list) and len(c[i]) < 64:
                todo.append(c[i])
    return out


def mutate(rng: random.Random, msg: list) -> tuple[object, bool]:
    """(mutated message, whether it must still be answered under its id)."""
    op = rng.choice(["leaf", "leaf", "leaf", "leaf", "extra", "drop", "dict", "tag", "id", "whole", "deep"])
    if op == "leaf":
        c, i = rng.choice(slots(msg))
        c[i] = rng.choice(POISON)
        return msg, True
    if op == "deep":
        c, i = rng.choice(slots(msg))
        c[i] = deep(rng.choice([100, 5000]))
        return msg, True
    if op == "extra":  # unknown trailing fields: ignored on Generate, refused inside SamplingParams
        target = rng.choice([msg, msg[3]])
        target.extend(rng.choice(POISON) for _ in range(rng.randrange(1, 4)))
        return msg, True
    if op == "drop":
        n = rng.randrange(0, len(msg))
        return msg[:n], n >= 2
    if op == "dict":
        return dict(zip(["type", "id", "prompt_ids", "sampling"], msg)), False
    if op == "tag":
        msg[0] = rng.choice(["tokens", "hello", "finished", "", "GENERATE", 7, None])
        return msg, False
    if op == "id":
        msg[1] = rng.choice(POISON)
        return msg, False
    return rng.choice(POISON), False


def broken_frame(rng: random.Random) -> bytes:
    return rng.choice([b"", b"\x93garbage", bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))),
                       msgspec.msgpack.encode({"not": "a list"}), msgspec.msgpack.encode([1, 2, 3]),
                       b"\xdd\xff\xff\xff\xff", bytes(deep(20_000))])


class Fuzz:
    def __init__(self, url: str, rng: random.Random, want: list[int]):
        self.url, self.rng, self.want = url, rng, want
        self.expect: dict[str, float] = {}  # id -> when sent (answer still due)
        self.answered: dict[str, object] = {}
        self.maybe: set[str] = set()  # aborted by the fuzzer: an answer may or may not come
        self.late: list[tuple[str, float]] = []
        self.twice: list[str] = []
        self.sent_msgs: dict[str, object] = {}  # what was sent under each id that is due an answer
        self.unfinished_bystanders: list[str] = []
        self.closed: list[str] = []  # the replica closed a socket
        self.bystanders_done = 0
        self.bystander_failures: list[str] = []
        self.sent = 0
        self.progress = asyncio.Event()

    def on_messages(self, msgs, by: dict) -> None:
        now = time.monotonic()
        for m in msgs:
            if isinstance(m, (P.Tokens, P.Finished)) and m.id in by:
                by[m.id].extend(m.ids)
            if not isinstance(m, (P.Finished, P.Error)) or m.id is None:
                continue
            if m.id in by:
                self._bystander_done(m, by.pop(m.id))
            elif m.id in self.expect:
                sent = self.expect.pop(m.id)
                if now - sent > ANSWER_BOUND_S:
                    self.late.append((m.id, now - sent))
                self.answered[m.id] = m
            elif m.id in self.answered and m.id not in self.maybe:
                self.twice.append(f"{m.id}: {self.answered[m.id]} then {m}")
        self.progress.set()

    def _bystander_done(self, m, tokens: list[int]) -> None:
        if not isinstance(m, P.Finished) or tokens != self.want:
            self.bystander_failures.append(f"{m.id}: {m} {tokens}")
        self.bystanders_done += 1

    def overdue(self) -> bool:
        return bool(self.expect) and time.monotonic() - min(self.expect.values()) > ANSWER_BOUND_S

    async def bystanders(self, c: ReplicaWS, prefix: str, stop: asyncio.Event, by: dict) -> None:
        n = 0
        while not stop.is_set():
            rid = f"{prefix}{n}"
            n += 1
            by[rid] = []
            await c.send(msgspec.structs.replace(BYSTANDER, id=rid))
            while rid in by:
                await asyncio.sleep(0.05)

    async def reader(self, c: ReplicaWS, by: dict) -> None:
        while True:
            self.on_messages(await c.recv(), by)

    async def run(self) -> None:
        rng = self.rng
        async with connect(ws_url(self.url), max_size=None, additional_headers=AUTH) as s1, \
                connect(ws_url(self.url), max_size=None, additional_headers=AUTH) as s2:
            fuzz, other = ReplicaWS(s1), ReplicaWS(s2)
            by1, by2, stop = {}, {}, asyncio.Event()
            tasks = [asyncio.create_task(self.reader(fuzz, by1)), asyncio.create_task(self.reader(other, by2)),
                     asyncio.create_task(self.bystanders(fuzz, "bx", stop, by1)),
                     asyncio.create_task(self.bystanders(other, "by", stop, by2))]
            try:
                while self.sent < N_MESSAGES:
                    while len(self.expect) >= MAX_OUTSTANDING and not self.overdue():
                        self.progress.clear()
                        await asyncio.wait([asyncio.ensure_future(self.progress.wait())], timeout=1.0)
                    if self.overdue():
                        break  # reported by the test
                    await s1.send(self.frame(rng))
                    if rng.random() < 0.02:
                        await s1.send(broken_frame(rng))
                stop.set()  # no new bystanders: drain what is due
                deadline = time.monotonic() + ANSWER_BOUND_S
                while (self.expect or by1 or by2) and time.monotonic() < deadline \
                        and not any(t.done() for t in tasks[:2]):
                    self.progress.clear()
                    await asyncio.wait([asyncio.ensure_future(self.progress.wait())], timeout=1.0)
                self.unfinished_bystanders = sorted(by1) + sorted(by2)
                self.closed = [repr(t.exception()) for t in tasks[:2] if t.done() and not t.cancelled()]
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    def frame(self, rng: random.Random) -> bytes:
        msgs = []
        for _ in range(rng.randrange(1, 9)):
            self.sent += 1
            rid = f"f{self.sent}"
            if rng.random() < 0.15 and self.sent > 1:  # an Abort, valid or mutated, of an earlier request
                target = f"f{rng.randrange(1, self.sent)}"
                abort: object = rng.choice([["abort", target], ["abort", target, rng.choice(POISON)],
                                            ["abort", rng.choice(POISON)], ["abort"], {"type": "abort", "id": target}])
                valid = isinstance(abort, list) and abort[:2] == ["abort", target]  # extra fields are ignored
                if valid and target in self.expect:
                    del self.expect[target]
                    self.maybe.add(target)
                msgs.append(abort)
                continue
            msg, answered = mutate(rng, base_generate(rng, rid))
            if answered:
                self.expect[rid] = time.monotonic()
                self.sent_msgs[rid] = msg
            msgs.append(msg)
        return msgspec.msgpack.encode(msgs)


@pytest.fixture(scope="module")
def replica():
    with replica_server("--kv-memory-gb", "0.05", "--max-num-seqs", "32", "--max-model-len", "64") as (url, proc):
        yield url, proc


async def _alone(url: str) -> list[int]:
    async with connect(ws_url(url), additional_headers=AUTH) as s:
        c = ReplicaWS(s)
        await c.send(msgspec.structs.replace(BYSTANDER, id="alone"))
        return (await c.collect(["alone"]))["alone"][0]


def test_fuzz_internal_protocol(replica):
    url, proc = replica
    engine = engine_pid(proc.pid)
    want = asyncio.run(_alone(url))
    fuzz = Fuzz(url, random.Random(SEED), want)
    t0 = time.perf_counter()
    asyncio.run(asyncio.wait_for(fuzz.run(), 600))
    took = time.perf_counter() - t0
    seed = f"(seed {SEED})"
    assert proc.poll() is None and engine_pid(proc.pid) == engine, f"a process died {seed}"
    assert scrape(url)["edgechat_replica_engine_restarts_total"] == 0, seed
    assert not fuzz.expect, (f"{len(fuzz.expect)} requests never answered {seed}, e.g. "
                             + "; ".join(f"{k}: {str(fuzz.sent_msgs[k])[:300]}" for k in sorted(fuzz.expect)[:4]))
    assert not fuzz.closed, f"the replica closed a socket: {fuzz.closed} {seed}"
    assert not fuzz.unfinished_bystanders, f"bystanders never finished: {fuzz.unfinished_bystanders} {seed}"
    assert not fuzz.twice, f"answered twice: {fuzz.twice[:3]} {seed}"
    assert not fuzz.late, f"answers later than {ANSWER_BOUND_S} s: {fuzz.late[:5]} {seed}"
    assert not fuzz.bystander_failures, f"bystanders differ: {fuzz.bystander_failures[:3]} {seed}"
    assert fuzz.bystanders_done >= 2, seed
    idle_within(url, 5.0)
    finished = sum(isinstance(m, P.Finished) for m in fuzz.answered.values())
    errors = sum(isinstance(m, P.Error) for m in fuzz.answered.values())
    assert finished > 50 and errors > 500, (finished, errors)  # both kinds of outcome are exercised
    print(f"fuzz {seed}: {fuzz.sent} messages in {took:.1f} s; {len(fuzz.answered)} answered "
          f"({finished} finished, {errors} errors); {fuzz.bystanders_done} bystander streams exact")
