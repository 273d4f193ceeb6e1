"""Issue 11, items 2, 5 and 12 (proxy side): poison values are refused at the edge with
their request's id, size limits apply before any work, and one message that cannot be
encoded toward a replica fails its own request only."""

import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from edge_proxy import protocol as pp
from stub_replica.server import expected_tokens
from wire import protocol as P

from conftest import KEYS, proxy_for, stubs, want
from attacker import attack_frames
from rawclient import RawClient, generate

pytestmark = pytest.mark.anyio
AUTH = {"Authorization": "Bearer sk-alice"}
LOAD_KEYS = KEYS + [{"key": "sk-load", "tenant": "load", "rate_per_s": 10_000, "burst": 10_000}]


POISON = {  # request id -> (field path, value); every one must be refused with bad_request
    "topk-2^31": ("sampling.top_k", 2**31), "topk-2^63": ("sampling.top_k", 2**63),
    "topk-2^64": ("sampling.top_k", 2**64), "topk--1": ("sampling.top_k", -1),
    "stopid-2^64": ("sampling.stop_token_ids", [2**64]), "stopid--1": ("sampling.stop_token_ids", [-1]),
    "stopid-many": ("sampling.stop_token_ids", list(range(65))),
    "seed-2^63": ("sampling.seed", 2**63), "seed-2^64": ("sampling.seed", 2**64), "seed--1": ("sampling.seed", -1),
    "max-2^63": ("sampling.max_tokens", 2**63), "max-0": ("sampling.max_tokens", 0),
    "max-str": ("sampling.max_tokens", "8"), "max-float": ("sampling.max_tokens", 8.5),
    "max-over-limit": ("sampling.max_tokens", 100_000),
    "temp-inf": ("sampling.temperature", "1e999"), "temp-neg": ("sampling.temperature", -1),
    "topp-0": ("sampling.top_p", 0), "topp-2": ("sampling.top_p", 2),
    "stop-empty": ("sampling.stop", [""]), "stop-17": ("sampling.stop", ["x"] * 17),
    "deadline-neg": ("deadline_ms", -1), "deadline-inf": ("deadline_ms", "1e999"),
    "priority": ("priority", "urgent"), "unknown": ("bogus", 1), "session-long": ("session", "s" * 257),
    "tenant-long": ("tenant", "t" * 129), "nested": ("prompt", [[[[[[["x"]]]]]]]),
}


def poisoned(rid: str, path: str, value) -> str:
    g = generate(rid)
    *parents, leaf = path.split(".")
    d = g
    for k in parents:
        d = d[k]
    d[leaf] = value
    text = json.dumps(g)
    return text.replace('"1e999"', "1e999")  # a JSON number out of float range


async def test_poison_values_are_refused_with_their_id_and_spare_the_burst():
    async with stubs("a", step_s=0.005) as reps, proxy_for(reps, max_tokens_limit=4096) as p:
        async with await RawClient.connect(p.ws_url) as c:
            ids_ok = [f"ok-{i}" for i in range(4)] + ["x" * 128]  # the longest valid id
            frames = [json.dumps(generate(rid, prompt=f"bystander {i}", max_tokens=12)) for i, rid in enumerate(ids_ok)]
            frames += [poisoned(rid, path, v) for rid, (path, v) in POISON.items()]
            frames.insert(3, json.dumps(generate("y" * 129)))  # an id over the bound: refused, never echoed
            frames.insert(5, '{"type":"generate","id":"deep","prompt":' + "[" * 5000 + "]" * 5000 + "}")
            frames.insert(7, '{"type":"cancel","id":"' + "z" * 100_000 + '"}')
            for f in frames:  # one burst: all of it reaches the proxy within a few loop turns
                await c.ws.send(f)
            answers = len(ids_ok) + len(POISON) + 3  # + the 129-char id, the deep frame, the 100,000-char cancel
            await c.until(lambda: len(c.ended) + len(c.conn_errors) == answers)
            for rid in POISON:
                assert c.ended[rid]["type"] == "error" and c.ended[rid]["code"] == pp.BAD_REQUEST, rid
            assert "2147483647" in c.ended["topk-2^64"]["message"] and "top_k" in c.ended["topk-2^64"]["message"]
            assert {e["code"] for e in c.conn_errors} == {pp.BAD_REQUEST}  # ids past their bound are not echoed
            assert len(c.conn_errors) == 3 - ("deep" in c.ended)  # the deep frame may be too deep to find its id
            assert all(len(json.dumps(f)) < 1000 for f in c.frames)  # nothing long echoed
            for i, rid in enumerate(ids_ok):
                assert c.ended[rid]["type"] == "done", c.ended[rid]
                assert c.text(rid) == want(f"bystander {i}", 12)
        assert len(reps[0].generates) == len(ids_ok)
        assert not p.proxy.streams


