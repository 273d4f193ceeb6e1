"""Poison-pill detection: a query of death reaches at most two replicas, never the region.

A request a replica names as the cause of an engine failure (engine_fault) or
rejects as malformed is failed at once, never retried elsewhere; one that was on
two replicas when they died is failed rather than sent to a third. Bystanders
keep their failover."""

import pytest

from edge_proxy import protocol as pp
from edge_proxy.client import EdgeClient, EdgeError

from conftest import proxy_for, stubs

pytestmark = pytest.mark.anyio
POISON = ord("~")


def received(reps, marker: int) -> list[str]:
    """Ids of the stubs that were sent a prompt holding `marker`."""
    return [r.cfg.replica_id for r in reps if any(marker in g.prompt_ids for g in r.generates)]


async def test_engine_fault_is_not_retried_and_bystanders_finish():
    async with stubs("a", "b", "c", poison_token=POISON, poison_action="fault") as reps, proxy_for(reps) as p:
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            bystander = await c.generate(prompt="a long and harmless story", max_tokens=40, temperature=0)
            with pytest.raises(EdgeError) as e:
                await c.complete(prompt="kill ~ it", max_tokens=8)
            assert e.value.code == pp.INTERNAL and "engine fail" in str(e.value)
            text, done = await bystander.result()
            assert len(text) == 40 and done.failovers == 0
        assert len(received(reps, POISON)) == 1 and not p.proxy.metrics.failovers.values


async def test_a_replica_killer_is_failed_after_two_replicas():
    async with stubs("a", "b", "c", poison_token=POISON, poison_action="crash") as reps, proxy_for(reps) as p:
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            with pytest.raises(EdgeError) as e:
                await c.complete(prompt="kill ~ them all", max_tokens=8)
            assert e.value.code == pp.INTERNAL and "2 replicas" in str(e.value)
            assert len(received(reps, POISON)) == 2  # the third replica never saw it
            survivor = next(r for r in reps if r.conns)
            text, done = await c.complete(prompt="still serving?", max_tokens=5)
            assert done.replica == survivor.cfg.replica_id and len(text) == 5
        assert not p.proxy.streams
