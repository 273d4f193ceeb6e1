"""The speculating engine's tiny target (four layers: the head's three feature layers
are distinct) and its drafters, shared by test_speculative_engine and
test_grammar_speculative; the random EAGLE-3 head is the `head_path` fixture
(tests/replica/conftest.py)."""

from replica.config import EngineConfig
from replica.engine.llm_engine import LLMEngine
from tests.replica.tiny import tiny_config, tiny_weights

CFG = tiny_config(num_layers=4)  # four layers: the head's three feature layers are distinct
W = tiny_weights(CFG)
DRAFTERS = {
    "ngram": dict(speculative="ngram", spec_depth=4),
    "eagle3-chain": dict(speculative="eagle3", spec_depth=3),
    "eagle3-tree": dict(speculative="eagle3", spec_depth=4, spec_top_k=3, spec_budget=10),
}


def engine(spec=None, head=None, tokenizer=None, **kw):
    ecfg = dict(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=40, spec_max_batch=16)
    ecfg.update(DRAFTERS[spec] if spec else {})
    if spec and spec.startswith("eagle3"):
        ecfg["spec_head"] = head
    ecfg.update(kw)
    return LLMEngine(EngineConfig(**ecfg), CFG, W, tokenizer=tokenizer)
