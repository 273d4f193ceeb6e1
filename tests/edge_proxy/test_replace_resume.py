"""Issue 16's protocol additions on replica stubs (the proxy's own logic): `replaces`
aborts the old request within one step and puts the new one on the old one's
replica; a replaced id may be the new id (its done/abort comes before any frame of
the new request); `resumable` deltas carry the token ids; `resume` continues from
them exactly (the stub refuses resume ids that differ from its stream); every
refusal names the frame's id; FIM where the tokenizer has no FIM tokens is
refused naming why."""

import asyncio

import pytest

from edge_proxy.client import EdgeClient
from edge_proxy.prompt import ByteTokenizer
from edge_proxy.routing import RouterConfig
from stub_replica.server import expected_tokens
from wire import protocol as P

from conftest import proxy_for, stubs
from rawclient import RawClient

pytestmark = pytest.mark.anyio
STEP = 0.02
SAMPLING = {"max_tokens": 40, "temperature": 0.8, "seed": 11}


def stream_of(prompt: str, n: int, seed: int = 11, temperature: float = 0.8) -> list[int]:
    """The stub's token ids for a raw prompt through the byte tokenizer."""
    return expected_tokens(ByteTokenizer().encode(prompt), P.SamplingParams(seed=seed, temperature=temperature), n)


async def test_replaces_aborts_the_old_request_and_stays_on_its_replica():
    # round_robin sends every new request to the next replica: only `replaces` keeps it in place.
    async with stubs("a", "b", step_s=STEP) as reps, \
            proxy_for(reps, router=RouterConfig(mode="round_robin")) as p:
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            old = await c.generate(prompt="def main():", max_tokens=1000, temperature=0)
            async for _ in old:
                break
            home = next(r for r in reps if r.generates)
            before = home.produced()
            new = await c.generate(prompt="def main():\n", replaces=old, max_tokens=5, temperature=0)
            _, done_old = await old.result()
            _, done_new = await new.result()
            assert done_old.finish_reason == "abort"
            assert done_new.finish_reason == "length" and done_new.replica == done_old.replica == home.cfg.replica_id
            other = next(r for r in reps if r is not home)
            assert not other.generates  # the new request went where the old one ran
            await asyncio.wait_for(home.abort_event.wait(), 5)
            (rid, produced), = home.aborts
            assert rid == home.generates[0].id and produced - before[rid] <= 1  # stopped within one step
            assert p.proxy.metrics.routing.get("replaces") == 1


async def test_replacing_the_same_id_ends_the_old_one_first():
    async with stubs("a", step_s=STEP) as reps, proxy_for(reps) as p:
        raw = await RawClient.connect(p.ws_url)
        await raw.send({"type": "generate", "id": "c", "prompt": "x = ", "sampling": {"max_tokens": 1000}})
        await raw.until(lambda: raw.deltas.get("c"))
        await raw.send({"type": "generate", "id": "c", "prompt": "x = 1", "replaces": "c",
                        "sampling": {**SAMPLING, "max_tokens": 6}})
        await raw.until(lambda: raw.endings.get("c") == 2)
        mine = [f for f in raw.frames if f.get("id") == "c"]
        first_done = next(i for i, f in enumerate(mine) if f["type"] == "done")
        assert mine[first_done]["finish_reason"] == "abort"
        after = mine[first_done + 1:]
        assert [f["type"] for f in after][-1] == "done" and after[-1]["finish_reason"] == "length"
        text = "".join(f["text"] for f in after if f["type"] == "delta")
        assert text == ByteTokenizer().decode(stream_of("x = 1", 6))
        await raw.ws.close()


async def test_replaces_an_id_no_longer_open_just_starts():
    async with stubs("a", step_s=STEP) as reps, proxy_for(reps) as p:
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            _, done = await c.complete(prompt="a", max_tokens=2)
            req = await c.generate(prompt="ab", replaces="gone", max_tokens=3)
            text, done = await req.result()
            assert done.finish_reason == "length" and done.usage.completion_tokens == 3
        assert not reps[0].aborts