async def test_poison_values_over_http():
    async with stubs("a") as reps, proxy_for(reps) as p:
        async with httpx.AsyncClient(trust_env=False, headers=AUTH) as h:
            for body in ({"prompt": [1, 2, 2**64], "max_tokens": 2}, {"prompt": [-1], "max_tokens": 2},
                         {"prompt": "x", "top_k": 2**64, "max_tokens": 2}, {"prompt": "x", "top_k": 2**31},
                         {"prompt": "x", "seed": 2**63}, {"prompt": "x", "stop": ["s"] * 17}):
                r = await h.post(p.http + "/v1/completions", json=body)
                assert r.status_code == 400 and r.json()["error"]["code"] == pp.BAD_REQUEST, (body, r.text)
            r = await h.post(p.http + "/v1/completions", json={"prompt": [104, 105], "max_tokens": 2})
            assert r.status_code == 200
        assert [g.prompt_ids for g in reps[0].generates] == [[104, 105]]


class Counting:
    """A tokenizer that counts its calls and, given a gate, blocks each until it opens."""

    def __init__(self, inner, gate: threading.Event | None = None):
        self.inner, self.gate, self.calls = inner, gate, 0

    def encode(self, text):
        self.calls += 1
        if self.gate is not None:
            self.gate.wait(10)
        return self.inner.encode(text)

    def encode_chat(self, messages):
        self.calls += 1
        return self.inner.encode_chat(messages)


class _Request:
    """Stands in for a ProxiedRequest on a replica connection (what ReplicaConn reads of it)."""

    samples = None  # one sample

    def __init__(self, conn, gen):
        self.conn, self.gen, self.ids, self.done, self.error = conn, gen, [], asyncio.Event(), None


class _Events:
    """Stands in for the proxy as the pool's RequestEvents (what the pool tells about each request)."""

    def on_tokens(self, s, msg, now):
        s.ids += msg.ids

    def on_finished(self, s, msg, now):
        s.ids += msg.ids
        s.conn.release(s.gen.id, abort=False)  # as the proxy does
        s.done.set()

    def on_replica_error(self, s, err):
        s.error = err
        s.done.set()

    def on_lost(self, conn, streams, cause):
        pass


async def test_an_unencodable_message_fails_alone():
    """Item 12: Generates and an Abort queued in the same loop turn as a message that
    cannot be encoded (ints past msgpack's range) all reach the replica."""
    async with stubs("a", step_s=0.005) as reps, proxy_for(reps) as p:
        p.proxy.pool.events = _Events()
        conn = p.proxy.pool.conns[0]
        victim = _Request(conn, P.Generate("", [1, 2, 3], P.SamplingParams(max_tokens=1000, temperature=0.0)))
        conn.start(victim, victim.gen)
        await asyncio.wait_for(reps[0].token_event.wait(), 5)
        a = _Request(conn, P.Generate("", [5, 6], P.SamplingParams(max_tokens=5, temperature=0.0)))
        bad = _Request(conn, P.Generate("", [7, 2**64], P.SamplingParams(max_tokens=5)))
        b = _Request(conn, P.Generate("", [8, 9], P.SamplingParams(max_tokens=5, temperature=0.0)))
        conn.start(a, a.gen)  # all four in one loop turn, so one frame
        rid_bad = conn.start(bad, bad.gen)
        conn.start(b, b.gen)
        conn.release(victim.gen.id, abort=True)
        await asyncio.wait_for(asyncio.gather(a.done.wait(), b.done.wait(), bad.done.wait()), 5)
        await asyncio.wait_for(reps[0].abort_event.wait(), 5)
        assert a.ids == expected_tokens([5, 6], a.gen.sampling, 5) and b.ids == expected_tokens([8, 9], b.gen.sampling, 5)
        assert bad.error.code == P.BAD_REQUEST and "encode" in bad.error.message and bad.error.id == rid_bad
        assert rid_bad not in conn.streams and conn.own_inflight == 0
        assert [g.id for g in reps[0].generates] == [victim.gen.id, a.gen.id, b.gen.id]
        assert reps[0].aborts[0][0] == victim.gen.id


async def test_size_limits_apply_before_tokenizing():
    """Item 5: a 1 MB prompt, a 1 MB role and 30,000 messages are refused at once, and
    nothing of them is rendered or tokenized (the tokenizer pool never sees a job)."""
    async with stubs("a") as reps, proxy_for(reps, max_frame_bytes=2 << 20) as p:
        tok = p.proxy.tokenizers.tokenizer = Counting(p.proxy.tokenizer)
        cases = {
            "prompt": (generate("prompt", prompt="x" * 1_000_000), pp.PROMPT_TOO_LONG),
            "utf8": (generate("utf8", prompt="é" * 140_000), pp.PROMPT_TOO_LONG),  # 280,000 bytes in 140,000 chars
            "role": ({"type": "generate", "id": "role", "messages": [{"role": "r" * 1_000_000, "content": "x"}]},
                     pp.BAD_REQUEST),
            "many": ({"type": "generate", "id": "many", "messages": [{"role": "user", "content": ""}] * 30_000},
                     pp.PROMPT_TOO_LONG),
        }
        async with await RawClient.connect(p.ws_url) as c:
            for rid, (msg, code) in cases.items():
                t0 = time.perf_counter()
                await c.send(msg)
                await c.until(lambda: rid in c.ended)
                took = time.perf_counter() - t0
                assert c.ended[rid]["code"] == code, c.ended[rid]
                assert took < 0.5, f"{rid}: refused after {took * 1e3:.0f} ms"
        assert tok.calls == 0 and p.proxy.tokenizers.jobs == 0 and not reps[0].generates


