"""One region, two proxies over the same replica stubs (issue 44): a conversation's turns
alternating between the proxies go to one replica (its home, learned from the replicas' KV
events, not from either proxy's memory), and new conversations spread evenly over the replicas
(by the conversations each holds, `Load.chains`)."""

import asyncio
import random

import pytest

from edge_proxy import protocol as pp
from edge_proxy.client import EdgeClient

from conftest import stubs, two_proxies

pytestmark = pytest.mark.anyio
WORDS = "river stone lamp orchard violin harbor meadow copper lantern thistle compass ember".split()


def system_prompt(k: int) -> dict:
    rng = random.Random(k)
    return {"role": "system", "content": " ".join(rng.choice(WORDS) for _ in range(40))}


async def conversations(proxies, session: bool, n_conv: int = 12, turns: int = 4, at_once: int = 6,
                        spread: str = "alternate") -> dict[tuple[int, int], pp.Done]:
    """`n_conv` conversations of `turns` turns, `at_once` at a time; turn n of conversation
    k goes to proxy (k + n) mod 2 ("alternate") or a seeded random one."""
    gate = asyncio.Semaphore(at_once)
    done: dict[tuple[int, int], pp.Done] = {}
    clients = [await EdgeClient.connect(p.ws_url, api_key="sk-alice") for p in proxies]
    rng = random.Random(7)

    async def conversation(k: int) -> None:
        msgs = [system_prompt(k)]
        async with gate:
            for n in range(turns):
                msgs = msgs + [{"role": "user", "content": f"question {n} of conversation {k}"}]
                c = clients[(k + n) % 2 if spread == "alternate" else rng.randrange(2)]
                text, d = await c.complete(messages=msgs, max_tokens=24, session=f"conv-{k}" if session else None)
                done[(k, n)] = d
                msgs = msgs + [{"role": "assistant", "content": text}]

    try:
        await asyncio.gather(*(conversation(k) for k in range(n_conv)))
    finally:
        for c in clients:
            await c.close()
    return done


@pytest.mark.parametrize("session", [False, True], ids=["no-session", "session"])
@pytest.mark.parametrize("spread", ["alternate", "random"])
async def test_turns_alternating_between_two_proxies_stay_on_their_replica(session, spread):
    async with stubs("a", "b", "c", max_running=1) as reps, two_proxies(reps) as proxies:
        done = await conversations(proxies, session, spread=spread)
    for k in range(12):
        served = {done[(k, n)].replica for n in range(4)}
        assert len(served) == 1, (k, [done[(k, n)].replica for n in range(4)])
        assert all(done[(k, n)].usage.cached_tokens > 0 for n in range(1, 4))
    # Conversations 5/4/3 at worst: the replicas count the conversations they hold (Load.chains) and the
    # proxies place new ones where fewer are, but two placements through two proxies within one network hop
    # (before either's Load reaches the other) can still meet; 4/4/4 in about 22 of 24 runs here (by blocks
    # held, 3 of 8); the goal's statistics are bench/routing.py's (docs/perf.md)
    per = [sum(d.replica == r for d in done.values()) for r in "abc"]
    assert sum(per) == 48 and max(per) - min(per) <= 8, per


async def test_a_session_id_stays_its_keys_on_every_proxy():
    """Bob naming Alice's session id on the other proxy gets a session of his own there
    (namespaced by key: `placement_key`), and Alice's next turn through that proxy is hers
    still: served, on her replica, cached. (Before issue 44 that proxy bound the id to Bob,
    the first key it saw use it, and refused Alice `forbidden`.)"""
    async with stubs("a", "b", "c") as reps, two_proxies(reps) as (p1, p2):
        alice = [await EdgeClient.connect(p.ws_url, api_key="sk-alice") for p in (p1, p2)]
        bob = await EdgeClient.connect(p2.ws_url, api_key="sk-bob")
        try:
            msgs = [system_prompt(1), {"role": "user", "content": "hello"}]
            text, first = await alice[0].complete(messages=msgs, max_tokens=24, session="shared")
            _, other = await bob.complete(messages=msgs, max_tokens=24, session="shared")
            assert other.usage.cached_tokens == 0  # another tenant's salt: nothing of Alice's is his
            msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "and then?"}]
            _, again = await alice[1].complete(messages=msgs, max_tokens=4, session="shared")
            assert again.replica == first.replica and again.usage.cached_tokens > 0
        finally:
            for c in alice + [bob]:
                await c.close()
