"""Rejection sampling through the engine: with sampled drafts (EAGLE-3 chains drawn
from the head's q, spec_sample) the joint law of the tokens a request emits is the
target's own, checked by chi-square against the exact law of a tiny target over
many seeds; the same check rejects an engine whose acceptance rule is biased."""

import itertools

import pytest
import torch

from kernels.sampling import probs_ref
from replica.engine import speculation
from replica.config import EngineConfig
from replica.engine.llm_engine import LLMEngine
from speculative.tree_spec import TreeSpec
from speculative.head import save_head
from speculative.policy import SpecPolicy
from tests.replica.reference import reference_logits
from tests.replica.tiny import tiny_config, tiny_weights
from tests.speculative.util import chi_square_rejects, random_head, tiny_target
from wire import protocol as P

VOCAB, TOP_K, L = 8, 3, 3  # a small vocabulary, top-3 sampling, 3 tokens per request: 27 cells
PROMPT = [5, 1, 3, 6, 2]
CFG = tiny_config(num_layers=4, vocab_size=VOCAB)


def sampling(seed: int) -> P.SamplingParams:
    return P.SamplingParams(max_tokens=L, temperature=1.0, top_k=TOP_K, seed=seed, ignore_eos=True)


def target_law() -> dict:
    """{first L tokens: probability} under top-3 sampling of the reference forward."""
    w = tiny_weights(CFG)

    def p(ids):
        logits = reference_logits(CFG, w, ids)[-1:]
        return probs_ref(logits, torch.tensor([1.0]), torch.tensor([TOP_K]), torch.tensor([1.0]))[0].tolist()

    law, first = {}, p(PROMPT)
    for a, b, c in itertools.product(range(VOCAB), repeat=L):
        if first[a] == 0:
            continue
        second = p(PROMPT + [a])
        if second[b] == 0:
            continue
        law[(a, b, c)] = first[a] * second[b] * p(PROMPT + [a, b])[c]
    return law


@pytest.fixture(scope="module")
def sampled_engine(tmp_path_factory):
    """Builds engines serving chain-2 drafts sampled from an untrained head at every batch size."""
    model = tiny_target(vocab_size=VOCAB)
    folder = save_head(random_head(model, draft_vocab=VOCAB), tmp_path_factory.mktemp("eagle3") / "head")
    SpecPolicy(((1, TreeSpec.chain(2)),), device="cpu").save(folder)

    def build():
        cfg = EngineConfig(speculative="eagle3", spec_head=str(folder), spec_sample=True, num_blocks=80,
                           max_num_seqs=64, max_num_batched_tokens=512)
        return LLMEngine(cfg, CFG, model=model, ops=model.ops)

    return build


def emitted(engine: LLMEngine, seeds: range) -> dict:
    for s in seeds:
        assert engine.add(P.Generate(id=str(s), prompt_ids=PROMPT, sampling=sampling(s))) is None
    out: dict = {}
    while engine.has_work():
        for m in engine.step():
            out.setdefault(m.id, []).extend(m.ids)
    counts: dict = {}
    for ids in out.values():
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
    return counts


def test_sampled_drafts_emit_the_target_law(sampled_engine):
    engine = sampled_engine()
    counts = emitted(engine, range(1200))
    assert sum(counts.values()) == 1200
    assert not chi_square_rejects(counts, target_law())
    st = engine.stats
    assert 0 < st.accepted < st.drafted  # both branches: drafts kept, drafts replaced from (p - q)+


def test_a_biased_acceptance_rule_is_caught(sampled_engine, monkeypatch):
    def accept_every_draft(tokens, q, p, seeds, root_pos):
        B, n = tokens.shape  # chains: keep them all, then draw the bonus from the last node
        bonus = torch.multinomial(p[:, -1], 1, generator=torch.Generator().manual_seed(int(seeds[0])))
        return torch.full((B,), n - 1), torch.arange(n).expand(B, n), torch.cat([tokens[:, 1:], bonus], 1)

    monkeypatch.setattr(speculation, "accept_sampling_chains", accept_every_draft)
    assert chi_square_rejects(emitted(sampled_engine(), range(300)), target_law())