async def test_a_full_tokenizer_pool_refuses_at_once():
    async with stubs("a") as reps, proxy_for(reps) as p:
        pool = p.proxy.tokenizers
        gate = threading.Event()
        pool.tokenizer = Counting(p.proxy.tokenizer, gate)
        async with await RawClient.connect(p.ws_url) as c:
            for i in range(pool.max_jobs + 3):
                await c.send(generate(f"r{i}", max_tokens=1))
            await c.until(lambda: len(c.ended) == 3)
            assert all(f["code"] == pp.OVERLOADED and f["retry_after_s"] > 0 for f in c.ended.values())
            gate.set()
            await c.until(lambda: len(c.ended) == pool.max_jobs + 3)
            assert sum(f["type"] == "done" for f in c.ended.values()) == pool.max_jobs
        assert pool.jobs == 0 and pool.tokenizer.calls == pool.max_jobs


def _gaps_ms(c: RawClient, rids) -> list[float]:
    return [(b - a) * 1e3 for rid in rids for a, b in zip(c.arrivals[rid], c.arrivals[rid][1:])]


async def _bystanders(url: str, n: int, tokens: int) -> list[float]:
    """`n` streams of `tokens` tokens on one socket; their inter-token gaps as the client saw them."""
    async with await RawClient.connect(url, timed=True) as c:
        rids = [f"b{i}" for i in range(n)]
        for i, rid in enumerate(rids):
            await c.send(generate(rid, prompt=f"bystander {i}", max_tokens=tokens))
        await c.until(lambda: all(r in c.ended for r in rids), timeout=30)
        assert all(c.ended[r]["type"] == "done" and len(c.text(r)) == tokens for r in rids)
        return _gaps_ms(c, rids)


def _timed_ms(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t0) * 1e3


def p99(xs: list[float]) -> float:
    return sorted(xs)[int(0.99 * (len(xs) - 1))]


@pytest.fixture(scope="module")
def model_tokenizer():
    from edge_proxy.prompt import load_tokenizer

    return load_tokenizer("default")


async def test_bystanders_keep_their_pace_while_attackers_send_1mb_prompts(model_tokenizer):
    """Item 5 with the model's own tokenizer: three attackers (another process) send 1 MB
    prompts, 1 MB roles, 30,000 messages and 200 KB prompts (tokenized, then too long for
    the context) in a loop; bystanders' inter-token gaps stay within 2x their baseline p99, or,
    where this machine is busy enough that the attackers' own tokenizing (in the proxy's pool
    threads, on the same cores) stretches them further, within half of one such prompt's
    tokenizing time of it: one prompt tokenized on the event loop would stretch a gap by all of
    it (~220 ms here), so either bound still fails a proxy that blocks its loop."""
    fp = model_tokenizer.fingerprint
    long_prompt = next(json.loads(f)["prompt"] for f in attack_frames() if json.loads(f)["id"] == "long")
    async with stubs("a", step_s=0.02, tokenizer=fp) as reps, \
            proxy_for(reps, tokenizer=model_tokenizer, max_frame_bytes=2 << 20, keys=LOAD_KEYS) as p:
        await _bystanders(p.ws_url, 4, 10)  # warm up
        base = await _bystanders(p.ws_url, 8, 100)
        model_tokenizer.encode(long_prompt)  # warm; then what one attack prompt costs a core, at this load
        tokenize_ms = min(_timed_ms(model_tokenizer.encode, long_prompt) for _ in range(2))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(Path(__file__).with_name("attacker.py")), p.ws_url, "sk-load", "3",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        try:
            for _ in range(3):  # every attacker has had a round answered: the attack is on
                assert (await asyncio.wait_for(proc.stdout.readline(), 30)).strip() == b"ROUND"
            under = await _bystanders(p.ws_url, 8, 100)
            proc.stdin.close()
            summary = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
        print(f"bystander gap p99: baseline {p99(base):.1f} ms, under attack {p99(under):.1f} ms "
              f"({summary['rounds']} attack rounds of 4 frames: {summary['codes']}; one 200 KB prompt "
              f"tokenized in {tokenize_ms:.0f} ms)")
        n = summary["rounds"]
        assert summary["codes"] == {pp.PROMPT_TOO_LONG: 3 * n, pp.BAD_REQUEST: n}
        assert p99(under) <= max(2 * p99(base), p99(base) + tokenize_ms / 2), (p99(base), p99(under), tokenize_ms)
        assert p.proxy.tokenizers.jobs == 0 and len(reps[0].generates) == 20  # only the bystanders reached it
