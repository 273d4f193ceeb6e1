"""The speculative loop end to end: with speculation on, greedy output is token
for token the output with it off (tiny random target, and the default model at
batch 1 and 8); rejected drafts' blocks go back to the pool; seeded sampling is
reproducible."""

import pytest

from wire import protocol as P
from replica.config import EngineConfig
from replica.engine import LLMEngine
from wire.protocol import SamplingParams
from speculative.decode import SpeculativeGenerator
from speculative.drafting import TreeSpec
from speculative.ngram import NgramDrafter
from tests.speculative.util import OracleDrafter, random_head, tiny_target

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 3, 88, 41], [7] * 20, list(range(10, 40)), [60, 61, 62, 60, 61, 62, 60]]
SPECS = [TreeSpec.chain(3), TreeSpec(depth=4, top_k=3, budget=10), TreeSpec(depth=5, top_k=4, budget=20),
         NgramDrafter(k=4, min_n=1)]


@pytest.fixture(scope="module")
def tiny():
    model = tiny_target()
    gen = SpeculativeGenerator(model, random_head(model), num_blocks=96)
    base, _ = gen.generate(PROMPTS, GREEDY)
    return model, gen, base


def test_plain_loop_is_the_engine(tiny):
    model, gen, base = tiny
    engine = LLMEngine(EngineConfig(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64), model.cfg,
                       model=model, ops=model.ops)
    for i, p in enumerate(PROMPTS):
        engine.add(P.Generate(id=str(i), prompt_ids=p, sampling=GREEDY))
    out = {}
    while engine.has_work():
        for m in engine.step():
            out.setdefault(m.id, []).extend(m.ids)
    assert [out[str(i)] for i in range(len(PROMPTS))] == base


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_greedy_identical_with_speculation(tiny, spec):
    _, gen, base = tiny
    assert gen.generate(PROMPTS, GREEDY, spec)[0] == base  # batch 4
    assert gen.generate(PROMPTS[1:2], GREEDY, spec)[0] == base[1:2]  # batch 1
    assert len(gen.pool.free_blocks) == gen.pool.num_blocks  # every block came back


def test_oracle_drafts_accept_long_paths_off_the_first_branch(tiny):
    _, gen, base = tiny
    oracle = OracleDrafter([p + b for p, b in zip(PROMPTS, base)], depth=5)
    out, stats = gen.generate(PROMPTS, GREEDY, oracle)
    assert out == base
    assert stats.tau > 3.0  # long accepted paths, KV moved down from the second branch
    assert len(gen.pool.free_blocks) == gen.pool.num_blocks


def test_stops_and_max_tokens_cut_accepted_drafts(tiny):
    model, gen, base = tiny
    oracle = OracleDrafter([p + b for p, b in zip(PROMPTS, base)], depth=5)
    stop = base[0][6]
    sp = SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    plain, _ = gen.generate(PROMPTS, sp)
    out, _ = gen.generate(PROMPTS, sp, oracle)
    assert out == plain and out[0] == base[0][: base[0].index(stop) + 1] and all(len(o) <= 13 for o in out)


@pytest.mark.parametrize("spec", [TreeSpec.chain(3, sample=True), TreeSpec(depth=4, top_k=3, budget=10),
                                  NgramDrafter(k=4, min_n=1)], ids=str)
def test_seeded_sampling_is_reproducible(tiny, spec):
    _, gen, _ = tiny
    sp = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True) for s in range(4)]
    a, _ = gen.generate(PROMPTS, sp, spec)
    b, _ = gen.generate(PROMPTS, sp, spec)
    assert a == b and all(len(x) == 24 for x in a)


@pytest.fixture(scope="module")
def default_model():
    import kernels
    from replica.loader import load_checkpoint
    from replica.runner import build_model

    ck = load_checkpoint("default")
    model = build_model(ck.config, EngineConfig(), ck.weights, kernels.ops("cpu"), 1024)
    prompts = [ck.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in (
        "What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
        "Explain recursion in one sentence.", "Say hello in Spanish.", "What is 2 + 2?",
        "Name a famous painter.", "Write a Python function that adds two numbers.")]
    return model, prompts


def test_default_model_greedy_identical_at_batch_1_and_8(default_model):
    model, prompts = default_model
    gen = SpeculativeGenerator(model, random_head(model, draft_vocab=2048), num_blocks=128)
    sp = SamplingParams(max_tokens=20, temperature=0.0)
    base, _ = gen.generate(prompts, sp)
    oracle = OracleDrafter([p + b for p, b in zip(prompts, base)], depth=4, vocab=model.cfg.vocab_size)
    for spec in (TreeSpec(depth=3, top_k=2, budget=6), oracle):
        assert gen.generate(prompts, sp, spec)[0] == base  # batch 8
    assert gen.generate([prompts[7]], sp, TreeSpec.chain(3))[0] == [base[7]]  # batch 1
    assert gen.generate([prompts[7]], sp, oracle)[0] == [base[7]]
