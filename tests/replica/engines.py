"""The plain engine on the tiny random Llama, shared by the engine tests
(test_engine, test_overlap, test_containment, test_sampling_params): build it,
make prompts, step it until idle."""

import random

from wire import protocol as P
from replica.config import EngineConfig
from replica.engine.llm_engine import LLMEngine
from tests.replica.tiny import tiny_config, tiny_weights


def make_engine(cfg=None, w=None, **kw):
    cfg = cfg or tiny_config()
    w = w if w is not None else tiny_weights(cfg)
    ecfg = dict(num_blocks=64, block_size=16, max_num_batched_tokens=24, max_num_seqs=8)
    ecfg.update(kw)
    return LLMEngine(EngineConfig(**ecfg), cfg, w), cfg, w


def run(engine, check=None):
    """Step until idle; returns {id: generated ids}, {id: Finished}."""
    toks, fins = {}, {}
    while engine.has_work():
        out, logits = engine.step(return_logits=True)
        if check:
            check(logits, toks)
        for m in out:
            toks.setdefault(m.id, []).extend(m.ids)
            if isinstance(m, P.Finished):
                fins[m.id] = m
    engine.blocks.check_invariants()
    return toks, fins


def prompts(n_list, seed=0, vocab=97):
    rng = random.Random(seed)
    return {f"s{i}": [rng.randrange(1, vocab) for _ in range(n)] for i, n in enumerate(n_list)}
