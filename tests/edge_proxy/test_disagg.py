"""Prefill/decode disaggregation (edge_proxy.disagg) on real default-model replicas: a prefill
replica P and a decode replica D behind one proxy (disagg_stack). A cold prompt is computed on P,
pulled by D and streamed from D: greedy output token for token that of colocated serving (D alone,
under another salt), D's usage counts the prompt's usable full blocks as cached, P's pool holds
them, byte for byte the KV D computes itself for that prompt, and P sampled nothing but its one
prefill token. A pull that fails (P's exports cut) and a stopped P
fall back to colocated serving on D, exactly, nothing cached."""

from __future__ import annotations

import httpx
import pytest

from replica.tokenizer import Tokenizer
from tests.edge_proxy.disagg_stack import anonymous_salt, export, stack
from tests.replica.server import AUTH, scrape, stop_group


def proxy_metrics(url: str) -> dict[str, float]:
    """The proxy's /metrics values by name and labels."""
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))}


def export_block_bytes(url: str) -> int:
    return httpx.get(url + "/v1/kv/spec", headers=AUTH, timeout=10).json()["block_bytes"]

pytestmark = pytest.mark.timeout(400)
BLOCK = 16
MAX_TOKENS = 16
PROMPT = 160  # tokens: whole blocks (the last one recomputed on D), over INT8_PROMPT_TOKENS (int8 prompt rows)
USABLE = (PROMPT - 1) // BLOCK * BLOCK  # the tokens D's cache can serve
TEXT = (" lighthouse keeper kept a logbook of every ship that passed the rocky point, the weather each "
        "morning, the colour of the sea at dusk, and the names of the gulls that nested on the lamp room roof. "
        "Every spring the keeper painted the iron railings white again and counted the cracked panes of glass "
        "in the tall windows. "
        "One winter night a small boat with no lights drifted toward the rocks, and")


@pytest.fixture(scope="module")
def disagg():
    with stack() as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_spec("default")


def complete(url: str, ids: list[int], **extra) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, **extra},
                   headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def colocated(d_url: str, ids: list[int]) -> str:
    """D's own greedy answer, computed whole there (a salt of its own: no block of the proxy's run is reused)."""
    out = complete(d_url, ids, cache_salt="colocated")
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    return out["choices"][0]["text"]


def prompt(tokenizer, opening: str) -> list[int]:
    ids = tokenizer.encode(opening + TEXT + TEXT)[:PROMPT]
    assert len(ids) == PROMPT
    return ids


def test_a_cold_prompt_is_prefilled_on_the_prefill_replica_and_streamed_from_the_decode_one(disagg, tokenizer):
    url, reps, _ = disagg
    (p_url, _), (d_url, _) = reps["P"], reps["D"]
    ids = prompt(tokenizer, "The old")
    p_generated = scrape(p_url).get("edgechat_replica_generation_tokens_total", 0.0)
    out = complete(url, ids)
    assert out["choices"][0]["text"] == colocated(d_url, ids)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == USABLE  # every usable block pulled from P
    pulled = export(p_url, ids[:USABLE], anonymous_salt())  # P's pool holds them ...
    assert len(pulled) == USABLE // BLOCK * export_block_bytes(d_url)
    assert export(d_url, ids[:USABLE], anonymous_salt()) == pulled  # ... D the same bytes ...
    assert export(d_url, ids[:USABLE], "colocated") == pulled  # ... those D computed itself for the prompt
    assert scrape(p_url).get("edgechat_replica_generation_tokens_total", 0.0) - p_generated == 1  # its prefill's only
    m = proxy_metrics(url)
    assert m['edgechat_proxy_disagg_total{outcome="pulled"}'] == 1
    assert m["edgechat_proxy_disagg_blocks_total"] == USABLE // BLOCK


def test_a_failed_pull_falls_back_to_colocated_serving(disagg, tokenizer):
    url, reps, relay = disagg
    ids = prompt(tokenizer, "A young")
    relay.armed = True
    try:
        out = complete(url, ids)
    finally:
        relay.armed = False
    assert relay.cut == 1, "D never tried to pull from P"
    assert proxy_metrics(url)['edgechat_proxy_disagg_total{outcome="fallback"}'] == 1
    assert out["choices"][0]["text"] == colocated(reps["D"][0], ids)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # D computed it all


def test_a_stopped_prefill_replica_falls_back_to_colocated_serving(disagg, tokenizer):
    url, reps, _ = disagg
    stop_group(reps["P"][1])
    ids = prompt(tokenizer, "A weary")
    out = complete(url, ids)
    assert out["choices"][0]["text"] == colocated(reps["D"][0], ids)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert httpx.get(url + "/healthz", timeout=5).json()["prefill_ready"] == 0