async def test_resumable_deltas_carry_ids_and_resume_continues_exactly():
    async with stubs("a", step_s=STEP) as reps, proxy_for(reps) as p:
        whole = stream_of("Once", 40)
        raw = await RawClient.connect(p.ws_url)
        await raw.send({"type": "generate", "id": "r", "prompt": "Once", "resumable": True, "sampling": SAMPLING})
        await raw.until(lambda: "r" in raw.ended)
        ids = [i for d in raw.deltas["r"] for i in d["ids"]]
        assert ids == whole and sum(d["tokens"] for d in raw.deltas["r"]) == 40
        # A client that got 13 tokens (and their text) resumes on another connection.
        raw2 = await RawClient.connect(p.ws_url)
        await raw2.send({"type": "generate", "id": "r", "prompt": "Once", "resume": whole[:13], "sampling": SAMPLING})
        await raw2.until(lambda: "r" in raw2.ended)
        done = raw2.ended["r"]
        assert done["type"] == "done" and done["finish_reason"] == "length", done
        assert done["usage"]["completion_tokens"] == 40
        assert ByteTokenizer().decode(whole[:13]) + raw2.text("r") == raw.text("r")
        assert all("ids" not in d for d in raw2.deltas["r"])  # not asked for
        assert reps[0].generates[-1].resume_ids == whole[:13]
        # Everything was received but the done: answered at once, nothing sent to the replica.
        n = len(reps[0].generates)
        await raw2.send({"type": "generate", "id": "s", "prompt": "Once", "resume": whole, "sampling": SAMPLING})
        await raw2.until(lambda: "s" in raw2.ended)
        assert raw2.ended["s"]["finish_reason"] == "length" and "s" not in raw2.deltas
        assert len(reps[0].generates) == n
        await raw.ws.close()
        await raw2.ws.close()


@pytest.mark.parametrize("frame, code, says", [
    ({"prompt": "x", "suffix": "y"}, "bad_request", "suffix goes with prefix"),
    ({"prompt": "x", "prefix": "y"}, "bad_request", "exactly one of messages, prompt and prefix"),
    ({"prefix": "def f(", "suffix": "):"}, "bad_request", "fill-in-the-middle"),
    ({"prompt": "x", "resume": [1, 2], "sampling": {"temperature": 0.5}}, "bad_request", "needs the request's"),
    ({"prompt": "x", "resume": [1, 2, 3], "sampling": {"max_tokens": 2}}, "bad_request", "over max_tokens"),
    ({"prompt": "x", "resume": [-1]}, "bad_request", "resume"),
    ({"prompt": "x", "replaces": 7}, "bad_request", "replaces"),
    ({"prompt": "x", "resumable": "yes"}, "bad_request", "resumable"),
], ids=["suffix-alone", "two-prompts", "no-fim-tokens", "resume-unseeded", "resume-too-long", "resume-bad-id",
        "replaces-not-a-string", "resumable-not-bool"])
async def test_refusals_name_the_frame_and_keep_the_old_request(frame, code, says):
    async with stubs("a", step_s=STEP) as reps, proxy_for(reps) as p:
        raw = await RawClient.connect(p.ws_url)
        await raw.send({"type": "generate", "id": "old", "prompt": "keep", "sampling": {"max_tokens": 30}})
        await raw.until(lambda: raw.deltas.get("old"))
        await raw.send({"type": "generate", "id": "new", **frame, "replaces": frame.get("replaces", "old")})
        await raw.until(lambda: "new" in raw.ended and "old" in raw.ended)
        err = raw.ended["new"]
        assert err["type"] == "error" and err["code"] == code and says in err["message"], err
        assert raw.ended["old"]["finish_reason"] == "length"  # a refused replace aborts nothing
        await raw.ws.close()
